"""The CPPO trainer: set-up, and one step in the order of the paper.

One step (`Trainer.step`):
  1. Draw Q questions (Q = floor(b / (1 - p)) with allocation, else b; GRESO skipping: `skipping`).
  2. Roll out G completions each from the current policy.
  3. Score every completion (host reward workers).
  4. Group advantages.
  5. Keep k = floor(G (1 - p)) completions per question by |A| (a static-shape top-k).
  6. Reference (beta > 0) and sampler (tis_cap) log-probs of the kept completions.
  7. mu policy updates on the kept completions, one compiled program; with mu > 1 the first one's
     forward gives the old policy's log-probs for the others (a stale rollout's come from its own
     pass in 6; where each comes from: `logp_sources`).
Nothing is computed for a pruned completion after its reward. p = 0 is plain GRPO on the same path.

With `rollout.overlap = 1` (vLLM backend) step n+1's rollout is produced while step n trains, one update
stale, with exact old-policy log-probs (`rollout.overlap`). Steps 1-2 are `rollout.draw`'s, step 3 on
the host `scoring`'s, steps 4-5 `cppo.prune`, 6-7 `step`'s compiled functions. The run around the steps
(resume, evaluations, checkpoints, stops) is `trainer_run`'s; evaluation and validation `trainer_eval`'s.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax import (
    cppo,
    distributed,
    pipeline,
    programs,
    scoring,
    selection,
    trainer_eval,
    trainer_run,
)
from cppo_jax import profile as prof
from cppo_jax import sharding as sharding_lib
from cppo_jax import skipping as skip_lib
from cppo_jax import step as step_lib
from cppo_jax.checkpoint import Checkpointer, CheckpointError, holds_a_run, set_aside_earlier_run
from cppo_jax.config import Config, ConfigError
from cppo_jax.config_io import save_config
from cppo_jax.models import Tokenizer, load_hf
from cppo_jax.models import lora_state as lora_lib
from cppo_jax.models.transformer import forward_copy
from cppo_jax.packed_rows import Packer
from cppo_jax.rewards.pool import RewardPool
from cppo_jax.rewards.registry import TASK_EVAL, display_name
from cppo_jax.rollout.backend import make_backend
from cppo_jax.rollout.draw import StepRollout, draw_rollout
from cppo_jax.rollout.overlap import Overlap
from cppo_jax.runlog import RunLog, wandb_settings


def check_vocab(tokenizer: Tokenizer, model_vocab: int, model_path: str) -> None:
    """Refuse a tokenizer with ids the model has no embedding for (the model may have more rows)."""
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids but the model {model_path} "
            f"has vocab_size {model_vocab}: they do not belong together (check model.tokenizer and "
            f"model.path / model.init_checkpoint)"
        )


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row; the last good state was saved."""


def _block(x):
    return jax.block_until_ready(x)


class Trainer:
    def __init__(self, cfg: Config, model_path: str | Path | None = None):
        self.cfg = cfg
        self.out_dir = Path(cfg.trainer.out_dir).resolve() / cfg.trainer.run_name
        self.earlier_run = None  # where an earlier run in this folder was moved (a fresh run)
        if not cfg.trainer.resume and holds_a_run(self.out_dir):
            if jax.process_count() > 1:  # the processes share the folder: none may move it alone
                raise ConfigError(
                    f"run folder {self.out_dir} holds an earlier run: set trainer.resume=true to "
                    "continue it, or choose another trainer.run_name"
                )
            self.earlier_run = set_aside_earlier_run(self.out_dir)
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"config key 'trainer.out_dir' = {cfg.trainer.out_dir!r}: cannot create the run "
                f"folder {self.out_dir}: {type(e).__name__}: {e.strerror or e}"
            ) from e
        self.main = distributed.is_main()  # process 0 writes logs and exports
        if self.main:
            save_config(cfg, self.out_dir / "config.json")
        self.shapes = cppo.shapes_of(cfg)
        path = str(model_path or cfg.model.init_checkpoint or cfg.model.path)
        self.model_path = path  # the HF folder the run starts from (exports keep its fields)
        self.tokenizer = Tokenizer.from_dir(cfg.model.tokenizer or path)
        # The mesh: questions split whole over (data, fsdp); params sharded by the rules.
        self.mesh = sharding_lib.make_mesh(cfg.mesh)
        sharding_lib.check_questions(self.shapes.Q, self.mesh)
        model = load_hf(
            path,
            dtype=cfg.model.dtype,
            mesh=self.mesh,
            param_dtype=cfg.model.param_dtype,
            remat=cfg.model.remat,
            scan_layers=cfg.model.scan_layers,
            attention=cfg.model.attention,
        )
        check_vocab(self.tokenizer, model.cfg.vocab_size, path)
        # `graphdef` is the model without adapters: the sampler's, evaluation's and exports' (with
        # LoRA they get merged weights, `policy_params`); `train_graphdef` the trained model's.
        self.frozen = None  # LoRA: the base, frozen in the compute dtype (`lora_lib.split`)
        self.graphdef, params = nnx.split(model)
        self.train_graphdef = self.graphdef
        self.ref_params = None  # the reference policy: forwards only, so in the compute dtype
        if cfg.model.lora.enabled:  # params: the adapters; the reference: the base alone
            model = lora_lib.with_adapters(model, cfg.model.lora, seed=cfg.trainer.seed)
            self.train_graphdef, params, base = lora_lib.split(model)
            params = sharding_lib.shard_params(params, self.mesh)
            self.frozen = lora_lib.cast(base, model.cfg.compute_dtype)
            del base
        elif cfg.cppo.beta > 0:
            self.ref_params = forward_copy(params, model.cfg.compute_dtype)
        self.params = params
        self.model_cfg = model.cfg

        # Data.
        sets = pipeline.load_prompt_sets(
            cfg.data, self.tokenizer, self.shapes.P, cfg.trainer.eval_size
        )
        self.train_set, self.val_set, self.test_set = sets.train, sets.val, sets.test
        self.data_stats = sets.stats  # skipped rows, cut prompts
        self.best_val: float | None = None
        self.order = pipeline.question_order(
            len(self.train_set), self.shapes.Q, cfg.data.seed, cfg.data.shuffle
        )
        self.skipper = skip_lib.PromptSkipper.from_config(
            cfg.data, len(self.train_set), self.shapes.Q
        )
        self.num_steps = cfg.trainer.steps or pipeline.steps_per_epoch(
            len(self.train_set), self.shapes.Q
        )

        # Device functions.
        self.sp = programs.sampling_params(
            cfg, self.shapes, self.tokenizer.stop_ids, self.tokenizer.pad_id
        )
        if cfg.rollout.overlap and jax.process_count() > 1:
            # The background rollout would run process 0's broadcasts beside the step's collectives.
            raise ConfigError(
                f"config key 'rollout.overlap' = 1 is not supported with {jax.process_count()} "
                "trainer processes yet; use rollout.overlap=0"
            )
        self.backend = make_backend(
            cfg.rollout, self.graphdef, self.sp, self.out_dir, mesh=self.mesh
        )
        self.tx = step_lib.make_optimizer(cfg.optim, self.num_steps * cfg.cppo.mu)
        self.lr_fn = step_lib.lr_schedule(cfg.optim, self.num_steps * cfg.cppo.mu)
        self.opt_state = sharding_lib.init_opt_state(self.tx, self.params, self.mesh)
        self.spec = programs.step_spec(cfg, self.shapes)
        self.sources = programs.logp_sources(cfg)  # where the old and behaviour log-probs come from
        self.train_step, self.logps = step_lib.compiled(
            self.train_graphdef,
            self.tx,
            self.spec,
            mesh=self.mesh,
            params=self.params,
            rows=self.shapes.M,
            frozen=self.frozen,
        )
        self.packer = None  # trainer.pack: the kept sequences trained in packed rows
        if cfg.trainer.pack:
            self.packer = Packer.make(cfg.trainer, self.shapes, self.graphdef, self.spec, self.mesh)
        self._merge = None
        if self.frozen is not None:  # the base's log-probs (adapters off): the reference's
            _, self._base_logps = step_lib.compiled(
                self.graphdef, self.tx, self.spec, self.mesh, self.frozen, self.shapes.M
            )
            self._merge = jax.jit(lora_lib.merge_weights, static_argnums=2)
            if hasattr(self.backend, "attach_lora"):  # vLLM: adapter pushes, rollout.lora_push
                self.backend.attach_lora(self.train_graphdef, self.frozen, lambda: self.params)

        # Rewards (the training ones, plus each evaluation rule, run only when evaluating), logs, checkpoints.
        # Metrics name a reward by its registered name, else by its function's name (as TRL).
        funcs = [(display_name(f), w, f) for f, w in zip(cfg.reward.funcs, cfg.reward.weights)]
        self.train_fns = [name for name, _, _ in funcs]
        self.eval_rules = {f"eval/{rule}": fn for rule, fn in TASK_EVAL[cfg.data.task].items()}
        self.rewards = RewardPool(
            funcs + [(name, 0.0, fn) for name, fn in self.eval_rules.items()],
            num_workers=cfg.reward.num_workers,
            timeout_s=cfg.reward.timeout_s,
        )
        self.accuracy_fn = pipeline.ACCURACY_REWARD[cfg.data.task]
        self.log = RunLog(
            self.out_dir,
            tensorboard=cfg.logging.tensorboard,
            write=self.main,
            wandb=wandb_settings(cfg) if cfg.logging.wandb else None,
        )
        if self.earlier_run is not None:
            self.log.event("earlier_run_moved", to=str(self.earlier_run))
        self.log.event("data", train=len(self.train_set), **self.data_stats)  # skipped, cut prompts
        self.ckpt = Checkpointer(self.out_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints)
        self.tracer = prof.Tracer(self.out_dir, cfg.trainer.profile_steps)
        self.start_step = 0
        self.params_step = 0  # the step the current params belong to
        self.nan_streak = 0
        self.num_tokens = 0  # prompt + completion tokens sampled so far (TRL's num_tokens)
        self.step_began: tuple[int, dict | None] = (0, None)  # set by each step (see `_skip`)
        self.evals: list[dict] = []
        self.overlap = None
        if cfg.rollout.overlap:
            self.overlap = Overlap(self._rollout, self.num_steps, model.cfg.compute_dtype)

    # ------------------------------------------------------------------------------------------

    def state(self) -> dict:
        """What a checkpoint holds: the trained params (with LoRA the adapters only) and their
        optimizer state."""
        return {"params": self.params, "opt_state": self.opt_state}

    def policy_params(self, params=None):
        """`params` (default: the current ones) as weights of `graphdef`, the model without
        adapters: themselves, or with LoRA the base with the adapters merged in (W + s A B, in the
        compute dtype), for the sampler, evaluation, weight pushes and exports."""
        params = self.params if params is None else params
        if self._merge is None:
            return params
        return self._merge(params, self.frozen, self.model_cfg)

    @property
    def frozen_args(self) -> tuple:
        """What `train_step` and `logps` take after their arguments: the frozen base with LoRA."""
        return () if self.frozen is None else (self.frozen,)

    def ref_logps(self, tokens_MT, valid_MT):
        """The reference policy's completion log-probs: the initial model's, which with LoRA is
        the base with the adapters off (no copy of it is kept)."""
        if self.frozen is None:
            return self.logps(self.ref_params, tokens_MT, valid_MT)
        return self._base_logps(self.frozen, tokens_MT, valid_MT)

    def save(self, step: int) -> None:
        """Checkpoint `step`; a failed write (full disk, unwritable folder) is logged and raised
        (`CheckpointError`), which stops the run: it never trains on without a way back."""
        meta = {
            "step": step,
            "seed": self.cfg.trainer.seed,
            "nan_streak": self.nan_streak,
            "num_tokens": self.num_tokens,
            "lora": self._lora_meta(),
        }
        if self.skipper is not None:
            meta["skipper"] = self.skipper.state_dict()
        try:
            self.ckpt.save(step, self.state(), meta)
        except CheckpointError as e:
            self.log.event("checkpoint_failed", step=step, error=str(e))
            raise

    def _lora_meta(self) -> dict | None:
        """What a checkpoint's params are: LoRA adapters of this rank, alpha and targets, or
        (None) a full model's weights."""
        lora = self.cfg.model.lora
        if not lora.enabled:
            return None
        return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}

    def maybe_resume(self) -> None:
        if not self.cfg.trainer.resume or self.ckpt.latest_step() is None:
            return
        held, want = self.ckpt.read_meta().get("lora"), self._lora_meta()
        if held != want:
            kind = lambda m: "a full run's weights" if m is None else f"LoRA adapters {m}"  # noqa: E731
            raise ConfigError(
                f"config key 'model.lora' does not match the checkpoint under {self.ckpt.directory}: "
                f"it holds {kind(held)}, this run trains {kind(want)}; resume with the run's own "
                "model.lora settings, or start a LoRA run from a full run's export/ folder "
                "(model.init_checkpoint) instead of its checkpoint"
            )
        state, meta = self.ckpt.restore(None, self.state())
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.start_step = self.params_step = int(meta["step"])
        self.nan_streak = int(meta.get("nan_streak", 0))
        self.num_tokens = int(meta.get("num_tokens", 0))
        skip_lib.resume(self.skipper, meta.get("skipper"), self.start_step)
        self.log.event("resumed", step=self.start_step)

    def _decode(self, tokens_NC: np.ndarray, valid_NC: np.ndarray) -> list[str]:
        return pipeline.decode_completions(self.tokenizer, tokens_NC, valid_NC)

    # ------------------------------------------------------------------------------------------

    def step(self, step: int) -> dict:
        """One CPPO step (see the module docstring); returns its metrics. With overlap, the step never
        returns (early, or by an error) while a generation it requested runs: see `rollout.overlap`."""
        try:
            return self._step(step)
        finally:
            if self.overlap is not None:
                self.overlap.settle()

    def _step(self, step: int) -> dict:
        cfg, sh = self.cfg, self.shapes
        t0 = time.perf_counter()
        times = {}
        # The counters as this step begins: what a stop on non-finite steps saves (`_skip`).
        self.step_began = (self.num_tokens, self.skipper and self.skipper.state_dict())

        # 1-2. Questions and their rollout (with overlap: requested during the previous step).
        if self.skipper is not None and self.overlap is not None:  # before this step's record:
            self.skipper.ids(step + 1)  # the one-step lag (skipping.py), at a fixed point
        with prof.phase("rollout", times):
            if self.overlap is not None:
                rollout, sample_params = self.overlap.take(self.params, step)
            else:
                rollout, sample_params = self._rollout(self.params, step), None
        batch, prompt_QP, pvalid_QP = rollout.batch, rollout.prompt_QP, rollout.pvalid_QP
        samples = rollout.samples
        tokens_NC, valid_NC = distributed.to_host((samples.tokens_NC, samples.valid_NC))

        # 3. Rewards: each process scores its own questions' completions; all get every reward.
        with prof.phase("reward", times):  # the training rewards, not the evaluation rules
            texts, total_N, per_fn, rstats = scoring.score_rollout(
                self.rewards, self.tokenizer, batch, tokens_NC, valid_NC, sh.G, self.train_fns
            )
        rewards_QG = total_N.reshape(sh.Q, sh.G)
        self.num_tokens += scoring.sampled_tokens(batch.valid_nP, valid_NC, sh.G)
        finished_N = distributed.to_host(samples.finished_N)
        metrics = scoring.rollout_metrics(
            rewards_QG, per_fn, rstats, valid_NC, finished_N, self.accuracy_fn, self.num_tokens
        )
        if cfg.cppo.filter_groups:
            metrics.update(selection.filter_counts(rewards_QG, sh.U))
        if cfg.rollout.overlap:
            metrics["rollout/staleness"] = float(sample_params is not None)  # updates behind
            metrics["rollout/generate_s"] = rollout.seconds
        try:
            cppo.check_rewards(rewards_QG)
        except ValueError as e:
            self.log.event("nonfinite_rewards", step=step, error=str(e))
            return self._skip(step, metrics, times, t0, reason=str(e))
        if self.skipper is not None:  # GRESO histories and p (skipping.py)
            correct = per_fn.get(self.accuracy_fn)
            metrics.update(
                self.skipper.record(step, rewards_QG, skip_lib.easy_of(rewards_QG, correct))
            )

        # 4-5. Advantages and pruning.
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.trainer.seed), step)
        pruned = cppo.prune(
            distributed.global_array(rewards_QG.astype(np.float32), self.mesh),
            key,
            prompt_QP,
            pvalid_QP,
            samples.tokens_NC,
            samples.valid_NC,
            samples.finished_N,
            samples.logp_NC if self.sources.behav == "sampler" else None,
            shapes=sh,
            algo=cfg.cppo,
            mesh=self.mesh,
        )
        tokens_MT, valid_MT = pruned.tokens_MT, pruned.valid_MT

        # 6. Reference log-probs, and the overlap snapshot's (the old policy's, or with cppo.tis_cap
        # the behaviour policy's: `logp_sources`), kept completions only. When the old policy is the
        # current one its log-probs come from the update's own forward, in the train step.
        src, ref, old, behav = self.sources, None, None, pruned.behav_logp_MC
        packed = None
        if self.packer is not None:
            packed = self.packer.batch(tokens_MT, valid_MT, pruned.mask_MC, pruned.adv_M)

        def logps(params):  # None: the reference's (with LoRA the base's forward, adapters off)
            if packed is not None:  # trainer.pack (refused with LoRA by the config)
                return _block(
                    self.packer.logps(self.ref_params if params is None else params, packed)
                )
            if params is None:
                return _block(self.ref_logps(tokens_MT, valid_MT))
            return _block(self.logps(params, tokens_MT, valid_MT, *self.frozen_args))

        with prof.phase("ref_logps", times):
            if cfg.cppo.beta > 0:
                ref = logps(None)
        with prof.phase("old_logps", times):
            if src.needs_snapshot:  # the params that sampled (one update behind after step 1)
                sampled_by = self.params if sample_params is None else sample_params
                snap = logps(sampled_by)
                old = snap if src.old == "snapshot" else None
                behav = snap if src.behav == "snapshot" else behav
        sample_params = sampled_by = None  # the snapshot that sampled: not kept through the update

        # 7. mu updates, one program; its metrics (the last update's) fetched once.
        if packed is None:
            train_batch = step_lib.Batch(
                tokens_MT, valid_MT, pruned.mask_MC, pruned.adv_M, old, ref, behav
            )
        else:
            train_batch = packed._replace(old_logp_MC=old, ref_logp_MC=ref, behav_logp_MC=behav)
        args = (self.params, self.opt_state, train_batch)  # before donating
        args += self.frozen_args
        self.tracer.dump_hlo_once(self.train_step, args, "train_step")
        with prof.phase("update", times):
            self.params, self.opt_state, m = self.train_step(*args)
            # Replicated (the program's out_shardings): each process's first shard is the whole value.
            m = jax.device_get(jax.tree.map(lambda x: x.addressable_data(0), m))
        self.params_step = step + 1
        if self.overlap is not None:  # the server must be idle before new weights go in
            times["rollout"] += self.overlap.wait()
        if (step + 1) % cfg.rollout.push_every == 0:
            with prof.phase("weight_sync", times):
                metrics.update(self.backend.sync_weights(self.policy_params(), step + 1))
        metrics.update({k: float(v) for k, v in m.items()})
        metrics["learning_rate"] = self._learning_rate()
        metrics.update(self._step_counts(pruned.mask_MC))
        if m["update_skipped"]:  # any of the mu updates
            self.log.event("nonfinite_update", step=step, loss=metrics.get("loss"))
            return self._skip(step, metrics, times, t0, reason="non-finite loss or gradient")
        self.nan_streak = 0
        return self._finish(step, metrics, times, t0, texts, batch)

    def _rollout(self, params, step: int) -> StepRollout:
        """Draw `step`'s questions and sample G completions each from `params`."""
        ids = self.order[step] if self.skipper is None else self.skipper.ids(step)
        seed, G = self.cfg.trainer.seed, self.shapes.G
        weights = self.policy_params(params)
        return draw_rollout(self.backend, weights, self.train_set, ids, step, seed, G, self.mesh)

    def _learning_rate(self) -> float:
        """The learning rate of the last update applied (TRL's `learning_rate`)."""
        applied = int(distributed.to_host(step_lib.update_count(self.opt_state)))
        return float(self.lr_fn(max(applied - 1, 0)))

    def _step_counts(self, mask_MC) -> dict:
        return {
            "cppo/questions": float(self.shapes.Q),
            "cppo/questions_trained": float(self.shapes.U),
            "cppo/kept": float(self.shapes.M),
            "cppo/tokens_trained": float(distributed.to_host(jnp.sum(mask_MC))),
        }

    def _finish(self, step, metrics, times, t0, texts, batch) -> dict:
        times["step"] = time.perf_counter() - t0
        metrics.update({f"timing_s/{k}": v for k, v in times.items()})
        metrics["step"] = step + 1
        compiled, loaded = prof.compilations()
        metrics["jit/compilations"] = float(compiled)
        metrics["jit/cache_hits"] = float(loaded)
        metrics["update_skipped"] = 0.0
        if (
            texts is not None
            and self.cfg.logging.samples_per_log
            and step % self.cfg.trainer.log_every == 0
        ):
            n = min(self.cfg.logging.samples_per_log, len(texts) // self.shapes.G)
            rows = [
                {"question": batch.examples[i]["question"], "completion": texts[i * self.shapes.G]}
                for i in range(n)
            ]
            self.log.samples(step + 1, rows)
        return metrics

    def _skip(self, step, metrics, times, t0, reason: str) -> dict:
        self.nan_streak += 1
        metrics = self._finish(step, metrics, times, t0, None, None)
        metrics["update_skipped"] = 1.0
        if self.nan_streak >= self.cfg.trainer.max_nan_streak:
            # Saved as `step` steps done: the params are the last good ones (skipped updates changed
            # nothing), the token count and the skipper as this step began, so a resumed run that
            # runs this step again does not count its tokens or record its questions twice.
            self.num_tokens, skipper_state = self.step_began
            if self.skipper is not None:
                self.skipper.load_state_dict(skipper_state)
            self.save(step)
            raise NonFiniteError(
                f"{self.nan_streak} non-finite steps in a row (last: {reason}) at step {step + 1}; "
                f"stopped with the last good state saved under {self.ckpt.directory} (step {step}). "
                f"Raise trainer.max_nan_streak to tolerate more."
            )
        return metrics

    # ------------------------------------------------------------------------------------------

    def evaluate(
        self, step: int, batch_size: int = 64, split: str = "test", sampled: bool = False
    ) -> dict:
        """Held-out accuracy of the current params (`trainer_eval.evaluate`), logged and kept in `evals`."""
        return trainer_eval.evaluate(self, step, batch_size, split, sampled)

    def train(self, progress=None) -> dict:
        """The whole run (`trainer_run.train`); returns a summary."""
        return trainer_run.train(self, progress)

    def close(self) -> None:
        if self.overlap is not None and not self.overlap.close():  # before the backend's client
            self.log.event("rollout_abandoned", wait_s=self.overlap.close_wait_s)
        self.tracer.close()
        self.rewards.close()
        self.backend.close()
        self.log.close()
        self.ckpt.close()
