"""The embedded sampler's row compaction (`rollout.compact`, issue #49) against the sampler without it.

With compaction the rows still decoding are gathered into ever smaller loops (N, N/2, ..., 1 rows,
`segments.compact_buckets`) once half of them have ended. Nothing a row draws may change: on a tiny
model whose rows end at spread-out positions (a fifth of the vocabulary ends a row), the tokens,
which tokens are valid, which rows finished and the decode count are equal to the uncompacted
sampler's, and the log-probs equal to float32 rounding; also with Gemma 3's sliding-window layers,
greedily, and on a model in bfloat16.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.models.config import FULL, SLIDING
from cppo_jax.rollout.embedded.sampler import make_sampler
from cppo_jax.rollout.embedded.sampling import SamplingParams
from cppo_jax.rollout.embedded.segments import compact_buckets, decoded_row_steps, running_rows

try:
    import helpers
except ImportError:  # pragma: no cover - run as a package
    from tests import helpers

PROMPTS = [[5, 17, 33], [9, 200, 3, 44, 45, 46, 47], [128], [7, 7]]
# 4 prompts x G = 2 samples: 8 rows, decoded in loops of 8, 5, 3, 2 and 1 rows once compacted (each
# loop is compiled: a smaller N compiles fewer of them)
P, C, G, PAD = 7, 24, 2, 0
ENDS = tuple(range(237, 257))  # 20 of 257 ids end a row: lengths spread over the C positions


def _batch(seeds):
    tokens, valid, _ = helpers.left_pad(PROMPTS, pad_id=PAD, length=P)
    return jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(seeds, jnp.uint32)


def _both(cfg, sp: SamplingParams, num_samples: int, seeds=(3, 4, 5, 6)):
    model = helpers.random_model(cfg, seed=1)
    graphdef, state = nnx.split(model)
    args = (state, *_batch(seeds))
    plain = make_sampler(graphdef, num_samples, sp)(*args)
    packed = make_sampler(graphdef, num_samples, dataclasses.replace(sp, compact=True))(*args)
    return plain, packed


@functools.cache
def _sampled(segment_len: int):
    """(plain, packed) of the tiny untied model whose rows end at spread-out positions, sampled once
    per segment length for the tests that read them (each pair is two compiled samplers)."""
    sp = SamplingParams(
        max_new_tokens=C, temperature=1.0, eos_id=ENDS, pad_id=PAD, segment_len=segment_len
    )
    return _both(helpers.tiny_config(tie_word_embeddings=False), sp, G)


def _assert_same(plain, packed, rtol: float):
    np.testing.assert_array_equal(np.asarray(packed.tokens_NC), np.asarray(plain.tokens_NC))
    np.testing.assert_array_equal(np.asarray(packed.valid_NC), np.asarray(plain.valid_NC))
    np.testing.assert_array_equal(np.asarray(packed.finished_N), np.asarray(plain.finished_N))
    assert int(packed.steps) == int(plain.steps)
    np.testing.assert_allclose(
        np.asarray(packed.logp_NC), np.asarray(plain.logp_NC), rtol=rtol, atol=rtol
    )
    # And the compacted loops ran: each step decoded the smallest bucket holding its rows.
    lengths, N = _lengths(plain), plain.tokens_NC.shape[0]
    C_ = plain.tokens_NC.shape[1]
    assert (
        int(plain.row_steps)
        == decoded_row_steps(lengths, C_, [N])
        == N * int(plain.steps) - (N if int(plain.steps) == C_ else 0)
    )
    assert int(packed.row_steps) == decoded_row_steps(lengths, C_, compact_buckets(N))


def _lengths(samples) -> np.ndarray:
    return np.asarray(samples.valid_NC).sum(axis=1)


F32_TOL = 64 * float(np.finfo(np.float32).eps)  # a few roundings of a reduction's order


@pytest.mark.slow
@pytest.mark.parametrize("segment_len", [4, 0], ids=["segments", "one-segment"])
def test_compacted_rows_draw_what_uncompacted_rows_draw(segment_len):
    plain, packed = _sampled(segment_len)
    lengths = _lengths(plain)
    # The rows end at spread-out positions, so that the buckets decode (8 rows: 8, 5, 3, 2, 1), and
    # some run to the end.
    assert len(set(lengths.tolist())) >= 5 and lengths.max() == C, lengths
    assert compact_buckets(len(lengths)) == [8, 5, 3, 2, 1]
    _assert_same(plain, packed, F32_TOL)
    assert int(packed.row_steps) < int(plain.row_steps)


@pytest.mark.slow
def test_greedy_and_sliding_window_layers_compact_too():
    """Gemma 3's local layers (a window of 5 over the prompt and completion slots), sampled and
    greedy. Its random model repeats each prompt's last token with near certainty, so the sampled
    run is at temperature 20 (its rows then end at spread-out positions), and the greedy run ends
    on the first two prompts' tokens (half its rows end at once, the rest run to C)."""
    cfg = helpers.tiny_config(
        arch="gemma3", sliding_window=5, layer_types=(SLIDING, FULL), num_heads=2, num_kv_heads=1
    )
    sp = SamplingParams(max_new_tokens=C, temperature=20.0, eos_id=ENDS, pad_id=PAD, segment_len=4)
    greedy = dataclasses.replace(sp, temperature=0.0, eos_id=(PROMPTS[0][-1], PROMPTS[1][-1]))
    for num_samples, s in ((G, sp), (1, greedy)):
        plain, packed = _both(cfg, s, num_samples)
        assert len(set(_lengths(plain).tolist())) >= 2, _lengths(plain)
        _assert_same(plain, packed, F32_TOL)
        assert int(packed.row_steps) < int(plain.row_steps)


@pytest.mark.slow
def test_bfloat16_model_and_cache():
    cfg = helpers.tiny_config(tie_word_embeddings=False, dtype="bfloat16")
    sp = SamplingParams(
        max_new_tokens=C, temperature=1.0, eos_id=ENDS, pad_id=PAD, cache_dtype="bfloat16"
    )
    plain, packed = _both(cfg, sp, G)
    # The same bf16 products in the same order per row: equal tokens, log-probs to f32 rounding.
    _assert_same(plain, packed, F32_TOL)


def test_decoded_row_steps_counts_the_bucket_of_every_step():
    """Row-steps decoded (the host's count behind benchmarks/generation.md's useful fraction):
    without compaction every step decodes all N rows; with it, the smallest bucket holding the
    rows still running. Step t runs while a row is longer than t, up to t = C - 2."""
    lengths = np.array([1, 2, 2, 3, 8, 8, 8, 20])  # N = 8; buckets 8, 5, 3, 2, 1
    assert running_rows(lengths, 30) == [8, 7, 5, 4, 4, 4, 4, 4] + [1] * 12
    assert running_rows(lengths, 10) == [8, 7, 5, 4, 4, 4, 4, 4, 1]  # truncated at C = 10
    assert decoded_row_steps(lengths, 30, [8]) == 8 * 20
    assert compact_buckets(8) == [8, 5, 3, 2, 1]
    assert decoded_row_steps(lengths, 30, compact_buckets(8)) == 8 * 2 + 5 + 5 * 5 + 1 * 12


@pytest.mark.slow
def test_the_sampler_decodes_what_the_count_says():
    """`running_rows` against the sampler itself: its decode count is the steps counted, plus the
    last token's choice (the one-segment sampler of the test above: C is within one segment)."""
    plain, _ = _sampled(0)
    lengths = _lengths(plain)
    steps = len(running_rows(lengths, C))
    assert int(plain.steps) == (steps + 1 if lengths.max() == C else steps)
