"""System prompts (spec section 4) and the chat messages built from them.

The prompts ask for the R1 layout. Note that the example in the prompt puts `<answer>` right after
`</think>`, while the format reward wants exactly one newline between them (as in the released code).
"""

from __future__ import annotations

__all__ = [
    "MATH_SYSTEM_PROMPT",
    "SYSTEM_PROMPT",
    "TINY_SYSTEM_PROMPT",
    "chat_messages",
    "system_prompt_for",
]

SYSTEM_PROMPT = (
    "A conversation between a User and an Assistant. The User asks a question and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed in <think> </think> tags and the answer in <answer> </answer> "
    "tags, that is, <think> reasoning process here </think><answer> answer here </answer>"
)

MATH_SYSTEM_PROMPT = (
    SYSTEM_PROMPT + ". Inside <answer> </answer>, end the answer with the sentence "
    '"Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct", '
    "where ANSWER is the final number or expression that solves the problem."
)

# A short instruction for the tiny synthetic task, whose model has a context of a few dozen tokens.
TINY_SYSTEM_PROMPT = "Think in <think> </think>, then answer in <answer> </answer>."

_BY_TASK = {
    "gsm8k": SYSTEM_PROMPT,
    "math": MATH_SYSTEM_PROMPT,
    "math500": MATH_SYSTEM_PROMPT,
    "amc23": MATH_SYSTEM_PROMPT,
    "aime24": MATH_SYSTEM_PROMPT,
    "arith": TINY_SYSTEM_PROMPT,
}


def system_prompt_for(task: str) -> str:
    """The system prompt of a task: gsm8k, math (math500, amc23, aime24) or arith."""
    try:
        return _BY_TASK[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(_BY_TASK)}") from None


def chat_messages(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """`[system, user]` messages for a chat template (no system message when `system_prompt` is None)."""
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": question})
    return messages
