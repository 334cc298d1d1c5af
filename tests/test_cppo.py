"""Tests of cppo_jax.algo.cppo: advantages, pruning, counts and reward checks (vs a NumPy reference)."""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo_jax.algo import cppo
from cppo_jax.config.choices import ADV_SCALES, GROUP_METRICS, METRICS

try:
    import reference_numpy as ref
except ImportError:  # tests/ became a package
    from tests import reference_numpy as ref

try:
    from helpers import count_compiles, prune_inputs
except ImportError:  # tests/ became a package
    from tests.helpers import count_compiles, prune_inputs

GSM8K_REWARDS = (0.0, 1.0, 1.5, 2.0, 2.5, 3.0)
SETTINGS = settings(max_examples=30, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


# --------------------------------------------------------------------------- strategies


@st.composite
def rewards_QG(draw, group_sizes=(2, 3, 4, 16), gsm8k=None):
    """[Q, G] float64 rewards: GSM8K values (many ties) or floats, some groups all equal."""
    Q = draw(st.sampled_from((1, 3)))  # few shapes: each one compiles
    G = draw(st.sampled_from(group_sizes))
    use_gsm8k = draw(st.booleans()) if gsm8k is None else gsm8k
    values = st.sampled_from(GSM8K_REWARDS) if use_gsm8k else st.floats(-5, 5, width=32)
    r = np.array(draw(st.lists(values, min_size=Q * G, max_size=Q * G)), dtype=np.float64)
    r = r.reshape(Q, G)
    for q in range(Q):
        if draw(st.integers(0, 3)) == 0:
            r[q] = r[q, 0]  # a group whose rewards are all equal: A = 0
    return r


PAIRWISE = ("smallest", "largest")


@jax.jit
def _all_advantages(r_QG):
    return {scale: cppo.group_advantages(r_QG, scale) for scale in ADV_SCALES}


@jax.jit
def _all_kept(adv_QG):
    """keep_indices for every k in 1..G and both |A| metrics: one compilation per shape."""
    G = adv_QG.shape[1]
    return {(k, m): cppo.keep_indices(adv_QG, k, m) for k in range(1, G + 1) for m in PAIRWISE}


@jax.jit
def _all_kept_batch(adv_N):
    N = adv_N.shape[0]
    counts = sorted({1, 2, N // 3, N // 2, N - 1, N} - {0})
    return {(n, m): cppo.keep_indices_batch(adv_N, n, m) for n in counts for m in PAIRWISE}


# --------------------------------------------------------------------------- advantages


@SETTINGS
@given(r=rewards_QG())
def test_group_advantages_match_reference(r):
    for scale, got in _all_advantages(r).items():
        assert got.dtype == jnp.float64
        want = ref.group_advantages(r, scale)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=scale)


def test_equal_rewards_give_zero_advantage():
    adv = cppo.group_advantages(jnp.array([[1.5, 1.5, 1.5], [0.0, 2.0, 1.0]]))
    assert np.all(np.asarray(adv[0]) == 0.0)
    np.testing.assert_allclose(adv[1], [-1 / 1.0001, 1 / 1.0001, 0.0], rtol=1e-12)


def test_group_advantages_rejects_bad_arguments():
    with pytest.raises(ValueError, match="scale"):
        cppo.group_advantages(jnp.ones((2, 4)), scale="median")
    with pytest.raises(ValueError, match="G=1"):
        cppo.group_advantages(jnp.ones((2, 1)))
    with pytest.raises(ValueError, match=r"\[Q, G\]"):
        cppo.group_advantages(jnp.ones(4))


# --------------------------------------------------------------------------- pruning


@SETTINGS
@given(r=rewards_QG())
def test_keep_indices_match_reference_on_same_advantages(r):
    adv = ref.group_advantages(r)
    for (k, metric), got in _all_kept(adv).items():
        assert got.dtype == jnp.int32
        want = ref.prune_per_question(adv, k, metric)
        np.testing.assert_array_equal(got, want, err_msg=f"k={k} {metric}")


@SETTINGS
@given(r=rewards_QG(group_sizes=(2, 4, 16), gsm8k=True))
def test_rewards_to_kept_end_to_end(r):
    # GSM8K rewards and power-of-two G make group means exact, so both sides see the same ties.
    for scale, adv in _all_advantages(r).items():
        ref_adv = ref.group_advantages(r, scale)
        for (k, metric), got in _all_kept(adv).items():
            want = ref.prune_per_question(ref_adv, k, metric)
            np.testing.assert_array_equal(got, want, err_msg=f"{scale} k={k} {metric}")


@SETTINGS
@given(r=rewards_QG())
def test_keep_indices_batch_matches_reference(r):
    adv_N = ref.group_advantages(r).ravel()
    for (n_keep, metric), got in _all_kept_batch(adv_N).items():
        want = ref.prune_batch(adv_N, n_keep, metric)
        np.testing.assert_array_equal(got, want, err_msg=f"n_keep={n_keep} {metric}")


def test_batch_scope_keeps_floor_n_times_one_minus_p():
    adv_N = jnp.arange(32.0) - 15.5
    n_keep = cppo.num_kept(32, 0.875)
    assert n_keep == 4
    got = np.asarray(cppo.keep_indices_batch(adv_N, n_keep))
    np.testing.assert_array_equal(got, [0, 1, 30, 31])


@jax.jit
def _all_kept_slice(adv_QG):
    """keep_indices_slice for every divisor of Q as the slice count, a few counts, both metrics."""
    Q, G = adv_QG.shape
    out = {}
    for slices in (d for d in range(1, Q + 1) if Q % d == 0):
        X = Q // slices * G
        for n in sorted({1, 2, X // 2, X}):
            for m in PAIRWISE:
                out[(slices, n, m)] = cppo.keep_indices_slice(adv_QG, slices, n, m)
    return out


@SETTINGS
@given(r=rewards_QG(gsm8k=True))
def test_keep_indices_slice_matches_reference(r):
    """scope="slice": one top-k within each contiguous slice of the questions (the TRL fork)."""
    Q, G = r.shape
    adv_QG = ref.group_advantages(r)
    for (slices, n, metric), got in _all_kept_slice(adv_QG).items():
        X = Q // slices * G
        want = np.concatenate(
            [
                ref.prune_batch(adv_QG.ravel()[s * X : (s + 1) * X], n, metric) + s * X
                for s in range(slices)
            ]
        )
        np.testing.assert_array_equal(got, want, err_msg=f"slices={slices} n={n} {metric}")


def test_slice_scope_worked_example_drops_zero_variance_groups_first():
    """docs/concepts.md's example: Q = 4 questions, G = 4, p = 0.5, GSM8K rewards."""
    r_QG = jnp.array(
        [
            [3.0, 3.0, 3.0, 3.0],  # all right: A = 0
            [3.0, 0.0, 1.0, 1.0],
            [0.0, 0.0, 0.0, 0.0],  # all wrong: A = 0
            [2.0, 1.0, 1.0, 1.0],
        ]
    )
    adv_QG = cppo.group_advantages(r_QG)
    # Per question (the paper's text): 2 of every group, the zero-variance ones included.
    per_question = np.asarray(cppo.keep_indices(adv_QG, cppo.num_kept(4, 0.5)))
    np.testing.assert_array_equal(per_question, [[0, 1], [0, 1], [0, 1], [0, 1]])
    # One slice (the released GSM8K run, one training process): 8 of the 16 by |A|; both zero-variance groups go.
    n = cppo.num_kept_slice(4, 4, 1, 0.5)
    assert n == 8
    kept = np.asarray(cppo.keep_indices_slice(adv_QG, 1, n))
    np.testing.assert_array_equal(kept, [4, 5, 6, 7, 12, 13, 14, 15])
    # Two slices: each keeps 4 of its 8, so each zero-variance group's slice keeps only the other.
    kept = np.asarray(cppo.keep_indices_slice(adv_QG, 2, cppo.num_kept_slice(4, 4, 2, 0.5)))
    np.testing.assert_array_equal(kept, [4, 5, 6, 7, 12, 13, 14, 15])
    # The verl recipe's global batch gives the same here: keep floor(16 (1 - p)) = 8.
    np.testing.assert_array_equal(cppo.keep_indices_batch(adv_QG.ravel(), 8), kept)


def test_slice_scope_counts_and_limits():
    # The TRL fork drops int(N p) of a slice: N = 8 x 16 = 128 at p = 0.875 keeps 16 (the GSM8K run).
    assert cppo.num_kept_slice(8, 16, 1, 0.875) == 16
    assert cppo.num_kept_slice(24, 16, 3, 0.875) == 16  # MATH: 3 slices of 8 questions
    # Not dyadic: N = 48, p = 0.9 drops floor(43.2) = 43 and keeps 5, where "batch" keeps floor(4.8) = 4.
    assert cppo.num_kept_slice(3, 16, 1, 0.9) == 5
    assert cppo.num_kept(48, 0.9) == 4
    # One question per slice at a dyadic p is the paper's per-question rule.
    adv_QG = cppo.group_advantages(jnp.asarray(np.random.default_rng(0).normal(size=(6, 16))))
    per_slice = cppo.keep_indices_slice(adv_QG, 6, cppo.num_kept_slice(6, 16, 6, 0.875))
    per_question = cppo.keep_indices(adv_QG, 2) + jnp.arange(6)[:, None] * 16
    np.testing.assert_array_equal(per_slice, per_question.reshape(-1))
    for bad in (0, 4):
        with pytest.raises(ValueError, match="slices must divide the Q=6"):
            cppo.keep_indices_slice(adv_QG, bad, 1)
        with pytest.raises(ValueError, match="slices must divide the Q=6"):
            cppo.num_kept_slice(6, 16, bad, 0.5)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_permuting_a_group_permutes_the_kept_set(data):
    G = data.draw(st.sampled_from((4, 7, 16)))
    k = data.draw(st.integers(1, G))
    metric = data.draw(st.sampled_from(("smallest", "largest")))
    # Distinct |A| (random signs), so no tie interferes.
    mags = np.array(data.draw(st.permutations(range(1, G + 1))), dtype=np.float64) / G
    signs = np.array(data.draw(st.lists(st.sampled_from((-1.0, 1.0)), min_size=G, max_size=G)))
    adv_G = mags * signs
    perm = np.array(data.draw(st.permutations(range(G))))
    kept = set(np.asarray(_all_kept(adv_G[None])[k, metric])[0].tolist())
    kept_perm = np.asarray(_all_kept(adv_G[perm][None])[k, metric])[0]
    # position j of the shuffled group holds completion perm[j]
    assert {int(perm[j]) for j in kept_perm} == kept


def test_ties_keep_the_lower_index():
    adv = jnp.array(
        [
            [0.5, -0.5, 0.5, 0.1, -0.5],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [-0.1, 0.3, 0.1, 0.3, 0.1],
        ]
    )
    np.testing.assert_array_equal(cppo.keep_indices(adv, 2), [[0, 1], [0, 1], [1, 3]])
    np.testing.assert_array_equal(cppo.keep_indices(adv, 3), [[0, 1, 2], [0, 1, 2], [0, 1, 3]])
    np.testing.assert_array_equal(
        cppo.keep_indices(adv, 2, metric="largest"), [[0, 3], [0, 1], [0, 2]]
    )
    np.testing.assert_array_equal(cppo.keep_indices_batch(adv.ravel(), 3), [0, 1, 2])
    # -0.0 and +0.0 are the same |A|
    adv_signed_zero = jnp.array([[-0.0, 0.0, -0.0, 1.0]])
    np.testing.assert_array_equal(cppo.keep_indices(adv_signed_zero, 2), [[0, 3]])


def test_output_is_sorted_ascending():
    adv = jnp.array([[0.9, 0.1, -0.8, 0.2, 0.7, -0.3]])
    np.testing.assert_array_equal(cppo.keep_indices(adv, 3), [[0, 2, 4]])
    np.testing.assert_array_equal(cppo.keep_indices(adv, 3, metric="largest"), [[1, 3, 5]])


@pytest.mark.parametrize("metric", METRICS)
def test_k_equal_g_keeps_everything(metric):
    adv = jnp.asarray(np.random.default_rng(0).normal(size=(3, 6)))
    rng = jax.random.key(1)
    np.testing.assert_array_equal(
        cppo.keep_indices(adv, 6, metric=metric, rng=rng), np.tile(np.arange(6), (3, 1))
    )
    assert cppo.num_kept(16, 0) == 16
    if metric in GROUP_METRICS:  # a group's rule: no batch form (test_max_variance_..., selection)
        return
    np.testing.assert_array_equal(
        cppo.keep_indices_batch(adv.ravel(), 18, metric=metric, rng=rng), np.arange(18)
    )


def test_random_metric_is_uniform_without_replacement():
    Q, G, k = 4000, 8, 3
    keys = jax.random.split(jax.random.key(0), 3)
    idx = np.asarray(cppo.keep_indices(jnp.zeros((Q, G)), k, metric="random", rng=keys[0]))
    assert idx.dtype == np.int32 and idx.shape == (Q, k)
    assert np.all(np.diff(idx, axis=1) > 0)  # sorted, hence distinct
    assert idx.min() >= 0 and idx.max() < G
    freq = np.bincount(idx.ravel(), minlength=G) / Q  # rows are independent draws
    np.testing.assert_allclose(freq, k / G, atol=0.04)
    assert len({tuple(row) for row in idx}) == math.comb(G, k)  # every subset shows up
    again = cppo.keep_indices(jnp.zeros((Q, G)), k, metric="random", rng=keys[0])
    np.testing.assert_array_equal(again, idx)
    batch = np.asarray(cppo.keep_indices_batch(jnp.zeros(32), 5, metric="random", rng=keys[1]))
    assert batch.shape == (5,) and np.all(np.diff(batch) > 0)


def test_random_metric_needs_rng():
    with pytest.raises(ValueError, match="rng"):
        cppo.keep_indices(jnp.zeros((2, 4)), 2, metric="random")
    with pytest.raises(ValueError, match="rng"):
        cppo.keep_indices_batch(jnp.zeros(8), 2, metric="random")


@pytest.mark.parametrize("scope", ["question", "slice", "batch"])
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_prune_trains_the_kept_completions_with_their_prompts(scope, mask_truncated):
    """The trainer's prune step: each kept row is its completion behind its own question's prompt."""
    from cppo_jax.config.schema import CPPOConfig

    Q, G, P, C = 6, 4, 3, 5
    algo = CPPOConfig(
        num_generations=G,
        questions_per_step=Q,
        pruning_rate=0.5,
        scope=scope,
        slices=3,
        mask_truncated=mask_truncated,
    )
    shapes = cppo.step_shapes(algo, P, C)
    inputs = prune_inputs(Q, G, P, C, seed=1)
    rewards_QG, prompt_QP, pvalid_QP, tokens_NC, cvalid_NC, finished_N = inputs
    out = cppo.prune(
        rewards_QG,
        jax.random.PRNGKey(0),
        prompt_QP,
        pvalid_QP,
        tokens_NC,
        cvalid_NC,
        finished_N,
        shapes=shapes,
        algo=algo,
    )
    adv_QG = cppo.group_advantages(jnp.asarray(rewards_QG))
    if scope == "question":
        want = np.asarray(cppo.keep_indices(adv_QG, shapes.k)) + np.arange(Q)[:, None] * G
    elif scope == "slice":
        want = cppo.keep_indices_slice(adv_QG, 3, shapes.M // 3)
    else:
        want = cppo.keep_indices_batch(adv_QG.reshape(-1), shapes.M)
    kept = np.asarray(want).reshape(-1)
    np.testing.assert_array_equal(np.asarray(out.kept).reshape(-1), kept)
    assert out.tokens_MT.shape == (shapes.M, P + C) == out.valid_MT.shape
    np.testing.assert_array_equal(out.tokens_MT[:, :P], prompt_QP[kept // G])
    np.testing.assert_array_equal(out.tokens_MT[:, P:], tokens_NC[kept])
    np.testing.assert_array_equal(out.valid_MT[:, :P], pvalid_QP[kept // G])
    np.testing.assert_array_equal(out.valid_MT[:, P:], cvalid_NC[kept])
    mask = cvalid_NC[kept] & (finished_N[kept][:, None] if mask_truncated else True)
    np.testing.assert_array_equal(out.mask_MC, mask.astype(np.float32))
    np.testing.assert_array_equal(out.adv_M, np.asarray(adv_QG).reshape(-1)[kept])


def test_step_shapes_count_exactly():
    """Q and M in every scope; a slice count that does not divide Q is refused naming the key."""
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.config.schema import CPPOConfig

    batch = CPPOConfig(num_generations=16, questions_per_step=3, pruning_rate=0.9, scope="batch")
    assert cppo.step_shapes(batch, 4, 4).M == 4  # floor(48 * (1 - 0.9))
    q = CPPOConfig(num_generations=16, questions_per_step=2, pruning_rate=0.875, allocation=True)
    assert (cppo.step_shapes(q, 4, 4).Q, cppo.step_shapes(q, 4, 4).M) == (16, 32)
    with pytest.raises(ConfigError, match="cppo.slices"):
        cppo.step_shapes(CPPOConfig(questions_per_step=4, scope="slice", slices=3), 4, 4)


def test_keep_indices_does_not_recompile_for_new_data():
    traces = {"n": 0}

    def step(adv_QG, rng):
        traces["n"] += 1
        return (
            cppo.keep_indices(adv_QG, 4),
            cppo.keep_indices(adv_QG, 4, metric="random", rng=rng),
            cppo.group_advantages(adv_QG),
        )

    f = jax.jit(step)
    keep = jax.jit(cppo.keep_indices, static_argnames=("k", "metric"))
    gen = np.random.default_rng(0)
    inputs = [gen.normal(size=(8, 16)) for _ in range(4)]
    keys = [jax.random.key(i) for i in range(4)]
    jax.block_until_ready(f(inputs[0], keys[0]))
    with count_compiles() as compiles:
        for adv, key in zip(inputs[1:], keys[1:]):
            jax.block_until_ready(f(adv, key))
            jax.block_until_ready(keep(adv, k=4, metric="smallest"))
    assert traces["n"] == 1
    assert compiles["n"] == 1  # only keep's first call compiles


# --------------------------------------------------------------------------- counts


@pytest.mark.parametrize(
    ("p", "k", "q"),
    [(0, 16, 16), (0.5, 8, 32), (0.75, 4, 64), (0.875, 2, 128), (0.9375, 1, 256)],
)
def test_paper_settings(p, k, q):
    assert cppo.num_kept(16, p) == k
    assert cppo.num_questions(16, p, allocation=True) == q
    assert cppo.num_questions(16, p, allocation=False) == 16
    assert q * k == 16 * 16


def test_non_dyadic_rates():
    assert cppo.num_kept(16, 0.9) == 1  # 1.6
    assert cppo.num_questions(16, 0.9, allocation=True) == 160
    assert cppo.num_kept(16, 0.3) == 11  # 11.2
    assert cppo.num_questions(16, 0.3, allocation=True) == 22  # 22.86
    assert cppo.num_kept(10, 0.3) == 7  # float: 10 * 0.7 = 7.000000000000001
    assert cppo.num_kept(10, 0.7) == 3  # float: 10 * (1 - 0.7) = 3.0000000000000004
    assert cppo.num_questions(3, 0.7, allocation=True) == 10  # float: 3 / 0.3 = 9.999999999999998
    assert cppo.num_questions(1, 2 / 3, allocation=True) == 3  # float: 2.9999999999999996
    assert cppo.num_questions(1, Fraction(2, 3), allocation=True) == 3
    assert cppo.num_kept(16, 1e-7) == 15
    assert cppo.num_kept(16, 0.99) == 1  # at least one
    assert cppo.num_kept(16, 1 - 1e-16) == 1  # just below 1 is still a valid rate


@pytest.mark.parametrize("den", [2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 64, 100, 1000])
def test_counts_are_exact_for_many_rates(den):
    nums = range(den) if den <= 100 else range(0, den, 7)
    for num in nums:
        p = num / den
        for G in range(2, 34):
            assert cppo.num_kept(G, p) == ref.num_kept(G, num, den), (G, num, den)
        for b in range(1, 34):
            assert cppo.num_questions(b, p, True) == ref.num_questions(b, num, den), (b, num, den)


@pytest.mark.parametrize("p", [1, 1.0, 1.5, -0.1, -1e-12, math.nan, math.inf, "0.5", None])
def test_bad_pruning_rate(p):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        cppo.num_kept(16, p)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        cppo.num_questions(16, p, allocation=True)


def test_bad_sizes():
    with pytest.raises(ValueError, match="G=1"):
        cppo.num_kept(1, 0.5)
    with pytest.raises(ValueError, match="b=0"):
        cppo.num_questions(0, 0.5, allocation=True)
    adv = jnp.zeros((2, 4))
    with pytest.raises(ValueError, match="k=5"):
        cppo.keep_indices(adv, 5)
    with pytest.raises(ValueError, match="k=0"):
        cppo.keep_indices(adv, 0)
    with pytest.raises(ValueError, match="static Python int"):
        cppo.keep_indices(adv, 2.0)
    with pytest.raises(ValueError, match="G=1"):
        cppo.keep_indices(jnp.zeros((2, 1)), 1)
    with pytest.raises(ValueError, match="metric"):
        cppo.keep_indices(adv, 2, metric="median")
    with pytest.raises(ValueError, match="k=9"):
        cppo.keep_indices_batch(adv.ravel(), 9)
    with pytest.raises(ValueError, match=r"\[N\]"):
        cppo.keep_indices_batch(adv, 2)


# --------------------------------------------------------------------------- reward checks


def test_check_rewards_names_the_question():
    r = np.zeros((4, 3))
    cppo.check_rewards(r)  # fine
    r[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"question 2 \(completion 1: nan\)"):
        cppo.check_rewards(r)
    r[0, 2] = -np.inf
    with pytest.raises(ValueError, match=r"question 0 \(completion 2: -inf\); question 2"):
        cppo.check_rewards(r)
    with pytest.raises(ValueError, match=r"\[Q, G\]"):
        cppo.check_rewards(np.zeros(3))


def test_nonfinite_questions_in_graph():
    r = jnp.array([[0.0, 1.0], [jnp.nan, 1.0], [2.0, jnp.inf], [3.0, 3.0]])
    got = jax.jit(cppo.nonfinite_questions)(r)
    np.testing.assert_array_equal(got, [False, True, True, False])


@pytest.mark.parametrize("p", [0.0, 0.5, 0.75, 0.875, 0.9375])
@pytest.mark.parametrize(("name", "slices"), [("gsm8k_1p5b.py", 1), ("math7b.py", 3)])
def test_paper_configs_match_the_released_settings(name, slices, p):
    """The paper configs at each of the paper's rates train what the released TRL fork trained.

    The fork (scripts/CPPO*.sh): `slices` GPUs (one training process each) of 16 completions each; with allocation each draws
    16 / int(G (1 - p)) questions of G = 16 and keeps 16 completions of its slice (drops int(N p)).
    """
    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.config.files import load_config

    cfg = load_config(name, [f"cppo.pruning_rate={p}"])
    a = cfg.cppo
    assert (a.scope, a.slices, a.metric, a.allocation) == (
        "slice",
        slices,
        "smallest",
        True,
    )
    assert (a.num_generations, a.mu, a.beta, a.eps_low, a.eps_high) == (16, 2, 0.04, 0.2, 0.2)
    assert (a.adv_scale, a.adv_eps, a.loss_type) == ("group", 1e-4, "token_mean")
    assert cfg.reward.weights == (1.0, 1.0) and cfg.eval.rule == "released"
    sh = shapes_of(cfg)
    k_fork = int(16 * (1 - p))  # the fork's num_generations with allocation
    assert slices * (16 // k_fork) == sh.Q
    assert slices * 16 == sh.M  # each slice (process) trains its 16 completions


def test_max_variance_keeps_the_subset_of_largest_variance():
    """PODS' rule against brute force over every k-subset, on continuous and on binary rewards."""
    import itertools

    from cppo_jax.algo.cppo import keep_indices

    rng = np.random.default_rng(0)
    cases = [rng.normal(size=(5, 7)), rng.integers(0, 4, size=(6, 8)).astype(np.float32)]
    for x_QG in cases:
        G = x_QG.shape[1]
        for k in range(1, G + 1):
            got = np.asarray(keep_indices(jnp.asarray(x_QG), k, metric="max_variance"))
            assert got.shape == (x_QG.shape[0], k)
            for q, row in enumerate(x_QG):
                best = max(np.var(row[list(c)]) for c in itertools.combinations(range(G), k))
                assert len(set(got[q])) == k and list(got[q]) == sorted(got[q])
                kept = np.var(row[got[q]])
                assert kept >= best * (1 - 64 * np.finfo(np.float32).eps) - 1e-30, (q, k)
    # Binary rewards, 3 right of 8, keep 4: two right and two wrong (variance 1/4, the most a 0/1
    # subset can have), as PODS keeps m/2 best and m/2 worst.
    r = jnp.asarray([[1, 0, 0, 1, 0, 0, 1, 0]], jnp.float32)
    kept = np.asarray(keep_indices(r, 4, metric="max_variance"))[0]
    assert sorted(np.asarray(r)[0][kept]) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="within each question"):
        from cppo_jax.algo.cppo import keep_indices_batch

        keep_indices_batch(jnp.zeros(8), 4, metric="max_variance")


def test_max_variance_needs_question_scope():
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.config.schema import CPPOConfig

    CPPOConfig(metric="max_variance", pruning_rate=0.5)
    with pytest.raises(ConfigError, match="needs cppo.scope='question'"):
        CPPOConfig(metric="max_variance", scope="batch", pruning_rate=0.5)
