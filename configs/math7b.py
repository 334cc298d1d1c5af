"""The paper's MATH run: CPPO on Qwen2.5-7B-Instruct (spec section 5).

    python -m cppo_jax.launch --config configs/math7b.py model.path=/models/Qwen2.5-7B-Instruct \
        data.train=/data/math/train.jsonl mesh.data=1 mesh.fsdp=4 trainer.micro_batch=16

on 4 GPUs of 80 GB: the 7B parameters, AdamW moments and reference model sharded 4 ways over `fsdp`
(56 GiB planned per GPU; one GPU would need 245 GiB). `launch/gpu_node.sh` picks such a mesh itself
(docs/reproducing.md).

Two values are required and have no default, because nothing is downloaded:
- `model.path`: a local Hugging Face folder;
- `data.train`: a local .jsonl/.jsonl.gz/.parquet file (or a folder holding train.jsonl) of the MATH
  training split, 7500 problems with `problem` and `solution` fields (the released code trains on
  DigitalLearningGmbH/MATH-lighteval); the answer is the last \\boxed{} of each solution.

The settings the paper shares with the GSM8K run are taken from configs/gsm8k_1p5b.py (G = 16, mu = 2,
beta = 0.04, eps = 0.2, temperature 1.0, AdamW at 1e-6 with cosine decay after a 10% warm-up, no weight
decay, grad-norm clip 1.0, prompts of 512 and completions of 1024 tokens, one epoch); this file sets what
differs: rewards MATH accuracy + format with weights 1, 1 and the MATH system prompt (the
answer ends with "Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct"). The test
split during training is MATH-500 (greedy); `python -m cppo_jax.evaluate` adds AMC23 and AIME24
(mean of 4 samples at T 0.6, top-p 0.95, 3072 tokens).

Default: the paper's headline CPPO setting, p = 0.875 with dynamic allocation. The paper trains 16
completions per GPU on 3 training GPUs, i.e. b = 3 questions per step for GRPO; with allocation CPPO draws
Q = floor(3 / (1 - p)) = 24 questions and keeps k = 2 of 16 completions each (48 trained, as GRPO's 3 x 16).
Overrides: `cppo.pruning_rate=0.0` (GRPO), `0.5 | 0.75 | 0.9375`; `cppo.allocation=false` (pruning alone).

Rollouts use the embedded JAX sampler; on a GPU node with a vLLM server use
`rollout.backend=vllm rollout.vllm_url=http://127.0.0.1:8000` (see docs/vllm.md). In-training validation
on problems held out of train (never the test set): `data.val_size=200 trainer.eval_every=100`.
Check everything first, reading no weights: add `trainer.dry_run=true` (with `--devices N
--device-memory-gb GB` for GPUs other than this machine's).
"""

import dataclasses
from pathlib import Path

from cppo_jax.config.files import load_config
from cppo_jax.config.schema import Config
from cppo_jax.tasks.prompts import MATH_SYSTEM_PROMPT

HERE = Path(__file__).resolve().parent

# A value `cppo_jax.launch` refuses to run with: it must be overridden on the command line.
MATH_TRAIN_REQUIRED = (
    "<required: a local .jsonl/.jsonl.gz/.parquet file of the MATH training split with fields "
    "problem and solution (nothing is downloaded); set data.train=/path/to/math_train.jsonl>"
)


def get_config() -> Config:
    base = load_config(HERE / "gsm8k_1p5b.py")  # the settings both paper runs share
    return dataclasses.replace(
        base,
        # remat "full" (each layer keeps only its input): the 7B layers' projections that
        # "minimal" keeps put 48 rows over 4 GPUs of 80 GB past their memory (the plan: 98.5 GiB).
        model=dataclasses.replace(base.model, remat="full"),
        data=dataclasses.replace(
            base.data,
            task="math",
            train=MATH_TRAIN_REQUIRED,
            test="math500",
            system_prompt=MATH_SYSTEM_PROMPT,  # the released recipe's, byte for byte
        ),
        cppo=dataclasses.replace(
            base.cppo,
            questions_per_step=3,
            slices=3,  # one per training process (GPU) of the released run
        ),
        reward=dataclasses.replace(
            base.reward,
            funcs=("math_accuracy", "math_format"),
            timeout_s=10.0,
            num_workers=8,
        ),
        trainer=dataclasses.replace(base.trainer, run_name="math7b", checkpoint_every=50),
    )
