"""The device mesh and the one table that maps logical axis names onto it.

Parameters carry logical axis names as NNX metadata (`out_sharding`, set in models/transformer.py);
activations get them through `constrain`. `RULES` maps each logical name onto mesh axes (`data`, `fsdp`,
`tensor`); a dimension that a rule's axes do not divide keeps the longest prefix of them that does
(often none: replicated), so any model runs on any mesh, only less sharded. The same code runs on one
CPU (a 1x1x1 mesh), 8 GPUs or a TPU slice.

Inside the jitted step functions `use_mesh(mesh)` is active while tracing, which is what turns
`constrain` from the identity into `jax.lax.with_sharding_constraint`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.run import MESH_AXES, MeshConfig

DATA_AXES = ("data", "fsdp")  # the axes questions (and so sequences) are split over

# Logical axis name -> mesh axes, in the order they are tried. None: never sharded.
RULES: dict[str, tuple[str, ...] | None] = {
    # parameters
    "layers": None,  # the stacked decoder layers' leading axis (scanned over, never split)
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "norm": None,
    "lora_rank": None,  # the adapters' rank (models/lora.py): small, never split
    # activations
    "batch": DATA_AXES,
    "length": None,
    "act_embed": None,
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
}


class MeshError(ConfigError):
    """The mesh does not fit the devices or the batch; the message names the config keys."""


def make_mesh(
    cfg: MeshConfig, devices: Sequence[jax.Device] | None = None, *, allow_split: bool = True
) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all), -1 resolved to the rest.

    On a TPU slice JAX places the axes along the torus; a shape it cannot place without splitting a
    physical axis (16 chips as 4 x 4 and a mesh 8 x 1 x 2, say) is placed splitting one
    (`allow_split_physical_axes`: the same program, some collectives over longer paths) when
    `allow_split`, else, or when that fails too, a MeshError naming the mesh and the torus."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        sizes = cfg.sizes(len(devices))
    except ConfigError as e:
        raise MeshError(str(e)) from None
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    except (NotImplementedError, ValueError, AssertionError) as e:
        first = e
    if allow_split:
        from jax.experimental import mesh_utils

        try:
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
            return Mesh(grid, MESH_AXES, axis_types=auto)
        except (NotImplementedError, ValueError, AssertionError):
            pass
    coords = [getattr(d, "coords", None) for d in devices]
    torus = (
        " x ".join(str(max(c[i] for c in coords) + 1) for i in range(len(coords[0])))
        if coords and all(coords)
        else "unknown"
    )
    given = " ".join(f"mesh.{a}={sizes[a]}" for a in MESH_AXES)
    raise MeshError(
        f"{given} cannot be placed on the slice's torus of {torus} ({len(devices)} "
        f"{devices[0].platform} devices){'' if allow_split else ' without splitting a physical axis'}: {first}; "
        f"choose sizes that factor the torus, or leave the mesh to mesh=auto"
    ) from None


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in DATA_AXES)


def check_questions(questions: int, mesh: Mesh) -> None:
    """Questions are split whole over the data axes: Q must divide by data * fsdp."""
    dp = data_parallel_size(mesh)
    if questions % dp:
        raise MeshError(
            f"the {questions} questions per step do not split over mesh.data={mesh.shape['data']} "
            f"x mesh.fsdp={mesh.shape['fsdp']} = {dp} data-parallel devices: adjust "
            f"cppo.questions_per_step (Q={questions}) or mesh.data / mesh.fsdp so {dp} divides Q"
        )


# ---------------------------------------------------------------------------------------------
# Logical names -> PartitionSpec
# ---------------------------------------------------------------------------------------------


def logical_spec(
    names: Sequence[str | None], shape: Sequence[int], axis_sizes: Mapping[str, int]
) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dims have logical `names` (None: replicated).

    Each dim takes the mesh axes of its rule, in order, while they divide it; size-1 axes and axes
    already used by an earlier dim are skipped.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical axis names {tuple(names)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    out = []
    for name, dim in zip(names, shape):
        if name is None:
            out.append(None)
            continue
        if name not in RULES:
            raise ValueError(f"logical axis name {name!r} has no rule; known: {sorted(RULES)}")
        axes, prod = [], 1
        for axis in RULES[name] or ():
            size = axis_sizes.get(axis, 1)
            if size == 1 or axis in used:
                continue
            if dim % (prod * size):
                break
            axes.append(axis)
            prod *= size
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def named(mesh: Mesh, names: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(names, shape, mesh.shape))


def _names_of(var: nnx.Variable) -> tuple[str | None, ...] | None:
    return var.get_metadata().get("out_sharding")


def param_shardings(tree, mesh: Mesh):
    """NamedShardings for `tree` by the rules: params, their gradients or an optax state.

    Variables (nnx.Param, abstract or concrete) are placed by their logical axis names; any other
    array leaf (an optimizer step count) is replicated. Optax states mirror the param tree and keep
    each Variable's metadata, so this one function places params and optimizer state alike.
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        if isinstance(x, nnx.Variable):
            value = x.get_value()
            names = _names_of(x)
            if names is None:
                return x.replace(replicated)
            return x.replace(named(mesh, names, value.shape))
        return replicated

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_params(params, mesh: Mesh):
    """`params` (or any tree `param_shardings` accepts) placed on `mesh` by the rules."""
    return jax.device_put(params, param_shardings(params, mesh))


def opt_state_shardings(tx, params, mesh: Mesh):
    """Shardings of `tx.init(params)`: moments like their params, scalars replicated."""
    return param_shardings(jax.eval_shape(tx.init, params), mesh)


def init_opt_state(tx, params, mesh: Mesh | None):
    """`tx.init(params)`, created directly in its sharded layout when there is a mesh."""
    if mesh is None:
        return tx.init(params)
    return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh))(params)


def batch_sharding(mesh: Mesh, rows: int | None = None) -> NamedSharding:
    """Leading dim over (data, fsdp); with `rows`, only the axes that divide it (else replicated)."""
    rows = data_parallel_size(mesh) if rows is None else rows
    return named(mesh, ("batch",), (rows,))


# ---------------------------------------------------------------------------------------------
# Activation constraints
# ---------------------------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("cppo_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None):
    """Activation constraints apply to functions traced inside (none with mesh None)."""
    token = _ACTIVE.set(mesh)
    try:
        yield mesh
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` constrained to the rules' sharding of its logical `names`; the identity without a mesh."""
    mesh = _ACTIVE.get()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, names, x.shape))


def gather_cast(w: jax.Array, names: tuple[str, ...], whole: tuple[str | None, ...], dtype):
    """`w`, sharded by its logical `names`, cast to `dtype` on each device's shard, then laid out
    by `whole` (gathered along the dims `whole` leaves unsharded).

    The all-gather moves `dtype` bytes (a float32 matrix gathered and then cast held the whole
    float32 copy), and the gradient comes back reduced in `dtype`, cast to w's dtype on the
    shard. The identity without a mesh but for the cast.
    """
    if w.dtype != dtype:
        w = constrain(w.astype(dtype), names)
    return constrain(w, whole)
