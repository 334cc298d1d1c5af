"""Flax NNX decoder for Qwen2/Qwen2.5, Llama, Qwen3 and Gemma 3 (text) checkpoints, with a
slot-indexed KV cache (`TransformerConfig` says what differs between them).

Letters (see docs/conventions.md): B batch, T tokens, S cache slots, D model width, F MLP width,
H query heads, J key/value heads, E head dim, V vocabulary, L layers.

How a query attends (the rule, and its einsum, XLA, cuDNN and splash implementations) is
`models/attention.py`; the KV cache is `models/kv_cache.py`; the rotary tables `models/rope.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.models import lora
from cppo_jax.models.attention import attend, attention_mask, library_attend, sliding_window_mask
from cppo_jax.models.config import DTYPES, HF_ARCHITECTURES, TransformerConfig, has_o_bias
from cppo_jax.models.kv_cache import Cache
from cppo_jax.models.matmul import dense
from cppo_jax.models.rope import apply_rope, rope_tables
from cppo_jax.parallel import sharding

# DTYPES, HF_ARCHITECTURES, TransformerConfig, dense and has_o_bias are defined elsewhere and
# importable from here as before.
__all__ = [
    "DTYPES",
    "HF_ARCHITECTURES",
    "Transformer",
    "TransformerConfig",
    "dense",
    "has_o_bias",
    "init_model",
    "run_layers",
]

_INIT_STD = 0.02
# Logical names of activations (mapped onto the mesh by cppo_jax.parallel.sharding.RULES).
_ACT_EMBED = ("batch", "length", "act_embed")
_ACT_HEADS = ("batch", "length", "act_heads", "head_dim")
_ACT_KV_HEADS = ("batch", "length", "act_kv_heads", "head_dim")
_ACT_MLP = ("batch", "length", "act_mlp")
_ACT_VOCAB = ("batch", "length", "act_vocab")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """The one place activations get logical sharding constraints (cppo_jax.parallel.sharding.RULES).

    The identity unless a mesh is active while tracing (`sharding.use_mesh`, set by the jitted step
    functions); a dim the rule's mesh axes do not divide stays replicated.
    """
    return sharding.constrain(x, names)


def _param(value: jax.Array, names: tuple[str, ...]) -> nnx.Param:
    """A parameter annotated with logical axis names (metadata only; placed by a later pass)."""
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _stacked(layers: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Leading shape and logical names of a parameter stacked over `layers` (0: not stacked)."""
    return ((layers,), ("layers",)) if layers else ((), ())


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> jax.Array:
    return (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def unembed(h_XD: jax.Array, w_DV: jax.Array) -> jax.Array:
    """Float32 logits [..., V] = h @ w: the precision rule of every logits matmul (the forward, the
    sampler, the training and reference log-probs, the vLLM probe through the forward).

    Both operands in h's dtype, the compute dtype (a float32 weight is cast, as the other layers'
    weights are), products accumulated and returned in float32. So sampler and trainer multiply the
    same numbers, and their log-probs of a token differ by float32 rounding, not by the rounding of
    the [D, V] weight to the compute dtype.
    """
    return dense(h_XD, w_DV.astype(h_XD.dtype), out_dtype=jnp.float32)


def forward_copy(params, dtype):
    """A copy of `params` for forwards only (the reference policy, a rollout snapshot): floating
    leaves in `dtype`, the compute dtype, each array keeping its sharding.

    Every forward casts each weight to the compute dtype before use, so the copy's forwards equal
    the params' bit for bit, and it takes half the bytes of float32 params.
    """

    def leaf(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return jnp.copy(x)  # a buffer of its own: the update donates the params

    return jax.tree.map(leaf, params)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


# The norm weights: the decoder's (`scale_D`) and the per-head query and key norms (`q_norm_E`,
# `k_norm_E`). Gemma 3 stores w of a (1 + w) scale, initialised 0; the others the scale, 1.
NORM_WEIGHTS = ("scale_D", "q_norm_E", "k_norm_E")


def rms_norm(x_BTX: jax.Array, w_X: jax.Array, eps: float, gemma: bool) -> jax.Array:
    """RMS-normalised over the last axis, in float32, then scaled as Hugging Face does: Qwen/Llama
    round the normed x to x's dtype and multiply by w; Gemma multiplies by (1 + w) in float32 and
    rounds once."""
    x32 = x_BTX.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if gemma:
        return (normed * (1.0 + w_X.astype(jnp.float32))).astype(x_BTX.dtype)
    return w_X.astype(x_BTX.dtype) * normed.astype(x_BTX.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: TransformerConfig, layers: int = 0):
        lead, names = _stacked(layers)
        self.eps = cfg.rms_norm_eps
        self.gemma = cfg.gemma
        init = jnp.zeros if cfg.gemma else jnp.ones
        self.scale_D = _param(init((*lead, cfg.hidden_size), cfg.weight_dtype), (*names, "norm"))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return rms_norm(x_BTD, self.scale_D[...], self.eps, self.gemma)


class Attention(nnx.Module):
    """Projections of grouped-query attention; `qkv` and `out` are shared by the full forward and
    the sampler's decode step, which differ only in how scores are taken over the cache."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, layers: int = 0):
        D, H, J, E, pdt = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.weight_dtype,
        )
        L, n = _stacked(layers)
        self.cfg = cfg
        self.q_DHE = _param(_normal(rngs, (*L, D, H, E), pdt), (*n, "embed", "q_heads", "head_dim"))
        self.k_DJE = _param(
            _normal(rngs, (*L, D, J, E), pdt), (*n, "embed", "kv_heads", "head_dim")
        )
        self.v_DJE = _param(
            _normal(rngs, (*L, D, J, E), pdt), (*n, "embed", "kv_heads", "head_dim")
        )
        self.o_HED = _param(_normal(rngs, (*L, H, E, D), pdt), (*n, "q_heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.q_bias_HE = _param(jnp.zeros((*L, H, E), pdt), (*n, "q_heads", "head_dim"))
            self.k_bias_JE = _param(jnp.zeros((*L, J, E), pdt), (*n, "kv_heads", "head_dim"))
            self.v_bias_JE = _param(jnp.zeros((*L, J, E), pdt), (*n, "kv_heads", "head_dim"))
        if has_o_bias(cfg):
            self.o_bias_D = _param(jnp.zeros((*L, D), pdt), (*n, "embed"))
        if cfg.qk_norm:  # one weight over head_dim, shared by the heads
            init = jnp.zeros if cfg.gemma else jnp.ones
            self.q_norm_E = _param(init((*L, E), pdt), (*n, "norm"))
            self.k_norm_E = _param(init((*L, E), pdt), (*n, "norm"))
        lora.add(self, cfg, lora.ATTENTION_TARGETS, rngs, layers)

    def qkv(self, x_BTD, cos_BTE, sin_BTE):
        """Rotated queries [B, T, H, E], rotated keys and values [B, T, J, E] of a normed input."""
        dt = x_BTD.dtype
        q_BTHE = lora.apply(self, "q", x_BTD, dense(x_BTD, self.q_DHE[...].astype(dt)))
        k_BTJE = lora.apply(self, "k", x_BTD, dense(x_BTD, self.k_DJE[...].astype(dt)))
        v_BTJE = lora.apply(self, "v", x_BTD, dense(x_BTD, self.v_DJE[...].astype(dt)))
        if self.cfg.attention_bias:
            q_BTHE = q_BTHE + self.q_bias_HE[...].astype(dt)
            k_BTJE = k_BTJE + self.k_bias_JE[...].astype(dt)
            v_BTJE = v_BTJE + self.v_bias_JE[...].astype(dt)
        if self.cfg.qk_norm:
            eps, gemma = self.cfg.rms_norm_eps, self.cfg.gemma
            q_BTHE = rms_norm(q_BTHE, self.q_norm_E[...], eps, gemma)
            k_BTJE = rms_norm(k_BTJE, self.k_norm_E[...], eps, gemma)
        q_BTHE = constrain(apply_rope(q_BTHE, cos_BTE, sin_BTE), _ACT_HEADS)
        k_BTJE = constrain(apply_rope(k_BTJE, cos_BTE, sin_BTE), _ACT_KV_HEADS)
        return q_BTHE, k_BTJE, constrain(v_BTJE, _ACT_KV_HEADS)

    def out(self, out_BTHE: jax.Array) -> jax.Array:
        """The output projection of the attended values [B, T, H, E] -> [B, T, D]."""
        dt = out_BTHE.dtype
        y_BTD = dense(out_BTHE, self.o_HED[...].astype(dt), n_in=2)
        y_BTD = lora.apply(self, "o", out_BTHE, y_BTD)
        if has_o_bias(self.cfg):
            y_BTD = y_BTD + self.o_bias_D[...].astype(dt)
        return y_BTD

    def __call__(
        self, x_BTD, cos_BTE, sin_BTE, mask_BTS, cache: Cache | None, layer, segment_BT=None
    ):
        q_BTHE, k_BTJE, v_BTJE = self.qkv(x_BTD, cos_BTE, sin_BTE)
        if cache is None and self.cfg.attention != "einsum":
            out_BTHE = library_attend(q_BTHE, k_BTJE, v_BTJE, mask_BTS, self.cfg, segment_BT)
            return self.out(out_BTHE), cache
        if cache is None:
            k_BSJE, v_BSJE = k_BTJE, v_BTJE
        else:
            dt = x_BTD.dtype
            cache = cache.write_kv(layer, k_BTJE, v_BTJE)
            k_BSJE = jax.lax.dynamic_index_in_dim(cache.k_LBSJE, layer, 0, False).astype(dt)
            v_BSJE = jax.lax.dynamic_index_in_dim(cache.v_LBSJE, layer, 0, False).astype(dt)
        return self.out(attend(q_BTHE, k_BSJE, v_BSJE, mask_BTS, self.cfg.attn_scale)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, layers: int = 0):
        D, F, pdt = cfg.hidden_size, cfg.intermediate_size, cfg.weight_dtype
        L, n = _stacked(layers)
        self.cfg = cfg
        self.gate_DF = _param(_normal(rngs, (*L, D, F), pdt), (*n, "embed", "mlp"))
        self.up_DF = _param(_normal(rngs, (*L, D, F), pdt), (*n, "embed", "mlp"))
        self.down_FD = _param(_normal(rngs, (*L, F, D), pdt), (*n, "mlp", "embed"))
        lora.add(self, cfg, lora.MLP_TARGETS, rngs, layers)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = x_BTD.dtype
        gate_BTF = lora.apply(self, "gate", x_BTD, dense(x_BTD, self.gate_DF[...].astype(dt)))
        up_BTF = lora.apply(self, "up", x_BTD, dense(x_BTD, self.up_DF[...].astype(dt)))
        gate_BTF = constrain(gate_BTF, _ACT_MLP)
        # Gemma's GeGLU: the tanh GELU (transformers' gelu_pytorch_tanh); else SwiGLU
        act_BTF = (
            jax.nn.gelu(gate_BTF, approximate=True) if self.cfg.gemma else jax.nn.silu(gate_BTF)
        )
        h_BTF = act_BTF * constrain(up_BTF, _ACT_MLP)
        return lora.apply(self, "down", h_BTF, dense(h_BTF, self.down_FD[...].astype(dt)))


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer; built with `layers=L` it holds all L layers' params stacked.
    Gemma 3 also normalises the attention and MLP outputs before each residual sum."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, layers: int = 0):
        self.attn_norm = RMSNorm(cfg, layers)
        self.attn = Attention(cfg, rngs, layers)
        self.mlp_norm = RMSNorm(cfg, layers)
        self.mlp = MLP(cfg, rngs, layers)
        self.gemma = cfg.gemma
        if cfg.gemma:
            self.post_attn_norm = RMSNorm(cfg, layers)
            self.post_mlp_norm = RMSNorm(cfg, layers)

    def attn_residual(self, x_BTD: jax.Array, y_BTD: jax.Array) -> jax.Array:
        """The residual sum after attention (y: its output projection)."""
        if self.gemma:
            y_BTD = self.post_attn_norm(y_BTD)
        return constrain(x_BTD + y_BTD, _ACT_EMBED)

    def mlp_residual(self, x_BTD: jax.Array) -> jax.Array:
        y_BTD = self.mlp(self.mlp_norm(x_BTD))
        if self.gemma:
            y_BTD = self.post_mlp_norm(y_BTD)
        return constrain(x_BTD + y_BTD, _ACT_EMBED)

    def __call__(self, x_BTD, cos_BTE, sin_BTE, mask_BTS, cache, layer, segment_BT=None):
        y_BTD, cache = self.attn(
            self.attn_norm(x_BTD), cos_BTE, sin_BTE, mask_BTS, cache, layer, segment_BT
        )
        return self.mlp_residual(self.attn_residual(x_BTD, y_BTD)), cache


# What each remat policy (TransformerConfig.remat) saves of a layer's forward for its backward;
# None: jax.checkpoint is not applied (every residual is kept).
REMAT_POLICIES = {
    "save_all": None,
    # only the layer's input (the carry): the whole layer is recomputed
    "full": jax.checkpoint_policies.nothing_saveable,
    # the projections (q, k, v, o, gate, up, down: 2-D `dense` matmuls); attention's batched
    # einsums (scores, weighted values) and all elementwise work recomputed
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # every matmul output, the attention scores too; elementwise work recomputed
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def run_layers(
    cfg: TransformerConfig, layers: DecoderLayer, body, carry, *, remat: str = "save_all"
):
    """`carry = body(layer_i, i, carry)` for each of the L layers stacked in `layers`, in order.

    Under one `lax.scan` over the stacked params when `cfg.scan_layers` (every program holds one
    copy of the layer), else unrolled (layer i is a static slice of the stack). `body` may close
    over traced values. `remat` names what each layer keeps for the backward pass
    (`REMAT_POLICIES`); the rest is recomputed there.
    """
    graphdef, state = nnx.split(layers)

    def step(carry, xs):
        state_l, index = xs
        return body(nnx.merge(graphdef, state_l), index, carry), None

    policy = REMAT_POLICIES[remat]
    if policy is not None:
        step = jax.checkpoint(step, policy=policy)
    if cfg.scan_layers:
        carry, _ = jax.lax.scan(step, carry, (state, jnp.arange(cfg.num_layers, dtype=jnp.int32)))
        return carry
    for i in range(cfg.num_layers):
        carry, _ = step(carry, (jax.tree.map(lambda x, i=i: x[i], state), i))
    return carry


def scale_embeddings(x_BTD: jax.Array, cfg: TransformerConfig) -> jax.Array:
    """Gemma's embeddings times sqrt(D), the factor rounded to the table's dtype as Hugging Face
    does (x is the lookup, still in the table's dtype); the others' unchanged."""
    if not cfg.gemma:
        return x_BTD
    return x_BTD * jnp.asarray(cfg.hidden_size**0.5, x_BTD.dtype)


def per_layer(cfg: TransformerConfig, index, local, full):
    """Layer `index`'s (traced, under the scan) choice of the local-layer value or the global one;
    `full` alone for a model without sliding-window layers."""
    if not any(cfg.local_layers):
        return full
    is_local = jnp.asarray(cfg.local_layers)[index]
    return jax.tree.map(lambda a, b: jnp.where(is_local, a, b), local, full)


class Transformer(nnx.Module):
    """Decoder-only transformer (Qwen2 / Llama / Qwen3 / Gemma 3 layout)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        V, D, pdt = cfg.vocab_size, cfg.hidden_size, cfg.weight_dtype
        self.cfg = cfg
        self.embed_VD = _param(_normal(rngs, (V, D), pdt), ("vocab", "embed"))
        self.layers = DecoderLayer(cfg, rngs, layers=cfg.num_layers)  # params stacked [L, ...]
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head_DV = _param(_normal(rngs, (D, V), pdt), ("embed", "vocab"))

    def unembed_weight(self) -> jax.Array:
        """The output projection [D, V] (the embedding transposed when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed_VD[...].T
        return self.lm_head_DV[...]

    def hidden(
        self, tokens_BT, positions_BT, valid_BT, cache: Cache | None = None, segment_BT=None
    ):
        """Final-normed hidden states [B, T, D] in the compute dtype, and the updated cache.

        `valid_BT` marks real tokens (prompts left-padded, completions right-padded);
        `positions_BT` are the RoPE positions, e.g. cumsum(valid) - 1 clipped at 0. With a cache,
        the T tokens are written at slots [index, index + T) (the caller keeps index + T <= S)
        and attend over all S slots; index advances by T. Without one, the cache stays None.
        Padding queries see no valid key and get finite, meaningless outputs.

        `segment_BT` (packed rows, `cppo_jax.packing.pack`; no cache): int ids of the sequences sharing a
        row, 0 on padding. A query sees the keys at or before it with its own id (a padding slot
        sees the padding before it), `valid_BT` unused; positions restart per sequence.
        """
        cfg = self.cfg
        T = tokens_BT.shape[1]
        table_VD = self.embed_VD[...]
        if table_VD.dtype == cfg.compute_dtype:
            # The table whole along D (gathered over fsdp), so each row's lookup stays on its
            # device; a tied unembedding shares the gathered copy (a forward copy's programs).
            x_BTD = jnp.take(constrain(table_VD, ("vocab", None)), tokens_BT, axis=0, mode="clip")
        else:
            # Wider params (float32 under bfloat16 compute): looked up in the table as it is
            # sharded, each device taking every row's D slice [B, T, D / fsdp], then regathered
            # along D and split by rows. No float32 [V, D] copy is gathered, and the lookup's
            # gradient is scattered into the shard.
            x_BTD = jnp.take(table_VD, tokens_BT, axis=0, mode="clip")
            x_BTD = constrain(x_BTD, (None, None, "embed"))
        x_BTD = scale_embeddings(x_BTD, cfg)
        x_BTD = constrain(x_BTD.astype(cfg.compute_dtype), _ACT_EMBED)
        mask_BTS, cache = attention_mask(valid_BT, cache, segment_BT)
        full = (mask_BTS, *rope_tables(positions_BT, cfg))
        local = None
        if any(cfg.local_layers):  # Gemma 3's local layers: the window, their own RoPE base
            window_BTS = sliding_window_mask(mask_BTS, cache, cfg.sliding_window)
            local = (window_BTS, *rope_tables(positions_BT, cfg.local_rope()))

        def layer_fn(layer, index, carry):
            x_BTD, cache = carry
            mask_BTS, cos_BTE, sin_BTE = per_layer(cfg, index, local, full)
            return layer(x_BTD, cos_BTE, sin_BTE, mask_BTS, cache, index, segment_BT)

        x_BTD, cache = run_layers(cfg, self.layers, layer_fn, (x_BTD, cache), remat=cfg.remat)
        h_BTD = self.final_norm(x_BTD)
        if cache is not None:
            cache = cache.replace(index=cache.index + T)
        return h_BTD, cache

    def __call__(self, tokens_BT, positions_BT, valid_BT, cache: Cache | None = None):
        """Float32 logits [B, T, V] and the updated cache."""
        h_BTD, cache = self.hidden(tokens_BT, positions_BT, valid_BT, cache)
        logits_BTV = unembed(h_BTD, self.unembed_weight())
        return constrain(logits_BTV, _ACT_VOCAB), cache


def init_adapter_value(path, shape, rng: np.random.Generator) -> np.ndarray:
    """A fresh LoRA adapter's value, as PEFT draws it: B zeros, A [L, *in, r] uniform within
    +-1/sqrt(in) (`models.lora`)."""
    if "_b_" in str(path[-1]):
        return np.zeros(shape, np.float32)
    bound = float(np.prod(shape[1:-1])) ** -0.5
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def init_model(cfg: TransformerConfig, seed: int = 0) -> Transformer:
    """A randomly initialised model: N(0, 0.02) weights, unit norms, zero biases; adapters (if
    `cfg.lora_rank`) A uniform within +-1/sqrt(in), B zero, as `models.lora.add`.

    Values come from NumPy's generator (no per-shape XLA compiles, which dominate start-up on
    CPU), so they differ from `Transformer(cfg, rngs=nnx.Rngs(seed))`, whose initialiser is the same.
    """
    rng = np.random.default_rng(seed)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = []
    for path, var in nnx.to_flat_state(state):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        if isinstance(var, nnx.LoRAParam):
            value = init_adapter_value(path, shape, rng)
        elif path[-1] in NORM_WEIGHTS:  # Gemma's (1 + w) weights start at 0, the others' at 1
            value = np.full(shape, 0.0 if cfg.gemma else 1.0, np.float32)
        elif "bias" in str(path[-1]):
            value = np.zeros(shape, np.float32)
        else:
            value = _INIT_STD * rng.standard_normal(shape, np.float32)
        flat.append((path, var.replace(jnp.asarray(value, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
