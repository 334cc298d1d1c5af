"""vLLM's weight-transfer protocol, trainer side: full and sparse pushes through shared memory.

Host code: numpy and the standard library, no JAX and no torch. The server side is vLLM's own protocol
(dev routes `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, on with `VLLM_SERVER_DEV_MODE=1`) with the `cppo_shm` engine of
`cppo_jax/rollout/vllm_plugin/cppo_vllm_shm.py` registered through vLLM's engine factory; the wire format is
described there. One push is one round: start, one update call naming every tensor, finish.

- Full push: every tensor's bytes, in the serving dtype.
- Sparse push: for each tensor, the elements whose serving-dtype bit pattern changed since the last
  confirmed push, in two groups. Most move by a few units of their bit pattern (an RL update is a few ulps
  at most: `ulp_steps`, the difference taken modulo 2^bits as the server adds it); those go as steps: per element one uint8 gap from the previous stepped index and
  one int8 step of the bit pattern, 2 bytes where an index and a value take 4 + 2. The rest (a weight that
  crosses zero, or moves more than 127 ulps) go as flat int32 indices and new values (vLLM's
  `SparseWeightPatch` coordinates). A tensor with nothing changed is sent with 0 elements (so a dropped
  tensor is still detected), one with over a quarter of its elements changed, or where a patch would be
  no smaller than the tensor, is sent whole. A sparse
  push names the round it was diffed against (`base_round`); the server refuses it unless it holds that
  round.

The diff runs on the host, tensors on several threads (largest first), 8 bytes at a time where most are
equal; a linear weight arrives as the transposed view of the trainer's parameter (no copy in HF order,
`hf_io.state_to_hf_tensors(contiguous=False)`), is compared in its memory order and its changes are put in
HF order by one sort (`changed_steps`); only a tensor sent whole is copied. `push_cast` takes the float32
weights themselves and casts them to bf16 in the diff's pass (`encode_cast`, `cast_patch.py`): the base is
then the last push's bits kept here, overwritten as they are diffed, and the payload is byte for byte the
one of the cast tensors' `push`.

`ProtocolPusher.push` returns per-push figures: `bytes` (payload), `changed_frac` (changed elements / all
elements; 1 for a full push), `write_s` (trainer side: diff and write), `pause_s` (the server's share:
start + update + finish + prefix-cache reset, during which its engine cannot generate).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from cppo_jax.rollout.vllm.client import reset_prefix_cache
from cppo_jax.rollout.vllm.transport import JSONClient, RolloutServerError

__all__ = [
    "SHM_BACKEND",
    "ProtocolPusher",
    "changed_indices",
    "encode",
    "encode_cast",
    "gap_steps",
    "server_backend",
    "ulp_steps",
]

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


_SLICE = 1 << 18  # elements compared at once: the comparison's mask stays in the cache


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Threads for the tensors of a push (numpy releases the GIL while comparing and sorting)."""
    return ThreadPoolExecutor(min(8, os.cpu_count() or 1), "cppo-diff")


def _layout(arr: np.ndarray) -> tuple[np.ndarray, tuple[int, int] | None]:
    """`arr`'s elements as unsigned bit patterns in memory order, and its (rows, cols) when `arr` is the
    transpose of a C-contiguous array (a linear layer's weight seen in HF layout without a copy: its memory
    order is [cols, rows]), else None (C order; any other layout is copied to it)."""
    arr = np.asarray(arr)
    u = _UINT[arr.dtype.itemsize]
    if arr.ndim == 2 and not arr.flags.c_contiguous and arr.T.flags.c_contiguous:
        return arr.T.reshape(-1).view(u), arr.shape
    return np.ascontiguousarray(arr).reshape(-1).view(u), None


def _memory_changes(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ascending positions (int64) where the flat unsigned `b` differs from `a`, and the differences
    modulo 2^bits read signed. Compared a cache-sized slice at a time, 8 bytes at a time (a few percent
    of the elements change, so most words are equal; the changed words' elements are then compared one
    by one)."""
    signed = np.dtype(f"i{a.itemsize}")
    k = 8 // a.itemsize  # elements per word
    n = a.size - a.size % k
    words_a, words_b = a[:n].view(np.uint64), b[:n].view(np.uint64)
    found_i, found_d = [], []

    def add(i: np.ndarray, d: np.ndarray) -> None:
        if i.size:
            found_i.append(i)
            found_d.append(d.view(signed))

    step, shift = _SLICE // k, k.bit_length() - 1  # k = 2^shift
    for start in range(0, words_a.size, step):
        w = np.flatnonzero(words_a[start : start + step] != words_b[start : start + step])
        w += start
        d = words_b[w].view(a.dtype)
        d -= words_a[w].view(a.dtype)  # unsigned subtraction wraps: the difference modulo 2^bits
        lane = np.flatnonzero(d)
        at = w[lane >> shift]
        at <<= shift
        at += lane & (k - 1)
        add(at, d[lane])
    i = np.flatnonzero(a[n:] != b[n:])  # the elements after the last whole word
    add(i + n, b[n:][i] - a[n:][i])
    if not found_i:
        return np.zeros(0, np.int64), np.zeros(0, signed)
    return np.concatenate(found_i), np.concatenate(found_d)


def _hf_index(j: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """C-order flat indices of memory positions `j` of a [rows, cols] tensor stored transposed."""
    c, r = np.divmod(j, shape[0])
    return r * shape[1] + c


def _memory_index(idx: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Memory positions of C-order flat indices `idx` of a [rows, cols] tensor stored transposed
    (the inverse of `_hf_index`)."""
    r, c = np.divmod(idx.astype(np.int64), shape[1])
    return c * shape[0] + r


def _hf_order(
    j: np.ndarray, d: np.ndarray, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Changes found at memory positions `j` of a [rows, cols] tensor stored transposed, as ascending
    HF (C order) flat indices with their differences: one sort of keys index << bits | difference."""
    hf = _hf_index(j, shape)
    bits = 8 * d.dtype.itemsize
    if bits > 32:  # no room for the difference beside the index: sort the pair
        order = np.argsort(hf, kind="stable")
        return hf[order], d[order]
    u = _UINT[d.dtype.itemsize]
    key = hf.astype(np.uint64) << np.uint64(bits)
    key |= d.view(u).astype(np.uint64)
    key.sort()
    low = (key & np.uint64((1 << bits) - 1)).astype(u).view(d.dtype)
    return (key >> np.uint64(bits)).astype(np.int64), low


def _layouts(
    old: np.ndarray, new: np.ndarray
) -> tuple[np.ndarray, np.ndarray, tuple[int, int] | None]:
    """`old` and `new` (same shape and dtype) as unsigned bit patterns in one memory order, with the
    (rows, cols) of a transposed view (`_layout`); where only one of them is transposed, both in C order."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"cannot diff {old.dtype}{old.shape} against {new.dtype}{new.shape}")
    if new.size >= 2**31:
        raise ValueError(f"a tensor of {new.size} elements exceeds int32 sparse indices")
    (a, shape_a), (b, shape) = _layout(old), _layout(new)
    if shape_a != shape:
        (a, _), (b, shape) = _layout(np.ascontiguousarray(old)), _layout(np.ascontiguousarray(new))
    return a, b, shape


def changed_steps(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The changed elements of `old` -> `new` (same shape and dtype): their ascending flat indices
    (int64, C order of the shape) and the difference of their bit patterns modulo 2^bits, read signed
    (the server adds it modulo 2^bits). Compared in memory order: a 2-D transposed view (a linear weight
    in HF layout, `hf_io.state_to_hf_tensors(contiguous=False)`) is compared without a copy, and its
    changes are put in C order by one sort."""
    a, b, shape = _layouts(old, new)
    j, d = _memory_changes(a, b)
    return (j, d) if shape is None else _hf_order(j, d, shape)


def _values_at(arr: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """`arr`'s elements at C-order flat indices `idx`, without copying a transposed view whole."""
    bits, shape = _layout(arr)
    return bits[idx if shape is None else _memory_index(idx, shape)].view(arr.dtype)


def changed_indices(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Flat int32 indices where `new`'s bit pattern differs from `old`'s (same shape and dtype)."""
    return changed_steps(old, new)[0].astype(np.int32)


def ulp_steps(old: np.ndarray, new: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, ...]:
    """Encode the changed elements `idx` (ascending) of `old` -> `new` (same shape and dtype) as steps.

    Returns (gaps_S uint8, steps_S int8, rest_idx int32): entry s patches flat index
    cumsum(gaps)[s] - 1 by adding steps[s] to its unsigned bit pattern, modulo 2^bits (as the server
    adds it). Elements whose pattern moves by more than 127 either way are left in `rest_idx` (sent as
    index and value). A gap over 255 is bridged by entries of gap 255 and step 0 (no-ops), so every gap
    fits a byte."""
    a = np.ascontiguousarray(old).reshape(-1).view(_UINT[old.dtype.itemsize])
    b = np.ascontiguousarray(new).reshape(-1).view(_UINT[new.dtype.itemsize])
    d = b[idx]
    d -= a[idx]
    return split_steps(idx, d.view(np.dtype(f"i{a.itemsize}")))


def split_steps(idx: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, ...]:
    """`ulp_steps` of changed elements `idx` whose bit patterns moved by `d` (signed, modulo 2^bits)."""
    if d.dtype.itemsize not in (2, 4):  # the server steps 16- and 32-bit patterns only
        return np.zeros(0, np.uint8), np.zeros(0, np.int8), idx.astype(np.int32)
    small = (d + 127).view(_UINT[d.dtype.itemsize]) <= 254  # -127 <= d <= 127 in one comparison
    return (*gap_steps(idx[small], d[small]), idx[~small].astype(np.int32))


def gap_steps(at: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Steps `d` (|d| <= 127) of the ascending flat indices `at` as (gaps_S uint8, steps_S int8):
    entry s patches flat index cumsum(gaps)[s] - 1; a gap over 255 is bridged by entries of gap 255
    and step 0."""
    gap = np.diff(at.astype(np.int64, copy=False), prepend=-1)
    far = np.flatnonzero(gap > 255)  # few: at a few percent changed, one gap in thousands
    if not far.size:
        return gap.astype(np.uint8), d.astype(np.int8)
    fill = (gap[far] - 1) // 255  # bridging entries before each far element
    gap[far] -= 255 * fill
    before = np.repeat(far, fill)
    return (
        np.insert(gap.astype(np.uint8), before, np.uint8(255)),
        np.insert(d.astype(np.int8), before, np.int8(0)),
    )


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
        # pushed, unconfirmed: (tensors, full, round, whether they are views of `_bits`)
        self._pending: tuple[dict[str, np.ndarray] | None, bool, int, bool] | None = None
        # `push_cast`: per tensor the bf16 bits of its last push in memory order, updated in place
        self._bits: dict[str, tuple] = {}
        self._bits_base = False  # `_bits` hold the last confirmed push (the base of a cast push)
        self._base_round: int | None = None  # the round `_last` was pushed in
        self._payload: Path | None = (
            None  # the last round's file, removed once the round is confirmed
        )
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
        self._since_full, self._last, self._bits_base = None, None, False

    def next_is_full(self) -> bool:
        return self._since_full is None or self._since_full + 1 >= self.full_push_every

    def push(self, tensors: dict[str, np.ndarray], *, skip_finish: bool = False) -> dict:
        """One round (start, update, finish, prefix-cache reset) of `tensors` (host arrays), diffed
        here against the last confirmed push's; the new state counts as the base of the next sparse
        push only once `confirm()` is called (after the probe check passed). `skip_finish` is for
        fault tests only."""
        full = self.next_is_full()
        t0 = time.perf_counter()
        entries, changed, total = encode(tensors, None if full else self._last)
        encode_s = time.perf_counter() - t0
        m = self.push_entries(entries, full, changed, total, skip_finish=skip_finish)
        self._pending = (tensors, full, self.rounds, False)
        m["write_s"] += encode_s
        return m

    def push_cast(self, tensors: dict[str, np.ndarray], *, skip_finish: bool = False) -> dict:
        """`push` of float32 `tensors` served in bfloat16: the cast and the diff in one pass per tensor
        (`encode_cast`), against the bits of the last confirmed push kept here (not a copy of the
        tensors). The bits are overwritten as they are diffed: a push that is not confirmed leaves them
        as neither round's, and the next push is full (`invalidate`)."""
        full = self.next_is_full() or not self._bits_base
        self._bits_base = False
        t0 = time.perf_counter()
        entries, changed, total, served = encode_cast(tensors, self._bits, full)
        encode_s = time.perf_counter() - t0
        m = self.push_entries(entries, full, changed, total, skip_finish=skip_finish)
        self._pending = (served, full, self.rounds, True)
        m["write_s"] += encode_s
        return m

    def push_entries(
        self, entries: list[tuple], full: bool, changed: int, total: int, *, skip_finish=False
    ) -> dict:
        """One round of entries already encoded (`encode`, or on the device: `device_patch`), full or
        sparse against the last confirmed push (`next_is_full()` says which is due)."""
        if not self._ready:
            self.init()
        t0 = time.perf_counter()
        self.rounds += 1
        name = f"round{self.rounds % 2}.bin"
        info, nbytes = self._write(name, entries, not full)
        self._payload = self.root / name
        t1 = time.perf_counter()
        self._start()
        self._post("/update_weights", {"update_info": info}, f"sending weight round {self.rounds}")
        if not skip_finish:
            self._post(
                "/finish_weight_update",
                {"weight_version": str(self.rounds)},
                f"finishing weight round {self.rounds}",
            )
        reset_prefix_cache(self.client)
        t2 = time.perf_counter()
        self._pending = (None, full, self.rounds, False)
        return {
            "bytes": float(nbytes),
            "changed_frac": changed / max(total, 1),
            "full": float(full),
            "write_s": t1 - t0,
            "pause_s": t2 - t1,
        }

    def confirm(self) -> None:
        """The last push was checked: it becomes the base of the next sparse push, and its payload file is
        removed (the server has applied it; a full push of a 7B model is 15 GB of `/dev/shm`)."""
        if self._pending is None:
            raise RuntimeError("confirm() without a push to confirm")
        if self._payload is not None:
            self._payload.unlink(missing_ok=True)
            self._payload = None
        (tensors, full, self._base_round, self._bits_base), self._pending = self._pending, None
        # fresh host arrays per push: kept, not copied (None: the base is on the device)
        self._last = None if tensors is None else dict(tensors)
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

    def _write(self, name: str, entries: list[tuple], sparse: bool):
        """Write one payload file of `entries` (to a temporary name, then renamed); returns
        (update_info, bytes)."""
        parts: list[np.ndarray] = []
        offsets, counts, index_offsets, step_offsets, step_counts = [], [], [], [], []
        pos = 0

        def place(arr: np.ndarray) -> int:
            nonlocal pos
            start = -(-pos // _ALIGN) * _ALIGN
            if start > pos:
                parts.append(np.zeros(start - pos, np.uint8))
            raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
            parts.append(raw)
            pos = start + raw.size
            return start

        names, dtypes, shapes = [], [], []
        for key, dtype, shape, values, *patch in entries:
            names.append(key)
            dtypes.append(np.dtype(dtype).name)
            shapes.append(list(shape))
            offsets.append(place(values))
            counts.append(int(np.size(values)))
            if not patch:  # whole
                index_offsets.append(-1)
                step_offsets.append(-1)
                step_counts.append(0)
                continue
            rest, gaps_S, steps_S = patch
            index_offsets.append(place(np.asarray(rest, np.int32)))
            step_offsets.append(place(np.concatenate([gaps_S, np.asarray(steps_S).view(np.uint8)])))
            step_counts.append(int(gaps_S.size))
        self.root.mkdir(parents=True, exist_ok=True)
        # The server applied this round's file two rounds ago: removed first, so that the folder never
        # holds more than two payloads (the push folder's space check, `vllm_push.check_space`)
        with contextlib.suppress(FileNotFoundError):
            (self.root / name).unlink()
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
            "index_offsets": index_offsets if sparse else None,
            "step_offsets": step_offsets if sparse else None,
            "step_counts": step_counts if sparse else None,
            "base_round": self._base_round if sparse else None,
            "crc32": crc,
            "round": self.rounds,
            "round_tensors": len(names),
        }
        return info, pos


def _steps_in_hf_order(j: np.ndarray, d: np.ndarray, shape: tuple[int, int]):
    """Steps `d` (|d| <= 127) found at memory positions `j` of a [rows, cols] tensor stored transposed,
    as ascending C-order flat indices and int8 steps: one sort of keys index << 8 | step + 128, in 32
    bits where the tensor has under 2^24 elements."""
    key_t = np.uint32 if shape[0] * shape[1] < 1 << 24 else np.uint64
    key = _hf_index(j, shape).astype(key_t) << key_t(8)
    key |= (d + 128).astype(key_t)
    key.sort()
    return (key >> key_t(8)).astype(np.int64), ((key & key_t(255)).astype(np.int16) - 128)


def _patch(old: np.ndarray | None, arr: np.ndarray) -> tuple[int, tuple | None]:
    """(changed elements, patch) of one tensor against its `old` (None: a full push, no patch); the
    patch is (values, rest indices, gaps, steps), None where the tensor goes whole: over a quarter
    changed (a large update: a patch would save little) or a patch no smaller. The same patch as
    `changed_steps` then `split_steps`, with the steps of a transposed view put in HF order by a sort
    of their small keys."""
    if old is None:
        return arr.size, None
    a, b, shape = _layouts(old, arr)
    j, d = _memory_changes(a, b)
    if 4 * j.size > arr.size:
        return j.size, None
    if shape is None or d.dtype.itemsize not in (2, 4):
        gaps_S, steps_S, rest = split_steps(*((j, d) if shape is None else _hf_order(j, d, shape)))
    else:
        small = (d + 127).view(_UINT[d.dtype.itemsize]) <= 254  # -127 <= d <= 127
        gaps_S, steps_S = gap_steps(*_steps_in_hf_order(j[small], d[small], shape))
        rest = np.sort(_hf_index(j[~small], shape)).astype(np.int32)
    if 2 * gaps_S.size + rest.size * (4 + arr.itemsize) >= arr.nbytes:
        return j.size, None
    return j.size, (_values_at(arr, rest), rest, gaps_S, steps_S)


def _bf16_view(
    bits_N: np.ndarray, shape: tuple[int, ...], memory: tuple[int, int] | None
) -> np.ndarray:
    """The bits of one tensor as bfloat16 in its HF shape: a transposed view where `memory` is the
    (rows, cols) of a tensor stored transposed (`_layout`)."""
    bf = bits_N.view(ml_dtypes.bfloat16)
    return bf.reshape(shape) if memory is None else bf.reshape(memory[1], memory[0]).T


@functools.cache
def _warm() -> None:
    """Compile `cast_patch`'s loops once per process, on the first cast push (a second or more; loaded
    from numba's cache where the package folder is writable)."""
    from cppo_jax.rollout.vllm import cast_patch

    cast_patch.warm()


def _cast_patch(x: np.ndarray, held: tuple | None, full: bool) -> tuple:
    """One float32 tensor cast to bfloat16 over its bits of the last push (`held`: (bits, memory
    layout, scratch buffers kept across rounds), the bits updated in place; None or a full push: cast
    whole into fresh or reused bits), and its patch as `_patch` makes it. Returns (changed elements,
    patch or None (whole), held, bf16 view)."""
    from cppo_jax.rollout.vllm import cast_patch

    x_N, memory = _layout(x)
    if held is None or held[1] != memory or held[0].size != x_N.size:
        held, full = (np.empty(x_N.size, np.uint16), memory, {}), True
    bits_N, _, scratch = held
    arr = _bf16_view(bits_N, x.shape, memory)
    if full:
        cast_patch.cast_bf16(x_N, bits_N)
        return x.size, None, held, arr
    if not scratch:  # room for a quarter changed (more goes whole); kept, as fresh pages cost their
        # faults every round (a ~500M push's encoding: 0.38-0.43 s kept, 0.41-0.55 s fresh, measured)
        room = x.size // 4 + 1
        scratch.update(at=np.empty(room, np.int32), step=np.empty(room, np.int16))
        if memory is not None:
            scratch.update(row=np.empty(room, np.int32), idx=np.empty(room, np.int32))
            scratch.update(out=np.empty(room, np.int16))
    at_C, step_C = scratch["at"], scratch["step"]
    if memory is None:
        n = cast_patch.cast_changes(x_N, bits_N, at_C, step_C)
    else:  # recorded with their HF index and row, then put in HF order
        count_R = np.zeros(memory[0] + 1, np.int64)
        n = cast_patch.cast_changes_t(x_N, bits_N, memory[0], at_C, scratch["row"], step_C, count_R)
    if 4 * n > x.size:
        return n, None, held, arr
    at_C, step_C = at_C[:n], step_C[:n]
    if memory is not None:
        idx_C, out_C = scratch["idx"][:n], scratch["out"][:n]
        cast_patch.hf_order(at_C, scratch["row"][:n], step_C, count_R, idx_C, out_C)
        at_C, step_C = idx_C, out_C
    gaps_S, steps_S, rest = cast_patch.split_gap_steps(at_C, step_C)
    if 2 * gaps_S.size + rest.size * (4 + arr.itemsize) >= arr.nbytes:
        return n, None, held, arr
    return n, (_values_at(arr, rest), rest, gaps_S, steps_S), held, arr


def encode_cast(
    tensors: dict[str, np.ndarray], bits: dict[str, tuple], full: bool
) -> tuple[list[tuple], int, int, dict[str, np.ndarray]]:
    """`encode` of the bfloat16 cast of float32 `tensors` (HF-named host arrays, transposed views
    allowed), cast and diffed in one pass (`cast_patch`) against `bits`: per tensor the bit patterns of
    the last push in the tensor's memory order, updated in place to this push's (added where missing;
    every tensor cast whole when `full`). Returns (entries, changed, total, the cast tensors as bfloat16
    views of `bits` in HF shape)."""
    arrays = {key: np.asarray(t) for key, t in tensors.items()}
    wrong = [key for key, a in arrays.items() if a.dtype != np.float32]
    if wrong:
        raise ValueError(
            f"tensor {wrong[0]} is {arrays[wrong[0]].dtype}: the bf16 cast reads float32"
        )
    _warm()
    order = sorted(arrays, key=lambda key: -arrays[key].size)
    found = dict(
        zip(
            order,
            _pool().map(
                _cast_patch,
                [arrays[k] for k in order],
                [bits.get(k) for k in order],
                [full] * len(order),
            ),
            strict=True,
        )
    )
    entries: list[tuple] = []
    served: dict[str, np.ndarray] = {}
    changed = total = 0
    for key, x in arrays.items():
        n, patch, bits[key], arr = found[key]
        served[key] = arr
        changed, total = changed + n, total + x.size
        entries.append(
            (key, arr.dtype, arr.shape, arr)
            if patch is None
            else (key, arr.dtype, arr.shape, *patch)
        )
    return entries, changed, total, served


def encode(tensors: dict[str, np.ndarray], base: dict | None) -> tuple[list[tuple], int, int]:
    """The wire entries of `tensors` on the host: whole (`base` None: a full push), or each diffed
    against `base` (a patch, or whole where over a quarter changed or a patch would be no smaller).
    Returns (entries, changed elements, all elements); entries as `ProtocolPusher.push_entries`.
    Tensors are diffed on several threads, the largest first; a tensor may be a transposed view
    (`changed_steps`), copied only when it goes whole."""
    arrays = {key: np.asarray(t) for key, t in tensors.items()}
    if base is not None:
        missing = [key for key in arrays if key not in base]
        if missing:
            raise ValueError(f"tensor {missing[0]} was not in the last push: a full push is needed")
    order = sorted(arrays, key=lambda key: -arrays[key].size)
    olds = [None if base is None else base[key] for key in order]
    found = dict(zip(order, _pool().map(_patch, olds, [arrays[k] for k in order]), strict=True))
    entries: list[tuple] = []
    changed = total = 0
    for key, arr in arrays.items():
        n, patch = found[key]
        changed, total = changed + n, total + arr.size
        entries.append(
            (key, arr.dtype, arr.shape, arr)
            if patch is None
            else (key, arr.dtype, arr.shape, *patch)
        )
    return entries, changed, total
