"""RoPE scaling (`rope_scaling` of Llama 3.1/3.2 and Qwen2.5 checkpoints): parity with transformers."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from cppo_jax.models import TransformerConfig, load_hf, save_hf
from cppo_jax.models.hf_io import hf_tensors_to_model
from cppo_jax.models.hf_read import read_hf_tensors

try:
    import helpers
except ImportError:  # pragma: no cover - run as a package
    from tests import helpers

ORIGINAL = 64  # original_max_position_embeddings of the tiny checkpoints; rows run past it
LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
}
LLAMA32 = {**LLAMA31, "factor": 32.0}
QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# name -> (arch, tied, rope_scaling, max_position_embeddings)
CASES = {
    "llama3.1-style": ("llama", False, LLAMA31, 4 * ORIGINAL),
    "llama3.2-style-tied": ("llama", True, LLAMA32, 4 * ORIGINAL),
    "qwen2.5-style-yarn": ("qwen2", True, QWEN25_YARN, 4 * ORIGINAL),
    "qwen2-linear": ("qwen2", False, {"rope_type": "linear", "factor": 2.0}, 4 * ORIGINAL),
    "llama-dynamic": ("llama", False, {"rope_type": "dynamic", "factor": 2.0}, ORIGINAL),
}
LENGTHS = (ORIGINAL + 30, ORIGINAL - 20, 9)  # left-padded rows; the longest passes ORIGINAL
# Float32 logits through 2 layers of attention over ~100 positions: measured relative error
# ~5 ulps of the logits' scale; 64 ulps leaves room for other BLAS orders.
REL = 2**6 * np.finfo(np.float32).eps


def _batch(vocab: int):
    rng = np.random.default_rng(0)
    return helpers.left_pad([list(rng.integers(3, vocab, n)) for n in LENGTHS])


def _checkpoint(tmp_path, name):
    arch, tied, scaling, max_pos = CASES[name]
    return helpers.make_hf_checkpoint(
        tmp_path,
        arch=arch,
        tied=tied,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        name=name,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_logit_parity_with_transformers_past_original_length(tmp_path, name):
    path = _checkpoint(tmp_path, name)
    model = load_hf(path)
    assert dict(model.cfg.rope_scaling)["rope_type"] == dict(CASES[name][2]).get(
        "rope_type", CASES[name][2].get("type")
    )
    tokens_BT, valid_BT, positions_BT = _batch(model.cfg.vocab_size)
    assert positions_BT.max() >= ORIGINAL
    ref_BTV = helpers.hf_logits(helpers.load_hf_torch(path), tokens_BT, valid_BT)
    ours_BTV = np.asarray(helpers.forward(model, tokens_BT, positions_BT, valid_BT)[0])
    scale = np.abs(ref_BTV[valid_BT]).max()
    err = np.abs(ours_BTV - ref_BTV)[valid_BT].max() / scale
    # The same weights without the scaling are far off: the test sees the rope type.
    tensors, _ = read_hf_tensors(path)
    plain = hf_tensors_to_model(dataclasses.replace(model.cfg, rope_scaling=None), tensors)
    plain_BTV = np.asarray(helpers.forward(plain, tokens_BT, positions_BT, valid_BT)[0])
    plain_err = np.abs(plain_BTV - ref_BTV)[valid_BT].max() / scale
    print(
        f"{name}: max |ours - transformers| / max |logit| = {err:.2e} (unscaled RoPE: {plain_err:.2e})"
    )
    assert err < REL, err
    assert plain_err > 100 * REL, plain_err


def test_saved_scaling_round_trips_and_transformers_reads_it(tmp_path):
    path = _checkpoint(tmp_path, "llama3.1-style")
    model = load_hf(path)
    saved = save_hf(model, tmp_path / "saved")
    d = json.loads((saved / "config.json").read_text())
    assert d["rope_scaling"] == LLAMA31
    assert TransformerConfig.from_hf_dict(d) == model.cfg
    tokens_BT, valid_BT, positions_BT = _batch(model.cfg.vocab_size)
    ref_BTV = helpers.hf_logits(helpers.load_hf_torch(saved), tokens_BT, valid_BT)
    ours_BTV = np.asarray(helpers.forward(model, tokens_BT, positions_BT, valid_BT)[0])
    err = np.abs(ours_BTV - ref_BTV)[valid_BT].max() / np.abs(ref_BTV[valid_BT]).max()
    assert err < REL, err


def _hf(scaling, **extra):
    return helpers.tiny_config(arch="llama", attention_bias=False).to_hf_dict(
        rope_scaling=scaling, **extra
    )


def test_rope_scaling_forms_of_config_json():
    # Qwen2.5's legacy `type` key; transformers 5's `rope_parameters` with the base inside.
    assert (
        dict(TransformerConfig.from_hf_dict(_hf(QWEN25_YARN)).rope_scaling)["rope_type"] == "yarn"
    )
    d = _hf(None, rope_parameters={**LLAMA31, "rope_theta": 500000.0})
    cfg = TransformerConfig.from_hf_dict(d)
    assert cfg.rope_theta == 500000.0 and dict(cfg.rope_scaling)["factor"] == 8.0
    assert TransformerConfig.from_hf_dict(_hf({"rope_type": "default"})).rope_scaling is None
    # original_max_position_embeddings defaults to max_position_embeddings, as in transformers.
    no_original = {k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}
    cfg = TransformerConfig.from_hf_dict(_hf(no_original, max_position_embeddings=999))
    assert dict(cfg.rope_scaling)["original_max_position_embeddings"] == 999
    assert hash(cfg)  # stays usable as a static jit argument


@pytest.mark.parametrize(
    "scaling,culprit",
    [
        ({"rope_type": "longrope", "short_factor": [1.0]}, "'longrope' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0}, "missing ['low_freq_factor', 'high_freq_factor']"),
        ({"rope_type": "linear", "factor": 2.0, "fator": 3.0}, "unknown ['fator']"),
        ({"rope_type": "linear", "factor": -2.0}, "factor must be a positive number, got -2.0"),
        ({**LLAMA31, "low_freq_factor": 4.0}, "high_freq_factor 4.0 must exceed"),
        (
            {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5},
            "partial_rotary_factor",
        ),
    ],
)
def test_bad_rope_scaling_is_refused_by_name(scaling, culprit):
    with pytest.raises(ValueError, match="rope_scaling") as err:
        TransformerConfig.from_hf_dict(_hf(scaling))
    assert culprit in str(err.value)


@pytest.mark.parametrize("name", ["llama3.1-style", "qwen2.5-style-yarn"])
def test_embedded_sampler_greedy_matches_transformers_past_original_length(tmp_path, name):
    """The sampler's own decode step (its cos/sin table) under scaling: greedy tokens from prompts
    ending just before `original_max_position_embeddings` equal transformers' greedy tokens, and
    their log-probs agree with transformers' log-softmax."""
    import jax.numpy as jnp
    from flax import nnx

    from cppo_jax.rollout.embedded.sampler import make_sampler
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    path = _checkpoint(tmp_path, name)
    model = load_hf(path)
    hf_model = helpers.load_hf_torch(path)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(3, model.cfg.vocab_size, n)) for n in (ORIGINAL - 4, ORIGINAL - 9)]
    C = 12  # completions run from position ORIGINAL - 4 to ORIGINAL + 7
    tokens_QP, valid_QP, _ = helpers.left_pad(prompts)
    graphdef, state = nnx.split(model)
    sp = SamplingParams(max_new_tokens=C, temperature=0.0, eos_id=model.cfg.vocab_size, pad_id=0)
    out = make_sampler(graphdef, 1, sp)(
        state, jnp.asarray(tokens_QP), jnp.asarray(valid_QP), jnp.zeros((2,), jnp.uint32)
    )
    seqs = [list(p) for p in prompts]
    ref_logp = []
    for _ in range(C):
        t_BT, v_BT, _ = helpers.left_pad(seqs)
        logits_BV = helpers.hf_logits(hf_model, t_BT, v_BT)[:, -1].astype(np.float64)
        logp_BV = logits_BV - logits_BV.max(-1, keepdims=True)
        logp_BV -= np.log(np.exp(logp_BV).sum(-1, keepdims=True))
        ref_logp.append(logp_BV.max(-1))
        for s, t in zip(seqs, logits_BV.argmax(-1)):
            s.append(int(t))
    ref_tokens = np.asarray([s[len(p) :] for s, p in zip(seqs, prompts)])
    np.testing.assert_array_equal(np.asarray(out.tokens_NC), ref_tokens)
    logp_scale = np.abs(np.stack(ref_logp, 1)).max()
    np.testing.assert_allclose(
        np.asarray(out.logp_NC), np.stack(ref_logp, 1), rtol=0, atol=REL * max(logp_scale, 1.0)
    )
