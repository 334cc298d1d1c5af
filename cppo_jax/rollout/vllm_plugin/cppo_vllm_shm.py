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

Why a shadow copy: on CPU, vLLM packs each linear layer's weight for oneDNN / the sgl kernels after loading
and drops the plain `weight` (`model_executor/layers/linear.py`: `dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)`), so vLLM's in-place sparse loader (`load_checkpoint_weight_patches`, used by
`sparse_nccl`) has no tensor to patch there. The engine therefore keeps the checkpoint-format weights of the
last push, patches that copy, and reloads the model from it through vLLM's layerwise reload (the path the
`ipc` engine and `reload_weights` use). The wire carries only the changed elements; the reload is in memory.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "cppo_shm"


def register() -> None:
    """vLLM general-plugin hook: register the engine once per process (plugins may load twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, ShmWeightTransferEngine)


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
        self.shadow: dict[str, torch.Tensor] = {}
        self.shadow_round: int | None = None  # the round whose weights `shadow` holds
        self._pending: list[
            tuple
        ] = []  # (name, values, indices | None, (step indices, steps) | None)
        self._round: int | None = None
        self._round_tensors = 0

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        root = os.path.realpath(init_info.root)
        if not init_info.root or not os.path.isdir(root):
            raise ValueError(f"cppo_shm: root {init_info.root!r} is not a folder on the server")
        self.root = root

    def start_weight_update(self) -> None:
        self._pending, self._round, self._round_tensors = [], None, 0

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, u: ShmUpdateInfo) -> None:
        if self.root is None:
            raise RuntimeError("cppo_shm: init_weight_transfer_engine was not called")
        if self._round is None:
            self._round, self._round_tensors = u.round, u.round_tensors
        elif (u.round, u.round_tensors) != (self._round, self._round_tensors):
            raise ValueError(f"cppo_shm: update of round {u.round} inside round {self._round}")
        if u.index_offsets is not None and u.base_round != self.shadow_round:
            raise ValueError(
                f"cppo_shm: sparse patch of round {u.base_round}, the server holds round "
                f"{self.shadow_round}: nothing applied (a full push is needed)"
            )
        path = os.path.realpath(os.path.join(self.root, u.file))
        if os.path.dirname(path) != self.root:
            raise ValueError(f"cppo_shm: payload {u.file!r} is not a file directly under the root")
        with open(path, "rb") as fh:  # a private copy: the trainer may rewrite the file next round
            data = bytearray(fh.read())
        crc = zlib.crc32(data)
        if crc != u.crc32:
            raise ValueError(
                f"cppo_shm: payload {u.file} has crc32 {crc}, the trainer wrote {u.crc32}: "
                f"corrupted or overwritten in transit; nothing applied"
            )
        buf = (
            torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        )
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
                self._pending.append((name, values.view(shape), None, None))  # views: no copy
                continue
            old = self.shadow.get(name)
            if old is None:
                raise ValueError(f"cppo_shm: sparse patch of {name} before any full push of it")
            if tuple(old.shape) != shape or old.dtype != dtype:
                raise ValueError(
                    f"cppo_shm: sparse patch of {name} is {u.dtype_names[i]}{list(shape)}, "
                    f"the last full push was {old.dtype}{list(old.shape)}"
                )
            idx = _view(buf, u.index_offsets[i], count * 4, torch.int32, name).to(torch.long)
            n = int(u.step_counts[i])
            raw = _view(buf, u.step_offsets[i], 2 * n, torch.uint8, name) if n else buf[:0]
            at = torch.cumsum(raw[:n].to(torch.long), 0) - 1
            for where in (idx, at):
                if where.numel() and (int(where.min()) < 0 or int(where.max()) >= numel):
                    raise ValueError(
                        f"cppo_shm: sparse patch of {name} indexes outside {numel} elements"
                    )
            steps = (at, raw[n:].view(torch.int8).to(torch.long))
            self._pending.append((name, values, idx, steps))

    def finish_weight_update(self) -> None:
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
            missing = sorted(set(self.shadow) - names)
            if self.shadow and missing:
                raise ValueError(f"cppo_shm: full push lacks {missing[:3]}: nothing applied")
            new = {name: values for name, values, _, _ in pending}
        else:  # validated on receipt (names, shapes, dtypes, index range): patch the copy in place
            new = self.shadow
            for name, values, idx, steps in pending:
                if idx is None:
                    new[name] = values
                    continue
                new[name].view(-1)[idx] = values
                _step(new[name], *steps)
        self._reload(new)
        self.shadow, self.shadow_round = new, round_

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        self.model.load_weights(list(tensors.items()))
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self._pending = []


_SIGNED = {2: torch.int16, 4: torch.int32}


def _step(tensor: torch.Tensor, at: torch.Tensor, steps: torch.Tensor) -> None:
    """Add `steps` to the unsigned bit patterns of `tensor`'s flat elements `at`, in place."""
    bits = 8 * tensor.element_size()
    flat = tensor.view(-1).view(_SIGNED[tensor.element_size()])
    u = (flat[at].to(torch.long) & ((1 << bits) - 1)) + steps
    flat[at] = torch.where(u >= 1 << (bits - 1), u - (1 << bits), u).to(flat.dtype)


def _view(
    buf: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, name: str
) -> torch.Tensor:
    if offset < 0 or offset + nbytes > buf.numel():
        raise ValueError(f"cppo_shm: {name} lies outside the payload ({offset} + {nbytes} bytes)")
    return buf[offset : offset + nbytes].view(dtype)
