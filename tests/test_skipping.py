"""GRESO prompt skipping (`cppo_jax.data.skipping`): the p^z rule, p's adaptation, the fixed batch shape,
exploration, exact resume (unit, and a trainer resumed from its checkpoint), metrics, config errors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from cppo_jax.config.choices import ConfigError
from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.data.skipping import PromptSkipper, easy_of, resume, zero_variance
from tests.test_trainer import small_config

EPS64 = float(np.finfo(np.float64).eps)
G = 4


def _rewards(ids, informative) -> np.ndarray:
    """[Q, G] rewards: a spread for the questions `informative(id)`, all 0 (hard) otherwise."""
    r_QG = np.zeros((len(ids), G))
    for q, qid in enumerate(ids):
        if informative(int(qid)):
            r_QG[q, 0] = 1.0
    return r_QG


@pytest.mark.parametrize("z, easy, p", [(1, True, 0.7), (2, False, 0.5), (3, False, 0.5)])
def test_a_question_with_z_zero_variance_outcomes_is_rolled_out_with_probability_p_to_the_z(
    z, easy, p
):
    """Question 0 (z frozen: nothing recorded) is taken on a fraction p^z of its appearances in the
    stream, over 4 seeds x 700 epochs; tolerance 5 binomial standard deviations."""
    n, Q = 8, 2
    taken = appeared = 0
    for seed in range(4):
        sk = PromptSkipper(n, Q, seed=seed, shuffle=False)  # stream = range(n) each epoch
        sk.z_n[0], sk.easy_n[0] = z, easy
        sk.p_easy, sk.p_hard = (p, 0.9) if easy else (0.9, p)
        while sk.cursor < 700 * n:
            ids, _ = sk.draw()
            assert len(ids) == Q
            taken += ids.count(0)
        appeared += -(-sk.cursor // n)  # question 0 is each epoch's first candidate
    want = p**z
    sigma = math.sqrt(want * (1 - want) / appeared)
    assert abs(taken / appeared - want) <= 5 * sigma, (taken, appeared, want)


def test_p_adapts_toward_the_target_share_and_stays_in_its_bounds():
    n, Q = 12, 6
    sk = PromptSkipper(n, Q, seed=0, target=0.3, delta_p=0.05)
    tol = 8 * EPS64
    ids = sk.ids(0)
    # Every question zero-variance and easy: share 1 > alpha_easy = 0.1; hard share 0 <= 0.2.
    m = sk.record(0, np.ones((Q, G)), np.ones(Q, bool))
    assert m["skip/p_easy"] == pytest.approx(0.45, rel=tol)
    assert m["skip/p_hard"] == pytest.approx(0.55, rel=tol)
    assert m["skip/zero_variance_frac"] == 1.0
    assert all(sk.z_n[i] == 1 and sk.easy_n[i] for i in ids)
    # One hard zero-variance question of 6 (share 1/6 <= 0.2): p_hard still rises, p_easy too.
    ids = sk.ids(1)
    r_QG = _rewards(ids, lambda qid: qid != ids[0])
    m = sk.record(1, r_QG, easy_of(r_QG))
    assert (m["skip/p_easy"], m["skip/p_hard"]) == pytest.approx((0.5, 0.6), rel=tol)
    assert sk.z_n[ids[0]] >= 1 and not sk.easy_n[ids[0]]
    assert all(sk.z_n[i] == 0 for i in ids[1:])  # a spread resets z
    # Two hard of 6 (1/3 > 0.2): p_hard falls.
    ids = sk.ids(2)
    m = sk.record(2, _rewards(ids, lambda qid: qid not in ids[:2]), np.zeros(Q, bool))
    assert m["skip/p_hard"] == pytest.approx(0.55, rel=tol)
    # Clipped to [delta_p, 1].
    for step in range(3, 60):
        sk.ids(step)
        m = sk.record(step, np.zeros((Q, G)), np.zeros(Q, bool))
    assert m["skip/p_hard"] == pytest.approx(0.05, rel=tol) and m["skip/p_easy"] == 1.0


@pytest.mark.slow
def test_the_batch_is_always_q_and_every_question_keeps_coming_back_when_all_is_zero_variance():
    """Nearly everything skipped: a pass that cannot fill the batch fills it with the smallest z, so
    the shape holds and the questions take turns (z never more than 1 apart once p is at its floor,
    when coins pass with probability 0.01^z, z > 10)."""
    n, Q = 13, 4
    sk = PromptSkipper(n, Q, seed=5)
    last_drawn = np.zeros(n, int)
    skipped = []
    for step in range(120):
        ids = sk.ids(step)
        assert ids.shape == (Q,) and ((ids >= 0) & (ids < n)).all()
        assert len(set(ids.tolist())) == Q  # distinct, also when a pass straddles two epochs
        last_drawn[ids] = step
        m = sk.record(step, np.full((Q, G), 0.5), np.zeros(Q, bool))  # all zero variance, hard
        skipped.append(m["skip/skipped"])
        if step >= 60:  # p_hard reached its floor after (0.5 - 0.01) / 0.01 = 49 steps
            assert m["skip/p_hard"] == pytest.approx(0.01, rel=8 * EPS64)
            assert sk.z_n.max() - sk.z_n.min() <= 1, sk.z_n
            # Drawn again within 2 ceil(n / Q) steps: the others at its old z catch up (one
            # round), then its turn comes in the next round (ties go in stream order).
            assert (step - last_drawn).max() <= 2 * -(-n // Q), last_drawn
    assert max(skipped) > 0
    assert all(sk.p_of(q) > 0 for q in range(n))  # exploration never reaches 0


def test_without_zero_variance_the_draws_are_the_plain_order_and_a_plain_run_resumes_there():
    """No question ever zero-variance: nothing is skipped and the ids are `question_order`'s; a
    checkpoint of a run without skipping (no state) continues from the plain order's position."""
    n, Q = 12, 4  # n % Q == 0: no step straddles two epochs
    plain = pipeline.question_order(n, Q, seed=7, shuffle=True)
    sk = PromptSkipper(n, Q, seed=7)
    for step in range(9):
        assert sk.ids(step).tolist() == plain[step].tolist()
        m = sk.record(step, _rewards(sk.ids(step), lambda qid: True), np.zeros(Q, bool))
        assert m["skip/skipped"] == 0 and m["skip/zero_variance_frac"] == 0
    late = PromptSkipper(n, Q, seed=7)
    resume(late, None, 5)
    assert late.ids(5).tolist() == plain[5].tolist()


def _play(sk: PromptSkipper, steps: range, lagged: bool) -> list[list[int]]:
    """Draw and record `steps` (rewards a fixed function of the ids); `lagged`: step s + 1 drawn
    before step s is recorded, as the trainer does with rollout.overlap = 1."""
    out = []
    for step in steps:
        if lagged:
            sk.ids(step + 1)
        ids = sk.ids(step)
        out.append(ids.tolist())
        r_QG = _rewards(ids, lambda qid: qid % 3 == 0)
        r_QG[[qid % 5 == 0 for qid in ids]] = 1.0  # some easy ones too
        sk.record(step, r_QG, easy_of(r_QG))
    return out


@pytest.mark.parametrize("lagged", [False, True])
def test_state_dict_round_trip_continues_with_the_same_draws(lagged):
    n, Q = 17, 3
    whole = PromptSkipper(n, Q, seed=2, p_init=0.3)
    expected = _play(whole, range(40), lagged)
    first = PromptSkipper(n, Q, seed=2, p_init=0.3)
    got = _play(first, range(15), lagged)
    state = json.loads(json.dumps(first.state_dict()))  # through JSON, as in checkpoint meta
    resumed = PromptSkipper(n, Q, seed=2, p_init=0.3)
    resumed.load_state_dict(state)
    got += _play(resumed, range(15, 40), lagged)
    assert got == expected
    assert resumed.state_dict() == whole.state_dict()
    assert any(
        ids != pipeline.question_order(n, Q, 2, True)[s].tolist() for s, ids in enumerate(got)
    )
    for bad in (PromptSkipper(n, Q, seed=3), PromptSkipper(n + 1, Q, seed=2)):
        with pytest.raises(ConfigError, match=r"data\.seed|training questions"):
            bad.load_state_dict(state)


def test_zero_variance_and_easy_signals():
    r_QG = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [2.0, 1.0, 2.0], [0.5, 0.5, 0.5]])
    assert zero_variance(r_QG).tolist() == [True, True, False, True]
    assert easy_of(r_QG).tolist() == [True, False, True, True]
    correct_N = np.array([1, 1, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0])  # the accuracy reward, flat [Q G]
    assert easy_of(r_QG, correct_N).tolist() == [True, False, False, False]


@pytest.mark.parametrize(
    "key, value",
    [("skip_p_init", 0), ("skip_p_init", 1.5), ("skip_target", 0), ("skip_delta_p", -0.01)],
)
def test_bad_skip_values_are_refused_naming_the_key(tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"data\.{key}"):
        small_config(tmp_path, tmp_path, f"data.{key}={value}")


def test_more_questions_per_step_than_training_questions_is_refused():
    with pytest.raises(ConfigError, match=r"cppo\.questions_per_step"):
        PromptSkipper(3, 4, seed=0)


def _skipping_trainer(tmp_path, model_dir, name: str, steps: int, *extra: str):
    """A trainer skipping over 8 questions (2 steps an epoch, so questions come back), its run
    folder tmp_path / name."""
    from cppo_jax.train.trainer import Trainer

    cfg = small_config(
        tmp_path,
        model_dir,
        "data.num_train=8",
        "data.skip_zero_variance=true",
        "data.skip_p_init=0.05",
        f"trainer.steps={steps}",
        f"trainer.run_name={name}",
        *extra,
    )
    return Trainer(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0, 1])
def test_trainer_resume_draws_the_same_questions_and_logs_skip_metrics(
    tmp_path, arith_model_dir, overlap
):
    """6 steps with skipping, checkpointed after step 3: a trainer resumed from that checkpoint
    draws and records, event for event, what the uninterrupted one did after it, and ends in the
    same skipper state. With rollout.overlap=1 (the embedded sampler behind test_overlap's recording
    wrapper, slowed so that the next step's rollout runs while this step trains) step s + 1 is
    drawn before step s is recorded. Every step logs the skip metrics, documented."""
    from cppo_jax.rollout.backend import EmbeddedBackend
    from tests.test_overlap import RecordingBackend

    server = ["rollout.backend=vllm", "rollout.vllm_url=http://127.0.0.1:9"]  # never contacted
    extra = [*server, "rollout.overlap=1"] if overlap else []

    def spied(*resume: str):
        """The trainer (its skipper's draws and records noted in `events`) and `events`."""
        trainer = _skipping_trainer(tmp_path, arith_model_dir, "run", 6, *extra, *resume)
        if overlap:
            trainer.rollout = dataclasses.replace(
                trainer.rollout,
                backend=RecordingBackend(
                    EmbeddedBackend(trainer.actor.graphdef, trainer.rollout.sp), 0.2
                ),
            )
        sk, events = trainer.data.skipper, []
        draw, record = sk.draw, sk.record

        def spy_draw():  # the real draw, noted (the step it is for: sk.next_step)
            ids, skipped = draw()
            events.append(("draw", sk.next_step, ids))
            return ids, skipped

        def spy_record(step, *args):
            events.append(("record", step))
            return record(step, *args)

        sk.draw, sk.record = spy_draw, spy_record
        return trainer, events

    whole, whole_events = spied()
    try:
        rows = [whole.step(s) for s in range(3)]
        whole.save(3)
        cut_at = len(whole_events)
        rows += [whole.step(s) for s in range(3, 6)]
    finally:
        whole.close()
    resumed, resumed_events = spied("trainer.resume=true")
    try:
        resumed.maybe_resume()
        assert resumed.start_step == 3
        for s in range(3, 6):
            resumed.step(s)
    finally:
        resumed.close()
    assert resumed_events == whole_events[cut_at:]
    assert resumed.data.skipper.state_dict() == whole.data.skipper.state_dict()
    order = [e[:2] for e in whole_events]
    for s in range(5):  # overlap: s + 1 drawn before s is recorded; else after
        assert (order.index(("draw", s + 1)) < order.index(("record", s))) == bool(overlap), order
    doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    for key in ("skip/skipped", "skip/p_easy", "skip/p_hard", "skip/zero_variance_frac"):
        assert all(key in row for row in rows), key
        assert f"`{key}`" in doc, f"{key} is logged but not documented in docs/metrics.md"
    assert sum(row["skip/skipped"] for row in rows) > 0  # questions came back and were skipped


@pytest.mark.slow
def test_a_stop_on_non_finite_steps_saves_the_counters_before_the_failed_step(
    tmp_path, arith_model_dir
):
    """trainer.max_nan_streak reached at step 2: the checkpoint (2 steps done) holds the skipper and
    the token count as step 2 began, so the resumed trainer records step 2's questions and counts its
    tokens once, and ends where an uninterrupted one ends."""
    import jax.numpy as jnp

    from cppo_jax.train.checkpoint import Checkpointer
    from cppo_jax.train.trainer import NonFiniteError

    def counters(trainer) -> tuple[dict, int]:
        return trainer.data.skipper.state_dict(), trainer.num_tokens

    def steps(trainer, first: int, last: int) -> None:
        for s in range(first, last):
            trainer.step(s)

    whole = _skipping_trainer(tmp_path, arith_model_dir, "whole", 4)
    try:
        steps(whole, 0, 2)
        two = counters(whole)  # as step 2 begins
        steps(whole, 2, 4)
    finally:
        whole.close()
    cut = _skipping_trainer(tmp_path, arith_model_dir, "cut", 4, "trainer.max_nan_streak=1")
    inner = cut.actor.train_step

    def poisoned(params, opt_state, batch):  # step 2's update only (params_step: done)
        if cut.params_step == 2:
            batch = batch._replace(adv_M=batch.adv_M * jnp.nan)
        return inner(params, opt_state, batch)

    cut.actor = dataclasses.replace(cut.actor, train_step=poisoned)
    cut.phase_split = True  # the programs apart, so the updates' batch is seen
    try:
        steps(cut, 0, 2)
        with pytest.raises(NonFiniteError, match="at step 3"):
            cut.step(2)
    finally:
        cut.close()
    _, meta = Checkpointer(cut.host.out_dir / "checkpoints").restore(
        None, {"params": cut.params, "opt_state": cut.opt_state}
    )
    assert meta["step"] == 2
    assert (meta["skipper"], meta["num_tokens"]) == two
    resumed = _skipping_trainer(
        tmp_path, arith_model_dir, "cut", 4, "trainer.max_nan_streak=1", "trainer.resume=true"
    )
    try:
        resumed.maybe_resume()
        assert resumed.start_step == 2
        steps(resumed, 2, 4)
    finally:
        resumed.close()
    assert counters(resumed) == counters(whole)
