"""Sampling parameters and choosing tokens: what the embedded sampler draws, and how.

`SamplingParams` (validated once), `Samples` (what every rollout backend returns), where a completion
ends (`completion_ends`: its valid tokens and whether it finished, on NumPy or in jit, for every
backend), and the choice of one token per row from logits: greedy, or the top-k/top-p truncation of
softmax(logits / temperature) sampled by inverse CDF from one uniform number per token
(`sequence_uniforms`: question q's numbers come from `PRNGKey(seed_q)` alone). Pure functions of arrays;
the model and its caches are `sampler`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cppo_jax.models.transformer import DTYPES
from cppo_jax.rollout.embedded.segments import SEGMENT_LEN


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    # End-of-sequence ids: a row ends at the first of them (an int is taken as a 1-tuple).
    eos_id: int | tuple[int, ...] = 0
    pad_id: int = 0
    cache_dtype: str = "float32"
    # Completion-cache slots of the first decode segment; later segments double it (0: one
    # segment of max_new_tokens). See `segments.segment_ends`.
    segment_len: int = SEGMENT_LEN
    # Row compaction: as rows end, the running ones are gathered into ever smaller decode loops
    # (`segments.compact_buckets`: 0.6 of the rows of the last, down to one); the tokens and
    # log-probs are the same as without it.
    compact: bool = False
    # How top-k / top-p cuts are found ("bits" or "sort", `_truncate`); "": by the platform traced
    # for (`sampler.make_sampler` sets it from the devices a sampler is built for).
    truncation: str = ""

    def __post_init__(self):
        eos = (self.eos_id,) if _is_int(self.eos_id) else self.eos_id
        if (
            not isinstance(eos, (tuple, list))
            or not eos
            or not all(_is_int(i) and i >= 0 for i in eos)
        ):
            raise ValueError(
                f"eos_id: must be a non-negative id or a non-empty tuple of them, got {self.eos_id!r}"
            )
        object.__setattr__(self, "eos_id", tuple(int(i) for i in eos))
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens: must be a positive integer, got {self.max_new_tokens!r}"
            )
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k: must be a non-negative integer, got {self.top_k!r}")
        if not _is_int(self.segment_len) or self.segment_len < 0:
            raise ValueError(
                f"segment_len: must be a non-negative integer, got {self.segment_len!r}"
            )
        if self.cache_dtype not in DTYPES:
            raise ValueError(
                f"cache_dtype: unknown {self.cache_dtype!r}; supported: {sorted(DTYPES)}"
            )


class Samples(NamedTuple):
    tokens_NC: jax.Array  # int32, pad after EOS
    logp_NC: jax.Array  # float32, 0 after EOS
    valid_NC: jax.Array  # bool: tokens up to and including EOS (`completion_ends`)
    finished_N: jax.Array  # bool: has an EOS (False: truncated at C) (`completion_ends`)
    # int32 scalar: completion positions decoded, C unless every sequence stopped earlier (then
    # 1 + the last sequence's EOS position). None where a backend does not report it.
    steps: jax.Array | None = None
    # int32 scalar: row-steps the decode loops ran (rows of each loop summed over its steps: N per
    # step without compaction, `segments.decoded_row_steps`). None where a backend does not report it.
    row_steps: jax.Array | None = None


def is_end_id(tokens, end_ids, *, xp=np):
    """bool, shaped like `tokens`: which tokens are end ids (`end_ids`: an id or a tuple of ids)."""
    return xp.isin(tokens, xp.asarray(end_ids, tokens.dtype))


def completion_ends(tokens_NC, end_ids, length_N=None, *, xp=np):
    """(valid_NC, finished_N): where each completion ends, the one rule both backends use.

    A token is valid up to and including the row's first end id (any id of `end_ids`, an id or a
    tuple of ids); everything after it is padding. A row with no end id is valid up to its length
    and not finished (truncated). `length_N` (optional, [N]) is how many tokens each row holds;
    positions at or past it are padding and never end a row. `xp` is the array namespace: NumPy
    on the host (`samples_from_completions`, no device round trip), `jax.numpy` inside jit (the
    embedded sampler).
    """
    N, C = tokens_NC.shape
    within_NC = xp.ones((N, C), bool)
    if length_N is not None:
        within_NC = xp.arange(C)[None, :] < xp.asarray(length_N)[:, None]
    end_NC = is_end_id(tokens_NC, end_ids, xp=xp) & within_NC
    ends_before_NC = xp.cumsum(end_NC, axis=1, dtype=xp.int32) - end_NC  # end ids strictly before t
    return (ends_before_NC == 0) & within_NC, xp.any(end_NC, axis=1)


# ---------------------------------------------------------------------------------------------
# Choosing a token
# ---------------------------------------------------------------------------------------------


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that sort like the float32 values (non-NaN; -inf smallest)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> jnp.uint32(31)) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys_NV: jax.Array, enough) -> jax.Array:
    """Per row, the largest key K with enough(keys >= K) true ([N] uint32), bit by bit.

    `enough(mask_NV) -> bool [N]` must be monotone (true for a set, true for any superset) and
    true for the full row. 32 passes over the row, exact, no sort.
    """

    def body(i, best_N):
        candidate_N = best_N | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
        return jnp.where(enough(keys_NV >= candidate_N[:, None]), candidate_N, best_N)

    return jax.lax.fori_loop(0, 32, body, jnp.zeros(keys_NV.shape[:1], jnp.uint32))


def _truncate(
    logits_NV: jax.Array, top_k: int, top_p: float, method: str | None = None
) -> jax.Array:
    """Mask logits outside the top-k set and outside the top-p nucleus with -inf.

    top-k keeps every token at least as large as the k-th largest logit (ties at the cut are all
    kept). top-p then keeps the smallest set of the remaining tokens, by decreasing logit, whose
    probability mass reaches `top_p` (the token that crosses it included), again with every token
    tied with the last kept one. The cuts are found the way the backend does fastest (`method`:
    None picks by the platform being traced for, `TRUNCATION`): on CPU by an exact bit-by-bit
    search over the logits' order keys (32 masked passes: sorting is slow there), on accelerators
    by `lax.top_k` and a sort (`_truncate_sorted`), the same cut.
    """
    if method is None:
        method = TRUNCATION.get(jax.default_backend(), "sort")
    if method == "sort":
        return _truncate_sorted(logits_NV, top_k, top_p)
    if method != "bits":
        raise ValueError(f"truncation method: 'bits' or 'sort', got {method!r}")
    keys_NV = _order_keys(logits_NV)
    keep_NV = jnp.ones(logits_NV.shape, jnp.bool_)
    if top_k == 1:
        keep_NV = logits_NV >= jnp.max(logits_NV, axis=-1, keepdims=True)
    elif 0 < top_k < logits_NV.shape[-1]:
        kth_N = _largest_threshold(keys_NV, lambda m_NV: jnp.sum(m_NV, axis=-1) >= top_k)
        keep_NV = keys_NV >= kth_N[:, None]
    if top_p < 1.0:
        masked_NV = jnp.where(keep_NV, logits_NV, -jnp.inf)
        weight_NV = jnp.exp(masked_NV - jnp.max(masked_NV, axis=-1, keepdims=True))
        target_N = top_p * jnp.sum(weight_NV, axis=-1)

        def enough(m_NV):
            return jnp.sum(jnp.where(m_NV, weight_NV, 0.0), axis=-1) >= target_N

        cut_N = _largest_threshold(keys_NV, enough)
        keep_NV = keep_NV & (keys_NV >= cut_N[:, None])
    return jnp.where(keep_NV, logits_NV, -jnp.inf)


# The truncation per platform (`_truncate`): the bit search on CPU, where a sort of [N, V] is slow,
# `lax.top_k` and a sort elsewhere (GPU and TPU sort natively; 32 passes over [N, V] per token
# would cost more than the sort).
TRUNCATION = {"cpu": "bits"}


def _truncate_sorted(logits_NV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """`_truncate`'s cuts by `lax.top_k` and a descending sort: the k-th largest logit; then the
    first sorted position whose cumulative weight reaches `top_p` of the total gives the nucleus's
    smallest logit (every token tied with it kept, as the bit search keeps them)."""
    V = logits_NV.shape[-1]
    keep_NV = jnp.ones(logits_NV.shape, jnp.bool_)
    if top_k == 1:
        keep_NV = logits_NV >= jnp.max(logits_NV, axis=-1, keepdims=True)
    elif 0 < top_k < V:
        kth_N = jax.lax.top_k(logits_NV, top_k)[0][:, -1]
        keep_NV = logits_NV >= kth_N[:, None]
    if top_p < 1.0:
        masked_NV = jnp.where(keep_NV, logits_NV, -jnp.inf)
        max_N1 = jnp.max(masked_NV, axis=-1, keepdims=True)
        target_N = top_p * jnp.sum(jnp.exp(masked_NV - max_N1), axis=-1)
        sorted_NV = -jnp.sort(-masked_NV, axis=-1)  # descending
        cum_NV = jnp.cumsum(jnp.exp(sorted_NV - max_N1), axis=-1)
        reached_NV = cum_NV >= target_N[:, None]
        # (a cumulative sum rounded below the total keeps every token, not only the first)
        first_N = jnp.where(jnp.any(reached_NV, axis=-1), jnp.argmax(reached_NV, axis=-1), V - 1)
        cut_N = jnp.take_along_axis(sorted_NV, first_N[:, None], axis=-1)[:, 0]
        keep_NV = keep_NV & (logits_NV >= cut_N[:, None])
    return jnp.where(keep_NV, logits_NV, -jnp.inf)


def _prefix_sum(x_NK: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last axis as a triangular matmul (full float32 precision)."""
    K = x_NK.shape[-1]
    upper_KK = np.triu(np.ones((K, K), np.float32))  # a literal: nothing to compute per step
    return jnp.matmul(x_NK, upper_KK.astype(x_NK.dtype), precision=jax.lax.Precision.HIGHEST)


def _first_above(cum_NK: jax.Array, w_NK: jax.Array, x_N: jax.Array) -> jax.Array:
    """First k with cum_k > x and w_k > 0; the last k with w_k > 0 when rounding left none."""
    K = w_NK.shape[-1]
    k_K = np.arange(K, dtype=np.int32)
    positive_NK = w_NK > 0
    first_N = jnp.min(jnp.where((cum_NK > x_N[:, None]) & positive_NK, k_K, K), axis=-1)
    last_N = jnp.max(jnp.where(positive_NK, k_K, -1), axis=-1)
    return jnp.where(first_N < K, first_N, last_N)


def _inverse_cdf(w_NV: jax.Array, u_N: jax.Array, x_N: jax.Array | None = None) -> jax.Array:
    """Row-wise index v drawn with probability w_v / sum(w), given u ~ U[0, 1) per row.

    Picks the first v whose cumulative weight exceeds x = u * sum(w) (or the `x_N` given: a target
    in weight units, as `choose_split` hands each vocabulary shard); zero-weight entries are never
    picked. Two levels (blocks of about sqrt(V)): prefix sums over the block totals, then within the
    chosen block only, so the work is O(V) per row with small matmuls instead of a V-long scan.
    """
    N, V = w_NV.shape
    b = math.isqrt(V - 1) + 1 if V > 1 else 1
    nb = -(-V // b)
    w_NBb = jnp.pad(w_NV, ((0, 0), (0, nb * b - V))).reshape(N, nb, b)
    total_NB = jnp.sum(w_NBb, axis=-1)
    cum_NB = _prefix_sum(total_NB)
    if x_N is None:
        x_N = u_N * cum_NB[:, -1]
    block_N = _first_above(cum_NB, total_NB, x_N)
    take = functools.partial(jnp.take_along_axis, axis=1)
    before_N = (take(cum_NB, block_N[:, None]) - take(total_NB, block_N[:, None]))[:, 0]
    w_Nb = jnp.take_along_axis(w_NBb, block_N[:, None, None], axis=1)[:, 0]
    inner_N = _first_above(_prefix_sum(w_Nb), w_Nb, x_N - before_N)
    return (block_N * b + inner_N).astype(jnp.int32)


def choose(logits_NV: jax.Array, u_N: jax.Array, sp: SamplingParams):
    """One token per row and its log-prob under log-softmax(logits / temperature).

    temperature 0 is greedy (log-probs of the unscaled logits). Otherwise the token is drawn from
    the top-k/top-p truncation of softmax(logits / temperature) by inverse CDF with `u_N`.
    """
    if sp.temperature == 0.0:
        token_N = jnp.argmax(logits_NV, axis=-1).astype(jnp.int32)
        scaled_NV = logits_NV
    else:
        scaled_NV = logits_NV / sp.temperature
    max_N1 = jnp.max(scaled_NV, axis=-1, keepdims=True)
    weight_NV = jnp.exp(scaled_NV - max_N1)
    log_total_N = jnp.log(jnp.sum(weight_NV, axis=-1))
    if sp.temperature != 0.0:
        if sp.top_k > 0 or sp.top_p < 1.0:
            # The largest logit always survives truncation, so the shift by the max still holds.
            kept_NV = _truncate(scaled_NV, sp.top_k, sp.top_p, sp.truncation or None) > -jnp.inf
            weight_NV = jnp.where(kept_NV, weight_NV, 0.0)
        token_N = _inverse_cdf(weight_NV, u_N)
    chosen_N = jnp.take_along_axis(scaled_NV, token_N[:, None], axis=-1)[:, 0]
    return token_N, (chosen_N - max_N1[:, 0]) - log_total_N


class VocabSplit(NamedTuple):
    """The decode's logits split by vocabulary over `axes` of `mesh` (rows over `rows` where they
    divide), so that no device sums [N, V] partial logits per token (`sampler.vocab_split`); the
    tokens drawn go back split by rows over `batch` (the sampler's rows, and so its KV cache, stay
    where they were); `V` the real vocabulary (the logits' columns are padded to a multiple of the
    split)."""

    mesh: jax.sharding.Mesh
    rows: tuple[str, ...]
    axes: tuple[str, ...]
    batch: tuple[str, ...] = ()
    V: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def padded(self, V: int) -> int:
        return -(-V // self.size) * self.size


def choose_split(logits_NV: jax.Array, u_N: jax.Array, sp: SamplingParams, split: VocabSplit):
    """`choose` on logits split by vocabulary (columns from `split.V` on are padding, never drawn),
    without gathering them: each shard reduces its own columns and the devices exchange per-row
    figures only (max, total weight, the shards' totals, the chosen token and its logit). Greedy:
    the first column of the largest logit. Sampling: the inverse CDF of `choose` (the first column
    whose cumulative weight exceeds u times the total), over the shards' totals, then inside the
    shard that holds it. No top-k / top-p (`sampler.vocab_split` leaves those to `choose`)."""
    axes = split.axes
    row_size = math.prod(split.mesh.shape[a] for a in split.rows)
    rows = split.rows if split.rows and logits_NV.shape[0] % row_size == 0 else None

    def local(logits_nv, u_n):
        Vs = logits_nv.shape[-1]
        first = jax.lax.axis_index(axes).astype(jnp.int32) * Vs
        col_v = first + jnp.arange(Vs, dtype=jnp.int32)
        scaled_nv = logits_nv if sp.temperature == 0.0 else logits_nv / sp.temperature
        scaled_nv = jnp.where(col_v < split.V, scaled_nv, -jnp.inf)
        own_max_n = jnp.max(scaled_nv, axis=-1)
        max_n = jax.lax.pmax(own_max_n, axes)
        w_nv = jnp.exp(scaled_nv - max_n[:, None])
        own_total_n = jnp.sum(w_nv, axis=-1)
        log_total_n = jnp.log(jax.lax.psum(own_total_n, axes))
        if sp.temperature == 0.0:
            top_n = first + jnp.argmax(scaled_nv, axis=-1).astype(jnp.int32)
            token_n = jax.lax.pmin(
                jnp.where(own_max_n == max_n, top_n, jnp.iinfo(jnp.int32).max), axes
            )
        else:
            totals_nS = jax.lax.all_gather(own_total_n[:, None], axes, axis=1, tiled=True)
            cum_nS = _prefix_sum(totals_nS)
            x_n = u_n * cum_nS[:, -1]
            shard_n = _first_above(cum_nS, totals_nS, x_n)
            take = functools.partial(jnp.take_along_axis, axis=1)
            before_n = (take(cum_nS, shard_n[:, None]) - take(totals_nS, shard_n[:, None]))[:, 0]
            inner_n = _inverse_cdf(w_nv, u_n, x_n - before_n)
            token_n = jax.lax.psum(jnp.where(shard_n * Vs == first, first + inner_n, 0), axes)
        here_n = (token_n >= first) & (token_n < first + Vs)
        own_n = jnp.take_along_axis(scaled_nv, jnp.clip(token_n - first, 0, Vs - 1)[:, None], -1)
        chosen_n = jax.lax.psum(jnp.where(here_n, own_n[:, 0], 0.0), axes)
        return token_n, (chosen_n - max_n) - log_total_n

    P = jax.sharding.PartitionSpec
    token_N, logp_N = jax.shard_map(
        local, mesh=split.mesh, in_specs=(P(rows, axes), P(rows)), out_specs=(P(rows), P(rows))
    )(logits_NV, u_N)
    if (
        split.batch
        and logits_NV.shape[0] % math.prod(split.mesh.shape[a] for a in split.batch) == 0
    ):
        # each device keeps its own rows (a slice of what it holds: no transfer), so that the
        # next token's layers, and the cache they write, stay split by rows
        rows_N = jax.sharding.NamedSharding(split.mesh, P(split.batch))
        token_N, logp_N = (jax.lax.with_sharding_constraint(x, rows_N) for x in (token_N, logp_N))
    return token_N, logp_N


def sequence_uniforms(seeds_Q: jax.Array, num_samples: int, num_tokens: int) -> jax.Array:
    """The random numbers behind every sampled token: u [Q * G, C] in [0, 1).

    Row q * G + j, column t drives token t of sample j of question q: threefry of the counter
    j * C + t under `PRNGKey(seed_q)` (counter mode, as `jax.random.fold_in` computes it), so a
    question's numbers depend on its seed alone, never on the other questions in the batch. (The
    counter form compiles in a fraction of the time `jax.random.uniform` takes on CPU.)
    """
    keys_Q2 = jax.vmap(jax.random.PRNGKey)(seeds_Q)
    counters_M = jnp.arange(num_samples * num_tokens, dtype=jnp.uint32)
    fold = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)), in_axes=(0, None))
    bits_QM = fold(keys_Q2, counters_M)[..., 0]
    # 23 random mantissa bits -> a float in [1, 2) -> [0, 1).
    one_to_two_QM = jax.lax.bitcast_convert_type(
        (bits_QM >> jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32
    )
    return (one_to_two_QM - 1.0).reshape(-1, num_tokens)
