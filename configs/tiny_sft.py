"""Supervised warm start of the tiny arith model (what `make demo` runs when no warm start exists).

70% of the targets are written in the direct style (expression, then answer: mostly wrong for a tiny
model) and 30% stepwise, so that greedy decoding starts out direct and RL has a strategy to find
(docs/learning.md). The shipped cppo_jax/assets/tiny_arith was made in stages (its README).
"""

from cppo_jax.config.schema import ArchConfig, DataConfig
from cppo_jax.train.sft import SFTConfig


def get_config() -> SFTConfig:
    return SFTConfig(
        out="runs/tiny_sft",
        arch=ArchConfig(
            arch="qwen2",
            hidden_size=128,
            intermediate_size=384,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            max_position_embeddings=256,
        ),
        data=DataConfig(task="arith", train="arith", test="arith", max_prompt_len=72),
        completion_len=40,
        batch=64,
        steps=600,
        lr=3e-3,
        seed=0,
        direct_fraction=0.7,
    )
