"""The bf16 cast and the diff of a sparse push in one pass over the float32 weights, on the host.

Where the trainer's device is the CPU its parameters already lie in host memory, and a sparse push
(`weight_transfer`) would otherwise cast the whole model to bfloat16 (a pass writing a second copy) and then
compare that copy with the last push's (a second pass). Here one compiled loop (numba) reads each float32
weight once, rounds it to bfloat16 as XLA and ml_dtypes do (round to nearest even, subnormals kept; a
NaN becomes the canonical quiet NaN of its sign), compares it with the last push's bits, writes the new bits over them in place and records the
changed positions with their steps (the difference of the 16-bit patterns modulo 2^16, read signed).
Memory traffic: 4 bytes read per weight plus 2 bytes read and the changed ones written, against 4 read +
2 written + 2 x 2 read for the two passes; measured in benchmarks/results/weight_sync.md.

The rest of the encoding stays in loops over the changes (a few percent of the weights): a transposed
tensor's changes put in HF order by a counting sort on their HF row (`hf_order`), then split into 2-byte
steps with their index gaps and the rest (`split_gap_steps`), byte for byte as
`weight_transfer.split_steps` writes them (`tests/test_weight_transfer.py`).

Host code: numpy and numba, no JAX. The loops release the GIL (tensors run on several threads); compiled
once per process (cached on disk where the package folder is writable), `warm()` compiles them up front.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["cast_bf16", "cast_changes", "hf_order", "split_gap_steps", "warm"]

_JIT = {"nogil": True, "cache": True, "boundscheck": False}


@numba.njit(inline="always")
def _bf16(u: np.uint32) -> np.uint16:
    """The bfloat16 bit pattern of the float32 with bit pattern `u`, rounded to nearest even."""
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: the quiet NaN of its sign
        return np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    return np.uint16(
        (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    )


@numba.njit(**_JIT)
def cast_bf16(x_N: np.ndarray, bits_N: np.ndarray) -> None:
    """bits_N[:] = the bfloat16 bit patterns of the float32 bit patterns x_N (both flat)."""
    for i in range(x_N.size):
        bits_N[i] = _bf16(x_N[i])


@numba.njit(**_JIT)
def cast_changes(x_N: np.ndarray, bits_N: np.ndarray, at_C: np.ndarray, step_C: np.ndarray) -> int:
    """Cast the float32 bit patterns x_N to bfloat16 over the last bits_N (both flat, one memory order),
    in place; the first changes (up to C) go to at_C (their positions, ascending) and step_C (new - old
    bit pattern modulo 2^16, as int16). Returns the number of changed elements, which may exceed C (the
    changes past C are applied to bits_N but not recorded)."""
    n = 0
    room = at_C.size
    for i in range(x_N.size):
        new = _bf16(x_N[i])
        old = bits_N[i]
        if new != old:
            if n < room:
                at_C[n] = i
                step_C[n] = np.int16(np.uint16(new - old))
            n += 1
            bits_N[i] = new
    return n


@numba.njit(**_JIT)
def hf_order(at_C: np.ndarray, step_C: np.ndarray, rows: int, cols: int):
    """Changes at ascending memory positions of a [rows, cols] tensor stored transposed (memory order
    [cols, rows]: position j is HF row j % rows, column j // rows) as ascending C-order flat indices
    (int64) with their steps: a counting sort on the row, stable, so each row's columns stay ascending."""
    count_R = np.zeros(rows + 1, np.int64)
    for k in range(at_C.size):
        count_R[at_C[k] % rows + 1] += 1
    for r in range(rows):
        count_R[r + 1] += count_R[r]
    idx_C = np.empty(at_C.size, np.int64)
    out_C = np.empty(step_C.size, step_C.dtype)
    for k in range(at_C.size):
        j = at_C[k]
        c, r = divmod(j, rows)
        slot = count_R[r]
        count_R[r] = slot + 1
        idx_C[slot] = np.int64(r) * cols + c
        out_C[slot] = step_C[k]
    return idx_C, out_C


@numba.njit(**_JIT)
def split_gap_steps(idx_C: np.ndarray, step_C: np.ndarray):
    """Changes at ascending flat indices idx_C moved by step_C (signed) as the wire's streams: the ones
    that moved by at most 127 as (gaps_S uint8, steps_S int8), entry s patching index cumsum(gaps)[s] - 1,
    a gap over 255 bridged by entries of gap 255 and step 0; the others as rest_R (int32 indices)."""
    n = idx_C.size
    small = 0
    bridges = 0
    prev = np.int64(-1)
    for k in range(n):
        if -127 <= step_C[k] <= 127:
            small += 1
            bridges += (idx_C[k] - prev - 1) // 255
            prev = idx_C[k]
    gaps_S = np.empty(small + bridges, np.uint8)
    steps_S = np.empty(small + bridges, np.int8)
    rest_R = np.empty(n - small, np.int32)
    s = 0
    r = 0
    prev = np.int64(-1)
    for k in range(n):
        d = step_C[k]
        if -127 <= d <= 127:
            gap = idx_C[k] - prev
            while gap > 255:
                gaps_S[s] = 255
                steps_S[s] = 0
                s += 1
                gap -= 255
            gaps_S[s] = np.uint8(gap)
            steps_S[s] = np.int8(d)
            s += 1
            prev = idx_C[k]
        else:
            rest_R[r] = np.int32(idx_C[k])
            r += 1
    return gaps_S, steps_S, rest_R


def warm() -> None:
    """Compile (or load from the cache) every loop for the types a push uses."""
    x_N = np.zeros(4, np.uint32)
    bits_N = np.zeros(4, np.uint16)
    cast_bf16(x_N, bits_N)
    at_C, step_C = np.zeros(1, np.int64), np.zeros(1, np.int16)
    cast_changes(x_N, bits_N, at_C, step_C)
    idx_C, step_C = hf_order(at_C, step_C, 2, 2)
    split_gap_steps(idx_C, step_C)
