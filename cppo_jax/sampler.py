"""The embedded JAX sampler: one shared prompt prefill per question, then batched KV-cache decode.

Q questions, G samples each, N = Q * G sequences; P prompt slots (left-padded), C new tokens.

1. Prefill the Q prompts once into a cache of P + C slots.
2. Repeat that cache G times (row q -> rows q*G .. q*G+G-1): no G-fold prompt recompute.
3. Decode in a bounded `lax.while_loop` that stops when every sequence has emitted EOS or C tokens.

Each sequence draws from its own key, `fold_in(fold_in(seed, q), j)` for sample j of question q, so a
question's samples do not depend on which other questions share the batch. Returns the sampled tokens,
their log-probabilities under the sampling distribution (logits / temperature, before top-k/top-p
truncation) and whether each sequence stopped on EOS.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cppo_jax.models import init_cache
from cppo_jax.models.transformer import repeat_cache


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    eos_id: int = 0
    pad_id: int = 0
    cache_dtype: str = "float32"


class Samples(NamedTuple):
    tokens_NC: jax.Array  # int32, pad after EOS
    logp_NC: jax.Array  # float32, 0 after EOS
    valid_NC: jax.Array  # bool: tokens up to and including EOS
    finished_N: jax.Array  # bool: stopped on EOS (False: truncated at C)


def positions_from_valid(valid_BT: jax.Array) -> jax.Array:
    """RoPE positions of left-padded rows: 0 at the first real token."""
    return jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=-1) - 1, 0)


def _truncate(logits_NV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Mask logits outside the top-k set and outside the top-p nucleus with -inf."""
    if top_k > 0:
        kth_N = jax.lax.top_k(logits_NV, top_k)[0][:, -1:]
        logits_NV = jnp.where(logits_NV < kth_N, -jnp.inf, logits_NV)
    if top_p < 1.0:
        sorted_NV = jnp.sort(logits_NV, axis=-1)[:, ::-1]
        probs_NV = jax.nn.softmax(sorted_NV, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        mass_before_NV = jnp.cumsum(probs_NV, axis=-1) - probs_NV
        keep_NV = mass_before_NV < top_p
        cutoff_N = jnp.min(jnp.where(keep_NV, sorted_NV, jnp.inf), axis=-1, keepdims=True)
        logits_NV = jnp.where(logits_NV < cutoff_N, -jnp.inf, logits_NV)
    return logits_NV


def _choose(logits_NV, keys_N, step, sp: SamplingParams):
    """Pick one token per row; return it and its log-prob under logits / temperature."""
    if sp.temperature == 0.0:
        token_N = jnp.argmax(logits_NV, axis=-1).astype(jnp.int32)
        logp_NV = jax.nn.log_softmax(logits_NV, axis=-1)
    else:
        scaled_NV = logits_NV / sp.temperature
        logp_NV = jax.nn.log_softmax(scaled_NV, axis=-1)
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys_N)
        truncated_NV = _truncate(scaled_NV, sp.top_k, sp.top_p)
        token_N = jax.vmap(jax.random.categorical)(step_keys, truncated_NV).astype(jnp.int32)
    logp_N = jnp.take_along_axis(logp_NV, token_N[:, None], axis=-1)[:, 0]
    return token_N, logp_N


def sample(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_QP: jax.Array,
    prompt_valid_QP: jax.Array,
    seeds_Q: jax.Array,
    *,
    num_samples: int,
    sp: SamplingParams,
) -> Samples:
    """Draw `num_samples` completions for each of Q left-padded prompts (see the module docstring)."""
    model = nnx.merge(graphdef, state)
    Q, P = prompt_QP.shape
    G, C = num_samples, sp.max_new_tokens
    N = Q * G
    cfg = model.cfg
    dtype = jnp.dtype(sp.cache_dtype)

    cache = init_cache(cfg, Q, P + C, dtype)
    pos_QP = positions_from_valid(prompt_valid_QP)
    h_QPD, cache = model.hidden(prompt_QP, pos_QP, prompt_valid_QP, cache=cache)
    w_DV = model.unembed_weight()
    logits_QV = jnp.einsum("qd,dv->qv", h_QPD[:, -1].astype(jnp.float32), w_DV.astype(jnp.float32))
    cache = repeat_cache(cache, G)
    logits_NV = jnp.repeat(logits_QV, G, axis=0)
    next_pos_N = jnp.repeat(pos_QP[:, -1] + 1, G)

    keys_Q = jax.vmap(jax.random.PRNGKey)(seeds_Q)
    keys_N = jax.vmap(lambda k: jax.vmap(lambda j: jax.random.fold_in(k, j))(jnp.arange(G)))(keys_Q)
    keys_N = keys_N.reshape(N, *keys_Q.shape[1:])

    def cond(carry):
        t, _, _, _, _, done_N, _ = carry
        return (t < C) & ~jnp.all(done_N)

    def body(carry):
        t, cache, logits_NV, tokens_NC, logp_NC, done_N, pos_N = carry
        token_N, logp_N = _choose(logits_NV, keys_N, t, sp)
        live_N = ~done_N
        token_N = jnp.where(live_N, token_N, sp.pad_id)
        tokens_NC = tokens_NC.at[:, t].set(token_N)
        logp_NC = logp_NC.at[:, t].set(jnp.where(live_N, logp_N, 0.0))
        done_N = done_N | (token_N == sp.eos_id)
        h_N1D, cache = model.hidden(token_N[:, None], pos_N[:, None], live_N[:, None], cache=cache)
        logits_NV = jnp.einsum(
            "nd,dv->nv", h_N1D[:, 0].astype(jnp.float32), w_DV.astype(jnp.float32)
        )
        return t + 1, cache, logits_NV, tokens_NC, logp_NC, done_N, pos_N + 1

    carry = (
        jnp.int32(0),
        cache,
        logits_NV,
        jnp.full((N, C), sp.pad_id, jnp.int32),
        jnp.zeros((N, C), jnp.float32),
        jnp.zeros((N,), bool),
        next_pos_N,
    )
    t, _, _, tokens_NC, logp_NC, done_N, _ = jax.lax.while_loop(cond, body, carry)
    valid_NC = completion_valid(tokens_NC, sp.eos_id, t)
    return Samples(tokens_NC, logp_NC, valid_NC, done_N)


def completion_valid(tokens_NC: jax.Array, eos_id: int, length=None) -> jax.Array:
    """True up to and including the first EOS (all True when there is none), within `length`."""
    is_eos_NC = tokens_NC == eos_id
    before_eos_NC = jnp.cumsum(is_eos_NC.astype(jnp.int32), axis=-1) - is_eos_NC.astype(jnp.int32)
    valid_NC = before_eos_NC == 0
    if length is not None:
        valid_NC = valid_NC & (jnp.arange(tokens_NC.shape[1]) < length)[None, :]
    return valid_NC


@functools.cache
def _compiled_sampler(graphdef, num_samples: int, sp: SamplingParams):
    return jax.jit(functools.partial(sample, graphdef, num_samples=num_samples, sp=sp))


def make_sampler(graphdef: nnx.GraphDef, num_samples: int, sp: SamplingParams):
    """The jitted sampler for one (G, sampling parameters); compiled once per prompt shape."""
    return _compiled_sampler(graphdef, num_samples, sp)
