"""The CPPO trainer: one step in the order of the paper, over the run's roles (`roles`).

One step (`Trainer.step`):
  1. Draw Q questions (Q = floor(b / (1 - p)) with allocation, else b; GRESO skipping: `skipping`).
  2. Roll out G completions each from the current policy.
  3. Score every completion (host reward workers).
  4. Group advantages.
  5. Keep k = floor(G (1 - p)) completions per question by |A| (a static-shape top-k).
  6. Reference (beta > 0) and sampler (tis_cap) log-probs of the kept completions.
  7. mu policy updates on the kept completions; with mu > 1 the first one's forward gives the old
     policy's log-probs for the others (a stale rollout's come from its own pass in 6; where each
     comes from: `logp_sources`).
Steps 4-7 are one compiled program whose metrics are fetched once (`after_rewards`, run by
`update`). Nothing is computed for a pruned completion after its reward. p = 0 is plain GRPO
on the same path.

With `rollout.overlap = 1` (vLLM backend) step n+1's rollout is produced while step n trains, one update
stale, with exact old-policy log-probs; with `rollout.max_staleness = k >= 2` up to k steps ahead,
pushes landing mid-rollout, TIS against the sampler's log-probs, and a rollout older than k updates
dropped and sampled again (`rollout.overlap`). Steps 1-2 are the `rollout` role's, step 3 on
the host `scoring`'s, steps 4-7 the actor's fused program (the reference's params an argument of it).
The roles are built by `roles.build`; the trainer holds what changes in a run: the params, their
optimizer state and the counters. The run around the steps (resume, evaluations,
checkpoints, stops) is `loop`'s; evaluation and validation `evaluation`'s.
"""

from __future__ import annotations

import time
from pathlib import Path

from cppo_jax.algo import cppo, selection
from cppo_jax.config.schema import Config
from cppo_jax.data import skipping as skip_lib
from cppo_jax.observe import profile as prof
from cppo_jax.parallel import distributed
from cppo_jax.rollout.draw import StepRollout
from cppo_jax.rollout.embedded.segments import running_rows
from cppo_jax.rollout.overlap import Overlap
from cppo_jax.train import evaluation, loop, programs, roles, scoring, update


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row; the last good state was saved."""


class Trainer:
    def __init__(self, cfg: Config, model_path: str | Path | None = None):
        self.cfg = cfg
        built = roles.build(cfg, model_path)
        self.shapes, self.mesh = built.shapes, built.mesh
        self.data, self.host = built.data, built.host  # the prompts; folder, rewards, logs
        self.actor, self.reference, self.rollout = built.actor, built.reference, built.rollout
        actor = self.actor
        self.params, self.opt_state = built.params, built.opt_state  # the actor's trained state
        if self.actor.frozen is not None and hasattr(self.rollout.backend, "attach_lora"):
            # vLLM: pushes of the adapters alone (rollout.lora_push), the live ones asked for
            self.rollout.backend.attach_lora(
                actor.train_graphdef, actor.frozen, lambda: self.params
            )
        self.num_steps = self.data.num_steps
        self.best_val: float | None = None
        self.start_step = 0
        self.params_step = 0  # the step the current params belong to
        self.nan_streak = 0
        self.num_tokens = 0  # prompt + completion tokens sampled so far (TRL's num_tokens)
        self.step_began: tuple[int, dict | None] = (0, None)  # set by each step (see `_skip`)
        self.evals: list[dict] = []
        # True: steps 4-7 as separate programs, each timed (tests and benchmarks: the phases apart)
        self.phase_split = False
        self.dropped_stale = 0  # rollouts older than rollout.max_staleness, dropped (k >= 2)
        self.overlap = None
        self.ahead = programs.rollout_ahead(cfg)  # 0: synchronous; 1: overlap; k >= 2: a queue
        if cfg.rollout.overlap:
            dtype = self.actor.model_cfg.compute_dtype
            self.overlap = Overlap(
                self._rollout, self.num_steps, dtype, ahead=self.ahead, served=self._served
            )

    def state(self) -> dict:
        """What a checkpoint holds: the trained params (with LoRA the adapters only) and their
        optimizer state."""
        return {"params": self.params, "opt_state": self.opt_state}

    def policy_params(self):
        """The current params as a plain model's weights: exports', merged pushes' (`Actor`)."""
        return self.actor.policy_params(self.params)

    def sampler_params(self, params=None):
        """`params` (the current ones by default) as the rollout backend's weights: with LoRA on
        the embedded sampler the adapters unmerged on the base (`Rollout.weights`)."""
        return self.rollout.weights(self.actor, self.params if params is None else params)

    def save(self, step: int) -> None:
        """Checkpoint `step` (`loop.save`)."""
        loop.save(self, step)

    def maybe_resume(self) -> None:
        """Restore the latest checkpoint when `trainer.resume` (`loop.maybe_resume`)."""
        loop.maybe_resume(self)

    # ------------------------------------------------------------------------------------------

    def step(self, step: int) -> dict:
        """One CPPO step (see the module docstring); returns its metrics. With overlap, the step never
        returns (early, or by an error) while a generation it requested runs: see `rollout.overlap`."""
        try:
            return self._step(step)
        finally:
            if self.ahead == 1:  # k >= 2: generations run on across steps and pushes (partial)
                self.overlap.settle()

    def _step(self, step: int) -> dict:
        cfg, sh, data, host = self.cfg, self.shapes, self.data, self.host
        t0 = time.perf_counter()
        times = {}
        # The counters as this step begins: what a stop on non-finite steps saves (`_skip`).
        self.step_began = (self.num_tokens, data.skipper and data.skipper.state_dict())

        # 1-2. Questions and their rollout (with overlap: requested during the previous step).
        if data.skipper is not None and self.overlap is not None:  # before this step's record:
            data.skipper.ids(step + 1)  # the one-step lag (skipping.py), at a fixed point
        with prof.phase("rollout", times):
            if self.overlap is not None:
                rollout, sample_params, version = self.overlap.take(self.params, step)
                if self.ahead > 1 and version is not None and step - version > self.ahead:
                    rollout, version = self._resample(step, version)
            else:
                rollout, sample_params = self._rollout(self.params, step), None
        batch, samples = rollout.batch, rollout.samples
        tokens_NC, valid_NC, finished_N, row_steps = distributed.to_host(  # one wait for all
            (samples.tokens_NC, samples.valid_NC, samples.finished_N, samples.row_steps)
        )

        # 3. Rewards: each process scores its own questions' completions; all get every reward.
        with prof.phase("reward", times):  # the training rewards, not the evaluation rules
            texts, total_N, per_fn, rstats = scoring.score_rollout(
                host.rewards, data.tokenizer, batch, tokens_NC, valid_NC, sh.G, host.train_fns
            )
        rewards_QG = total_N.reshape(sh.Q, sh.G)
        self.num_tokens += scoring.sampled_tokens(batch.valid_nP, valid_NC, sh.G)
        metrics = scoring.rollout_metrics(
            rewards_QG, per_fn, rstats, valid_NC, finished_N, host.accuracy_fn, self.num_tokens
        )
        if cfg.cppo.filter_groups:
            metrics.update(selection.filter_counts(rewards_QG, sh.U))
        if row_steps is not None:  # the embedded sampler's decode work (`rollout.compact`)
            row_steps = int(row_steps)
            running = sum(running_rows(valid_NC.sum(axis=1), sh.C))
            metrics["rollout/row_steps"] = float(row_steps)
            metrics["rollout/useful_fraction"] = running / row_steps if row_steps else 1.0
        if self.ahead == 1:
            metrics["rollout/staleness"] = float(sample_params is not None)  # updates behind
        elif self.ahead > 1 and version is not None:  # updates since the rollout's oldest token
            metrics["rollout/staleness"] = float(step - version)
            metrics["rollout/dropped_stale"] = float(self.dropped_stale)  # in the run so far
        if self.overlap is not None:
            metrics["rollout/generate_s"] = rollout.seconds
        try:
            cppo.check_rewards(rewards_QG)
        except ValueError as e:
            host.log.event("nonfinite_rewards", step=step, error=str(e))
            return self._skip(step, metrics, times, t0, reason=str(e))
        if data.skipper is not None:  # GRESO histories and p (skipping.py)
            easy = skip_lib.easy_of(rewards_QG, per_fn.get(host.accuracy_fn))
            metrics.update(data.skipper.record(step, rewards_QG, easy))

        # 4-7. Advantages, pruning, reference (and snapshot) log-probs, the mu updates: one program
        # and one fetch of its metrics (`update`; the phases apart in profiled steps).
        m = update.after_rewards(self, rollout, rewards_QG, sample_params, step, times)
        sample_params = None  # the snapshot that sampled: not kept through the update
        self.params_step = step + 1
        if self.ahead == 1:  # the server must be idle before new weights go in (k >= 2: partial)
            times["rollout"] += self.overlap.wait()
        if (step + 1) % cfg.rollout.push_every == 0:
            with prof.phase("weight_sync", times):
                metrics.update(self.rollout.push(self.sampler_params(), step + 1))
        metrics.update(m)  # with the learning rate and cppo/tokens_trained
        metrics.update(
            {
                "cppo/questions": float(sh.Q),
                "cppo/questions_trained": float(sh.U),
                "cppo/kept": float(sh.M),
            }
        )
        if m["update_skipped"]:  # any of the mu updates
            host.log.event("nonfinite_update", step=step, loss=metrics.get("loss"))
            return self._skip(step, metrics, times, t0, reason="non-finite loss or gradient")
        self.nan_streak = 0
        return self._finish(step, metrics, times, t0, texts, batch)

    def _rollout(self, params, step: int) -> StepRollout:
        """Draw `step`'s questions and sample G completions each from `params` (None: from the
        weights the backend serves, pushed before: the producer's rollouts k >= 2 ahead)."""
        weights = None if params is None else self.sampler_params(params)
        return self.rollout.draw(weights, self.data, step)

    def _served(self) -> int | None:
        """The updates in the weights the rollout backend serves (its last confirmed push)."""
        return getattr(self.rollout.backend, "synced_step", None)

    def _resample(self, step: int, version: int) -> tuple[StepRollout, int]:
        """A rollout older than `rollout.max_staleness` updates: dropped, counted and logged; the step's questions are sampled again from the current
        weights (pushed first when the server is behind them: `rollout.push_every`)."""
        self.dropped_stale += 1
        self.host.log.event(
            "stale_rollout_dropped",
            step=step,
            version=version,
            staleness=step - version,
            max_staleness=self.ahead,
            dropped=self.dropped_stale,
        )
        if self._served() != self.params_step:
            self.rollout.push(self.sampler_params(), self.params_step)
        return self._rollout(self.params, step), self.params_step

    def _finish(self, step, metrics, times, t0, texts, batch) -> dict:
        times["step"] = time.perf_counter() - t0
        metrics.update({f"timing_s/{k}": v for k, v in times.items()})
        metrics["step"] = step + 1
        compiled, loaded = prof.compilations()
        metrics["jit/compilations"] = float(compiled)
        metrics["jit/cache_hits"] = float(loaded)
        metrics["update_skipped"] = 0.0
        log_cfg, G = self.cfg.logging, self.shapes.G
        if texts is not None and log_cfg.samples_per_log and step % self.cfg.trainer.log_every == 0:
            n = min(log_cfg.samples_per_log, len(texts) // G)
            rows = [
                {"question": batch.examples[i]["question"], "completion": texts[i * G]}
                for i in range(n)
            ]
            self.host.log.samples(step + 1, rows)
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
            if self.data.skipper is not None:
                self.data.skipper.load_state_dict(skipper_state)
            self.save(step)
            raise NonFiniteError(
                f"{self.nan_streak} non-finite steps in a row (last: {reason}) at step {step + 1}; "
                f"stopped with the last good state saved under {self.host.ckpt.directory} (step "
                f"{step}). Raise trainer.max_nan_streak to tolerate more."
            )
        return metrics

    # ------------------------------------------------------------------------------------------

    def evaluate(
        self,
        step: int,
        batch_size: int = 64,
        split: str = "test",
        sampled: bool = False,
        whole: bool = False,
    ) -> dict:
        """Held-out accuracy of the current params (`evaluation.evaluate`: the test split's
        `trainer.eval_subset` sample unless `whole`), logged and kept in `evals`."""
        return evaluation.evaluate(self, step, batch_size, split, sampled, whole)

    def train(self, progress=None) -> dict:
        """The whole run (`loop.train`); returns a summary."""
        return loop.train(self, progress)

    def close(self) -> None:
        host = self.host
        if self.overlap is not None and not self.overlap.close():  # before the backend's client
            host.log.event("rollout_abandoned", wait_s=self.overlap.close_wait_s)
        host.tracer.close()
        host.rewards.close()
        self.rollout.backend.close()
        host.log.close()
        host.ckpt.close()
