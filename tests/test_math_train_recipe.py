"""The MATH training split's recipe: `python -m cppo_jax.data.datasets --write OUT` writes the file that
configs/math7b.py's `data.train` wants, from the hub when `datasets` is installed (a stand-in module
here: nothing is downloaded), and the paper config's dry run takes it."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

from cppo_jax import launch
from cppo_jax.config.files import load_config
from cppo_jax.data import datasets
from tests.test_launch import MATH7B, QWEN25_7B, model_folder

ROWS = [
    {"problem": "1 + 1?", "solution": "It is $\\boxed{2}$.", "level": "Level 1", "type": "Algebra"},
    {
        "problem": "2 + 2?",
        "solution": "No boxed answer here.",
        "level": "Level 1",
        "type": "Algebra",
    },
    {
        "problem": "3 x 3?",
        "solution": "$3 \\cdot 3 = \\boxed{9}$",
        "level": "Level 2",
        "type": "Algebra",
    },
]


def test_the_math_train_recipe_writes_what_math7b_reads(tmp_path, monkeypatch, capsys):
    asked = []
    hub = types.ModuleType("datasets")
    hub.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    hub.load_dataset = lambda name, split: asked.append((name, split)) or list(ROWS)
    monkeypatch.setitem(sys.modules, "datasets", hub)
    out = tmp_path / "math" / "train.jsonl"
    assert datasets.main(["--write", str(out)]) == 0
    assert asked == [("DigitalLearningGmbH/MATH-lighteval", "train")]
    said = capsys.readouterr().out
    assert f"wrote 2 rows of hub:DigitalLearningGmbH/MATH-lighteval/train to {out}" in said
    assert "(1 bad rows skipped)" in said  # no \boxed{}: no gold answer
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{k: r[k] for k in ("problem", "solution")} for r in (ROWS[0], ROWS[2])]
    # configs/math7b.py reads it: the dry run counts its records and refuses nothing.
    model = model_folder(tmp_path, "Qwen2.5-7B-Instruct", QWEN25_7B)
    cfg = load_config(
        MATH7B,
        [f"model.path={model}", f"data.train={out}", "trainer.dry_run=true", "trainer.eval_size=8"],
    )
    lines: list[str] = []
    launch.run(cfg, log=lines.append, num_devices=4, device_memory_gb=80)
    text = "\n".join(lines)
    assert f"train: '{out}' split 'train': 2 records (0 bad rows skipped)" in text
    assert "dry run: config, model files" in text


def test_the_recipe_without_datasets_names_what_it_needs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    assert datasets.main(["--write", str(tmp_path / "t.jsonl")]) == 2
    assert "needs network access and the `datasets` package" in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()
