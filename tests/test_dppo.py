"""DPPO's pruning (cppo_jax/algo/dppo.py): capped inclusion probabilities, systematic draws whose
inclusion frequencies are exactly those probabilities, and an enumeration of every outcome of the
prompt and completion draws showing that the rescaled estimator's expectation is the unpruned
policy-gradient (the gradient of `loss.policy_loss` over all Q * G completions)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cppo_jax.algo import cppo, dppo, loss
from cppo_jax.config.schema import ConfigError, CPPOConfig
from tests import reference_numpy as ref
from tests.helpers import prune_inputs

EPS32 = float(np.finfo(np.float32).eps)
# The functions under test, each compiled once per shape (called op by op they compile every op).
inclusion_probs = jax.jit(dppo.inclusion_probs, static_argnums=1)
systematic_indices = jax.jit(dppo.systematic_indices, static_argnums=1)
trained_advantages = jax.jit(dppo.trained_advantages, static_argnums=2)


def outcomes(pi_G: np.ndarray, n: int) -> list[tuple[float, tuple[int, ...]]]:
    """Every outcome of one systematic draw with its exact probability: the drawn set is constant
    between the fractional parts of the cumulative probabilities, so u is enumerated by interval
    (its midpoint through `dppo.systematic_indices` itself, its length as the probability)."""
    cum = np.cumsum(pi_G.astype(np.float32)).astype(np.float64)
    cum = cum * (n / cum[-1])
    cuts = np.unique(np.concatenate([[0.0, 1.0], np.mod(cum, 1.0)]))
    out = []
    for a, b in itertools.pairwise(cuts):
        u = jnp.full((1,), (a + b) / 2, jnp.float32)
        idx = np.asarray(systematic_indices(jnp.asarray(pi_G)[None], n, u))[0]
        out.append((b - a, tuple(int(i) for i in idx)))
    return out


def test_inclusion_probs_are_capped_proportional_and_sum_to_n():
    s_XG = np.array(
        [[9.0, 1, 0.5, 0.5, 0, 0.25, 2], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 3, 0, 0]], np.float32
    )
    for n in (1, 2, 3, 7):
        pi = np.asarray(inclusion_probs(jnp.asarray(s_XG), n))
        np.testing.assert_allclose(pi.sum(-1), n, rtol=8 * EPS32)
        assert np.all((pi >= 0) & (pi <= 1))
        free = (pi < 1) & (s_XG[0:1] > 0)  # row 0: the uncapped share one factor c
        c = pi[0][free[0]] / s_XG[0][free[0]]
        assert c.size == 0 or np.ptp(c) <= 8 * EPS32 * c.max()  # (none free at n = 7)
        np.testing.assert_allclose(pi[1], n / 7, rtol=8 * EPS32)
        # one positive score: it is kept surely, the other places spread over the zeros
        np.testing.assert_allclose(pi[2], np.where(s_XG[2] > 0, 1.0, (n - 1) / 6), rtol=8 * EPS32)
    assert np.asarray(inclusion_probs(jnp.asarray(s_XG), 2))[0, 0] == 1.0  # 9 / 13.5 > 1/2
    with pytest.raises(ValueError, match="n"):
        dppo.inclusion_probs(jnp.asarray(s_XG), 8)


def test_systematic_draws_n_distinct_units_with_probability_pi():
    gen = np.random.default_rng(3)
    for G, n in [(7, 2), (5, 3), (11, 4)]:
        score = gen.random(G).astype(np.float32) * (gen.random(G) < 0.8)
        pi = np.asarray(inclusion_probs(jnp.asarray(score[None]), n))[0]
        freq = np.zeros(G)
        total = 0.0
        for p, idx in outcomes(pi, n):
            assert len(set(idx)) == n and list(idx) == sorted(idx)
            freq[list(idx)] += p
            total += p
        assert total == pytest.approx(1.0, abs=4 * EPS32)
        np.testing.assert_allclose(freq, pi, atol=4 * G * EPS32)


def _grad_fn(loss_type: str, C: int):
    def surrogate(logp_NC, rows_M, adv_M, mask_NC):
        logp_MC = logp_NC[rows_M]
        value, _ = loss.policy_loss(
            logp_MC,
            logp_MC,
            None,
            adv_M,
            mask_NC[rows_M],
            loss_type=loss_type,
            beta=0.0,
            max_completion_len=C,
        )
        return value

    return jax.jit(jax.grad(surrogate))


@pytest.mark.parametrize("loss_type", ["seq_mean", "dr_grpo"])
def test_enumerated_expectation_of_the_rescaled_estimator_is_the_full_gradient(loss_type):
    """Q = 3 groups of G = 4, U = 2 trained, K = 2 kept each: sum over every (prompt draw,
    completion draws) outcome of probability * gradient equals the gradient of the loss over all
    12 completions; without the rescaling (the same draws, plain A) it does not."""
    Q, G, U, K, C = 3, 4, 2, 2, 5
    gen = np.random.default_rng(11)
    rewards_QG = np.array([[0, 1, 1, 2], [0, 0, 0, 1], [0, 0, 3, 1]], np.float32)
    scale = "none" if loss_type == "dr_grpo" else "group"
    adv_QG = cppo.group_advantages(jnp.asarray(rewards_QG), scale=scale)
    logp_NC = jnp.asarray(-gen.random((Q * G, C)), jnp.float32)
    mask_NC = jnp.asarray(np.cumsum(gen.random((Q * G, C)) < 0.25, axis=1) == 0, jnp.float32)
    mask_NC = mask_NC.at[:, 0].set(1.0)
    grad = _grad_fn(loss_type, C)
    full = np.asarray(grad(logp_NC, jnp.arange(Q * G), adv_QG.reshape(-1), mask_NC))

    rho_Q = np.asarray(jax.jit(dppo.prompt_probs, static_argnums=1)(adv_QG, U))
    mean_rescaled, mean_plain, biggest, count = 0.0, 0.0, 0.0, 0
    for p_q, groups in outcomes(rho_Q, U):
        groups_U = jnp.asarray(groups, jnp.int32)
        adv_UG, trained_UG = trained_advantages(adv_QG, groups_U, K)
        pi_UG = np.asarray(inclusion_probs(jnp.abs(adv_UG), K))
        per_group = [outcomes(pi_UG[u], K) for u in range(U)]
        for draws in itertools.product(*per_group):
            p = p_q * np.prod([d[0] for d in draws])
            idx_UK = np.array([d[1] for d in draws])
            rows_M = jnp.asarray((np.asarray(groups)[:, None] * G + idx_UK).reshape(-1))
            trained_M, plain_M = (
                jnp.take_along_axis(x_UG, jnp.asarray(idx_UK), 1).reshape(-1)
                for x_UG in (trained_UG, adv_UG)
            )
            g = np.asarray(grad(logp_NC, rows_M, trained_M, mask_NC))
            mean_rescaled = mean_rescaled + p * g
            mean_plain = mean_plain + p * np.asarray(grad(logp_NC, rows_M, plain_M, mask_NC))
            biggest = max(biggest, float(np.abs(g).max()))
            count += 1
    assert count > 1
    # Each outcome's gradient is exact to a few float32 roundings of its largest entry; the pi
    # and the enumerated probabilities agree to a few eps: summed over the outcomes, with margin.
    tol = 4 * count * EPS32 * biggest
    np.testing.assert_allclose(mean_rescaled, full, rtol=0, atol=tol)
    assert np.abs(mean_plain - full).max() > 100 * tol  # the rescaling is what makes it unbiased


def test_prune_with_dppo_trains_the_drawn_groups_with_rescaled_advantages():
    G, P, C = 4, 2, 3
    algo = CPPOConfig(
        num_generations=G,
        questions_per_step=2,
        pruning_rate=0.5,
        allocation=True,
        metric="dppo",
        prompt_rate=0.5,
    )
    shapes = cppo.step_shapes(algo, P, C)
    assert (shapes.Q, shapes.U, shapes.k, shapes.M) == (8, 4, 2, 8)
    inputs = list(prune_inputs(shapes.Q, G, P, C, seed=5, rewards=(0.0, 1.0)))
    inputs[0][[1, 6]] = 1.0  # two zero-variance groups: probability 0, never trained
    out = cppo.prune(inputs[0], jax.random.key(3), *inputs[1:], shapes=shapes, algo=algo)
    groups = np.asarray(out.groups_U)
    assert len(set(groups.tolist())) == shapes.U and not {1, 6} & set(groups.tolist())
    adv_QG = ref.group_advantages(inputs[0])
    np.testing.assert_allclose(out.adv_UG, adv_QG[groups], rtol=16 * EPS32, atol=16 * EPS32)
    _, trained_UG = trained_advantages(jnp.asarray(adv_QG), jnp.asarray(groups), shapes.k)
    kept = np.asarray(out.kept).reshape(shapes.U, shapes.k)
    assert np.all(kept // G == groups[:, None])
    want = np.take_along_axis(np.asarray(trained_UG), kept % G, axis=1).reshape(-1)
    np.testing.assert_allclose(out.adv_M, want, rtol=16 * EPS32)
    np.testing.assert_array_equal(out.tokens_MT[:, P:], inputs[3][kept.reshape(-1)])


def test_dppo_config_is_validated_and_shapes_are_exact():
    with pytest.raises(ConfigError, match="cppo.prompt_rate"):
        CPPOConfig(prompt_rate=0.5)  # metric "smallest"
    with pytest.raises(ConfigError, match="cppo.prompt_rate"):
        CPPOConfig(metric="dppo", prompt_rate=1.0)
    with pytest.raises(ConfigError, match="cppo.filter_groups"):
        CPPOConfig(metric="dppo", filter_groups=True)
    with pytest.raises(ConfigError, match="cppo.metric"):
        CPPOConfig(metric="dppo", scope="batch")
    # the benchmark's row: b = 4, p = 0.75 with allocation, r_q = 0.5: 16 of 32, k = 4
    algo = CPPOConfig(pruning_rate=0.75, allocation=True, metric="dppo", prompt_rate=0.5)
    sh = cppo.step_shapes(algo, 8, 8)
    assert (sh.Q, sh.U, sh.k, sh.M) == (32, 16, 4, 64)
    sh = cppo.step_shapes(CPPOConfig(questions_per_step=3, metric="dppo", prompt_rate=0.9), 8, 8)
    assert (sh.Q, sh.U) == (30, 3)  # floor(3 / (1 - 0.9)) in exact arithmetic
