"""The projection matmul every layer of the decoder uses (and the LoRA adapters beside them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, out_dtype=None) -> jax.Array:
    """x [..., *in] @ w [*in, *out] -> [..., *out], as one 2-D matmul over the flattened leading dims.

    `in` is the last `n_in` dims of x and the first `n_in` of w. The 2-D form is for speed: from
    3-D einsums (batch and tokens contracted in the weight gradient) XLA:CPU wrote transposed copies
    of the backward's activations, a quarter of a SwiGLU MLP's forward + backward time; from
    [N, K] @ [K, F] it takes the dots as they are (benchmarks/results/vs_trl.md).
    """
    k = int(np.prod(w.shape[:n_in]))
    y_NF = jnp.dot(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=out_dtype)
    return y_NF.reshape(*x.shape[: x.ndim - n_in], *w.shape[n_in:])
