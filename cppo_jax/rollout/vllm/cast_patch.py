"""The bf16 cast and the diff of a sparse push in one pass over the float32 weights, on the host.

Where the trainer's device is the CPU its parameters already lie in host memory, and a sparse push
(`weight_transfer`) would otherwise cast the whole model to bfloat16 (a pass writing a second copy) and then
compare that copy with the last push's (a second pass). Here one compiled loop (numba) reads each float32
weight once, in blocks of `_B`: it rounds each to bfloat16 as XLA and ml_dtypes do (round to nearest even,
subnormals kept; a NaN becomes the canonical quiet NaN of its sign), writes the new bits over the last
push's in place and the changes of their 16-bit patterns (modulo 2^16, read signed) to a scratch block,
without a branch, so that the compiler vectorizes it (AVX2 here); a scan of that block, 4 steps at a time,
records the changed positions with their steps. A transposed tensor's positions ascend in memory order; one
walk over them gives their HF index and row (the column advances by a comparison, no division per change).
Memory traffic: 4 bytes read per weight plus 2 read and 2 written, against 4 read + 2 written + 2 x 2 read
for the two passes; measured in benchmarks/results/weight_sync.md.

The rest of the encoding stays in loops over the changes (a few percent of the weights): a transposed
tensor's changes, recorded with their HF index and row (`cast_changes_t`), put in HF order by a counting
sort on the row (`hf_order`), then split into 2-byte steps with their index gaps and the rest
(`split_gap_steps`), byte for byte as `weight_transfer.split_steps` writes them
(`tests/test_weight_transfer.py`).

Host code: numpy and numba, no JAX. The loops release the GIL (tensors run on several threads); compiled
once per process (cached on disk where the package folder is writable), `warm()` compiles them up front.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["cast_bf16", "cast_changes", "cast_changes_t", "hf_order", "split_gap_steps", "warm"]

_JIT = {"nogil": True, "cache": True, "boundscheck": False}


@numba.njit(inline="always")
def _bf16(u: np.uint32) -> np.uint16:
    """The bfloat16 bit pattern of the float32 with bit pattern `u`, rounded to nearest even."""
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: the quiet NaN of its sign
        return np.uint16(((u >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
    return np.uint16(
        (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    )


# Weights a block: its steps stay in L1 between the cast and the scan (a multiple of 4: scanned as 8-byte
# words, a zero word skipped). Measured on one thread, 136M weights, 3% changed, AMD EPYC: 0.62-0.66 ns a
# weight blocked against 1.07-1.10 for one loop casting and recording in turn (0.66-0.71 against 0.92-0.97
# for a transposed [4864, 21504]), bit-equal.
_B = 256


@numba.njit(inline="always")
def _cast_block(x_K: np.ndarray, bits_K: np.ndarray, step_B: np.ndarray) -> np.uint32:
    """bits_K recast from x_K (one block, K <= B weights), the change of each bit pattern (new - old
    modulo 2^16, as uint16: 0 where it did not change) in step_B[:K]; returns the OR of the changes."""
    acc = np.uint32(0)
    for j in range(x_K.size):
        new = np.uint32(_bf16(x_K[j]))
        d = (new - np.uint32(bits_K[j])) & np.uint32(0xFFFF)
        step_B[j] = np.uint16(d)
        bits_K[j] = np.uint16(new)
        acc |= d
    return acc


@numba.njit(inline="always")
def _next_block(x_N: np.ndarray, bits_N: np.ndarray, s: int, step_B: np.ndarray) -> np.uint32:
    """`_cast_block` of the block at s; a short last block leaves zeros in step_B past its end."""
    e = min(s + _B, x_N.size)
    if e - s < _B:
        step_B[:] = 0
    return _cast_block(x_N[s:e], bits_N[s:e], step_B)


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
    step_B = np.zeros(_B, np.uint16)
    word_W = step_B.view(np.uint64)
    n = 0
    room = at_C.size
    for s in range(0, x_N.size, _B):
        if _next_block(x_N, bits_N, s, step_B) == 0:
            continue
        for w in range(_B // 4):
            if word_W[w] == 0:
                continue
            if n + 4 <= room:  # branch-free: each of the 4 written, kept where it changed
                for j in range(4 * w, 4 * w + 4):
                    d = np.int16(step_B[j])
                    at_C[n] = s + j
                    step_C[n] = d
                    n += d != 0
            else:
                for j in range(4 * w, 4 * w + 4):
                    d = np.int16(step_B[j])
                    if d != 0:
                        if n < room:
                            at_C[n] = s + j
                            step_C[n] = d
                        n += 1
    return n


@numba.njit(**_JIT)
def cast_changes_t(
    x_N: np.ndarray,
    bits_N: np.ndarray,
    rows: int,
    at_C: np.ndarray,
    row_C: np.ndarray,
    step_C: np.ndarray,
    count_R: np.ndarray,
) -> int:
    """`cast_changes` of a [rows, cols] tensor stored transposed (memory order [cols, rows]: position
    c * rows + r is HF row r, column c), recording each change's C-order flat index r * cols + c in at_C
    and its row in row_C, in memory order, and counting the recorded changes of row r in count_R[r + 1]
    (count_R: rows + 1 zeros), for `hf_order`."""
    n = cast_changes(x_N, bits_N, at_C, step_C)
    # the recorded positions ascend: their column advances by a comparison, no division per change
    cols = x_N.size // rows
    c, end = 0, rows  # the column of the position at hand, and where the next one starts
    for k in range(min(n, at_C.size)):
        i = at_C[k]
        while i >= end:
            c += 1
            end += rows
        r = i - (end - rows)
        at_C[k] = r * cols + c
        row_C[k] = r
        count_R[r + 1] += 1
    return n


@numba.njit(**_JIT)
def hf_order(
    at_C: np.ndarray,
    row_C: np.ndarray,
    step_C: np.ndarray,
    count_R: np.ndarray,
    idx_C: np.ndarray,
    out_C: np.ndarray,
) -> None:
    """The changes `cast_changes_t` recorded (C-order indices in memory order, their rows, steps, and
    per-row counts) in ascending C order, into idx_C and out_C (as long as at_C): a counting sort on the
    row, stable, so that each row's columns stay ascending. count_R is used up."""
    for r in range(count_R.size - 1):
        count_R[r + 1] += count_R[r]
    for k in range(at_C.size):
        r = row_C[k]
        slot = count_R[r]
        count_R[r] = slot + 1
        idx_C[slot] = at_C[k]
        out_C[slot] = step_C[k]


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
    at_C, row_C, step_C = np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int16)
    cast_changes(x_N, bits_N, at_C, step_C)
    count_R = np.zeros(3, np.int64)
    cast_changes_t(x_N, bits_N, 2, at_C, row_C, step_C, count_R)
    hf_order(at_C, row_C, step_C, count_R, row_C.copy(), step_C.copy())
    split_gap_steps(at_C, step_C)
