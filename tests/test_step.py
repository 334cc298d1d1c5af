"""cppo_jax.train.device_fns's train step: all mu updates of a step in one program.

With mu > 1 the old policy's log-probs come from the first update's forward instead of a separate
pass: `one_update` returns them (in the batch's row order, micro-batched or not) and the train step
uses them as the old ones of updates 2..mu, in a `lax.scan`; the result is that of mu separate
updates. Log-probs given in the batch (a stale rollout's) are the old ones of every update.

The jitted programs are kept for reuse, but only the `profile.KEPT_PROGRAMS` most recent: a process
that builds many runs releases the compiled programs of the older ones.
"""

from __future__ import annotations

import functools
import gc
import weakref
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.config.schema import CPPOConfig, OptimConfig
from cppo_jax.models import TransformerConfig, init_model
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train import optimizer as optimizer_lib

try:
    from helpers import SMOOTH_ADAMW
except ImportError:  # tests/ became a package
    from tests.helpers import SMOOTH_ADAMW

EPS32 = float(np.finfo(np.float32).eps)
M, P, C, V = 8, 6, 5, 61


def _parts(micro_batch: int = 0, mu: int = 2):
    """(graphdef, params, spec, tx) of a tiny model; a new optimizer object each call, as each run's.
    AdamW made smooth in the gradient (`SMOOTH_ADAMW`, eps = 1): tests compare two programs' params
    after updates, where at the default eps a rounding of a near-zero gradient element moves its
    param by up to a whole lr step (issue #50); with eps = 1 it stays a rounding, on any CPU."""
    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    graphdef, params = nnx.split(init_model(cfg, seed=3))
    spec = step_lib.StepSpec.make(CPPOConfig(beta=0.04, mu=mu), P, C, 1.0, micro_batch=micro_batch)
    tx = optimizer_lib.make_optimizer(
        OptimConfig(schedule="constant", warmup_ratio=0.0, **SMOOTH_ADAMW), 10
    )
    return graphdef, params, spec, tx


def _batch() -> step_lib.Batch:
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, V, (M, P + C)), jnp.int32)
    valid = np.ones((M, P + C), bool)
    valid[::2, :2] = False  # left padding on half the rows
    valid[1::3, -2:] = False  # and early ends
    valid = jnp.asarray(valid)
    mask = valid[:, P:].astype(jnp.float32)
    adv = jnp.asarray(rng.standard_normal(M), jnp.float32)
    ref = jnp.asarray(-rng.uniform(1.0, 4.0, (M, C)), jnp.float32)
    return step_lib.Batch(tokens, valid, mask, adv, None, ref)


def _setup(micro_batch: int = 0, mu: int = 2):
    graphdef, params, spec, tx = _parts(micro_batch, mu)
    train_step, logps = step_lib.compiled(graphdef, tx, spec)
    return params, tx, _batch(), train_step, logps


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@pytest.fixture(scope="module", params=[0, 2], ids=lambda m: f"micro_batch{m}")
def mu2(request) -> SimpleNamespace:
    """mu = 2 programs of one micro-batch setting, built once for the tests below: the train step
    and the log-prob program (`step.compiled`), and `step.one_update` jitted alone, (params,
    opt_state, metrics, logp_MC) of one update; with the params and batch they start from."""
    graphdef, params, spec, tx = _parts(request.param, mu=2)
    train_step, logps = step_lib.compiled(graphdef, tx, spec)
    one = jax.jit(functools.partial(step_lib.one_update, graphdef=graphdef, tx=tx, spec=spec))
    return SimpleNamespace(
        params=params, tx=tx, batch=_batch(), train_step=train_step, logps=logps, one=one
    )


@pytest.mark.slow
def test_returned_logps_are_the_pre_update_policy_in_row_order(mu2):
    params, tx, batch = mu2.params, mu2.tx, mu2.batch
    want = np.asarray(mu2.logps(params, batch.tokens_MT, batch.valid_MT))
    _, _, _, got = mu2.one(_copy(params), tx.init(params), batch)
    got = np.asarray(got)
    mask = np.asarray(batch.mask_MC) > 0
    # Two programs (the gradient's forward, the log-prob one) of the same float32 math.
    scale = max(1.0, float(np.abs(want[mask]).max()))
    np.testing.assert_allclose(got[mask], want[mask], rtol=0, atol=64 * EPS32 * scale)
    # A row order mix-up would be off by whole nats, far above that.
    assert np.abs(np.roll(got, 1, axis=0)[mask] - want[mask]).max() > 1e3 * 64 * EPS32 * scale


def _assert_params_close(got, want, tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))


@pytest.mark.slow
@pytest.mark.parametrize("given_old", [False, True])
def test_mu2_in_one_program_is_two_updates(mu2, given_old):
    """mu = 2 in one program = two separate updates: the second with the first's log-probs as the old
    ones (given_old: both with the batch's). Metrics: the last update's.

    Two programs' params after two updates: AdamW made smooth in the gradient (`_parts`), so a few
    float32 ulps per operation, on any CPU. Fails when the program's second update starts from the
    wrong params, old log-probs or batch: those move the params by ~lr x a gradient difference, far
    above it."""
    params, tx, batch, one = mu2.params, mu2.tx, mu2.batch, mu2.one
    if given_old:  # a stale rollout's (here another policy's: ratios far from 1)
        batch = batch._replace(old_logp_MC=batch.ref_logp_MC)
    p1, o1, _, logp_MC = one(_copy(params), tx.init(params), batch)
    second = batch if given_old else batch._replace(old_logp_MC=logp_MC)
    want_p, _, want_m, _ = one(p1, o1, second)
    got_p, _, got_m = mu2.train_step(_copy(params), tx.init(params), batch)
    # The same float32 math in two programs (XLA may fuse, so round, differently): a few float32
    # ulps per operation, relative to each leaf's size.
    tol = 64 * EPS32
    _assert_params_close(got_p, want_p, tol)
    assert set(got_m) == set(want_m)
    for k in want_m:
        np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=tol, atol=tol, err_msg=k)
    assert float(got_m["update_skipped"]) == 0.0
    # The second update is off-policy: its ratio moved from 1 (the first's is exactly 1 unless given).
    assert float(got_m["ratio/abs_dev_mean"]) > 1e3 * EPS32


@pytest.mark.slow
def test_given_old_logps_are_the_old_policy_and_none_is_the_current_one():
    params, tx, batch, train_step, _ = _setup(mu=1)
    stale = batch._replace(old_logp_MC=batch.ref_logp_MC)  # not this policy's: ratios far from 1
    cur_p, _, cur_m = train_step(_copy(params), tx.init(params), batch)
    old_p, _, old_m = train_step(_copy(params), tx.init(params), stale)
    # None: the old policy is this forward's (ratio exactly 1, nothing clipped).
    assert float(cur_m["clip_ratio/region_mean"]) == 0.0 == float(cur_m["ratio/abs_dev_mean"])
    # Given (stale) log-probs are the old policy: tokens are clipped, the update differs.
    assert float(old_m["clip_ratio/region_mean"]) > 0.0
    moved = max(
        float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(old_p), jax.tree.leaves(cur_p))
    )
    assert moved > 0.0


@pytest.mark.slow
def test_a_skipped_update_is_reported_whichever_of_mu():
    """A non-finite loss skips every update (params unchanged) and the step reports it."""
    params, tx, batch, train_step, _ = _setup(mu=3)
    poisoned = batch._replace(adv_M=batch.adv_M * jnp.nan)
    got_p, _, m = train_step(_copy(params), tx.init(params), poisoned)
    assert float(m["update_skipped"]) == 1.0
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_process_keeps_only_the_latest_programs():
    """Each run's optimizer is a new object, so each run builds its own train step: the cache reuses
    a program for the same key and keeps the `KEPT_PROGRAMS` latest, releasing older ones (and their
    compiled executables)."""
    from cppo_jax.observe.profile import KEPT_PROGRAMS

    graphdef, params, spec, tx = _parts()
    first, _ = step_lib.compiled(graphdef, tx, spec)
    assert step_lib.compiled(graphdef, tx, spec)[0] is first
    first(_copy(params), tx.init(params), _batch())  # compiled: holds an executable
    released = weakref.ref(first)
    del first
    for _ in range(KEPT_PROGRAMS):
        g, _, s, t = _parts()
        step_lib.compiled(g, t, s)
    gc.collect()
    assert released() is None, "the oldest train step outlived KEPT_PROGRAMS newer ones"


def _zero_residual_writes(params):
    """The params with every layer's attention and MLP output projection zero: each layer adds exactly
    0 to the residual stream, so the hidden states are the embeddings, final-normed, on every path."""
    flat = [
        (
            path,
            var.replace(jnp.zeros_like(var.get_value()))
            if path[-1] in ("o_HED", "down_FD")
            else var,
        )
        for path, var in nnx.to_flat_state(params)
    ]
    return nnx.from_flat_state(flat)


@pytest.mark.slow
def test_bf16_training_logps_equal_the_samplers_with_float32_params():
    """bf16 compute, float32 params: the trainer's log-probs of the sampled tokens are the embedded
    sampler's (Samples.logp_NC), and the on-policy TIS weight is 1, to float32 rounding.

    The layers write zero to the residual stream, so the hidden states are the same bf16 numbers in
    the sampler's prefill and decode and in the training forward: what is left is the logits matmul.
    With one precision rule (`transformer.unembed`: both operands bf16, float32 accumulation) both paths
    multiply the same numbers and differ only by float32 rounding of the accumulation and log-softmax.
    A float32 unembedding in the training forward moves each log-prob by the bf16 rounding of the
    weight instead: ~1e4 float32 ulps here (0.1 to 0.4 bf16 ulps: below any bf16 tolerance, so the
    tolerance is float32's, which the shared bf16 operands allow).
    """
    from cppo_jax.algo import loss as loss_lib
    from cppo_jax.rollout.embedded.sampler import make_sampler
    from cppo_jax.rollout.embedded.sampling import SamplingParams
    from tests import helpers

    cfg = helpers.tiny_config(tie_word_embeddings=False, dtype="bfloat16", num_layers=1)
    assert cfg.weight_dtype == jnp.float32 and cfg.compute_dtype == jnp.bfloat16
    graphdef, params = nnx.split(helpers.random_model(cfg, seed=0))
    params = _zero_residual_writes(params)
    Pn, Cn, G, temperature = 7, 11, 3, 0.5
    tokens_QP, valid_QP, _ = helpers.left_pad(
        [[5, 17, 33], [9, 200, 3, 44, 45, 46, 47], [128]], length=Pn
    )
    sp = SamplingParams(
        max_new_tokens=Cn,
        temperature=temperature,
        eos_id=cfg.vocab_size,
        pad_id=0,
        cache_dtype="bfloat16",
    )
    seeds_Q = jnp.asarray([1, 2, 3], jnp.uint32)
    out = make_sampler(graphdef, G, sp)(
        params, jnp.asarray(tokens_QP), jnp.asarray(valid_QP), seeds_Q
    )
    tokens_MT = jnp.concatenate([jnp.repeat(jnp.asarray(tokens_QP), G, 0), out.tokens_NC], axis=1)
    valid_MT = jnp.concatenate([jnp.repeat(jnp.asarray(valid_QP), G, 0), out.valid_NC], axis=1)
    spec = step_lib.StepSpec.make(CPPOConfig(), Pn, Cn, temperature)
    _, logps = step_lib.compiled(graphdef, _parts()[3], spec)
    logp_MC = logps(params, tokens_MT, valid_MT)
    behav_MC = out.logp_NC
    mask_MC = out.valid_NC.astype(jnp.float32)
    assert float(mask_MC.sum()) == mask_MC.size  # no EOS: every sampled token is compared
    # float32 rounding of a V-term accumulation and log-softmax, relative to the log-prob's size.
    tol_MC = 16 * EPS32 * (1 + np.abs(np.asarray(behav_MC)))
    gap_MC = np.abs(np.asarray(logp_MC) - np.asarray(behav_MC))
    assert np.all(gap_MC <= tol_MC), np.max(gap_MC / tol_MC)
    w_MC = np.asarray(loss_lib.tis_weights(logp_MC, behav_MC, mask_MC, 2.0))
    assert np.all(np.abs(w_MC - 1) <= tol_MC), np.max(np.abs(w_MC - 1) / tol_MC)
