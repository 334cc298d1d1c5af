"""The run around the step: resume, evaluations at their times, checkpoints, stops, the summary.

`train(trainer)` is `Trainer.train`: resume if asked, compile the first step's program (vLLM backend:
while the server may still be loading), push the weights, evaluate (a sample of the test split,
`trainer.eval_subset`, greedy and sampled) and validate, then the steps, each logged, with an evaluation
every `trainer.eval_every` steps (validation when a validation split is held out) and a checkpoint every
`trainer.checkpoint_every`; then the last checkpoint, validation, the final policy as a Hugging Face
folder `export/`, evaluation of the whole test split and the run's files (`evaluation.write_summary`).
`save` and `maybe_resume` write and read the checkpoints:
the trained state (`Trainer.state`) and the counters, the skipper's state and what the params are (LoRA
adapters or a full model's weights).

A SIGTERM/SIGINT (`cppo_jax.train.stopping`) stops at the next step boundary with a checkpoint; a rollout-server
failure stops with a checkpoint of the last finished update (`guarded_step`).
"""

from __future__ import annotations

import gc

from cppo_jax.config.choices import ConfigError
from cppo_jax.data import skipping as skip_lib
from cppo_jax.models.peft_io import save_adapter
from cppo_jax.rollout.vllm.client import RolloutServerError
from cppo_jax.train import evaluation
from cppo_jax.train.checkpoint import CheckpointError
from cppo_jax.train.export import ADAPTER_DIR, EXPORT_DIR, export_policy
from cppo_jax.train.stopping import SignalStopError, StopSignals
from cppo_jax.train.update import compile_ahead


def train(trainer, progress=None) -> dict:
    """The whole run: resume if asked, evaluate, train, checkpoint, evaluate; returns a summary."""
    trainer.maybe_resume()
    # What set-up built (data, tokenizer, model, caches) lives for the whole run: one full collection,
    # then out of the collector's sight until the run ends. Tracing and lowering allocate fast enough
    # to set off full collections, each a pass over all of it (a third of a second in the demo's first
    # step). Unfrozen at the end, so a process that trains again can still free this run's objects.
    gc.collect()
    gc.freeze()
    try:
        return _run(trainer, progress)
    finally:
        gc.unfreeze()


def _run(trainer, progress) -> dict:
    cfg = trainer.cfg.trainer
    # A rollout server started beside the trainer may still be loading: the first step's program is
    # compiled meanwhile, then the server is waited for and the weights pushed (a failed push is
    # checkpointed like one after a step). A signal during this wait ends the run at once, as no
    # handler is installed yet: nothing was trained, so nothing is lost.
    if trainer.cfg.rollout.backend == "vllm":
        trainer.host.log.event("compiled_ahead", **compile_ahead(trainer))
    trainer.rollout.wait_ready()
    guarded(trainer, trainer.start_step, lambda s: trainer.rollout.push(trainer.policy_params(), s))
    with StopSignals() as stop:  # SIGTERM/SIGINT: checkpoint and stop (cppo_jax.train.stopping)
        before = trainer.evaluate(trainer.start_step, sampled=True)
        evaluation.validate(trainer, trainer.start_step)
        for step in range(trainer.start_step, trainer.num_steps):
            stop_if_asked(trainer, stop, step)
            with trainer.host.tracer.step(step + 1):
                metrics = guarded_step(trainer, step)
            trainer.host.log.metrics(metrics)
            if progress is not None:
                progress(metrics)
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < trainer.num_steps:
                if trainer.data.val_set is not None:
                    evaluation.validate(trainer, done)
                else:
                    trainer.evaluate(done)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                trainer.save(done)
        if trainer.host.ckpt.latest_step() != trainer.num_steps:
            trainer.save(trainer.num_steps)
        stop_if_asked(trainer, stop, trainer.num_steps)
    evaluation.validate(trainer, trainer.num_steps)
    actor, out_dir = trainer.actor, trainer.host.out_dir
    export_policy(
        actor.graphdef,
        trainer.policy_params(),
        trainer.cfg,
        out_dir / EXPORT_DIR,
        actor.model_path,
        cppo_step=trainer.num_steps,
    )
    if actor.frozen is not None:  # LoRA: the adapters alone too, as PEFT saves them
        save_adapter(trainer.params, actor.model_cfg, out_dir / ADAPTER_DIR, actor.model_path)
    after = trainer.evaluate(trainer.num_steps, sampled=True, whole=True)  # as the paper scores
    table = evaluation.write_summary(trainer, before, after)
    return {"before": before, "after": after, "steps": trainer.num_steps, "phases": table}


def stop_if_asked(trainer, stop: StopSignals, step: int) -> None:
    """After SIGTERM/SIGINT (see `cppo_jax.train.stopping`): checkpoint `step` and raise `SignalStopError`."""
    if stop.requested is None:
        return
    if trainer.host.ckpt.latest_step() != step:
        trainer.save(step)
    trainer.host.log.event("stopped", step=step, signal=stop.name)
    raise SignalStopError(
        stop.requested,
        step,
        f"stopped by {stop.name} after step {step}; checkpoint of step {step} saved under "
        f"{trainer.host.ckpt.directory} (resume with trainer.resume=true)",
    )


def guarded_step(trainer, step: int) -> dict:
    """`step`, saving a checkpoint before a rollout-server failure propagates."""
    return guarded(trainer, step, trainer.step)


def guarded(trainer, step: int, fn):
    """`fn(step)`; on a rollout-server failure (a failed weight push included) the last finished
    update is checkpointed (unless it already is), logged, and the error raised naming it."""
    try:
        return fn(step)
    except RolloutServerError as e:
        done = max(step, trainer.params_step)
        if trainer.host.ckpt.latest_step() != done:
            trainer.save(done)
        trainer.host.log.event("rollout_server_error", step=done, error=str(e))
        raise RolloutServerError(
            f"{e} -- stopped; checkpoint of step {done} saved under {trainer.host.ckpt.directory} "
            f"(resume with trainer.resume=true once the server is back)"
        ) from e


def save(trainer, step: int) -> None:
    """Checkpoint `step`; a failed write (full disk, unwritable folder) is logged and raised
    (`CheckpointError`), which stops the run: it never trains on without a way back."""
    meta = {
        "step": step,
        "seed": trainer.cfg.trainer.seed,
        "nan_streak": trainer.nan_streak,
        "num_tokens": trainer.num_tokens,
        "dropped_stale": trainer.dropped_stale,
        "lora": lora_meta(trainer.cfg),
    }
    if trainer.data.skipper is not None:
        meta["skipper"] = trainer.data.skipper.state_dict()
    try:
        trainer.host.ckpt.save(step, trainer.state(), meta)
    except CheckpointError as e:
        trainer.host.log.event("checkpoint_failed", step=step, error=str(e))
        raise


def lora_meta(cfg) -> dict | None:
    """What a checkpoint's params are: LoRA adapters of this rank, alpha and targets, or
    (None) a full model's weights."""
    lora = cfg.model.lora
    if not lora.enabled:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}


def maybe_resume(trainer) -> None:
    """With `trainer.resume` and a checkpoint in the run folder: its state and counters."""
    ckpt = trainer.host.ckpt
    if not trainer.cfg.trainer.resume or ckpt.latest_step() is None:
        return
    held, want = ckpt.read_meta().get("lora"), lora_meta(trainer.cfg)
    if held != want:
        kind = lambda m: "a full run's weights" if m is None else f"LoRA adapters {m}"  # noqa: E731
        raise ConfigError(
            f"config key 'model.lora' does not match the checkpoint under {ckpt.directory}: "
            f"it holds {kind(held)}, this run trains {kind(want)}; resume with the run's own "
            "model.lora settings, or start a LoRA run from a full run's export/ folder "
            "(model.init_checkpoint) instead of its checkpoint"
        )
    state, meta = ckpt.restore(None, trainer.state())
    trainer.params, trainer.opt_state = state["params"], state["opt_state"]
    trainer.start_step = trainer.params_step = int(meta["step"])
    trainer.nan_streak = int(meta.get("nan_streak", 0))
    trainer.num_tokens = int(meta.get("num_tokens", 0))
    trainer.dropped_stale = int(meta.get("dropped_stale", 0))
    skip_lib.resume(trainer.data.skipper, meta.get("skipper"), trainer.start_step)
    trainer.host.log.event("resumed", step=trainer.start_step)
