"""GSPO and CISPO (`cppo.loss_type=gspo|cispo`, cppo_jax/algo/loss.py): each loss against a direct NumPy
transcription of its paper's equation (tests/reference_numpy.py), its gradient, the identities
(on-policy GSPO is the sequence-mean policy gradient; CISPO without a cap is the unclipped IS
gradient), and its composition with truncated IS and micro-batches. Packing, pruning and LoRA:
tests/test_packed_rows.py, tests/test_loss.py and tests/test_lora_train.py run over LOSS_TYPES."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cppo_jax.algo import loss
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.schema import CPPOConfig

try:
    import reference_numpy as ref
except ImportError:  # tests/ became a package
    from tests import reference_numpy as ref

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(autouse=True, scope="module")
def _x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


_STATIC = ("loss_type", "eps_low", "eps_high", "beta", "max_completion_len", "cispo_cap", "tis_cap")
_loss = jax.jit(loss.policy_loss, static_argnames=_STATIC)


def _batch(seed, N=5, T=7, spread=0.5, mask_p=0.8):
    """float64 (logp, old, ref, adv, mask): every row keeps at least one token."""
    gen = np.random.default_rng(seed)
    logp = gen.uniform(-3.0, -0.1, size=(N, T))
    old = logp + gen.uniform(-spread, spread, size=(N, T))
    ref_logp = logp + gen.uniform(-spread, spread, size=(N, T))
    adv = gen.standard_normal(N)
    mask = (gen.uniform(size=(N, T)) < mask_p).astype(np.float64)
    mask[:, 0] = 1.0
    return logp, old, ref_logp, adv, mask


def _fd_grad(f, x, h=1e-6):
    """Central differences of a float64 Python function of an array."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        g[idx] = (f(up) - f(down)) / (2 * h)
    return g


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_equals_the_papers_objective_and_its_gradient(seed, beta):
    # GSPO's paper clips the sequence ratio tightly (3e-4, 4e-4); spread 0.002 puts sequences on
    # both sides of the clip.
    eps_low, eps_high = 3e-4, 4e-4
    logp, old, ref_logp, adv, mask = _batch(seed, spread=0.002)
    kw = dict(loss_type="gspo", eps_low=eps_low, eps_high=eps_high, beta=beta)
    got, metrics = _loss(logp, old, ref_logp, adv, mask, **kw)
    want, want_metrics = ref.policy_loss(logp, old, ref_logp, adv, mask, **kw)
    np.testing.assert_allclose(got, want, rtol=64 * EPS64, atol=64 * EPS64)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-12, atol=1e-12, err_msg=name)
    s_N = np.exp(((logp - old) * mask).sum(1) / mask.sum(1))
    inside = (1 - eps_low <= s_N) & (s_N <= 1 + eps_high)
    assert inside.any() and not inside.all()  # sequences inside the clip and outside it

    grad = jax.grad(lambda x: _loss(x, old, ref_logp, adv, mask, **kw)[0])(logp)

    def paper(x):
        return ref.gspo_loss(x, old, ref_logp, adv, mask, eps_low, eps_high, beta)

    want_grad = _fd_grad(paper, logp)
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-7 * np.abs(want_grad).max())
    assert np.all(np.asarray(grad)[mask == 0] == 0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [1.1, 5.0, math.inf])
def test_cispo_equals_the_papers_objective_and_its_gradient(seed, cap):
    logp, old, ref_logp, adv, mask = _batch(seed, spread=0.5)
    beta = 0.04
    kw = dict(loss_type="cispo", beta=beta, cispo_cap=cap)
    got, metrics = _loss(logp, old, ref_logp, adv, mask, **kw)
    want, want_metrics = ref.policy_loss(logp, old, ref_logp, adv, mask, **kw)
    np.testing.assert_allclose(got, want, rtol=64 * EPS64, atol=64 * EPS64)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-12, atol=1e-12, err_msg=name)
    r = np.exp(logp - old)
    if cap == 1.1:
        assert ((r > cap) & (mask > 0)).any() and float(metrics["clip_ratio/high_mean"]) > 0
    # The gradient: the weight is a constant (stop-gradient), so d/dlogp_it is the paper's
    # -sg(r_hat) A_i / sum |o| plus the KL's, never the derivative of the weight itself.
    grad = jax.grad(lambda x: _loss(x, old, ref_logp, adv, mask, **kw)[0])(logp)
    want_grad = (
        mask
        / mask.sum()
        * (-np.minimum(r, cap) * adv[:, None] + beta * (1 - np.exp(ref_logp - logp)))
    )
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=16 * EPS64 * np.abs(want_grad).max())
    # ... and no token is dropped: every kept token has a non-zero policy-gradient term.
    g_pg = jax.grad(lambda x: _loss(x, old, None, adv, mask, loss_type="cispo", beta=0.0)[0])(logp)
    assert np.all((np.asarray(g_pg) != 0) == (mask > 0))


@pytest.mark.parametrize("seed", range(3))
def test_on_policy_gspo_is_the_sequence_mean_policy_gradient(seed):
    """mu = 1, old = the current policy (sg): s = 1 and grad s = s grad(mean_t logp), so the GSPO
    gradient is -1/N sum_i A_i (1/|y_i|) sum_t grad logp_it: seq_mean's on-policy gradient."""
    logp, _, _, adv, mask = _batch(seed)

    def grad(loss_type):
        def f(x):
            return loss.policy_loss(
                x, x, None, adv, mask, loss_type=loss_type, beta=0.0, eps_low=3e-4, eps_high=4e-4
            )[0]

        return np.asarray(jax.jit(jax.grad(f))(logp))

    N = logp.shape[0]
    closed_form = -adv[:, None] * mask / (N * mask.sum(axis=1, keepdims=True))
    tol = 16 * EPS64 * np.abs(closed_form).max()
    np.testing.assert_allclose(grad("gspo"), closed_form, rtol=0, atol=tol)
    np.testing.assert_allclose(grad("gspo"), grad("seq_mean"), rtol=0, atol=tol)


@pytest.mark.parametrize("seed", range(3))
def test_cispo_without_a_cap_is_the_unclipped_importance_sampled_gradient(seed):
    """cap = inf: sg(r) A grad logp = A grad r, the gradient of the unclipped IS surrogate
    -1/sum|o| sum r A, off-policy (ratios far from 1, where any clip would bite)."""
    logp, old, ref_logp, adv, mask = _batch(seed, spread=1.0)

    def cispo(x):
        return loss.policy_loss(
            x, old, ref_logp, adv, mask, loss_type="cispo", cispo_cap=math.inf, beta=0.04
        )[0]

    def unclipped_is(x):
        r = jnp.exp(x - old)
        d = ref_logp - x
        per_token = -r * adv[:, None] + 0.04 * (jnp.exp(d) - d - 1)
        return jnp.sum(per_token * mask) / jnp.sum(mask)

    want = np.asarray(jax.jit(jax.grad(unclipped_is))(logp))
    got = np.asarray(jax.jit(jax.grad(cispo))(logp))
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * EPS64 * np.abs(want).max())
    assert (np.exp(logp - old)[mask > 0] > 1.5).any()  # a clip at 1 + 0.2 or 5 would differ here


@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_truncated_is_weights_each_tokens_term(loss_type):
    """cppo.tis_cap with GSPO / CISPO: each token's policy-gradient term times min(pi_old /
    pi_behav, cap) (GSPO's sequence term is on every token of the sequence)."""
    logp, old, _, adv, mask = _batch(7, spread=0.3)
    behav = old + np.random.default_rng(8).uniform(-1.0, 1.0, size=old.shape)
    cap = 2.0
    kw = dict(loss_type=loss_type, eps_low=0.2, eps_high=0.2, beta=0.0)
    got = _loss(logp, old, None, adv, mask, behav_logp_MC=behav, tis_cap=cap, **kw)[0]
    w = np.minimum(np.exp(old - behav), cap) * mask
    if loss_type == "gspo":
        s = np.exp(((logp - old) * mask).sum(1) / mask.sum(1))
        term = -np.minimum(s * adv, np.clip(s, 0.8, 1.2) * adv)
        want = np.mean(term * w.sum(1) / mask.sum(1))
    else:
        r_hat = np.minimum(np.exp(logp - old), 5.0)
        want = np.sum(-r_hat * adv[:, None] * logp * w) / mask.sum()
    np.testing.assert_allclose(got, want, rtol=64 * EPS64)
    assert (w[mask > 0] >= cap).any() and (w[mask > 0] < 1).any()


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_micro_batches_give_the_whole_batchs_gradient(loss_type):
    """trainer.micro_batch: GSPO's sequence means weigh micro-batches equally, CISPO's token mean by
    their tokens (step._grads), so accumulation gives the whole batch's loss and gradient."""
    from flax import nnx

    from cppo_jax.train import device_fns as step_lib

    try:
        from helpers import random_model, tiny_config
    except ImportError:  # tests/ became a package
        from tests.helpers import random_model, tiny_config

    jax.config.update("jax_enable_x64", False)
    try:
        M, P, C = 6, 3, 5
        graphdef, params = nnx.split(random_model(tiny_config(), seed=3))
        rng = np.random.default_rng(4)
        tokens = jnp.asarray(rng.integers(1, 257, (M, P + C)), jnp.int32)
        valid = np.ones((M, P + C), bool)
        valid[::2, -3:] = False  # lengths differ, so token and sequence weights differ
        mask = jnp.asarray(valid[:, P:], jnp.float32)
        adv = jnp.asarray(rng.standard_normal(M), jnp.float32)
        old = jnp.asarray(-rng.uniform(3.0, 6.0, (M, C)), jnp.float32)  # ratios far from 1
        batch = step_lib.Batch(tokens, jnp.asarray(valid), mask, adv, old, None)
        algo = CPPOConfig(loss_type=loss_type, beta=0.0, cispo_cap=math.inf)
        out = {}
        for micro in (0, 2):
            spec = step_lib.StepSpec.make(algo, P, C, 1.0, micro_batch=micro)
            f = jax.jit(lambda p, b, spec=spec: step_lib._grads(p, graphdef, b, spec)[::2])
            out[micro] = f(params, batch)
        (loss0, g0), (loss2, g2) = out[0], out[2]
        np.testing.assert_allclose(loss2, loss0, rtol=64 * EPS32)
        for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g0), strict=True):
            b = np.asarray(b)
            np.testing.assert_allclose(a, b, rtol=0, atol=64 * EPS32 * np.abs(b).max())
    finally:
        jax.config.update("jax_enable_x64", True)


def test_config_takes_the_losses_and_refuses_a_cap_below_one():
    assert CPPOConfig(loss_type="gspo").loss_type == "gspo"
    assert CPPOConfig(loss_type="cispo", cispo_cap=math.inf).cispo_cap == math.inf
    with pytest.raises(ConfigError, match="cppo.cispo_cap"):
        CPPOConfig(loss_type="cispo", cispo_cap=0.5)
    with pytest.raises(ValueError, match="cispo_cap"):
        b = _batch(0)
        loss.policy_loss(*b, loss_type="cispo", cispo_cap=0.0)
