"""CPPO on MATH with Qwen3-4B: the model the DPPO paper (arXiv 2603.04135) and TRL's async GRPO
quickstart train, with this project's MATH recipe (configs/math7b.py).

    python -m cppo_jax.launch --config math_qwen3_4b model.path=/models/Qwen3-4B \
        data.train=/data/math/train.jsonl mesh.data=4 mesh.fsdp=2

on 8 GPUs of 80 GB (the layout `mesh=auto` picks there, and XLA:GPU's compile fits: 47.5 GiB peak).

Everything but the model and the run's name is configs/math7b.py's: the released CPPO code's MATH
prompt, rewards and evaluation (MATH-500 greedy during training), G = 16, p = 0.875 with
allocation (Q = 24 questions, 48 trained completions per step), mu = 2, beta = 0.04, prompts of
512 and completions of 1024 tokens, AdamW at 1e-6. The DPPO paper's own hyperparameters are not in
the copy of it we read, so none is guessed here; override what your run needs.

Qwen3's chat template thinks by default (its completions open with <think>); the MATH format reward
does not require that block, and `data.enable_thinking=false` makes the template close an empty one
so the policy answers at once (docs/checkpoints.md). Completions of 1024 tokens cut most of Qwen3's
reasoning short: raise `rollout.max_new_tokens` where memory allows.

`model.path` (a local Hugging Face folder of Qwen3-4B) and `data.train` (the MATH training split,
docs/reproducing.md has the recipe) are required; the plan sizes the model by name without them:
`python -m cppo_jax.plan --config math_qwen3_4b --compile-for h100:8` (benchmarks/results/aot_models.md
has Qwen3-4B, Qwen3-8B and Gemma 3 4B compiled for v5e-8 and 8 H100s).
"""

import dataclasses
import runpy
from pathlib import Path

from cppo_jax.config.schema import Config

_MATH = runpy.run_path(str(Path(__file__).with_name("math7b.py")))["get_config"]


def get_config() -> Config:
    cfg = _MATH()
    trainer = dataclasses.replace(cfg.trainer, run_name="math_qwen3_4b")
    return dataclasses.replace(cfg, trainer=trainer)
