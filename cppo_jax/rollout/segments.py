"""The embedded sampler's completion cache in segments: the slot counts its decode loops run over.

Host arithmetic (no JAX), shared by the sampler, which builds one while loop per segment, and the
memory plan (`program_memory`), which counts the caches the compiled sampler holds.
"""

from __future__ import annotations

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
