"""LoRA adapters as a PEFT adapter folder: `adapter_config.json` + `adapter_model.safetensors`,
which `peft.PeftModel.from_pretrained` loads onto the transformers model of the base (and vLLM
serves with `--enable-lora`).

PEFT's layout for a Qwen2 / Llama projection `model.layers.{i}.self_attn.q_proj` is
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r] (torch Linear weights: out by in); ours are A [L, *in, r] and B [L, r, *out]
(`models/lora.py`), flattened over the heads as `hf_io` flattens the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cppo_jax.models import lora as lora_lib
from cppo_jax.models import lora_state

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# target -> PEFT's module name under model.layers.{i}
MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
_OWNER = {"q": "attn", "k": "attn", "v": "attn", "o": "attn"}  # else "mlp"


def adapter_tensors(adapters: dict[tuple, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """PEFT's tensors of `adapters` (path -> host array, `lora_state.numpy_adapters`) of a model `cfg`."""
    out = {}
    for t in cfg.lora_targets:
        owner = _OWNER.get(t, "mlp")
        a_name, b_name = lora_lib.names(t)
        a = adapters[("layers", owner, a_name)]
        b = adapters[("layers", owner, b_name)]
        r = cfg.lora_rank
        for i in range(cfg.num_layers):
            prefix = f"base_model.model.model.layers.{i}.{MODULES[t]}"
            a_in_r = a[i].reshape(-1, r)
            b_r_out = b[i].reshape(r, -1)
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a_in_r.T.astype(np.float32))
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b_r_out.T.astype(np.float32))
    return out


def adapter_config(cfg, base_model: str | Path) -> dict:
    """PEFT's `adapter_config.json` for adapters of a model `cfg` (rank, alpha and targets)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(MODULES[t].split(".")[1] for t in cfg.lora_targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
    }


def save_adapter(adapters, cfg, out: str | Path, base_model: str | Path) -> Path:
    """Writes `adapters` (an nnx.State of the `LoRAParam`s, or path -> host array) of a model
    `cfg` to the folder `out` in PEFT's layout; returns the folder (None on processes other than
    0, which join the gathers). `base_model` is recorded as `base_model_name_or_path` (the folder
    the run started from)."""
    from safetensors.numpy import save_file

    if not isinstance(adapters, dict):
        adapters = lora_state.numpy_adapters(adapters)
        if adapters is None:
            return None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(adapters, cfg)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")
    return out


def adapter_bytes(cfg) -> int:
    """Bytes of a PEFT adapter of a model `cfg` in float32 (the push size with LoRA)."""
    w = lora_lib.widths(cfg)
    per_layer = sum(cfg.lora_rank * (w[t][0] + w[t][1]) for t in cfg.lora_targets)
    return 4 * cfg.num_layers * per_layer
