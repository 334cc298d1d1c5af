"""Rewards (spec section 4), the registry, and the time- and memory-bounded RewardPool."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cppo_jax.data import datasets
from cppo_jax.rewards import RewardPool, gsm8k, registry
from cppo_jax.rewards import math as math_rewards

# ----- GSM8K accuracy and format (spec section 4, every consequence it lists) -----

GOLD = "She has 12 + 2 = <<12+2=14>>14 apples.\n#### 14"
GOLD_1800 = "Steps.\n#### 1,800"


def completion(answer: str, think: str = "12+2=14", sep: str = "\n") -> str:
    return f"<think>{think}</think>{sep}<answer>{answer}</answer>"


@pytest.mark.parametrize(
    ("answer", "solution", "expected"),
    [
        ("14", GOLD, 2.0),
        (" 14 ", GOLD, 2.0),
        ("14.0", GOLD, 1.5),
        ("15", GOLD, 0.0),
        ("1,234", "#### 1234", 2.0),
        ("1234", "#### 1,234", 2.0),
        ("-3", "#### -3", 2.0),
        ("-3.0", "#### -3", 1.5),
        ("3", "#### -3", 0.0),
        # The released 1.5 tier: exactly one number anywhere in the answer, equal as floats.
        ("1800", GOLD_1800, 2.0),
        ("$1800", GOLD_1800, 1.5),
        ("1800 dollars", GOLD_1800, 1.5),
        ("x = 1800", GOLD_1800, 1.5),
        ("1800.", GOLD_1800, 1.5),
        ("The answer is 1800", GOLD_1800, 1.5),
        ("$1,800.00", GOLD_1800, 1.5),
        ("18 + 2 = 20", "#### 20", 0.0),  # three numbers
        ("1800 or 1900", GOLD_1800, 0.0),
        ("0.5", "#### .5", 1.5),  # ".5" is a number to the released pattern
        ("...", "#### ...", 0.0),  # "..." is no answer, even against itself
        ("", GOLD, 0.0),
    ],
)
def test_gsm8k_accuracy_tiers(answer, solution, expected):
    assert gsm8k.accuracy_reward(completion(answer), solution) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>7</answer> wait <answer>14</answer>", 2.0),  # the last block counts
        ("<answer>14</answer> wait <answer>7</answer>", 0.0),
        ("<answer>14</answer> <answer>5", 0.0),  # the last part has no closing tag: None
        ("<answer>14</answer> <answer>5</answer>", 0.0),
        (
            "<answer>14</answer></answer>",
            2.0,
        ),  # up to the first closing tag after the last <answer>
        ("<answer>14", 0.0),
        ("14", 0.0),  # no answer tag
    ],
)
def test_gsm8k_extraction_splits_on_the_last_answer_tag(text, expected):
    assert gsm8k.accuracy_reward("<think>a</think>\n" + text, GOLD) == expected


def test_gsm8k_extract_answer_and_gold():
    assert gsm8k.extract_answer("<answer>1800</answer> <answer>5") is None
    assert gsm8k.extract_answer("<answer> 1,800 </answer>") == "1800"
    assert gsm8k.extract_answer("<answer>...</answer>") is None
    assert gsm8k.extract_answer("no tags") is None
    assert gsm8k.gold_answer("steps\n#### 1,234 ") == "1234"
    assert gsm8k.gold_answer("42") == "42"


@pytest.mark.parametrize(
    ("answer", "solution", "expected"),
    [
        ("14", GOLD, 2.0),
        ("14.0", GOLD, 1.5),
        ("$1800", GOLD_1800, 0.0),  # strict: the whole answer must be one number
        ("1800 dollars", GOLD_1800, 0.0),
        ("1800.", GOLD_1800, 0.0),
        ("1,800.0", GOLD_1800, 1.5),
    ],
)
def test_gsm8k_strict_accuracy_is_a_separate_option(answer, solution, expected):
    assert gsm8k.accuracy_reward_strict(completion(answer), solution) == expected
    assert registry.resolve("gsm8k_accuracy_strict") is gsm8k.accuracy_reward_strict
    assert registry.resolve("gsm8k_accuracy") is gsm8k.accuracy_reward


@pytest.mark.parametrize(
    ("text", "released", "strict"),
    [
        ("<think>x</think>\n<answer>1</answer>", 1.0, 1.0),
        ("<think>x\ny</think>\n<answer>1\n2</answer>", 1.0, 1.0),  # DOTALL
        ("  \n<think>x</think>\n<answer>1</answer>", 0.0, 1.0),  # released: not stripped
        (" <think>x</think>\n<answer>1</answer>", 0.0, 1.0),
        ("<think>x</think>\n<answer>1</answer>\n  ", 1.0, 1.0),
        ("<think>x</think><answer>1</answer>", 0.0, 0.0),  # the newline is required
        ("<think>x</think>\n\n<answer>1</answer>", 0.0, 0.0),
        ("<think>x</think> \n<answer>1</answer>", 0.0, 0.0),
        ("Sure! <think>x</think>\n<answer>1</answer>", 0.0, 0.0),  # from the start
        ("<think>x</think>\n<answer>1</answer>\nmore text", 1.0, 0.0),  # `$` at any line end
        ("<think>x</think>\n<answer>1</answer> trailing", 0.0, 0.0),
        ("<think>x</think>\n<answer>1", 0.0, 0.0),
    ],
)
def test_format_reward(text, released, strict):
    assert gsm8k.format_reward(text) == released
    assert math_rewards.format_reward(text) == released
    assert gsm8k.format_reward_strict(text) == strict


@pytest.mark.parametrize(
    ("text", "total"),
    [
        ("I think it is 14.", 0.0),
        (completion("15"), 1.0),
        ("<answer>14.0</answer>", 1.5),
        ("<answer>14</answer>", 2.0),
        (completion("14.0"), 2.5),
        (completion("14"), 3.0),
    ],
)
def test_gsm8k_totals(text, total):
    assert gsm8k.format_reward(text) + gsm8k.accuracy_reward(text, GOLD) == total


# ----- the released GSM8K evaluation rule (eval.rule=released) -----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # An extracted answer decides: exact, exactly one number, or the last number.
        (completion("1800"), True),
        (completion("$1,800"), True),
        (completion("18 + 2 = 1800"), True),  # the last number
        (completion("1800 or 1900"), False),
        (completion("1800%"), True),
        (completion("1800.5"), False),
        (completion("-1800"), True),  # the last-number pattern has no sign: 1800 == 1800
        # ... even when the raw text would have counted.
        ("The answer is 1800. <answer>12</answer>", False),
        # Without an extractable answer the raw text decides.
        ("so she pays $1,800 in total", True),
        ("18 + 2 = 20, times 90 is 1800", True),
        ("1800 is wrong, it is 1900", False),
        ("<answer>1800</answer> <answer>5", False),  # raw text: last number 5
        ("<answer>5</answer> <answer>1800", True),  # raw text: last number 1800
        ("no number at all", False),
    ],
)
def test_released_evaluation_rule(text, expected):
    assert gsm8k.released_correct(text, GOLD_1800) is expected
    assert gsm8k.eval_released(text, GOLD_1800) == float(expected)


def test_released_rule_never_raises_on_a_gold_that_is_not_a_number():
    """The released loop stops counting its batch when float(gold) raises; here the question is only
    judged (exact match still counts)."""
    assert gsm8k.released_correct(completion("five"), "#### five") is True
    assert gsm8k.released_correct(completion("six"), "#### five") is False
    assert gsm8k.released_correct("no tags, 5", "#### five") is False


def test_released_rule_is_more_lenient_than_the_accuracy_reward():
    lenient_only = [completion("18 + 2 = 1800"), "she pays $1800"]
    for text in lenient_only:
        assert gsm8k.released_correct(text, GOLD_1800)
        assert gsm8k.accuracy_reward(text, GOLD_1800) == 0.0
    for answer in ("1800", "$1800", "1800.", "x = 1800", "15", "18 + 2 = 20"):
        text = completion(answer)
        if gsm8k.accuracy_reward(text, GOLD_1800) > 0:  # strict => released
            assert gsm8k.released_correct(text, GOLD_1800)


# ----- MATH accuracy (the released options) -----


def math_completion(answer: str) -> str:
    return completion(
        f"Therefore, the final answer is: $\\boxed{{{answer}}}$. I hope it is correct", "..."
    )


@pytest.mark.parametrize(
    ("gold", "pred", "expected"),
    [
        ("\\frac{1}{2}", "0.5", 2.0),
        ("\\frac{1}{2}", "\\dfrac{1}{2}", 2.0),
        ("[1, 2)", "[1,2)", 2.0),
        ("[1, 2)", "(1, 2)", 0.0),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})", 2.0),
        ("3", "4", 0.0),
        ("x^2+2x+1", "(x+1)^2", 2.0),
        ("5", "x = 5", 2.0),  # equations=True: the right-hand side
        ("5", "5\\text{ cm}", 2.0),  # units=True
    ],
)
def test_math_equivalences(gold, pred, expected):
    solution = f"We find that the answer is $\\boxed{{{gold}}}$."
    assert math_rewards.accuracy_reward(math_completion(pred), solution) == expected
    assert math_rewards.eval_released(math_completion(pred), solution) == expected / 2


def test_math_released_options_parse_the_whole_completion_boxed_first():
    solution = "So $x = \\boxed{5}$."
    # Only anchored answers count (try_extract_without_anchor=False): a bare answer block scores 0.
    assert math_rewards.accuracy_reward("<think>x</think>\n<answer>5</answer>", solution) == 0.0
    # A boxed answer anywhere in the completion (first match, boxed first) counts, also in the thinking.
    text = "<think>\\boxed{5}</think>\n<answer>6</answer>"
    assert math_rewards.accuracy_reward(text, solution) == 2.0
    text = "<think>x</think>\n<answer>The final answer is $5$</answer>"
    assert math_rewards.accuracy_reward(text, solution) == 2.0
    # nits=False, malformed_operators=False: `\frac12` is not repaired.
    assert (
        math_rewards.accuracy_reward(math_completion("\\frac12"), "$\\boxed{\\frac{1}{2}}$") == 0.0
    )
    assert math_rewards.accuracy_reward("no answer at all", solution) == 0.0


def test_math_unparsable_gold_scores_one_as_released_and_is_counted():
    registry.drain_notes()
    before = math_rewards.gold_unparsed_count()
    no_gold = "a solution without any answer"
    assert math_rewards.accuracy_reward(math_completion("5"), no_gold) == 1.0
    assert math_rewards.accuracy_reward("anything", no_gold) == 1.0
    assert math_rewards.accuracy_reward_strict(math_completion("5"), no_gold) == 0.0
    assert math_rewards.eval_released(math_completion("5"), no_gold) == 0.0
    assert math_rewards.gold_unparsed_count() == before + 3
    assert registry.drain_notes().get("math_gold_unparsed") == 4


# ----- registry -----


def test_registry_names_and_errors():
    names = registry.known_names()
    for name in (
        "gsm8k_accuracy",
        "gsm8k_format",
        "math_accuracy",
        "math_format",
        "arith_accuracy",
        "arith_format",
    ):
        assert name in names
        assert callable(registry.resolve(name))
    assert registry.resolve("arith_accuracy") is gsm8k.accuracy_reward
    assert registry.resolve("cppo_jax.rewards.gsm8k:format_reward") is gsm8k.format_reward
    with pytest.raises(ValueError, match="gsm8k_accuracy"):
        registry.resolve("no_such_reward")
    with pytest.raises(ValueError, match="known rewards"):
        registry.resolve("no_such_module.fn")
    with pytest.raises(ValueError, match="top level"):
        registry.register("bad")(lambda c, s: 0.0)
    with pytest.raises(ValueError, match="importable"):
        registry.qualified_name(lambda c, s: 0.0)


@registry.register("test_length_reward")
def length_reward(completion: str, solution: str) -> float:
    return float(len(completion))


def test_register_decorator():
    assert registry.resolve("test_length_reward") is length_reward
    assert registry.reference("test_length_reward").endswith(":length_reward")


# ----- RewardPool -----

TIMEOUT_S = 1.5
SLACK_S = 15.0  # kill, plus a replacement worker starting on a loaded 2-core machine (a hang is unbounded)


def hostile_reward(completion: str, solution: str) -> float:
    """A reward that misbehaves on request (module level, so that pool workers can import it)."""
    if completion == "sleep":
        time.sleep(600)
    if completion == "crash":
        os._exit(3)
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "nan":
        return float("nan")
    if completion == "hog":
        block = bytearray(3 << 30)  # beyond the pool's memory limit: MemoryError
        return float(len(block))
    if completion == "jax?":
        return float("jax" in sys.modules)
    return 1.0


@pytest.fixture(scope="module")
def math_pool():
    with RewardPool(
        [("accuracy", 1.0, "math_accuracy"), ("format", 1.0, "math_format")],
        num_workers=2,
        timeout_s=TIMEOUT_S,
    ) as pool:
        yield pool


def test_pool_matches_in_process_scores(math_pool):
    completions = [math_completion(a) for a in ("\\frac{1}{2}", "0.5", "3")] + [
        "<answer>1/2</answer>",
        "",
    ]
    solutions = ["\\boxed{\\frac{1}{2}}"] * len(completions)
    total, per_func, stats = math_pool.score(completions, solutions)
    expected_acc = [math_rewards.accuracy_reward(c, s) for c, s in zip(completions, solutions)]
    expected_fmt = [math_rewards.format_reward(c) for c in completions]
    assert per_func["accuracy"].tolist() == expected_acc == [2.0, 2.0, 0.0, 0.0, 0.0]
    assert per_func["format"].tolist() == expected_fmt
    assert total.dtype == np.float64 and total.tolist() == [
        a + f for a, f in zip(expected_acc, expected_fmt)
    ]
    assert stats["timeouts"] == 0 and stats["errors"] == 0
    assert math_pool.score([], [])[0].shape == (0,)
    with pytest.raises(ValueError, match="differ in length"):
        math_pool.score(["a"], [])


HOSTILE = {
    "power tower": "<answer>$\\boxed{10^{10^{10^{10}}}}$</answer>",
    "deep fractions": "\\boxed{" + "\\frac{" * 3000 + "1}{2}" * 3000 + "}",
    "one megabyte": "\\boxed{" + "x^{2}+\\sqrt{y}-" * (1 << 16) + "1}",
    "unclosed boxed": "The answer is \\boxed{" + "\\frac{1}{2" * 1000,
}


def test_pool_bounds_time_on_hostile_latex(math_pool):
    timeouts = 0
    for name, text in HOSTILE.items():
        t0 = time.monotonic()
        total, per_func, stats = math_pool.score([text], ["\\boxed{2}"])
        elapsed = time.monotonic() - t0
        assert per_func["accuracy"][0] == 0.0, name
        assert elapsed < TIMEOUT_S + SLACK_S, (name, elapsed)
        timeouts += stats["timeouts"]
    assert timeouts >= 1
    assert math_pool.totals["restarts"] >= timeouts
    # The pool still works afterwards.
    total, _, stats = math_pool.score(
        [math_completion("2"), math_completion("3")], ["\\boxed{2}"] * 2
    )
    assert total.tolist() == [3.0, 1.0]
    assert stats["timeouts"] == 0


def test_pool_kills_hung_crashed_and_greedy_workers():
    with RewardPool(
        [("hostile", 2.0, hostile_reward)],
        num_workers=2,
        timeout_s=TIMEOUT_S,
        memory_limit_bytes=1 << 30,
    ) as pool:
        t0 = time.monotonic()
        texts = ["ok", "sleep", "ok", "crash", "raise", "nan", "hog", "ok", "jax?"]
        total, per_func, stats = pool.score(texts, [""] * len(texts))
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
        assert per_func["hostile"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert total.tolist() == [2.0 * v for v in per_func["hostile"]]
        assert stats["timeouts"] == 1
        assert stats["errors"] == 4  # crash, raise, nan, hog
        assert stats["restarts"] == 2  # the sleeper and the crash
        total, _, stats = pool.score(["ok"] * 5, [""] * 5)
        assert total.tolist() == [2.0] * 5 and stats["timeouts"] == stats["errors"] == 0


def test_pool_inline_mode_and_bad_config():
    with RewardPool(["gsm8k_accuracy", ("fmt", 0.5, "gsm8k_format")], num_workers=0) as pool:
        total, per_func, _ = pool.score([completion("14"), "x"], [GOLD, GOLD])
        assert total.tolist() == [2.5, 0.0]
        assert per_func["gsm8k_accuracy"].tolist() == [2.0, 0.0]
    with pytest.raises(ValueError, match="unique"):
        RewardPool(["gsm8k_format", "gsm8k_format"], num_workers=0)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pool_scores_only_the_named_functions(num_workers):
    """Training scores its rewards, evaluation its rules, from one pool (`score(..., only=...)`)."""
    funcs = [("acc", 1.0, "gsm8k_accuracy"), ("fmt", 1.0, "gsm8k_format")]
    funcs += [("eval/released", 0.0, "gsm8k_eval_released")]
    texts = [completion("$1800"), "she pays $1,800", completion("7")]
    with RewardPool(funcs, num_workers=num_workers) as pool:
        total, per_func, stats = pool.score(texts, [GOLD_1800] * 3, only=["acc", "fmt"])
        assert sorted(per_func) == ["acc", "fmt"] and sorted(stats["errors_per_func"]) == sorted(
            per_func
        )
        assert total.tolist() == [2.5, 0.0, 1.0]
        total, per_func, _ = pool.score(texts, [GOLD_1800] * 3, only=["eval/released"])
        assert list(per_func) == ["eval/released"] and per_func["eval/released"].tolist() == [
            1.0,
            1.0,
            0.0,
        ]
        assert total.tolist() == [0.0] * 3  # weight 0
        assert sorted(pool.score(texts, [GOLD_1800] * 3)[1]) == ["acc", "eval/released", "fmt"]
        with pytest.raises(ValueError, match="unknown reward name.*'accuracy'.*this pool has"):
            pool.score(texts, [GOLD_1800] * 3, only=["accuracy"])
    with pytest.raises(ValueError, match="unknown reward"):
        RewardPool(["nope"], num_workers=0)
    with pytest.raises(ValueError, match="cannot load"):
        RewardPool([("x", 1.0, "cppo_jax.rewards.gsm8k:no_such_function")], num_workers=1)


# ----- TRL's calling convention, from a file -----

# Written as TRL's GRPOTrainer documentation shows reward functions (keyword lists in, list of floats out).
TRL_STYLE_FILE = """
import re


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def reward_num_tokens(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def matches_gold(completions, solution, **kwargs):
    rewards = []
    for text, gold in zip(completions, solution):
        if "####" not in gold:
            rewards.append(None)  # nothing to compare with: abstain
            continue
        found = re.search(r"<answer>(.*?)</answer>", text)
        rewards.append(1.0 if found and found.group(1).strip() == gold.split("####")[-1].strip() else 0.0)
    return rewards


def sees_its_prompt(prompts, completions, question, **kwargs):
    return [1.0 if q in p else 0.0 for p, q in zip(prompts, question)]


def not_a_list(completions, **kwargs):
    return 1.0
"""


@pytest.mark.parametrize("num_workers", [0, 1])
def test_trl_style_rewards_from_a_file_get_keywords_and_may_abstain(tmp_path, num_workers):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_STYLE_FILE)
    names = ["reward_len", "reward_num_tokens", "matches_gold", "sees_its_prompt", "not_a_list"]
    funcs = [(name, 1.0, f"{path}:{name}") for name in names]
    texts = [completion("14"), "x" * 25, completion("15")]
    golds = [GOLD, GOLD, "no gold here"]
    contexts = [
        {"prompt": "<|im_start|>Q: apples?", "completion_ids": [5, 6, 7], "question": "apples"},
        {"prompt": "<|im_start|>Q: pears?", "completion_ids": [5], "question": "apples"},
        {"prompt": "apples", "completion_ids": [], "question": "apples"},
    ]
    with RewardPool(funcs, num_workers=num_workers) as pool:
        total, per, stats = pool.score(texts, golds, contexts=contexts)
    assert per["reward_len"].tolist() == [-abs(20 - len(t)) for t in texts]
    assert per["reward_num_tokens"].tolist() == [3.0, 1.0, 0.0]
    assert per["matches_gold"][:2].tolist() == [1.0, 0.0] and np.isnan(per["matches_gold"][2])
    assert per["sees_its_prompt"].tolist() == [1.0, 0.0, 1.0]
    # A return that is not a list of one value per completion is an error (scored 0), named as such.
    assert stats["errors_per_func"] == {n: (3 if n == "not_a_list" else 0) for n in names}
    # The total leaves the abstention out (TRL's nansum) instead of turning NaN.
    expected = [sum(per[n][i] for n in names if not np.isnan(per[n][i])) for i in range(3)]
    assert total.tolist() == expected and np.isfinite(total).all()


def test_reward_files_and_names_in_errors(tmp_path):
    with pytest.raises(ValueError, match=r"reward file .*missing\.py.* does not exist"):
        registry.resolve(f"{tmp_path}/missing.py:f")
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(
        ValueError, match=r"cannot load reward file .*broken\.py.*no_such_module_here"
    ):
        registry.resolve(f"{tmp_path}/broken.py:f")
    (tmp_path / "ok.py").write_text(
        "def f(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    with pytest.raises(ValueError, match="has no attribute 'g'"):
        registry.resolve(f"{tmp_path}/ok.py:g")
    fn = registry.resolve(f"{tmp_path}/ok.py:f")
    assert registry.resolve(f"{tmp_path}/ok.py:f") is fn  # loaded once
    assert registry.is_trl_style(fn) and not registry.is_trl_style(gsm8k.accuracy_reward)
    assert registry.display_name(f"{tmp_path}/ok.py:f") == "f"
    assert registry.display_name("gsm8k_accuracy") == "gsm8k_accuracy"
    assert registry.display_name("mypkg.rewards:my_reward") == "my_reward"


# ----- gold answers of the shipped data -----


def test_gsm8k_golds_are_numbers():
    for split, count in (("train", 7473), ("test", 1319)):
        rows = datasets.load_records("gsm8k", split)
        assert len(rows) == count
        for row in rows:
            assert re.fullmatch(r"-?\d+", gsm8k.gold_answer(row["answer"])), row["answer"][-40:]


def test_math_golds_parse_and_own_answers_score_full_marks():
    """Every MATH-500, AMC23 and AIME24 gold parses, and its own answer, boxed, scores 2.0 through the
    pool, except the answers written in LaTeX shorthand (`\\frac43`, `\\sqrt2`): the released options
    (nits=False) do not repair a prediction, so a model that writes them scores 0 as it did there."""
    examples = (
        datasets.load_examples("math500", task="math")
        + datasets.load_examples("amc23")
        + datasets.load_examples("aime24")
    )
    assert len(examples) == 570
    completions = [
        f"<think>.</think>\n<answer>$\\boxed{{{ex['answer']}}}$</answer>" for ex in examples
    ]
    with RewardPool([("accuracy", 1.0, "math_accuracy")], num_workers=2, timeout_s=20.0) as pool:
        _, per_func, stats = pool.score(completions, [ex["solution"] for ex in examples])
    assert stats["notes"].get("math_gold_unparsed", 0) == 0
    assert stats["timeouts"] == stats["errors"] == 0
    failed = {ex["answer"] for ex, v in zip(examples, per_func["accuracy"]) if v != 2.0}
    shorthand = re.compile(r"\\(?:frac\s*\d|frac\{[^}]*\}\s*\d|sqrt\s*\d)")
    assert failed == {ex["answer"] for ex in examples if shorthand.search(ex["answer"])}
    assert 0 < len(failed) < 10


# ----- host code stays host code -----


def test_host_modules_do_not_import_jax():
    code = (
        "import sys\n"
        "import cppo_jax.rewards, cppo_jax.rewards.math, cppo_jax.rewards.pool, cppo_jax.rewards.registry\n"
        "import cppo_jax.rewards.worker_procs\n"
        "import cppo_jax.data.datasets, cppo_jax.data.example_format, cppo_jax.tasks, cppo_jax.tasks.arith, cppo_jax.tasks.tiny_tokenizer\n"
        "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_two_reward_files_with_one_function_name_are_refused_naming_the_key(
    tmp_path, capsys, arith_model_dir
):
    """Metrics name a function by its name (as TRL), so two `reward_func`s would share a metric."""
    from cppo_jax import launch

    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("def reward_func(completions, **kw):\n    return [0.0]\n")
    code = launch.main(
        [
            "--config",
            str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.py"),
            f"model.init_checkpoint={arith_model_dir}",
            f"reward.funcs={tmp_path}/a.py:reward_func,{tmp_path}/b.py:reward_func",
            "trainer.dry_run=true",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "config key 'reward.funcs'" in err and "named reward_func" in err
