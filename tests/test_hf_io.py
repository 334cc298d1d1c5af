"""Hugging Face checkpoint I/O: round trips, transformers interop, sharding, bf16, bad input."""

from __future__ import annotations

import json
import os
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from cppo_jax.models import Tokenizer, hf_read, load_hf, save_hf
from cppo_jax.models.hf_io import hf_tensors_to_model, state_to_hf_tensors
from cppo_jax.models.hf_read import read_raw_tensor

try:
    import helpers
except ImportError:  # pragma: no cover - run as a package
    from tests import helpers

PROMPTS = [[5, 17, 33, 101, 250, 7, 64], [9, 200, 3], [44, 45, 46, 47, 48], [128]]


def flat_params(model) -> dict:
    return {
        path: np.asarray(var.get_value())
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def assert_same_params(a, b):
    pa, pb = flat_params(a), flat_params(b)
    assert pa.keys() == pb.keys()
    for path in pa:
        assert pa[path].dtype == pb[path].dtype, path
        np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return helpers.make_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="qwen2", tied=True)


def test_roundtrip_bit_exact_and_transformers_reads_ours(qwen_dir, tmp_path):
    model = load_hf(qwen_dir)
    out = save_hf(model, tmp_path / "saved", extra_config={"bos_token_id": 1, "eos_token_id": 2})
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    saved = load_file(out / "model.safetensors")
    # Tied: lm_head.weight is written too, as a copy of the embedding (vLLM reload trap).
    np.testing.assert_array_equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert_same_params(model, load_hf(out))

    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS)
    hf_saved = helpers.hf_logits(helpers.load_hf_torch(out), tokens_BT, valid_BT)
    hf_orig = helpers.hf_logits(helpers.load_hf_torch(qwen_dir), tokens_BT, valid_BT)
    np.testing.assert_array_equal(hf_saved, hf_orig)
    ours = np.asarray(helpers.forward(model, tokens_BT, positions_BT, valid_BT)[0])
    assert np.abs(ours - hf_saved)[valid_BT].max() < 1e-4


def test_untied_llama_roundtrip_and_tensor_dict_inverse(tmp_path):
    src = helpers.make_hf_checkpoint(tmp_path, arch="llama", tied=False, seed=3)
    model = load_hf(src)
    tensors = state_to_hf_tensors(model)
    original = load_file(src / "model.safetensors")
    assert tensors.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    assert_same_params(model, hf_tensors_to_model(model.cfg, tensors))
    out = save_hf(model, tmp_path / "saved")
    assert_same_params(model, load_hf(out))
    hf = helpers.load_hf_torch(out)
    assert type(hf).__name__ == "LlamaForCausalLM"


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = helpers.make_hf_checkpoint(tmp_path, name="single", seed=5)
    sharded = helpers.make_hf_checkpoint(tmp_path, name="sharded", seed=5, max_shard_size="40KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert_same_params(load_hf(single), load_hf(sharded))


def test_bf16_checkpoint_loads_and_saves(tmp_path, monkeypatch):
    src = helpers.make_hf_checkpoint(tmp_path, torch_dtype="bfloat16", seed=2)
    file = src / "model.safetensors"
    with safe_open(str(file), framework="numpy") as f:
        name = "model.layers.0.self_attn.q_proj.weight"
        assert f.get_slice(name).get_dtype() == "BF16"
        raw = read_raw_tensor(file, name)
        assert raw.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(raw, f.get_tensor(name))
        np.testing.assert_array_equal(
            read_raw_tensor(file, "model.norm.weight"), f.get_tensor("model.norm.weight")
        )
    model = load_hf(src)
    assert model.layers.attn.q_DHE[...].dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(model.layers.attn.q_DHE[0]).reshape(37, 40).T, raw.astype(np.float32)
    )

    # Older safetensors cannot hand out bf16 as numpy: the raw reader takes over.
    real_open = hf_read.safe_open

    class NoBf16:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            if self.f.get_slice(name).get_dtype() == "BF16":
                raise TypeError("data type 'bfloat16' not understood")
            return self.f.get_tensor(name)

    monkeypatch.setattr(hf_read, "safe_open", NoBf16)
    assert_same_params(model, load_hf(src))
    monkeypatch.undo()

    bf16_model = load_hf(src, dtype="bfloat16", param_dtype="bfloat16")
    out = save_hf(bf16_model, tmp_path / "bf16_saved")
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert_same_params(bf16_model, load_hf(out, dtype="bfloat16", param_dtype="bfloat16"))


def test_save_replaces_atomically_and_copies_tokenizer(qwen_dir, tmp_path):
    model = load_hf(qwen_dir)
    target = tmp_path / "policy"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    # A failing save leaves the existing folder untouched and no temporary folder behind.
    with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
        save_hf(model, target, tokenizer_dir=tmp_path / "no_such_tokenizer")
    assert (target / "stale.txt").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["policy"]

    tok_dir = helpers.make_tokenizer_dir(tmp_path)
    save_hf(model, target, tokenizer_dir=tok_dir)
    assert not (target / "stale.txt").exists()
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= set(
        os.listdir(target)
    )
    assert sorted(os.listdir(tmp_path)) == ["policy", "tokenizer"]
    assert Tokenizer.from_dir(target).eos_id == 2


def test_mesh_places_params(qwen_dir):
    mesh = jax.make_mesh((1,), ("data",))
    model = load_hf(qwen_dir, mesh=mesh)
    assert model.embed_VD[...].sharding.mesh.shape == mesh.shape


# ---------------------------------------------------------------------------------------------
# Bad input: every message names the file and, where relevant, the tensor.
# ---------------------------------------------------------------------------------------------


def copy_ckpt(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def rewrite_tensors(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_folder_is_never_a_hub_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=re.escape("Qwen/Qwen2.5-0.5B-Instruct")):
        load_hf("Qwen/Qwen2.5-0.5B-Instruct")


def test_missing_config_or_weights(qwen_dir, tmp_path):
    d = copy_ckpt(qwen_dir, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_hf(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf(d)


def test_unsupported_architecture(qwen_dir, tmp_path):
    d = copy_ckpt(qwen_dir, tmp_path / "c")
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*GPT2LMHeadModel.*supported"):
        load_hf(d)


def test_missing_shard(tmp_path):
    d = helpers.make_hf_checkpoint(tmp_path, name="sharded", max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    names = [n for n, f in index["weight_map"].items() if f == shard]
    (d / shard).unlink()
    with pytest.raises(
        FileNotFoundError, match=rf"{re.escape(shard)}.*tensor '{re.escape(names[0])}'"
    ):
        load_hf(d)


def test_truncated_file(qwen_dir, tmp_path):
    d = copy_ckpt(qwen_dir, tmp_path / "c")
    file = d / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_hf(d)
    file.write_bytes(b"\x05")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_hf(d)


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda t: t.update(
                {"model.layers.1.mlp.up_proj.weight": np.zeros((61, 37), np.float32)}
            ),
            r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight.*\(61, 37\).*expected \(67, 37\)",
        ),
        (
            lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"),
            r"model\.safetensors.*model\.layers\.0\.self_attn\.k_proj\.bias.*missing",
        ),
        (
            lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}),
            r"model\.safetensors.*unexpected.*model\.layers\.0\.extra\.weight",
        ),
    ],
    ids=["wrong_shape", "missing_tensor", "extra_tensor"],
)
def test_bad_tensors(qwen_dir, tmp_path, edit, match):
    d = copy_ckpt(qwen_dir, tmp_path / "c")
    rewrite_tensors(d, edit)
    with pytest.raises(ValueError, match=match):
        load_hf(d)


def test_ignored_buffers_load(qwen_dir, tmp_path):
    d = copy_ckpt(qwen_dir, tmp_path / "c")
    rewrite_tensors(
        d,
        lambda t: t.update(
            {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(5, np.float32)}
        ),
    )
    assert_same_params(load_hf(d), load_hf(qwen_dir))
