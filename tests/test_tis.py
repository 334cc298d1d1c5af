"""Truncated importance sampling (`cppo.tis_cap`): the weights, the loss and the trainer's wiring.

The weight of a token is w = min(pi_old / pi_behav, cap), pi_behav the policy that really sampled it (the
rollout engine, or a stale snapshot with `rollout.overlap=1`). The estimator is checked by enumeration over a
categorical distribution (no Monte Carlo), the loss's gradient by hand, and the trainer's batches against
log-probs recomputed here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cppo_jax.algo import cppo, loss
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import apply_overrides
from cppo_jax.config.schema import Config, CPPOConfig
from tests.helpers import prune_inputs

try:
    from test_overlap import overlap_trainer
    from test_trainer import small_config
except ImportError:  # tests/ became a package
    from tests.test_overlap import overlap_trainer
    from tests.test_trainer import small_config

EPS32 = float(np.finfo(np.float32).eps)


def _weights(pi_V, b_V, cap):
    """tis_weights of each token of a categorical distribution (one row, float32)."""
    old = jnp.log(jnp.asarray(pi_V, jnp.float32))[None]
    behav = jnp.log(jnp.asarray(b_V, jnp.float32))[None]
    return np.asarray(loss.tis_weights(old, behav, jnp.ones_like(old), cap))[0].astype(np.float64)


# --------------------------------------------------------------------------- the estimator


def test_weights_make_the_behaviour_expectation_the_target_one_by_enumeration():
    """E_b[w f] = E_pi[f] with no cap; with cap c it is sum_x min(pi(x), c b(x)) f(x). Dyadic numbers:
    the only rounding is the log/exp of the weights, a few float32 ulps each."""
    b = np.array([0.5, 0.25, 0.125, 0.125])
    pi = np.array([0.125, 0.25, 0.125, 0.5])
    f = np.array([1.0, 2.0, 3.0, 4.0])
    tol = 8 * EPS32  # log and exp of each weight in float32, then a sum of 4 terms
    assert np.sum(b * _weights(pi, b, np.inf) * f) == pytest.approx(3.0, rel=tol)  # E_pi f
    # cap 2: only the last token (ratio 4) is truncated, losing (pi - 2 b) f = (0.5 - 0.25) 4 = 1.
    assert np.sum(b * _weights(pi, b, 2.0) * f) == pytest.approx(2.0, rel=tol)
    # cap 1: min(pi, b) f = 0.125 + 0.5 + 0.375 + 0.5.
    assert np.sum(b * _weights(pi, b, 1.0) * f) == pytest.approx(1.5, rel=tol)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [np.inf, 1.0, 1.5, 4.0])
def test_truncated_expectation_matches_the_closed_form(seed, cap):
    gen = np.random.default_rng(seed)
    V = 16
    b = gen.dirichlet(np.ones(V)).astype(np.float32).astype(np.float64)
    pi = gen.dirichlet(np.ones(V)).astype(np.float32).astype(np.float64)
    f = gen.normal(size=V)
    got = np.sum(b * _weights(pi, b, cap) * f)
    want = np.sum(np.minimum(pi, cap * b) * f)
    if cap == np.inf:
        assert want == pytest.approx(np.sum(pi * f), rel=1e-12)
    else:
        assert (pi > cap * b).any()  # the cap bites somewhere
    # Each weight is off by a few ulps; the sum's error is bounded by that times sum |b w f|.
    scale = np.sum(np.abs(np.minimum(pi, cap * b) * f))
    assert abs(got - want) <= 8 * EPS32 * scale


# --------------------------------------------------------------------------- the loss

_LOSS = jax.jit(
    loss.policy_loss, static_argnames=("loss_type", "eps_low", "eps_high", "beta", "tis_cap")
)


def _batch(seed, M=4, C=7):
    gen = np.random.default_rng(seed)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    logp = gen.uniform(-3.0, -0.1, size=(M, C))
    old = logp + gen.uniform(-0.4, 0.4, size=(M, C))  # ratios inside and outside the clip
    ref_logp = logp + gen.uniform(-0.3, 0.3, size=(M, C))
    behav = old + gen.uniform(-1.5, 1.5, size=(M, C))  # pi_old / pi_behav in [0.22, 4.5]
    adv = np.array([1.3, -0.7, 0.4, -1.9])[:M]
    mask = (gen.uniform(size=(M, C)) < 0.8).astype(np.float32)
    return tuple(map(f32, (logp, old, ref_logp, adv, mask, behav)))


@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_is_the_weighted_pg_gradient_plus_the_unweighted_kl(seed):
    logp, old, ref_logp, adv, mask, behav = _batch(seed)
    cap, beta, eps = 2.0, 0.04, 0.2

    def f(logp_, old_, behav_):
        return _LOSS(
            logp_, old_, ref_logp, adv, mask, beta=beta, behav_logp_MC=behav_, tis_cap=cap
        )[0]

    g_logp, g_old, g_behav = jax.grad(f, argnums=(0, 1, 2))(logp, old, behav)
    # The weights (and the old log-probs) are constants of the update: no gradient reaches them.
    assert not np.any(np.asarray(g_behav)) and not np.any(np.asarray(g_old))
    # By hand (token_mean): d/dlogp of w * -min(r A, clip(r) A) is -w r A where the unclipped branch is
    # the active one, else 0; the k3 KL term adds beta (1 - exp(ref - logp)), unweighted.
    lp, o, rf, a, m, bh = (
        np.asarray(x, np.float64) for x in (logp, old, ref_logp, adv, mask, behav)
    )
    r = np.exp(lp - o)
    w = np.minimum(np.exp(o - bh), cap)
    A = a[:, None]
    active = (np.abs(r - 1) <= eps) | (r * A < np.clip(r, 1 - eps, 1 + eps) * A)
    want = m / m.sum() * (-w * r * A * active + beta * (1 - np.exp(rf - lp)))
    assert (w >= cap).any() and (w < 1).any() and (~active & (m > 0)).any()  # every case is hit
    # float32 throughout: each term is a few roundings off; compare relative to the gradient's scale.
    np.testing.assert_allclose(
        np.asarray(g_logp), want, rtol=0, atol=16 * EPS32 * np.abs(want).max()
    )


def test_clipped_frac_counts_exactly_the_tokens_above_the_cap():
    M, C = 3, 5
    # log ratios old - behav per token: well above/below log 2, and exactly 0 (ratio exactly 1).
    log_ratio = np.array(
        [[1.2, 0.0, -0.5, 0.9, 3.0], [0.0, 0.0, 0.3, 2.0, -2.0], [0.8, 1.0, 0.0, -1.0, 5.0]]
    )
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float32)
    old = np.full((M, C), -1.0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    logp, behav = f32(old), f32(old - log_ratio)
    adv = f32([0.5, -1.0, 2.0])
    for cap in (1.0, 2.0):
        _, metrics = _LOSS(
            logp, f32(old), None, adv, f32(mask), beta=0.0, behav_logp_MC=behav, tis_cap=cap
        )
        ratio = np.exp(log_ratio)
        above = (ratio > cap) & (mask > 0)  # a ratio of exactly 1 with cap 1 is not above it
        assert metrics["tis/clipped_frac"] == pytest.approx(above.sum() / mask.sum(), rel=EPS32)
        want_w = (np.minimum(ratio, cap) * mask).sum() / mask.sum()
        assert metrics["tis/weight_mean"] == pytest.approx(want_w, rel=8 * EPS32)
    # Masked-out tokens weigh 0 and never count (the 5.0 and 3.0 log ratios are masked).
    w = np.asarray(loss.tis_weights(f32(old), behav, f32(mask), 2.0))
    assert np.all(w[mask == 0] == 0) and np.all(w[mask > 0] > 0)


def test_tis_off_leaves_the_loss_and_its_program_unchanged():
    logp, old, ref_logp, adv, mask, behav = _batch(3)
    base = _LOSS(logp, old, ref_logp, adv, mask, beta=0.04)
    off = _LOSS(logp, old, ref_logp, adv, mask, beta=0.04, behav_logp_MC=behav, tis_cap=0.0)
    assert set(off[1]) == set(base[1]) and not any(k.startswith("tis/") for k in base[1])
    for k in base[1]:
        assert np.asarray(off[1][k]) == np.asarray(base[1][k]), k
    assert np.asarray(off[0]) == np.asarray(base[0])

    # The traced program: the behaviour log-probs are an unused input, nothing else changes.
    def program(tis_cap, with_behav):
        def fn(lp, b):
            kw = {"behav_logp_MC": b, "tis_cap": tis_cap} if with_behav else {}
            return loss.policy_loss(lp, old, ref_logp, adv, mask, beta=0.04, **kw)

        return [str(e) for e in jax.make_jaxpr(fn)(logp, behav).jaxpr.eqns]

    assert program(0.0, True) == program(0.0, False)
    assert program(2.0, True) != program(0.0, False)
    # On-policy sampler (behav == old): every weight is exactly 1 and the loss is the plain one.
    same = _LOSS(logp, old, ref_logp, adv, mask, beta=0.04, behav_logp_MC=old, tis_cap=2.0)
    assert np.asarray(same[0]) == np.asarray(base[0])
    assert same[1]["tis/weight_mean"] == 1.0 and same[1]["tis/clipped_frac"] == 0.0


def test_policy_loss_refuses_tis_without_behaviour_logps():
    logp, old, _, adv, mask, _ = _batch(0)
    with pytest.raises(ValueError, match="tis_cap=2.0 needs behav_logp_MC"):
        loss.policy_loss(logp, old, None, adv, mask, beta=0.0, tis_cap=2.0)
    with pytest.raises(ValueError, match="tis_cap must be a static Python float"):
        loss.policy_loss(logp, old, None, adv, mask, beta=0.0, behav_logp_MC=old, tis_cap=-1.0)


# --------------------------------------------------------------------------- the kept rows


@pytest.mark.parametrize("scope", ["question", "slice", "batch"])
def test_prune_gathers_the_samplers_logps_of_the_kept_rows(scope):
    Q, G, P, C = 6, 4, 3, 5
    algo = CPPOConfig(
        num_generations=G, questions_per_step=Q, pruning_rate=0.5, scope=scope, slices=3
    )
    shapes = cppo.step_shapes(algo, P, C)
    rewards_QG, *rest = prune_inputs(Q, G, P, C, seed=2)
    tokens_NC = rest[2]
    logp_NC = -np.random.default_rng(3).uniform(0.1, 5.0, size=(Q * G, C)).astype(np.float32)
    args = (rewards_QG, jax.random.PRNGKey(0), *rest)
    out = cppo.prune(*args, logp_NC, shapes=shapes, algo=algo)
    kept = np.asarray(out.kept).reshape(-1)
    assert len(set(kept // G)) > 1  # rows of several questions: a wrong gather would show
    np.testing.assert_array_equal(out.behav_logp_MC, logp_NC[kept])
    np.testing.assert_array_equal(out.tokens_MT[:, P:], tokens_NC[kept])
    assert cppo.prune(*args, shapes=shapes, algo=algo).behav_logp_MC is None  # tis off


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("value", ["0.5", "-1", "nan", "inf"])
def test_config_refuses_a_bad_cap(value):
    with pytest.raises(ConfigError, match=r"'cppo.tis_cap' = .* allowed 0 \(off\) or a finite"):
        apply_overrides(Config(), [f"cppo.tis_cap={value}"])


def test_config_accepts_caps_and_refuses_vllm_logprobs_at_another_temperature():
    assert apply_overrides(Config(), ["cppo.tis_cap=1"]).cppo.tis_cap == 1.0
    assert apply_overrides(Config(), ["cppo.tis_cap=2.5"]).cppo.tis_cap == 2.5
    vllm = ["rollout.backend=vllm", "rollout.vllm_url=http://127.0.0.1:9", "cppo.tis_cap=2"]
    with pytest.raises(ConfigError, match=r"'cppo.tis_cap' = 2.0 needs rollout.temperature=1"):
        apply_overrides(Config(), [*vllm, "rollout.temperature=0.7"])
    # Overlap: the trainer computes the behaviour log-probs itself, at the right temperature.
    cfg = apply_overrides(Config(), [*vllm, "rollout.temperature=0.7", "rollout.overlap=1"])
    assert cfg.cppo.tis_cap == 2.0
    assert apply_overrides(Config(), vllm).rollout.temperature == 1.0


# --------------------------------------------------------------------------- the trainer


def _spy(trainer):
    """Record (params before the step's updates, batch) of every train_step call (one a step), as
    host copies."""
    seen, inner = [], trainer.actor.train_step

    def spy(params, opt_state, batch):
        params_host = jax.tree.map(np.asarray, params)  # before the update donates them
        seen.append((params_host, jax.tree.map(np.asarray, batch)))
        return inner(params, opt_state, batch)

    trainer.actor = dataclasses.replace(trainer.actor, train_step=spy)
    trainer.phase_split = True  # the programs apart, so the updates' batch is seen
    return seen


@pytest.mark.slow
def test_embedded_sampler_weights_are_one(tmp_path, arith_model_dir):
    """Without overlap the behaviour log-probs are the embedded sampler's: the same float32 model the
    trainer recomputes with, so every weight is 1 up to rounding accumulated over the sequence."""
    from cppo_jax.train.trainer import Trainer

    cfg = small_config(tmp_path, arith_model_dir, "cppo.tis_cap=2", "trainer.steps=2")
    trainer = Trainer(cfg)
    seen = _spy(trainer)
    try:
        rows = [trainer.step(s) for s in range(2)]
    finally:
        trainer.close()
    T = trainer.shapes.P + trainer.shapes.C
    tol = T * EPS32  # float32 rounding of a T-token forward pass, relative to a weight of 1
    assert len(seen) == 2
    for params, batch in seen:
        assert batch.old_logp_MC is None  # mu = 1: the old policy is the current one, in the step
        now = np.asarray(trainer.actor.logps(params, batch.tokens_MT, batch.valid_MT))
        on = batch.mask_MC > 0
        w = np.exp(now - batch.behav_logp_MC)[on]
        assert on.sum() > 0 and np.max(np.abs(w - 1)) <= tol, np.max(np.abs(w - 1))
    for row in rows:
        assert abs(row["tis/weight_mean"] - 1) <= tol and row["tis/clipped_frac"] == 0.0
        assert np.isfinite(row["loss"])


@pytest.mark.slow
def test_overlap_corrects_the_stale_batch_by_truncated_is(tmp_path, arith_model_dir):
    """overlap=1 with tis: behaviour = the snapshot that sampled (recomputed exactly), old = the current
    params (mu = 2: the first update's forward, kept for the second); the stale steps' weights move
    off 1."""
    trainer, backend = overlap_trainer(
        tmp_path, arith_model_dir, "cppo.tis_cap=2", "cppo.mu=2", "trainer.steps=3"
    )
    seen = _spy(trainer)
    try:  # the steps alone: `train` would add the evaluations' generations to the backend's record
        rows = [trainer.step(s) for s in range(3)]
    finally:
        trainer.close()
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert len(seen) == 3 and len(backend.sampled_with) == 3  # one train program a step
    starts = [seen[s][0] for s in range(3)]  # the params at the start of each step's updates
    sampled_by = [starts[0], starts[0], starts[1]]
    for s in range(3):
        batch = seen[s][1]
        for a, b in zip(jax.tree.leaves(sampled_by[s]), jax.tree.leaves(backend.sampled_with[s])):
            np.testing.assert_array_equal(a, b)
        tokens, valid = batch.tokens_MT, batch.valid_MT
        behav, old = (
            np.asarray(trainer.actor.logps(p, tokens, valid)) for p in (sampled_by[s], starts[s])
        )
        on = batch.mask_MC > 0
        np.testing.assert_array_equal(batch.behav_logp_MC, behav)
        # The old policy: the current params, from the first update's own forward in the train step
        # (kept for the second; `test_step` pins that they are the log-prob program's within
        # float32 rounding of two programs, 64 ulps of the largest log-prob).
        assert batch.old_logp_MC is None
        scale = max(1.0, float(np.abs(old[on]).max()))
        w = np.minimum(np.exp(old - batch.behav_logp_MC), 2.0)[on]
        # The logged metrics are the last update's; its weights are the same (old, behav fixed).
        rel = (on.sum() + 64 * scale) * EPS32
        assert rows[s]["tis/weight_mean"] == pytest.approx(w.mean(), rel=rel)
        clipped = np.mean(np.exp(old - batch.behav_logp_MC)[on] > 2.0)
        assert rows[s]["tis/clipped_frac"] == pytest.approx(clipped, abs=0.5 / on.sum())
        assert np.isfinite(rows[s]["loss"])
        # The last update's policy moved from the old one (ratio != 1).
        assert rows[s]["ratio/abs_dev_mean"] > 0.0
        # Step 0 was sampled by its own params: on-policy to float32 rounding. The stale steps are
        # off-policy by far more than rounding (the weights moved by lr 1e-3 on a spread reward).
        log_w = np.abs(old - batch.behav_logp_MC)[on]
        if s == 0:
            assert np.max(log_w) <= 64 * EPS32 * scale, np.max(log_w)
        else:
            assert np.max(log_w) > 100 * on.sum() * EPS32, np.max(log_w)
