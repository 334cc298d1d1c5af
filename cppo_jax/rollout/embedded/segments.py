"""The embedded sampler's completion cache in segments: the slot counts its decode loops run over.

Host arithmetic (no JAX), shared by the sampler, which builds one while loop per segment, and the
memory plan (`planning.compiled_memory`), which counts the caches the compiled sampler holds.
"""

from __future__ import annotations

import bisect
import math

SEGMENT_LEN = 64  # the first segment's slots (`SamplingParams.segment_len`'s default)


def segment_ends(C: int, first: int) -> list[int]:
    """Completion-cache sizes of the decode segments: first, 2 first, 4 first, ..., then C.

    Decode attention reads every slot of the current segment: with one segment of C slots it reads
    twice the slots in use on average, with doubling segments about 4/3 (past the first), at the
    price of one compiled loop body per segment. One segment when `first` is 0 or C < 2 first.
    """
    ends = []
    size = first
    while size > 0 and 2 * size <= C:
        ends.append(size)
        size *= 2
    return [*ends, C]


# Each compacted loop holds this fraction of the rows of the one before (rounded up): the rows still
# running fill a loop at least this much. 0.6 keeps 0.8 of the decoded row-steps useful on
# reasoning-like lengths with 11 loops for 128 rows (halving: 0.74 with 8;
# benchmarks/results/compaction.md).
COMPACT_RATIO = 0.6


def compact_buckets(N: int, ratio: float = COMPACT_RATIO) -> list[int]:
    """Row counts of the embedded sampler's decode loops with `rollout.compact`: N, then `ratio`
    of the last (rounded up, at least one fewer) down to one row. Decoding moves to the next bucket
    once the rows still running fit in it."""
    sizes = [N]
    while sizes[-1] > 1:
        sizes.append(min(sizes[-1] - 1, math.ceil(sizes[-1] * ratio)))
    return sizes


def running_rows(lengths, C: int) -> list[int]:
    """Rows still running at each decode step of the embedded sampler, for completions of `lengths`
    valid tokens (EOS included) of at most C: step t (t = 0, 1, ...) feeds token t of every row
    of its loop through the model, and runs while a row has not ended before t (length > t), up to
    t = C - 2 (the last token needs no forward pass)."""
    lengths = sorted(int(n) for n in lengths)
    steps = min(C - 1, lengths[-1] if lengths else 0)
    return [len(lengths) - bisect.bisect_right(lengths, t) for t in range(steps)]


def decoded_row_steps(lengths, C: int, buckets: list[int]) -> int:
    """Row-steps the decode loops run: at each step the smallest bucket that holds the rows still
    running (`[N]`: no compaction, every step decodes all N rows)."""
    return sum(min(b for b in buckets if b >= r) for r in running_rows(lengths, C))
