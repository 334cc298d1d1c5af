"""Tests of the optimizer update in cppo_jax.train.optimizer: `apply_update` with `make_optimizer`'s transform
against optax's own `chain(clip_by_global_norm, adamw)` + `apply_updates`, and the skip of a
non-finite update (params and optimizer state bit-identical)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cppo_jax.config.schema import OptimConfig
from cppo_jax.train import optimizer as optimizer_lib

F32_EPS = float(jnp.finfo(jnp.float32).eps)
# Normwise per leaf (max |ours - optax| <= RTOL * max |optax|): the same formulas, fused differently
# by XLA and the clip scaling by max_norm / norm where optax divides then multiplies, are a few
# roundings apart; elementwise relative error would be unbounded where a moment's two terms cancel.
RTOL = 4 * F32_EPS

CFG = OptimConfig(
    lr=1e-2, schedule="cosine", warmup_ratio=0.2, weight_decay=0.1, b1=0.8, b2=0.95, grad_clip=1.0
)
TOTAL = 10


def _params(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed_VD": jax.random.normal(k[0], (37, 16), jnp.float32),
        "layers": {
            "w_LDF": jax.random.normal(k[1], (2, 16, 24), jnp.float32),
            "scale_D": 1.0 + 0.1 * jax.random.normal(k[2], (16,), jnp.float32),
        },
    }


def _grads(params, seed: int, norm: float):
    """Random gradients of global norm `norm`."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    g = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    g = jax.tree.unflatten(treedef, g)
    scale = norm / optax.global_norm(g)
    return jax.tree.map(lambda x: x * scale, g)


def _optax_tx(cfg: OptimConfig):
    lr = optimizer_lib.lr_schedule(cfg, TOTAL)
    adamw = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    clip = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
    return optax.chain(*clip, adamw)


def _ours(cfg: OptimConfig):
    tx = optimizer_lib.make_optimizer(cfg, TOTAL)
    return tx, jax.jit(functools.partial(optimizer_lib.apply_update, tx=tx), donate_argnums=(0, 1))


def _reference_step(cfg: OptimConfig):
    tx = _optax_tx(cfg)

    @jax.jit
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def _assert_close(ours, ref, what: str):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(ref)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, (what, path)
        if a.dtype.kind in "iu":
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {path}")
        else:
            err, scale = np.max(np.abs(a - b)), np.max(np.abs(b))
            assert err <= RTOL * scale, (
                f"{what} {path}: max error {err:.3g}, max |optax| {scale:.3g}"
            )


@pytest.mark.parametrize(
    "cfg, norm",
    [
        (CFG, 5.0),  # clipped
        (CFG, 0.3),  # below the clip
        (OptimConfig(**{**vars(CFG), "grad_clip": 0.0}), 5.0),  # no clip
    ],
    ids=["clip-active", "clip-inactive", "grad_clip=0"],
)
def test_update_matches_optax_chain(cfg, norm):
    tx, ours = _ours(cfg)
    ref_tx, ref = _reference_step(cfg)
    params = _params()
    state = tx.init(params)
    ref_params, ref_state = params, ref_tx.init(params)
    # The state is optax's: the same tree (old checkpoints restore), the same leaves.
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    for i in range(4):  # several updates: bias correction and schedule move
        grads = _grads(params, seed=10 + i, norm=norm)
        ref_params, ref_state = ref(ref_params, ref_state, grads)
        params, state, grad_norm, finite = ours(params, state, grads, jnp.float32(0.5))
        assert bool(finite)
        np.testing.assert_allclose(float(grad_norm), norm, rtol=RTOL)
        _assert_close(params, ref_params, f"params after update {i + 1}")
        _assert_close(state, ref_state, f"optimizer state after update {i + 1}")
    assert int(optimizer_lib.update_count(state)) == 4
    # The updates were real: the params moved by about lr per element, far beyond the tolerance.
    moved = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), params, _params())
    assert min(float(x) for x in jax.tree.leaves(moved)) > 1e-3


@pytest.mark.parametrize(
    "where, value, loss",
    [
        ("embed_VD", np.nan, 0.5),
        ("w_LDF", np.inf, 0.5),
        ("scale_D", -np.inf, 0.5),
        (None, None, np.nan),  # finite gradients, non-finite loss
    ],
)
def test_nonfinite_update_leaves_params_and_state_bit_identical(where, value, loss):
    tx, ours = _ours(CFG)
    params = _params()
    state = tx.init(params)
    params, state, _, _ = ours(params, state, _grads(params, 1, 2.0), jnp.float32(0.5))
    before = jax.tree.map(np.asarray, (params, state))
    grads = _grads(params, 2, 2.0)
    if where is not None:
        grads = jax.tree_util.tree_map_with_path(
            lambda p, x: x.at[(0,) * x.ndim].set(value) if p[-1].key == where else x, grads
        )
    params, state, grad_norm, finite = ours(params, state, grads, jnp.float32(loss))
    assert not bool(finite)
    after = jax.tree.map(np.asarray, (params, state))
    assert jax.tree.structure(after) == jax.tree.structure(before)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert int(optimizer_lib.update_count(state)) == 1
    # The metric is the pre-clip norm, as before: non-finite with the gradient.
    assert np.isfinite(float(grad_norm)) == (where is None)


def test_norm_overflow_with_finite_gradients_updates_as_optax_does():
    """Finite gradients whose squares overflow float32: the norm is inf but nothing is non-finite, so
    the update runs (the clip scales every gradient to 0), exactly as optax's chain does."""
    tx, ours = _ours(CFG)
    ref_tx, ref = _reference_step(CFG)
    params = _params()
    grads = jax.tree.map(lambda x: jnp.full_like(x, 3e19), params)
    assert not np.isfinite(float(optax.global_norm(grads)))
    ref_params, ref_state = ref(params, ref_tx.init(params), grads)
    params, state, grad_norm, finite = ours(params, tx.init(params), grads, jnp.float32(0.5))
    assert bool(finite) and float(grad_norm) == np.inf
    _assert_close(params, ref_params, "params")
    _assert_close(state, ref_state, "optimizer state")
    assert int(optimizer_lib.update_count(state)) == 1


def test_donated_update_copies_no_params_or_moments():
    """The compiled update works in place: no copy of a param-sized array (the select it replaced
    kept old and new moments alive, so XLA copied them)."""
    tx, ours = _ours(CFG)
    params = _params()
    state = tx.init(params)
    grads = _grads(params, 1, 2.0)
    hlo = ours.lower(params, state, grads, jnp.float32(0.5)).compile().as_text()
    shapes = {"f32[" + ",".join(map(str, x.shape)) + "]" for x in jax.tree.leaves(params)}
    copies = [line for line in hlo.splitlines() if " copy(" in line]
    assert not [c for c in copies if any(s in c for s in shapes)], copies


def test_any_optax_transform_updates_and_skips():
    """A plain optax transform (no extra arguments) is applied as is; non-finite still skips."""
    tx = optax.scale(-0.5)
    assert not isinstance(tx, optax.GradientTransformationExtraArgs)
    update = jax.jit(functools.partial(optimizer_lib.apply_update, tx=tx))
    params = _params()
    grads = _grads(params, 3, 2.0)
    new, state, _, finite = update(params, tx.init(params), grads, jnp.float32(0.5))
    assert bool(finite)
    _assert_close(new, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), "params")
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(np.nan), grads)
    kept, _, _, finite = update(params, state, bad, jnp.float32(0.5))
    assert not bool(finite)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*map(jax.tree.leaves, (kept, params))))
