"""Packed training rows (`trainer.pack`): the kept sequences of a step placed, on the host, into R
rows of L tokens, so the training forward/backward computes R * L tokens instead of M * T.

Letters (docs/conventions.md): M kept sequences, T = P + C their padded slots, C completion slots;
locally R packed rows and L tokens per row (both static per run, so the step compiles once).

Steps of `pack`, in order:
1. Each kept sequence is its real tokens only: the prompt's (left-padded in `tokens_MT`) then the
   completion's up to and including EOS (right-padded); n_m = p_m + c_m tokens.
2. First-fit decreasing: sequences by length, longest first (ties in row order), each into the
   first row with room for it. A sequence longer than L, or a step whose sequences do not fit in R
   rows, is a `DoesNotFitError` (a `ValueError`) naming `trainer.pack_len` / `trainer.pack_rows` and the
   sizes needed; the trainer then trains that step padded (`packing.rows.Packer.batch`).
3. Each sequence's tokens lie contiguous and in order in its row; `segment_RL` numbers the
   sequences of a row from 1 (0: padding), `positions_RL` restart at 0 per sequence (the RoPE
   positions the padded forward gives it: `positions_from_valid`).
4. `src_MC`: where completion token c of sequence m is predicted, as a flat index into the
   [R, L - 1] next-token log-probs of the packed rows (row r's slot l predicts slot l + 1):
   r * (L - 1) + l - 1 for the token at slot l. Slots past a completion's end point at 0 and must
   carry no loss weight (`mask_MC` 0 there; checked).

Host code: NumPy only, no JAX.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class DoesNotFitError(ValueError):
    """A step that does not fit R rows of L: `rows` first-fit decreasing needs (0 when a sequence of
    `longest` tokens is longer than L)."""

    def __init__(self, message: str, rows: int = 0, longest: int = 0):
        super().__init__(message)
        self.rows, self.longest = rows, longest


class Packed(NamedTuple):
    tokens_RL: np.ndarray  # int32: the packed sequences, 0 in padding slots
    segment_RL: np.ndarray  # int32: 1, 2, ... per sequence of a row; 0 padding
    positions_RL: np.ndarray  # int32: RoPE positions, from 0 in each sequence
    src_MC: np.ndarray  # int32: flat index into [R, L - 1] next-token log-probs (see module doc)
    row_M: np.ndarray  # int32: each sequence's row (-1: an empty sequence, not placed)
    start_M: np.ndarray  # int32: its first slot in the row

    @property
    def tokens_placed(self) -> int:
        return int((self.segment_RL > 0).sum())


def sequence_lengths(valid_MT: np.ndarray, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(p_M, c_M): real prompt and completion tokens of each row of `valid_MT`, checked to be a
    left-padded prompt and a right-padded completion (a `ValueError` names the row)."""
    valid_MT = np.asarray(valid_MT, bool)
    P = prompt_len
    p_M = valid_MT[:, :P].sum(axis=1)
    c_M = valid_MT[:, P:].sum(axis=1)
    slot_P = np.arange(P)
    slot_C = np.arange(valid_MT.shape[1] - P)
    prompt_ok = (valid_MT[:, :P] == (slot_P[None] >= (P - p_M)[:, None])).all(axis=1)
    completion_ok = (valid_MT[:, P:] == (slot_C[None] < c_M[:, None])).all(axis=1)
    bad = np.flatnonzero(~(prompt_ok & completion_ok))
    if bad.size:
        raise ValueError(
            f"valid_MT row {int(bad[0])}: packing needs a left-padded prompt and a right-padded "
            f"completion (contiguous real tokens)"
        )
    no_prompt = np.flatnonzero((p_M == 0) & (c_M > 0))
    if no_prompt.size:
        raise ValueError(
            f"valid_MT row {int(no_prompt[0])}: a completion without a prompt token has no "
            f"position to predict its first token from"
        )
    return p_M.astype(np.int64), c_M.astype(np.int64)


def first_fit_decreasing(n_M: np.ndarray, rows: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(row_M, start_M): sequences of n_M tokens placed by first-fit decreasing into `rows` rows of
    `length` slots; empty sequences get row -1. Errors name trainer.pack_len / trainer.pack_rows."""
    n_M = np.asarray(n_M, np.int64)
    longest = int(n_M.max(initial=0))
    if longest > length:
        m = int(np.argmax(n_M))
        raise DoesNotFitError(
            f"sequence {m} has {longest} tokens, more than trainer.pack_len={length}: raise "
            f"trainer.pack_len to at least {longest} (0: the padded length P + C always fits)",
            longest=longest,
        )
    used_R = np.zeros(rows, np.int64)
    row_M = np.full(n_M.shape, -1, np.int64)
    start_M = np.zeros(n_M.shape, np.int64)
    order = np.argsort(-n_M, kind="stable")  # longest first, ties in row order
    for m in order:
        n = n_M[m]
        if n == 0:
            break  # the rest are empty too
        fits = np.flatnonzero(used_R + n <= length)
        if fits.size == 0:
            needed = rows_for(n_M, length)
            raise DoesNotFitError(
                f"the step's {int((n_M > 0).sum())} sequences ({int(n_M.sum())} tokens) do not fit "
                f"in trainer.pack_rows={rows} rows of trainer.pack_len={length} tokens; first-fit "
                f"decreasing needs {needed}: raise trainer.pack_rows",
                rows=needed,
            )
        r = fits[0]
        row_M[m], start_M[m] = r, used_R[r]
        used_R[r] += n
    return row_M, start_M


def pack(
    tokens_MT: np.ndarray,
    valid_MT: np.ndarray,
    prompt_len: int,
    rows: int,
    length: int,
    mask_MC: np.ndarray | None = None,
) -> Packed:
    """The step's M sequences packed into `rows` rows of `length` tokens (see the module doc).

    `mask_MC` (optional): the loss weights, checked to be 0 on every completion slot past its
    sequence's end (those slots are not placed)."""
    tokens_MT = np.asarray(tokens_MT)
    valid_MT = np.asarray(valid_MT, bool)
    M, T = tokens_MT.shape
    P = prompt_len
    C = T - P
    if rows < 1 or length < 2:
        raise ValueError(
            f"trainer.pack_rows={rows} and trainer.pack_len={length}: need >= 1 and >= 2"
        )
    p_M, c_M = sequence_lengths(valid_MT, P)
    if mask_MC is not None:
        outside = (np.asarray(mask_MC) != 0) & (np.arange(C)[None] >= c_M[:, None])
        if outside.any():
            m = int(np.flatnonzero(outside.any(axis=1))[0])
            raise ValueError(f"mask_MC row {m} weighs completion slots past the sequence's end")
    n_M = p_M + c_M
    row_M, start_M = first_fit_decreasing(n_M, rows, length)
    tokens_RL = np.zeros((rows, length), np.int32)
    segment_RL = np.zeros((rows, length), np.int32)
    positions_RL = np.zeros((rows, length), np.int32)
    src_MC = np.zeros((M, C), np.int32)
    seg_R = np.zeros(rows, np.int32)
    for m in np.argsort(start_M, kind="stable"):  # a row's segments numbered left to right
        r = row_M[m]
        if r < 0:
            continue
        s, n, p, c = start_M[m], n_M[m], p_M[m], c_M[m]
        seg_R[r] += 1
        tokens_RL[r, s : s + p] = tokens_MT[m, P - p : P]
        tokens_RL[r, s + p : s + n] = tokens_MT[m, P : P + c]
        segment_RL[r, s : s + n] = seg_R[r]
        positions_RL[r, s : s + n] = np.arange(n)
        # completion token j sits at slot s + p + j, predicted at slot s + p + j - 1
        src_MC[m, :c] = r * (length - 1) + s + p - 1 + np.arange(c)
    return Packed(
        tokens_RL,
        segment_RL,
        positions_RL,
        src_MC,
        row_M.astype(np.int32),
        start_M.astype(np.int32),
    )


def rows_for(n_M: np.ndarray, length: int) -> int:
    """Rows first-fit decreasing fills with sequences of n_M tokens (each <= length) in rows of
    `length`: the smallest `trainer.pack_rows` with which that step packs."""
    used: list[int] = []
    for n in sorted((int(n) for n in np.asarray(n_M).ravel() if n > 0), reverse=True):
        for i, u in enumerate(used):
            if u + n <= length:
                used[i] += n
                break
        else:
            used.append(n)
    return len(used)
