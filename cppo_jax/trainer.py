"""The CPPO trainer: one step in the order of the paper, logging, evaluation, checkpoints.

One step (`Trainer.step`):
  1. Draw Q questions (Q = floor(b / (1 - p)) with allocation, else b).
  2. Roll out G completions each from the current policy.
  3. Score every completion (host reward workers).
  4. Group advantages.
  5. Keep k = floor(G (1 - p)) completions per question by |A| (a static-shape top-k).
  6. Reference log-probs (beta > 0) and old-policy log-probs (mu > 1) on the kept completions only.
  7. mu policy updates on the kept completions.
Nothing is computed for a pruned completion after its reward. p = 0 is plain GRPO on the same path.

With `rollout.overlap = 1` (vLLM backend) step n+1's rollout is requested from the server at the start of
step n, with the weights the server holds then (step n's), and runs while step n scores, prunes and
updates; the step waits for it before pushing its new weights. Step n+1 therefore trains on completions
sampled one update earlier, and its old-policy log-probs are those of the sampling weights (a copy kept
for the purpose), so the PPO ratio is exact. With overlap 0 nothing of this runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax import cppo, distributed, pipeline
from cppo_jax import profile as prof
from cppo_jax import sharding as sharding_lib
from cppo_jax import step as step_lib
from cppo_jax.checkpoint import Checkpointer, CheckpointError
from cppo_jax.config import Config, ConfigError
from cppo_jax.config_io import save_config
from cppo_jax.export import EXPORT_DIR, export_policy
from cppo_jax.models import Tokenizer, load_hf
from cppo_jax.rewards.pool import RewardPool
from cppo_jax.rewards.registry import TASK_EVAL, display_name
from cppo_jax.rollout import make_backend
from cppo_jax.runlog import RunLog, phase_table, plot_curves, reward_metrics, wandb_settings
from cppo_jax.sampler import SamplingParams
from cppo_jax.stopping import SignalStopError, StopSignals
from cppo_jax.vllm_client import RolloutServerError


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


@dataclasses.dataclass
class _Rollout:
    """One step's questions and their sampled completions."""

    step: int
    batch: pipeline.PromptSet
    prompt_QP: jax.Array
    pvalid_QP: jax.Array
    samples: object  # rollout.Samples
    seconds: float  # wall time of the generation itself


class Trainer:
    def __init__(self, cfg: Config, model_path: str | Path | None = None):
        self.cfg = cfg
        self.out_dir = Path(cfg.trainer.out_dir).resolve() / cfg.trainer.run_name
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
        self.model_path = (
            path  # the Hugging Face folder the run starts from (exports keep its fields)
        )
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
        )
        check_vocab(self.tokenizer, model.cfg.vocab_size, path)
        self.graphdef, params = nnx.split(model)
        self.params = params
        self.ref_params = jax.tree.map(jnp.copy, params) if cfg.cppo.beta > 0 else None

        # Data.
        train, train_stats = pipeline.load_examples(cfg.data, "train")
        train, val = pipeline.holdout_validation(cfg.data, train)
        test, _ = pipeline.load_examples(cfg.data, "test")
        enc = functools.partial(
            pipeline.encode_prompts,
            tokenizer=self.tokenizer,
            task=cfg.data.task,
            max_len=self.shapes.P,
            long_prompts=cfg.data.long_prompts,
            system_prompt=cfg.data.system_prompt,
            prompt_format=cfg.data.prompt_format,
        )
        self.train_set = enc(train)
        self.val_set = enc(val) if val else None
        self.best_val: float | None = None
        self.test_set = enc(test)
        if cfg.trainer.eval_size:
            self.test_set = self.test_set.take(np.arange(min(cfg.trainer.eval_size, len(test))))
        self.data_stats = {
            "bad_rows": train_stats.get("bad_rows", 0),
            "truncated": self.train_set.truncated,
        }
        self.order = pipeline.question_order(
            len(self.train_set), self.shapes.Q, cfg.data.seed, cfg.data.shuffle
        )
        self.num_steps = cfg.trainer.steps or pipeline.steps_per_epoch(
            len(self.train_set), self.shapes.Q
        )

        # Device functions.
        self.sp = SamplingParams(
            max_new_tokens=self.shapes.C,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            eos_id=self.tokenizer.stop_ids,
            pad_id=self.tokenizer.pad_id,
            cache_dtype=cfg.model.dtype,
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
        self.spec = step_lib.StepSpec.make(
            cfg.cppo,
            self.shapes.P,
            self.shapes.C,
            cfg.rollout.temperature,
            micro_batch=cfg.trainer.micro_batch,
        )
        self.train_step, self.logps = step_lib.compiled(
            self.graphdef,
            self.tx,
            self.spec,
            mesh=self.mesh,
            params=self.params,
            rows=self.shapes.M,
        )

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
        self.log.event("data", train=len(self.train_set), **self.data_stats)  # skipped, cut prompts
        self.ckpt = Checkpointer(self.out_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints)
        self.tracer = prof.Tracer(self.out_dir, cfg.trainer.profile_steps)
        self._hlo_dumped = False
        self.start_step = 0
        self.params_step = 0  # the step the current params belong to
        self.nan_streak = 0
        self.num_tokens = 0  # prompt + completion tokens sampled so far (TRL's num_tokens)
        self.evals: list[dict] = []
        self._pending = None  # overlap: (step, future of its _Rollout, the params sampling it)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------------------------------

    def state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state}

    def save(self, step: int) -> None:
        """Checkpoint `step`; a failed write (full disk, unwritable folder) is logged and raised
        (`CheckpointError`), which stops the run: it never trains on without a way back."""
        meta = {
            "step": step,
            "seed": self.cfg.trainer.seed,
            "nan_streak": self.nan_streak,
            "num_tokens": self.num_tokens,
        }
        try:
            self.ckpt.save(step, self.state(), meta)
        except CheckpointError as e:
            self.log.event("checkpoint_failed", step=step, error=str(e))
            raise

    def maybe_resume(self) -> None:
        if not self.cfg.trainer.resume or self.ckpt.latest_step() is None:
            return
        state, meta = self.ckpt.restore(None, self.state())
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.start_step = self.params_step = int(meta["step"])
        self.nan_streak = int(meta.get("nan_streak", 0))
        self.num_tokens = int(meta.get("num_tokens", 0))
        self.log.event("resumed", step=self.start_step)

    def _decode(self, tokens_NC: np.ndarray, valid_NC: np.ndarray) -> list[str]:
        return pipeline.decode_completions(self.tokenizer, tokens_NC, valid_NC)

    # ------------------------------------------------------------------------------------------

    def step(self, step: int) -> dict:
        """One CPPO step (see the module docstring); returns its metrics."""
        cfg, sh = self.cfg, self.shapes
        t0 = time.perf_counter()
        times = {}

        # 1-2. Questions and their rollout (with overlap: requested during the previous step).
        if cfg.rollout.overlap:
            with prof.phase("rollout", times):
                rollout, sample_params = self._take_rollout(step)
        else:
            with prof.phase("rollout", times):
                rollout, sample_params = self._rollout(self.params, step), None
        batch, prompt_QP, pvalid_QP = rollout.batch, rollout.prompt_QP, rollout.pvalid_QP
        samples = rollout.samples
        tokens_NC, valid_NC = distributed.to_host((samples.tokens_NC, samples.valid_NC))

        # 3. Rewards: each process scores its own questions' completions; all get every reward.
        with prof.phase("reward", times):
            own = distributed.local_slice(sh.Q)
            rows = slice(own.start * sh.G, own.stop * sh.G)
            texts = self._decode(tokens_NC[rows], valid_NC[rows])
            solutions = [ex["solution"] for ex in batch.examples[own] for _ in range(sh.G)]
            contexts = self._reward_contexts(batch, own, tokens_NC[rows], valid_NC[rows])
            only = self.train_fns  # not the evaluation rules
            total_N, per_fn, rstats = self.rewards.score(texts, solutions, only, contexts)
            total_N = distributed.gather_rows(np.asarray(total_N, np.float64))
            per_fn = {k: distributed.gather_rows(np.asarray(v)) for k, v in sorted(per_fn.items())}
        rewards_QG = total_N.reshape(sh.Q, sh.G)
        metrics = self._reward_metrics(
            rewards_QG, per_fn, rstats, valid_NC, samples, batch.valid_nP
        )
        if cfg.rollout.overlap:
            metrics["rollout/staleness"] = float(sample_params is not None)  # updates behind
            metrics["rollout/generate_s"] = rollout.seconds
        try:
            cppo.check_rewards(rewards_QG)
        except ValueError as e:
            self.log.event("nonfinite_rewards", step=step, error=str(e))
            return self._skip(step, metrics, times, t0, reason=str(e))

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
            shapes=sh,
            algo=cfg.cppo,
            mesh=self.mesh,
        )
        tokens_MT, valid_MT = pruned.tokens_MT, pruned.valid_MT

        # 6. Reference and old-policy log-probs, kept completions only.
        ref = old = None
        with prof.phase("ref_logps", times):
            if cfg.cppo.beta > 0:
                ref = _block(self.logps(self.ref_params, tokens_MT, valid_MT))
        with prof.phase("old_logps", times):
            if cfg.rollout.overlap:  # the sampling policy's (one update behind after step 1)
                sampled_by = self.params if sample_params is None else sample_params
                old = _block(self.logps(sampled_by, tokens_MT, valid_MT))
            elif cfg.cppo.mu > 1:
                old = _block(self.logps(self.params, tokens_MT, valid_MT))

        # 7. mu updates.
        train_batch = step_lib.Batch(tokens_MT, valid_MT, pruned.mask_MC, pruned.adv_M, old, ref)
        if self.tracer.active and not self._hlo_dumped:  # before the donating call
            like = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                (self.params, self.opt_state, train_batch),
            )
            prof.dump_hlo(self.train_step, like, self.tracer.directory / "hlo", "train_step")
            self._hlo_dumped = True
        skipped = 0.0
        with prof.phase("update", times):
            for _ in range(cfg.cppo.mu):
                self.params, self.opt_state, m = self.train_step(
                    self.params, self.opt_state, train_batch
                )
                m = distributed.to_host(m)
                skipped = max(skipped, float(m["update_skipped"]))
        self.params_step = step + 1
        if self._pending is not None:  # the server must be idle before new weights go in
            t = time.perf_counter()
            self._pending[1].result()
            times["rollout"] += time.perf_counter() - t
        if (step + 1) % cfg.rollout.push_every == 0:
            with prof.phase("weight_sync", times):
                metrics.update(self.backend.sync_weights(self.params, step + 1))
        metrics.update({k: float(v) for k, v in m.items()})
        metrics["learning_rate"] = self._learning_rate()
        metrics.update(self._step_counts(pruned.mask_MC))
        if skipped:
            self.log.event("nonfinite_update", step=step, loss=metrics.get("loss"))
            return self._skip(step, metrics, times, t0, reason="non-finite loss or gradient")
        self.nan_streak = 0
        return self._finish(step, metrics, times, t0, texts, batch)

    def _reward_contexts(self, batch, own: slice, tokens_NC, valid_NC) -> list[dict]:
        """What TRL-style rewards receive besides the completion: the prompt as the model saw it, the
        completion's token ids (up to and including EOS) and the example's columns."""
        G, out = self.shapes.G, []
        for q, i in enumerate(range(own.start, own.stop)):
            ids = batch.ids_nP[i][batch.valid_nP[i].astype(bool)]
            prompt = self.tokenizer.decode([int(t) for t in ids])
            columns = {k: v for k, v in batch.examples[i].items() if k != "prompt"}
            for r in range(q * G, (q + 1) * G):
                completion_ids = [int(t) for t, v in zip(tokens_NC[r], valid_NC[r]) if v]
                out.append({"prompt": prompt, "completion_ids": completion_ids, **columns})
        return out

    def _rollout(self, params, step: int) -> _Rollout:
        """Draw `step`'s questions and sample G completions each from `params`."""
        sh, seed = self.shapes, self.cfg.trainer.seed
        # Every process draws the whole global batch (ids are cheap) and builds one global array.
        batch = self.train_set.take(np.asarray(self.order[step]))
        prompt_QP = distributed.rows(batch.ids_nP, self.mesh)
        pvalid_QP = distributed.rows(batch.valid_nP, self.mesh)
        seeds = (seed * 1_000_003 + step * sh.Q + np.arange(sh.Q)) % (2**31)
        seeds_Q = distributed.rows(seeds.astype(np.uint32), self.mesh)
        t = time.perf_counter()
        samples = _block(self.backend.generate(params, prompt_QP, pvalid_QP, seeds_Q, sh.G))
        return _Rollout(step, batch, prompt_QP, pvalid_QP, samples, time.perf_counter() - t)

    def _take_rollout(self, step: int) -> tuple[_Rollout, object]:
        """Overlap: this step's rollout (requested last step, else made now) and the params that
        sampled it (None: the current ones); then request the next step's from the current params."""
        if self._pending is not None and self._pending[0] == step:
            _, future, sample_params = self._pending
            rollout = future.result()
        else:  # the first step of a run (or of a resumed one): nothing was requested yet
            rollout, sample_params = self._rollout(self.params, step), None
        self._pending = None
        if step + 1 < self.num_steps:
            snapshot = jax.tree.map(jnp.copy, self.params)  # the update donates self.params
            future = self._producer().submit(self._rollout, snapshot, step + 1)
            self._pending = (step + 1, future, snapshot)
        return rollout, sample_params

    def _producer(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "cppo-rollout")
        return self._executor

    def _reward_metrics(self, rewards_QG, per_fn, rstats, valid_NC, samples, prompt_valid_QP):
        finished_N = distributed.to_host(samples.finished_N)
        m = reward_metrics(rewards_QG, per_fn, valid_NC.sum(axis=1), finished_N)
        m["rewards/timeouts"] = float(rstats.get("timeouts", 0))
        acc = per_fn.get(self.accuracy_fn)
        if acc is not None:
            m["accuracy"] = float(np.mean(np.asarray(acc) > 0))
        # TRL's num_tokens: prompt and completion tokens of every sampled sequence, run so far.
        G = rewards_QG.shape[1]
        self.num_tokens += int(np.asarray(prompt_valid_QP).sum()) * G + int(valid_NC.sum())
        m["num_tokens"] = float(self.num_tokens)
        return m

    def _learning_rate(self) -> float:
        """The learning rate of the last update applied (TRL's `learning_rate`)."""
        applied = int(distributed.to_host(step_lib.update_count(self.opt_state)))
        return float(self.lr_fn(max(applied - 1, 0)))

    def _step_counts(self, mask_MC) -> dict:
        return {
            "cppo/questions": float(self.shapes.Q),
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
            self.save(step)  # params are the last good ones: skipped updates changed nothing
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
        """Greedy accuracy on the test (or validation) split under both rules; every question is scored.

        `accuracy` is the headline rule's (`eval.rule`), `accuracy_released` and `accuracy_strict` both.
        With `sampled`, also `sampled_accuracy` (and per rule): one completion per question at the
        rollout temperature, from fixed seeds (question i: seed 2**30 + i), so that before and after
        a run the same random numbers are used.
        """
        prompts = self.val_set if split == "validation" else self.test_set
        rule = self.cfg.eval.rule
        acc = self._score(prompts, batch_size, None)
        result = {"step": step, "accuracy": acc[f"accuracy_{rule}"], **acc, "n": len(prompts)}
        if sampled:  # after greedy, which pushes `self.params` to a server that lags behind
            sampled_acc = self._score(prompts, batch_size, 2**30)
            result["sampled_accuracy"] = sampled_acc[f"accuracy_{rule}"]
            result.update({f"sampled_{k}": v for k, v in sampled_acc.items()})
        result.update(split=split, rule=rule)
        self.evals.append(result)
        self.log.evaluation(result)
        return result

    def _score(self, prompts, batch_size: int, seed: int | None) -> dict[str, float]:
        """Accuracy under each evaluation rule (`accuracy_<rule>`) of greedy (seed None) or
        one-sample (seeds seed + question index) completions."""
        n = len(prompts)
        texts = []
        for lo in range(0, n, batch_size):
            idx = np.arange(lo, lo + batch_size) % n  # pad the last batch by wrapping, then drop
            part = prompts.take(idx)
            ids = distributed.rows(part.ids_nP, self.mesh)
            valid = distributed.rows(part.valid_nP, self.mesh)
            if seed is None:
                out = self.backend.greedy(self.params, ids, valid)
            else:
                seeds = distributed.rows((seed + idx).astype(np.uint32), self.mesh)
                out = self.backend.generate(self.params, ids, valid, seeds, 1)
            got = self._decode(*distributed.to_host((out.tokens_NC, out.valid_NC)))
            texts.extend(got[: min(batch_size, n - lo)])
        solutions = [ex["solution"] for ex in prompts.examples]
        _, per_fn, _ = self.rewards.score(texts, solutions, list(self.eval_rules))
        return {
            f"accuracy_{name.split('/')[1]}": float(np.mean(np.asarray(v) > 0))
            for name, v in per_fn.items()
        }

    def train(self, progress=None) -> dict:
        """The whole run: resume if asked, evaluate, train, checkpoint, evaluate; returns a summary."""
        self.maybe_resume()
        self.backend.sync_weights(self.params, self.start_step)
        cfg = self.cfg.trainer
        with StopSignals() as stop:  # SIGTERM/SIGINT: checkpoint and stop (cppo_jax.stopping)
            before = self.evaluate(self.start_step, sampled=True)
            self._validate(self.start_step)
            for step in range(self.start_step, self.num_steps):
                self._stop_if_asked(stop, step)
                with self.tracer.step(step + 1):
                    metrics = self._guarded_step(step)
                self.log.metrics(metrics)
                if progress is not None:
                    progress(metrics)
                done = step + 1
                if cfg.eval_every and done % cfg.eval_every == 0 and done < self.num_steps:
                    if self.val_set is not None:
                        self._validate(done)
                    else:
                        self.evaluate(done)
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                    self.save(done)
            if self.ckpt.latest_step() != self.num_steps:
                self.save(self.num_steps)
            self._stop_if_asked(stop, self.num_steps)
        self._validate(self.num_steps)
        export_policy(
            self.graphdef,
            self.params,
            self.cfg,
            self.out_dir / EXPORT_DIR,
            self.model_path,
            cppo_step=self.num_steps,
        )
        after = self.evaluate(self.num_steps, sampled=True)
        table = phase_table(self.log.history)
        if self.main:
            if self.cfg.logging.plot and self.log.history:
                plot_curves(self.log.history, self.evals, self.out_dir / "curves.png")
            programs = prof.format_programs_report()
            (self.out_dir / "compiled_programs.md").write_text(programs + "\n")
            rules = " ".join(
                f"{rule} {before[f'accuracy_{rule}']:.3f} -> {after[f'accuracy_{rule}']:.3f};"
                for rule in ("released", "strict")
            )
            (self.out_dir / "summary.md").write_text(
                f"accuracy ({self.cfg.eval.rule} rule) before {before['accuracy']:.3f}, after "
                f"{after['accuracy']:.3f} (both rules: {rules[:-1]})\n\n{table}\n"
            )
        return {"before": before, "after": after, "steps": self.num_steps, "phases": table}

    def _stop_if_asked(self, stop: StopSignals, step: int) -> None:
        """After SIGTERM/SIGINT (see `cppo_jax.stopping`): checkpoint `step` and raise `SignalStopError`."""
        if stop.requested is None:
            return
        if self.ckpt.latest_step() != step:
            self.save(step)
        self.log.event("stopped", step=step, signal=stop.name)
        raise SignalStopError(
            stop.requested,
            step,
            f"stopped by {stop.name} after step {step}; checkpoint of step {step} saved under "
            f"{self.ckpt.directory} (resume with trainer.resume=true)",
        )

    def _guarded_step(self, step: int) -> dict:
        """`step`, saving a checkpoint before a rollout-server failure propagates."""
        try:
            return self.step(step)
        except RolloutServerError as e:
            done = max(step, self.params_step)
            self.save(done)
            self.log.event("rollout_server_error", step=done, error=str(e))
            raise RolloutServerError(
                f"{e} -- stopped; checkpoint of step {done} saved under {self.ckpt.directory} "
                f"(resume with trainer.resume=true once the server is back)"
            ) from e

    def _validate(self, step: int) -> None:
        """Validation accuracy; the best policy so far is kept as a Hugging Face folder `best/`."""
        if self.val_set is None:
            return
        r = self.evaluate(step, split="validation")
        if self.best_val is None or r["accuracy"] > self.best_val:
            self.best_val = r["accuracy"]
            export_policy(
                self.graphdef,
                self.params,
                self.cfg,
                self.out_dir / "best",
                self.model_path,
                cppo_step=step,
                cppo_val_accuracy=r["accuracy"],
            )
            self.log.event("best", step=step, accuracy=r["accuracy"])

    def close(self) -> None:
        if self._executor is not None:  # an in-flight rollout ends by itself (client timeouts)
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._pending = None
        self.tracer.close()
        self.rewards.close()
        self.backend.close()
        self.log.close()
        self.ckpt.close()
