"""LoRA adapters leave the trainer as PEFT loads them, and checkpoints hold the adapters only:
a PEFT adapter folder on the transformers model of our exported base gives our logits; a LoRA run
(one, shared by the tests of its outputs) exports the merged policy and the adapters and resumes from
its adapter checkpoint; a full run's checkpoint in a LoRA run is an error naming `model.lora`."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import apply_overrides
from cppo_jax.config.model import LoraConfig
from cppo_jax.models import load_hf, lora_state, peft_io, save_hf
from cppo_jax.train.trainer import Trainer
from tests.helpers import forward, load_hf_torch, random_model, tiny_config
from tests.test_lora import _inputs, _noisy_adapters
from tests.test_trainer import small_config

LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8")


@pytest.mark.parametrize(
    "arch, targets", [("qwen2", ("q", "k", "v", "o", "gate", "up", "down")), ("llama", ("o", "up"))]
)
@pytest.mark.slow
def test_peft_loads_our_adapter_folder_and_gives_our_logits(tmp_path, arch, targets):
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    # transformers' Llama wants D = H x E: 40 = 4 x 10 (Qwen2 takes the prime 37)
    D = 37 if arch == "qwen2" else 40
    cfg = tiny_config(arch=arch, hidden_size=D, tie_word_embeddings=arch == "qwen2")
    base_dir = save_hf(random_model(cfg), tmp_path / "base")
    adapted = _noisy_adapters(
        lora_state.with_adapters(load_hf(base_dir), LoraConfig(rank=3, alpha=5.0, targets=targets))
    )
    _, adapters, _ = lora_state.split(adapted)
    out = peft_io.save_adapter(adapters, adapted.cfg, tmp_path / "adapter", base_dir)
    config = json.loads((out / peft_io.CONFIG_FILE).read_text())
    assert config["r"] == 3 and config["lora_alpha"] == 5.0 and config["peft_type"] == "LORA"

    tokens_BT, positions_BT, valid_BT = _inputs()
    ours, _ = forward(adapted, tokens_BT, positions_BT, valid_BT)
    base_logits, _ = forward(load_hf(base_dir), tokens_BT, positions_BT, valid_BT)
    model = peft.PeftModel.from_pretrained(load_hf_torch(base_dir), str(out)).eval()
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(np.asarray(tokens_BT)).long()).logits.numpy()
    ours = np.asarray(ours)
    scale = np.abs(ours).max()
    assert np.abs(ours - np.asarray(base_logits)).max() > 0.1 * scale  # the adapters act
    # Two float32 implementations of the same sums (torch's and XLA's order): the rounding bound
    # of the model parity tests (tests/test_model.py), 100 ulps of the logits' scale.
    tol = 100 * np.finfo(np.float32).eps * scale
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=tol)


def test_adapter_bytes_counts_the_saved_tensors(tmp_path):
    adapted = lora_state.with_adapters(random_model(tiny_config()), LoraConfig(rank=3))
    _, adapters, _ = lora_state.split(adapted)
    out = peft_io.save_adapter(adapters, adapted.cfg, tmp_path / "a", "base")
    tensors = peft_io.adapter_tensors(lora_state.numpy_adapters(adapters), adapted.cfg)
    assert sum(t.nbytes for t in tensors.values()) == peft_io.adapter_bytes(adapted.cfg)
    assert (out / peft_io.WEIGHTS_FILE).stat().st_size > peft_io.adapter_bytes(adapted.cfg)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, arith_model_dir):
    """A one-step LoRA run (`Trainer.train`: its checkpoint, export/ and adapter/ folders) on a
    reward spread over any text, so that the step moves the adapters: (trainer, config)."""
    from tests.helpers import spread_reward
    from tests.test_trainer import run_trainer

    out = tmp_path_factory.mktemp("lora_run")
    cfg = small_config(out, arith_model_dir, *LORA, *spread_reward(out), "trainer.steps=1")
    trainer, _ = run_trainer(cfg)
    return trainer, cfg


@pytest.mark.slow
def test_lora_checkpoints_hold_the_adapters_and_resume(lora_run, arith_model_dir):
    trainer, cfg = lora_run
    run_dir = trainer.host.out_dir
    saved = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.params))
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    on_disk = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    base_bytes = sum(f.stat().st_size for f in arith_model_dir.glob("*.safetensors"))
    # adapters + 2 AdamW moments in float32 and metadata: well under the base's weights
    assert on_disk < base_bytes, (on_disk, base_bytes, n_params)

    resumed = Trainer(apply_overrides(cfg, ["trainer.resume=true"]))
    try:
        resumed.maybe_resume()
        assert resumed.start_step == 1
        got = jax.tree.map(np.asarray, nnx.to_pure_dict(resumed.params))
        jax.tree.map(np.testing.assert_array_equal, got, saved)
    finally:
        resumed.close()


@pytest.mark.parametrize(
    "saved_with, resumed_with",
    [
        ((), LORA),  # a full run's checkpoint in a LoRA run
        (LORA, ("model.lora.enabled=false",)),  # and the other way round
        (LORA, ("model.lora.rank=8",)),  # adapters of another rank
    ],
)
def test_a_checkpoint_of_another_kind_names_model_lora(
    tmp_path, arith_model_dir, saved_with, resumed_with
):
    cfg = small_config(tmp_path, arith_model_dir, "trainer.steps=1", *saved_with)
    first = Trainer(cfg)
    try:
        first.save(1)
    finally:
        first.close()
    trainer = Trainer(apply_overrides(cfg, ["trainer.resume=true", *resumed_with]))
    try:
        with pytest.raises(ConfigError, match=r"'model\.lora' does not match the checkpoint"):
            trainer.maybe_resume()
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_lora_run_exports_the_merged_policy_and_a_peft_adapter(lora_run, arith_model_dir):
    trainer, _ = lora_run
    adapter = trainer.host.out_dir / "adapter"
    config = json.loads((adapter / peft_io.CONFIG_FILE).read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(arith_model_dir)
    assert (adapter / peft_io.WEIGHTS_FILE).is_file()
    # export/: the adapters merged into the base, a plain Hugging Face folder
    exported = load_hf(trainer.host.out_dir / "export")
    want = trainer.policy_params()
    got = nnx.state(exported)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        nnx.to_pure_dict(got),
        nnx.to_pure_dict(want),
    )


@pytest.mark.slow
def test_export_of_a_lora_checkpoint_merges_the_adapters(lora_run, arith_model_dir, tmp_path):
    from cppo_jax.train.export import export_run

    trainer, _ = lora_run
    want = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.policy_params()))
    out = export_run(trainer.host.out_dir, out=tmp_path / "export")  # the checkpoint of step 1
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(load_hf(out))))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    base = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(load_hf(arith_model_dir))))
    assert any(  # the step moved the adapters: the merge is not the base
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(base))
    )
    adapter = out.with_name("export-adapter")
    assert json.loads((adapter / peft_io.CONFIG_FILE).read_text())["r"] == 4
