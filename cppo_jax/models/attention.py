"""How a query attends: the rule, as a mask over key slots, and the implementations of softmax
attention that follow it (`model.attention`: einsum, ours; xla and cudnn, `jax.nn.dot_product_attention`;
splash, TPUs' Pallas kernel in `splash.py`).

Letters (see docs/conventions.md): B batch, T tokens, S cache slots, H query heads, J key/value heads,
E head dim; locally R = H // J query heads per key/value head.

Attention rule: query slot i may attend key slot j iff j <= i and key j is valid. Without a cache
the slots are the T positions of the input; with a cache they are the S cache slots, and the T new
tokens occupy slots [index, index + T).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cppo_jax.models.config import TransformerConfig
from cppo_jax.models.kv_cache import Cache

# Large finite negative for masked scores: fully masked rows (padding queries) stay finite.
MASKED = -1e30


def attention_mask(
    valid_BT, cache: Cache | None, segment_BT=None
) -> tuple[jax.Array, Cache | None]:
    """The attention rule as a mask [B, T, S] (S = T without a cache), and the cache with the T new
    slots' validity written at [index, index + T) (its index is advanced by the caller).

    `segment_BT` (packed rows, no cache): a query sees only the keys of its own segment.
    """
    T = valid_BT.shape[1]
    valid_BT = valid_BT.astype(jnp.bool_)
    if cache is None:
        query_slot_T = jnp.arange(T)
        key_slot_S = jnp.arange(T)
        valid_BS = valid_BT
    else:
        zero = jnp.zeros((), jnp.int32)
        valid_BS = jax.lax.dynamic_update_slice(cache.valid_BS, valid_BT, (zero, cache.index))
        cache = cache.replace(valid_BS=valid_BS)
        query_slot_T = cache.index + jnp.arange(T, dtype=jnp.int32)
        key_slot_S = jnp.arange(valid_BS.shape[1], dtype=jnp.int32)
    causal_TS = key_slot_S[None, :] <= query_slot_T[:, None]
    if segment_BT is None:
        mask_BTS = causal_TS[None] & valid_BS[:, None, :]
    else:
        if cache is not None:
            raise ValueError("segment_BT (packed rows) is for forwards without a cache")
        mask_BTS = causal_TS[None] & (segment_BT[:, :, None] == segment_BT[:, None, :])
    return mask_BTS, cache


def sliding_window_mask(mask_BTS, cache: Cache | None, window: int) -> jax.Array:
    """`mask_BTS` (from `attention_mask`, the cache's index not yet advanced) narrowed to a sliding
    window: query slot i also needs i - j < window (Gemma 3's local layers, as transformers: the
    query and window - 1 slots before it). Slots are consecutive within a sequence (prompts
    left-padded, completions after them, packed segments contiguous), so slot distances are token
    distances."""
    T, S = mask_BTS.shape[1:]
    start = jnp.zeros((), jnp.int32) if cache is None else cache.index
    query_slot_T = start + jnp.arange(T, dtype=jnp.int32)
    key_slot_S = jnp.arange(S, dtype=jnp.int32)
    return mask_BTS & (key_slot_S[None, :] > query_slot_T[:, None] - window)[None]


def attend(q_BTHE, k_BSJE, v_BSJE, mask_BTS, scale: float | None = None) -> jax.Array:
    """Grouped-query softmax attention; scores and softmax in float32; `scale` the scores' factor
    (None: head_dim^-0.5)."""
    B, T, H, E = q_BTHE.shape
    J = k_BSJE.shape[2]
    q_BTJRE = q_BTHE.reshape(B, T, J, H // J, E)
    scores_BJRTS = jnp.einsum(
        "btjre,bsje->bjrts", q_BTJRE, k_BSJE, preferred_element_type=jnp.float32
    ) * (E**-0.5 if scale is None else scale)
    scores_BJRTS = jnp.where(mask_BTS[:, None, None], scores_BJRTS, MASKED)
    probs_BJRTS = jax.nn.softmax(scores_BJRTS, axis=-1).astype(v_BSJE.dtype)
    out_BTJRE = jnp.einsum("bjrts,bsje->btjre", probs_BJRTS, v_BSJE)
    return out_BTJRE.reshape(B, T, H, E)


def library_attend(
    q_BTHE, k_BTJE, v_BTJE, mask_BTT, cfg: TransformerConfig, segment_BT=None
) -> jax.Array:
    """`attend` without a cache through `jax.nn.dot_product_attention` (`cfg.attention`: "xla", or
    "cudnn" for the fused kernel of NVIDIA GPUs) or TPUs' splash kernel ("splash": `splash`). Same rule: the causal mask of the T slots and the
    key-validity of `mask_BTT`'s last row (a padding query's row is all False there and is
    meaningless either way). With `segment_BT` (packed rows), the rule is `mask_BTT` whole:
    causal within a segment (the splash kernel takes the segment ids themselves)."""
    if cfg.attention == "splash":
        from cppo_jax.models.splash import splash_attend

        keys_BT = mask_BTT[:, -1, :] if segment_BT is None else segment_BT
        return splash_attend(q_BTHE, k_BTJE, v_BTJE, keys_BT)
    if cfg.attention == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            f"model.attention=cudnn needs an NVIDIA GPU; this JAX runs on {jax.default_backend()} "
            f"(use einsum, the default)"
        )
    scale = cfg.attn_scale
    if segment_BT is not None or cfg.sliding_window:  # the rule is the mask whole
        return jax.nn.dot_product_attention(
            q_BTHE,
            k_BTJE,
            v_BTJE,
            mask=mask_BTT[:, None],
            scale=scale,
            implementation=cfg.attention,
        )
    valid_BS = mask_BTT[:, -1, :]  # the last query slot sees every valid key
    return jax.nn.dot_product_attention(
        q_BTHE,
        k_BTJE,
        v_BTJE,
        mask=valid_BS[:, None, None, :],
        scale=scale,
        is_causal=True,
        implementation=cfg.attention,
    )
