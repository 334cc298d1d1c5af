"""MATH rewards (spec section 4), with math-verify.

- `format_reward`: the same `<think>..</think>\\n<answer>..</answer>` rule as GSM8K.
- `accuracy_reward`: gold = the `\\boxed{}` answer of the reference solution, parsed by math-verify; prediction =
  the completion parsed with boxed answers first (falling back to the content of the last `<answer>` block);
  2.0 when `math_verify.verify(gold, pred)`, else 0.0. A parse error scores 0.0. A gold that cannot be
  parsed scores 0.0 (the released code gives 1.0) and is counted: `gold_unparsed_count()` in this process,
  and the event `"math_gold_unparsed"` in `RewardPool.score`'s stats.

math-verify bounds its own work with SIGALRM, which exists only in a process's main thread; elsewhere these
functions run without that bound. Untrusted completions are scored through `cppo_jax.rewards.pool.RewardPool`,
which bounds time and memory per call in worker processes. Model output is only ever read by math-verify's
LaTeX parser; nothing here evaluates it.
"""

from __future__ import annotations

import logging
import re
import threading

from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from cppo_jax.rewards.gsm8k import format_reward
from cppo_jax.rewards.registry import note

__all__ = [
    "accuracy_reward",
    "format_reward",
    "gold_unparsed_count",
    "last_answer_block",
    "parse_gold",
    "parse_prediction",
]

logger = logging.getLogger(__name__)

# Seconds for math-verify's own (SIGALRM) bound on each parse and each comparison, main thread only.
MATH_VERIFY_TIMEOUT_S = 3
# The answer-block fallback wraps short plain answers ("5", "1/2") in $...$ for the LaTeX parser.
_MAX_WRAPPED_ANSWER_CHARS = 1000

_GOLD_CONFIG = (LatexExtractionConfig(boxed_match_priority=0),)
# math-verify's default normalisation (it repairs `\\frac12`), boxed answers first, and only anchored
# answers (boxed, "final answer is ...", "answer: ...") from the free text of a completion.
_PRED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),)
_ANSWER_BLOCK_CONFIG = (
    LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=True),
)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

_GOLD_CACHE_SIZE = 4096
_GOLD_CACHE: dict[str, tuple] = {}
_UNPARSED_LOGGED: set[str] = set()
_gold_unparsed = 0


def _timeout_s() -> int | None:
    """math-verify's SIGALRM timeouts work only in the main thread; elsewhere disable them."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(text: str, config: tuple) -> list:
    try:
        return parse(
            text,
            extraction_config=list(config),
            extraction_mode="first_match",
            parsing_timeout=_timeout_s(),
        )
    except (Exception, TimeoutException):
        note("math_parse_error")
        return []


def parse_gold(solution: str) -> list:
    """math-verify's parse of the reference solution's boxed answer (empty when it cannot be parsed).

    Parsed golds are cached (each question has G completions); failures are not, so a gold that once ran
    into a timeout is tried again.
    """
    cached = _GOLD_CACHE.get(solution)
    if cached is not None:
        return list(cached)
    parsed = _parse(solution, _GOLD_CONFIG)
    if parsed:
        if len(_GOLD_CACHE) >= _GOLD_CACHE_SIZE:
            _GOLD_CACHE.clear()
        _GOLD_CACHE[solution] = tuple(parsed)
    elif solution not in _UNPARSED_LOGGED and len(_UNPARSED_LOGGED) < _GOLD_CACHE_SIZE:
        _UNPARSED_LOGGED.add(solution)
        logger.warning(
            "MATH gold answer cannot be parsed; its completions score 0: %.200r", solution
        )
    return parsed


def last_answer_block(completion: str) -> str | None:
    """The content of the last `<answer>...</answer>` block, stripped; None if there is none."""
    matches = _ANSWER_RE.findall(completion)
    return matches[-1].strip() if matches else None


def parse_prediction(completion: str) -> list:
    """Parse a completion: boxed answers (and "final answer is ...") first, then the last answer block."""
    first = _parse(completion, _PRED_CONFIG)
    if _has_expression(first):
        return first
    content = last_answer_block(completion)
    if content:
        pred = _parse(content, _ANSWER_BLOCK_CONFIG)
        if (
            not _has_expression(pred)
            and "$" not in content
            and len(content) <= _MAX_WRAPPED_ANSWER_CHARS
        ):
            pred = _parse(f"${content}$", _ANSWER_BLOCK_CONFIG)
        if _has_expression(pred):
            return pred
    # Nothing parsed into an expression: keep math-verify's string fallback, compared as a string.
    return first


def _has_expression(parsed: list) -> bool:
    return any(not isinstance(p, str) for p in parsed)


def gold_unparsed_count() -> int:
    """How many completions this process scored 0.0 because their gold answer could not be parsed."""
    return _gold_unparsed


def accuracy_reward(completion: str, solution: str) -> float:
    """2.0 when math-verify finds the completion's answer equal to the solution's boxed answer, else 0.0."""
    global _gold_unparsed
    gold = parse_gold(solution)
    if not gold:
        _gold_unparsed += 1
        note("math_gold_unparsed")
        return 0.0
    pred = parse_prediction(completion)
    if not pred:
        return 0.0
    try:
        ok = verify(gold, pred, timeout_seconds=_timeout_s())
    except (Exception, TimeoutException):
        note("math_verify_error")
        return 0.0
    return 2.0 if ok else 0.0
