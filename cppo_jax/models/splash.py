"""`model.attention=splash`: TPUs' Pallas splash (flash) attention for whole sequences.

The kernel walks blocks of queries and keys with a running softmax, forward and backward (its own
VJP), so no [T, T] score buffer reaches memory: at the paper's 1,535 tokens those buffers are most of
a log-prob forward's temporaries and, saved or rebuilt, of the train step's.

Same rule as `attention.attend`: a valid query sees the valid keys at or before it. Padding (the
prompt's on the left, the completion's on the right) becomes segment ids, valid tokens 1 and padding
0, and-ed with the causal mask: a valid query sees exactly its valid keys, a padding query sees
padding at or before it (never an empty row, so never a NaN; padding rows are ignored downstream).
Queries are scaled by E^-1/2 before the kernel (it takes no scale). The length is padded to a
multiple of 128 (the kernel's block) and sliced back.

Under a mesh the kernel runs per device through `shard_map`: rows split as the batch rule says,
heads split over `tensor` when it divides both head counts (else every device runs all heads). On CPU
the same kernel runs in Pallas' interpreter (the tests); a GPU is refused (`cudnn` is its kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.sharding import PartitionSpec

from cppo_jax.parallel import sharding as sharding_lib

LANE = 128  # the length is padded to a multiple of this
BLOCKS = (512, 256, 128)  # each kernel's block: the largest that divides the padded length


def _kernel(heads: int, length: int, interpret: bool):
    """The causal splash kernel of one row: q [heads, length, E], k and v [kv_heads, length, E].
    Built per trace (its mask tables become the program's constants; a cache would leak tracers)."""
    b = next(b for b in BLOCKS if length % b == 0)
    sizes = sk.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    mask = sm.MultiHeadMask([sm.CausalMask((length, length)) for _ in range(heads)])
    return sk.make_splash_mha(
        mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret
    )


def _rows(q_BTHE, k_BTJE, v_BTJE, seg_BT, *, interpret: bool):
    """The kernel over the rows of one device's shard ([B, T, heads, E] in and out)."""
    kernel = _kernel(q_BTHE.shape[2], q_BTHE.shape[1], interpret)
    seg = sk.SegmentIds(seg_BT, seg_BT)

    def heads_first(x):
        return x.transpose(0, 2, 1, 3)

    out_BHTE = jax.vmap(kernel)(heads_first(q_BTHE), heads_first(k_BTJE), heads_first(v_BTJE), seg)
    return heads_first(out_BHTE)


def splash_attend(q_BTHE, k_BTJE, v_BTJE, valid_BT) -> jax.Array:
    """Causal grouped-query attention of whole sequences through the splash kernel (see above)."""
    mesh = sharding_lib.active_mesh()
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if platform == "gpu":
        raise ValueError(
            "model.attention=splash is the TPU kernel (Pallas splash attention); on a GPU use "
            "model.attention=cudnn"
        )
    B, T, H, E = q_BTHE.shape
    J = k_BTJE.shape[2]
    pad = -T % LANE

    def padded(x):
        return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))

    q_BTHE = (q_BTHE * jnp.asarray(E**-0.5, q_BTHE.dtype)).astype(q_BTHE.dtype)
    args = (padded(q_BTHE), padded(k_BTJE), padded(v_BTJE), padded(valid_BT.astype(jnp.int32)))
    run = functools.partial(_rows, interpret=platform == "cpu")
    if mesh is None:
        out_BTHE = run(*args)
    else:
        axes = mesh.shape
        rows = sharding_lib.logical_spec(("batch",), (B,), axes)
        rows = rows[0] if len(rows) else None
        heads = sharding_lib.logical_spec(("act_heads",), (H,), axes)
        kv_heads = sharding_lib.logical_spec(("act_kv_heads",), (J,), axes)
        h = heads[0] if len(heads) and heads == kv_heads else None  # whole groups per device
        x_spec, seg_spec = PartitionSpec(rows, None, h, None), PartitionSpec(rows, None)
        out_BTHE = jax.shard_map(
            run,
            mesh=mesh,
            in_specs=(x_spec, x_spec, x_spec, seg_spec),
            out_specs=x_spec,
            check_vma=False,
        )(*args)
    return out_BTHE[:, :T]
