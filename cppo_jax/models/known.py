"""The sizes of the paper's models, and the exact parameter count of any config.json.

`KNOWN_MODELS` holds the released config.json fields of the paper's two policies, of Qwen2.5-0.5B (the
one-chip configs) and of Qwen3-4B / 8B
and Gemma 3 1B / 4B (those that fix the parameter count), so a plan can size a model whose folder is not on this machine; `find_known_model`
recognises them by name ("Qwen2.5-7B-Instruct", "math7b", "gsm8k_1p5b", ...). `model_size` counts the
parameters from the tensors this project's loader reads (`hf_io.name_table`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

__all__ = [
    "KNOWN_MODELS",
    "ModelSize",
    "config_model_size",
    "find_known_model",
    "model_size",
    "transformer_config",
]

# config.json of the paper's models (the fields that fix the parameter count).
KNOWN_MODELS: dict[str, dict] = {
    # One-chip configs (configs/gsm8k_0p5b*_one_chip.py): the smallest Qwen2.5 instruct model.
    "Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen2.5-1.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    # The models the RL frameworks of 2026 train (issue 48): Qwen3-4B / 8B (TRL, verl, the DPPO
    # paper) and Gemma 3 1B (tunix), from their released config.json files.
    "Qwen3-4B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "torch_dtype": "bfloat16",
    },
    # Gemma 3 4B (tunix's GSM8K recipes): the released checkpoint is the image-text
    # Gemma3ForConditionalGeneration; these are its text_config's fields, the decoder this project
    # trains (Gemma3ForCausalLM), with its vocabulary of 262,208 (the 1B's 262,144 + image tokens).
    "gemma-3-4b-it": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "torch_dtype": "bfloat16",
    },
}
# Names that identify a known model: "Qwen2.5-1.5B-Instruct", "qwen2_5_1p5b", "gsm8k_1p5b", "math7b", ...
_NAME_PATTERNS = (
    ("Qwen2.5-0.5B-Instruct", re.compile(r"(?<![\d.])0[._p]5b(?![a-z\d])")),
    ("Qwen2.5-1.5B-Instruct", re.compile(r"(?<![\d.])1[._p]5b(?![a-z\d])")),
    ("Qwen2.5-7B-Instruct", re.compile(r"(?<![\d.])7b(?![a-z\d])")),
    ("Qwen3-4B", re.compile(r"qwen3[-_]4b(?![a-z\d])")),
    ("Qwen3-8B", re.compile(r"qwen3[-_]8b(?![a-z\d])")),
    ("gemma-3-1b-it", re.compile(r"gemma[-_]?3[-_]1b(?![a-z\d])")),
    ("gemma-3-4b-it", re.compile(r"gemma[-_]?3[-_]4b(?![a-z\d])")),
)


def find_known_model(*names: str) -> str | None:
    """The `KNOWN_MODELS` entry the first matching name points to (a path's last part, a run name)."""
    for name in names:
        if not name:
            continue
        text = Path(name).name.lower() or name.lower()
        for known, pattern in _NAME_PATTERNS:
            if pattern.search(text):
                return known
    return None


@dataclasses.dataclass(frozen=True)
class ModelSize:
    source: str  # where the architecture came from
    params: int
    hf_config: dict

    @property
    def layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])


def model_size(hf_config: dict, source: str = "config.json") -> ModelSize:
    """Exact parameter count of a config.json dict, from the tensors this project's loader reads."""
    from cppo_jax.models.hf_io import name_table
    from cppo_jax.models.transformer import TransformerConfig

    try:
        tcfg = TransformerConfig.from_hf_dict(hf_config)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    params = sum(math.prod(entry.nnx_shape) for entry in name_table(tcfg))
    return ModelSize(source, params, dict(hf_config))


def config_model_size(cfg) -> ModelSize | None:
    """The size of `cfg`'s model (a `Config`): its folder's config.json, else a known model named
    by the model path, checkpoint, tokenizer or run name; None when neither says."""
    folder = cfg.model.start_folder
    config_file = Path(folder) / "config.json" if folder else None
    if config_file is not None and config_file.is_file():
        try:
            hf = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file}: not valid JSON ({e})") from e
        return model_size(hf, str(config_file))
    known = find_known_model(
        cfg.model.path, cfg.model.init_checkpoint, cfg.model.tokenizer, cfg.trainer.run_name
    )
    if known is None:
        return None
    return model_size(KNOWN_MODELS[known], f"known sizes of {known} (by name; no config.json)")


def transformer_config(cfg, size: ModelSize):
    """The TransformerConfig a run of `cfg` (a `Config`) builds for a model of `size`."""
    from cppo_jax.models.transformer import TransformerConfig

    m = cfg.model
    return TransformerConfig.from_hf_dict(
        size.hf_config,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        remat=m.remat,
        scan_layers=m.scan_layers,
        attention=m.attention,
    )
