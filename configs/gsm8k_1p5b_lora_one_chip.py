"""CPPO on GSM8K with Qwen2.5-1.5B-Instruct and LoRA, on one accelerator chip.

    python -m cppo_jax.launch --config configs/gsm8k_1p5b_lora_one_chip.py model.path=/models/Qwen2.5-1.5B-Instruct

Derived from configs/gsm8k_1p5b.py (the paper's GSM8K settings: G = 16, p = 0.875 with allocation, so
Q = 8 questions and 16 trained completions per step, mu = 2, beta = 0.04, prompts of 512 and
completions of 1024 tokens, the embedded sampler); what changes is only what one chip needs.
`model.path` is required: a local Hugging Face folder of Qwen2.5-1.5B-Instruct.

LoRA (`config_model.LORA_RECIPE`: rank 32, alpha 64, on every projection): only the adapters are
trained (float32, with their AdamW state); the base is frozen in bfloat16 and is also the reference (no second copy), so a
1.5B run needs about a third of full fine-tuning's memory. The learning rate is LoRA's usual
1e-5 rather than full fine-tuning's 1e-6.

Whether it fits a chip, and with which micro-batch, is the compiler's answer, not this file's:
benchmarks/results/aot_one_chip.md compiles it for one v5e, one v6e, one H100 and one A100
(`python -m cppo_jax.plan --config configs/gsm8k_1p5b_lora_one_chip.py --compile-for v5e:1x1 model.path=...`).
"""

import dataclasses
import runpy
from pathlib import Path

from cppo_jax.config.files import apply_overrides
from cppo_jax.config.model import LORA_RECIPE
from cppo_jax.config.schema import Config

_PAPER = runpy.run_path(str(Path(__file__).with_name("gsm8k_1p5b.py")))["get_config"]


def get_config() -> Config:
    cfg = apply_overrides(_PAPER(), list(LORA_RECIPE))
    trainer = dataclasses.replace(cfg.trainer, run_name="gsm8k_1p5b_lora_one_chip")
    return dataclasses.replace(cfg, trainer=trainer)
