"""LoRA adapters (models/lora.py): the fresh adapted model is the base, the adapters change the
forward, merged weights compute the adapted model, the adapters are stacked and named for the rules,
bad `model.lora` input names its key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.config import files as config_io
from cppo_jax.config.choices import LORA_TARGETS, ConfigError
from cppo_jax.config.model import LoraConfig
from cppo_jax.config.schema import Config
from cppo_jax.models import lora, lora_state
from cppo_jax.parallel import sharding as sharding_lib
from tests.helpers import forward, random_model, tiny_config


def _inputs(B=3, T=7, V=257, seed=0):
    tokens_BT = jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return tokens_BT, positions_BT, jnp.ones((B, T), bool)


def _noisy_adapters(model, seed=1):
    """`model` with every adapter (B too) set to O(1/sqrt(fan-in)) noise."""
    graphdef, adapters, base = lora_state.split(model)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(adapters):
        v = var.get_value()
        noise = rng.standard_normal(v.shape).astype(np.float32) / np.sqrt(np.prod(v.shape[1:-1]))
        flat.append((path, var.replace(jnp.asarray(noise, v.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat), base)


@pytest.mark.parametrize("scan", [True, False])
def test_fresh_adapters_leave_the_forward_unchanged(scan):
    cfg = tiny_config(scan_layers=scan)
    base = random_model(cfg)
    adapted = lora_state.with_adapters(base, LoraConfig(rank=3))
    # B = 0: every delta is an exact zero, so the logits are the base's bit for bit.
    want, _ = forward(base, *_inputs())
    got, _ = forward(adapted, *_inputs())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_split_base_has_the_plain_models_paths_and_merge_computes_the_adapted_model():
    cfg = tiny_config()
    base = random_model(cfg)
    adapted = _noisy_adapters(lora_state.with_adapters(base, LoraConfig(rank=5)))
    _, adapters, frozen = lora_state.split(adapted)
    plain_paths = {p for p, _ in nnx.to_flat_state(nnx.state(base))}
    assert {p for p, _ in nnx.to_flat_state(frozen)} == plain_paths
    assert len(nnx.to_flat_state(adapters)) == 2 * len(LORA_TARGETS)  # A and B, stacked [L]

    logits_base, _ = forward(base, *_inputs())
    logits_lora, _ = forward(adapted, *_inputs())
    scale = float(jnp.max(jnp.abs(logits_lora)))
    assert float(jnp.max(jnp.abs(logits_lora - logits_base))) > 0.1 * scale  # adapters act

    merged = lora_state.merge_weights(adapters, frozen, adapted.cfg)
    as_base = nnx.merge(lora_state.base_graphdef(adapted.cfg), merged)
    logits_merged, _ = forward(as_base, *_inputs())
    # Same numbers summed in another order ((xA)B + xW vs x(W + AB)): float32 rounding of sums
    # over D, F and the layers; 64 ulps of the logits' scale bounds it with room.
    tol = 64 * float(jnp.finfo(jnp.float32).eps) * scale
    np.testing.assert_allclose(np.asarray(logits_merged), np.asarray(logits_lora), atol=tol, rtol=0)


@pytest.mark.parametrize("targets", [("q", "v"), ("o",), ("down", "gate")])
def test_only_the_named_targets_get_adapters(targets):
    adapted = lora_state.with_adapters(
        random_model(tiny_config()), LoraConfig(rank=2, targets=targets)
    )
    _, adapters, _ = lora_state.split(adapted)
    got = {str(p[-1]).split("_")[0] for p, _ in nnx.to_flat_state(adapters)}
    assert got == set(targets)
    for _, var in nnx.to_flat_state(adapters):
        assert var.get_value().shape[0] == 2  # stacked under [L]
        assert var.get_metadata()["out_sharding"][0] == "layers"


def test_adapter_axes_follow_their_weights_sharding_rules():
    adapted = lora_state.with_adapters(random_model(tiny_config()), LoraConfig(rank=3))
    _, adapters, _ = lora_state.split(adapted)
    flat = dict(nnx.to_flat_state(adapters))
    a_names = flat[("layers", "mlp", "gate_a_Dr")].get_metadata()["out_sharding"]
    b_names = flat[("layers", "mlp", "gate_b_rF")].get_metadata()["out_sharding"]
    assert a_names == ("layers", "embed", "lora_rank")
    assert b_names == ("layers", "lora_rank", "mlp")
    sizes = {"data": 1, "fsdp": 37, "tensor": 67}  # divide D and F of the tiny model
    assert sharding_lib.logical_spec(a_names, (2, 37, 3), sizes) == jax.sharding.PartitionSpec(
        None, "fsdp"
    )
    assert sharding_lib.logical_spec(b_names, (2, 3, 67), sizes) == jax.sharding.PartitionSpec(
        None, None, "tensor"
    )
    mesh = sharding_lib.make_mesh(Config().mesh, devices=jax.devices()[:1])
    placed = sharding_lib.shard_params(adapters, mesh)  # every adapter axis has a rule
    assert len(jax.tree.leaves(placed)) == 14


@pytest.mark.parametrize(
    "override, culprit",
    [
        ("model.lora.rank=0", "model.lora.rank"),
        ("model.lora.rank=-2", "model.lora.rank"),
        ("model.lora.targets=q,qkv", "model.lora.targets"),
        ("model.lora.targets=q,q", "model.lora.targets"),
        ("model.lora.dropout=0.1", "model.lora.dropout"),
        ("model.lora.alpha=0", "model.lora.alpha"),
    ],
)
def test_bad_lora_config_names_the_key(override, culprit):
    with pytest.raises(ConfigError, match=culprit):
        config_io.apply_overrides(Config(), [override])


def test_lora_with_packed_rows_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"trainer\.pack.*model\.lora\.enabled"):
        config_io.apply_overrides(Config(), ["model.lora.enabled=true", "trainer.pack=true"])


def test_lora_overrides_parse():
    cfg = config_io.apply_overrides(
        Config(), ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.targets=q,down"]
    )
    assert cfg.model.lora == LoraConfig(enabled=True, rank=4, targets=("q", "down"))
    assert LoraConfig().targets == LORA_TARGETS


def test_rank_above_a_targets_width_names_the_key_and_the_target():
    cfg = tiny_config()  # k and v: 37 -> 2 x 10 = 20 wide
    lora.check(LoraConfig(rank=20), cfg)
    with pytest.raises(ConfigError, match=r"model\.lora\.rank.*'k'.*37 -> 20"):
        lora.check(LoraConfig(rank=21), cfg)
    lora.check(LoraConfig(rank=37, targets=("q", "gate")), cfg)  # 37 -> 40, 37 -> 67
    with pytest.raises(ConfigError, match="model.lora.rank"):
        lora_state.with_adapters(random_model(cfg), LoraConfig(rank=38, targets=("q",)))


def test_the_sampler_on_merged_weights_samples_as_the_adapted_model():
    """What the trainer's rollout runs (the merged weights, a model without adapters) and the
    adapted model itself sample the same greedy tokens."""
    from cppo_jax.rollout.embedded.sampler import make_sampler
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    adapted = _noisy_adapters(lora_state.with_adapters(random_model(tiny_config()), LoraConfig(3)))
    graphdef, adapters, base = lora_state.split(adapted)
    merged = lora_state.merge_weights(adapters, base, adapted.cfg)
    sp = SamplingParams(max_new_tokens=9, temperature=0.0, eos_id=(256,), pad_id=0)
    tokens_QP, valid_QP, _ = (jnp.asarray(x) for x in _left_padded())
    seeds_Q = jnp.arange(tokens_QP.shape[0], dtype=jnp.uint32)
    want = make_sampler(graphdef, 1, sp)(
        nnx.merge_state(adapters, base), tokens_QP, valid_QP, seeds_Q
    )
    got = make_sampler(lora_state.base_graphdef(adapted.cfg), 1, sp)(
        merged, tokens_QP, valid_QP, seeds_Q
    )
    np.testing.assert_array_equal(np.asarray(got.tokens_NC), np.asarray(want.tokens_NC))
    plain = make_sampler(lora_state.base_graphdef(adapted.cfg), 1, sp)(
        base, tokens_QP, valid_QP, seeds_Q
    )
    assert not np.array_equal(np.asarray(plain.tokens_NC), np.asarray(want.tokens_NC))


def _left_padded():
    from tests.helpers import left_pad

    return left_pad([[5, 17, 33, 2], [101, 7], [250, 3, 9]])
