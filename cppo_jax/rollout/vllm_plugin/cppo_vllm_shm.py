"""A vLLM weight-transfer engine for CPU servers: payloads through shared memory (server side).

This module runs inside the vLLM server (its own environment, with torch and vLLM), never in the trainer.
vLLM 0.32's built-in engines cannot run on a CPU server: `ipc` rebuilds CUDA tensors from CUDA IPC handles
(`torch.cuda.get_device_properties`), `nccl`/`sparse_nccl` need NCCL, and the base class's `update_weights`
calls `torch.accelerator.synchronize()`, which raises "Cannot access accelerator device when none is
available" on a CPU-only host. So this engine is registered with vLLM's `WeightTransferEngineFactory` under
the name `cppo_shm` by a general plugin (the `cppo_vllm_shm-0.1.dist-info` next to this file declares the
entry point; putting this folder on the server's PYTHONPATH is the whole installation), and is selected
with `--weight-transfer-config '{"backend": "cppo_shm"}'`. The HTTP routes, the worker's session checks
(start, update, finish) and the trainer's client are vLLM's protocol unchanged; only the data plane differs.

Wire format (written by `cppo_jax/rollout/vllm/weight_transfer.py`, which imports neither torch nor JAX):

- `init_weight_transfer_engine {"root": DIR}`: the only folder payload files may be read from.
- `update_weights {"file", "names", "dtype_names", "shapes", "offsets", "counts", "index_offsets",
  "crc32", "round", "round_tensors"}`: `file` (relative to root) holds raw little-endian tensor bytes;
  tensor i's values start at byte `offsets[i]` and hold `counts[i]` elements of `dtype_names[i]`. A dense
  update has `index_offsets`, `step_offsets`, `step_counts` and `base_round` null and `counts[i]` = the
  tensor's size. A sparse update patches the round `base_round` (refused unless the engine holds it) in two
  groups per tensor: `counts[i]` values with their int32 flat indices at `index_offsets[i]` (vLLM's
  `SparseWeightPatch` coordinates; -1: tensor i is sent whole), and `step_counts[i]` steps at
  `step_offsets[i]`: that many uint8 gaps, then as many int8 steps; step s adds steps[s] to the unsigned bit
  pattern of flat element cumsum(gaps)[s] - 1. `crc32` covers the whole file; `round_tensors` is how many
  tensors the round (start ... finish) carries in all, over every update call.

What the engine guarantees: nothing is applied before `finish_weight_update`, and a round is applied whole
or not at all (a checksum mismatch, a tensor missing from the round, a sparse patch before any full push, an
unknown name or an index out of range all raise, and the served weights stay as they were).

What a round costs the server: the payload is mapped, not copied, and checked (CRC-32); each tensor's
steps are decoded in one compiled pass (numba, which vLLM depends on) into buffers kept across rounds
(fresh memory would cost its page faults every round) and written into its run of the served parameter
by one `index_add_`, the tensors on one thread per core
(vLLM binds its CPU worker to its compute cores; during a round the engine waits on the worker, so the
round's threads may use the others).

Where the weights are patched: in place, wherever the served model keeps plain weights. On CPU, vLLM
packs each linear layer's weight for oneDNN / the sgl kernels after loading and drops the plain `weight`
(`model_executor/layers/utils.py`: `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`; the
embedding keeps it but the logits use a packed copy), so a patch of the plain tensors would not reach what
the server computes with. This plugin therefore keeps plain weights on a CPU server (`PLAIN_ENV`, on by
default): the dispatch is replaced by `torch.nn.functional.linear` on the plain weight, the path vLLM itself
takes for MLA's `kv_b_proj` (`_cpu_skip_gemm_dispatch`), at the cost of slower GEMMs (measured in
benchmarks/results/weight_sync.md). A GPU server keeps plain weights anyway.

At the first full push of a set of tensors the engine finds where each checkpoint tensor lives (`locate`):
one call of the model's own `load_weights`, fed int32 tensors of flat index + 1, with every parameter's loader
replaced by one that runs the real loader on an int32 stand-in of its parameter filled with -1; what the
loader wrote is where the tensor goes (q/k/v at their offsets in `qkv_proj`, gate/up in `gate_up_proj`, a
tied `lm_head` nowhere). Every round, full or sparse, is then written into the served parameters in place:
a sparse round costs what changed. Where a tensor does not land as one contiguous run of a parameter (a
tensor-parallel rank's share of it), a parameter was packed, or a payload's dtype is not the served one, the
engine
keeps the checkpoint-format copy of the last push instead, patches it and reloads the whole model from it
through vLLM's layerwise reload (the path the `ipc` engine and `reload_weights` use); the server log says
which path each round took (`cppo_shm: round R applied in place` or `... reloaded`, with the engine's
seconds reading and applying it). A tied model's embedding arrives once (the trainer sends no
`lm_head.weight`): in place the head is the embedding's own tensor; a reload loads it as the head too, which
the CPU backend needs to rebuild its packed head (shared/docs/VLLM.md's trap).
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "cppo_shm"
# "0": let a CPU server pack its weights (then every round reloads the model)
PLAIN_ENV = "CPPO_VLLM_PLAIN_WEIGHTS"


def register() -> None:
    """vLLM general-plugin hook: register the engine once per process (plugins may load twice), and on a
    CPU server keep plain weights unless `PLAIN_ENV` is "0"."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ShmWeightTransferEngine)
    if os.environ.get(PLAIN_ENV, "1") != "0":
        keep_plain_weights()


def keep_plain_weights() -> None:
    """On a CPU platform, compute every unquantized linear layer (and the logits) with
    `torch.nn.functional.linear` on its plain `weight` instead of a packed copy, so that a patch written
    into the weight is what the server computes with."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.utils as layer_utils

    if getattr(layer_utils.dispatch_cpu_unquantized_gemm, "keeps_plain_weights", False):
        return

    def plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    plain.keeps_plain_weights = True
    layer_utils.dispatch_cpu_unquantized_gemm = plain


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.cppo_shm")


_MISSING = object()


def locate(
    model: torch.nn.Module, layout: dict[str, tuple[tuple, torch.dtype]]
) -> dict[str, tuple[str, int]]:
    """Where each checkpoint tensor of `layout` (name -> shape, dtype) lives in `model`: (parameter name,
    flat offset of its element 0), its element i at offset + i; found by running the model's own loaders
    on int32 stand-ins (module docstring). One `load_weights` call is fed the tensors one at a time (as a
    checkpoint is), so a tied alias is skipped as in a real load; a tensor passed to no loader (a tied
    `lm_head`) is left out. Raises when a loader fails on a stand-in (a packed parameter has no plain
    weight to write into), is handed something not derived from the tensor fed, or writes it other than
    as one contiguous run. The model's weights are not changed."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    names = {id(p): n for n, p in model.named_parameters()}
    params = {id(p): p for p in model.parameters()}
    places: dict[str, tuple[str, int]] = {}
    current: list = [None, None]  # the name and the int32 tensor last fed

    def record(param, loaded, *args, **kwargs):
        name, fed = current
        if loaded.untyped_storage().data_ptr() != fed.untyped_storage().data_ptr():
            raise ValueError(f"the loader of {names[id(param)]} got a copy of {name}, not a view")
        if param.numel() == 0:
            raise ValueError(f"{names[id(param)]} holds no plain weight (packed for the CPU GEMMs)")
        real, grad = param.data, param.requires_grad
        stand_in = torch.full_like(real, -1, dtype=torch.int32)
        param.requires_grad_(False)  # an int32 stand-in cannot require gradients
        param.data = stand_in
        try:
            saved[id(param)][0](param, loaded, *args, **kwargs)
        finally:
            param.data = real
            param.requires_grad_(grad)
        place = (names[id(param)], _run_of(stand_in.view(-1), fed.numel()))
        if place[1] is None or places.setdefault(name, place) != place:  # a repeated call: the same
            raise ValueError(f"{name} does not land as one contiguous run of one parameter")

    def feed():
        for name, (shape, _) in layout.items():
            n = math.prod(shape)
            current[:] = [name, torch.arange(1, n + 1, dtype=torch.int32).view(shape)]
            yield name, current[1]

    saved = {}
    for key, p in params.items():
        saved[key] = (
            getattr(p, "weight_loader", default_weight_loader),
            p.__dict__.get("weight_loader", _MISSING),
            p.__dict__.get("_weight_loader", _MISSING),
        )
        p.weight_loader = record
    try:
        model.load_weights(feed())
    finally:
        for key, p in params.items():
            _, attr, private = saved[key]
            for field, value in (("weight_loader", attr), ("_weight_loader", private)):
                if value is _MISSING:
                    p.__dict__.pop(field, None)
                else:
                    p.__dict__[field] = value
    return places


def _run_of(flat: torch.Tensor, numel: int) -> int | None:
    """Where a loader wrote the values 1 .. numel (flat index + 1) into an int32 stand-in filled with -1:
    the offset of the first when they lie in order as one run (found without listing the positions), else
    None. Values <= 0 are not the tensor's: the fill, or a loader's own zeros (a vocabulary's padding)."""
    written = flat > 0
    if int(written.sum()) != numel:
        return None
    base = int(torch.argmax(written.to(torch.uint8)))
    run = flat[base : base + numel]
    return base if torch.equal(run, torch.arange(1, numel + 1, dtype=torch.int32)) else None


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    root: str = ""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    file: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    counts: list[int]
    crc32: int
    round: int
    round_tensors: int
    index_offsets: list[int] | None = None
    step_offsets: list[int] | None = None
    step_counts: list[int] | None = None
    base_round: int | None = None

    def __post_init__(self) -> None:
        n = len(self.names)
        for key in ("dtype_names", "shapes", "offsets", "counts"):
            if len(getattr(self, key)) != n:
                raise ValueError(f"`{key}` has {len(getattr(self, key))} entries for {n} names")
        sparse = ("index_offsets", "step_offsets", "step_counts")
        if self.index_offsets is not None:
            for key in sparse:
                if getattr(self, key) is None or len(getattr(self, key)) != n:
                    raise ValueError(f"`{key}` needs one entry per name ({n}) in a sparse update")


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Dense and sparse checkpoint-coordinate updates read from files under one root folder."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.root: str | None = None
        # the last full push's names, shapes and dtypes, and the round the served weights hold
        self.held: dict[str, tuple[tuple, torch.dtype]] = {}
        self.held_round: int | None = None
        # per checkpoint tensor: (parameter, offset), when rounds can be written in place; `located`:
        # the layout `places` was sought for (sought once per layout, found or not)
        self.places: dict[str, tuple[str, int]] | None = None
        self.located: dict[str, tuple[tuple, torch.dtype]] | None = None
        self.shadow: dict[str, torch.Tensor] = {}  # the reload path's checkpoint-format copy
        self._pending: list[
            tuple
        ] = []  # (name, values, indices | None, (step indices, steps) | None)
        self._round: int | None = None
        self._round_tensors = 0
        self._receive_s = 0.0
        # per signed dtype: (buffer, elements taken this round) for the decoded step positions and steps
        self._scratch: dict[torch.dtype, tuple[torch.Tensor, int]] = {}

    def _take(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        """n elements of `dtype` from a buffer kept across rounds: fresh memory for a round's 21M steps
        costs its page faults again every round (0.07-0.09 s against 0.02-0.04 s reused, measured on 2
        cores). A round needing more than the buffer holds moves to a larger one."""
        buf, used = self._scratch.get(dtype, (None, 0))
        if buf is None or used + n > buf.numel():
            buf, used = torch.empty(max(n, 2 * (0 if buf is None else buf.numel())), dtype=dtype), 0
        self._scratch[dtype] = (buf, used + n)
        return buf[used : used + n]

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        root = os.path.realpath(init_info.root)
        if not init_info.root or not os.path.isdir(root):
            raise ValueError(f"cppo_shm: root {init_info.root!r} is not a folder on the server")
        self.root = root
        _positions()  # compiled now, not inside the first sparse round's pause

    def start_weight_update(self) -> None:
        self._pending, self._round, self._round_tensors = [], None, 0
        self._receive_s = 0.0
        self._scratch = {dtype: (buf, 0) for dtype, (buf, _) in self._scratch.items()}

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, u: ShmUpdateInfo) -> None:
        t0 = time.perf_counter()
        try:
            self._receive(u)
        finally:
            self._receive_s += time.perf_counter() - t0

    def _receive(self, u: ShmUpdateInfo) -> None:
        if self.root is None:
            raise RuntimeError("cppo_shm: init_weight_transfer_engine was not called")
        if self._round is None:
            self._round, self._round_tensors = u.round, u.round_tensors
        elif (u.round, u.round_tensors) != (self._round, self._round_tensors):
            raise ValueError(f"cppo_shm: update of round {u.round} inside round {self._round}")
        if u.index_offsets is not None and u.base_round != self.held_round:
            raise ValueError(
                f"cppo_shm: sparse patch of round {u.base_round}, the server holds round "
                f"{self.held_round}: nothing applied (a full push is needed)"
            )
        path = os.path.realpath(os.path.join(self.root, u.file))
        if os.path.dirname(path) != self.root:
            raise ValueError(f"cppo_shm: payload {u.file!r} is not a file directly under the root")
        # Mapped, not copied: the trainer never writes into a payload once it is renamed into place (a
        # round goes to a new file, `weight_transfer.ProtocolPusher._write`), so the mapping holds what
        # the checksum covered. Copy-on-write: a patch of the reload path's copy stays private.
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            # faulted in as read (MAP_POPULATE measured slower: the faults then precede all the work)
            data = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) if size else bytearray()
        crc = _pool().submit(zlib.crc32, data)  # beside the decoding below (zlib releases the GIL)
        buf = (
            torch.frombuffer(data, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        )
        dense = []
        patches = []
        for i, name in enumerate(u.names):
            sparse = u.index_offsets is not None and u.index_offsets[i] >= 0
            dtype = getattr(torch, u.dtype_names[i])
            shape, count = tuple(u.shapes[i]), int(u.counts[i])
            numel = math.prod(shape)
            size = torch.empty((), dtype=dtype).element_size()
            values = _view(buf, u.offsets[i], count * size, dtype, name)
            if not sparse:
                if count != numel:
                    raise ValueError(f"cppo_shm: dense {name} has {count} values for shape {shape}")
                dense.append((name, values.view(shape), None, None))  # views: no copy
                continue
            old = self.held.get(name)
            if old is None:
                raise ValueError(f"cppo_shm: sparse patch of {name} before any full push of it")
            if old != (shape, dtype):
                raise ValueError(
                    f"cppo_shm: sparse patch of {name} is {u.dtype_names[i]}{list(shape)}, "
                    f"the last full push was {old[1]}{list(old[0])}"
                )
            idx = _view(buf, u.index_offsets[i], count * 4, torch.int32, name)
            n = int(u.step_counts[i])
            raw = _view(buf, u.step_offsets[i], 2 * n, torch.uint8, name) if n else buf[:0]
            signed = _SIGNED.get(size)
            if n and signed is None:
                raise ValueError(f"cppo_shm: steps of {name} ({u.dtype_names[i]}): only 16/32-bit")
            out = (self._take(torch.int32, n), self._take(signed, n)) if n else None
            patches.append((name, numel, values, idx, raw, n, out))
        # the step positions of every tensor, on several threads (torch releases the GIL); all checked,
        # the checksum first, before any is pending
        try:
            decoded = list(_pool().map(_decode, patches))
        finally:
            if crc.result() != u.crc32:
                raise ValueError(
                    f"cppo_shm: payload {u.file} has crc32 {crc.result()}, the trainer wrote "
                    f"{u.crc32}: corrupted or overwritten in transit; nothing applied"
                )
        self._pending += dense + decoded

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        want, round_, self._round = self._round_tensors, self._round, None
        if not pending:
            return
        names = {entry[0] for entry in pending}
        if len(names) != want or len(pending) != want:
            raise ValueError(
                f"cppo_shm: the round declared {want} tensors, {len(names)} arrived "
                f"({len(pending)} updates): partial push refused, nothing applied"
            )
        dense = all(entry[2] is None for entry in pending)
        if dense:
            missing = sorted(set(self.held) - names)
            if self.held and missing:
                raise ValueError(f"cppo_shm: full push lacks {missing[:3]}: nothing applied")
            layout = {name: (tuple(values.shape), values.dtype) for name, values, _, _ in pending}
            if layout != self.located:
                self.places, self.located = self._locate(layout), layout
            self.held = layout
        params = dict(self.model.named_parameters())
        if self.places is not None and all(
            name not in self.places or params[self.places[name][0]].dtype == values.dtype
            for name, values, _, _ in pending
        ):
            elements = self._write_in_place(pending, params)
            self.shadow = {}
            how = f"applied in place ({elements} elements written)"
        else:
            if not dense and not self.shadow:
                raise ValueError(
                    "cppo_shm: sparse patch of a payload dtype other than the served one, and no "
                    "checkpoint-format copy to patch: nothing applied (a full push is needed)"
                )
            if dense:
                new = {name: values for name, values, _, _ in pending}
            else:  # validated on receipt (names, shapes, dtypes, index range): patch the copy
                new = self.shadow
                for name, values, idx, steps in pending:
                    if idx is None:
                        new[name] = values
                        continue
                    new[name].view(-1)[idx] = values
                    if steps is not None:
                        _step(new[name].view(-1), *steps)
            self._reload(new)
            self.shadow = new
            how = "reloaded (the whole model, in memory)"
        self.held_round = round_
        _logger().info(
            "cppo_shm: round %s %s; read and checked in %.3f s, applied in %.3f s",
            round_,
            how,
            self._receive_s,
            time.perf_counter() - t0,
        )

    def _locate(self, layout: dict[str, tuple[tuple, torch.dtype]]) -> dict | None:
        t0 = time.perf_counter()
        try:
            places = locate(self.model, layout)
            _logger().info(
                "cppo_shm: %d of %d tensors located in the served parameters in %.2f s",
                len(places),
                len(layout),
                time.perf_counter() - t0,
            )
            return places
        except Exception as err:  # a packed or otherwise unlocatable parameter: the reload path
            _logger().info(
                "cppo_shm: rounds reload the model (weights not patchable in place: %s)", err
            )
            return None

    def _write_in_place(self, pending: list[tuple], params: dict[str, torch.Tensor]) -> int:
        """Write a validated round into the served parameters, tensors on several threads (each writes
        its own run of a parameter); returns the elements written."""

        def write(entry) -> int:
            name, values, idx, steps = entry
            place = self.places.get(name)
            if place is None:  # a tensor the model does not hold (a tied lm_head)
                return 0
            param, base = place
            numel = values.numel() if idx is None else math.prod(self.held[name][0])
            run = params[param].data.view(-1).narrow(0, base, numel)
            if idx is None:
                run.copy_(values.reshape(-1))
                return values.numel()
            run[idx] = values
            if steps is None:
                return idx.numel()
            _step(run, *steps)
            return idx.numel() + steps[0].numel()

        with torch.no_grad():
            return sum(_pool().map(write, pending))

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        items = list(tensors.items())
        served = dict(self.model.named_parameters(remove_duplicate=False))
        tied = served.get("lm_head.weight") is served.get("model.embed_tokens.weight") is not None
        if tied and "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors:
            # the trainer sends a tied embedding once; the CPU backend's head (a packed copy) is only
            # rebuilt when `lm_head.weight` is loaded too (shared/docs/VLLM.md's trap)
            items.append(("lm_head.weight", tensors["model.embed_tokens.weight"]))
        initialize_layerwise_reload(self.model)
        self.model.load_weights(items)
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self._pending = []


_SIGNED = {2: torch.int16, 4: torch.int32}


def _every_core() -> None:
    """Let the calling thread run on every core of the machine. vLLM binds its CPU worker's threads to
    the cores it computes on (on 2 cores: core 0, the other kept for the engine and the API server), and
    a thread inherits that; during a round the engine waits on the worker, so the round's threads may use
    the other cores too."""
    # not Linux, or cores the process may not use: the binding stays
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Threads for a round's tensors, decoding and writing them (torch releases the GIL), one per core
    (at most 8)."""
    return ThreadPoolExecutor(min(8, os.cpu_count() or 1), "cppo-shm", initializer=_every_core)


def _decode(patch: tuple) -> tuple:
    """One tensor's sparse patch (name, elements, values, int32 indices, step bytes, steps, buffers for
    the positions and the steps in the tensor's signed dtype) checked and decoded to a pending entry
    (name, values, indices, (positions, steps)); raises on an index out of range or a gap of 0."""
    name, numel, values, idx, raw, n, out = patch
    outside = f"cppo_shm: sparse patch of {name} indexes outside {numel} elements"
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
        raise ValueError(outside)
    if not n:
        return name, values, idx, None
    # int32 positions (a tensor has < 2^31 elements); gaps >= 1 make them strictly ascending from 0
    at, steps = out
    last, zero = _positions()(raw.numpy(), n, at.numpy(), steps.numpy())
    if zero:
        raise ValueError(f"cppo_shm: sparse patch of {name} has a gap of 0 (a repeated element)")
    if last >= numel:
        raise ValueError(outside)
    return name, values, idx, (at, steps)


@functools.cache
def _positions():
    """The loop `_decode` runs, compiled once per server process (numba, a dependency of vLLM itself;
    `ShmWeightTransferEngine.init_transfer_engine` asks for it before any round): in one pass over the
    payload the steps' positions (the running sum of their gaps, less 1) and the steps sign-extended,
    with the last position and whether any gap was 0. Measured on 2 cores, ~500M model's 20M steps in
    290 tensors: 0.015-0.017 s, against 0.028-0.041 s for the same in five torch operations."""
    import numba
    import numpy as np

    # compiled for these types when defined: the 16- and 32-bit steps (`_SIGNED`)
    types = [f"(uint8[::1], int64, int32[::1], {t}[::1])" for t in ("int16", "int32")]

    @numba.njit(types, nogil=True, boundscheck=False)
    def positions(raw_B, n, at_S, steps_S):
        pos = -1
        zero = False
        for s in range(n):
            gap = raw_B[s]
            zero |= gap == 0
            pos += gap
            at_S[s] = pos
            steps_S[s] = np.int8(raw_B[n + s])
        return pos, zero

    return positions


def _step(flat: torch.Tensor, at: torch.Tensor, steps: torch.Tensor) -> None:
    """Add `steps` (-127 .. 127, in `flat`'s signed width) to the bit patterns of the 1-D tensor `flat`'s
    elements `at` (distinct), in place, modulo 2^bits: one `index_add_` on the same-width signed view,
    whose addition wraps."""
    flat.view(_SIGNED[flat.element_size()]).index_add_(0, at, steps)


def _view(
    buf: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, name: str
) -> torch.Tensor:
    if offset < 0 or offset + nbytes > buf.numel():
        raise ValueError(f"cppo_shm: {name} lies outside the payload ({offset} + {nbytes} bytes)")
    return buf[offset : offset + nbytes].view(dtype)
