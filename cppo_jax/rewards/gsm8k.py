"""GSM8K rewards, as in the released CPPO code (spec section 4).

- `format_reward`: 1.0 when the stripped completion is `<think>...</think>`, exactly one newline,
  `<answer>...</answer>`, then the end of a line; else 0.0.
- `accuracy_reward`: 2.0 when the last `<answer>` block equals the gold answer as a string (both stripped,
  commas removed); 1.5 when both are exactly one number and equal as floats; else 0.0.

So a completion scored with both (weights 1, 1) gets one of 0, 1, 1.5, 2, 2.5, 3.
Pure string functions: nothing here evaluates model output.
"""

from __future__ import annotations

import re

__all__ = [
    "FORMAT_RE",
    "accuracy_reward",
    "extract_answer",
    "format_reward",
    "gold_answer",
]

# From the start of the stripped completion: <think> anything </think>, one newline, <answer> anything
# </answer>, then the end of a line. re.match anchors at the start; MULTILINE lets `$` be any line end.
FORMAT_RE = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.MULTILINE | re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def format_reward(completion: str) -> float:
    """1.0 when `completion` has the `<think>..</think>\\n<answer>..</answer>` layout, else 0.0."""
    return 1.0 if FORMAT_RE.match(completion.strip()) else 0.0


def gold_answer(solution: str) -> str:
    """The gold answer of a GSM8K solution: the text after the last `####`, stripped, commas removed.

    A solution without `####` is taken to be the bare answer.
    """
    _, sep, tail = solution.rpartition("####")
    text = tail if sep else solution
    return text.strip().replace(",", "")


def extract_answer(completion: str) -> str | None:
    """The content of the last `<answer>...</answer>` block, stripped, commas removed; None if there is none."""
    matches = _ANSWER_RE.findall(completion)
    if not matches:
        return None
    return matches[-1].strip().replace(",", "")


def _is_single_number(text: str) -> bool:
    return _NUMBER_RE.fullmatch(text) is not None


def accuracy_reward(completion: str, solution: str) -> float:
    """2.0 for an exact string match, 1.5 for an equal single number, else 0.0 (spec section 4)."""
    gold = gold_answer(solution)
    pred = extract_answer(completion)
    if pred is None or not gold:
        return 0.0
    if pred == gold:
        return 2.0
    if _is_single_number(pred) and _is_single_number(gold) and float(pred) == float(gold):
        return 1.5
    return 0.0
