"""Dry runs of the paper configs without weights, and the clear errors for what they require."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cppo_jax import launch, plan
from cppo_jax.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
GSM8K = str(ROOT / "configs" / "gsm8k_1p5b.py")
MATH7B = str(ROOT / "configs" / "math7b.py")

# config.json of the released Qwen2.5 instruct models (the fields that matter here).
QWEN25_1P5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN25_7B = {
    **QWEN25_1P5B,
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_window_layers": 28,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
}
# Published sizes: 1.54 B and 7.62 B parameters.
PARAMS_1P5B, PARAMS_7B = 1_543_714_304, 7_615_616_512


def _fake_model(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _dry_run(config: str, overrides: list[str]) -> str:
    lines: list[str] = []
    cfg = load_config(config, [*overrides, "trainer.dry_run=true"])
    result = launch.run(cfg, log=lines.append)
    assert result["dry_run"] is True
    return "\n".join(lines)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_1p5b_dry_run_without_weights(tmp_path):
    model = _fake_model(tmp_path, "Qwen2.5-1.5B-Instruct", QWEN25_1P5B)
    text = _dry_run(GSM8K, [f"model.path={model}"])
    assert f"{PARAMS_1P5B:,} parameters" in text and "config.json" in text
    assert "tied embeddings" in text
    assert "7473 records" in text and "1319 records" in text
    assert "prompts not tokenized" in text
    assert "Q=8 questions/step" in text and "G=16, k=2, M=16" in text
    assert "P=512 prompt + C=1024 completion" in text
    assert "935 per epoch of 7473 questions" in text and "1870 optimizer updates" in text


def test_math7b_dry_run_without_weights(tmp_path):
    model = _fake_model(tmp_path, "m", QWEN25_7B)
    train = _jsonl(
        tmp_path / "math_train.jsonl",
        [
            {"problem": f"What is {i} + {i}?", "solution": f"It is $\\boxed{{{2 * i}}}$."}
            for i in range(50)
        ]
        + [{"problem": "no solution field"}],
    )
    text = _dry_run(MATH7B, [f"model.path={model}", f"data.train={train}"])
    assert f"{PARAMS_7B:,} parameters" in text and "untied embeddings" in text
    assert "50 records (1 bad rows skipped)" in text
    assert "'math500' split 'test': 500 records" in text
    assert "Q=24 questions/step" in text and "M=48" in text
    assert "3 per epoch of 50 questions" in text
    # Overrides reach the plan: GRPO at b = 3.
    grpo = _dry_run(MATH7B, [f"model.path={model}", f"data.train={train}", "cppo.pruning_rate=0"])
    assert "Q=3 questions/step" in grpo and "k=16, M=48" in grpo


def test_known_sizes_by_name_when_there_is_no_config_json():
    assert plan.find_known_model("/models/Qwen2.5-7B-Instruct") == "Qwen2.5-7B-Instruct"
    assert plan.find_known_model("", "gsm8k_1p5b") == "Qwen2.5-1.5B-Instruct"
    assert plan.find_known_model("/models/Qwen2.5-72B-Instruct") is None
    assert plan.model_size(QWEN25_1P5B).params == PARAMS_1P5B
    assert plan.model_size(plan.KNOWN_MODELS["Qwen2.5-7B-Instruct"]).params == PARAMS_7B


def test_dry_run_tokenizes_prompts_when_the_folder_has_a_tokenizer(tmp_path):
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer

    model = _fake_model(tmp_path, "model", QWEN25_1P5B)
    build_tokenizer(model, corpus_examples=100)
    rows = [
        {"question": f"Tom has {i} pens. How many?", "answer": f"so\n#### {i}"} for i in range(9)
    ]
    data = _jsonl(tmp_path / "gsm8k_small.jsonl", rows)
    overrides = [f"model.path={model}", f"data.train={data}", f"data.test={data}"]
    text = _dry_run(GSM8K, [*overrides, "data.val_size=2", "data.max_prompt_len=64"])
    assert "tokenizer: " in text and "chat template yes" in text
    assert "train prompts: 7 tokenized" in text and "validation prompts: 2 tokenized" in text
    assert "of P=64; 7 cut from the left" in text  # the GSM8K system prompt alone is longer
    assert "1 per epoch of 7 questions" in text
    with pytest.raises(ValueError, match="data.max_prompt_len=64"):
        _dry_run(GSM8K, [*overrides, "data.max_prompt_len=64", "data.long_prompts=reject"])


def test_model_path_is_required(capsys):
    with pytest.raises(ConfigError, match=r"^model\.path is required: a local Hugging Face folder"):
        launch.run(load_config(GSM8K, ["trainer.dry_run=true"]), log=lambda *_: None)
    assert launch.main(["--config", MATH7B]) == 2
    err = capsys.readouterr().err
    assert "model.path is required: a local Hugging Face folder (nothing is downloaded)" in err


def test_math_train_placeholder_is_refused_after_the_plan(tmp_path, capsys):
    model = _fake_model(tmp_path, "m", QWEN25_7B)
    assert (
        launch.main(["--config", MATH7B, f"model.path={model}"]) == 2
    )  # a real run: refused first
    assert "config key 'data.train' is required" in capsys.readouterr().err
    argv = ["--config", MATH7B, f"model.path={model}", "trainer.dry_run=true"]
    assert launch.main(argv) == 2
    captured = capsys.readouterr()
    assert "train: NOT SET" in captured.out and "500 records" in captured.out  # the rest is planned
    assert "config key 'data.train' is required" in captured.err and "nothing is downloaded" in (
        captured.err
    )
    missing = str(tmp_path / "missing.jsonl")
    assert launch.main([*argv, f"data.train={missing}"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_dry_run_rejects_a_micro_batch_that_does_not_divide_the_kept_sequences(tmp_path):
    model = _fake_model(tmp_path, "m", QWEN25_7B)
    overrides = [f"model.path={model}", "data.train=gsm8k", "cppo.allocation=false"]
    overrides += ["cppo.pruning_rate=0.5", "trainer.micro_batch=16"]  # M = 3 x 8 = 24
    with pytest.raises(ConfigError, match="'trainer.micro_batch' = 16.*24 kept sequences"):
        _dry_run(MATH7B, overrides)
