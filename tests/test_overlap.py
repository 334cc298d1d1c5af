"""rollout.overlap = 1: the next step's rollout runs while the current step trains, one update stale.

The mechanics are checked here with the embedded sampler behind a recording wrapper standing in for the
server (the real vLLM server runs the same path in tests/test_vllm.py): which weights sampled which step,
that the old-policy log-probs are the sampling weights', that no weights are pushed while a generation is in
flight, and that a failed generation stops the run with a checkpoint.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cppo_jax.config.choices import ConfigError
from cppo_jax.rollout.backend import EmbeddedBackend
from cppo_jax.rollout.vllm.client import RolloutServerError
from cppo_jax.train import loop as trainer_run
from cppo_jax.train.trainer import Trainer
from tests.helpers import spread_reward
from tests.reliability.runs import read_events
from tests.test_trainer import small_config


class RecordingBackend:
    """The embedded sampler, recording the weights each generation used; pushes check nothing is in
    flight (a real server would mix weights into a running generation)."""

    def __init__(self, inner: EmbeddedBackend, delay_s: float = 0.3):
        self.inner = inner
        self.delay_s = delay_s
        self.sampled_with: list = []  # host copies of the params, one per generate call, in call order
        self.pushed: list[int] = []
        self.in_flight = 0
        self.fail_call: int | None = (
            None  # raise RolloutServerError on this generate call (0-based)
        )
        self.hold_call: int | None = None  # this generate call (0-based) waits for `release`
        self.release = threading.Event()
        self.release.set()
        self.events: list[str] = []  # "generated <call>" and "closed", in order
        self._lock = threading.Lock()

    def generate(self, params, prompt_QP, valid_QP, seeds_Q, n):
        with self._lock:
            self.in_flight += 1
            call = len(self.sampled_with)
            self.sampled_with.append(jax.tree.map(np.asarray, params))
        try:
            time.sleep(self.delay_s)  # long enough for the trainer's step to run meanwhile
            if self.hold_call in (None, call):
                self.release.wait()
            if call == self.fail_call:
                raise RolloutServerError("injected: the server went away mid-rollout")
            return jax.block_until_ready(
                self.inner.generate(params, prompt_QP, valid_QP, seeds_Q, n)
            )
        finally:
            with self._lock:
                self.in_flight -= 1
                self.events.append(f"generated {call}")

    def greedy(self, *args, **kw):
        return self.inner.greedy(*args, **kw)

    def wait_ready(self):
        self.inner.wait_ready()

    def sync_weights(self, params, step):
        assert self.in_flight == 0, f"weights of step {step} pushed during a generation"
        self.pushed.append(step)
        return {}

    def close(self):
        self.events.append("closed")


def overlap_trainer(tmp_path, arith_model_dir, *overrides):
    cfg = small_config(
        tmp_path,
        arith_model_dir,
        "rollout.vllm_url=http://127.0.0.1:9",  # never contacted: the backend is replaced below
        "rollout.backend=vllm",
        "rollout.overlap=1",
        "trainer.steps=4",
        *spread_reward(tmp_path),  # non-zero advantages: the weights move every step
        *overrides,
    )
    trainer = Trainer(cfg)
    backend = RecordingBackend(EmbeddedBackend(trainer.actor.graphdef, trainer.rollout.sp))
    trainer.rollout = dataclasses.replace(trainer.rollout, backend=backend)
    return trainer, backend


def test_overlap_samples_one_update_behind_with_exact_old_logps(tmp_path, arith_model_dir):
    trainer, backend = overlap_trainer(tmp_path, arith_model_dir)
    seen = []
    inner = trainer.actor.train_step

    def spy(params, opt_state, batch):
        seen.append(jax.tree.map(np.asarray, batch))
        return inner(params, opt_state, batch)

    trainer.actor = dataclasses.replace(trainer.actor, train_step=spy)
    trainer.phase_split = True  # the programs apart, so the updates' batch is seen
    before_step = []  # host copies of the params at the start of each step
    history = []
    try:
        for s in range(4):
            before_step.append(jax.tree.map(np.asarray, trainer.params))
            history.append(trainer.step(s))
        after = jax.tree.map(np.asarray, trainer.params)
    finally:
        trainer.close()

    assert [m["rollout/staleness"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["rollout/generate_s"] >= backend.delay_s for m in history)
    assert backend.pushed == [1, 2, 3, 4]  # every push after the in-flight generation ended
    # Step 0 sampled with its own weights; step s >= 1 with the weights at the start of step s - 1.
    assert len(backend.sampled_with) == 4
    sampled_by = [before_step[0]] + before_step[:3]
    for s, (got, want) in enumerate(zip(backend.sampled_with, sampled_by)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b, err_msg=f"step {s}")
    # The weights did move, so the stale steps really are off-policy.
    moved = [
        max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
        for x, y in zip(before_step[1:] + [after], before_step)
    ]
    assert min(moved) > 0
    # Old-policy log-probs: those of the weights that sampled the batch.
    for s, batch in enumerate(seen):
        want = np.asarray(trainer.actor.logps(sampled_by[s], batch.tokens_MT, batch.valid_MT))
        np.testing.assert_allclose(batch.old_logp_MC, want, atol=1e-6, err_msg=f"step {s}")
    assert history[0]["ratio/abs_dev_mean"] < 1e-5  # on-policy: the ratio is 1
    assert all(m["ratio/abs_dev_mean"] > 1e-6 for m in history[1:])
    assert all(np.isfinite(m["loss"]) for m in history)


def test_failed_background_rollout_stops_the_run_with_a_checkpoint(tmp_path, arith_model_dir):
    trainer, backend = overlap_trainer(tmp_path, arith_model_dir)
    backend.fail_call = 2  # the generation of step 2, requested during step 1
    try:
        trainer_run.guarded_step(trainer, 0)
        with pytest.raises(RolloutServerError, match="mid-rollout.*checkpoint of step 2 saved"):
            trainer_run.guarded_step(trainer, 1)
        assert trainer.host.ckpt.latest_step() == 2
        assert backend.pushed == [1]  # step 1's update is saved, never pushed
    finally:
        trainer.close()


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cppo-rollout")]


def test_close_stops_the_producer_before_the_client(tmp_path, arith_model_dir):
    """Closing while the next step's generation runs: the producer ends first (the generation is let
    finish, nothing new starts), then the backend and its client are closed."""
    trainer, backend = overlap_trainer(tmp_path, arith_model_dir)
    try:
        trainer.step(0)  # requests step 1's generation and waits for it before its push
        backend.release.clear()
        trainer.overlap.take(trainer.params, 1)  # step 2's generation (call 2) now runs and waits
        while backend.in_flight == 0:
            time.sleep(0.01)
        threading.Timer(1.0, backend.release.set).start()
    finally:
        t0 = time.monotonic()
        trainer.close()
    assert time.monotonic() - t0 >= 0.5  # close waited for the generation in flight
    assert backend.events[-2:] == ["generated 2", "closed"]
    assert backend.in_flight == 0 and not producer_threads()
    assert all(e["event"] != "rollout_abandoned" for e in read_events(trainer.host.out_dir))
    with pytest.raises(RuntimeError, match="producer is closed"):
        trainer.overlap.take(trainer.params, 2)


def test_close_does_not_wait_for_a_hung_rollout(tmp_path, arith_model_dir):
    trainer, backend = overlap_trainer(tmp_path, arith_model_dir)
    trainer.overlap.close_wait_s = 0.5
    try:
        trainer.step(0)
        backend.release.clear()  # the generation of step 2 hangs (a server that never answers)
        trainer.overlap.take(trainer.params, 1)
        # Until the thread has started it, the generation is only queued and close cancels it (no
        # abandonment): wait for it to be in flight, as a loaded CI machine may start it late.
        deadline = time.monotonic() + 60
        while backend.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.in_flight == 1
        t0 = time.monotonic()
    finally:
        trainer.close()
    assert time.monotonic() - t0 < 5.0
    events = [e for e in read_events(trainer.host.out_dir) if e["event"] == "rollout_abandoned"]
    assert [e["wait_s"] for e in events] == [0.5]
    assert backend.events[-1] == "closed" and backend.in_flight == 1  # abandoned, still running
    backend.release.set()
    for thread in producer_threads():
        thread.join(timeout=30)
    assert backend.in_flight == 0 and not producer_threads()


def test_a_step_that_returns_early_waits_for_the_generation_it_requested(
    tmp_path, arith_model_dir, monkeypatch
):
    """Non-finite rewards end the step early (skipped); the next step's generation, requested at its
    start, has ended by the time it returns, so nothing (an evaluation's push) reaches a busy server."""
    trainer, backend = overlap_trainer(tmp_path, arith_model_dir)
    score = trainer.host.rewards.score
    scored_at = []

    def poisoned(texts, solutions, *rest):
        total, per_fn, stats = score(texts, solutions, *rest)
        scored_at.append(time.monotonic())
        threading.Timer(1.0, backend.release.set).start()  # step 1's generation ends 1 s later
        return np.full(len(total), np.nan), per_fn, stats

    monkeypatch.setattr(trainer.host.rewards, "score", poisoned)
    backend.hold_call = 1  # step 1's generation, requested during step 0, waits for the release
    backend.release.clear()
    try:
        metrics = trainer.step(0)
        returned_after = time.monotonic() - scored_at[0]
        assert metrics["update_skipped"] == 1.0 and backend.pushed == []
        assert backend.in_flight == 0 and backend.events == ["generated 0", "generated 1"]
        assert returned_after >= 0.9  # it waited for the held generation
    finally:
        backend.release.set()
        trainer.close()


def test_overlap_needs_a_server(tmp_path):
    with pytest.raises(ConfigError, match="rollout.overlap.*embedded.*nothing to overlap"):
        small_config(tmp_path, tmp_path / "model", "rollout.overlap=1")


def test_overlap_0_is_the_synchronous_step(tmp_path, arith_model_dir):
    """overlap 0: every step samples with its own current weights, in the step, and trains on-policy."""
    trainer, backend = overlap_trainer(tmp_path, arith_model_dir, "rollout.overlap=0")
    seen = []
    inner = trainer.actor.train_step

    def spy(params, opt_state, batch):
        seen.append(batch.old_logp_MC)
        return inner(params, opt_state, batch)

    trainer.actor = dataclasses.replace(trainer.actor, train_step=spy)
    trainer.phase_split = True  # the programs apart, so the updates' batch is seen
    before_step, history = [], []
    try:
        for s in range(3):
            before_step.append(jax.tree.map(np.asarray, trainer.params))
            history.append(trainer.step(s))
            assert len(backend.sampled_with) == s + 1  # nothing requested ahead
    finally:
        trainer.close()
    assert trainer.overlap is None and seen == [None, None, None]  # mu = 1: ratio exactly 1
    for got, want in zip(backend.sampled_with, before_step):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
    assert all("rollout/staleness" not in m and m["ratio/abs_dev_mean"] == 0.0 for m in history)
    assert backend.pushed == [1, 2, 3]


def test_the_snapshot_is_a_compute_dtype_copy(tmp_path, arith_model_dir):
    """bf16 compute, float32 params: the params that sample the next step are held in bf16 (they only
    run forwards), each leaf the policy's rounded once, a buffer of its own that outlives the donation."""
    trainer, _ = overlap_trainer(
        tmp_path, arith_model_dir, "model.dtype=bfloat16", "trainer.steps=2"
    )
    try:
        trainer.overlap.make = lambda params, step: params  # the rollout: what sampled it
        policy = jax.tree.map(np.asarray, trainer.params)
        assert trainer.overlap.take(trainer.params, 0)[1] is None  # step 0 sampled on the spot
        jax.tree.map(lambda x: x.delete(), trainer.params)  # the update donates the live params
        rollout, sampled_by = trainer.overlap.take(None, 1)
        assert rollout is sampled_by
        leaves = jax.tree.leaves(sampled_by)
        assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
        for got, want in zip(leaves, jax.tree.leaves(policy)):
            np.testing.assert_array_equal(np.asarray(got), want.astype(jnp.bfloat16))
    finally:
        trainer.overlap.close()
        trainer.close()
