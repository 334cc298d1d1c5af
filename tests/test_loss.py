"""Tests of cppo_jax.algo.loss: chunked log-probs and the clipped policy loss (the completion masks are
`rollout.sampling.completion_ends`'s, tested in tests/test_sampler.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo_jax.algo import cppo, loss
from cppo_jax.config.choices import LOSS_TYPES

try:
    import reference_numpy as ref
except ImportError:  # tests/ became a package
    from tests import reference_numpy as ref

try:
    from helpers import count_compiles
except ImportError:  # tests/ became a package
    from tests.helpers import count_compiles

GSM8K_REWARDS = (0.0, 1.0, 1.5, 2.0, 2.5, 3.0)


@pytest.fixture(autouse=True, scope="module")
def _x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


_STATIC = ("loss_type", "eps_low", "eps_high", "beta", "max_completion_len")
_loss = jax.jit(loss.policy_loss, static_argnames=_STATIC)


def _per_loss_type(f):
    """jit(x -> {loss_type: f(x, loss_type)}): one compilation for all four aggregations."""
    return jax.jit(lambda *args: {lt: f(*args, loss_type=lt) for lt in LOSS_TYPES})


def _batch(seed, N=4, T=6, spread=0.6, mask_p=0.8):
    """float64 logp/old/ref, group advantages from GSM8K rewards, a random mask."""
    gen = np.random.default_rng(seed)
    logp = gen.uniform(-3.0, -0.1, size=(N, T))
    old = logp + gen.uniform(-spread, spread, size=(N, T))
    ref_logp = logp + gen.uniform(-spread, spread, size=(N, T))
    if N >= 2:  # one group: ties and zeros are common
        adv = ref.group_advantages(gen.choice(GSM8K_REWARDS, size=(1, N)))[0]
    else:
        adv = gen.choice((-1.5, 0.0, 0.7), size=N)
    mask = (gen.uniform(size=(N, T)) < mask_p).astype(np.float64)
    return logp, old, ref_logp, adv, mask


# --------------------------------------------------------------------------- loss vs reference


@jax.jit
def _all_configs(logp, old, ref_logp, adv, mask, eps_low, eps_high):
    """policy_loss for every loss_type and beta in {0, 0.04}; eps traced, so one compile per shape."""
    out = {}
    for loss_type in LOSS_TYPES:
        for beta in (0.0, 0.04):
            kw = dict(loss_type=loss_type, beta=beta, max_completion_len=logp.shape[1] + 3)
            out[loss_type, beta] = loss.policy_loss(
                logp, old, ref_logp, adv, mask, eps_low=eps_low, eps_high=eps_high, **kw
            )
    return out


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    shape=st.sampled_from(((1, 1), (2, 5), (4, 7))),
    eps=st.sampled_from(((0.2, 0.2), (0.2, 0.28), (0.1, 0.3))),
    mask_p=st.sampled_from((0.0, 0.5, 1.0)),
)
def test_policy_loss_matches_reference(seed, shape, eps, mask_p):
    N, T = shape
    batch = _batch(seed, N, T, mask_p=mask_p)
    results = _all_configs(*batch, *eps)
    for (loss_type, beta), (got, metrics) in results.items():
        want, want_metrics = ref.policy_loss(
            *batch, loss_type, eps[0], eps[1], beta, max_completion_len=T + 3
        )
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=loss_type)
        assert set(metrics) == set(want_metrics)
        for name, value in want_metrics.items():
            msg = f"{loss_type} beta={beta} {name}"
            np.testing.assert_allclose(metrics[name], value, rtol=1e-6, atol=1e-6, err_msg=msg)


def test_k_equal_g_equals_unpruned_grpo():
    Q, G, T = 3, 4, 5
    gen = np.random.default_rng(0)
    rewards_QG = gen.choice(GSM8K_REWARDS, size=(Q, G))
    logp_QGT = gen.uniform(-2, 0, size=(Q, G, T))
    old_QGT = logp_QGT + gen.uniform(-0.5, 0.5, size=(Q, G, T))
    ref_QGT = logp_QGT + gen.uniform(-0.5, 0.5, size=(Q, G, T))
    mask_QGT = (gen.uniform(size=(Q, G, T)) < 0.7).astype(np.float64)
    adv_QG = cppo.group_advantages(rewards_QG)

    def flat(x):  # [Q, G, ...] -> [N, ...]
        return jnp.reshape(jnp.asarray(x), (-1, *x.shape[2:]))

    # The trainer's prune step with p = 0 (k = G): row n of the completions holds the token n, so the
    # trained batch says which completion each kept row is; every row must come back, in order.
    from cppo_jax.config.schema import CPPOConfig

    algo = CPPOConfig(num_generations=G, questions_per_step=Q, pruning_rate=0.0)
    shapes = cppo.step_shapes(algo, prompt_len=1, completion_len=T)
    assert shapes.k == G and shapes.M == Q * G
    out = cppo.prune(
        jnp.asarray(rewards_QG, jnp.float32),
        jax.random.PRNGKey(0),
        jnp.zeros((Q, 1), jnp.int32),
        jnp.ones((Q, 1), bool),
        jnp.broadcast_to(jnp.arange(Q * G, dtype=jnp.int32)[:, None], (Q * G, T)),
        jnp.asarray(flat(mask_QGT) > 0),
        jnp.ones(Q * G, bool),
        shapes=shapes,
        algo=algo,
    )
    rows = np.asarray(out.tokens_MT[:, 1])
    np.testing.assert_array_equal(rows, np.arange(Q * G))
    np.testing.assert_array_equal(out.mask_MC, flat(mask_QGT))
    np.testing.assert_allclose(out.adv_M, flat(adv_QG), rtol=np.finfo(np.float32).eps)
    pruned = [flat(x)[rows] for x in (logp_QGT, old_QGT, ref_QGT, adv_QG, mask_QGT)]
    full = [flat(x) for x in (logp_QGT, old_QGT, ref_QGT, adv_QG, mask_QGT)]

    def both(pruned, full, loss_type):
        kw = dict(loss_type=loss_type, max_completion_len=T)
        return loss.policy_loss(*pruned, **kw), loss.policy_loss(*full, **kw)

    for (a, a_metrics), (b, b_metrics) in _per_loss_type(both)(pruned, full).values():
        assert float(a) == float(b)
        assert all(float(a_metrics[m]) == float(b_metrics[m]) for m in a_metrics)


def test_zero_advantage_gives_zero_gradient_without_kl():
    logp, old, ref_logp, _, mask = _batch(1, N=4, T=5, spread=0.5, mask_p=1.0)
    adv = np.array([0.0, 1.2, -0.7, 0.0])

    def grads(lp, loss_type):
        def f(lp, beta):
            kw = dict(loss_type=loss_type, beta=beta, max_completion_len=8)
            return loss.policy_loss(lp, old, ref_logp, adv, mask, **kw)[0]

        return jax.grad(f)(lp, 0.0), jax.grad(f)(lp, 0.04)

    for loss_type, (grad, grad_kl) in _per_loss_type(grads)(logp).items():
        grad = np.asarray(grad)
        assert np.all(grad[[0, 3]] == 0.0), loss_type
        assert np.all(np.any(grad[[1, 2]] != 0.0, axis=1)), loss_type
        assert np.any(np.asarray(grad_kl)[0] != 0.0), loss_type  # the KL term does pull


def test_gradient_matches_finite_differences_inside_and_outside_the_clip():
    # ratios inside [0.8, 1.2] and outside it: clipped (A > 0 above 1.2, A < 0 below 0.8)
    # and unclipped (A > 0 below 0.8, A < 0 above 1.2), where min() picks the raw ratio.
    ratios = np.array([[1.0, 1.1, 1.5, 0.5, 0.95], [0.9, 1.05, 1.6, 0.6, 1.0]])
    old = np.array([[-1.0, -0.5, -2.0, -1.5, -0.2], [-0.7, -1.2, -0.3, -2.5, -0.9]])
    logp = old + np.log(ratios)
    ref_logp = logp + np.array([[0.3, -0.2, 0.1, 0.5, 0.0], [-0.4, 0.2, 0.6, -0.1, 0.3]])
    adv = np.array([0.8, -1.3])
    mask = np.array([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0]])
    h = 1e-6

    @jax.jit
    def grads_and_differences(lp):
        out = {}
        # CISPO's gradient is by design not its value's derivative (its weight is a stop-gradient
        # constant): tests/test_objectives.py checks it against the paper's gradient.
        for loss_type in (t for t in LOSS_TYPES if t != "cispo"):

            def f(x, loss_type=loss_type):
                kw = dict(loss_type=loss_type, beta=0.04, max_completion_len=7)
                return loss.policy_loss(x, old, ref_logp, adv, mask, **kw)[0]

            steps = h * jnp.eye(lp.size).reshape(lp.size, *lp.shape)
            fd = (jax.vmap(f)(lp + steps) - jax.vmap(f)(lp - steps)) / (2 * h)
            out[loss_type] = (jax.grad(f)(lp), fd.reshape(lp.shape))
        return out

    for loss_type, (grad, fd) in grads_and_differences(logp).items():
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8, err_msg=loss_type)
    _, metrics = _loss(logp, old, ref_logp, adv, mask)
    np.testing.assert_allclose(metrics["clip_ratio/high_mean"], 1 / 9)
    np.testing.assert_allclose(metrics["clip_ratio/low_mean"], 1 / 9)
    np.testing.assert_allclose(metrics["clip_ratio/region_mean"], 2 / 9)


def test_beta_zero_never_touches_ref():
    logp, old, _, adv, mask = _batch(2)
    a, metrics = _loss(logp, old, None, adv, mask, beta=0.0)
    b, _ = _loss(logp, old, np.full_like(logp, np.nan), adv, mask, beta=0.0)
    assert np.isfinite(a) and float(a) == float(b)
    assert float(metrics["kl"]) == 0.0
    jaxpr = jax.make_jaxpr(lambda r: loss.policy_loss(logp, old, r, adv, mask, beta=0.0))(logp)
    ref_var = jaxpr.jaxpr.invars[0]
    assert not any(v is ref_var for e in jaxpr.eqns for v in e.invars)


def test_empty_mask_is_safe():
    logp, old, ref_logp, adv, _ = _batch(3)
    mask = np.zeros_like(logp)

    def value_and_grad(lp, loss_type):
        def f(lp):
            kw = dict(loss_type=loss_type, max_completion_len=4)
            return loss.policy_loss(lp, old, ref_logp, adv, mask, **kw)

        return jax.value_and_grad(f, has_aux=True)(lp)

    for loss_type, ((value, metrics), grad) in _per_loss_type(value_and_grad)(logp).items():
        assert float(value) == 0.0, loss_type
        assert np.all(np.asarray(grad) == 0.0), loss_type
        assert all(np.isfinite(v) for v in metrics.values()), loss_type


def test_policy_loss_rejects_bad_arguments():
    logp, old, ref_logp, adv, mask = _batch(5)
    with pytest.raises(ValueError, match="loss_type"):
        loss.policy_loss(logp, old, ref_logp, adv, mask, loss_type="sum")
    with pytest.raises(ValueError, match="max_completion_len"):
        loss.policy_loss(logp, old, ref_logp, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logp_MC"):
        loss.policy_loss(logp, old, None, adv, mask, beta=0.04)
    with pytest.raises(ValueError, match="static Python float"):
        jax.jit(lambda b: loss.policy_loss(logp, old, ref_logp, adv, mask, beta=b))(0.04)


def test_policy_loss_does_not_recompile_for_new_data():
    traces = {"n": 0}

    def step(logp, old, ref_logp, adv, mask):
        traces["n"] += 1
        return loss.policy_loss(logp, old, ref_logp, adv, mask, loss_type="seq_mean")

    f = jax.jit(jax.value_and_grad(step, has_aux=True))
    batches = [_batch(seed) for seed in range(4)]
    jax.block_until_ready(f(*batches[0]))
    with count_compiles() as compiles:
        for batch in batches[1:]:
            jax.block_until_ready(f(*batch))
            jax.block_until_ready(_loss(*batch, loss_type="dr_grpo", max_completion_len=9))
    assert traces["n"] == 1
    assert compiles["n"] == 1  # only _loss's first call compiles


# --------------------------------------------------------------------------- log-probs


def _dense_logps(logits_MTV, targets_MT, temperature=1.0):
    """The unchunked log-probs the chunked ones must equal (holds [M, T, V]: small V only)."""
    logp_MTV = jax.nn.log_softmax(logits_MTV.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp_MTV, targets_MT[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("chunk_size", [2, 3, 100])  # divides T, does not, exceeds
def test_chunked_logps_equal_unchunked(chunk_size):
    gen = np.random.default_rng(chunk_size)
    N, T, D, V = 2, 8, 5, 11
    h = gen.normal(size=(N, T, D)).astype(np.float32)
    w = gen.normal(size=(D, V)).astype(np.float32)
    targets = gen.integers(0, V, size=(N, T))
    temperature = 0.7
    logits = np.einsum("ntd,dv->ntv", h.astype(np.float64), w.astype(np.float64))

    @jax.jit
    def run(h, w, logits):
        logp, ent = loss.token_logps_from_hidden(
            h, w, targets, temperature, chunk_size=chunk_size, return_entropy=True
        )
        return logp, ent, _dense_logps(logits, targets, temperature)

    logp, ent, dense = run(h, w, jnp.asarray(logits, jnp.float32))
    assert logp.shape == (N, T) and logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logp, ref.token_logps(logits, targets, temperature), atol=1e-4)
    np.testing.assert_allclose(ent, ref.token_entropy(logits, temperature), atol=1e-4)

    def chunked(h, w):
        return jnp.sum(loss.token_logps_from_hidden(h, w, targets, temperature, chunk_size))

    def unchunked(h, w):
        logits = jnp.einsum("ntd,dv->ntv", h, w)
        return jnp.sum(_dense_logps(logits, targets, temperature))

    grads = jax.jit(
        lambda h, w: (jax.grad(chunked, (0, 1))(h, w), jax.grad(unchunked, (0, 1))(h, w))
    )
    for a, b in zip(*grads(h, w)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _intermediate_sizes(jaxpr) -> list[int]:
    sizes = []
    for eqn in jaxpr.eqns:
        sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                sizes += _intermediate_sizes(inner)
    return sizes


def test_chunked_logps_never_hold_n_t_v_logits():
    N, T, D, V, chunk = 2, 512, 16, 50021, 8
    full_bytes = N * T * V * 4
    h = jax.ShapeDtypeStruct((N, T, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((N, T), jnp.int32)

    def fwd(h, w, t):
        return loss.token_logps_from_hidden(h, w, t, chunk_size=chunk)

    def grad(h, w, t):
        return jax.grad(lambda h, w: jnp.sum(fwd(h, w, t)), (0, 1))(h, w)

    def dense(h, w, t):
        return _dense_logps(jnp.einsum("ntd,dv->ntv", h, w), t)

    for f in (fwd, grad):
        sizes = _intermediate_sizes(jax.make_jaxpr(f)(h, w, targets).jaxpr)
        assert max(sizes) == N * chunk * V, f.__name__  # the walk reaches the scan body
        stats = jax.jit(f).lower(h, w, targets).compile().memory_analysis()
        if stats is not None:
            # a few [N, chunk, V] blocks (about full / 16 here), far below one [N, T, V] buffer
            assert stats.temp_size_in_bytes < full_bytes / 8, (f.__name__, stats)
    # the check has teeth: the dense version does hold N*T*V
    assert max(_intermediate_sizes(jax.make_jaxpr(dense)(h, w, targets).jaxpr)) >= N * T * V


def test_logps_reject_bad_arguments():
    h, w, t = jnp.zeros((1, 3, 2)), jnp.zeros((2, 5)), jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="chunk_size"):
        loss.token_logps_from_hidden(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        loss.token_logps_from_hidden(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="targets_MT"):
        loss.token_logps_from_hidden(h, w, t[:, :2])
