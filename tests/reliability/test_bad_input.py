"""Bad input gives a clear message naming the culprit; model output is never run as code.

Promises (docs/reliability.md): a config file that does not load, a malformed override or an unknown key
exits with code 2 and names it; a missing model folder is named (never looked up on a hub); a tokenizer
with more ids than the model's vocabulary is refused naming both; dataset rows with invalid UTF-8 or
missing fields are skipped and counted with line numbers (or rejected, `data.bad_rows=error`); prompts
longer than `data.max_prompt_len` are cut from the left and counted (`data.long_prompts=truncate`) or
rejected naming the example (`reject`); the reward functions never evaluate a completion as code.
"""

from __future__ import annotations

import builtins
import json

import pytest

from cppo_jax import launch
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.schema import DataConfig
from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.models import Tokenizer
from cppo_jax.tasks.prompts import system_prompt_for
from cppo_jax.train.trainer import Trainer
from tests.reliability.runs import write_config_file
from tests.test_trainer import small_config


def _main(capsys, *argv) -> tuple[int, str]:
    code = launch.main(list(argv))
    return code, capsys.readouterr().err


def test_config_faults_exit_2_naming_the_culprit(tmp_path, arith_model_dir, capsys):
    bad = tmp_path / "broken.py"
    bad.write_text("def get_config(:\n")
    code, err = _main(capsys, "--config", str(bad))
    assert code == 2 and "broken.py" in err and "failed to load" in err
    good = write_config_file(tmp_path / "ok.py", small_config(tmp_path, arith_model_dir))
    code, err = _main(capsys, "--config", str(good), "trainer.stepz=3")
    assert code == 2 and "unknown config key 'trainer.stepz'" in err and "did you mean steps" in err
    code, err = _main(capsys, "--config", str(good), "cppo.pruning_rate")
    assert code == 2 and "malformed: expected key.path=value" in err
    code, err = _main(capsys, "--config", str(good), "cppo.pruning_rate=1.5")
    assert code == 2 and "'cppo.pruning_rate' = 1.5 is invalid: allowed in [0, 1)" in err


def test_missing_model_folder_is_named(tmp_path, arith_model_dir, capsys):
    cfg = small_config(tmp_path, arith_model_dir, f"model.init_checkpoint={tmp_path / 'nope'}")
    code, err = _main(capsys, "--config", str(write_config_file(tmp_path / "c.py", cfg)))
    assert code == 2 and str(tmp_path / "nope") in err


def test_tokenizer_with_more_ids_than_the_model_is_refused(tmp_path, arith_model_dir):
    from cppo_jax.models import TransformerConfig, init_model, save_hf

    tok = Tokenizer.from_dir(arith_model_dir)
    small = TransformerConfig(
        arch="qwen2",
        vocab_size=tok.vocab_size - 7,
        hidden_size=16,
        intermediate_size=33,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    model_dir = save_hf(init_model(small, 0), tmp_path / "small_vocab", tokenizer_dir=tok.path)
    cfg = small_config(tmp_path, model_dir)
    with pytest.raises(ConfigError, match=rf"has {tok.vocab_size} ids but the model .*small_vocab"):
        Trainer(cfg)


def test_dataset_rows_with_invalid_utf8_or_missing_fields_are_counted_or_rejected(tmp_path):
    good = {"question": "Tom has 3 pens and buys 4. How many?", "answer": "3+4=7\n#### 7"}
    lines = [
        json.dumps(good).encode(),
        b'{"question": "caf\xe9 \xff", "answer": "#### 1"}',  # not UTF-8
        json.dumps({"question": "no answer"}).encode(),
        json.dumps(good).encode(),
    ]
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(task="gsm8k", train=str(path), test=str(path))
    examples, stats = pipeline.load_examples(cfg, "train")
    assert len(examples) == 2 and stats["bad_rows"] == 2
    reasons = dict(stats["bad_row_lines"])
    assert "invalid UTF-8" in reasons[2] and "missing field(s) ['answer']" in reasons[3]
    with pytest.raises(ValueError, match=r"line 2\b.*UTF-8"):
        pipeline.load_examples(DataConfig(task="gsm8k", train=str(path), bad_rows="error"), "train")


def test_long_prompts_are_cut_from_the_left_and_counted_or_rejected(arith_model_dir):
    tok = Tokenizer.from_dir(arith_model_dir)
    examples = [{"question": "1 + 2 = ?"}, {"question": " + ".join(["7"] * 40) + " = ?"}]
    system = system_prompt_for("arith")
    short = tok.chat_prompt_ids(system, examples[0]["question"])
    full = tok.chat_prompt_ids(system, examples[1]["question"])
    P = len(short) + 2
    assert len(full) > P
    kept = pipeline.encode_prompts(examples, tok, "arith", P, "truncate")
    assert kept.truncated == 1
    assert (
        kept.ids_nP[1].tolist()
        == pipeline.encode_prompts(examples, tok, "arith", len(full) + 5, "truncate")
        .ids_nP[1][-P:]
        .tolist()
    )  # the last P tokens: the question's end and the assistant turn
    with pytest.raises(ValueError, match=r"prompt of example 1 has \d+ tokens, more than "):
        pipeline.encode_prompts(examples, tok, "arith", P, "reject")


PAYLOADS = [
    "__import__('pathlib').Path({marker!r}).touch()",
    "\\boxed{{__import__('pathlib').Path({marker!r}).touch()}}",
    "<answer>$__import__('pathlib').Path({marker!r}).touch()$</answer>",
    "#### __import__('os').system('touch {marker}')",
    "The answer is \\boxed{{exec(\"open({marker!r}, 'w')\")}}. #### eval('1')",
    "<think>x</think>\n<answer>lambda: open({marker!r}, 'w')</answer>",
]


def test_reward_functions_never_run_completions_as_code(tmp_path, monkeypatch):
    from cppo_jax.rewards import math as math_rewards
    from cppo_jax.rewards import registry
    from cppo_jax.rewards.pool import RewardPool

    marker = tmp_path / "pwned"
    texts = [p.format(marker=str(marker)) for p in PAYLOADS]
    calls = []

    def refuse(name, real):
        def fn(source, *args, **kwargs):
            text = str(source) + repr(getattr(source, "co_consts", ""))  # source or compiled code
            if any(t in text for t in ("pwned", "__import__", "open(")):
                calls.append((name, str(source)[:80]))
                raise AssertionError(f"{name} of model output")
            return real(source, *args, **kwargs)

        return fn

    monkeypatch.setattr(builtins, "eval", refuse("eval", builtins.eval))
    monkeypatch.setattr(builtins, "exec", refuse("exec", builtins.exec))
    names = registry.known_names()
    with RewardPool(names, num_workers=0) as pool:  # in this process, where the guards are
        for solution in ("#### 1", "\\boxed{1}", "1"):
            _, per_fn, _ = pool.score(texts, [solution] * len(texts))
            for name in names:
                if name.endswith("accuracy"):
                    # As released, a MATH gold that does not parse gives every completion 1.0.
                    unparsed = name == "math_accuracy" and not math_rewards.parse_gold(solution)
                    assert per_fn[name].tolist() == [float(unparsed)] * len(texts), name
    assert calls == [] and not marker.exists()
