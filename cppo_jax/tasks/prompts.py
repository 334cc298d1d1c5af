"""System prompts (spec section 4) and the prompt text built from them.

`GSM8K_SYSTEM_PROMPT` and `MATH_SYSTEM_PROMPT` are the released recipes' `system_prompt` strings, byte for
byte: each is one line except for the real newline in its example `</think>\\n<answer>`, which is the
layout the format reward asks for; `{{ANSWER}}` is literal and the MATH prompt ends with a space. The paper
configs set them as `data.system_prompt`; a config that leaves it unset gets its task's prompt here.

Prompt formats (`data.prompt_format`):
- `chat`: the tokenizer's chat template over `[system, user]` messages, ending with the assistant turn
  (the released code; no system message when the system prompt is empty);
- `plain`: `system prompt + "\\n" + question + "\\n"`, no template (base models without one).
"""

from __future__ import annotations

__all__ = [
    "GSM8K_SYSTEM_PROMPT",
    "MATH_SYSTEM_PROMPT",
    "SYSTEM_PROMPT",
    "TINY_SYSTEM_PROMPT",
    "chat_messages",
    "plain_prompt",
    "resolve_system_prompt",
    "system_prompt_for",
]

_LAYOUT = (
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think>\n<answer> answer here </answer>."
)
_OPENING = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. "
)

GSM8K_SYSTEM_PROMPT = _OPENING + _LAYOUT

MATH_SYSTEM_PROMPT = (
    _OPENING + "And the answer should be of the following format: 'Therefore, the final answer is: "
    "$\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is just the final number "
    "or expression that solves the problem. " + _LAYOUT + " "
)

# Kept as the name of the GSM8K prompt (older code and notebooks import it).
SYSTEM_PROMPT = GSM8K_SYSTEM_PROMPT

# A short instruction for the tiny synthetic task, whose model has a context of a few dozen tokens.
TINY_SYSTEM_PROMPT = "Think in <think> </think>, then answer in <answer> </answer>."

_BY_TASK = {
    "gsm8k": GSM8K_SYSTEM_PROMPT,
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


def resolve_system_prompt(task: str, system_prompt: str | None) -> str:
    """`data.system_prompt` as used: None means the task's own prompt; "" means no system prompt."""
    return system_prompt_for(task) if system_prompt is None else system_prompt


def chat_messages(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """`[system, user]` messages for a chat template (no system message when `system_prompt` is empty)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return messages


def plain_prompt(question: str, system_prompt: str) -> str:
    """The `plain` format: the system prompt (when any) and the question, each on its own line."""
    head = system_prompt + "\n" if system_prompt else ""
    return f"{head}{question}\n"
