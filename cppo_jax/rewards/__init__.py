"""Rewards for CPPO: GSM8K and MATH accuracy and format (spec section 4), a registry, and a worker pool.

`cppo_jax.rewards.math` (math-verify, sympy) is imported on first use, so GSM8K-only runs stay light.

May import: config.
"""

from __future__ import annotations

from cppo_jax.rewards import gsm8k, registry
from cppo_jax.rewards.pool import RewardPool
from cppo_jax.rewards.registry import known_names, register, resolve

__all__ = ["RewardPool", "gsm8k", "known_names", "math", "register", "registry", "resolve"]


def __getattr__(name: str):
    if name == "math":
        import importlib

        return importlib.import_module("cppo_jax.rewards.math")
    raise AttributeError(f"module 'cppo_jax.rewards' has no attribute {name!r}")
