"""The run around the step: resume, evaluations at their times, checkpoints, stops, the summary.

`train(trainer)` is `Trainer.train`: resume if asked, push the weights, evaluate (test split, greedy and
sampled) and validate, then the steps, each logged, with an evaluation every `trainer.eval_every` steps
(validation when a validation split is held out) and a checkpoint every `trainer.checkpoint_every`; then
the last checkpoint, validation, the final policy as a Hugging Face folder `export/`, evaluation and the
run's files (`trainer_eval.write_summary`).

A SIGTERM/SIGINT (`cppo_jax.stopping`) stops at the next step boundary with a checkpoint; a rollout-server
failure stops with a checkpoint of the last finished update (`guarded_step`).
"""

from __future__ import annotations

import gc

from cppo_jax import trainer_eval
from cppo_jax.export import ADAPTER_DIR, EXPORT_DIR, export_policy
from cppo_jax.models.peft_io import save_adapter
from cppo_jax.rollout.vllm_client import RolloutServerError
from cppo_jax.stopping import SignalStopError, StopSignals


def train(trainer, progress=None) -> dict:
    """The whole run: resume if asked, evaluate, train, checkpoint, evaluate; returns a summary."""
    trainer.maybe_resume()
    trainer.backend.sync_weights(trainer.policy_params(), trainer.start_step)
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
    with StopSignals() as stop:  # SIGTERM/SIGINT: checkpoint and stop (cppo_jax.stopping)
        before = trainer.evaluate(trainer.start_step, sampled=True)
        trainer_eval.validate(trainer, trainer.start_step)
        for step in range(trainer.start_step, trainer.num_steps):
            stop_if_asked(trainer, stop, step)
            with trainer.tracer.step(step + 1):
                metrics = guarded_step(trainer, step)
            trainer.log.metrics(metrics)
            if progress is not None:
                progress(metrics)
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < trainer.num_steps:
                if trainer.val_set is not None:
                    trainer_eval.validate(trainer, done)
                else:
                    trainer.evaluate(done)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                trainer.save(done)
        if trainer.ckpt.latest_step() != trainer.num_steps:
            trainer.save(trainer.num_steps)
        stop_if_asked(trainer, stop, trainer.num_steps)
    trainer_eval.validate(trainer, trainer.num_steps)
    export_policy(
        trainer.graphdef,
        trainer.policy_params(),
        trainer.cfg,
        trainer.out_dir / EXPORT_DIR,
        trainer.model_path,
        cppo_step=trainer.num_steps,
    )
    if trainer.frozen is not None:  # LoRA: the adapters alone too, as PEFT saves them
        save_adapter(
            trainer.params, trainer.model_cfg, trainer.out_dir / ADAPTER_DIR, trainer.model_path
        )
    after = trainer.evaluate(trainer.num_steps, sampled=True)
    table = trainer_eval.write_summary(trainer, before, after)
    return {"before": before, "after": after, "steps": trainer.num_steps, "phases": table}


def stop_if_asked(trainer, stop: StopSignals, step: int) -> None:
    """After SIGTERM/SIGINT (see `cppo_jax.stopping`): checkpoint `step` and raise `SignalStopError`."""
    if stop.requested is None:
        return
    if trainer.ckpt.latest_step() != step:
        trainer.save(step)
    trainer.log.event("stopped", step=step, signal=stop.name)
    raise SignalStopError(
        stop.requested,
        step,
        f"stopped by {stop.name} after step {step}; checkpoint of step {step} saved under "
        f"{trainer.ckpt.directory} (resume with trainer.resume=true)",
    )


def guarded_step(trainer, step: int) -> dict:
    """`step`, saving a checkpoint before a rollout-server failure propagates."""
    try:
        return trainer.step(step)
    except RolloutServerError as e:
        done = max(step, trainer.params_step)
        trainer.save(done)
        trainer.log.event("rollout_server_error", step=done, error=str(e))
        raise RolloutServerError(
            f"{e} -- stopped; checkpoint of step {done} saved under {trainer.ckpt.directory} "
            f"(resume with trainer.resume=true once the server is back)"
        ) from e
