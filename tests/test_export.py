"""The trained policy leaves as a Hugging Face folder: every run ends with `export/`, any checkpoint
exports through `python -m cppo_jax.export`, transformers reproduces the trainer's logits from it, and
the starting checkpoint's config fields, dtype, generation config and tokenizer files are kept.
(vLLM serving an export as it is: tests/test_vllm.py::TestUntiedServer.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file

from cppo_jax import export as export_cli
from cppo_jax.models import load_hf, save_hf
from cppo_jax.models.hf_io import TOKENIZER_FILES
from cppo_jax.models.hf_read import INDEX_FILE
from cppo_jax.train import export
from tests import helpers
from tests.test_trainer import run_trainer, small_config

GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "top_p": 0.9}
PROMPTS = [[5, 9, 14, 3, 22, 7], [8, 8, 41, 2], [30, 12, 6, 19, 4, 11, 25]]


def _logit_tol(logits: np.ndarray, width: int) -> float:
    """float32 rounding of sums over `width` terms, relative to the logits' size."""
    return 4 * width * float(np.finfo(np.float32).eps) * float(np.abs(logits).max())


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory, arith_model_dir):
    """The arith model with what real checkpoints carry: eos/bos ids, an unknown field, a
    generation_config.json with two end ids."""
    src = tmp_path_factory.mktemp("source") / "model"
    shutil.copytree(arith_model_dir, src)
    config = json.loads((src / "config.json").read_text())
    config.update(bos_token_id=1, eos_token_id=[2, 3], transformers_version="4.99.0", my_field=7)
    (src / "config.json").write_text(json.dumps(config))
    (src / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return src


@pytest.fixture(scope="module")
def run(tmp_path_factory, source_dir):
    out = tmp_path_factory.mktemp("export_run")
    overrides = ["trainer.steps=2", "trainer.checkpoint_every=1", *helpers.spread_reward(out)]
    cfg = small_config(out, source_dir, *overrides)
    trainer, _ = run_trainer(cfg)
    return trainer, out / "run"


@pytest.mark.slow
def test_every_run_ends_with_an_export_transformers_reproduces(run, source_dir):
    trainer, run_dir = run
    out = run_dir / export.EXPORT_DIR
    config = json.loads((out / "config.json").read_text())
    source = json.loads((source_dir / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "transformers_version", "my_field", "rope_theta"):
        assert config[key] == source[key], key
    assert config["cppo_step"] == 2 and config["torch_dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION_CONFIG
    copied = sorted(f.name for f in source_dir.iterdir() if f.name in TOKENIZER_FILES)
    assert copied and all((out / f).read_bytes() == (source_dir / f).read_bytes() for f in copied)

    # The export holds the trained params exactly, and transformers computes their logits.
    trained = nnx.merge(trainer.actor.graphdef, trainer.params)
    start = load_hf(source_dir)
    exported = load_hf(out)
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(trained, nnx.Param)),
        nnx.to_flat_state(nnx.state(exported, nnx.Param)),
    ):
        np.testing.assert_array_equal(
            np.asarray(a.get_value()), np.asarray(b.get_value()), str(path)
        )
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS)
    ours = np.asarray(helpers.forward(trained, tokens_BT, positions_BT, valid_BT)[0])
    theirs = helpers.hf_logits(helpers.load_hf_torch(out), tokens_BT, valid_BT)
    tol = _logit_tol(ours[valid_BT], trained.cfg.hidden_size)
    assert np.abs(ours - theirs)[valid_BT].max() <= tol
    # ... and the trained model is not the starting one (the test would pass on an unchanged copy).
    first = np.asarray(helpers.forward(start, tokens_BT, positions_BT, valid_BT)[0])
    assert np.abs(first - theirs)[valid_BT].max() > 10 * tol


@pytest.mark.slow
def test_cli_exports_any_checkpoint_and_names_bad_input(run, tmp_path):
    _, run_dir = run
    step1 = tmp_path / "step1"
    assert export_cli.main(["--run", str(run_dir), "--step", "1", "--out", str(step1)]) == 0
    latest = export.export_run(run_dir, out=tmp_path / "latest")
    final = load_file(run_dir / export.EXPORT_DIR / "model.safetensors")
    assert load_file(latest / "model.safetensors").keys() == final.keys()
    for name, value in load_file(latest / "model.safetensors").items():
        np.testing.assert_array_equal(value, final[name], err_msg=name)  # latest == the run's end
    first = load_file(step1 / "model.safetensors")
    assert any(not np.array_equal(first[n], final[n]) for n in final)  # step 1 is another policy
    assert json.loads((step1 / "config.json").read_text())["cppo_step"] == 1

    # As users run it: the module's command line, default output folder.
    proc = subprocess.run(
        [sys.executable, "-m", "cppo_jax.export", "--run", str(run_dir), "--step", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "export-step1" / "model.safetensors").is_file()

    assert export_cli.main(["--run", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export.export_run(tmp_path / "nowhere")
    with pytest.raises(export.CheckpointError, match=r"--step 7: not a checkpoint .*\[1, 2\]"):
        export.export_run(run_dir, step=7)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    shutil.copy(run_dir / "config.json", empty / "config.json")
    with pytest.raises(export.CheckpointError, match="no checkpoint"):
        export.export_run(empty)
    with pytest.raises(FileNotFoundError, match="--source"):
        export.export_run(run_dir, source=tmp_path / "no_model")


def test_export_keeps_bf16_and_shards_above_the_size(tmp_path):
    src = helpers.make_hf_checkpoint(tmp_path, arch="llama", tied=False, torch_dtype="bfloat16")
    model = load_hf(src)  # float32 params from bf16 tensors: the cast back is exact
    out = save_hf(model, tmp_path / "out", source_dir=src, max_shard_bytes=20_000)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    for shard in shards:
        with safe_open(str(out / shard), framework="numpy") as f:
            names = f.keys()  # safe_open is not iterable
            for name in names:
                assert f.get_slice(name).get_dtype() == "BF16", name
                assert f.get_tensor(name).nbytes <= 20_000 or len(names) == 1
    config = json.loads((out / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    assert config["eos_token_id"] == source["eos_token_id"] == 2
    assert (config.get("dtype") or config["torch_dtype"]) == "bfloat16"
    original = load_file(src / "model.safetensors")
    back = {}
    for shard in shards:
        back.update(load_file(out / shard))
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert value.dtype == back[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    tokens_BT, valid_BT, _ = helpers.left_pad(PROMPTS)
    np.testing.assert_array_equal(
        helpers.hf_logits(helpers.load_hf_torch(out), tokens_BT, valid_BT),
        helpers.hf_logits(helpers.load_hf_torch(src), tokens_BT, valid_BT),
    )
    with pytest.raises(ValueError, match="export dtype 'int8'"):
        save_hf(model, tmp_path / "bad", dtype="int8")
