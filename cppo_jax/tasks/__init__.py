"""Tasks: system prompts, the synthetic `arith` task, and its tiny tokenizer (`cppo_jax.tasks.tiny_tokenizer`).

May import: nothing of the package.
"""

from __future__ import annotations

from cppo_jax.tasks import arith, prompts
from cppo_jax.tasks.prompts import (
    MATH_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    TINY_SYSTEM_PROMPT,
    chat_messages,
)

__all__ = [
    "MATH_SYSTEM_PROMPT",
    "SYSTEM_PROMPT",
    "TINY_SYSTEM_PROMPT",
    "arith",
    "chat_messages",
    "prompts",
]
