"""The embedded sampler against independent references.

- Greedy KV-cache decoding equals greedy decoding by full forward passes (the whole prefix recomputed
  for every token), on left-padded prompts of different lengths.
- Sampled tokens' log-probs equal log-softmax(logits / temperature) of a full forward pass.
- Shared prefill equals per-sample prefill; a question's samples depend only on its seed; a second
  batch of the same shape compiles nothing.
- First-token frequencies match the model's softmax (and its top-k/top-p truncation): chi-square.
- EOS handling (pad after EOS, valid through EOS, early exit), top-k = 1 is greedy, a completion
  cache grown over two segments, the truncation and inverse-CDF helpers on hand-made inputs, bf16
  compute and cache.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.rollout.embedded import sampler, sampling
from cppo_jax.rollout.embedded.sampler import make_sampler, positions_from_valid
from cppo_jax.rollout.embedded.sampling import SamplingParams
from cppo_jax.rollout.embedded.segments import segment_ends

try:
    import helpers
    import reference_numpy as ref
except ImportError:  # pragma: no cover - run as a package
    from tests import helpers
    from tests import reference_numpy as ref

PROMPTS = [[5, 17, 33], [9, 200, 3, 44, 45, 46, 47], [128]]  # different lengths: left padding
P, C, G = 7, 6, 2
PAD = 0
NEVER = 257  # vocab size of the tiny model: an EOS id that never comes out
SEEDS = (11, 12, 13)
GREEDY = SamplingParams(max_new_tokens=C, temperature=0.0, eos_id=NEVER, pad_id=PAD)
SAMPLE = SamplingParams(max_new_tokens=C, temperature=0.7, eos_id=NEVER, pad_id=PAD)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def batch(prompts, seeds):
    tokens, valid, _ = helpers.left_pad(prompts, pad_id=PAD, length=P)
    return jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(seeds, jnp.uint32)


def np_log_softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=axis, keepdims=True))


def full_logits(model, tokens_BT, valid_BT) -> np.ndarray:
    """Float32 logits [B, T, V] of one full forward pass (no cache)."""
    tokens_BT, valid_BT = jnp.asarray(tokens_BT), jnp.asarray(valid_BT)
    logits, _ = helpers.forward(model, tokens_BT, positions_from_valid(valid_BT), valid_BT)
    return np.asarray(logits)


@pytest.fixture(scope="module")
def policy():
    """A tiny untied qwen2 with O(1) random weights: logits far from uniform but not one-hot."""
    model = helpers.random_model(helpers.tiny_config(tie_word_embeddings=False), seed=0)
    graphdef, state = nnx.split(model)
    return model, graphdef, state


@pytest.fixture(scope="module")
def greedy(policy):
    _, graphdef, state = policy
    return make_sampler(graphdef, 1, GREEDY)(state, *batch(PROMPTS, SEEDS))


@pytest.fixture(scope="module")
def sampled(policy):
    _, graphdef, state = policy
    return make_sampler(graphdef, G, SAMPLE)(state, *batch(PROMPTS, SEEDS))


def greedy_by_recompute(model, prompts, steps):
    """Greedy decoding that recomputes the whole window for every token: (tokens, log-probs)."""
    tokens_BP, valid_BP, _ = helpers.left_pad(prompts, pad_id=PAD, length=P)
    B = len(prompts)
    tokens_BT = np.concatenate([tokens_BP, np.full((B, steps), PAD, np.int32)], axis=1)
    valid_BT = np.concatenate([valid_BP, np.zeros((B, steps), bool)], axis=1)
    out_tokens, out_logp = [], []
    for c in range(steps):
        logp_BV = np_log_softmax(full_logits(model, tokens_BT, valid_BT)[:, P - 1 + c])
        token_B = logp_BV.argmax(axis=-1)
        tokens_BT[:, P + c], valid_BT[:, P + c] = token_B, True
        out_tokens.append(token_B)
        out_logp.append(logp_BV[np.arange(B), token_B])
    return np.stack(out_tokens, axis=1), np.stack(out_logp, axis=1)


# ---------------------------------------------------------------------------------------------
# Cached decoding against full forward passes
# ---------------------------------------------------------------------------------------------


def test_greedy_cached_decode_equals_full_recompute(policy, greedy):
    model, _, _ = policy
    ref_tokens, ref_logp = greedy_by_recompute(model, PROMPTS, C)
    np.testing.assert_array_equal(np.asarray(greedy.tokens_NC), ref_tokens)
    # temperature 0: the log-probs of the unscaled logits.
    np.testing.assert_allclose(np.asarray(greedy.logp_NC), ref_logp, atol=2e-5, rtol=0)
    assert np.asarray(greedy.valid_NC).all()
    assert not np.asarray(greedy.finished_N).any()
    assert int(greedy.steps) == C
    # Not a degenerate model: the three prompts get different continuations.
    assert len({tuple(row) for row in ref_tokens}) == len(PROMPTS)


def test_sampled_logps_equal_full_forward_log_softmax(policy, sampled):
    """The returned log-probs can serve as old-policy log-probs: log-softmax(logits / T)."""
    model, _, _ = policy
    tokens_NP, valid_NP, _ = batch(PROMPTS, SEEDS)
    tokens_NC = np.asarray(sampled.tokens_NC)
    tokens_NT = np.concatenate([np.repeat(np.asarray(tokens_NP), G, axis=0), tokens_NC], axis=1)
    valid_NT = np.concatenate(
        [np.repeat(np.asarray(valid_NP), G, axis=0), np.asarray(sampled.valid_NC)], axis=1
    )
    logits_NCV = full_logits(model, tokens_NT, valid_NT)[:, P - 1 : P + C - 1]
    logp_NCV = np_log_softmax(logits_NCV / SAMPLE.temperature)
    ref_NC = np.take_along_axis(logp_NCV, tokens_NC[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(sampled.logp_NC), ref_NC, atol=2e-5, rtol=0)
    assert np.asarray(sampled.valid_NC).all() and int(sampled.steps) == C
    assert len(np.unique(tokens_NC)) > C  # sampling, not a constant stream


def test_shared_prefill_equals_per_sample_prefill(policy, sampled):
    """One prefill per question (cache shared by its G samples) vs prompts repeated G times."""
    _, graphdef, state = policy
    tokens_QP, valid_QP, seeds_Q = batch(PROMPTS, SEEDS)
    u_NC = sampling.sequence_uniforms(seeds_Q, G, C)
    per_sample = jax.jit(
        functools.partial(sampler.sample_with_uniforms, graphdef, num_samples=1, sp=SAMPLE)
    )
    out = per_sample(state, jnp.repeat(tokens_QP, G, axis=0), jnp.repeat(valid_QP, G, axis=0), u_NC)
    np.testing.assert_array_equal(np.asarray(out.tokens_NC), np.asarray(sampled.tokens_NC))
    np.testing.assert_allclose(
        np.asarray(out.logp_NC), np.asarray(sampled.logp_NC), atol=1e-5, rtol=0
    )


# ---------------------------------------------------------------------------------------------
# Seeds, batch independence, compilation
# ---------------------------------------------------------------------------------------------


def test_same_seeds_same_samples_other_seeds_other_samples(policy, sampled):
    _, graphdef, state = policy
    fn = make_sampler(graphdef, G, SAMPLE)
    again = fn(state, *batch(PROMPTS, SEEDS))
    np.testing.assert_array_equal(np.asarray(again.tokens_NC), np.asarray(sampled.tokens_NC))
    np.testing.assert_array_equal(np.asarray(again.logp_NC), np.asarray(sampled.logp_NC))
    other = np.asarray(fn(state, *batch(PROMPTS, (21, 22, 23))).tokens_NC)
    tokens = np.asarray(sampled.tokens_NC)
    for q in range(len(PROMPTS)):  # every question's samples change with its seed
        assert (other[q * G : (q + 1) * G] != tokens[q * G : (q + 1) * G]).any()
    # The G samples of one question differ from each other.
    assert (tokens[0] != tokens[1]).any()


def test_question_samples_do_not_depend_on_batch_and_no_recompile(policy, sampled):
    """Reorder and replace questions (same shapes): nothing compiles, kept questions keep samples."""
    _, graphdef, state = policy
    fn = make_sampler(graphdef, G, SAMPLE)
    assert make_sampler(graphdef, G, SAMPLE) is fn
    args = batch([PROMPTS[2], [60, 61, 62, 63], PROMPTS[0]], (SEEDS[2], 99, SEEDS[0]))
    compiles = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = jax.block_until_ready(fn(state, *args))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [], "a second batch of the same shape compiled again"
    new, old = np.asarray(out.tokens_NC), np.asarray(sampled.tokens_NC)
    np.testing.assert_array_equal(new[0:G], old[2 * G : 3 * G])  # question 2, seed 13
    np.testing.assert_array_equal(new[2 * G : 3 * G], old[0:G])  # question 0, seed 11
    np.testing.assert_array_equal(
        np.asarray(out.logp_NC)[0:G], np.asarray(sampled.logp_NC)[2 * G : 3 * G]
    )


# ---------------------------------------------------------------------------------------------
# EOS, early exit, top-k = 1
# ---------------------------------------------------------------------------------------------


def pick_eos(tokens_BC):
    """(row, position, token): a token whose first occurrence in its row is at 1 <= position <= C-2."""
    for r, row in enumerate(tokens_BC):
        for c in range(1, C - 1):
            if row[c] != PAD and row[c] not in row[:c]:
                return r, c, int(row[c])
    raise AssertionError(f"no usable EOS candidate in {tokens_BC}")


def expected_with_eos(tokens_BC, logp_BC, eos):
    tokens, logp = tokens_BC.copy(), logp_BC.copy()
    valid = np.ones_like(tokens, bool)
    finished = np.zeros(len(tokens), bool)
    for r, row in enumerate(tokens_BC):
        hits = np.flatnonzero(np.isin(row, eos))  # eos: one id or several
        if hits.size:
            e = hits[0]
            tokens[r, e + 1 :], logp[r, e + 1 :], valid[r, e + 1 :] = PAD, 0.0, False
            finished[r] = True
    return tokens, logp, valid, finished


def test_eos_stops_sequences_and_top_k_1_is_greedy(policy, greedy):
    """Sampling with top-k = 1 (temperature 1) decodes greedily; EOS ends a sequence and, once
    every sequence has ended, the loop. Expected outputs come from the greedy run without EOS
    (one segment of C slots); this run grows its completion cache from 2 to C slots on the way."""
    _, graphdef, state = policy
    g_tokens, g_logp = np.asarray(greedy.tokens_NC), np.asarray(greedy.logp_NC)
    row, pos, eos = pick_eos(g_tokens)
    sp = SamplingParams(
        max_new_tokens=C, temperature=1.0, top_k=1, eos_id=eos, pad_id=PAD, segment_len=2
    )
    assert segment_ends(C, sp.segment_len) == [2, C]
    fn = make_sampler(graphdef, 1, sp)

    out = fn(state, *batch(PROMPTS, (1, 2, 3)))
    tokens, logp, valid, finished = expected_with_eos(g_tokens, g_logp, eos)
    np.testing.assert_array_equal(np.asarray(out.tokens_NC), tokens)
    np.testing.assert_array_equal(np.asarray(out.valid_NC), valid)
    np.testing.assert_array_equal(np.asarray(out.finished_N), finished)
    # temperature 1: the log-probs equal the greedy run's (log-softmax of the raw logits).
    np.testing.assert_allclose(np.asarray(out.logp_NC), logp, atol=2e-5, rtol=0)
    assert int(out.steps) == (int(valid.sum(1).max()) if finished.all() else C)

    # Every row runs into EOS at `pos`: the loop stops after pos + 1 positions.
    same = fn(state, *batch([PROMPTS[row]] * 3, (4, 5, 6)))
    assert int(same.steps) == pos + 1 < C
    assert np.asarray(same.finished_N).all()
    expect_row = np.where(np.arange(C) <= pos, g_tokens[row], PAD)
    np.testing.assert_array_equal(np.asarray(same.tokens_NC), np.tile(expect_row, (3, 1)))
    np.testing.assert_array_equal(np.asarray(same.valid_NC), np.tile(np.arange(C) <= pos, (3, 1)))
    assert (np.asarray(same.logp_NC)[:, pos + 1 :] == 0).all()


def test_a_row_ends_at_the_first_of_several_eos_ids(policy, greedy):
    """Two end ids (Qwen2.5's <|im_end|> and <|endoftext|>, Llama 3's <|eot_id|> and
    <|end_of_text|>): the first never comes out here, the second ends some rows; the rows it ends
    stop there, the others run to C, and the valid mask (hence the reward text) follows."""
    _, graphdef, state = policy
    g_tokens, g_logp = np.asarray(greedy.tokens_NC), np.asarray(greedy.logp_NC)
    # The second id: a token some greedy rows produce and others do not.
    second = next(
        int(t)
        for t in np.unique(g_tokens)
        if t != PAD and 0 < np.isin(g_tokens, t).any(axis=1).sum() < len(g_tokens)
    )
    eos = (NEVER, second)
    sp = SamplingParams(max_new_tokens=C, temperature=0.0, eos_id=eos, pad_id=PAD)
    assert sp.eos_id == eos
    out = make_sampler(graphdef, 1, sp)(state, *batch(PROMPTS, SEEDS))
    tokens, logp, valid, finished = expected_with_eos(g_tokens, g_logp, eos)
    assert finished.any() and not finished.all()  # the second id ends some rows, not all
    np.testing.assert_array_equal(np.asarray(out.tokens_NC), tokens)
    np.testing.assert_array_equal(np.asarray(out.valid_NC), valid)
    np.testing.assert_array_equal(np.asarray(out.finished_N), finished)
    # Same program up to the stop test: log-probs agree to float32 rounding, 0 after the end.
    np.testing.assert_allclose(
        np.asarray(out.logp_NC), logp, rtol=16 * np.finfo(np.float32).eps, atol=0
    )
    # A one-id list misses those ends: the rows run on (the bug of a single eos id).
    only_first = make_sampler(graphdef, 1, dataclasses.replace(sp, eos_id=NEVER))
    assert not np.asarray(only_first(state, *batch(PROMPTS, SEEDS)).finished_N).any()
    # The vLLM backend, given these completions as a server returns them, marks the same tokens.
    np.testing.assert_array_equal(_as_served(out, sp), np.asarray(out.valid_NC))


def _as_served(samples, sp):
    """valid_NC of the vLLM backend's `samples_from_completions` on the rows of `samples`, each
    cut to its valid tokens (what a server sends back, with "stop" or "length"), no server."""
    from cppo_jax.rollout.vllm.backend import samples_from_completions
    from cppo_jax.rollout.vllm.client import Completion

    tokens_NC, valid_NC = np.asarray(samples.tokens_NC), np.asarray(samples.valid_NC)
    finished_N = np.asarray(samples.finished_N)
    groups = [
        [
            Completion(
                tuple(int(t) for t in row[ok]), (0.0,) * int(ok.sum()), "stop" if f else "length"
            )
        ]
        for row, ok, f in zip(tokens_NC, valid_NC, finished_N)
    ]
    served = samples_from_completions(groups, 1, sp)
    np.testing.assert_array_equal(np.asarray(served.tokens_NC), tokens_NC)
    np.testing.assert_array_equal(np.asarray(served.finished_N), finished_N)
    return np.asarray(served.valid_NC)


QWEN_ENDS = (151645, 151643)  # <|im_end|>, <|endoftext|>: Qwen2.5's two end ids


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_completion_ends_edge_cases(xp):
    im_end, text_end = QWEN_ENDS
    tokens_NC = np.asarray(
        [
            [im_end, 5, 6, 7, 8],  # end id first: only it is valid
            [5, 6, 7, 8, im_end],  # last
            [5, 6, 7, 8, 9],  # absent: all valid, truncated
            [5, im_end, 6, im_end, im_end],  # several: the first ends it
            [5, text_end, im_end, 6, 7],  # the other of two stop ids ends it too
            [
                5,
                6,
                im_end,
                text_end,
                text_end,
            ],  # padded with an end id (Qwen pads with <|endoftext|>)
        ],
        np.int32,
    )
    valid_NC, finished_N = sampling.completion_ends(xp.asarray(tokens_NC), QWEN_ENDS, xp=xp)
    np.testing.assert_array_equal(np.asarray(valid_NC).sum(1), [1, 5, 5, 2, 2, 3])
    np.testing.assert_array_equal(finished_N, [True, True, False, True, True, True])
    assert isinstance(valid_NC, np.ndarray) == (xp is np)  # host code stays on the host
    # One id (an int or a 1-tuple): the other stop id is an ordinary token.
    for one in (im_end, (im_end,)):
        valid_NC, finished_N = sampling.completion_ends(xp.asarray(tokens_NC), one, xp=xp)
        np.testing.assert_array_equal(np.asarray(valid_NC).sum(1), [1, 5, 5, 2, 3, 3])
        np.testing.assert_array_equal(finished_N, [True, True, False, True, True, True])
    # With lengths, positions past a row's length are padding even when they hold an end id.
    length_N = np.asarray([5, 4, 3, 1, 0, 2])
    valid_NC, finished_N = sampling.completion_ends(
        xp.asarray(tokens_NC), QWEN_ENDS, xp.asarray(length_N), xp=xp
    )
    np.testing.assert_array_equal(np.asarray(valid_NC).sum(1), [1, 4, 3, 1, 0, 2])
    np.testing.assert_array_equal(finished_N, [True, False, False, False, False, False])
    np.testing.assert_array_equal(
        np.asarray(valid_NC)[1], [True, True, True, True, False]
    )  # valid is a prefix of each row


@pytest.mark.parametrize("seed", range(6))
def test_completion_ends_numpy_equals_jit_equals_reference(seed):
    """The same function on NumPy (the vLLM backend's host code) and in jit (the embedded
    sampler) gives the reference's masks on random rows, end ids common, several, or absent."""
    gen = np.random.default_rng(seed)
    N, C = 7, 11
    ends = [3, (3,), (4, 3), (151645, 151643)][seed % 4]
    pool = np.asarray([1, 2, 3, 4, 151645, 151643, 9], np.int32)
    tokens_NC = pool[gen.integers(0, len(pool), size=(N, C))]
    for length_N in (None, gen.integers(0, C + 1, size=N)):
        want = ref.completion_ends(tokens_NC, ends, length_N)
        got_np = sampling.completion_ends(tokens_NC, ends, length_N, xp=np)
        got_jit = jax.jit(lambda t, n: sampling.completion_ends(t, ends, n, xp=jnp))(
            jnp.asarray(tokens_NC), None if length_N is None else jnp.asarray(length_N)
        )
        for w, a, b in zip(want, got_np, got_jit):
            np.testing.assert_array_equal(a, w)
            np.testing.assert_array_equal(np.asarray(b), w)


def test_both_backends_mark_the_same_tokens_on_random_rows():
    """Sampler-style rows (pad_id after the first end id) and the same completions as a vLLM server
    returns them (cut after the end id; "stop" or "length") get the same valid_NC and finished_N,
    with the pad id itself an end id (Qwen's <|endoftext|>)."""
    gen = np.random.default_rng(0)
    N, C = 9, 8
    sp = SamplingParams(max_new_tokens=C, eos_id=QWEN_ENDS, pad_id=QWEN_ENDS[1])
    pool = np.asarray([5, 6, 7, 8, *QWEN_ENDS], np.int32)
    tokens_NC = pool[gen.integers(0, len(pool), size=(N, C))]
    tokens_NC[0] = 5  # one row with no end id
    valid_NC, finished_N = sampling.completion_ends(tokens_NC, sp.eos_id)
    tokens_NC = np.where(valid_NC, tokens_NC, sp.pad_id)  # as the sampler pads
    assert finished_N.any() and not finished_N.all()
    samples = sampling.Samples(tokens_NC, np.zeros((N, C)), valid_NC, finished_N)
    np.testing.assert_array_equal(_as_served(samples, sp), valid_NC)


def test_eos_id_forms():
    assert SamplingParams(max_new_tokens=2, eos_id=7).eos_id == (7,)
    for bad in ((), (3, -1), ("2",), 2.5):
        with pytest.raises(ValueError, match="eos_id"):
            SamplingParams(max_new_tokens=2, eos_id=bad)


# ---------------------------------------------------------------------------------------------
# Token choice helpers
# ---------------------------------------------------------------------------------------------

_truncate = sampling._truncate  # eager: small per-primitive compiles, shared by all cases


def kept(logits, top_k=0, top_p=1.0):
    out = np.asarray(_truncate(jnp.asarray([logits], jnp.float32), top_k, top_p))[0]
    return sorted(np.flatnonzero(out > -np.inf).tolist())


def test_truncate_top_k_keeps_ties():
    assert kept([1.0, 3.0, 2.0, 0.0], top_k=2) == [1, 2]
    assert kept([1.0, 3.0, 3.0, 0.0], top_k=2) == [1, 2]
    assert kept([1.0, 3.0, 2.0, 2.0], top_k=2) == [1, 2, 3]  # tie at the k-th value: both kept
    assert kept([1.0, 3.0, 2.0, 0.0], top_k=1) == [1]
    assert kept([1.0, 3.0, 2.0, 0.0], top_k=4) == [0, 1, 2, 3]
    assert kept([1.0, 3.0, 2.0, 0.0]) == [0, 1, 2, 3]
    # Kept logits keep their values.
    out = np.asarray(_truncate(jnp.asarray([[1.0, 3.0, 2.0, 0.0]]), 2, 1.0))[0]
    np.testing.assert_array_equal(out, [-np.inf, 3.0, 2.0, -np.inf])


def test_truncate_top_p_keeps_the_smallest_nucleus():
    probs = np.array([0.05, 0.5, 0.15, 0.3])  # order: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = np.log(probs)
    assert kept(logits, top_p=0.4) == [1]  # 0.5 >= 0.4 already
    assert kept(logits, top_p=0.7) == [1, 3]  # 0.5 < 0.7 <= 0.8
    assert kept(logits, top_p=0.9) == [1, 2, 3]  # 0.8 < 0.9 <= 0.95
    assert kept(logits, top_p=0.99) == [0, 1, 2, 3]
    # Ties at the cut are all kept: {0.4, one of the 0.2s} reaches 0.5; the tied 0.2s stay.
    assert kept(np.log([0.2, 0.4, 0.2, 0.2]), top_p=0.5) == [0, 1, 2, 3]
    assert kept(np.log([0.1, 0.4, 0.25, 0.25]), top_p=0.3) == [1]
    # top-k first, then the nucleus of the renormalised top-k: {0.5, 0.3} -> 0.625, 0.375.
    assert kept(logits, top_k=2, top_p=0.6) == [1]
    assert kept(logits, top_k=2, top_p=0.7) == [1, 3]
    # Row by row, independent of position in the vocabulary.
    rows = jnp.asarray(np.stack([logits, logits[::-1]]), jnp.float32)
    out = np.asarray(_truncate(rows, 0, 0.7)) > -np.inf
    np.testing.assert_array_equal(out[0], out[1][::-1])


def test_truncate_matches_a_sorting_reference_on_random_rows_with_ties():
    rng = np.random.default_rng(5)
    logits = np.round(rng.standard_normal((64, 37)) * 2, 1)  # rounding makes ties common
    logits[:8, :5] = -np.inf  # tokens already masked
    logits[8:16] += 50.0  # large positive logits
    for top_k, top_p in ((5, 1.0), (0, 0.7), (7, 0.5), (1, 0.9), (0, 0.999)):
        want = np.stack([np_truncated_probs(row, top_k, top_p) > 0 for row in logits])
        # Both methods (`sampling.TRUNCATION`): the bit search CPUs use, the sort accelerators use.
        for method in ("bits", "sort"):
            fn = functools.partial(sampling._truncate, top_k=top_k, top_p=top_p, method=method)
            got = np.asarray(jax.jit(fn)(jnp.asarray(logits, jnp.float32))) > -np.inf
            np.testing.assert_array_equal(got, want, err_msg=f"{method} {top_k=} {top_p=}")


def test_truncation_is_the_bit_search_on_cpu_and_the_sort_elsewhere():
    assert sampling.TRUNCATION.get("cpu") == "bits"
    assert all(sampling.TRUNCATION.get(p, "sort") == "sort" for p in ("gpu", "cuda", "tpu"))
    with pytest.raises(ValueError, match="'bits' or 'sort'"):
        sampling._truncate(jnp.zeros((1, 4)), 2, 1.0, method="heap")


def test_both_truncations_agree_on_wide_random_rows():
    """At a vocabulary's width (4,096 ids, 32 rows of N(0, 3) logits, float32 sums over the whole
    row): the same kept set by both methods for top-k, top-p and both."""
    rng = np.random.default_rng(8)
    logits = jnp.asarray(rng.standard_normal((32, 4096)) * 3, jnp.float32)
    for top_k, top_p in ((50, 1.0), (0, 0.95), (200, 0.9)):
        bits, sort = (
            np.asarray(sampling._truncate(logits, top_k, top_p, method=m)) > -np.inf
            for m in ("bits", "sort")
        )
        np.testing.assert_array_equal(bits, sort, err_msg=f"{top_k=} {top_p=}")


def test_order_keys_sort_like_the_floats():
    x = np.array([-np.inf, -1e30, -2.5, -1e-30, 0.0, 1e-30, 0.5, 3.0, 1e30, np.inf], np.float32)
    keys = np.asarray(sampling._order_keys(jnp.asarray(x[::-1])))[::-1]
    assert (np.diff(keys.astype(np.int64)) > 0).all()


def test_inverse_cdf_never_picks_zero_weights_and_handles_the_edges():
    # V = 10: blocks of 4 (last one padded); weights in several blocks, zeros in between.
    w = np.array([0, 1, 0, 0, 0, 0, 3, 0, 0, 0], np.float32)  # cdf 1/4 at index 1, 1 at index 6
    cases = [(0.0, 1), (0.2499, 1), (0.25, 6), (0.7, 6), (np.nextafter(1.0, 0.0), 6)]
    w_tail = np.array([2, 0, 0, 0, 0, 0, 0, 0, 0, 1], np.float32)  # cdf 2/3 at 0, 1 at 9
    cases_tail = [(0.0, 0), (0.66, 0), (0.67, 9), (np.nextafter(1.0, 0.0), 9)]
    rows = [w] * len(cases) + [w_tail] * len(cases_tail)
    u = [c[0] for c in cases + cases_tail]
    fn = jax.jit(sampling._inverse_cdf)
    got = np.asarray(fn(jnp.asarray(np.stack(rows)), jnp.asarray(u, jnp.float32)))
    np.testing.assert_array_equal(got, [c[1] for c in cases + cases_tail])
    # Uniform u over a grid lands on each index in proportion to its weight.
    rng = np.random.default_rng(0)
    w_many = rng.random(37).astype(np.float32) * (rng.random(37) > 0.3)
    grid = (np.arange(3700) + 0.5) / 3700
    got = np.asarray(fn(jnp.asarray(np.tile(w_many, (3700, 1))), jnp.asarray(grid, jnp.float32)))
    counts = np.bincount(got, minlength=37)
    assert (counts[w_many == 0] == 0).all()
    np.testing.assert_allclose(counts / 3700, w_many / w_many.sum(), atol=2 / 3700)


def test_choose_top_k_1_is_argmax_with_tempered_logp():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(3 * rng.standard_normal((16, 37)), jnp.float32)
    u = jnp.asarray(rng.random(16), jnp.float32)
    argmax = np.asarray(logits).argmax(-1)
    sp = SamplingParams(max_new_tokens=1, temperature=0.5, top_k=1)
    token, logp = jax.jit(functools.partial(sampling.choose, sp=sp))(logits, u)
    np.testing.assert_array_equal(np.asarray(token), argmax)
    ref = np_log_softmax(np.asarray(logits) / 0.5)[np.arange(16), argmax]
    np.testing.assert_allclose(np.asarray(logp), ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Distribution: chi-square on the first token
# ---------------------------------------------------------------------------------------------


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper 1e-4 point of chi-square(df) (Wilson-Hilferty; z is the normal 1e-4 point)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(counts, probs) -> tuple[float, int]:
    """Pearson's statistic with bins of expected count < 5 pooled; (statistic, degrees of freedom)."""
    n = counts.sum()
    expected = n * probs
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def np_truncated_probs(logits, top_k, top_p):
    """Reference top-k then top-p (ties at each cut kept), renormalised."""
    order = np.argsort(-logits, kind="stable")
    keep = np.ones_like(logits, bool)
    if top_k:
        keep &= logits >= logits[order[top_k - 1]]
    p = np.where(keep, np.exp(logits - logits.max()), 0.0)
    p /= p.sum()
    srt = np.sort(p)[::-1]
    mass_before = np.cumsum(srt) - srt
    cutoff = srt[mass_before < top_p].min()
    p = np.where(p >= cutoff, p, 0.0)
    return p / p.sum()


@pytest.fixture(scope="module")
def small_vocab():
    """A tiny model over 11 tokens, one prompt, and the reference first-token logits."""
    model = helpers.random_model(
        helpers.tiny_config(vocab_size=11, tie_word_embeddings=False), seed=3
    )
    tokens, valid, _ = helpers.left_pad([[3, 1, 4, 1, 5]], pad_id=PAD)
    logits = full_logits(model, tokens, valid)[0, -1].astype(np.float64)
    return model, (jnp.asarray(tokens), jnp.asarray(valid)), logits


def check_frequencies(tokens_N, logp_N, logits_V, temperature, top_k=0, top_p=1.0):
    counts = np.bincount(tokens_N, minlength=len(logits_V))
    probs = np_truncated_probs(logits_V / temperature, top_k, top_p)
    assert (counts[probs == 0] == 0).all(), "a truncated token was sampled"
    assert (probs > 0).sum() >= 3, "the test needs a spread-out distribution"
    stat, df = chi2_statistic(counts[probs > 0], probs[probs > 0])
    assert stat < chi2_critical(df), (stat, df, counts, np.round(len(tokens_N) * probs, 1))
    # Power: the same counts reject a nearby wrong distribution (temperature off by 40%).
    wrong = np_truncated_probs(logits_V / (1.4 * temperature), top_k, top_p)
    assert chi2_statistic(counts[probs > 0], wrong[probs > 0])[0] > chi2_critical(df)
    # The log-probs are those of the untruncated softmax(logits / T).
    ref = np_log_softmax(logits_V / temperature)[tokens_N]
    np.testing.assert_allclose(logp_N, ref, atol=1e-5, rtol=0)


def test_first_token_frequencies_match_softmax(small_vocab):
    """4000 samples of one question through the whole sampler (seeded random numbers included)."""
    model, (tokens, valid), logits = small_vocab
    sp = SamplingParams(max_new_tokens=1, temperature=1.0)
    graphdef, state = nnx.split(model)
    out = make_sampler(graphdef, 4000, sp)(state, tokens, valid, jnp.asarray([2024], jnp.uint32))
    check_frequencies(
        np.asarray(out.tokens_NC)[:, 0], np.asarray(out.logp_NC)[:, 0], logits, sp.temperature
    )


def test_truncated_frequencies_match_truncated_softmax(small_vocab):
    """temperature, top-k and top-p together: the token choice on the same logits, 4000 times."""
    _, _, logits = small_vocab
    sp = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=5, top_p=0.8)
    n = 4000
    logits_NV = jnp.asarray(np.tile(logits, (n, 1)), jnp.float32)
    u_N = jnp.asarray(np.random.default_rng(7).random(n), jnp.float32)
    token_N, logp_N = jax.jit(functools.partial(sampling.choose, sp=sp))(logits_NV, u_N)
    check_frequencies(
        np.asarray(token_N), np.asarray(logp_N), logits, sp.temperature, sp.top_k, sp.top_p
    )


# ---------------------------------------------------------------------------------------------
# bf16, parameters
# ---------------------------------------------------------------------------------------------


def test_bf16_compute_and_cache_stay_close_to_fp32_greedy(greedy):
    cfg = helpers.tiny_config(tie_word_embeddings=False, dtype="bfloat16")
    graphdef, state = nnx.split(helpers.random_model(cfg, seed=0))  # the fp32 policy's weights
    sp = SamplingParams(
        max_new_tokens=3, temperature=0.0, eos_id=NEVER, pad_id=PAD, cache_dtype="bfloat16"
    )
    out = make_sampler(graphdef, 1, sp)(state, *batch(PROMPTS, SEEDS))
    tokens, ref = np.asarray(out.tokens_NC), np.asarray(greedy.tokens_NC)[:, :3]
    assert out.tokens_NC.dtype == jnp.int32 and out.logp_NC.dtype == jnp.float32
    np.testing.assert_array_equal(tokens[:, 0], ref[:, 0])
    assert (tokens == ref).mean() >= 2 / 3
    np.testing.assert_allclose(
        np.asarray(out.logp_NC)[:, 0], np.asarray(greedy.logp_NC)[:, 0], atol=0.1
    )


@pytest.mark.parametrize(
    "kwargs,culprit",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"cache_dtype": "float16"}, "cache_dtype"),
        ({"segment_len": -2}, "segment_len"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        SamplingParams(**{"max_new_tokens": 4, **kwargs})


def test_segment_ends():
    assert segment_ends(40, 64) == [40]
    assert segment_ends(256, 64) == [64, 128, 256]
    assert segment_ends(130, 64) == [64, 130]
    assert segment_ends(6, 2) == [2, 6]
    assert segment_ends(6, 1) == [1, 2, 6]
    assert segment_ends(6, 0) == [6]
