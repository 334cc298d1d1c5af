"""The selection rules after CPPO (cppo_jax/algo/selection.py), pinned against plain NumPy references:
zero-variance group filtering (DAPO, static shapes), proportional sampling with re-weighting (an
unbiased pruned estimator), PODS' max-variance tie rule; and filtering inside `cppo.prune` and a run."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cppo_jax.algo import cppo, selection
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.schema import CPPOConfig
from tests import reference_numpy as ref
from tests.helpers import prune_inputs

EPS32 = float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("U", [1, 3, 6])
def test_informative_groups_against_the_reference(U):
    """Varied groups first in index order, then zero-variance ones; ties (equal rows) by index."""
    cases = [
        np.array([[1, 1, 1], [0, 1, 0], [2, 2, 2], [0, 0, 1], [5, 5, 5], [1, 0, 0]], np.float32),
        np.ones((6, 3), np.float32),  # every group zero-variance: the first U fill the batch
        np.arange(18, dtype=np.float32).reshape(6, 3),  # every group informative
        np.array([[0, 0, 0], [0, 0, 0], [0, 0, 1], [1, 1, 1], [0, 0, 0], [3, 3, 3]], np.float32),
    ]
    for r_QG in cases:
        got = np.asarray(selection.informative_groups(jnp.asarray(r_QG), U))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, ref.informative_groups(r_QG, U))
        counts = selection.filter_counts(r_QG, U)
        zero = sum(max(row) == min(row) for row in r_QG.tolist())
        assert counts["filter/zero_variance_groups"] == zero
        assert counts["filter/dropped"] == min(zero, 6 - U)
        trained_zero = sum(max(r_QG[q]) == min(r_QG[q]) for q in got)
        assert counts["filter/zero_variance_trained"] == trained_zero


def test_proportional_probabilities_and_weights_give_the_full_gradient_in_expectation():
    """Known answer, by enumeration: the expected kept-row mean of w * f under the draw
    distribution q is the full group mean (1/G) sum A f, for any per-completion term f."""
    gen = np.random.default_rng(0)
    adv_QG = gen.normal(size=(5, 8)).astype(np.float32)
    adv_QG[1] = 0.0  # a zero-variance group
    adv_QG[2, :5] = 0.0  # some completions without signal: never drawn
    q_QG = np.asarray(selection.proportional_probs(jnp.asarray(adv_QG)))
    np.testing.assert_allclose(q_QG, ref.proportional_probs(adv_QG), rtol=8 * EPS32, atol=0)
    k = 2
    w_QG = np.asarray(selection.proportional_advantages(jnp.asarray(adv_QG), k))
    f_QG = gen.normal(size=adv_QG.shape)  # stands for each completion's loss gradient
    expected_Q = np.sum(q_QG * w_QG * f_QG, axis=1)  # E over one draw = E over the mean of k
    full_Q = np.mean(adv_QG * f_QG, axis=1)
    scale = np.mean(np.abs(adv_QG * f_QG), axis=1) + np.finfo(np.float32).tiny
    assert np.all(np.abs(expected_Q - full_Q) <= 16 * EPS32 * scale)
    # k = G prunes nothing: the advantages are A itself.
    np.testing.assert_array_equal(selection.proportional_advantages(jnp.asarray(adv_QG), 8), adv_QG)


def test_proportional_draws_follow_q_with_replacement():
    G, Q, k = 5, 20000, 2
    adv = np.array([0.0, 1.0, -3.0, 0.5, 1.5], np.float32)
    adv_QG = jnp.asarray(np.tile(adv, (Q, 1)))
    idx = np.asarray(cppo.keep_indices(adv_QG, k, metric="proportional", rng=jax.random.key(3)))
    assert idx.shape == (Q, k) and idx.dtype == np.int32
    assert np.all(np.diff(idx, axis=1) >= 0)  # ascending; repeats allowed
    assert not np.any(idx == 0)  # A = 0: never drawn
    q = np.abs(adv) / np.abs(adv).sum()
    n = Q * k
    freq = np.bincount(idx.ravel(), minlength=G)
    sigma = np.sqrt(n * q * (1 - q))
    assert np.all(np.abs(freq - n * q) <= 5 * sigma + 1e-9), (freq, n * q)
    assert np.any(idx[:, 0] == idx[:, 1])  # with replacement
    again = cppo.keep_indices(adv_QG, k, metric="proportional", rng=jax.random.key(3))
    np.testing.assert_array_equal(again, idx)
    # A group of zeros draws uniformly; k = G keeps each completion once.
    zero = np.asarray(
        cppo.keep_indices(jnp.zeros((Q, G)), 1, metric="proportional", rng=jax.random.key(4))
    )
    freq0 = np.bincount(zero.ravel(), minlength=G)
    assert np.all(np.abs(freq0 - Q / G) <= 5 * np.sqrt(Q * (1 / G) * (1 - 1 / G)))
    full = cppo.keep_indices(adv_QG[:3], G, metric="proportional", rng=jax.random.key(5))
    np.testing.assert_array_equal(full, np.tile(np.arange(G), (3, 1)))
    with pytest.raises(ValueError, match="rng"):
        cppo.keep_indices(adv_QG, k, metric="proportional")
    with pytest.raises(ValueError, match="within each question"):
        cppo.keep_indices_batch(jnp.zeros(8), 4, metric="proportional")
    with pytest.raises(ConfigError, match="needs cppo.scope='question'"):
        CPPOConfig(metric="proportional", scope="slice", pruning_rate=0.5)


def test_max_variance_ties_and_all_equal_groups():
    """Equal values sort by index; among equally good splits the fewest lowest values win, so an
    all-equal group keeps its last k completions (any subset has variance 0)."""
    # compiled once per k (called op by op, every op of the rule compiles on its own)
    keep = jax.jit(cppo.keep_indices, static_argnames=("k", "metric"))
    r = jnp.asarray([[2.0, 2.0, 2.0, 2.0, 2.0]])
    for k in (1, 3, 5):
        got = np.asarray(keep(r, k=k, metric="max_variance"))[0]
        np.testing.assert_array_equal(got, np.arange(5 - k, 5))
    # 0/1 rewards with ties: one 1 and one 0 for k = 2; the 1 is the last one by index among the
    # highest sorted (stable sort: equal values in index order), the 0 the first.
    r01 = jnp.asarray([[1.0, 0.0, 1.0, 0.0, 1.0]])
    np.testing.assert_array_equal(keep(r01, k=2, metric="max_variance"), [[1, 4]])


def _prune_inputs(Q, G, P, C, seed=0):
    """`helpers.prune_inputs` with 0/1 rewards and three zero-variance groups (0, 3 and 4)."""
    rewards_QG, *rest = prune_inputs(Q, G, P, C, seed, rewards=(0.0, 1.0))
    rewards_QG[[0, 3, 4]] = rewards_QG[[0, 3, 4], :1]
    return (rewards_QG, *rest)


@pytest.mark.parametrize("scope", ["question", "batch"])
def test_prune_with_filter_groups_trains_the_informative_groups(scope):
    G, P, C = 4, 3, 5
    algo = CPPOConfig(
        num_generations=G,
        questions_per_step=4,
        pruning_rate=0.5,
        scope=scope,
        filter_groups=True,
        filter_oversample=1.5,
    )
    shapes = cppo.step_shapes(algo, P, C)
    assert (shapes.Q, shapes.U, shapes.k) == (6, 4, 2)
    assert (8 if scope == "question" else cppo.num_kept(4 * G, 0.5)) == shapes.M
    inputs = _prune_inputs(shapes.Q, G, P, C)
    rewards_QG, prompt_QP, pvalid_QP, tokens_NC, cvalid_NC, _ = inputs
    out = cppo.prune(*inputs[:1], jax.random.key(0), *inputs[1:], shapes=shapes, algo=algo)
    groups = ref.informative_groups(rewards_QG, 4)
    np.testing.assert_array_equal(out.groups_U, groups)
    adv_UG = ref.group_advantages(rewards_QG[groups])
    np.testing.assert_allclose(out.adv_UG, adv_UG, rtol=16 * EPS32, atol=16 * EPS32)
    if scope == "question":
        within = ref.prune_per_question(adv_UG, shapes.k)
        want = (np.asarray(groups)[:, None] * G + within).reshape(-1)
    else:
        flat = ref.prune_batch(adv_UG.reshape(-1), shapes.M)
        want = np.asarray(groups)[flat // G] * G + flat % G
    kept = np.asarray(out.kept).reshape(-1)
    np.testing.assert_array_equal(kept, want)  # flat indices into the Q * G rolled out
    assert out.tokens_MT.shape == (shapes.M, P + C)
    np.testing.assert_array_equal(out.tokens_MT[:, :P], prompt_QP[kept // G])
    np.testing.assert_array_equal(out.tokens_MT[:, P:], tokens_NC[kept])
    np.testing.assert_array_equal(out.valid_MT[:, P:], cvalid_NC[kept])
    np.testing.assert_array_equal(out.valid_MT[:, :P], pvalid_QP[kept // G])
    # The sampler's log-probs (for cppo.tis_cap) follow the kept rows through the filter.
    logp_NC = -np.arange(shapes.Q * G * C, dtype=np.float32).reshape(shapes.Q * G, C) / 7
    with_logp = cppo.prune(
        *inputs[:1], jax.random.key(0), *inputs[1:], logp_NC=logp_NC, shapes=shapes, algo=algo
    )
    np.testing.assert_array_equal(with_logp.behav_logp_MC, logp_NC[kept])
    adv_flat = np.zeros(shapes.Q * G)
    adv_flat[(np.asarray(groups)[:, None] * G + np.arange(G)).reshape(-1)] = adv_UG.reshape(-1)
    np.testing.assert_allclose(out.adv_M, adv_flat[kept], rtol=16 * EPS32, atol=16 * EPS32)


def test_prune_with_proportional_trains_reweighted_advantages():
    G, P, C = 4, 2, 3
    algo = CPPOConfig(
        num_generations=G, questions_per_step=6, pruning_rate=0.5, metric="proportional"
    )
    shapes = cppo.step_shapes(algo, P, C)
    inputs = _prune_inputs(shapes.Q, G, P, C, seed=1)
    out = cppo.prune(*inputs[:1], jax.random.key(7), *inputs[1:], shapes=shapes, algo=algo)
    adv_QG = ref.group_advantages(inputs[0])
    w_QG = np.sign(adv_QG) * np.mean(np.abs(adv_QG), axis=1, keepdims=True)
    kept = np.asarray(out.kept).reshape(-1)
    np.testing.assert_allclose(out.adv_M, w_QG.reshape(-1)[kept], rtol=16 * EPS32, atol=16 * EPS32)
    # Informative groups only draw completions with A != 0.
    assert np.all(np.abs(adv_QG.reshape(-1)[kept][np.abs(w_QG.reshape(-1)[kept]) > 0]) > 0)


def test_filter_config_is_validated_and_shapes_are_exact():
    with pytest.raises(ConfigError, match="cppo.filter_oversample"):
        CPPOConfig(filter_groups=True, filter_oversample=0.5)
    # allocation and filtering compose: U = floor(b / (1 - p)), Q = floor(U * oversample).
    algo = CPPOConfig(
        questions_per_step=3,
        pruning_rate=0.75,
        allocation=True,
        filter_groups=True,
        filter_oversample=4 / 3,
    )
    sh = cppo.step_shapes(algo, 8, 8)
    assert (sh.U, sh.Q, sh.M) == (12, 16, 12 * 4)
    plain = cppo.step_shapes(CPPOConfig(questions_per_step=3), 8, 8)
    assert plain.Q == plain.U == 3


@pytest.mark.slow
def test_a_trainer_with_filter_groups_logs_what_it_dropped(tmp_path, arith_model_dir):
    """Two steps of a trainer that filters groups: each step's metrics (the rows metrics.jsonl logs)
    count the groups rolled out, trained, zero-variance and dropped, under documented names."""
    from cppo_jax.train.trainer import Trainer
    from tests.test_trainer import small_config

    cfg = small_config(
        tmp_path, arith_model_dir, "cppo.filter_groups=true", "cppo.filter_oversample=1.5"
    )
    trainer = Trainer(cfg)
    try:
        history = [trainer.step(s) for s in range(2)]
    finally:
        trainer.close()
    assert (trainer.shapes.Q, trainer.shapes.U, trainer.shapes.M) == (6, 4, 8)
    rows = [m for m in history if "filter/dropped" in m]
    assert len(rows) == 2
    for m in rows:
        assert m["cppo/questions"] == 6 and m["cppo/questions_trained"] == 4
        zero = m["filter/zero_variance_groups"]
        assert m["filter/dropped"] == min(zero, 2)
        assert m["filter/zero_variance_trained"] == zero - m["filter/dropped"]
        assert np.isfinite(m["loss"])
    doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    assert all(f"`{key}`" in doc for key in rows[0] if key.startswith("filter/"))
