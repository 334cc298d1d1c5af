"""GSM8K rewards and evaluation rule, as in the released CPPO code (spec section 4).

Rewards (the paper configs, registered as `gsm8k_accuracy`, `gsm8k_format`):
- `format_reward`: 1.0 when the completion, NOT stripped, matches `^<think>.*?</think>\\n<answer>.*?</answer>$`
  from its start, with DOTALL and MULTILINE (so `$` is any line end); else 0.0.
- `accuracy_reward`: the answer is the text between the LAST `<answer>` and the first `</answer>` after it
  (`extract_answer`; None when that part has no `</answer>`, or is `...`); 2.0 when it equals the gold as a
  string, 1.5 when it and the gold each hold exactly one number and the two are equal, else 0.0.
  `$1800`, `1800 dollars`, `x = 1800`, `1800.` score 1.5 against 1800; `18 + 2 = 20` scores 0.

A completion scored with both (weights 1, 1) gets one of 0, 1, 1.5, 2, 2.5, 3.

Stricter options (`gsm8k_accuracy_strict`, `gsm8k_format_strict`): the 1.5 tier only when the whole answer
is one number, any `<answer>..</answer>` block taken as the answer (the last complete one); the layout must
fill the whole (stripped) completion, nothing after `</answer>`.

`released_correct` is the released evaluation's lenient rule (`eval.rule=released`, spec section 4).
Pure string functions: nothing here evaluates model output.
"""

from __future__ import annotations

import re

__all__ = [
    "FORMAT_RE",
    "accuracy_reward",
    "accuracy_reward_strict",
    "eval_released",
    "extract_answer",
    "format_reward",
    "format_reward_strict",
    "gold_answer",
    "last_number",
    "released_correct",
    "single_number",
]

FORMAT_RE = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL | re.MULTILINE)
_FORMAT_STRICT_RE = re.compile(r"<think>.*?</think>\n<answer>.*?</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"-?\d*\.?\d+")  # the released tier-1.5 and evaluation "number"
_LAST_NUMBER_RE = re.compile(r".*?(\d+\.?\d*)")  # the released evaluation's last number (no sign)
_STRICT_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_BLOCK_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def format_reward(completion: str) -> float:
    """1.0 when `completion` starts with `<think>..</think>\\n<answer>..</answer>` then a line end."""
    return 1.0 if FORMAT_RE.match(completion) else 0.0


def format_reward_strict(completion: str) -> float:
    """1.0 when the stripped completion is exactly `<think>..</think>\\n<answer>..</answer>`."""
    return 1.0 if _FORMAT_STRICT_RE.fullmatch(completion.strip()) else 0.0


def gold_answer(solution: str) -> str:
    """The gold answer of a GSM8K solution: the text after `####`, stripped, commas removed.

    A solution without `####` is taken to be the bare answer.
    """
    parts = solution.split("####")
    text = parts[1] if len(parts) > 1 else solution
    return text.strip().replace(",", "")


def extract_answer(completion: str) -> str | None:
    """The released extraction: the part after the last `<answer>`, up to its first `</answer>`.

    None when there is no `<answer>`, when that last part has no `</answer>` (so `<answer>1800</answer>
    <answer>5` gives None), or when the answer is `...`. Stripped, commas removed.
    """
    parts = completion.split("<answer>")
    if len(parts) < 2 or "</answer>" not in parts[-1]:
        return None
    answer = parts[-1].split("</answer>")[0].strip().replace(",", "")
    return None if answer == "..." else answer


def single_number(text: str) -> float | None:
    """The number in `text` when it holds exactly one (`-?\\d*\\.?\\d+`), else None."""
    found = _NUMBER_RE.findall(text)
    return float(found[0]) if len(found) == 1 else None


def last_number(text: str) -> float | None:
    """The last unsigned number of `text` after removing `$`, `%` and commas (released evaluation)."""
    found = _LAST_NUMBER_RE.findall(text.replace("$", "").replace("%", "").replace(",", ""))
    return float(found[-1]) if found else None


def accuracy_reward(completion: str, solution: str) -> float:
    """2.0 for an exact string match, 1.5 for one equal number on each side, else 0.0 (released)."""
    gold = gold_answer(solution)
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    if pred == gold:
        return 2.0
    p, g = single_number(pred), single_number(gold)
    return 1.5 if p is not None and g is not None and p == g else 0.0


def accuracy_reward_strict(completion: str, solution: str) -> float:
    """Like `accuracy_reward`, but 1.5 only when the whole answer and the gold are each one number."""
    gold = gold_answer(solution)
    blocks = _ANSWER_BLOCK_RE.findall(completion)
    if not blocks or not gold:
        return 0.0
    pred = blocks[-1].strip().replace(",", "")
    if pred == gold:
        return 2.0
    whole = _STRICT_NUMBER_RE.fullmatch
    return 1.5 if whole(pred) and whole(gold) and float(pred) == float(gold) else 0.0


def _lenient_match(text: str, gold: str) -> bool:
    if text == gold:
        return True
    try:
        gold_value = float(gold)
    except ValueError:
        gold_value = None
    one = single_number(text)
    if one is not None and gold_value is not None and one == gold_value:
        return True
    last, gold_last = last_number(text), last_number(gold)
    return last is not None and gold_last is not None and last == gold_last


def released_correct(completion: str, solution: str) -> bool:
    """The released GSM8K evaluation: lenient, and decided by the extracted answer when there is one.

    On a text (the extracted answer when `extract_answer` finds one, else the raw completion): correct when
    it equals the gold, or holds exactly one number equal to the gold's value, or its last number equals
    the gold's last number. (The released loop also stops counting a batch at the first gold that is not
    a number; here such a question is only wrong.)
    """
    gold = gold_answer(solution)
    pred = extract_answer(completion)
    return _lenient_match(completion if pred is None else pred, gold)


def eval_released(completion: str, solution: str) -> float:
    """`released_correct` as a score for the reward workers: 1.0 or 0.0."""
    return 1.0 if released_correct(completion, solution) else 0.0
