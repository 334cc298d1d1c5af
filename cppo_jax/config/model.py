"""The model's sections of the run config: `ModelConfig`, with the architecture of a randomly
initialised model (`ArchConfig`) and the low-rank adapters (`LoraConfig`). Host code: imports no JAX.
"""

from __future__ import annotations

import dataclasses

from cppo_jax.config.choices import (
    ARCHS,
    ATTENTION_KINDS,
    DTYPES,
    LORA_TARGETS,
    REMAT_POLICIES,
    ConfigError,
    _check,
    _choice,
    remat_policy,
)


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    """Architecture of a randomly initialised model (used when `model.path` is empty)."""

    arch: str = "qwen2"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 512

    def __post_init__(self):
        _choice("model.arch.arch", self.arch, ARCHS)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            _check(getattr(self, name) > 0, f"model.arch.{name}", getattr(self, name), "> 0")
        _check(
            self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            "model.arch.num_kv_heads",
            self.num_kv_heads,
            f"a positive divisor of num_heads={self.num_heads}",
        )


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the decoder's projections: W x + (alpha / rank) B A x, the base W
    frozen and only A [in, rank], B [rank, out] (B zero at the start) trained. `enabled=false`
    (default): full fine-tuning. The rank is also checked against each target's width when the
    model is built (`models.lora.check`)."""

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS  # any of LORA_TARGETS
    dropout: float = 0.0  # only 0 (the RL peers' setting): the forward is deterministic

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        _check(
            isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank > 0,
            "model.lora.rank",
            self.rank,
            "a positive integer",
        )
        _check(self.alpha > 0, "model.lora.alpha", self.alpha, "> 0")
        _check(self.dropout == 0, "model.lora.dropout", self.dropout, "0 (no dropout)")
        for t in self.targets:
            _choice("model.lora.targets", t, LORA_TARGETS)
        _check(
            len(self.targets) > 0 and len(set(self.targets)) == len(self.targets),
            "model.lora.targets",
            self.targets,
            "a non-empty list without repeats",
        )


# LoRA's recipe where full fine-tuning does not fit (the one-chip configs and `plan --compile-for`'s
# fallback): rank 32, alpha 64 on every projection, and LoRA's usual learning rate of 1e-5 in place
# of full fine-tuning's 1e-6 (the adapters start at zero and need the larger step). As overrides.
LORA_RECIPE = (
    "model.lora.enabled=true",
    "model.lora.rank=32",
    "model.lora.alpha=64",
    "optim.lr=1e-05",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # a local Hugging Face folder; never a hub name (nothing is downloaded)
    tokenizer: str = ""  # defaults to `path`
    init_checkpoint: str = ""  # a warm-start HF folder to start the policy (and reference) from
    warm_start: str = ""  # an SFT config file that creates `init_checkpoint` when it is missing
    arch: ArchConfig = ArchConfig()
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    remat: str | bool = (
        "dots_saveable"  # REMAT_POLICIES; a boolean: true = full, false = dots_saveable
    )
    scan_layers: bool = True  # layers under one lax.scan (compiled once); false: unrolled
    # The sampler's cached steps always use einsum; xla is jax.nn.dot_product_attention anywhere.
    attention: str = "einsum"  # einsum (ours), cudnn (GPU kernel, bf16), splash (TPU), xla
    lora: LoraConfig = LoraConfig()  # low-rank adapters on a frozen base (off by default)

    def __post_init__(self):
        _choice("model.dtype", self.dtype, DTYPES)
        _choice("model.param_dtype", self.param_dtype, DTYPES)
        _choice("model.attention", self.attention, ATTENTION_KINDS)
        object.__setattr__(self, "remat", remat_policy(self.remat))
        _choice("model.remat", self.remat, REMAT_POLICIES)
        if self.attention == "cudnn" and self.dtype != "bfloat16":
            raise ConfigError(
                f"model.attention=cudnn needs model.dtype=bfloat16 (cuDNN's fused attention takes "
                f"16-bit inputs), got model.dtype={self.dtype}"
            )

    @property
    def start_folder(self) -> str:
        """The folder the policy (and the reference) start from: `init_checkpoint`, else `path`."""
        return self.init_checkpoint or self.path

    @property
    def tokenizer_folder(self) -> str:
        return self.tokenizer or self.start_folder
