"""Evaluation: every question scored once (padded last batch), files written, run folders restored.

A tiny random model (2 layers, widths 37/67) with the tiny arith tokenizer goes through the real entry
point; a stub backend that answers with reference completions checks that each output is scored
against its own question and that sampled benchmarks average over their samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cppo_jax import evaluate as ev
from cppo_jax.eval import policy as eval_checkpoint
from cppo_jax.rewards import gsm8k

ROOT = Path(__file__).resolve().parents[1]
TINY_CPU = str(ROOT / "configs" / "tiny_cpu.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer as RawTokenizer

    from cppo_jax.models import save_hf
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer
    from tests.helpers import random_model, tiny_config

    root = tmp_path_factory.mktemp("tiny_eval")
    tok_dir = build_tokenizer(root / "tokenizer", corpus_examples=200)
    vocab = RawTokenizer.from_file(str(Path(tok_dir) / "tokenizer.json")).get_vocab_size()
    return save_hf(
        random_model(tiny_config(vocab_size=vocab)), root / "model", tokenizer_dir=tok_dir
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_arith_every_question_scored_with_a_padded_last_batch(tiny_model, tmp_path):
    out = tmp_path / "eval"
    argv = ["--config", TINY_CPU, "--checkpoint", str(tiny_model), "--benchmarks", "arith"]
    argv += ["--out", str(out), "--batch-size", "4", "--max-new-tokens", "5"]
    argv += ["data.num_test=7", "reward.num_workers=1"]
    assert ev.main(argv) == 0
    rows = _rows(out / "arith.jsonl")
    assert [r["id"] for r in rows] == list(range(7))  # 7 questions in batches of 4: none dropped
    for r in rows:
        assert set(r) >= {"id", "prompt", "completion", "gold", "rewards", "correct"}
        assert r["correct"] == r["correct_strict"] == (r["rewards"]["arith_accuracy"] > 0)
        assert r["correct_released"] == (gsm8k.released_correct(r["completion"], r["gold"]))
        assert 1 <= r["length"] <= 5 and "<|im_start|>user" in r["prompt"]
    summary = json.loads((out / "summary.json").read_text())
    (result,) = summary["results"]
    assert result["benchmark"] == "arith" and result["n"] == 7 and result["samples"] == 1
    assert result["accuracy"] == np.mean([r["correct"] for r in rows])
    assert result["mean_length"] == np.mean([r["length"] for r in rows])
    table = (out / "summary.md").read_text()
    assert result["rule"] == "strict" and result["accuracy"] == result["accuracy_strict"]
    assert result["accuracy_released"] == np.mean([r["correct_released"] for r in rows])
    head = "| benchmark | n | samples | accuracy | released | strict | mean length | truncated | time (s) |"
    assert head in table
    assert "| arith | 7 | 1 |" in table


def test_gsm8k_three_questions_tiny_limits(tiny_model, tmp_path):
    out = tmp_path / "eval"
    argv = ["--config", TINY_CPU, "--checkpoint", str(tiny_model), "--benchmarks", "gsm8k"]
    argv += ["--out", str(out), "--limit", "3", "--max-new-tokens", "3", "--batch-size", "2"]
    argv += ["data.max_prompt_len=40", "reward.num_workers=1"]
    assert ev.main(argv) == 0
    rows = _rows(out / "gsm8k.jsonl")
    assert [r["id"] for r in rows] == [0, 1, 2]
    assert set(rows[0]["rewards"]) == {"gsm8k_accuracy", "gsm8k_format"}
    gold = [r["gold"] for r in rows]
    assert all(g.replace("-", "").isdigit() for g in gold)  # GSM8K answers after ####
    (result,) = json.loads((out / "summary.json").read_text())["results"]
    assert result["n"] == 3 and result["prompts_cut"] == 3  # 40 tokens cut every GSM8K prompt
    assert "| gsm8k | 3 | 1 |" in (out / "summary.md").read_text()


class _StubBackend:
    """Answers each prompt with its question's reference completion (sample 0) or nonsense (j > 0)."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        self.tok, self.answers, self.sp, self.calls = tokenizer, answers, None, []

    def _answer(self, prompt_text: str, j: int) -> list[int]:
        found = [a for q, a in self.answers.items() if q in prompt_text]
        text = found[0] if found and j == 0 else "no idea"
        return self.tok.encode(text) + [self.tok.eos_id]

    def _samples(self, prompt_QP, valid_QP, S: int, C: int):
        from cppo_jax.rollout.embedded.sampling import Samples

        prompt_QP, valid_QP = np.asarray(prompt_QP), np.asarray(valid_QP)
        Q = len(prompt_QP)
        tokens = np.full((Q * S, C), self.sp.pad_id, np.int32)
        valid = np.zeros((Q * S, C), bool)
        for q in range(Q):
            text = self.tok.decode([int(t) for t in prompt_QP[q][valid_QP[q]]])
            for j in range(S):
                ids = self._answer(text, j)[:C]
                tokens[q * S + j, : len(ids)] = ids
                valid[q * S + j, : len(ids)] = True
        finished = (tokens == self.sp.eos_id).any(axis=1)
        self.calls.append(Q)
        return Samples(tokens, np.zeros(tokens.shape, np.float32), valid, finished)

    def greedy(self, params, prompt_QP, valid_QP, max_new_tokens=None):
        return self._samples(prompt_QP, valid_QP, 1, max_new_tokens or self.sp.max_new_tokens)

    def generate(self, params, prompt_QP, valid_QP, seeds_Q, num_samples):
        return self._samples(prompt_QP, valid_QP, num_samples, self.sp.max_new_tokens)

    def close(self):
        pass


def test_outputs_are_scored_against_their_own_questions(tiny_model, tmp_path, monkeypatch):
    from cppo_jax.config.files import load_config
    from cppo_jax.data.datasets import load_examples
    from cppo_jax.models import Tokenizer
    from cppo_jax.tasks import arith

    overrides = ["data.num_test=7", "reward.num_workers=0", "data.max_prompt_len=1024"]
    cfg = load_config(TINY_CPU, overrides)
    tok = Tokenizer.from_dir(tiny_model)
    answers = {
        ex["question"]: arith.reference_completion(ex) for ex in arith.generate(7, 0, "test")
    }
    for ex in load_examples("aime24", "test")[:3]:  # the stub knows the first 3 AIME answers
        answers[ex["question"]] = f"<think>so</think>\n<answer>$\\boxed{{{ex['answer']}}}$</answer>"
    stub = _StubBackend(tok, answers)
    monkeypatch.setattr("cppo_jax.rollout.backend.make_backend", lambda *a, **k: stub)
    result = ev.evaluate(
        cfg,
        tiny_model,
        ["arith", "aime24"],
        tmp_path / "eval",
        batch_size=4,
        max_new_tokens=120,
        samples=2,
        log=lambda *_: None,
    )
    by_name = {r["benchmark"]: r for r in result["results"]}
    # arith: 7 questions in calls of 4 (the last padded with one repeat): all right, none dropped.
    assert by_name["arith"]["n"] == 7 and by_name["arith"]["accuracy"] == 1.0
    assert by_name["arith"]["truncated"] == 0.0
    # aime24: 30 questions x 2 samples in calls of 2 questions; only sample 0 of questions 0-2 is right.
    assert by_name["aime24"]["n"] == 30 and by_name["aime24"]["samples"] == 2
    assert by_name["aime24"]["accuracy"] == pytest.approx(3 / 60)
    # pass@k: 3 questions with 1 of 2 samples right; pass@1 = mean@2, pass@2 = 3 / 30.
    assert by_name["aime24"]["pass@1"] == pytest.approx(3 / 60)
    assert by_name["aime24"]["pass@2"] == pytest.approx(3 / 30)
    assert "pass@1" not in by_name["arith"]  # one greedy sample: no pass@k
    assert (
        "| aime24 | 2 | 5.00% | pass@1 5.00%, pass@2 10.00% |"
        in (tmp_path / "eval" / "summary.md").read_text()
    )
    rows = _rows(tmp_path / "eval" / "aime24.jsonl")
    assert [(r["id"], r["sample"]) for r in rows] == [(q, j) for q in range(30) for j in range(2)]
    assert [r["correct"] for r in rows[:6]] == [True, False] * 3
    assert not any(r["correct"] for r in rows[6:])
    assert stub.calls == [4, 4] + [2] * 15


def test_run_folder_restores_the_trained_params(tiny_model, tmp_path):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cppo_jax.config.choices import ConfigError
    from cppo_jax.config.files import load_config, save_config
    from cppo_jax.models import load_hf
    from cppo_jax.train import optimizer as optimizer_lib
    from cppo_jax.train.checkpoint import Checkpointer

    cfg = load_config(TINY_CPU, [f"model.init_checkpoint={tiny_model}", "model.warm_start="])
    run = tmp_path / "run"
    run.mkdir()
    save_config(cfg, run / "config.json")
    _, params = nnx.split(load_hf(tiny_model))
    trained = jax.tree.map(lambda x: x + 0.5, params)
    tx = optimizer_lib.make_optimizer(cfg.optim, 10)
    ckpt = Checkpointer(run / "checkpoints")
    ckpt.save(3, {"params": trained, "opt_state": tx.init(trained)}, {"step": 3})
    ckpt.close()

    assert (
        eval_checkpoint.checkpoint_kind(run) == "run"
        and eval_checkpoint.checkpoint_kind(tiny_model) == "hf"
    )
    policy = eval_checkpoint.load_policy(None, run)
    assert policy.kind == "run" and policy.step == 3 and policy.run_config == cfg
    same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), policy.params, trained)
    assert all(jax.tree.leaves(same))

    no_model = tmp_path / "run_without_model"
    (no_model / "checkpoints").mkdir(parents=True)
    save_config(load_config(TINY_CPU, ["model.init_checkpoint="]), no_model / "config.json")
    with pytest.raises(ConfigError, match="model.path is required: a local Hugging Face folder"):
        eval_checkpoint.load_policy(None, no_model)


def test_user_errors_exit_2_with_the_culprit(tiny_model, tmp_path, capsys):
    assert ev.main(["--config", TINY_CPU, "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "checkpoint folder not found" in capsys.readouterr().err
    argv = ["--config", TINY_CPU, "--checkpoint", str(tiny_model), "--benchmarks", "mmlu"]
    assert ev.main(argv) == 2
    assert "unknown benchmark 'mmlu'" in capsys.readouterr().err
    assert ev.main(["--checkpoint", str(tiny_model)]) == 2
    assert "--config is required" in capsys.readouterr().err


def test_paper_config_headlines_the_released_rule_and_reports_both(
    tiny_model, tmp_path, monkeypatch
):
    """configs/gsm8k_1p5b.py: `accuracy` is the released (lenient) rule; both rules are in every output."""
    from cppo_jax.config.files import load_config
    from cppo_jax.data.datasets import load_examples
    from cppo_jax.models import Tokenizer
    from cppo_jax.tasks.prompts import GSM8K_SYSTEM_PROMPT

    cfg = load_config("configs/gsm8k_1p5b.py", ["reward.num_workers=0", "data.max_prompt_len=1024"])
    assert cfg.eval.rule == "released"
    examples = load_examples("gsm8k", "test")[:4]
    golds = [ex["answer"] for ex in examples]
    answers = [
        f"<think>.</think>\n<answer>{golds[0]}</answer>",  # exact: both rules
        f"<think>.</think>\n<answer>{golds[1]} dollars</answer>",  # 1.5 tier: both rules
        f"<think>.</think>\n<answer>2 + 3 = {golds[2]}</answer>",  # last number: released only
        "<think>.</think>\n<answer>no idea</answer>",
    ]
    stub = _StubBackend(
        Tokenizer.from_dir(tiny_model), {ex["question"]: a for ex, a in zip(examples, answers)}
    )
    monkeypatch.setattr("cppo_jax.rollout.backend.make_backend", lambda *a, **k: stub)
    result = ev.evaluate(
        cfg,
        tiny_model,
        ["gsm8k"],
        tmp_path / "eval",
        limit=4,
        max_new_tokens=64,
        log=lambda *_: None,
    )
    (row,) = result["results"]
    assert (row["accuracy"], row["accuracy_released"], row["accuracy_strict"]) == (0.75, 0.75, 0.5)
    assert row["rule"] == "released"
    rows = _rows(tmp_path / "eval" / "gsm8k.jsonl")
    assert [r["correct_released"] for r in rows] == [True, True, True, False]
    assert [r["correct_strict"] for r in rows] == [True, True, False, False]
    assert [r["rewards"]["gsm8k_accuracy"] for r in rows] == [2.0, 1.5, 0.0, 0.0]
    assert all(GSM8K_SYSTEM_PROMPT in r["prompt"] for r in rows)  # the released system prompt
    assert (
        "| 75.00% (released) | 75.00% | 50.00% |" in (tmp_path / "eval" / "summary.md").read_text()
    )


def test_pass_at_k_is_the_unbiased_estimator():
    """Against hand counts, and against the definition: the share of all k-subsets of the n samples
    that hold a correct one."""
    import itertools

    from cppo_jax.eval.report import pass_at_k

    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 3 of the 6 pairs hold the right one
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(16, 2, 8) == pytest.approx(
        1 - (14 * 13 * 12 * 11 * 10 * 9 * 8 * 7) / (16 * 15 * 14 * 13 * 12 * 11 * 10 * 9) * 1
    )  # 1 - C(14,8)/C(16,8)
    for n, c, k in [(5, 2, 2), (6, 1, 3), (7, 3, 4), (8, 0, 2), (8, 5, 5)]:
        right = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        share = sum(any(right[i] for i in sub) for sub in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(share, rel=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="n=4, c=5"):
        pass_at_k(4, 5, 1)


def test_eval_samples_temperature_and_top_p_override_the_benchmarks_protocol():
    from cppo_jax.config.files import apply_overrides, load_config
    from cppo_jax.eval.benchmarks import resolve_benchmarks
    from cppo_jax.eval.policy import EvaluationError

    cfg = load_config(TINY_CPU)
    proto = {
        b.name: (b.samples, b.temperature, b.top_p)
        for b in resolve_benchmarks(["arith", "aime24"], cfg, None, None)
    }
    assert proto == {"arith": (1, 0.0, 1.0), "aime24": (4, 0.6, 0.95)}  # the paper's protocol
    cfg8 = apply_overrides(cfg, ["eval.samples=8", "eval.temperature=0.7", "eval.top_p=0.9"])
    got = {
        b.name: (b.samples, b.temperature, b.top_p)
        for b in resolve_benchmarks(["arith", "aime24"], cfg8, None, None)
    }
    assert got == {"arith": (8, 0.7, 0.9), "aime24": (8, 0.7, 0.9)}
    # The command's --samples still wins for sampled benchmarks.
    (aime,) = resolve_benchmarks(["aime24"], cfg8, None, 2)
    assert aime.samples == 2
    with pytest.raises(EvaluationError, match="eval.temperature > 0"):
        resolve_benchmarks(["arith"], apply_overrides(cfg, ["eval.samples=4"]), None, None)
    with pytest.raises(ValueError, match="eval.top_p"):
        apply_overrides(cfg, ["eval.top_p=0"])
