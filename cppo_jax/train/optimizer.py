"""The optimizer and its update: AdamW after a gradient-norm clip on a learning-rate schedule
(`optim.*`), and one update applied in-graph, or skipped when the loss or a gradient is not finite.

`make_optimizer` builds the transform the step functions (`cppo_jax.train.device_fns`) and checkpoints use;
`apply_update` is the update they run; `update_count` reads back how many updates were applied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from cppo_jax.config.schema import OptimConfig


def lr_schedule(cfg: OptimConfig, total_updates: int) -> optax.Schedule:
    """The learning rate of update number u (0-based): warmup from 0, then `optim.schedule`."""
    total = max(total_updates, 1)
    warmup = int(cfg.warmup_ratio * total)
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, total, end_value=0.0)
    if cfg.schedule == "linear":
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, cfg.lr, max(warmup, 1)),
                optax.linear_schedule(cfg.lr, 0.0, max(total - warmup, 1)),
            ],
            [warmup],
        )
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, max(warmup, 1)), optax.constant_schedule(cfg.lr)],
        [warmup],
    )


def make_optimizer(cfg: OptimConfig, total_updates: int) -> optax.GradientTransformationExtraArgs:
    """AdamW after the gradient-norm clip: the state of `optax.chain(clip_by_global_norm, adamw)`
    (so checkpoints restore), the clip taking the norm the step already computed (`grad_norm=`)."""
    lr = lr_schedule(cfg, total_updates)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` (same state, same threshold) that takes the gradients' global norm
    as the extra argument `grad_norm` when the caller has it, instead of a second pass to compute it.

    Gradients above the threshold are multiplied by max_norm / norm (optax divides by the norm, then
    multiplies: within a rounding of this); a scalar factor fuses into AdamW's moment updates, where
    a division made XLA write the clipped gradients out and read them back.
    """

    def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.global_norm(updates) if grad_norm is None else grad_norm
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def update_count(opt_state) -> jax.Array:
    """The schedule's count: updates applied (a skipped, non-finite one leaves the state alone)."""
    states = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
    counts = [s.count for s in states if isinstance(s, optax.ScaleByScheduleState)]
    if len(counts) != 1:
        raise ValueError(
            f"expected one learning-rate schedule in the optimizer state, got {len(counts)}"
        )
    return counts[0]


def _all_finite(tree, norm: jax.Array) -> jax.Array:
    """Whether every element of `tree` is finite, given its global `norm`: a finite norm says so at no
    cost; only a non-finite one (a NaN or inf, or squares overflowing float32) runs the element check."""

    def each_element():
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))

    return jax.lax.cond(jnp.isfinite(norm), lambda: jnp.bool_(True), each_element)


def apply_update(params, opt_state, grads, loss, *, tx, in_loop: bool = False):
    """(params, opt_state, grad_norm, finite): one update of `tx` with `grads`, or none (params and
    state returned untouched) when the loss or a gradient is not finite. `grad_norm` is the global
    norm before the clip.

    The norm is computed once (clip, metric and finiteness check). A lone update runs under
    `lax.cond`, so XLA updates the (donated) params and Adam moments in place: selecting between new
    and old values afterwards kept both alive, and XLA copied the moments on every update. Inside
    the loop over a step's updates (`in_loop`) it is the other way round: the cond held param-sized
    float32 copies (7B on v6e-8, mu = 2: 32.39 GiB per device with the cond, 29.62 with the select,
    compiled by libtpu), so there the new values are selected.
    A `tx` from `make_optimizer` clips with that norm; any other optax transform gets it and ignores it.
    """
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & _all_finite(grads, grad_norm)

    def update(state):
        params, opt_state = state
        update_fn = optax.with_extra_args_support(tx).update
        updates, opt_state = update_fn(grads, opt_state, params, grad_norm=grad_norm)
        return optax.apply_updates(params, updates), opt_state

    if in_loop:
        new = update((params, opt_state))
        params, opt_state = jax.tree.map(
            lambda a, b: jnp.where(finite, a, b), new, (params, opt_state)
        )
    else:
        params, opt_state = jax.lax.cond(finite, update, lambda state: state, (params, opt_state))
    return params, opt_state, grad_norm, finite
