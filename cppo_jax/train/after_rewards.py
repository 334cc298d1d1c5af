"""Steps 4-7 of a CPPO step, after the rewards, as one compiled program (issue #35).

`after_rewards(params, opt_state, step, rolled, ref_params, snap_params, *frozen)`:
  4-5. advantages and pruning (`cppo.prune`, inlined), its key drawn from (seed, `step`) inside,
       `step` a traced int32 scalar: one program for the whole run;
  6.   the reference's log-probs of the kept sequences (beta > 0; with LoRA the frozen base under
       the plain graphdef) and the overlap snapshot's (`logp_sources(...).needs_snapshot`);
  7.   the mu updates exactly as `device_fns.train_step`;
each phase under its `jax.named_scope` (`prune`, `ref_logps`, `old_logps`, `update`: a profiled
step's trace and HLO name them); returns (params, opt_state, metrics): the train step's metrics,
`cppo/tokens_trained` and `learning_rate` (the schedule at the last update applied), replicated, so
the trainer fetches them once and nothing else. `programs.update_programs` builds it for the trainer
and for the planner alike.

`trainer.pack` packs the kept sequences on the host between pruning and the forwards: there pruning
is its own program (`prune_step`, the same key) and `train_kept` fuses 6-7 on the packed batch.

Letters as in docs/conventions.md (Q questions, N = Q * G rolled out, M kept, C completion slots).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cppo_jax.algo import cppo
from cppo_jax.algo.logp_sources import LogpSources
from cppo_jax.config.schema import CPPOConfig
from cppo_jax.packing.rows import PackedBatch, packed_completion_logps
from cppo_jax.parallel import sharding as sharding_lib
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train.optimizer import update_count


class Rolled(NamedTuple):
    """A step's rollout and rewards as the program takes them, every array split by rows."""

    rewards_QG: jax.Array  # float32
    prompt_QP: jax.Array  # int32, left-padded
    pvalid_QP: jax.Array  # bool
    tokens_NC: jax.Array  # int32
    valid_NC: jax.Array  # bool
    finished_N: jax.Array  # bool
    logp_NC: jax.Array | None = None  # the sampler's log-probs (behaviour policy "sampler" only)


@dataclasses.dataclass(frozen=True)
class Program:
    """The static (trace-time) settings of the fused programs."""

    graphdef: nnx.GraphDef  # the trained model's (with LoRA: with the adapters)
    ref_graphdef: nnx.GraphDef  # the model without adapters: the reference's forward
    tx: object
    lr_fn: Callable  # update count -> learning rate
    spec: step_lib.StepSpec
    shapes: cppo.Shapes
    algo: CPPOConfig
    seed: int  # trainer.seed: pruning's key is `pruning_key(seed, step)`
    sources: LogpSources
    lora: bool  # the reference is the frozen base (no params of its own)


def pruning_key(seed: int, step):
    """Pruning's key at `step` (an int, or an int32 scalar traced): one rule for every path."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def prune_step(step, rolled: Rolled, *, prog: Program, mesh=None) -> cppo.Pruned:
    """Steps 4-5: `cppo.prune` of `rolled` with the key of `step` (an int32 scalar, traced)."""
    key = pruning_key(prog.seed, step)
    r = rolled
    with jax.named_scope("prune"):
        return cppo.prune(
            *(r.rewards_QG, key, r.prompt_QP, r.pvalid_QP, r.tokens_NC, r.valid_NC, r.finished_N),
            r.logp_NC,
            shapes=prog.shapes,
            algo=prog.algo,
            mesh=mesh,
        )


def train_kept(params, opt_state, batch, ref_params, snap_params, frozen=None, *, prog, mesh=None):
    """Steps 6-7 on the kept sequences: `batch` a `step.Batch` or a `PackedBatch` whose old and
    reference log-probs are unset (its behaviour ones the sampler's, or unset). Returns
    (params, opt_state, metrics) with `cppo/tokens_trained` and `learning_rate` in the metrics."""
    spec, src = prog.spec, prog.sources

    def logps(graphdef, p, base=None):
        if isinstance(batch, PackedBatch):  # trainer.pack (refused with LoRA by the config)
            with sharding_lib.use_mesh(mesh):
                return packed_completion_logps(nnx.merge(graphdef, p), batch, spec)
        return step_lib.logps_fn(
            p, batch.tokens_MT, batch.valid_MT, base, graphdef=graphdef, spec=spec, mesh=mesh
        )

    ref = old = None
    behav = batch.behav_logp_MC
    if spec.beta > 0:  # the initial model's: with LoRA the base, adapters off
        with jax.named_scope("ref_logps"):
            ref = logps(prog.ref_graphdef, frozen if prog.lora else ref_params)
    if src.needs_snapshot:  # the params that sampled (`logp_sources`)
        with jax.named_scope("old_logps"):
            snap = logps(prog.graphdef, snap_params, frozen)
        old = snap if src.old == "snapshot" else None
        behav = snap if src.behav == "snapshot" else behav
    batch = batch._replace(old_logp_MC=old, ref_logp_MC=ref, behav_logp_MC=behav)
    with jax.named_scope("update"):
        params, opt_state, metrics = step_lib.train_step(
            params,
            opt_state,
            batch,
            frozen,
            graphdef=prog.graphdef,
            tx=prog.tx,
            spec=spec,
            mesh=mesh,
        )
    metrics["cppo/tokens_trained"] = jnp.sum(batch.mask_MC)
    metrics["learning_rate"] = prog.lr_fn(jnp.maximum(update_count(opt_state) - 1, 0))
    return params, opt_state, metrics


def after_rewards(
    params,
    opt_state,
    step,
    rolled: Rolled,
    ref_params,
    snap_params,
    frozen=None,
    *,
    prog,
    mesh=None,
):
    """Steps 4-7 in one program (see the module docstring): (params, opt_state, metrics)."""
    p = prune_step(step, rolled, prog=prog, mesh=mesh)
    batch = step_lib.Batch(p.tokens_MT, p.valid_MT, p.mask_MC, p.adv_M, None, None, p.behav_logp_MC)
    return train_kept(
        params, opt_state, batch, ref_params, snap_params, frozen, prog=prog, mesh=mesh
    )


class Compiled(NamedTuple):
    """The jitted programs of a run: `update` (padded: steps 4-7 from `Rolled`; packed: 6-7 from a
    `PackedBatch`), `prune` (packed only: steps 4-5), and the layouts their arguments take."""

    update: Callable
    prune: Callable | None
    rolled_sharding: object | None  # where `Rolled`'s arrays go (None: one device)


def compiled(prog: Program, mesh=None, params=None, frozen=None, packed: bool = False) -> Compiled:
    """The run's fused programs, params and optimizer state donated.

    Arguments (after params, opt_state): padded, (step, rolled, ref_params, snap_params, *frozen);
    packed, (batch, ref_params, snap_params); `ref_params` None when beta = 0 or with LoRA (the
    base, `frozen`, is the reference), `snap_params` None unless the step needs the snapshot. With
    a `mesh` the shardings are declared as `step.compiled` does: params and optimizer state by the
    rules (`params`: the policy's params or their shapes; the reference and the snapshot, copies
    of them, alike), the rollout and the batch by rows over (data, fsdp), metrics replicated.
    """
    fn = after_rewards if not packed else train_kept
    update_fn = functools.partial(fn, prog=prog, mesh=mesh)
    prune_fn = functools.partial(prune_step, prog=prog, mesh=mesh) if packed else None
    if mesh is None:
        prune = jax.jit(prune_fn) if packed else None
        return Compiled(jax.jit(update_fn, donate_argnums=(0, 1)), prune, None)
    if params is None:
        raise ValueError("after_rewards.compiled(mesh=...) needs params (or their shapes)")
    p_sh = sharding_lib.param_shardings(params, mesh)
    o_sh = sharding_lib.opt_state_shardings(prog.tx, params, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows_sh = sharding_lib.batch_sharding(mesh, prog.shapes.Q)  # Q rows and N = Q * G alike
    ref_sh = p_sh if prog.spec.beta > 0 and not prog.lora else None
    snap_sh = p_sh if prog.sources.needs_snapshot else None
    f_sh = () if frozen is None else (sharding_lib.param_shardings(frozen, mesh),)
    b_sh = sharding_lib.batch_sharding(mesh, prog.shapes.M)
    head = (replicated, rows_sh) if not packed else (b_sh,)
    update = jax.jit(
        update_fn,
        in_shardings=(p_sh, o_sh, *head, ref_sh, snap_sh, *f_sh),
        out_shardings=(p_sh, o_sh, replicated),
        donate_argnums=(0, 1),
    )
    prune = None
    if packed:
        prune = jax.jit(prune_fn, in_shardings=(replicated, rows_sh))  # `cppo.prune` lays out
    return Compiled(update, prune, rows_sh)
