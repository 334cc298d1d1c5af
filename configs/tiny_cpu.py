"""The demo: CPPO on the tiny arith task, on a CPU, with the embedded sampler (what `make demo` runs).

Starts from the shipped warm-started checkpoint (re-created by configs/tiny_sft.py when missing),
trains with p = 0.875 and dynamic allocation (k = 2 of G = 16 kept per question, 8x the questions),
and prints held-out accuracy before and after.
"""

from pathlib import Path

import cppo_jax
from cppo_jax.config.schema import (
    Config,
    CPPOConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)

HERE = Path(__file__).resolve().parent  # configs/ (or an installed package's cppo_jax/configs)
ASSETS = Path(cppo_jax.__file__).resolve().parent / "assets"


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            init_checkpoint=str(ASSETS / "tiny_arith"),
            warm_start=str(HERE / "tiny_sft.py"),
        ),
        data=DataConfig(task="arith", train="arith", test="arith", max_prompt_len=72, num_test=256),
        rollout=RolloutConfig(backend="embedded", max_new_tokens=40, temperature=1.0),
        cppo=CPPOConfig(
            num_generations=16,
            questions_per_step=4,
            pruning_rate=0.875,
            allocation=True,
            mu=1,
            beta=0.04,
        ),
        reward=RewardConfig(funcs=("arith_accuracy", "arith_format"), weights=(1.0, 1.0)),
        optim=OptimConfig(lr=1e-4, schedule="constant", warmup_ratio=0.0),
        trainer=TrainerConfig(steps=40, out_dir="runs", run_name="tiny_cpu", checkpoint_every=20),
        logging=LoggingConfig(progress=True),
    )
