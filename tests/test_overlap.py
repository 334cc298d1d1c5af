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

    def __init__(self, inner: EmbeddedBackend, delay_s: float = 0.3, partial: bool = False):
        self.inner = inner
        self.delay_s = delay_s
        # partial: a server that takes pushes while it generates (rollout.max_staleness >= 2): a
        # generation asked with params None samples from the weights last pushed, as a server does
        self.partial = partial
        self.served = None  # the weights last pushed (partial)
        self.synced_step: int | None = None  # the step they belong to, as VLLMBackend keeps it
        self.versions: list = []  # synced_step at each generate call, in call order
        self.pushed_mid_rollout: list[int] = []  # pushes that landed while a generation ran
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
            if params is None:  # the server's own weights
                assert self.partial and self.served is not None, "nothing pushed to sample from"
                params = self.served
            self.versions.append(self.synced_step)
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
        with self._lock:
            if self.in_flight:
                assert self.partial, f"weights of step {step} pushed during a generation"
                self.pushed_mid_rollout.append(step)
            self.pushed.append(step)
            if self.partial:  # a copy: the update donates the live params
                self.served = jax.tree.map(jnp.copy, params)
            self.synced_step = step
        return {}

    def close(self):
        self.events.append("closed")


def overlap_trainer(tmp_path, arith_model_dir, *overrides, partial=False, delay_s=0.3):
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
    inner = EmbeddedBackend(trainer.actor.graphdef, trainer.rollout.sp)
    backend = RecordingBackend(inner, delay_s=delay_s, partial=partial)
    trainer.rollout = dataclasses.replace(trainer.rollout, backend=backend)
    return trainer, backend


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        rollout, sampled_by, _ = trainer.overlap.take(None, 1)
        assert rollout is sampled_by
        leaves = jax.tree.leaves(sampled_by)
        assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
        for got, want in zip(leaves, jax.tree.leaves(policy)):
            np.testing.assert_array_equal(np.asarray(got), want.astype(jnp.bfloat16))
    finally:
        trainer.overlap.close()
        trainer.close()


# ---------------------------------------------------------------------------------------------
# rollout.max_staleness = k >= 2: a queue of rollouts k steps ahead, pushes landing mid-rollout

AHEAD = ("rollout.max_staleness=2", "cppo.tis_cap=2")


def ahead_trainer(tmp_path, arith_model_dir, *overrides, delay_s=0.3):
    """A k = 2 trainer on the recording backend as a server that takes pushes mid-rollout, its
    weights pushed once before the first step (as `loop.train` does)."""
    trainer, backend = overlap_trainer(
        tmp_path, arith_model_dir, *AHEAD, *overrides, partial=True, delay_s=delay_s
    )
    trainer.rollout.push(trainer.sampler_params(), 0)
    return trainer, backend


def record_trained(monkeypatch) -> list[tuple[int, int, list[str]]]:
    """(step, the rollout's step, its questions) for every step that reached the update."""
    from cppo_jax.train import update

    trained, inner = [], update.after_rewards

    def spy(trainer, rollout, rewards_QG, sample_params, step, times):
        questions = [e["question"] for e in rollout.batch.examples]
        trained.append((step, rollout.step, questions))
        return inner(trainer, rollout, rewards_QG, sample_params, step, times)

    monkeypatch.setattr(update, "after_rewards", spy)
    return trained


@pytest.mark.slow
def test_k2_queues_two_steps_ahead_with_pushes_landing_mid_rollout(
    tmp_path, arith_model_dir, monkeypatch
):
    """k = 2: after step n's take, steps n + 1 and n + 2 are asked for; the trainer pushes without
    waiting for the generation in flight (which goes on across the push, a partial rollout); every
    step trains its own questions, no more than 2 updates stale, with TIS against the sampler's
    log-probs and the current policy as the old one."""
    trainer, backend = ahead_trainer(tmp_path, arith_model_dir, "trainer.steps=5", delay_s=1.0)
    trained = record_trained(monkeypatch)
    seen = []
    inner = trainer.actor.train_step

    def spy(params, opt_state, batch):
        seen.append(batch)
        return inner(params, opt_state, batch)

    trainer.actor = dataclasses.replace(trainer.actor, train_step=spy)
    trainer.phase_split = True  # the programs apart, so the updates' batch is seen
    history, queued = [], []
    try:
        for s in range(5):
            history.append(trainer.step(s))
            queued.append(trainer.overlap.queued)
    finally:
        trainer.close()
    assert queued == [[1, 2], [2, 3], [3, 4], [4], []]
    assert [t[:2] for t in trained] == [(s, s) for s in range(5)]  # each step its own questions
    for s, (_, _, questions) in enumerate(trained):
        ids = trainer.data.ids(s)
        assert questions == [trainer.data.train_set.examples[i]["question"] for i in ids]
    staleness = [m["rollout/staleness"] for m in history]
    assert staleness[0] == 0.0 and all(0 <= x <= 2 for x in staleness), staleness
    assert max(staleness) >= 1.0  # some steps really trained on a rollout sampled before an update
    assert all(m["rollout/dropped_stale"] == 0.0 for m in history)
    assert backend.pushed == [0, 1, 2, 3, 4, 5]
    # Generations (1 s each) are slower than the steps: pushes land while one runs.
    assert backend.pushed_mid_rollout, backend.pushed
    assert trainer.actor.sources.behav == "sampler" and trainer.actor.sources.old == "current"
    assert all(b.old_logp_MC is None and b.behav_logp_MC is not None for b in seen)
    assert all(np.isfinite(m["loss"]) for m in history)


@pytest.mark.slow
def test_a_rollout_older_than_k_is_dropped_counted_and_resampled(
    tmp_path, arith_model_dir, monkeypatch
):
    """rollout.push_every = 3 with k = 2: the server holds step 0's weights until step 3 is pushed,
    so step 3's rollout, asked for during step 1 and begun before that push, is 3 updates stale:
    dropped, counted and logged, and step 3's questions sampled again from the current weights."""
    trainer, backend = ahead_trainer(
        tmp_path, arith_model_dir, "trainer.steps=4", "rollout.push_every=3", delay_s=0.0
    )
    trained = record_trained(monkeypatch)
    try:
        history = [trainer.step(s) for s in range(4)]
    finally:
        trainer.close()
    assert backend.pushed == [0, 3]
    assert [m["rollout/staleness"] for m in history] == [0.0, 1.0, 2.0, 0.0]
    assert [m["rollout/dropped_stale"] for m in history] == [0.0, 0.0, 0.0, 1.0]
    events = [e for e in read_events(trainer.host.out_dir) if e["event"] == "stale_rollout_dropped"]
    assert [(e["step"], e["version"], e["staleness"], e["dropped"]) for e in events] == [
        (3, 0, 3, 1)
    ]
    # Five generations: steps 0-3 and step 3 again, from the params after step 3's updates.
    assert backend.versions == [0, 0, 0, 0, 3]
    assert [t[:2] for t in trained] == [(s, s) for s in range(4)]  # nothing lost, nothing twice


@pytest.mark.slow
def test_a_resumed_k2_run_trains_nothing_twice(tmp_path, arith_model_dir, monkeypatch):
    """A k = 2 trainer checkpointed after 2 of 4 steps and closed: the rollouts queued for steps 2
    and 3 are discarded with it; the resumed run (`Trainer.train`) samples them again, so every step
    trains once, on its own questions, and the stale-drop count carries over in the checkpoint."""
    trained = record_trained(monkeypatch)
    trainer, _ = ahead_trainer(tmp_path, arith_model_dir, "trainer.steps=4")
    try:
        for s in range(2):
            trainer.step(s)
        trainer.save(2)  # as a stop after step 2 does (loop.stop_if_asked)
        queued_at_stop = trainer.overlap.queued
    finally:
        trainer.close()
    assert queued_at_stop == [2, 3]
    assert [t[0] for t in trained] == [0, 1]

    resumed, backend2 = overlap_trainer(
        tmp_path, arith_model_dir, *AHEAD, "trainer.steps=4", "trainer.resume=true", partial=True
    )
    try:
        resumed.train()
    finally:
        resumed.close()
    assert resumed.start_step == 2
    assert [t[:2] for t in trained] == [(s, s) for s in range(4)]  # each step once, in order
    assert backend2.pushed[0] == 2  # the resumed run's first push: the checkpoint's weights
    assert backend2.versions[0] == 2  # its first rollout sampled from them


@pytest.mark.parametrize(
    "overrides, match",
    [
        (("rollout.max_staleness=2",), "max_staleness' = 2 needs rollout.overlap=1"),
        (("rollout.overlap=1", "rollout.max_staleness=2"), "needs cppo.tis_cap > 0"),
        (
            (*AHEAD, "rollout.overlap=1", "data.skip_zero_variance=true"),
            "max_staleness' = 2 is not supported with data.skip_zero_variance",
        ),
        (
            (*AHEAD, "rollout.overlap=1", "rollout.temperature=0.7"),
            "tis_cap' = 2.0 needs rollout.temperature=1",
        ),
        (("rollout.overlap=1", "rollout.push_every=2"), "push_every' = 2 is invalid with"),
        (("rollout.max_staleness=0",), "rollout.max_staleness"),
    ],
)
def test_max_staleness_refuses_what_it_cannot_correct(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        small_config(
            tmp_path,
            tmp_path / "model",
            "rollout.backend=vllm",
            "rollout.vllm_url=http://127.0.0.1:9",
            *overrides,
        )
