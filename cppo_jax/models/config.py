"""Architecture and numerics of a decoder (`TransformerConfig`), and its Hugging Face `config.json` form."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from cppo_jax.config_choices import ATTENTION_KINDS, REMAT_POLICIES, remat_policy
from cppo_jax.models.rope import normalize_scaling

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture and numerics of a Qwen2 or Llama decoder.

    `attention_bias` defaults to the architecture's choice (qwen2: q/k/v biases; llama: none).
    For llama, `attention_bias=True` also adds an o_proj bias, as Hugging Face does.
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
    # `lora_targets` names (config_choices.LORA_TARGETS), scaled by lora_alpha / lora_rank.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()

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
        archs = list(d.get("architectures") or [])
        supported = ", ".join(f"{a} ({t})" for t, a in HF_ARCHITECTURES.items())
        if model_type not in HF_ARCHITECTURES or any(
            a != HF_ARCHITECTURES[model_type] for a in archs
        ):
            raise ValueError(
                f"unsupported architecture {archs or model_type!r} (model_type {model_type!r}); "
                f"supported: {supported}"
            )
        # transformers 4 writes `rope_theta` + `rope_scaling`; transformers 5 one `rope_parameters`.
        rope = {**(d.get("rope_parameters") or {}), **(d.get("rope_scaling") or {})}
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")

        def need(key):
            if key not in d:
                raise ValueError(f"config is missing {key!r}")
            return d[key]

        heads = need("num_attention_heads")
        kwargs = dict(
            arch=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or need("hidden_size") // heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            rope_scaling=rope or None,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self, **extra) -> dict:
        """A `config.json` dict that transformers and vLLM load; `extra` keys are added last."""
        d = {
            "architectures": [HF_ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.arch == "llama":
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
        else:
            d.update(use_sliding_window=False, sliding_window=None)
        d.update(extra)
        return d


def has_o_bias(cfg: TransformerConfig) -> bool:
    """Llama with attention_bias has an o_proj bias too (as Hugging Face builds it); Qwen2 never."""
    return cfg.attention_bias and cfg.arch == "llama"
