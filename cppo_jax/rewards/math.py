"""MATH rewards and evaluation rule, as in the released CPPO code (spec section 4), with math-verify.

- `format_reward`: the same rule as GSM8K (`cppo_jax.rewards.gsm8k.format_reward`).
- `accuracy_reward` (`math_accuracy`): gold = math-verify's first match in the reference solution (default
  LaTeX extraction); prediction = the WHOLE completion parsed with boxed answers first
  (`boxed_match_priority=0`), no unanchored matches, normalisation `nits=False, malformed_operators=False,
  basic_latex=True, equations=True, boxed="all", units=True`, first match; reward 2.0 *
  `verify(prediction, gold)` (the released order), 0.0 when verify fails. A gold that does not parse gives
  1.0 to every completion, as released (its group then has zero advantage); it is logged once and
  counted: `gold_unparsed_count()` in this process and the event `"math_gold_unparsed"` in
  `RewardPool.score`'s stats. `accuracy_reward_strict` (`math_accuracy_strict`) scores such completions 0.0.
- `eval_released` (`math_eval_released`): the released evaluation, 1.0 when `verify(gold, prediction)`
  (its order), parsed as above; a gold that does not parse is wrong.

math-verify bounds its own work with SIGALRM, which exists only in a process's main thread; elsewhere these
functions run without that bound. Untrusted completions are scored through `cppo_jax.rewards.pool.RewardPool`,
which bounds time and memory per call in worker processes. Model output is only ever read by math-verify's
LaTeX parser; nothing here evaluates it.
"""

from __future__ import annotations

import logging
import threading

from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from cppo_jax.rewards.gsm8k import format_reward
from cppo_jax.rewards.registry import note

__all__ = [
    "accuracy_reward",
    "accuracy_reward_strict",
    "eval_released",
    "format_reward",
    "gold_unparsed_count",
    "parse_gold",
    "parse_prediction",
]

logger = logging.getLogger(__name__)


class _DropDeprecationNotice(logging.Filter):
    """latex2sympy2_extended warns on every parse with `equations=True`, which the released options set."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "equations=True in NormalizationConfig is deprecated" not in record.getMessage()


logging.getLogger("latex2sympy2_extended.math_normalization").addFilter(_DropDeprecationNotice())

# Seconds for math-verify's own (SIGALRM) bound on each parse and each comparison, main thread only
# (math-verify's default, which the released code keeps).
MATH_VERIFY_TIMEOUT_S = 5

_GOLD_CONFIG = (LatexExtractionConfig(),)
_PRED_CONFIG = (
    LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False,
            malformed_operators=False,
            basic_latex=True,
            equations=True,
            boxed="all",
            units=True,
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    ),
)

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
    """math-verify's first match in the reference solution (empty when it cannot be parsed).

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
        logger.warning("MATH gold answer cannot be parsed: %.200r", solution)
    return parsed


def parse_prediction(completion: str) -> list:
    """The released parse of a whole completion: boxed answers first, anchored answers only."""
    return _parse(completion, _PRED_CONFIG)


def gold_unparsed_count() -> int:
    """How many completions this process scored against a gold answer that could not be parsed."""
    return _gold_unparsed


def _verify(gold: list, pred: list, *, gold_first: bool) -> bool:
    try:
        a, b = (gold, pred) if gold_first else (pred, gold)
        return bool(verify(a, b, timeout_seconds=_timeout_s()))
    except (Exception, TimeoutException):
        note("math_verify_error")
        return False


def _score(completion: str, solution: str, unparsed: float) -> float:
    global _gold_unparsed
    gold = parse_gold(solution)
    if not gold:
        _gold_unparsed += 1
        note("math_gold_unparsed")
        return unparsed
    return 2.0 if _verify(gold, parse_prediction(completion), gold_first=False) else 0.0


def accuracy_reward(completion: str, solution: str) -> float:
    """2.0 when math-verify finds the completion's answer equal to the gold, else 0.0; 1.0 for every
    completion of a question whose gold does not parse (released)."""
    return _score(completion, solution, unparsed=1.0)


def accuracy_reward_strict(completion: str, solution: str) -> float:
    """`accuracy_reward`, except that a gold which does not parse scores 0.0."""
    return _score(completion, solution, unparsed=0.0)


def eval_released(completion: str, solution: str) -> float:
    """The released MATH evaluation: 1.0 when `verify(gold, prediction)`, else 0.0 (no gold: 0.0)."""
    gold = parse_gold(solution)
    if not gold:
        note("math_gold_unparsed")
        return 0.0
    return 1.0 if _verify(gold, parse_prediction(completion), gold_first=True) else 0.0
