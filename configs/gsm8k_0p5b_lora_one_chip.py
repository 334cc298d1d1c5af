"""CPPO on GSM8K with Qwen2.5-0.5B-Instruct and LoRA, on one accelerator chip.

    python -m cppo_jax.launch --config configs/gsm8k_0p5b_lora_one_chip.py model.path=/models/Qwen2.5-0.5B-Instruct

configs/gsm8k_1p5b_lora_one_chip.py (the paper's GSM8K settings with LoRA rank 32, alpha 64 on every
projection, lr 1e-5) for the smaller model: the model is whatever `model.path` holds, so only the run's
name changes. `model.path` is required: a local Hugging Face folder of Qwen2.5-0.5B-Instruct.

Whether it fits a chip, and with which micro-batch, is the compiler's answer, not this file's:
benchmarks/results/aot_one_chip.md compiles it for one v5e, one v6e, one H100 and one A100
(`python -m cppo_jax.plan --config configs/gsm8k_0p5b_lora_one_chip.py --compile-for v5e:1x1 model.path=...`).
"""

import dataclasses
import runpy
from pathlib import Path

from cppo_jax.config.schema import Config

_LORA_1P5B = runpy.run_path(str(Path(__file__).with_name("gsm8k_1p5b_lora_one_chip.py")))[
    "get_config"
]


def get_config() -> Config:
    cfg = _LORA_1P5B()
    trainer = dataclasses.replace(cfg.trainer, run_name="gsm8k_0p5b_lora_one_chip")
    return dataclasses.replace(cfg, trainer=trainer)
