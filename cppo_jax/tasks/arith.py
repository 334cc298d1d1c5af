"""`arith`: a synthetic task of short multi-step arithmetic word problems, small enough for a tiny model.

    Tom has 12 apples. He buys 7 more and gives away 5. How many apples does he have now?
    solution:  "12+7=19\\n19-5=14\\n#### 14"     (GSM8K style, so the GSM8K rewards apply)
    reference: "<think>12+7=19;19-5=14</think>\\n<answer>14</answer>"

A problem is a start amount in 1..49 followed by 2 or 3 additions or subtractions of 1..49; every running total
stays in 0..199. Its arithmetic, `(start, (op, amount), ...)`, decides its split by a stable hash, so a test
problem's arithmetic never appears in train, whatever the seed and whatever names and objects dress it up
(about 10% test, 10% validation, 80% train). `generate` is deterministic in `(n, seed, split)`.
"""

from __future__ import annotations

import hashlib
import random
import re

__all__ = [
    "SPLITS",
    "direct_completion",
    "generate",
    "reference_completion",
    "split_of",
    "steps_of",
]

SPLITS = ("train", "validation", "test")
_NAMES = (
    ("Tom", "He"),
    ("Ann", "She"),
    ("Sam", "He"),
    ("Lily", "She"),
    ("Ben", "He"),
    ("Mia", "She"),
)
_ITEMS = ("apples", "pens", "cards", "books", "coins", "stamps", "marbles", "shells")
_ADD = ("buys {} more", "finds {} more", "gets {} more")
_SUB = ("gives away {}", "loses {}", "sells {}")
_MAX_AMOUNT = 49
_MAX_TOTAL = 199


def split_of(arithmetic: tuple) -> str:
    """The split a problem's arithmetic `(start, (op, amount), ...)` belongs to: 1 in 10 test, 1 in 10 validation."""
    digest = hashlib.blake2b(repr(arithmetic).encode(), digest_size=8).digest()
    bucket = int.from_bytes(digest, "big") % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def _draw_arithmetic(rng: random.Random) -> tuple | None:
    start = rng.randint(1, _MAX_AMOUNT)
    total, ops = start, []
    for _ in range(rng.choice((2, 3))):
        op = rng.choice("+-")
        amount = rng.randint(1, _MAX_AMOUNT)
        total = total + amount if op == "+" else total - amount
        if not 0 <= total <= _MAX_TOTAL:
            return None
        ops.append((op, amount))
    return (start, *ops)


def _phrase(arithmetic: tuple, rng: random.Random) -> str:
    name, pronoun = rng.choice(_NAMES)
    items = rng.choice(_ITEMS)
    start, *ops = arithmetic
    unused = {"+": list(_ADD), "-": list(_SUB)}  # no verb twice in one problem
    verbs = [unused[op].pop(rng.randrange(len(unused[op]))).format(amount) for op, amount in ops]
    actions = ", ".join(verbs[:-1]) + " and " + verbs[-1]
    return (
        f"{name} has {start} {items}. {pronoun} {actions}. "
        f"How many {items} does {pronoun.lower()} have now?"
    )


def _solution(arithmetic: tuple) -> tuple[str, int]:
    start, *ops = arithmetic
    total, lines = start, []
    for op, amount in ops:
        new = total + amount if op == "+" else total - amount
        lines.append(f"{total}{op}{amount}={new}")
        total = new
    lines.append(f"#### {total}")
    return "\n".join(lines), total


def generate(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`n` distinct problems of `split` as `{"question", "solution", "answer"}`, deterministic in `(n, seed, split)`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"arith/{seed}/{split}")
    seen: set[tuple] = set()
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"could not draw {n} distinct {split} problems")
        arithmetic = _draw_arithmetic(rng)
        if arithmetic is None or arithmetic in seen or split_of(arithmetic) != split:
            continue
        seen.add(arithmetic)
        solution, answer = _solution(arithmetic)
        out.append(
            {"question": _phrase(arithmetic, rng), "solution": solution, "answer": str(answer)}
        )
    return out


def steps_of(example: dict) -> list[str]:
    """The `a+b=c` steps of an example's solution."""
    return [
        line.strip()
        for line in example["solution"].split("\n")
        if line.strip() and "####" not in line
    ]


def reference_completion(example: dict) -> str:
    """The target completion for the supervised warm start: `<think>a+b=c;c-d=e</think>\\n<answer>e</answer>`."""
    return f"<think>{';'.join(steps_of(example))}</think>\n<answer>{example['answer']}</answer>"


_STEP_RE = re.compile(r"(\d+)([+-])(\d+)=(\d+)")


def direct_completion(example: dict) -> str:
    """The answer without the worked steps: `<think>12+7-5</think>\\n<answer>14</answer>`.

    The warm start's second style (`sft.direct_fraction`): the whole expression, then the answer,
    which a tiny model has to compute in one go and so mostly gets wrong, where the stepwise
    `reference_completion` is within its reach. Both have the R1 layout (format reward 1).
    """
    parts = [_STEP_RE.fullmatch(step).groups() for step in steps_of(example)]
    expression = parts[0][0] + "".join(op + amount for _, op, amount, _ in parts)
    return f"<think>{expression}</think>\n<answer>{example['answer']}</answer>"
