"""Qwen3 (`Qwen3ForCausalLM`) and Gemma 3 text (`Gemma3ForCausalLM`): logits parity with
transformers' own implementations on random-init checkpoints at prime-number sizes (float32 and
bfloat16, tolerances from the dtype), the Hugging Face round trip, Gemma 3's sliding window (a
sequence longer than the window, a test that fails when the window is ignored), the KV-cache decode
and the embedded sampler against the full forward, and the stop ids of the generation config."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from cppo_jax.models import TransformerConfig, init_cache, load_hf, save_hf
from cppo_jax.models.config import FULL, SLIDING
from cppo_jax.models.hf_io import state_to_hf_tensors

try:
    import helpers
except ImportError:  # pragma: no cover - run as a package
    from tests import helpers

# Rows longer than Gemma's test window (5), left-padded, one of a single token.
PROMPTS = [
    [5, 17, 33, 101, 250, 7, 64, 90, 12, 3, 77],
    [9, 200, 3],
    [44, 45, 46, 47, 48, 49],
    [128],
]
WINDOW = 5
# Gemma 3's interleaving at a depth of 3: local, global, local (its real pattern is 5 : 1; the
# default `layer_types` of TransformerConfig; a short stack keeps the test small).
GEMMA_LAYERS = [SLIDING, FULL, SLIDING]


def _gemma_kwargs(**extra):
    return dict(
        layers=3,
        sliding_window=WINDOW,
        layer_types=GEMMA_LAYERS,
        query_pre_attn_scalar=13,  # not head_dim: a scale taken from head_dim would be wrong
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "default", "rope_theta": 1000000.0},
        },
        **extra,
    )


def checkpoint(tmp_path, arch, tied=True, dtype="float32", seed=0):
    kwargs = _gemma_kwargs() if arch == "gemma3" else {"layers": 2}
    return helpers.make_hf_checkpoint(
        tmp_path,
        arch=arch,
        tied=tied,
        seed=seed,
        torch_dtype=dtype,
        name=f"{arch}_{dtype}",
        **kwargs,
    )


def _valid_max_error(ours, ref, valid_BT):
    return float(np.abs(np.asarray(ours, np.float64) - ref)[valid_BT].max())


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("qwen3", False), ("gemma3", True)])
def test_float32_logits_equal_transformers(tmp_path, arch, tied):
    src = checkpoint(tmp_path, arch, tied)
    model = load_hf(src)
    assert model.cfg.arch == arch and model.cfg.tie_word_embeddings == tied
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS)
    ref = helpers.hf_logits(helpers.load_hf_torch(src), tokens_BT, valid_BT)
    ours = np.asarray(helpers.forward(model, tokens_BT, positions_BT, valid_BT)[0])
    # float32 on both sides: the same sums in another order, a few ulps per layer of the logits' size
    scale = float(np.abs(ref[valid_BT]).max())
    assert _valid_max_error(ours, ref, valid_BT) <= 256 * np.finfo(np.float32).eps * scale


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_bfloat16_logits_equal_transformers_within_bf16_rounding(tmp_path, arch):
    """Both in bfloat16 (params and compute): each side rounds every activation to 8 significant
    bits, in a different order, so the logits agree to a few bf16 ulps of their size, and far
    closer than to a model off by one weight's layout (checked against float32 too)."""
    import torch

    src = checkpoint(tmp_path, arch, dtype="bfloat16")
    model = load_hf(src, dtype="bfloat16", param_dtype="bfloat16")
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(src), dtype=torch.bfloat16, attn_implementation="eager", local_files_only=True
    ).eval()
    ref = helpers.hf_logits(hf, tokens_BT, valid_BT)
    ours = np.asarray(helpers.forward(model, tokens_BT, positions_BT, valid_BT)[0])
    eps = float(jnp.finfo(jnp.bfloat16).eps)  # 2^-7
    scale = float(np.abs(ref[valid_BT]).max())
    err = _valid_max_error(ours, ref, valid_BT)
    assert err <= 8 * eps * scale, (err, scale)
    # ... and the bf16 run is the float32 model's within the same bound (no layout error hides in
    # the rounding).
    f32 = np.asarray(helpers.forward(load_hf(src), tokens_BT, positions_BT, valid_BT)[0])
    assert _valid_max_error(ours, f32, valid_BT) <= 8 * eps * scale


def test_gemma_sliding_window_matters_and_is_the_transformers_window(tmp_path):
    """With sequences longer than the window, a model that ignores the window (every layer global)
    is far from transformers' logits; ours equals them. Both RoPE bases and the window apply."""
    src = checkpoint(tmp_path, "gemma3")
    model = load_hf(src)
    assert model.cfg.local_layers == (True, False, True)
    assert (model.cfg.rope_theta, model.cfg.rope_local_theta) == (1e6, 1e4)
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS)
    assert valid_BT.sum(axis=1).max() > WINDOW
    ref = helpers.hf_logits(helpers.load_hf_torch(src), tokens_BT, valid_BT)
    tol = 256 * np.finfo(np.float32).eps * float(np.abs(ref[valid_BT]).max())

    def logits_of(**changes):
        cfg = dataclasses.replace(model.cfg, **changes)
        other = load_hf_with(src, cfg)
        return np.asarray(helpers.forward(other, tokens_BT, positions_BT, valid_BT)[0])

    assert _valid_max_error(logits_of(), ref, valid_BT) <= tol
    ignored = logits_of(sliding_window=10_000)  # the window never binds: as if ignored
    assert _valid_max_error(ignored, ref, valid_BT) > 1000 * tol
    # Only positions beyond the window differ: the first WINDOW tokens of each row see the same keys.
    early_BT = valid_BT & (np.cumsum(valid_BT, axis=1) <= WINDOW)
    assert _valid_max_error(ignored, ref, early_BT) <= tol
    # The local layers' own RoPE base matters (less at these short positions: 100x the tolerance)
    one_base = logits_of(rope_local_theta=1e6)
    assert _valid_max_error(one_base, ref, valid_BT) > 100 * tol


def load_hf_with(src, cfg: TransformerConfig):
    from cppo_jax.models.hf_io import hf_tensors_to_model
    from cppo_jax.models.hf_read import read_hf_tensors

    tensors, _ = read_hf_tensors(src)
    return hf_tensors_to_model(cfg, tensors)


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("gemma3", True)])
def test_roundtrip_is_bit_exact_and_transformers_reads_the_export(tmp_path, arch, tied):
    src = checkpoint(tmp_path, arch, tied)
    model = load_hf(src)
    tensors = state_to_hf_tensors(model)
    original = load_file(src / "model.safetensors")
    if tied:
        original.setdefault("lm_head.weight", original["model.embed_tokens.weight"])
    assert tensors.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    out = save_hf(model, tmp_path / "saved", source_dir=src)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [
        {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    ]
    again = load_hf(out)
    assert again.cfg == model.cfg
    tokens_BT, valid_BT, _ = helpers.left_pad(PROMPTS)
    hf_saved = helpers.hf_logits(helpers.load_hf_torch(out), tokens_BT, valid_BT)
    hf_orig = helpers.hf_logits(helpers.load_hf_torch(src), tokens_BT, valid_BT)
    np.testing.assert_array_equal(hf_saved, hf_orig)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_cache_decode_equals_the_full_forward(tmp_path, arch):
    """Prefill then one token at a time through the KV cache (Gemma: the window is a mask over the
    cache's static slots) gives the full forward's logits, past the window too."""
    model = load_hf(checkpoint(tmp_path, arch))
    seqs = [p + [11, 12, 13, 14, 15, 16] for p in PROMPTS]
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(seqs)
    full_BTV = np.asarray(helpers.forward(model, tokens_BT, positions_BT, valid_BT)[0])
    B, T = tokens_BT.shape
    P = T - 6
    cache = init_cache(model.cfg, B, T, jnp.float32)
    logits_BPV, cache = helpers.forward(
        model, tokens_BT[:, :P], positions_BT[:, :P], valid_BT[:, :P], cache
    )
    steps = [np.asarray(logits_BPV)]
    for t in range(P, T):
        logits_B1V, cache = helpers.forward(
            model,
            tokens_BT[:, t : t + 1],
            positions_BT[:, t : t + 1],
            valid_BT[:, t : t + 1],
            cache,
        )
        steps.append(np.asarray(logits_B1V))
    cached_BTV = np.concatenate(steps, axis=1)
    atol = 100 * np.finfo(np.float32).eps * np.abs(full_BTV).max()
    np.testing.assert_allclose(cached_BTV[valid_BT], full_BTV[valid_BT], rtol=0, atol=atol)


def test_qwen3_stop_ids_come_from_the_generation_config(tmp_path):
    """Qwen3's generation_config.json lists <|im_end|> and <|endoftext|>: both end a completion."""
    from cppo_jax.models import Tokenizer

    src = checkpoint(tmp_path, "qwen3")
    tok_dir = helpers.make_tokenizer_dir(tmp_path)
    for file in tok_dir.iterdir():
        (src / file.name).write_bytes(file.read_bytes())
    tokenizer = Tokenizer.from_dir(src)
    eos, other = tokenizer.eos_id, tokenizer.eos_id + 1
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, other]}))
    assert set(Tokenizer.from_dir(src).stop_ids) >= {eos, other}


def test_config_reads_both_gemma_forms_and_refuses_what_it_lacks():
    base = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 257,
        "hidden_size": 44,
        "intermediate_size": 67,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 10,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 512,
        "query_pre_attn_scalar": 10,
    }
    # transformers 4's form (the released Gemma 3 config.json files): a pattern, two bases
    old = TransformerConfig.from_hf_dict(
        {
            **base,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    assert old.local_layers == (True,) * 5 + (False, True)
    assert (old.rope_theta, old.rope_local_theta) == (1e6, 1e4)
    assert dict(old.rope_scaling)["factor"] == 8.0 and old.tie_word_embeddings
    # transformers 5's: layer_types and one rope_parameters per kind; and our own export of it
    new = TransformerConfig.from_hf_dict(old.to_hf_dict())
    assert new == old
    for key, value, match in [
        ("final_logit_softcapping", 30.0, "soft-capping"),
        ("hidden_activation", "silu", "hidden_act"),
    ]:
        with pytest.raises(ValueError, match=match):
            TransformerConfig.from_hf_dict({**base, key: value})
    with pytest.raises(ValueError, match="splash"):
        dataclasses.replace(old, attention="splash")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_sampler_logps_equal_the_full_forward(tmp_path, arch):
    """The embedded sampler (shared prefill, then its own cached decode step) returns the log-probs
    the trainer's full forward gives its tokens; for Gemma past the window, in its local layers
    (the window a mask over the prompt's and the completions' static slots)."""
    from flax import nnx

    from cppo_jax.rollout.embedded.sampler import make_sampler, positions_from_valid
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    model = load_hf(checkpoint(tmp_path, arch))
    P, C, G = 11, 7, 2
    sp = SamplingParams(max_new_tokens=C, temperature=3.0, eos_id=257, pad_id=0)
    tokens_QP, valid_QP, _ = helpers.left_pad(PROMPTS, length=P)
    graphdef, state = nnx.split(model)
    seeds = jnp.arange(len(PROMPTS), dtype=jnp.uint32)
    out = make_sampler(graphdef, G, sp)(state, jnp.asarray(tokens_QP), jnp.asarray(valid_QP), seeds)
    tokens_NC = np.asarray(out.tokens_NC)
    tokens_NT = np.concatenate([np.repeat(tokens_QP, G, axis=0), tokens_NC], axis=1)
    valid_NT = np.concatenate([np.repeat(valid_QP, G, axis=0), np.asarray(out.valid_NC)], axis=1)
    assert valid_NT.sum(axis=1).max() > 2 * WINDOW
    valid_NT = jnp.asarray(valid_NT)
    logits_NTV, _ = helpers.forward(model, tokens_NT, positions_from_valid(valid_NT), valid_NT)
    z_NCV = np.asarray(logits_NTV, np.float64)[:, P - 1 : P + C - 1] / sp.temperature
    z_NCV -= z_NCV.max(axis=-1, keepdims=True)
    logp_NCV = z_NCV - np.log(np.exp(z_NCV).sum(axis=-1, keepdims=True))
    want_NC = np.take_along_axis(logp_NCV, tokens_NC[..., None], axis=-1)[..., 0]
    got_NC = np.asarray(out.logp_NC)
    scale = float(np.abs(np.asarray(logits_NTV)).max()) / sp.temperature
    assert np.abs(got_NC - want_NC).max() <= 256 * np.finfo(np.float32).eps * scale
    # sampling, not a constant stream: some question's two samples differ
    assert len({tuple(row) for row in tokens_NC}) > len(PROMPTS)


def _arith_model_dir(out, arch: str):
    """A random tiny model of `arch` with the arith tokenizer, saved as a Hugging Face folder (as
    conftest.build_arith_model_dir; Gemma with a window of 8 tokens, far below the prompts' 72)."""
    from cppo_jax.models.tokenizer import Tokenizer
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer

    tok_dir = build_tokenizer(out.parent / f"{out.name}_tokenizer")
    extra = {"sliding_window": 8, "layer_types": (SLIDING, FULL)} if arch == "gemma3" else {}
    cfg = TransformerConfig(
        arch=arch,
        vocab_size=Tokenizer.from_dir(tok_dir).vocab_size,
        hidden_size=32,
        intermediate_size=65,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        **extra,
    )
    return save_hf(helpers.random_model(cfg, seed=1), out, tokenizer_dir=tok_dir)


@pytest.mark.slow
@pytest.mark.parametrize("arch,loss_type", [("qwen3", "gspo"), ("gemma3", "cispo")])
def test_a_cppo_step_with_the_embedded_sampler_trains_and_exports(tmp_path, arch, loss_type):
    """One CPPO step (pruning 0.5, allocation, mu = 2: two updates) of each new architecture, random
    init, the embedded sampler; the run's export (`export_policy`, as the run's end writes it) is
    the trained policy and transformers loads it as its class. The run around the step (evaluation,
    checkpoints, the export's place) is the same for every architecture: tests/test_trainer.py."""
    from cppo_jax.train.export import export_policy
    from cppo_jax.train.trainer import Trainer
    from tests.helpers import spread_reward
    from tests.test_trainer import small_config

    model_dir = _arith_model_dir(tmp_path / "model", arch)
    cfg = small_config(
        tmp_path, model_dir, f"cppo.loss_type={loss_type}", "cppo.mu=2", *spread_reward(tmp_path)
    )
    trainer = Trainer(cfg)
    try:
        metrics = trainer.step(0)
        actor = trainer.actor
        export = export_policy(
            actor.graphdef, trainer.policy_params(), cfg, tmp_path / "export", actor.model_path
        )
    finally:
        trainer.close()
    assert metrics["update_skipped"] == 0.0 and np.isfinite(metrics["loss"])
    assert metrics["grad_norm"] > 0
    assert metrics["cppo/questions"] == 4 and metrics["cppo/kept"] == 8
    trained = load_hf(export)
    assert (
        trained.cfg.arch == arch and trained.cfg.local_layers == load_hf(model_dir).cfg.local_layers
    )
    moved = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(
            state_to_hf_tensors(trained).values(), state_to_hf_tensors(load_hf(model_dir)).values()
        )
    ]
    assert max(moved) > 0
    assert (
        type(helpers.load_hf_torch(export)).__name__ == trained.cfg.to_hf_dict()["architectures"][0]
    )


def _gemma_tiny(**changes):
    cfg = helpers.tiny_config(
        arch="gemma3",
        hidden_size=44,
        attention_bias=False,
        num_layers=3,
        sliding_window=4,
        layer_types=tuple(GEMMA_LAYERS),
        query_pre_attn_scalar=13.0,
        max_position_embeddings=64,
    )
    return dataclasses.replace(cfg, **changes)


@pytest.mark.slow
def test_gemma_library_attention_and_packed_rows_keep_the_window():
    """model.attention=xla (jax.nn.dot_product_attention, the window in its mask) and packed rows
    (trainer.pack: several sequences a row, the window within each) give the einsum path's padded
    log-probs; a packed forward whose window were ignored would not."""
    from flax import nnx

    from cppo_jax.config.schema import CPPOConfig
    from cppo_jax.packing import pack as packing
    from cppo_jax.packing.rows import packed_batch, packed_completion_logps
    from cppo_jax.train import device_fns as step_lib

    M, P, C = 5, 5, 9
    model = helpers.random_model(_gemma_tiny(), seed=2)
    rng = np.random.default_rng(3)
    p_M, c_M = rng.integers(2, P + 1, M), rng.integers(5, C + 1, M)
    slot = np.arange(P + C)
    valid = ((slot >= P - p_M[:, None]) & (slot < P)) | ((slot >= P) & (slot < P + c_M[:, None]))
    tokens = np.where(valid, rng.integers(1, 257, (M, P + C)), 0).astype(np.int32)
    mask = valid[:, P:].astype(np.float32)
    spec = step_lib.StepSpec.make(CPPOConfig(), P, C, 1.0)
    padded = jax_jit_partial(step_lib.completion_logps, spec)(model, tokens, valid)
    eps = np.finfo(np.float32).eps
    tol = 256 * eps * max(1.0, float(np.abs(np.asarray(padded)[mask > 0]).max()))

    def close(got):
        return float(np.abs(np.where(mask > 0, np.asarray(got) - np.asarray(padded), 0)).max())

    _, state = nnx.split(model)  # the same weights under other configs
    xla = nnx.merge(nnx.split(helpers.random_model(_gemma_tiny(attention="xla"), seed=2))[0], state)
    assert close(jax_jit_partial(step_lib.completion_logps, spec)(xla, tokens, valid)) <= tol

    L = P + C + 8
    rows = packing.rows_for(valid.sum(axis=1), L)
    packed = packing.pack(tokens, valid, P, rows, L, mask_MC=mask)
    batch = packed_batch(packed, mask, np.zeros(M, np.float32))
    assert batch.tokens_RL.shape[0] < M  # sequences really share rows
    logps = jax_jit_partial(packed_completion_logps, spec)
    assert close(logps(model, batch)) <= tol
    wide = nnx.merge(
        nnx.split(helpers.random_model(_gemma_tiny(sliding_window=64), seed=2))[0], state
    )
    assert close(logps(wide, batch)) > 100 * tol


def jax_jit_partial(fn, spec):
    import functools

    from flax import nnx

    return nnx.jit(functools.partial(fn, spec=spec))


def test_known_sizes_of_qwen3_and_gemma3():
    """`plan` sizes these by name without a folder: each count is the sum, by hand, of the released
    config's tensors (Qwen3-4B: 36 layers of 100,930,816 (q, o 2560 x 4096; k, v 2560 x 1024; MLP
    3 x 2560 x 9728; four norms) + tied 151936 x 2560 + 2560; 8B untied; Gemma 3 1B: 26 layers of
    26,842,112, six norms each, + tied 262144 x 1152 + 1152): the model cards' 4.0B, 8.2B and 1B."""
    from cppo_jax.models import known

    # Gemma 3 4B's text decoder: 34 layers of 94,382,592 (q, o 2560 x 2048; k, v 2560 x 1024; MLP
    # 3 x 2560 x 10240; four norms of 2560 and the q / k norms of 256) + tied 262208 x 2560 + 2560
    want = {
        "Qwen3-4B": 4_022_468_096,
        "Qwen3-8B": 8_190_735_360,
        "gemma-3-1b-it": 999_885_952,
        "gemma-3-4b-it": 3_880_263_168,
    }
    for name, params in want.items():
        assert known.model_size(known.KNOWN_MODELS[name]).params == params, name
    assert known.find_known_model("/models/Qwen3-8B") == "Qwen3-8B"
    assert known.find_known_model("/models/gemma-3-1b-it") == "gemma-3-1b-it"
    assert known.find_known_model("/models/gemma-3-4b-it") == "gemma-3-4b-it"
    gemma = TransformerConfig.from_hf_dict(known.KNOWN_MODELS["gemma-3-1b-it"])
    assert (
        gemma.local_layers.count(False) == 4 and gemma.sliding_window == 512
    )  # layers 6, 12, 18, 24
