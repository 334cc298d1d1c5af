"""The embedded JAX sampler: one shared prompt prefill per question, then batched KV-cache decode.

Q questions, G samples each, N = Q * G sequences (row q * G + j is sample j of question q); P prompt
slots (left-padded), C new tokens.

1. Prefill the Q prompts once (`Transformer.hidden` with a P-slot cache).
2. Decode in bounded `lax.while_loop`s that stop when every sequence has emitted EOS or C tokens.
   The prompt keys/values stay one copy per question: each decode step's attention reads them once
   for all G samples (shared-prefix attention) and reads the G completions' own keys/values from a
   separate completion cache, written in place. No G-fold prompt recompute and no G-fold prompt
   cache. The completion cache grows by segments (`SamplingParams.segment_len`) so that attention
   reads about the slots in use rather than all C.
   With `SamplingParams.compact` (`rollout.compact`), once the rows still running fit a loop of
   fewer rows (`segments.compact_buckets`: 0.6 of the last, down to one), they are gathered into
   it, each with its own completion cache (the full C slots) and its question's prompt cache, and
   decode on there (`_compacted`); the ended rows are not decoded any more. Every row keeps its own
   random numbers, so the tokens are the ones drawn without compaction.
3. The last position is sampled without a forward pass.

Randomness: token t of sample j of question q is drawn by inverse CDF from one uniform number,
u[q * G + j, t], and question q's numbers come from `PRNGKey(seed_q)` alone (`sequence_uniforms`),
so a question's samples depend only on its seed and prompt, never on the other questions in the
batch. All numbers are drawn before the loop: no per-step key derivation, no V random numbers per
token.

On a mesh the program declares its shardings (`make_sampler(..., mesh=)`): the params as they lie
(split by `sharding.RULES`), the prompts split by rows, and the samples returned split by rows (the
decode count replicated). It is traced without the training step's activation rules
(`sharding.use_mesh`), which would split the decode's rows over fsdp and so gather weights per token:
left to itself the compiler keeps the weights in place and moves the (small) activations (docs/aot.md,
"The embedded sampler on a sharded mesh"; checked in tests/test_aot.py). The logits are computed and
drawn split by vocabulary over fsdp x tensor (`vocab_split`, `sampling.choose_split`): one copy of the
unembedding laid out by vocabulary per rollout, no [N, V] sum per token.

Returns the sampled tokens, their log-probabilities under the sampling distribution (log-softmax of
logits / temperature, before top-k/top-p truncation: the old-policy log-probs when mu = 1), which
tokens are valid (up to and including EOS), whether each sequence stopped on EOS, and how many
positions were decoded before every sequence stopped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cppo_jax.models import init_cache
from cppo_jax.models.attention import MASKED
from cppo_jax.models.transformer import (
    DTYPES,
    per_layer,
    rope_tables,
    run_layers,
    scale_embeddings,
    unembed,
)
from cppo_jax.observe.profile import KEPT_PROGRAMS
from cppo_jax.rollout.embedded.sampling import (
    TRUNCATION,
    Samples,
    SamplingParams,
    VocabSplit,
    choose,
    choose_split,
    completion_ends,
    is_end_id,
    sequence_uniforms,
)
from cppo_jax.rollout.embedded.segments import compact_buckets, segment_ends


def positions_from_valid(valid_BT: jax.Array) -> jax.Array:
    """RoPE positions of left-padded rows: 0 at the first real token."""
    return jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=-1) - 1, 0)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def _decode_layers(model):
    """The stacked decoder layers with params in the compute dtype, cast once outside the loop."""
    dt = model.cfg.compute_dtype
    graphdef, state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dt), state))


def _decode_step(
    model, layers, prompt_kv, prompt_valid_QP, kv, token_N, t, rope_QE, local_rope_QE, w_DV=None
):
    """One token per sequence through the model at completion slot t: logits [N, V] and the cache.

    w_DV: the unembedding to use (`vocab_split`'s copy laid out by vocabulary), None: the model's.

    rope_QE: the (cos, sin) [Q, E] of this token's position; local_rope_QE the local layers' (Gemma
    3's sliding-window layers, which also see only the last `sliding_window` slots: a mask over the
    static prompt and completion slots), None without them.

    prompt_kv: (k, v) [L, Q, J, P, E], one copy per question; kv: keys [L, Q, J, G, E, C] and values
    [L, Q, J, G, C, E], the completions so far. The layer math is the model's own (`Attention.qkv`,
    `Attention.out`, `DecoderLayer.mlp_residual`, with the G samples of a question as its tokens);
    only attention differs from `Transformer.hidden`: it splits into the shared prompt part and the
    per-sample completion part.
    """
    cfg = model.cfg
    dt = cfg.compute_dtype
    kp_LQJPE, vp_LQJPE = prompt_kv
    kc_LQJGEC, vc_LQJGCE = kv
    cd = kc_LQJGEC.dtype
    _, Q, J, G, E, C = kc_LQJGEC.shape
    H = cfg.num_heads
    R = H // J
    scale = cfg.attn_scale
    f32 = jnp.float32
    x_QGD = jnp.take(model.embed_VD[...], token_N.reshape(Q, G), axis=0, mode="clip")
    x_QGD = scale_embeddings(x_QGD, cfg).astype(dt)
    prompt_mask_QJGRP = prompt_valid_QP[:, None, None, None, :]
    slot_mask_C = jnp.arange(C) <= t
    full = (prompt_mask_QJGRP, slot_mask_C, *(x[:, None] for x in rope_QE))
    local = None
    if local_rope_QE is not None:  # this token sits at slot P + t: the window from P + t - W + 1
        P, W = prompt_valid_QP.shape[1], cfg.sliding_window
        local = (
            prompt_mask_QJGRP & (jnp.arange(P) > P + t - W),
            slot_mask_C & (jnp.arange(C) > t - W),
            *(x[:, None] for x in local_rope_QE),
        )
    layer_at = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, 0, False)  # noqa: E731

    def layer_fn(layer, i, carry):
        x_QGD, kc_LQJGEC, vc_LQJGCE = carry
        prompt_mask_QJGRP, slot_mask_C, cos_Q1E, sin_Q1E = per_layer(cfg, i, local, full)
        q_QGHE, k_QGJE, v_QGJE = layer.attn.qkv(layer.attn_norm(x_QGD), cos_Q1E, sin_Q1E)
        zero = jnp.zeros((), jnp.int32)
        kc_LQJGEC = jax.lax.dynamic_update_slice(
            kc_LQJGEC,
            k_QGJE.transpose(0, 2, 1, 3)[None, ..., None].astype(cd),
            (i, zero, zero, zero, zero, t),
        )
        vc_LQJGCE = jax.lax.dynamic_update_slice(
            vc_LQJGCE,
            v_QGJE.transpose(0, 2, 1, 3)[None, :, :, :, None].astype(cd),
            (i, zero, zero, zero, t, zero),
        )
        kp_QJPE, vp_QJPE = layer_at(kp_LQJPE, i), layer_at(vp_LQJPE, i)
        kc_QJGEC, vc_QJGCE = layer_at(kc_LQJGEC, i), layer_at(vc_LQJGCE, i)

        q_QJGRE = q_QGHE.reshape(Q, G, J, R, E).transpose(0, 2, 1, 3, 4).astype(cd)
        sp_QJGRP = (
            jnp.einsum("qjgre,qjpe->qjgrp", q_QJGRE, kp_QJPE, preferred_element_type=f32) * scale
        )
        sc_QJGRC = (
            jnp.einsum("qjgre,qjgec->qjgrc", q_QJGRE, kc_QJGEC, preferred_element_type=f32) * scale
        )
        sp_QJGRP = jnp.where(prompt_mask_QJGRP, sp_QJGRP, MASKED)
        sc_QJGRC = jnp.where(slot_mask_C, sc_QJGRC, MASKED)
        max_QJGR1 = jnp.maximum(
            jnp.max(sp_QJGRP, axis=-1, keepdims=True), jnp.max(sc_QJGRC, axis=-1, keepdims=True)
        )
        ep_QJGRP = jnp.exp(sp_QJGRP - max_QJGR1)
        ec_QJGRC = jnp.exp(sc_QJGRC - max_QJGR1)
        total_QJGR1 = jnp.sum(ep_QJGRP, axis=-1, keepdims=True) + jnp.sum(
            ec_QJGRC, axis=-1, keepdims=True
        )
        o_QJGRE = jnp.einsum(
            "qjgrp,qjpe->qjgre", ep_QJGRP.astype(cd), vp_QJPE, preferred_element_type=f32
        ) + jnp.einsum(
            "qjgrc,qjgce->qjgre", ec_QJGRC.astype(cd), vc_QJGCE, preferred_element_type=f32
        )
        o_QJGRE = (o_QJGRE / total_QJGR1).astype(dt)
        o_QGHE = o_QJGRE.transpose(0, 2, 1, 3, 4).reshape(Q, G, H, E)
        x_QGD = layer.mlp_residual(layer.attn_residual(x_QGD, layer.attn.out(o_QGHE)))
        return x_QGD, kc_LQJGEC, vc_LQJGCE

    x_QGD, kc_LQJGEC, vc_LQJGCE = run_layers(cfg, layers, layer_fn, (x_QGD, kc_LQJGEC, vc_LQJGCE))
    h_ND = model.final_norm(x_QGD).reshape(Q * G, -1)
    w_DV = model.unembed_weight() if w_DV is None else w_DV
    return unembed(h_ND, w_DV), (kc_LQJGEC, vc_LQJGCE)


def _empty_kv(Q, J, G, C, E, dtype, num_layers):
    """Keys [L, Q, J, G, E, C] (slots last, for the score matmul), values [L, Q, J, G, C, E]."""
    L = num_layers
    return jnp.zeros((L, Q, J, G, E, C), dtype), jnp.zeros((L, Q, J, G, C, E), dtype)


def _grow_kv(kv, slots: int):
    """The completion cache padded with empty slots to `slots`."""

    def grow(x, axis):
        pad = [(0, slots - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)]
        return jnp.pad(x, pad)

    k, v = kv
    return grow(k, 5), grow(v, 4)


def _compacted(
    carry, buckets, body_over, running, u_NC, prompt_kv, prompt_valid_QP, first_pos_Q, G
):
    """The decode after the first loop, in ever smaller buckets of rows (`compact_buckets`): the
    rows still running are gathered, in row order, into the next bucket (the ended ones fill it
    up), the cache of each bucket row taken from the last, its prompt's keys and values from its
    question's; each bucket decodes until the running rows fit the next. Tokens, log-probs, the
    last logits and the ended flags go back to their rows after each bucket, so that the result
    is laid out, and drawn from the same numbers, as without compaction."""
    t, (k, v), logits_NV, tokens_NC, logp_NC, done_N, row_steps = carry
    L, Q, J, _, E, C = k.shape
    N = Q * G
    # The cache by rows: keys [L, N, J, 1, E, C], values [L, N, J, 1, C, E] (one sample each).
    k_B = k.transpose(0, 1, 3, 2, 4, 5).reshape(L, N, J, 1, E, C)
    v_B = v.transpose(0, 1, 3, 2, 4, 5).reshape(L, N, J, 1, C, E)
    rows_B, done_B = jnp.arange(N, dtype=jnp.int32), done_N
    kp_LQJPE, vp_LQJPE = prompt_kv
    for i, B in enumerate(buckets[1:], start=1):
        order = jnp.argsort(done_B, stable=True)[:B]  # running rows first, in row order
        rows_B = rows_B[order]
        k_B, v_B = jnp.take(k_B, order, axis=1), jnp.take(v_B, order, axis=1)
        q_B = rows_B // G
        body = body_over(
            u_NC[rows_B],
            (jnp.take(kp_LQJPE, q_B, axis=1), jnp.take(vp_LQJPE, q_B, axis=1)),
            prompt_valid_QP[q_B],
            first_pos_Q[q_B],
        )
        fewer = buckets[i + 1] if i + 1 < len(buckets) else 0
        state = (
            t,
            (k_B, v_B),
            logits_NV[rows_B],
            tokens_NC[rows_B],
            logp_NC[rows_B],
            done_N[rows_B],
            row_steps,
        )
        cond = lambda c, fewer=fewer: (c[0] < C - 1) & running(c[5], fewer)  # noqa: E731
        t, (k_B, v_B), logits_BV, tokens_BC, logp_BC, done_B, row_steps = jax.lax.while_loop(
            cond, body, state
        )
        logits_NV = logits_NV.at[rows_B].set(logits_BV)
        tokens_NC = tokens_NC.at[rows_B].set(tokens_BC)
        logp_NC = logp_NC.at[rows_B].set(logp_BC)
        done_N = done_N.at[rows_B].set(done_B)
    return t, (k_B, v_B), logits_NV, tokens_NC, logp_NC, done_N, row_steps


def sample_with_uniforms(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_QP: jax.Array,
    prompt_valid_QP: jax.Array,
    u_NC: jax.Array | None,
    *,
    num_samples: int,
    sp: SamplingParams,
    split: VocabSplit | None = None,
) -> Samples:
    """`sample` driven by explicit random numbers u [Q * G, C] (see `sequence_uniforms`).

    Row q * G + j is sample j of question q. `u_NC` may be None for greedy decoding. With `split`
    (`vocab_split`), the logits are computed and sampled split by vocabulary.
    """
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    Q, P = prompt_QP.shape
    G, C = num_samples, sp.max_new_tokens
    N = Q * G
    J, E = cfg.num_kv_heads, cfg.head_dim
    cd = DTYPES[sp.cache_dtype]
    if u_NC is None:
        if sp.temperature != 0.0:
            raise ValueError("u_NC: sampling with temperature > 0 needs random numbers")
        u_NC = jnp.zeros((N, C), jnp.float32)
    if u_NC.shape != (N, C):
        raise ValueError(f"u_NC: shape {u_NC.shape}, expected {(N, C)} ({Q} prompts x {G} samples)")

    # 1. Prefill: one pass over the Q prompts into a P-slot cache.
    prompt_valid_QP = prompt_valid_QP.astype(jnp.bool_)
    pos_QP = positions_from_valid(prompt_valid_QP)
    h_QPD, cache = model.hidden(prompt_QP, pos_QP, prompt_valid_QP, cache=init_cache(cfg, Q, P, cd))
    w_DV, pick = None, functools.partial(choose, sp=sp)
    if split is not None:  # one copy of the unembedding by vocabulary, padded, for the rollout
        w_DV = model.unembed_weight().astype(cfg.compute_dtype)
        V = w_DV.shape[1]
        if split.padded(V) > V:
            w_DV = jnp.pad(w_DV, ((0, 0), (0, split.padded(V) - V)))
        w_DV = jax.lax.with_sharding_constraint(
            w_DV,
            jax.sharding.NamedSharding(split.mesh, jax.sharding.PartitionSpec(None, split.axes)),
        )
        pick = functools.partial(choose_split, sp=sp, split=split._replace(V=V))
    logits_QV = unembed(h_QPD[:, -1], model.unembed_weight() if w_DV is None else w_DV)
    prompt_kv = (cache.k_LBSJE.transpose(0, 1, 3, 2, 4), cache.v_LBSJE.transpose(0, 1, 3, 2, 4))
    # Completion t sits at position (prompt length) + t; cos/sin for every position, once (and
    # the local layers' own, Gemma 3's).
    first_pos_Q = jnp.sum(prompt_valid_QP, axis=-1, dtype=jnp.int32)
    rope_TE = tuple(x[0] for x in rope_tables(jnp.arange(P + C)[None], cfg))
    local_rope_TE = None
    if any(cfg.local_layers):
        local_rope_TE = tuple(x[0] for x in rope_tables(jnp.arange(P + C)[None], cfg.local_rope()))
    layers = _decode_layers(model)

    def emit(t, u_BC, logits_BV, tokens_BC, logp_BC, done_B):
        token_B, logp_B = pick(logits_BV, jax.lax.dynamic_index_in_dim(u_BC, t, 1, False))
        token_B = jnp.where(done_B, sp.pad_id, token_B)
        tokens_BC = jax.lax.dynamic_update_index_in_dim(tokens_BC, token_B, t, 1)
        logp_BC = jax.lax.dynamic_update_index_in_dim(logp_BC, jnp.where(done_B, 0.0, logp_B), t, 1)
        return token_B, tokens_BC, logp_BC, done_B | is_end_id(token_B, sp.eos_id, xp=jnp)

    def body_over(u_BC, prompt_kv, prompt_valid, first_pos):
        """A decode loop's body over B rows: B = N (the questions' G samples) or a compacted
        bucket (each row its own "question" of one sample, its prompt's cache gathered)."""

        def body(carry):
            t, kv, logits_BV, tokens_BC, logp_BC, done_B, row_steps = carry
            token_B, tokens_BC, logp_BC, done_B = emit(
                t, u_BC, logits_BV, tokens_BC, logp_BC, done_B
            )
            pos = first_pos + t
            logits_BV, kv = _decode_step(
                model,
                layers,
                prompt_kv,
                prompt_valid,
                kv,
                token_B,
                t,
                tuple(jnp.take(x, pos, axis=0) for x in rope_TE),
                None
                if local_rope_TE is None
                else tuple(jnp.take(x, pos, axis=0) for x in local_rope_TE),
                w_DV,
            )
            return t + 1, kv, logits_BV, tokens_BC, logp_BC, done_B, row_steps + token_B.shape[0]

        return body

    def running(done_B, fewer: int):
        """Decode on while more than `fewer` rows run (0: while any does)."""
        return jnp.sum(~done_B, dtype=jnp.int32) > fewer

    # 2. Decode: positions 0 .. C - 2 each sample a token and run it through the model. The
    # completion cache grows by segments (see `segments.segment_ends`) so attention reads about the slots
    # in use, not all C; each segment is one while loop over a fixed slot count.
    buckets = compact_buckets(N) if sp.compact and C > 1 else [N]
    body = body_over(u_NC, prompt_kv, prompt_valid_QP, first_pos_Q)
    ends = segment_ends(C, sp.segment_len)
    carry = (
        jnp.int32(0),
        _empty_kv(Q, J, G, ends[0], E, cd, cfg.num_layers),
        jnp.repeat(logits_QV, G, axis=0),
        jnp.full((N, C), sp.pad_id, jnp.int32),
        jnp.zeros((N, C), jnp.float32),
        jnp.zeros((N,), jnp.bool_),
        jnp.int32(0),  # row-steps decoded (Samples.row_steps)
    )
    fewer = buckets[1] if len(buckets) > 1 else 0
    for i, end in enumerate(ends if C > 1 else []):
        if i > 0:
            carry = (carry[0], _grow_kv(carry[1], end), *carry[2:])
        last = min(end, C - 1)
        cond = lambda c, last=last: (c[0] < last) & running(c[5], fewer)  # noqa: E731
        carry = jax.lax.while_loop(cond, body, carry)
    if len(buckets) > 1:
        carry = _compacted(
            carry, buckets, body_over, running, u_NC, prompt_kv, prompt_valid_QP, first_pos_Q, G
        )
    t, _, logits_NV, tokens_NC, logp_NC, done_N, row_steps = carry
    all_done = jnp.all(done_N)
    # 3. The last position needs no forward pass (a no-op when every sequence already stopped).
    _, tokens_NC, logp_NC, _ = emit(t, u_NC, logits_NV, tokens_NC, logp_NC, done_N)
    steps = jnp.where(all_done, t, t + 1)
    # done_N only stopped the loop: the masks come from the rule every backend uses.
    valid_NC, finished_N = completion_ends(tokens_NC, sp.eos_id, xp=jnp)
    return Samples(tokens_NC, logp_NC, valid_NC, finished_N, steps, row_steps)


def sample(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_QP: jax.Array,
    prompt_valid_QP: jax.Array,
    seeds_Q: jax.Array,
    *,
    num_samples: int,
    sp: SamplingParams,
    split: VocabSplit | None = None,
) -> Samples:
    """Draw `num_samples` completions for each of Q left-padded prompts (see the module docstring)."""
    u_NC = None
    if sp.temperature != 0.0:
        u_NC = sequence_uniforms(seeds_Q, num_samples, sp.max_new_tokens)
    return sample_with_uniforms(
        graphdef,
        state,
        prompt_QP,
        prompt_valid_QP,
        u_NC,
        num_samples=num_samples,
        sp=sp,
        split=split,
    )


class SamplerShardings(NamedTuple):
    """The declared layouts of a sampler on a mesh: `in_` for (params, prompt_QP, prompt_valid_QP,
    seeds_Q), `out` for its `Samples`."""

    in_: tuple
    out: Samples


def sampler_shardings(
    mesh, params, Q: int, P: int, num_samples: int, sp: SamplingParams
) -> SamplerShardings:
    """Where a sampler of Q prompts of P slots on `mesh` takes and leaves its arrays: the params by
    the rules (where the trainer keeps them: no gather), prompts and seeds split by rows over the
    batch axes, the N = Q * G samples split by rows, the decode count replicated."""
    from cppo_jax.parallel import sharding as sharding_lib

    N = Q * num_samples
    rows = lambda *shape: sharding_lib.named(mesh, ("batch",) + (None,) * (len(shape) - 1), shape)  # noqa: E731
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    in_ = (sharding_lib.param_shardings(params, mesh), rows(Q, P), rows(Q, P), rows(Q))
    C = sp.max_new_tokens
    out = Samples(rows(N, C), rows(N, C), rows(N, C), rows(N), replicated, replicated)
    return SamplerShardings(in_, out)


def vocab_split(mesh, sp: SamplingParams) -> VocabSplit | None:
    """How the sampler on `mesh` splits its logits: by vocabulary over the fsdp and tensor axes,
    where they have more than one device, unless top-k / top-p cuts are asked for (those take the
    gathered path). The rules keep the unembedding split by its model dimension over fsdp, so each
    device's logits would be partial sums, all-reduced per token (float32 [N, V]: 39 MB for
    Qwen2.5's vocabulary at N = 64); laid out by vocabulary once per rollout, each device computes
    whole logits for its columns and the devices exchange a few numbers per row instead."""
    axes = tuple(a for a in ("fsdp", "tensor") if mesh.shape[a] > 1)
    if not axes or sp.top_k > 0 or sp.top_p < 1.0:
        return None
    from cppo_jax.parallel.sharding import DATA_AXES

    batch = tuple(a for a in DATA_AXES if mesh.shape[a] > 1)
    return VocabSplit(mesh, ("data",) if mesh.shape["data"] > 1 else (), axes, batch)


@functools.lru_cache(maxsize=KEPT_PROGRAMS)
def _compiled_sampler(graphdef, num_samples: int, sp: SamplingParams, shardings=None):
    fn = functools.partial(sample, graphdef, num_samples=num_samples, sp=sp)
    if shardings is None:
        return jax.jit(fn)
    mesh = shardings[0][1][0].mesh
    fn = functools.partial(fn, split=vocab_split(mesh, sp))
    in_ = jax.tree.unflatten(*shardings[0])
    return jax.jit(fn, in_shardings=in_, out_shardings=shardings[1])


def make_sampler(
    graphdef: nnx.GraphDef,
    num_samples: int,
    sp: SamplingParams,
    shardings: SamplerShardings | None = None,
):
    """The jitted sampler for one (G, sampling parameters); compiled once per prompt shape. With
    `shardings` (`sampler_shardings`: one mesh, one Q) its in and out shardings are declared, and
    arguments must arrive in them (`place`)."""
    if shardings is None:
        return _compiled_sampler(graphdef, num_samples, sp)
    leaves, treedef = jax.tree.flatten(shardings.in_)
    if not sp.truncation:  # the token choice of the devices it is built for (deviceless too)
        platform = leaves[0].mesh.devices.flat[0].platform
        sp = dataclasses.replace(sp, truncation=TRUNCATION.get(platform, "sort"))
    return _compiled_sampler(graphdef, num_samples, sp, ((treedef, tuple(leaves)), shardings.out))


def place(args: tuple, shardings: SamplerShardings) -> tuple:
    """The sampler's arguments in its declared layouts: those already there stay as they are (the
    trainer's params, the rollout's prompts); others (a LoRA merge's output, host arrays) are moved."""
    return jax.device_put(args, shardings.in_)
