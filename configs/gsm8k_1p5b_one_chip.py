"""CPPO on GSM8K with Qwen2.5-1.5B-Instruct, full fine-tuning, on one accelerator chip.

    python -m cppo_jax.launch --config configs/gsm8k_1p5b_one_chip.py model.path=/models/Qwen2.5-1.5B-Instruct

Derived from configs/gsm8k_1p5b.py (the paper's GSM8K settings: G = 16, p = 0.875 with allocation, so
Q = 8 questions and 16 trained completions per step, mu = 2, beta = 0.04, prompts of 512 and
completions of 1024 tokens, the embedded sampler); what changes is only what one chip needs.
`model.path` is required: a local Hugging Face folder of Qwen2.5-1.5B-Instruct.

Full fine-tuning: float32 params and AdamW state (12 bytes per parameter) beside a bfloat16
reference.

Whether it fits a chip, and with which micro-batch, is the compiler's answer, not this file's:
benchmarks/results/aot_one_chip.md compiles it for one v5e, one v6e, one H100 and one A100
(`python -m cppo_jax.plan --config configs/gsm8k_1p5b_one_chip.py --compile-for v5e:1x1 model.path=...`).
"""

import dataclasses
import runpy
from pathlib import Path

from cppo_jax.config.schema import Config

_PAPER = runpy.run_path(str(Path(__file__).with_name("gsm8k_1p5b.py")))["get_config"]


def get_config() -> Config:
    cfg = _PAPER()
    trainer = dataclasses.replace(cfg.trainer, run_name="gsm8k_1p5b_one_chip")
    return dataclasses.replace(cfg, trainer=trainer)
