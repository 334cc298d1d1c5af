"""The memory plan's terms for a training step on a (data, fsdp, tensor) mesh, and the candidate meshes.

`memory_plan(tcfg, mesh, ...)` gives the per-device bytes of a step's dominant buffers, the terms
of the one memory model (what `trainer.dry_run=true` and `python -m cppo_jax.plan` print line by
line), and names every mesh axis that cannot shard a dimension it is meant to shard (`Unsharded`: the
dimension's size is not a multiple of the axis, so those weights are held whole on each device of that
axis). `compiled_memory` assembles the terms into each compiled program's bytes, as the compilers lay
them out, and its `run_plan` is the plan every verdict is made on. `candidate_meshes` lists the
layouts of N devices whose data axes divide the questions per step, in `preference`'s order once
planned: the most data parallel layout that fits, then the fewest tensor shards (what
`launch/gpu_node.sh` runs).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from cppo_jax.config.run import MESH_AXES
from cppo_jax.config.schema import Config
from cppo_jax.packing import plan as pack_plan

_BYTES = {"float32": 4, "bfloat16": 2}
# The share of a device's memory the plan counts usable (the rest: what XLA and the driver keep, and
# fragmentation). On GPUs `cppo_jax.launch` sets XLA_PYTHON_CLIENT_MEM_FRACTION to it before JAX starts
# (JAX's own default preallocates 0.75), so the plan assumes what the run gets.
USABLE_FRACTION = 0.9
USABLE = USABLE_FRACTION  # the name the compile reports (planning.report, planning.fit) import
MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# A GPU program fits in this share of the HBM: the pool JAX's allocator holds once the launch has set
# XLA_PYTHON_CLIENT_MEM_FRACTION to it (the same fact: `plan --compile-for` judges by it).
GPU_MEM_FRACTION = USABLE_FRACTION


def set_gpu_memory_fraction(environ=None) -> str:
    """Set XLA_PYTHON_CLIENT_MEM_FRACTION to `USABLE_FRACTION` unless it is set (it must be set
    before JAX starts a GPU backend; CPUs and TPUs ignore it). Returns a line for the log when the
    variable was already set to another value (the plan then judges against what JAX holds)."""
    import os

    environ = os.environ if environ is None else environ
    given = environ.setdefault(MEM_FRACTION_VAR, f"{USABLE_FRACTION:g}")
    if given == f"{USABLE_FRACTION:g}":
        return ""
    return (
        f"{MEM_FRACTION_VAR}={given} is set: on a GPU JAX holds that share of its memory, and the "
        f"plan judges against it (unset, the launch sets {USABLE_FRACTION:g})"
    )


def device_memory(device) -> int | None:
    """The bytes of one device that the plan's `USABLE_FRACTION` is taken of (None: unknown, a CPU).

    A GPU's `bytes_limit` is the pool JAX's allocator holds, XLA_PYTHON_CLIENT_MEM_FRACTION of the
    device: the device is counted as bytes_limit / USABLE_FRACTION, so a plan fits exactly when its
    peak fits that pool (the whole device when the fraction is the launch's). A TPU's is its HBM."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return None
    return int(limit / USABLE_FRACTION) if device.platform == "gpu" else int(limit)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class Unsharded:
    """Mesh axis `axis` (of `size` devices) does not divide the `dim`-long `name` dimension of
    `tensors` weight tensors (`bytes` per device of them), so they are whole on each of its devices."""

    axis: str
    size: int
    name: str
    dim: int
    tensors: int
    bytes: int

    def line(self) -> str:
        ok = [d for d in range(2, min(self.dim, 64) + 1) if self.dim % d == 0][:8]
        return (
            f"mesh.{self.axis}={self.size} does not shard the {self.name} dimension ({self.dim} is "
            f"not a multiple of {self.size}): {self.tensors} weight tensors, {_gib(self.bytes)} per "
            f"device, stay whole on each of the {self.size} {self.axis} devices "
            f"(sizes that divide {self.dim}: {', '.join(map(str, ok)) or 'none'})"
        )


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of a training step's dominant buffers on one mesh (see `memory_plan`)."""

    mesh: dict[str, int]
    params: int  # the policy, sharded by the rules
    opt_state: int  # AdamW mu and nu, in the params' dtype and layout
    grads: int  # the gradient (x2 with micro-batches: the accumulator and one micro-batch's)
    gathered: int  # fsdp > 1: one layer's and the vocabulary matrices' weights gathered for use
    reference: int  # the reference model's params (beta > 0), in the compute dtype
    rows: int  # sequences per device in one forward/backward (a micro-batch)
    tokens: int  # T = P + C - 1 positions per sequence in the forward
    activations_remat: int  # full remat: the layers' inputs, one layer rebuilt
    activations_no_remat: int  # any other policy (model.remat): what it keeps of every layer
    remat: bool  # model.remat is full
    logits_chunk: int
    rollout_kv: int  # the embedded sampler's KV cache, Q*G sequences split over (data, fsdp)
    device_bytes: int | None = None
    unsharded: tuple[Unsharded, ...] = ()  # axes that do not divide a dimension they should shard
    snapshot: int = 0  # rollout.overlap: the params that sample the next step, in the compute dtype
    frozen: int = 0  # model.lora: the frozen base, in the compute dtype (params: the adapters)
    merged: int = 0  # model.lora with a server: the merged weights a push makes (compute dtype)
    # The programs' model (`compiled_memory.run_plan`): each compiled program's bytes, and the run
    # peak (the largest with the state alive beside it), for the compiler of `target`.
    programs: tuple[tuple[str, int], ...] = ()
    run_peak: int = 0
    target: str = ""

    @property
    def activations(self) -> int:
        return self.activations_remat if self.remat else self.activations_no_remat

    @property
    def resident(self) -> int:
        return self.params + self.opt_state + self.reference + self.snapshot + self.frozen

    @property
    def train_peak(self) -> int:
        return self.resident + self.grads + self.gathered + self.activations + self.logits_chunk

    @property
    def rollout_peak(self) -> int:
        return self.resident + self.gathered + self.rollout_kv + self.merged

    @property
    def peak(self) -> int:
        """The run peak of the programs' model where the plan has it (every verdict of the launch,
        `plan` and `--pick-mesh` is made on it); the dominant buffers' larger phase for the terms
        alone (`memory_plan` called by itself)."""
        return self.run_peak or max(self.train_peak, self.rollout_peak)

    @property
    def fits(self) -> bool | None:
        """peak <= USABLE_FRACTION of the device (the rest: XLA workspace, fragmentation); None if
        unknown."""
        return None if self.device_bytes is None else self.peak <= USABLE * self.device_bytes


def _shard_bytes(shape, names, axis_sizes, itemsize: int) -> int:
    from cppo_jax.parallel.sharding import logical_spec

    spec = logical_spec(names, shape, axis_sizes)
    n = math.prod(shape)
    for axes in spec:
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            n //= axis_sizes[axis]
    return n * itemsize


@functools.lru_cache(maxsize=8)
def _param_shapes(tcfg) -> tuple[tuple[tuple, tuple[int, ...], tuple[str | None, ...]], ...]:
    """(path, shape, logical axis names) of every parameter of the model `tcfg` describes."""
    from flax import nnx

    from cppo_jax.models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(tcfg, rngs=nnx.Rngs(0)))
    out = []
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        shape = tuple(var.get_value().shape)
        names = tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape))
        out.append((tuple(path), shape, names))
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _adapter_paths(tcfg) -> frozenset[tuple]:
    """The paths of the LoRA adapters (`nnx.LoRAParam`) among `_param_shapes(tcfg)`."""
    from flax import nnx

    from cppo_jax.models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(tcfg, rngs=nnx.Rngs(0)))
    return frozenset(tuple(p) for p, _ in nnx.to_flat_state(nnx.state(abstract, nnx.LoRAParam)))


def _unsharded(shapes, axis_sizes: dict[str, int], itemsize: int) -> tuple[Unsharded, ...]:
    """Where an axis of size > 1 that a dimension's rule names is left out of its PartitionSpec."""
    from cppo_jax.parallel.sharding import RULES, logical_spec

    found: dict[tuple[str, str, int], list[int]] = {}
    for _path, shape, names in shapes:
        spec = tuple(logical_spec(names, shape, axis_sizes))
        spec += (None,) * (len(shape) - len(spec))
        used = {a for axes in spec for a in ((axes,) if isinstance(axes, str) else axes or ())}
        for name, dim, axes in zip(names, shape, spec):
            got = (axes,) if isinstance(axes, str) else axes or ()
            for a in (RULES.get(name) or ()) if name else ():
                if axis_sizes.get(a, 1) > 1 and a not in got and a not in used:
                    entry = found.setdefault((a, name, dim), [0, 0])
                    entry[0] += 1
                    entry[1] += _shard_bytes(shape, names, axis_sizes, itemsize)
    return tuple(
        Unsharded(a, axis_sizes[a], name, dim, n, nbytes)
        for (a, name, dim), (n, nbytes) in sorted(found.items())
    )


def _split(n: int, size: int) -> int:  # n over `size` devices when it divides, else whole
    return n // size if size > 1 and n % size == 0 else n


def memory_plan(
    tcfg,
    mesh: dict[str, int],
    *,
    rows: int,
    prompt_len: int,
    completion_len: int,
    micro_batch: int = 0,
    beta: float = 0.0,
    logp_chunk: int = 64,
    rollout_rows: int = 0,
    device_bytes: int | None = None,
    overlap: bool = False,
    pack: tuple[int, int] = (0, 0),  # trainer.pack: R rows of L tokens (`pack_plan.RowChoice`)
) -> MemoryPlan:
    """Per-device bytes of one training step of `tcfg` (a TransformerConfig) on a (data, fsdp, tensor) mesh.

    With LoRA (`tcfg.lora_rank` > 0, `lora_state.transformer_config`) the trained params, their AdamW
    moments and gradients are the adapters' (param dtype); the base is frozen in the compute dtype; no
    reference copy (the reference is the base with the adapters off); the embedded sampler runs the
    adapters unmerged on the base (`rollout_rows` > 0: no copy), while a push to a server makes the
    merged weights (compute dtype), counted in the rollout peak.
    Params, AdamW moments, gradients, reference params and (`overlap`) the rollout snapshot are exact
    (the last two in the compute dtype, as `transformer.forward_copy` keeps them): every parameter's
    shard under `cppo_jax.parallel.sharding.RULES`; with fsdp > 1 one layer's weights and the vocabulary matrices are
    counted once more, gathered whole along fsdp where they are used. Activations are an estimate for the dense attention of
    models/transformer.py, per layer and token of a forward/backward of `rows` (or `micro_batch`)
    sequences split over (data, fsdp), heads/MLP/vocab split over tensor where they divide:
      saved for the backward: compute-dtype layer input, two normed inputs and the mid-layer residual
        (4D), q/k/v before and after RoPE (2(H+2J)E), the attention output (HE), gate, up and their
        product (3F), and three float32 [H, T] score-sized buffers (scores, masked scores, probs);
      with remat only the layer input (D) per layer, one layer's set rebuilt; plus the backward's
      work on one layer: three more float32 score-sized buffers. The logits chunk: 3 float32 [rows,
    chunk, V] (logits, probs, their gradient). Fitted on XLA:CPU's buffers (tests/test_sharding.py).
    """
    axis = {a: int(mesh.get(a, 1)) for a in MESH_AXES}
    dp, tp = axis["data"] * axis["fsdp"], axis["tensor"]
    pb = _BYTES[tcfg.param_dtype]
    cb = _BYTES[tcfg.dtype]
    adapters = _adapter_paths(tcfg)
    shapes = tuple(s for s in _param_shapes(tcfg) if s[0] not in adapters)  # the base's
    params = sum(_shard_bytes(shape, names, axis, pb) for _, shape, names in shapes)
    forward_copy = sum(_shard_bytes(shape, names, axis, cb) for _, shape, names in shapes)
    trained = params
    if adapters:  # LoRA: the adapters are trained, the base is frozen in the compute dtype
        ad = [s for s in _param_shapes(tcfg) if s[0] in adapters]
        trained = sum(_shard_bytes(shape, names, axis, pb) for _, shape, names in ad)
        pb = cb  # the base's weights, gathered below, are in the compute dtype
    # FSDP gathers a weight whole along fsdp where it is used: one layer and the vocabulary matrices.
    no_fsdp = {**axis, "fsdp": 1}
    gathered = 0
    if axis["fsdp"] > 1:
        gathered = sum(  # the decoder layers' params are stacked [L, ...]: one layer is 1/L
            _shard_bytes(shape, names, no_fsdp, pb) // (shape[0] if path[0] == "layers" else 1)
            for path, shape, names in shapes
            if path[0] in ("layers", "embed_VD", "lm_head_DV")
        )
    T = pack[1] - 1 if pack[0] else prompt_len + completion_len - 1  # packed: R rows of L, not M
    rows = pack_plan.round_rows(pack[0], rows, dp) if pack[0] else rows  # of T = P + C
    m = micro_batch if 0 < micro_batch < rows else rows
    n = _split(m, dp) if m % dp == 0 else m  # sequences per device (replicated if uneven)
    D, F, L, E = tcfg.hidden_size, tcfg.intermediate_size, tcfg.num_layers, tcfg.head_dim
    H, J = _split(tcfg.num_heads, tp), _split(tcfg.num_kv_heads, tp)
    F, V = _split(F, tp), _split(tcfg.vocab_size, tp)
    # one float32 [H, T] row of scores per token (the splash kernel: a log-sum-exp per head)
    scores = 4 * H * (T if tcfg.attention != "splash" else 1)
    # Per token, one layer's activations: all of them (save_all, or one layer recomputed under
    # full remat), or what the policy keeps: the matmul outputs (dots_saveable, fitted on CPU),
    # those without attention's scores (minimal).
    layer = cb * (4 * D + 2 * (H + 2 * J) * E + H * E + 3 * F) + 3 * scores
    kept = cb * (2 * D + (H + 2 * J) * E + H * E + 2 * F) + 2 * scores
    kept = {"save_all": layer, "minimal": kept - 2 * scores}.get(tcfg.remat, kept)
    if adapters:  # LoRA: each adapted projection's x A (rank wide) and s (x A) B (its output's)
        outs = {"q": H * E, "k": J * E, "v": J * E, "o": D, "gate": F, "up": F, "down": D}
        delta = cb * sum(outs[t] + tcfg.lora_rank for t in tcfg.lora_targets)
        layer, kept = layer + delta, kept + delta
    work = 3 * scores  # per token, one layer's backward
    edges = cb * D + 4 * D  # embeddings out and the final norm, per token
    batch = (T + 1) * 5 + completion_len * 4 * 3 + 4  # tokens, valid, mask, old, ref, adv per row
    no_remat = n * T * (L * kept + work + edges) + n * batch
    remat = n * T * (L * cb * D + layer + work + edges) + n * batch
    grads = trained * (2 if m < rows else 1)
    kv_rows = _split(rollout_rows, dp) if rollout_rows % dp == 0 else rollout_rows
    kv = 2 * L * J * E * (prompt_len + completion_len) * kv_rows * cb
    return MemoryPlan(
        mesh=axis,
        params=trained,
        opt_state=2 * trained,
        grads=grads,
        gathered=gathered,
        reference=forward_copy if beta > 0 and not adapters else 0,
        rows=n,
        tokens=T,
        activations_remat=remat,
        activations_no_remat=no_remat,
        remat=tcfg.remat == "full",
        logits_chunk=3 * n * min(logp_chunk, completion_len) * V * 4,
        rollout_kv=kv,
        device_bytes=device_bytes,
        unsharded=_unsharded(shapes, axis, pb),
        snapshot=(trained * cb // _BYTES[tcfg.param_dtype] if adapters else forward_copy)
        if overlap
        else 0,
        frozen=forward_copy if adapters else 0,
        merged=forward_copy if adapters and not rollout_rows else 0,
    )


def memory_lines(plan: MemoryPlan, param_dtype: str) -> list[str]:
    """The report's lines for a `MemoryPlan`, ending with `fits: yes|no|unknown`."""
    mesh = plan.mesh
    use, other = ("with full remat", "dots_saveable") if plan.remat else ("with", "full")
    act_other = plan.activations_no_remat if plan.remat else plan.activations_remat
    lines = [
        f"memory per device (mesh data={mesh['data']} fsdp={mesh['fsdp']} "
        f"tensor={mesh['tensor']}; sharded by cppo_jax.parallel.sharding.RULES):",
        f"  params ({param_dtype}) {_gib(plan.params)}; AdamW moments mu+nu ({param_dtype}; no "
        f"separate master copy: the params are it) {_gib(plan.opt_state)}; gradients "
        f"{_gib(plan.grads)}; reference params {_gib(plan.reference)}; rollout snapshot "
        f"{_gib(plan.snapshot)}; weights gathered over "
        f"fsdp for use {_gib(plan.gathered)}",
        f"  activations of {plan.rows} sequence(s) x {plan.tokens} tokens on this device "
        f"{use} (model.remat): {_gib(plan.activations)} ({other}: {_gib(act_other)}); "
        f"logits chunk {_gib(plan.logits_chunk)}",
        f"  training step peak {_gib(plan.train_peak)}; rollout peak (embedded KV cache "
        f"{_gib(plan.rollout_kv)}) {_gib(plan.rollout_peak)}",
    ]
    lora = f"frozen base (compute dtype) {_gib(plan.frozen)}; merged weights per push {_gib(plan.merged)}"
    lines[3:3] = [f"  LoRA: the params above are the adapters; {lora}"] if plan.frozen else []
    lines += [f"  not sharded: {u.line()}" for u in plan.unsharded]
    if plan.programs:
        compiler = plan.target or "v5p/v4"
        each = ", ".join(f"{name} {_gib(b)}" for name, b in plan.programs)
        lines.append(
            f"  programs as {compiler}'s compiler lays them out: {each}; run peak (the largest "
            f"with the state alive beside it) {_gib(plan.run_peak)}"
        )
    if plan.fits is None:
        lines.append(
            f"fits: unknown (device memory unknown; peak {_gib(plan.peak)} per device; give "
            f"--devices N --device-memory-gb GB to plan for a machine)"
        )
    else:
        verdict = "yes" if plan.fits else "no"
        lines.append(
            f"fits: {verdict} (peak {_gib(plan.peak)} per device of {_gib(plan.device_bytes)} "
            f"= {plan.device_bytes / 1e9:.0f} GB, {USABLE:.0%} usable)"
        )
    return lines


def mesh_overrides(mesh: dict[str, int]) -> str:
    """`mesh.data=D mesh.fsdp=F mesh.tensor=T`: the overrides that select `mesh`."""
    return " ".join(f"mesh.{a}={mesh[a]}" for a in MESH_AXES)


def candidate_meshes(num_devices: int, questions: int) -> list[dict[str, int]]:
    """Every (data, fsdp, tensor) layout of `num_devices` whose data x fsdp divides `questions`."""
    out = []
    for data in range(1, num_devices + 1):
        for fsdp in range(1, num_devices // data + 1):
            if num_devices % (data * fsdp) or questions % (data * fsdp):
                continue
            out.append({"data": data, "fsdp": fsdp, "tensor": num_devices // (data * fsdp)})
    return out


def preference(plan: MemoryPlan) -> tuple:
    """Fitting first; then the most data parallel, the fewest tensor shards, the most `data`."""
    m = plan.mesh
    return (not plan.fits, -(m["data"] * m["fsdp"]), m["tensor"], -m["data"])


def plan_kwargs(cfg: Config, shapes, device_bytes: int | None) -> dict:
    """`memory_plan`'s arguments for one step of `cfg` (everything but the model and the mesh)."""
    embedded = cfg.rollout.backend == "embedded"
    return dict(
        rows=shapes.M,
        prompt_len=shapes.P,
        completion_len=shapes.C,
        micro_batch=cfg.trainer.micro_batch,
        beta=cfg.cppo.beta,
        rollout_rows=shapes.Q * shapes.G if embedded else 0,
        device_bytes=device_bytes,
        overlap=bool(cfg.rollout.overlap),
        pack=pack_plan.config_choice(cfg, shapes).pack if cfg.trainer.pack else (0, 0),
    )
