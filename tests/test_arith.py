"""The synthetic arith task, its prompts, and the tiny byte-level tokenizer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from cppo_jax.rewards import gsm8k
from cppo_jax.tasks import arith, prompts
from cppo_jax.tasks.tiny_tokenizer import FORMAT_TOKENS, SPECIAL_TOKENS, build_tokenizer

STEP = re.compile(r"(\d+)([+-])(\d+)=(\d+)")


def arithmetic_of(example: dict) -> tuple:
    steps = [STEP.fullmatch(s).groups() for s in arith.steps_of(example)]
    start = int(steps[0][0])
    return (start, *((op, int(b)) for _, op, b, _ in steps))


def test_generate_is_deterministic_and_seeded():
    a = arith.generate(200, seed=3, split="train")
    assert a == arith.generate(200, seed=3, split="train")
    assert a != arith.generate(200, seed=4, split="train")
    assert arith.generate(50, seed=3, split="train") == a[:50]
    with pytest.raises(ValueError, match="split"):
        arith.generate(1, split="dev")


def test_problems_are_small_and_correct():
    for ex in arith.generate(2000, seed=0, split="train"):
        steps = [STEP.fullmatch(s).groups() for s in arith.steps_of(ex)]
        assert 2 <= len(steps) <= 3
        total = int(steps[0][0])
        assert 1 <= total <= 49
        for a, op, b, c in steps:
            assert int(a) == total and 1 <= int(b) <= 49
            total = total + int(b) if op == "+" else total - int(b)
            assert int(c) == total and 0 <= total < 200
        assert ex["answer"] == str(total) and ex["solution"].endswith(f"#### {total}")
        assert f"has {steps[0][0]} " in ex["question"] and ex["question"].endswith("now?")


def test_splits_are_disjoint():
    by_split = {s: arith.generate(3000, seed=7, split=s) for s in arith.SPLITS}
    keys = {s: {arithmetic_of(ex) for ex in exs} for s, exs in by_split.items()}
    for s, exs in by_split.items():
        assert len(keys[s]) == len(exs)  # distinct within a split
        assert all(arith.split_of(k) == s for k in keys[s])
    assert not keys["train"] & keys["test"]
    assert not keys["train"] & keys["validation"]
    assert not keys["validation"] & keys["test"]
    # Another seed draws other problems, still never a test problem in train.
    assert (
        not {arithmetic_of(ex) for ex in arith.generate(3000, seed=8, split="train")} & keys["test"]
    )


def test_reference_completion_scores_full_marks():
    ex = {"question": "q", "solution": "12+7=19\n19-5=14\n#### 14", "answer": "14"}
    assert arith.reference_completion(ex) == "<think>12+7=19;19-5=14</think>\n<answer>14</answer>"
    for ex in arith.generate(500, seed=1, split="test"):
        text = arith.reference_completion(ex)
        assert gsm8k.format_reward(text) + gsm8k.accuracy_reward(text, ex["solution"]) == 3.0


# The released recipes' system prompts (spec section 4), written out here independently of the code.
RELEASED_GSM8K_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think>\n<answer> answer here "
    "</answer>."
)
RELEASED_MATH_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. And the answer should be of the following format: 'Therefore, the final answer is: "
    "$\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is just the final number or "
    "expression that solves the problem. The reasoning process and answer are enclosed within <think> "
    "</think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think>\n"
    "<answer> answer here </answer>. "
)


def test_prompts_are_the_released_strings_byte_for_byte():
    assert prompts.GSM8K_SYSTEM_PROMPT == RELEASED_GSM8K_PROMPT
    assert prompts.MATH_SYSTEM_PROMPT == RELEASED_MATH_PROMPT
    # The example layout is the one the format reward asks for: one newline between the blocks.
    example = "<think> reasoning process here </think>\n<answer> answer here </answer>"
    assert gsm8k.format_reward(example) == 1.0
    assert example in prompts.GSM8K_SYSTEM_PROMPT and example in prompts.MATH_SYSTEM_PROMPT
    assert prompts.MATH_SYSTEM_PROMPT.count("\n") == 1 and prompts.MATH_SYSTEM_PROMPT.endswith(". ")
    assert "$\\boxed{{ANSWER}}$" in prompts.MATH_SYSTEM_PROMPT  # literal double braces
    assert prompts.system_prompt_for("gsm8k") == RELEASED_GSM8K_PROMPT
    for task in ("math", "math500", "amc23", "aime24"):
        assert prompts.system_prompt_for(task) == RELEASED_MATH_PROMPT
    with pytest.raises(ValueError, match="gsm8k"):
        prompts.system_prompt_for("chess")
    messages = prompts.chat_messages("2+2?", prompts.SYSTEM_PROMPT)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert [m["role"] for m in prompts.chat_messages("2+2?", "")] == ["user"]


def test_paper_configs_send_the_released_prompts():
    from cppo_jax.config.files import load_config

    for name, expected in (
        ("gsm8k_1p5b.py", RELEASED_GSM8K_PROMPT),
        ("math7b.py", RELEASED_MATH_PROMPT),
    ):
        data = load_config(name).data
        assert data.system_prompt == expected and data.prompt_format == "chat"
        assert prompts.resolve_system_prompt(data.task, data.system_prompt) == expected
    # Unset: the task's own; empty: none.
    assert prompts.resolve_system_prompt("gsm8k", None) == RELEASED_GSM8K_PROMPT
    assert prompts.resolve_system_prompt("gsm8k", "") == ""


# ----- tokenizer -----


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    t0 = time.monotonic()
    path = build_tokenizer(tmp_path_factory.mktemp("tok"), corpus_examples=2000, seed=0)
    assert time.monotonic() - t0 < 5.0
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))


def test_tokenizer_files_and_size(tok_dir, tok):
    assert sorted(os.listdir(tok_dir)) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert 384 <= tok.get_vocab_size() <= 512
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in config["chat_template"]


def test_tokenizer_is_deterministic(tok_dir, tmp_path):
    again = build_tokenizer(tmp_path / "again", corpus_examples=2000, seed=0)
    # And in another process, where Rust's hash maps get other seeds.
    code = "import sys; from cppo_jax.tasks.tiny_tokenizer import build_tokenizer; build_tokenizer(sys.argv[1])"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "other")], cwd=root, check=True, timeout=120
    )
    for name in os.listdir(tok_dir):
        with open(os.path.join(tok_dir, name), "rb") as a:
            expected = a.read()
        for folder in (again, tmp_path / "other"):
            with open(os.path.join(folder, name), "rb") as b:
                assert b.read() == expected, (folder, name)


def test_special_and_format_tokens_are_single_ids(tok):
    for token in (*SPECIAL_TOKENS, *FORMAT_TOKENS):
        ids = tok.encode(token).ids
        assert len(ids) == 1 and tok.id_to_token(ids[0]) == token
    text = arith.reference_completion(arith.generate(1, seed=0, split="train")[0])
    assert tok.encode(text).ids[0] == tok.token_to_id("<think>")
    # Digits are spelled one per token.
    assert tok.encode("123").tokens == ["1", "2", "3"]


def test_tokenizer_lengths_suit_a_tiny_model(tok):
    examples = arith.generate(200, seed=2, split="train")
    q_lens = [len(tok.encode(ex["question"]).ids) for ex in examples]
    c_lens = [len(tok.encode(arith.reference_completion(ex)).ids) for ex in examples]
    assert max(q_lens) <= 40 and max(c_lens) <= 50
    assert 15 <= sum(q_lens) / len(q_lens) <= 35 and 15 <= sum(c_lens) / len(c_lens) <= 45


@settings(max_examples=100, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_transformers_loads_it_with_chat_template(tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    assert hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    messages = prompts.chat_messages(
        "Tom has 3 pens. He buys 2 more. How many pens does he have now?",
        prompts.TINY_SYSTEM_PROMPT,
    )
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    assert hf.decode(ids) == (
        f"<|im_start|>system\n{prompts.TINY_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{messages[1]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )
    text = "<think>3+2=5</think>\n<answer>5</answer>"
    ids = hf.encode(text + "<|im_end|>", add_special_tokens=False)
    assert hf.decode(ids, skip_special_tokens=True) == text  # format tags are not special
    s = "héllo  wörld 😀\n\t x  "
    assert hf.decode(hf.encode(s, add_special_tokens=False)) == s
