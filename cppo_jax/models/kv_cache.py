"""The sampler's KV cache: per-layer keys and values of S slots, which slots hold real tokens, and the
next slot to write.

Letters (see docs/conventions.md): L layers, B batch, T tokens, S cache slots, J key/value heads,
E head dim.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from cppo_jax.models.config import DTYPES, TransformerConfig


@flax.struct.dataclass
class Cache:
    """Per-layer keys/values for S slots, which slots hold real tokens, and the next slot."""

    k_LBSJE: jax.Array
    v_LBSJE: jax.Array
    valid_BS: jax.Array
    index: jax.Array

    def repeat(self, n: int) -> Cache:
        return repeat_cache(self, n)

    def write_kv(self, layer: int, k_BTJE: jax.Array, v_BTJE: jax.Array) -> Cache:
        """Writes one layer's new keys/values at slots [index, index + T)."""
        zero = jnp.zeros((), jnp.int32)
        start = (jnp.asarray(layer, jnp.int32), zero, self.index, zero, zero)
        k = jax.lax.dynamic_update_slice(
            self.k_LBSJE, k_BTJE[None].astype(self.k_LBSJE.dtype), start
        )
        v = jax.lax.dynamic_update_slice(
            self.v_LBSJE, v_BTJE[None].astype(self.v_LBSJE.dtype), start
        )
        return self.replace(k_LBSJE=k, v_LBSJE=v)


def init_cache(cfg: TransformerConfig, batch: int, max_len: int, dtype=None) -> Cache:
    """An empty cache of `max_len` slots (dtype defaults to the compute dtype)."""
    dtype = DTYPES.get(dtype, dtype) if dtype is not None else cfg.compute_dtype
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return Cache(
        k_LBSJE=jnp.zeros(shape, dtype),
        v_LBSJE=jnp.zeros(shape, dtype),
        valid_BS=jnp.zeros((batch, max_len), jnp.bool_),
        index=jnp.zeros((), jnp.int32),
    )


def repeat_cache(cache: Cache, n: int) -> Cache:
    """Repeats each batch row n times consecutively (row b -> rows b*n .. b*n+n-1)."""
    return cache.replace(
        k_LBSJE=jnp.repeat(cache.k_LBSJE, n, axis=1),
        v_LBSJE=jnp.repeat(cache.v_LBSJE, n, axis=1),
        valid_BS=jnp.repeat(cache.valid_BS, n, axis=0),
    )
