"""The jitted device functions of a CPPO step: completion log-probs and the policy updates (all mu
of a step in one program).

M kept (trained) sequences, P prompt slots (left-padded), C completion slots (right-padded), T = P + C.
Both functions take the model as (graphdef, params) so params and optimizer state are plain pytrees that
the mesh can shard and `jax.jit` can donate. With LoRA (`models.lora`) params are the adapters only and
the frozen base comes as one more argument, `frozen`: gradients and optimizer state are the adapters'. Shapes are fixed by the config (Q, k, P, C), so each function
compiles once per run; a non-finite loss or gradient skips the update in-graph and is reported
(`cppo_jax.train.optimizer`: the optimizer and its update).
With a mesh (`compiled(..., mesh=...)`) params, optimizer state and gradients are sharded by the rules of
`cppo_jax.parallel.sharding`, the batch by its leading dim over (data, fsdp), and activations are constrained
while tracing; the math is the same code as on one device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cppo_jax.algo import loss as loss_lib
from cppo_jax.config.schema import CPPOConfig
from cppo_jax.observe.profile import KEPT_PROGRAMS
from cppo_jax.packing.rows import PackedBatch, packed_completion_logps
from cppo_jax.parallel import sharding as sharding_lib
from cppo_jax.rollout.embedded.sampler import positions_from_valid
from cppo_jax.train.optimizer import apply_update


class Batch(NamedTuple):
    tokens_MT: jax.Array  # int32: prompt then completion
    valid_MT: jax.Array  # bool: real prompt tokens, completion tokens up to and including EOS
    mask_MC: jax.Array  # float32: completion tokens that count in the loss
    adv_M: jax.Array  # float32
    old_logp_MC: jax.Array | None  # stale rollout only (`logp_sources`); None: the current's
    ref_logp_MC: jax.Array | None  # beta > 0 only
    behav_logp_MC: jax.Array | None = None  # cppo.tis_cap > 0 only: the sampling policy's log-probs


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static (trace-time) settings of the step functions."""

    prompt_len: int
    temperature: float
    loss_type: str
    eps_low: float
    eps_high: float
    beta: float
    mu: int
    max_completion_len: int
    micro_batch: int = 0
    logp_chunk: int = 64
    tis_cap: float = 0.0  # > 0: truncated importance sampling against batch.behav_logp_MC
    cispo_cap: float = 5.0  # loss_type="cispo": the cap of its token weight

    @classmethod
    def make(cls, algo: CPPOConfig, prompt_len: int, completion_len: int, temperature: float, **kw):
        return cls(
            prompt_len=prompt_len,
            temperature=temperature if temperature > 0 else 1.0,
            loss_type=algo.loss_type,
            eps_low=algo.eps_low,
            eps_high=algo.eps_high,
            beta=algo.beta,
            mu=algo.mu,
            max_completion_len=completion_len,
            tis_cap=algo.tis_cap,
            cispo_cap=algo.cispo_cap,
            **kw,
        )


def completion_logps(model, tokens_MT, valid_MT, spec: StepSpec, return_entropy: bool = False):
    """log p(completion token | everything before it), [M, C], without [M, T, V] logits; with
    `return_entropy`, (logp_MC, entropy_MC): the entropy of each next-token distribution."""
    P = spec.prompt_len
    pos_MT = positions_from_valid(valid_MT)
    h_MTD, _ = model.hidden(tokens_MT[:, :-1], pos_MT[:, :-1], valid_MT[:, :-1])
    h_MCD = h_MTD[:, P - 1 :]
    # Cast to the compute dtype on the shard, then gathered over fsdp (D whole), split by
    # vocabulary: logits stay split by sequence.
    w_DV = sharding_lib.gather_cast(
        model.unembed_weight(), ("embed", "vocab"), (None, "vocab"), model.cfg.compute_dtype
    )
    return loss_lib.token_logps_from_hidden(
        h_MCD,
        w_DV,
        tokens_MT[:, P:],
        temperature=spec.temperature,
        chunk_size=spec.logp_chunk,
        return_entropy=return_entropy,
    )


def _model(graphdef, params, frozen=None):
    """The model of `params` (and, with LoRA, the `frozen` base they adapt)."""
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def _loss_fn(params, graphdef, batch: Batch | PackedBatch, spec: StepSpec, first=None, frozen=None):
    model = _model(graphdef, params, frozen)
    if isinstance(batch, PackedBatch):  # trainer.pack: the forward on packed rows
        logp_MC, ent_MC = packed_completion_logps(model, batch, spec, return_entropy=True)
    else:
        logp_MC, ent_MC = completion_logps(
            model, batch.tokens_MT, batch.valid_MT, spec, return_entropy=True
        )
    # The old policy's log-probs: the given ones (a stale rollout's, or the first update's for the
    # updates after it), else this forward's (the old policy is the current one: the ratio is 1), as
    # on the `first` (a traced bool) of a step's updates. With tis_cap the tokens' pg terms are
    # weighted by min(pi_old / pi_behav, tis_cap) (`loss.tis_weights`).
    current_MC = jax.lax.stop_gradient(logp_MC)
    old_MC = current_MC if batch.old_logp_MC is None else batch.old_logp_MC
    if first is not None:
        old_MC = jnp.where(first, current_MC, old_MC)
    loss, metrics = loss_lib.policy_loss(
        logp_MC,
        old_MC,
        batch.ref_logp_MC if spec.beta > 0 else None,
        batch.adv_M,
        batch.mask_MC,
        loss_type=spec.loss_type,
        eps_low=spec.eps_low,
        eps_high=spec.eps_high,
        beta=spec.beta,
        max_completion_len=spec.max_completion_len,
        behav_logp_MC=batch.behav_logp_MC if spec.tis_cap else None,
        tis_cap=spec.tis_cap,
        cispo_cap=spec.cispo_cap,
    )
    # TRL's `entropy`: masked token mean of the policy's next-token entropy (at the temperature).
    mask_MC = batch.mask_MC.astype(jnp.float32)
    ent_MC = jax.lax.stop_gradient(ent_MC)
    metrics["entropy"] = jnp.sum(ent_MC * mask_MC) / jnp.maximum(jnp.sum(mask_MC), 1.0)
    return loss, (metrics, current_MC)


def _grads(params, graphdef, batch: Batch, spec: StepSpec, first=None, frozen=None):
    """(loss, metrics, grads, logp_MC): the loss of `batch`, its gradient, and the completion
    log-probs of this forward (stop-gradient: the old policy's for the updates after this one)."""
    grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
    M = batch.mask_MC.shape[0]
    m = spec.micro_batch
    if m > 0 and m < M and isinstance(batch, PackedBatch):
        raise ValueError(
            "trainer.pack packs all kept sequences in one forward: set trainer.micro_batch=0"
        )
    if m <= 0 or m >= M:
        (loss, (metrics, logp_MC)), grads = grad_fn(params, graphdef, batch, spec, first, frozen)
        return loss, metrics, grads, logp_MC
    if M % m:
        raise ValueError(f"trainer.micro_batch={m} must divide the {M} kept sequences of a step")
    # Gradient accumulation: equal-size micro-batches, averaged (exact for seq-level means of equal
    # weight; token-level means, token_mean and cispo, are re-weighted by each micro-batch's share of
    # the masked tokens).
    # Micro-batch j holds rows j, j + M/m, j + 2M/m, ...: with the rows split over devices in
    # contiguous blocks, every micro-batch takes m/devices rows from each device, without moving any.
    micro = Batch(*(_strided_split(x, m) for x in batch))
    tokens_total = jnp.maximum(batch.mask_MC.sum(), 1.0)

    def body(acc, mb: Batch):
        (loss, (metrics, logp_mC)), grads = grad_fn(params, graphdef, mb, spec, first, frozen)
        if loss_lib.AGGREGATION[spec.loss_type] == "token_mean":
            w = mb.mask_MC.sum() / tokens_total
        else:
            w = 1.0 / (M // m)
        acc = jax.tree.map(lambda a, g: a + w * g, acc, (loss, metrics, grads))
        return acc, logp_mC

    first_mb = Batch(*(x[0] if x is not None else None for x in micro))
    (loss, (metrics, _)), grads = jax.tree.map(
        jnp.zeros_like,
        jax.eval_shape(lambda: grad_fn(params, graphdef, first_mb, spec, first, frozen)),
    )
    mesh = sharding_lib.active_mesh()
    if mesh is not None:  # the accumulator lives where the params do
        grads = jax.lax.with_sharding_constraint(grads, sharding_lib.param_shardings(grads, mesh))
    (loss, metrics, grads), logp_XmC = jax.lax.scan(body, (loss, metrics, grads), micro)
    return loss, metrics, grads, _strided_join(logp_XmC)


def _strided_split(x_M: jax.Array | None, m: int) -> jax.Array | None:
    """[M, ...] -> [M/m, m, ...], micro-batch j = rows j, j + M/m, ...; the m rows keep the batch sharding."""
    if x_M is None:
        return None
    M = x_M.shape[0]
    x_XmM = x_M.reshape(m, M // m, *x_M.shape[1:]).swapaxes(0, 1)
    return sharding_lib.constrain(x_XmM, (None, "batch") + (None,) * (x_M.ndim - 1))


def _strided_join(x_XmM: jax.Array) -> jax.Array:
    """The inverse of `_strided_split`: [M/m, m, ...] -> [M, ...] in the original row order."""
    X, m = x_XmM.shape[:2]
    x_M = x_XmM.swapaxes(0, 1).reshape(X * m, *x_XmM.shape[2:])
    return sharding_lib.constrain(x_M, ("batch",) + (None,) * (x_M.ndim - 1))


def one_update(params, opt_state, batch: Batch, first=None, frozen=None, *, graphdef, tx, spec):
    """One optimizer update: (params, opt_state, metrics, logp_MC), logp_MC the completion log-probs
    of the params before it; skipped (params and state unchanged) when loss or grads are not finite.
    `first` (a traced bool, in a loop over a step's updates): the old policy is this forward's,
    whatever `batch.old_logp_MC` holds."""
    loss, metrics, grads, logp_MC = _grads(params, graphdef, batch, spec, first, frozen)
    params, opt_state, grad_norm, finite = apply_update(
        params, opt_state, grads, loss, tx=tx, in_loop=spec.mu > 1
    )
    metrics = dict(metrics)
    metrics["loss"] = loss
    metrics["grad_norm"] = grad_norm
    metrics["update_skipped"] = (~finite).astype(jnp.float32)
    return params, opt_state, metrics, logp_MC


def train_step(params, opt_state, batch: Batch, frozen=None, *, graphdef, tx, spec, mesh=None):
    """The step's `spec.mu` updates on `batch`, in one program: (params, opt_state, metrics).

    Old policy (`logp_sources`): `batch.old_logp_MC` when given (a stale rollout's), else the current
    policy's: the first update's own forward (ratio 1), whose log-probs (the params before it) are the
    old ones of updates 2..mu. mu = 1 is the one update; mu > 1 a `lax.scan` over the updates (one
    copy of the update in the program, its buffers reused by each), the first one's log-probs carried
    to the others. An update whose loss or gradient is not finite is skipped (params and state
    unchanged). `metrics` are the last update's, but `update_skipped` is 1 when any update was.
    `frozen`: the base under LoRA adapters (`params`), read, never updated.
    """
    update = functools.partial(one_update, frozen=frozen, graphdef=graphdef, tx=tx, spec=spec)
    with sharding_lib.use_mesh(mesh):
        if spec.mu == 1:
            params, opt_state, metrics, _ = update(params, opt_state, batch)
            return params, opt_state, metrics
        if batch.old_logp_MC is not None:  # given: the old policy of every update

            def given(state, _):
                params, opt_state, metrics, _ = update(*state, batch)
                return (params, opt_state), metrics

            (params, opt_state), per_update = jax.lax.scan(
                given, (params, opt_state), None, length=spec.mu
            )
        else:  # the current policy: the first update's forward, carried to the others

            def current(state, u):
                params, opt_state, old_MC = state
                first = u == 0
                params, opt_state, metrics, logp_MC = update(
                    params, opt_state, batch._replace(old_logp_MC=old_MC), first=first
                )
                return (params, opt_state, jnp.where(first, logp_MC, old_MC)), metrics

            unset_MC = jnp.zeros(batch.mask_MC.shape, jnp.float32)  # read by no update
            (params, opt_state, _), per_update = jax.lax.scan(
                current, (params, opt_state, unset_MC), jnp.arange(spec.mu)
            )
    metrics = {k: v[-1] for k, v in per_update.items()}
    metrics["update_skipped"] = jnp.max(per_update["update_skipped"])
    return params, opt_state, metrics


def logps_fn(params, tokens_MT, valid_MT, frozen=None, *, graphdef, spec: StepSpec, mesh=None):
    """Completion log-probs of a frozen model (reference or old policy)."""
    with sharding_lib.use_mesh(mesh):
        model = _model(graphdef, params, frozen)
        return completion_logps(model, tokens_MT, valid_MT, spec)


def compiled(
    graphdef, tx, spec: StepSpec, mesh=None, params=None, rows: int | None = None, frozen=None
):
    """(train_step, logps) jitted once per run, params and optimizer state donated.

    `train_step(params, opt_state, batch) -> (params, opt_state, metrics)`: all mu updates of a step
    (see `train_step`); `logps(params, tokens_MT, valid_MT) -> logp_MC`. With `frozen` (the base
    under LoRA adapters, or its abstract shapes) both take it as one more argument, not donated.

    With a `mesh`, both get declared shardings: `params` (the policy's params, or their abstract
    shapes) fix the param and optimizer-state layouts by the rules, the batch (`rows` sequences,
    default: any multiple of data * fsdp) is split by its leading dim, metrics are replicated.
    Arguments must arrive in those layouts (`sharding.shard_params`, `sharding.init_opt_state`,
    `sharding.batch_sharding`). Without a mesh, XLA places everything (one device).
    """
    if mesh is None:
        return _compiled(graphdef, tx, spec, None, None, None, None, None)
    if params is None:
        raise ValueError("compiled(mesh=...) needs params (or their abstract shapes) to shard")
    p_sh = sharding_lib.param_shardings(params, mesh)
    o_sh = sharding_lib.opt_state_shardings(tx, params, mesh)
    b_sh = sharding_lib.batch_sharding(mesh, rows)
    f_sh = None if frozen is None else _Frozen.of(sharding_lib.param_shardings(frozen, mesh))
    return _compiled(graphdef, tx, spec, mesh, _Frozen.of(p_sh), _Frozen.of(o_sh), b_sh, f_sh)


class _Frozen(NamedTuple):
    """A pytree of shardings as a hashable key (treedef, leaves)."""

    treedef: object
    leaves: tuple

    @classmethod
    def of(cls, tree) -> _Frozen:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple(leaves))

    def tree(self):
        return jax.tree.unflatten(self.treedef, self.leaves)


@functools.lru_cache(maxsize=KEPT_PROGRAMS)
def _compiled(graphdef, tx, spec, mesh, p_sh: _Frozen | None, o_sh: _Frozen | None, b_sh, f_sh):
    step_fn = functools.partial(train_step, graphdef=graphdef, tx=tx, spec=spec, mesh=mesh)
    logps_fn_ = functools.partial(logps_fn, graphdef=graphdef, spec=spec, mesh=mesh)
    if mesh is None:
        return jax.jit(step_fn, donate_argnums=(0, 1)), jax.jit(logps_fn_)
    params, opt_state = p_sh.tree(), o_sh.tree()
    frozen = () if f_sh is None else (f_sh.tree(),)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    step = jax.jit(
        step_fn,
        in_shardings=(params, opt_state, b_sh, *frozen),
        out_shardings=(params, opt_state, replicated),
        donate_argnums=(0, 1),
    )
    logps = jax.jit(logps_fn_, in_shardings=(params, b_sh, b_sh, *frozen), out_shardings=b_sh)
    return step, logps
