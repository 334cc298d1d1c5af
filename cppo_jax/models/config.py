"""Architecture and numerics of a decoder (`TransformerConfig`), and its Hugging Face `config.json` form."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from cppo_jax.config.choices import ATTENTION_KINDS, REMAT_POLICIES, remat_policy
from cppo_jax.models.rope import normalize_scaling

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
HF_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# The `model_type` of each architecture's config.json (Gemma 3's text-only model is "gemma3_text").
HF_MODEL_TYPES = {"qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}
ARCH_OF_MODEL_TYPE = {t: a for a, t in HF_MODEL_TYPES.items()}
# Gemma 3's layer kinds (config.json `layer_types`): local (sliding-window) and global attention.
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture and numerics of a Qwen2, Llama, Qwen3 or Gemma 3 (text) decoder.

    `attention_bias` defaults to the architecture's choice (qwen2: q/k/v biases; the others: none).
    For llama and qwen3, `attention_bias=True` also adds an o_proj bias, as Hugging Face does.
    Qwen3 and Gemma 3 RMS-normalise each query and key head before RoPE (`qk_norm`). Gemma 3 also
    scales the embeddings by sqrt(D), normalises the attention and MLP outputs too (four norms a
    layer), uses (1 + w) norm weights, a GeGLU MLP (tanh GELU), queries scaled by
    query_pre_attn_scalar^-0.5, and interleaves sliding-window layers (`layer_types`, a window of
    `sliding_window` tokens, RoPE base `rope_local_theta`, no rope scaling) with global ones
    (`rope_theta`, `rope_scaling`).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    max_position_embeddings: int = 32768
    # Hugging Face `rope_scaling` (a dict or normalized (key, value) pairs; None: plain RoPE).
    # Stored as sorted pairs so the config stays hashable; see models/rope.py for the types.
    rope_scaling: Any = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    # What each layer keeps for the backward pass (`run_layers`): "save_all" (everything), "full"
    # (its input only), "minimal" (the projections' outputs, not attention's) or "dots_saveable"
    # (every matmul output, attention scores too); a boolean: True = "full", False = "dots_saveable".
    remat: str | bool = "dots_saveable"
    # Layers run under one `lax.scan` over their stacked params (compiled once, whatever the depth);
    # False unrolls them (one copy of the layer per depth in every program). Params are stacked
    # [L, ...] either way, so checkpoints, sharding and Hugging Face I/O do not depend on it.
    scan_layers: bool = True
    # How a whole sequence attends (training, log-probs; the sampler's cached steps always use
    # "einsum"): "einsum", this package's grouped-query attention; "xla" or "cudnn",
    # `jax.nn.dot_product_attention` with that implementation ("cudnn": the fused kernel of NVIDIA
    # GPUs, bfloat16/float16 compute only; "xla": the same call on any backend, for comparison);
    # "splash", TPUs' Pallas flash kernel (no [T, T] scores in memory; interpreted on CPU).
    attention: str = "einsum"
    # Low-rank adapters (`models.lora`): rank 0 none; else A [in, r], B [r, out] on each projection
    # `lora_targets` names (config.choices.LORA_TARGETS), scaled by lora_alpha / lora_rank.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    # Gemma 3 (see the docstring): the window, each layer's kind (SLIDING or FULL), the local RoPE
    # base, the query scale's denominator (None: head_dim).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None

    def __post_init__(self):
        if self.arch not in HF_ARCHITECTURES:
            raise ValueError(f"arch: unknown {self.arch!r}; supported: {sorted(HF_ARCHITECTURES)}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"attention: unknown {self.attention!r}; one of {', '.join(ATTENTION_KINDS)}"
            )
        if self.attention == "cudnn" and self.dtype != "bfloat16":
            raise ValueError(f"attention: cudnn needs dtype bfloat16, got {self.dtype}")
        object.__setattr__(self, "remat", remat_policy(self.remat))
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat: unknown {self.remat!r}; one of {', '.join(REMAT_POLICIES)}")
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", self.arch == "qwen2")
        if self.arch == "qwen2" and not self.attention_bias:
            raise ValueError("attention_bias: qwen2 always has q/k/v biases; it must be True")
        if self.arch == "gemma3" and self.attention_bias:
            raise ValueError("attention_bias: gemma3 has no attention biases; it must be False")
        self._check_layer_types()
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads: {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)!r}")
        if self.lora_rank < 0 or (self.lora_rank > 0) != bool(self.lora_targets):
            raise ValueError(
                f"lora_rank: {self.lora_rank} with targets {self.lora_targets}: a positive rank "
                "needs targets and targets a positive rank"
            )
        scaling = normalize_scaling(self.rope_scaling, self.max_position_embeddings)
        object.__setattr__(self, "rope_scaling", scaling)
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(
                    f"{name}: unknown {getattr(self, name)!r}; supported: {sorted(DTYPES)}"
                )

    def _check_layer_types(self) -> None:
        if self.arch != "gemma3":
            if self.sliding_window is not None or self.layer_types is not None:
                raise ValueError(
                    f"sliding_window / layer_types: only gemma3 has them, not {self.arch}"
                )
            return
        if self.layer_types is None:  # Gemma 3's pattern: five local layers, then a global one
            kinds = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers))
            object.__setattr__(self, "layer_types", kinds)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"layer_types: {self.num_layers} entries of {SLIDING!r} or {FULL!r} needed, got "
                f"{self.layer_types!r}"
            )
        if SLIDING in self.layer_types and not (
            isinstance(self.sliding_window, int) and self.sliding_window >= 1
        ):
            raise ValueError(
                f"sliding_window: a positive int is needed, got {self.sliding_window!r}"
            )
        if self.attention == "splash":
            raise ValueError(
                "attention: splash does not take gemma3's sliding window or query scale; use "
                "einsum, xla or cudnn"
            )

    @property
    def qk_norm(self) -> bool:
        """Queries and keys RMS-normalised per head before RoPE (Qwen3, Gemma 3)."""
        return self.arch in ("qwen3", "gemma3")

    @property
    def gemma(self) -> bool:
        return self.arch == "gemma3"

    @property
    def attn_scale(self) -> float:
        """The factor of the attention scores q . k."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within the sliding window (Gemma 3's local layers)."""
        return tuple(t == SLIDING for t in (self.layer_types or ("",) * self.num_layers))

    def local_rope(self) -> TransformerConfig:
        """The config whose RoPE tables are the local layers' (base rope_local_theta, no scaling)."""
        return dataclasses.replace(self, rope_theta=self.rope_local_theta, rope_scaling=None)

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self) -> Any:
        return DTYPES[self.param_dtype]

    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> TransformerConfig:
        """Builds a config from a Hugging Face `config.json` dict; `overrides` replace fields."""
        model_type = d.get("model_type")
        arch = ARCH_OF_MODEL_TYPE.get(model_type)
        archs = list(d.get("architectures") or [])
        supported = ", ".join(f"{a} ({HF_MODEL_TYPES[t]})" for t, a in HF_ARCHITECTURES.items())
        if arch is None or any(a != HF_ARCHITECTURES[arch] for a in archs):
            raise ValueError(
                f"unsupported architecture {archs or model_type!r} (model_type {model_type!r}); "
                f"supported: {supported}"
            )
        # transformers 4 writes `rope_theta` + `rope_scaling`; transformers 5 one `rope_parameters`
        # (Gemma 3: one per layer kind).
        params = d.get("rope_parameters") or {}
        local_params = {}
        if arch == "gemma3" and FULL in params:
            params, local_params = params.get(FULL) or {}, params.get(SLIDING) or {}
        rope = {**params, **(d.get("rope_scaling") or {})}
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        local_theta = local_params.get("rope_theta", d.get("rope_local_base_freq", 10000.0))
        if local_params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters: local rope {local_params!r} is not supported")
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        want_act = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
        if act != want_act:
            raise ValueError(f"hidden_act {act!r} is not supported for {arch} (only {want_act!r})")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if d.get(key) is not None:
                raise ValueError(f"{key}: logit soft-capping is not supported, got {d[key]!r}")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: only causal attention is supported")

        def need(key):
            if key not in d:
                raise ValueError(f"config is missing {key!r}")
            return d[key]

        heads = need("num_attention_heads")
        kwargs = dict(
            arch=arch,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or need("hidden_size") // heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            rope_scaling=rope or None,
        )
        if arch == "gemma3":
            layers = kwargs["num_layers"]
            kinds = d.get("layer_types")
            if kinds is None:  # transformers 4's configs: every `sliding_window_pattern`-th global
                pattern = int(d.get("sliding_window_pattern", 6))
                kinds = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
            kwargs.update(
                sliding_window=d.get("sliding_window"),
                layer_types=tuple(kinds),
                rope_local_theta=float(local_theta),
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or kwargs["head_dim"]),
            )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self, **extra) -> dict:
        """A `config.json` dict that transformers and vLLM load; `extra` keys are added last."""
        d = {
            "architectures": [HF_ARCHITECTURES[self.arch]],
            "model_type": HF_MODEL_TYPES[self.arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "gelu_pytorch_tanh" if self.gemma else "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.arch in ("llama", "qwen3"):
            d.update(attention_bias=self.attention_bias)
        if self.arch == "llama":
            d.update(mlp_bias=False)
        elif self.arch in ("qwen2", "qwen3"):
            d.update(use_sliding_window=False, sliding_window=None)
        else:  # gemma3: both forms of its rope and layer kinds (transformers 4 and 5 read theirs)
            full = {"rope_type": "default", **dict(self.rope_scaling or {})}
            full["rope_theta"] = self.rope_theta
            d.update(
                hidden_activation="gelu_pytorch_tanh",
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types),
                rope_local_base_freq=self.rope_local_theta,
                rope_parameters={
                    FULL: full,
                    SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_theta},
                },
                query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar or self.head_dim),
                final_logit_softcapping=None,
                attn_logit_softcapping=None,
            )
        d.update(extra)
        return d


def _int_if_whole(x: float) -> int | float:
    """transformers' Gemma 3 config takes an int query_pre_attn_scalar."""
    return int(x) if float(x).is_integer() else x


def has_o_bias(cfg: TransformerConfig) -> bool:
    """Llama and Qwen3 with attention_bias have an o_proj bias too (as Hugging Face builds them);
    Qwen2 never."""
    return cfg.attention_bias and cfg.arch in ("llama", "qwen3")
