"""cppo_jax.step's train step: the completion log-probs it returns, and `old_is_current`.

With mu > 1 the trainer takes the old policy's log-probs from the first update's forward instead of a
separate pass: the train step returns them (in the batch's row order, micro-batched or not), and with
`old_is_current` it uses them as the old ones whatever the batch holds.

The jitted programs are kept for reuse, but only the `profile.KEPT_PROGRAMS` most recent: a process
that builds many runs releases the compiled programs of the older ones.
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax import step as step_lib
from cppo_jax.config import CPPOConfig, OptimConfig
from cppo_jax.models import TransformerConfig, init_model

EPS32 = float(np.finfo(np.float32).eps)
M, P, C, V = 8, 6, 5, 61


def _parts(micro_batch: int = 0):
    """(graphdef, params, spec, tx) of a tiny model; a new optimizer object each call, as each run's."""
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
    spec = step_lib.StepSpec.make(CPPOConfig(beta=0.04, mu=2), P, C, 1.0, micro_batch=micro_batch)
    tx = step_lib.make_optimizer(OptimConfig(lr=1e-3, schedule="constant", warmup_ratio=0.0), 10)
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


def _setup(micro_batch: int = 0):
    graphdef, params, spec, tx = _parts(micro_batch)
    train_step, logps = step_lib.compiled(graphdef, tx, spec)
    return params, tx, _batch(), train_step, logps


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("micro_batch", [0, 2])
def test_returned_logps_are_the_pre_update_policy_in_row_order(micro_batch):
    params, tx, batch, train_step, logps = _setup(micro_batch)
    want = np.asarray(logps(params, batch.tokens_MT, batch.valid_MT))
    _, _, _, got = train_step(_copy(params), tx.init(params), batch, False)
    got = np.asarray(got)
    mask = np.asarray(batch.mask_MC) > 0
    # Two programs (the gradient's forward, the log-prob one) of the same float32 math.
    scale = max(1.0, float(np.abs(want[mask]).max()))
    np.testing.assert_allclose(got[mask], want[mask], rtol=0, atol=64 * EPS32 * scale)
    # A row order mix-up would be off by whole nats, far above that.
    assert np.abs(np.roll(got, 1, axis=0)[mask] - want[mask]).max() > 1e3 * 64 * EPS32 * scale


def test_old_is_current_ignores_the_given_old_logps():
    params, tx, batch, train_step, _ = _setup()
    stale = batch._replace(old_logp_MC=batch.ref_logp_MC)  # not this policy's: ratios far from 1
    none_p, _, none_m, _ = train_step(_copy(params), tx.init(params), batch, False)
    cur_p, _, cur_m, _ = train_step(_copy(params), tx.init(params), stale, True)
    old_p, _, old_m, _ = train_step(_copy(params), tx.init(params), stale, False)
    # old_is_current: the old policy is this forward's, as with no old log-probs given (ratio 1).
    assert float(cur_m["clip_ratio/region_mean"]) == 0.0 == float(none_m["clip_ratio/region_mean"])
    np.testing.assert_allclose(
        float(cur_m["loss"]), float(none_m["loss"]), rtol=16 * EPS32, atol=16 * EPS32
    )
    for a, b in zip(jax.tree.leaves(cur_p), jax.tree.leaves(none_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=16 * EPS32, atol=16 * EPS32)
    # Without the flag the given (stale) log-probs are the old policy: tokens are clipped.
    assert float(old_m["clip_ratio/region_mean"]) > 0.0
    moved = max(
        float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(old_p), jax.tree.leaves(cur_p))
    )
    assert moved > 0.0


def test_a_process_keeps_only_the_latest_programs():
    """Each run's optimizer is a new object, so each run builds its own train step: the cache reuses
    a program for the same key and keeps the `KEPT_PROGRAMS` latest, releasing older ones (and their
    compiled executables)."""
    from cppo_jax.profile import KEPT_PROGRAMS

    graphdef, params, spec, tx = _parts()
    first, _ = step_lib.compiled(graphdef, tx, spec)
    assert step_lib.compiled(graphdef, tx, spec)[0] is first
    first(
        _copy(params), tx.init(params), _batch(), jnp.bool_(True)
    )  # compiled: holds an executable
    released = weakref.ref(first)
    del first
    for _ in range(KEPT_PROGRAMS):
        g, _, s, t = _parts()
        step_lib.compiled(g, t, s)
    gc.collect()
    assert released() is None, "the oldest train step outlived KEPT_PROGRAMS newer ones"
