"""vLLM's weight-transfer protocol, trainer side: full and sparse pushes through shared memory.

Host code: numpy and the standard library, no JAX and no torch. The server side is vLLM's own protocol
(dev routes `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, on with `VLLM_SERVER_DEV_MODE=1`) with the `cppo_shm` engine of
`cppo_jax/rollout/vllm_plugin/cppo_vllm_shm.py` registered through vLLM's engine factory; the wire format is
described there. One push is one round: start, one update call naming every tensor, finish.

- Full push: every tensor's bytes, in the serving dtype.
- Sparse push: for each tensor, the flat indices (int32) and new values of the elements whose serving-dtype
  bit pattern changed since the last confirmed push (vLLM's `SparseWeightPatch` coordinates); a tensor with
  nothing changed is sent with 0 elements (so a dropped tensor is still detected), one where a patch would
  be larger than the tensor is sent whole.

`ProtocolPusher.push` returns per-push figures: `bytes` (payload), `changed_frac` (changed elements / all
elements; 1 for a full push), `write_s` (trainer side: diff and write), `pause_s` (the server's share:
start + update + finish + prefix-cache reset, during which its engine cannot generate).
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from cppo_jax.rollout.vllm_http import JSONClient, RolloutServerError

__all__ = ["SHM_BACKEND", "ProtocolPusher", "changed_indices", "server_backend"]

SHM_BACKEND = "cppo_shm"
_ALIGN = 64
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def server_backend(client: JSONClient) -> str | None:
    """The weight-transfer backend the server was started with (`--weight-transfer-config`), from the
    dev route `GET /server_info`; None when it has none or no such route."""
    try:
        out = client.request(
            "GET", "/server_info?config_format=json", what="reading the weight-transfer backend"
        )
    except RolloutServerError as e:
        if e.status == 404:
            return None
        raise
    try:
        cfg = out["vllm_config"].get("weight_transfer_config")
    except (TypeError, KeyError, AttributeError):
        return None
    return str(cfg.get("backend")) if isinstance(cfg, dict) and cfg.get("backend") else None


def changed_indices(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Flat int32 indices where `new`'s bit pattern differs from `old`'s (same shape and dtype)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"cannot diff {old.dtype}{old.shape} against {new.dtype}{new.shape}")
    if new.size >= 2**31:
        raise ValueError(f"a tensor of {new.size} elements exceeds int32 sparse indices")
    u = _UINT[new.dtype.itemsize]
    a, b = np.ascontiguousarray(old).view(u).ravel(), np.ascontiguousarray(new).view(u).ravel()
    return np.flatnonzero(a != b).astype(np.int32)


class ProtocolPusher:
    """Pushes HF-named tensors to a vLLM server through its weight-transfer protocol.

    `root`: the folder both sides read (the server must see it at the same path; `/dev/shm/...` keeps it
    in memory). `full_push_every`: after this many pushes since the last full one the next is full again
    (1: every push is full). `invalidate()` forces the next push to be full (after a refused check).
    """

    def __init__(self, client: JSONClient, root: str | Path, *, full_push_every: int = 1):
        if full_push_every < 1:
            raise ValueError(f"rollout.full_push_every = {full_push_every} must be >= 1")
        self.client = client
        self.root = Path(root).resolve()
        self.full_push_every = int(full_push_every)
        self.rounds = 0
        self._since_full: int | None = None  # None: no confirmed full push yet
        self._last: dict[str, np.ndarray] | None = None
        self._pending: tuple[dict[str, np.ndarray], bool] | None = None  # pushed, not yet confirmed
        self._ready = False

    def _post(self, path: str, payload: Any, what: str) -> Any:
        # Never retried: a repeated update or finish would not be idempotent.
        return self.client.request("POST", path, payload, what=what, retries=0)

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._post(
            "/init_weight_transfer_engine",
            {"init_info": {"root": str(self.root)}},
            "initialising the weight-transfer engine",
        )
        self._ready = True

    def invalidate(self) -> None:
        self._since_full, self._last = None, None

    def next_is_full(self) -> bool:
        return self._since_full is None or self._since_full + 1 >= self.full_push_every

    def push(self, tensors: dict[str, np.ndarray], *, skip_finish: bool = False) -> dict:
        """One round (start, update, finish, prefix-cache reset); the new state counts as the base of
        the next sparse push only once `confirm()` is called (after the probe check passed).
        `skip_finish` is for fault tests only."""
        if not self._ready:
            self.init()
        full = self.next_is_full()
        t0 = time.perf_counter()
        self.rounds += 1
        name = f"round{self.rounds % 2}.bin"
        info, nbytes, changed, total = self._write(name, tensors, None if full else self._last)
        t1 = time.perf_counter()
        self._start()
        self._post("/update_weights", {"update_info": info}, f"sending weight round {self.rounds}")
        if not skip_finish:
            self._post(
                "/finish_weight_update",
                {"weight_version": str(self.rounds)},
                f"finishing weight round {self.rounds}",
            )
        self.client.request("POST", "/reset_prefix_cache", None, what="resetting the prefix cache")
        t2 = time.perf_counter()
        self._pending = (tensors, full)
        return {
            "bytes": float(nbytes),
            "changed_frac": changed / max(total, 1),
            "full": float(full),
            "write_s": t1 - t0,
            "pause_s": t2 - t1,
        }

    def confirm(self) -> None:
        """The last push was checked: it becomes the base of the next sparse push."""
        if self._pending is None:
            raise RuntimeError("confirm() without a push to confirm")
        (tensors, full), self._pending = self._pending, None
        self._last = dict(tensors)  # fresh host arrays per push: kept, not copied
        self._since_full = 0 if full else self._since_full + 1

    def _start(self) -> None:
        what = f"starting weight round {self.rounds}"
        try:
            self._post("/start_weight_update", None, what)
        except RolloutServerError as e:
            if "already active" not in str(e):
                raise
            # A round left open (a finish that never came or failed): close it, then start afresh.
            # The dangling round is overwritten by this one, which is full after any failure.
            with contextlib.suppress(RolloutServerError):
                self._post("/finish_weight_update", {}, "closing a dangling weight round")
            self._post("/start_weight_update", None, what)

    def _write(self, name: str, tensors: dict[str, np.ndarray], base: dict | None):
        """Write one payload file (to a temporary name, then renamed); returns (update_info, bytes,
        changed elements, all elements)."""
        parts: list[np.ndarray] = []
        offsets, counts, index_offsets = [], [], []
        pos = changed = total = 0

        def place(arr: np.ndarray) -> int:
            nonlocal pos
            start = -(-pos // _ALIGN) * _ALIGN
            if start > pos:
                parts.append(np.zeros(start - pos, np.uint8))
            raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            parts.append(raw)
            pos = start + raw.size
            return start

        names, dtypes, shapes = list(tensors), [], []
        for key in names:
            arr = np.asarray(tensors[key])
            dtypes.append(arr.dtype.name)
            shapes.append(list(arr.shape))
            total += arr.size
            if base is None:
                offsets.append(place(arr))
                counts.append(arr.size)
                index_offsets.append(-1)
                changed += arr.size
                continue
            if key not in base:
                raise ValueError(f"tensor {key} was not in the last push: a full push is needed")
            idx = changed_indices(base[key], arr)
            changed += idx.size
            if idx.size * (4 + arr.dtype.itemsize) >= arr.nbytes:  # a patch no smaller: whole
                offsets.append(place(arr))
                counts.append(arr.size)
                index_offsets.append(-1)
                continue
            offsets.append(place(arr.reshape(-1)[idx]))
            counts.append(int(idx.size))
            index_offsets.append(place(idx))
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.tmp"
        crc = 0
        with open(tmp, "wb") as fh:
            for p in parts:
                fh.write(memoryview(p))
                crc = zlib.crc32(memoryview(p), crc)
        os.replace(tmp, self.root / name)
        info = {
            "file": name,
            "names": names,
            "dtype_names": dtypes,
            "shapes": shapes,
            "offsets": offsets,
            "counts": counts,
            "index_offsets": None if base is None else index_offsets,
            "crc32": crc,
            "round": self.rounds,
            "round_tensors": len(names),
        }
        return info, pos, changed, total
