"""The device programs of a run, built from its config: what the trainer runs and `aot` compiles.

`build(cfg, devices)` returns, each with abstract arguments (`jax.ShapeDtypeStruct`s carrying the
mesh's shardings) for one step of `cfg`, the programs the trainer calls with the same static settings
(`step_spec`, `sampling_params`), so a program compiled from them is the one a run would compile:

- "step": what every step runs after its rewards (`after_rewards`, built by `update_programs` for
  the trainer too): pruning, the reference's and
  the overlap snapshot's log-probs and the mu updates in one program (with `trainer.pack`: the
  packed batch's forwards and updates; pruning, a small program, is not listed);
- "train_step", "ref_logps", "old_logps" (overlap): the same work as separate programs (run by a
  packed step whose sequences overflow its rows, and by `Trainer.phase_split`), and the parts the
  memory plan (`planning.compiled_memory`) models and `plan` compares;
- "sampler": the embedded sampler.

No weights are read: the model's shapes come from its `config.json` or known size.

B = one per data-parallel device; other letters as in docs/conventions.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cppo_jax.algo.cppo import Shapes, shapes_of
from cppo_jax.algo.logp_sources import LogpSources
from cppo_jax.algo.logp_sources import logp_sources as sources_of
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.schema import Config
from cppo_jax.packing.plan import config_lengths
from cppo_jax.packing.rows import PackedBatch, Packer
from cppo_jax.parallel import sharding as sharding_lib
from cppo_jax.rollout.embedded.sampler import make_sampler, sampler_shardings
from cppo_jax.rollout.embedded.sampling import SamplingParams
from cppo_jax.train import after_rewards
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train import optimizer as optimizer_lib
from cppo_jax.train.after_rewards import Rolled

ARGS_OF = {  # the resident state each program takes as arguments (the rest is alive beside it)
    "train_step": ("params", "opt_state", "base"),
    "ref_logps": ("reference", "base"),
    "old_logps": ("snapshot", "base"),
    "sampler": ("params", "base"),
}


def step_spec(cfg: Config, shapes: Shapes) -> step_lib.StepSpec:
    """The train step's and log-prob functions' static settings for `cfg`."""
    return step_lib.StepSpec.make(
        cfg.cppo, shapes.P, shapes.C, cfg.rollout.temperature, micro_batch=cfg.trainer.micro_batch
    )


def sampling_params(cfg: Config, shapes: Shapes, stop_ids, pad_id: int) -> SamplingParams:
    """The rollout's sampling settings (the embedded sampler's static arguments)."""
    return SamplingParams(
        max_new_tokens=shapes.C,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        eos_id=tuple(stop_ids),
        pad_id=pad_id,
        cache_dtype=cfg.model.dtype,
        compact=cfg.rollout.compact,
    )


def logp_sources(cfg: Config) -> LogpSources:
    """Where `cfg`'s steps take their old-policy and behaviour log-probs from (`logp_sources`)."""
    return sources_of(rollout_ahead(cfg), cfg.cppo.tis_cap, cfg.cppo.mu)


def rollout_ahead(cfg: Config) -> int:
    """How many updates a rollout may run ahead of the update that trains on it: 0 synchronous,
    else `rollout.max_staleness` (1: the overlap's one-step snapshot)."""
    return cfg.rollout.max_staleness if cfg.rollout.overlap else 0


def batch_fields(cfg: Config) -> dict[str, bool]:
    """Which optional log-probs a step's `step.Batch` carries (as `Trainer._step` fills it)."""
    src = logp_sources(cfg)
    return {
        "old_logp_MC": src.old_given,
        "ref_logp_MC": cfg.cppo.beta > 0,
        "behav_logp_MC": src.behav is not None,
    }


def _abstract(tree, shardings):
    """`tree`'s arrays as ShapeDtypeStructs placed by `shardings` (a tree of the same structure)."""

    def one(x, s):
        value = x.get_value() if isinstance(x, nnx.Variable) else x
        placed = s.get_value() if isinstance(s, nnx.Variable) else s
        out = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=placed)
        return x.replace(out) if isinstance(x, nnx.Variable) else out

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return jax.tree.map(one, tree, shardings, is_leaf=is_var)


@dataclasses.dataclass
class Built:
    """The programs of one step: name -> (jitted function, abstract arguments)."""

    mesh: jax.sharding.Mesh
    shapes: Shapes
    programs: dict[str, tuple[object, tuple]]
    resident: dict[str, int]  # bytes per device of the state that lives through a step
    args_of: dict[str, tuple[str, ...]]  # which of that state each program takes


def _bytes_per_device(tree) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        n = 1
        for d in shard:
            n *= d
        total += n * jnp.dtype(x.dtype).itemsize
    return total


def _tokenizer_ids(cfg: Config) -> tuple[tuple[int, ...], int]:
    """The stop ids and pad id of the config's tokenizer (placeholders when there is none: they
    are constants of the sampler and change no shape)."""
    from cppo_jax.models.tokenizer import Tokenizer, has_tokenizer

    folder = cfg.model.tokenizer_folder
    if folder and has_tokenizer(folder):
        tok = Tokenizer.from_dir(folder)
        return tuple(tok.stop_ids), tok.pad_id
    return (0,), 0


def model_config(cfg: Config):
    """The TransformerConfig of `cfg`'s model from its config.json or known size (no weights)."""
    from cppo_jax.models.known import config_model_size, transformer_config

    size = config_model_size(cfg)
    if size is None:
        raise ConfigError(
            f"model.path={cfg.model.path!r}: no config.json there and no known model name, so its "
            f"programs cannot be built"
        )
    return transformer_config(cfg, size)


class UpdatePrograms(NamedTuple):
    """Steps 6-7 and 4-7 of a run, compiled from one place for the trainer (`roles.build_actor`),
    `compile_ahead` and `plan --compile-for` (`build`): the same settings make the same programs."""

    tx: object  # the optimizer
    lr_fn: Callable  # update count -> learning rate
    spec: step_lib.StepSpec
    sources: LogpSources
    train_step: Callable  # (params, opt_state, batch, *frozen) -> (params, opt_state, metrics)
    logps: Callable  # (params, tokens_MT, valid_MT, *frozen) -> logp_MC
    fused: after_rewards.Compiled  # steps 4-7 after the rewards (packed rows: 6-7 and pruning)


def schedule_updates(cfg: Config, num_steps: int | None = None) -> int:
    """The optimizer's schedule length in updates: `num_steps` (the trainer's, one epoch of its data
    when `trainer.steps` is 0) or `trainer.steps` (1 when unset: a plan without the data) times mu."""
    return max(num_steps or cfg.trainer.steps, 1) * cfg.cppo.mu


def update_programs(
    cfg: Config,
    shapes: Shapes,
    mesh,
    graphdefs: tuple,
    params,
    frozen=None,
    packer: Packer | None = None,
    num_steps: int | None = None,
) -> UpdatePrograms:
    """The run's update programs (see `UpdatePrograms`). `graphdefs`: (the trained model's, the model
    without adapters); `params`: the trained params or their shapes (with their shardings); `frozen`:
    LoRA's base; `packer`: packed rows (`trainer.pack`), else the padded batch."""
    tx = optimizer_lib.make_optimizer(cfg.optim, schedule_updates(cfg, num_steps))
    lr_fn = optimizer_lib.lr_schedule(cfg.optim, schedule_updates(cfg, num_steps))
    spec = step_spec(cfg, shapes)
    train_step, logps = step_lib.compiled(
        graphdefs[0], tx, spec, mesh=mesh, params=params, rows=shapes.M, frozen=frozen
    )
    sources = logp_sources(cfg)
    prog = after_rewards.Program(
        *graphdefs,
        tx,
        lr_fn,
        spec,
        shapes,
        cfg.cppo,
        cfg.trainer.seed,
        sources,
        lora=frozen is not None,
    )
    fused = after_rewards.compiled(prog, mesh, params, frozen, packed=packer is not None)
    return UpdatePrograms(tx, lr_fn, spec, sources, train_step, logps, fused)


def build(cfg: Config, devices, num_steps: int | None = None) -> Built:
    """The programs of one step of `cfg` on a mesh over `devices` (see the module docstring);
    `num_steps`: the run's, when known (the schedule's length: `schedule_updates`).

    With `model.lora` the train step and log-probs take the adapters and the frozen base (resident
    as `base`, in the compute dtype), the reference is the base's forward without adapters, and the
    embedded sampler runs the adapted model (the adapters unmerged on the base: no copy made)."""
    from cppo_jax.models import lora_state
    from cppo_jax.models.transformer import Transformer, forward_copy

    sh = shapes_of(cfg)
    tcfg = model_config(cfg)
    lora = cfg.model.lora.enabled
    if lora:
        tcfg = lora_state.transformer_config(tcfg, cfg.model.lora)
    mesh = sharding_lib.make_mesh(cfg.mesh, devices=devices)
    sharding_lib.check_questions(sh.Q, mesh)
    model = nnx.eval_shape(lambda: Transformer(tcfg, rngs=nnx.Rngs(0)))
    plain_graphdef, base, frozen = None, None, ()
    if lora:
        graphdef, state, base_state = lora_state.split(model)
        plain_graphdef = lora_state.base_graphdef(tcfg)
        base = _abstract(
            jax.eval_shape(lambda p: lora_state.cast(p, tcfg.compute_dtype), base_state),
            sharding_lib.param_shardings(base_state, mesh),
        )
        frozen = (base,)
    else:
        graphdef, state = nnx.split(model)
    params = _abstract(state, sharding_lib.param_shardings(state, mesh))
    packer = None
    if cfg.trainer.pack:  # packed rows: R x L instead of M x T, same per-sequence arrays
        spec = step_spec(cfg, sh)
        packer = Packer.make(cfg.trainer, sh, graphdef, spec, mesh, config_lengths(cfg, sh))
    graphdefs = (graphdef, plain_graphdef or graphdef)
    up = update_programs(cfg, sh, mesh, graphdefs, params, base, packer, num_steps)
    tx, spec, train_step, logps = up.tx, up.spec, up.train_step, up.logps
    opt = _abstract(
        jax.eval_shape(tx.init, params), sharding_lib.opt_state_shardings(tx, params, mesh)
    )

    rows = sharding_lib.batch_sharding(mesh, sh.M)
    T = sh.P + sh.C

    def rows_of(shape, dtype, sharding=rows):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    tokens, valid = rows_of((sh.M, T), jnp.int32), rows_of((sh.M, T), jnp.bool_)
    logp = rows_of((sh.M, sh.C), jnp.float32)
    have = batch_fields(cfg)
    batch = step_lib.Batch(
        tokens,
        valid,
        rows_of((sh.M, sh.C), jnp.float32),
        rows_of((sh.M,), jnp.float32),
        *(logp if have[f] else None for f in ("old_logp_MC", "ref_logp_MC", "behav_logp_MC")),
    )
    ref_args = (tokens, valid)
    if packer is not None:
        packed = [rows_of((packer.rows, packer.length), jnp.int32) for _ in range(3)]
        batch = PackedBatch(*packed, rows_of((sh.M, sh.C), jnp.int32), *batch[2:])
        logps = packer.logps
        ref_args = (batch._replace(old_logp_MC=None, ref_logp_MC=None, behav_logp_MC=None),)
    programs = {"train_step": (train_step, (params, opt, batch, *frozen))}
    resident = {"params": _bytes_per_device(params), "opt_state": _bytes_per_device(opt)}
    args_of = dict(ARGS_OF)
    # The reference and the overlap's snapshot: forward-only copies in the compute dtype (with
    # LoRA: no reference copy, the base's forward; the snapshot is of the adapters).
    copy = _abstract(
        jax.eval_shape(lambda p: forward_copy(p, tcfg.compute_dtype), params),
        sharding_lib.param_shardings(params, mesh),
    )
    if lora:
        resident["base"] = _bytes_per_device(base)
        args_of.update(
            train_step=("params", "opt_state", "base"),
            ref_logps=("base",),
            old_logps=("snapshot", "base"),
            sampler=("params", "base"),  # the adapters unmerged on the base (`adapted_params`)
        )
    if cfg.cppo.beta > 0 and lora:
        _, base_logps = step_lib.compiled(plain_graphdef, tx, spec, mesh, base, sh.M)
        programs["ref_logps"] = (base_logps, (base, *ref_args))
    elif cfg.cppo.beta > 0:
        programs["ref_logps"] = (logps, (copy, *ref_args))
        resident["reference"] = _bytes_per_device(copy)
    if logp_sources(cfg).needs_snapshot:  # the overlap snapshot's (old or behaviour) log-probs
        programs["old_logps"] = (logps, (copy, *ref_args, *frozen))
        resident["snapshot"] = _bytes_per_device(copy)
    # The program a step runs after its rewards (`after_rewards`): the parts above fused, with the
    # reference's and the snapshot's copies as arguments beside the params and optimizer state.
    fused = up.fused
    ref_copy = copy if cfg.cppo.beta > 0 and not lora else None
    snap = copy if logp_sources(cfg).needs_snapshot else None
    sampler_logps = logp_sources(cfg).behav == "sampler"  # a snapshot's are computed inside
    if cfg.trainer.pack:
        behav = batch.behav_logp_MC if sampler_logps else None
        head = (batch._replace(old_logp_MC=None, ref_logp_MC=None, behav_logp_MC=behav),)
    else:
        q_rows = sharding_lib.batch_sharding(mesh, sh.Q)
        n_rows = (sh.Q * sh.G, sh.C)
        head = (
            rows_of((), jnp.int32, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
            Rolled(
                rows_of((sh.Q, sh.G), jnp.float32, q_rows),
                rows_of((sh.Q, sh.P), jnp.int32, q_rows),
                rows_of((sh.Q, sh.P), jnp.bool_, q_rows),
                rows_of(n_rows, jnp.int32, q_rows),
                rows_of(n_rows, jnp.bool_, q_rows),
                rows_of(n_rows[:1], jnp.bool_, q_rows),
                rows_of(n_rows, jnp.float32, q_rows)
                if logp_sources(cfg).behav == "sampler"
                else None,
            ),
        )
    programs["step"] = (fused.update, (params, opt, *head, ref_copy, snap, *frozen))
    args_of["step"] = (
        tuple(k for k, x in (("reference", ref_copy), ("snapshot", snap)) if x is not None)
        + args_of["train_step"]
    )
    if cfg.rollout.backend == "embedded":
        stop_ids, pad_id = _tokenizer_ids(cfg)
        sp = sampling_params(cfg, sh, stop_ids, pad_id)
        weights = nnx.merge_state(params, base) if lora else params
        placed = sampler_shardings(mesh, weights, sh.Q, sh.P, sh.G, sp)
        sampler = make_sampler(graphdef, sh.G, sp, placed)
        prompts = tuple(
            rows_of(shape, dtype, s)
            for shape, dtype, s in zip(
                ((sh.Q, sh.P), (sh.Q, sh.P), (sh.Q,)),
                (jnp.int32, jnp.bool_, jnp.uint32),
                placed.in_[1:],
            )
        )
        programs["sampler"] = (sampler, (weights, *prompts))
    args_of = {name: args_of[name] for name in programs}
    return Built(mesh, sh, programs, resident, args_of)
