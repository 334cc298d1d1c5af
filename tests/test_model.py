"""The NNX decoder: parity with transformers, KV cache, remat, bf16, config handling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.models import TransformerConfig, init_cache, init_model, load_hf, repeat_cache

try:
    import helpers
except ImportError:  # pragma: no cover - run as a package
    from tests import helpers

PROMPTS = [[5, 17, 33, 101, 250, 7, 64], [9, 200, 3], [44, 45, 46, 47, 48], [128]]
LOGICAL_AXES = {"layers", "vocab", "embed", "mlp", "q_heads", "kv_heads", "head_dim", "norm"}


small_config = helpers.tiny_config
scrambled_model = helpers.random_model
STEPS = 16
TRACES: list[tuple] = []  # one entry per trace of `forward_cache`


def forward(model, tokens_BT, positions_BT, valid_BT):
    """Jitted no-cache forward logits (compiles shared with other test files)."""
    return helpers.forward(model, tokens_BT, positions_BT, valid_BT)[0]


@nnx.jit
def forward_cache(model, tokens_BT, positions_BT, valid_BT, cache):
    """Jitted forward through a KV cache: (logits, cache). Shared by tests to share compiles."""
    TRACES.append(tokens_BT.shape)
    return model(tokens_BT, positions_BT, valid_BT, cache)


def greedy_with_cache(model, prompts, steps: int = STEPS):
    """Greedy decoding: one prefill, then `steps - 1` one-token steps. (tokens_BC, logits_BCV)."""
    tokens_BP, valid_BP, positions_BP = helpers.left_pad(prompts)
    B, P = tokens_BP.shape
    cache = init_cache(model.cfg, B, P + steps, jnp.float32)
    logits_BTV, cache = forward_cache(model, tokens_BP, positions_BP, valid_BP, cache)
    position_B = jnp.asarray(valid_BP.sum(axis=1), jnp.int32)
    step_logits = [logits_BTV[:, -1]]
    out = [jnp.argmax(step_logits[-1], axis=-1)]
    for c in range(steps - 1):
        if c == 1:
            traces_after_first_step = len(TRACES)
        logits_BTV, cache = forward_cache(
            model, out[-1][:, None], position_B[:, None] + c, jnp.ones((B, 1), bool), cache
        )
        step_logits.append(logits_BTV[:, -1])
        out.append(jnp.argmax(step_logits[-1], axis=-1))
    assert len(TRACES) == traces_after_first_step  # the decode step never retraces
    assert int(cache.index) == P + steps - 1
    return np.stack(out, axis=1), np.stack(step_logits, axis=1)


def greedy_hf(hf_model, prompts, steps: int = STEPS):
    """Greedy decoding with full transformers forwards on the growing left-padded batch."""
    seqs = [list(p) for p in prompts]
    out, step_logits = [], []
    for _ in range(steps):
        tokens_BT, valid_BT, _ = helpers.left_pad(seqs)
        step_logits.append(helpers.hf_logits(hf_model, tokens_BT, valid_BT)[:, -1])
        out.append(step_logits[-1].argmax(-1))
        for s, t in zip(seqs, out[-1]):
            s.append(int(t))
    return np.stack(out, axis=1), np.stack(step_logits, axis=1)


# Covers qwen2 tied/untied, llama, and GQA ratios 2, 4 and 1 (in that order).
@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,tied,heads,kv_heads",
    [("qwen2", True, 4, 2), ("qwen2", False, 4, 1), ("llama", False, 4, 4)],
)
def test_logit_and_greedy_parity_with_transformers(tmp_path, arch, tied, heads, kv_heads):
    path = helpers.make_hf_checkpoint(
        tmp_path, arch=arch, tied=tied, heads=heads, kv_heads=kv_heads
    )
    hf_model = helpers.load_hf_torch(path)
    model = load_hf(path)
    assert model.cfg.arch == arch and model.cfg.tie_word_embeddings == tied
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS)
    ours_BTV = np.asarray(forward(model, tokens_BT, positions_BT, valid_BT))
    ref_BTV = helpers.hf_logits(hf_model, tokens_BT, valid_BT)
    assert np.isfinite(ours_BTV).all()
    diff = np.abs(ours_BTV - ref_BTV)[valid_BT]
    assert diff.max() < 1e-4, diff.max()
    assert np.abs(ref_BTV[valid_BT]).std() > 0.5  # non-trivial logits

    ours_tokens, ours_logits = greedy_with_cache(model, PROMPTS)
    ref_tokens, ref_logits = greedy_hf(hf_model, PROMPTS)
    np.testing.assert_array_equal(ours_tokens, ref_tokens)
    np.testing.assert_allclose(ours_logits, ref_logits, atol=1e-4)


def test_cache_decode_matches_full_forward():
    cfg = small_config()
    model = scrambled_model(cfg, seed=3)
    tokens_BP, valid_BP, positions_BP = helpers.left_pad(PROMPTS)
    B, P = tokens_BP.shape
    C = 6
    cont_BC = np.asarray(jax.random.randint(jax.random.key(7), (B, C), 0, cfg.vocab_size), np.int32)
    full_tokens = np.concatenate([tokens_BP, cont_BC], axis=1)
    full_valid = np.concatenate([valid_BP, np.ones((B, C), bool)], axis=1)
    full_positions = np.maximum(np.cumsum(full_valid, axis=1) - 1, 0)
    full_BTV = np.asarray(forward(model, full_tokens, full_positions, full_valid))
    assert model(full_tokens[:1, :2], full_positions[:1, :2], full_valid[:1, :2])[1] is None

    cache = init_cache(cfg, B, P + STEPS)  # spare slots stay invalid
    prefill_BPV, cache = forward_cache(model, tokens_BP, positions_BP, valid_BP, cache)
    # Cached and full forwards sum in different orders: float32 rounding relative to the logits' scale.
    atol = 100 * np.finfo(np.float32).eps * np.abs(full_BTV).max()
    np.testing.assert_allclose(
        np.asarray(prefill_BPV)[valid_BP], full_BTV[:, :P][valid_BP], rtol=0, atol=atol
    )
    assert int(cache.index) == P
    n_traces = len(TRACES)
    for c in range(C):
        logits_B1V, cache = forward_cache(
            model,
            cont_BC[:, c : c + 1],
            full_positions[:, P + c : P + c + 1],
            np.ones((B, 1), bool),
            cache,
        )
        np.testing.assert_allclose(logits_B1V[:, 0], full_BTV[:, P + c], rtol=0, atol=atol)
    assert len(TRACES) <= n_traces + 1  # at most one decode compile for all steps
    assert int(cache.index) == P + C
    np.testing.assert_array_equal(np.asarray(cache.valid_BS)[:, : P + C], full_valid)
    assert not np.asarray(cache.valid_BS)[:, P + C :].any()


def test_decode_step_under_jax_jit_compiles_once():
    """A plain jax.jit over (state, cache) with a traced index: one trace for all steps."""
    model = scrambled_model(small_config(), seed=6)
    graphdef, state = nnx.split(model)
    traces = []

    @jax.jit
    def step(state, token_B1, position_B1, cache):
        traces.append(None)
        m = nnx.merge(graphdef, state)
        return m(token_B1, position_B1, jnp.ones_like(token_B1, bool), cache)

    cache = init_cache(model.cfg, 2, 5)
    for i in range(4):
        tok = jnp.full((2, 1), i + 3, jnp.int32)
        _, cache = step(state, tok, jnp.full((2, 1), i, jnp.int32), cache)
    assert len(traces) == 1 and int(cache.index) == 4
    if hasattr(step, "_cache_size"):
        assert step._cache_size() == 1


def test_repeat_cache_shares_prefill():
    cfg = small_config()
    model = scrambled_model(cfg, seed=5)
    n = 3
    prompts = PROMPTS[:2]
    tokens_BP, valid_BP, positions_BP = helpers.left_pad(prompts)
    P = tokens_BP.shape[1]
    _, cache = forward_cache(model, tokens_BP, positions_BP, valid_BP, init_cache(cfg, 2, P + 2))
    shared = repeat_cache(cache, n)
    assert shared.k_LBSJE.shape[1] == 2 * n and int(shared.index) == P
    tokens_NP, valid_NP, positions_NP = helpers.left_pad([p for p in prompts for _ in range(n)])
    _, direct = forward_cache(
        model, tokens_NP, positions_NP, valid_NP, init_cache(cfg, 2 * n, P + 2)
    )
    np.testing.assert_allclose(shared.k_LBSJE, direct.k_LBSJE, atol=1e-6)
    np.testing.assert_array_equal(shared.valid_BS, direct.valid_BS)
    assert jax.tree.structure(cache.repeat(n)) == jax.tree.structure(shared)

    next_N1 = np.arange(2 * n, dtype=np.int32)[:, None] + 10  # different token per sample
    pos_N1 = valid_NP.sum(axis=1, keepdims=True).astype(np.int32)
    a, _ = forward_cache(model, next_N1, pos_N1, np.ones((2 * n, 1), bool), shared)
    b, _ = forward_cache(model, next_N1, pos_N1, np.ones((2 * n, 1), bool), direct)
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_padding_is_finite_and_ignored():
    cfg = small_config()
    model = scrambled_model(cfg, seed=2)
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS)
    logits_BTV = forward(model, tokens_BT, positions_BT, valid_BT)
    assert np.isfinite(np.asarray(logits_BTV)).all()
    # Changing what sits in padding slots (even an out-of-range id) changes no valid logit.
    other = np.where(valid_BT, tokens_BT, 999)
    other_BTV = forward(model, other, positions_BT, valid_BT)
    np.testing.assert_allclose(
        np.asarray(other_BTV)[valid_BT], np.asarray(logits_BTV)[valid_BT], atol=1e-6
    )
    # Completion-style right padding: a trailing invalid slot never affects earlier ones.
    valid_r = valid_BT.copy()
    valid_r[:, -1] = False
    right_BTV = forward(model, tokens_BT, positions_BT, valid_r)
    keep = valid_BT[:, :-1]
    np.testing.assert_allclose(
        np.asarray(right_BTV)[:, :-1][keep], np.asarray(logits_BTV)[:, :-1][keep], atol=1e-6
    )


def _remat_loss_and_grad(policy: str, scan: bool):
    """The loss of two prompts and its gradient for a 2-layer model with remat `policy`, host copies."""
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS[:2])

    def loss(m):
        logits_BTV, _ = m(tokens_BT, positions_BT, valid_BT)
        logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1])
        picked_BT = jnp.take_along_axis(logp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(valid_BT[:, 1:], picked_BT, 0.0))

    model = scrambled_model(small_config(num_layers=2, remat=policy, scan_layers=scan), seed=1)
    loss_v, g = nnx.jit(nnx.value_and_grad(loss))(model)
    return float(loss_v), [(p, np.asarray(v.get_value())) for p, v in nnx.to_flat_state(g)]


@pytest.fixture(scope="module")
def save_all():
    """`_remat_loss_and_grad` of `save_all` (nothing recomputed) per layer layout, built once."""
    done = {}

    def of(scan: bool):
        if scan not in done:
            done[scan] = _remat_loss_and_grad("save_all", scan)
        return done[scan]

    return of


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("policy", ["full", "minimal", "dots_saveable"])
def test_each_remat_policy_gives_the_loss_and_gradient_of_no_remat(policy, scan, save_all):
    """A remat policy changes what the backward recomputes, not what it computes: the loss and
    gradient equal those of `save_all` (nothing recomputed) within float32 rounding."""
    assert small_config(remat=True).remat == "full"  # an older config's boolean
    assert small_config(remat=False).remat == "dots_saveable"
    loss_b, g_b = save_all(scan)
    loss_r, g_r = _remat_loss_and_grad(policy, scan)
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(loss_r, loss_b, rtol=100 * eps)
    for (path, a), (_, b) in zip(g_r, g_b, strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(
            a, b, rtol=0, atol=100 * eps * max(np.abs(b).max(), eps), err_msg=str(path)
        )


def test_remat_policies_are_checked_by_name():
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.config.files import apply_overrides, from_dict, to_dict
    from cppo_jax.config.model import ModelConfig
    from cppo_jax.config.schema import Config

    # An older run's config.json (a boolean) and an older command line still load.
    old = to_dict(Config())
    for value, policy in ((True, "full"), (False, "dots_saveable")):
        assert ModelConfig(remat=value).remat == policy
        old["model"]["remat"] = value
        assert from_dict(old).model.remat == policy
        assert (
            apply_overrides(Config(), [f"model.remat={str(value).lower()}"]).model.remat == policy
        )
    assert apply_overrides(Config(), ["model.remat=minimal"]).model.remat == "minimal"
    with pytest.raises(ConfigError, match=r"model.remat.*'save_all', 'full', 'minimal'"):
        ModelConfig(remat="everything")
    with pytest.raises(ValueError, match="remat"):
        small_config(remat="everything")


def test_bf16_compute_close_to_fp32():
    model = scrambled_model(small_config(), seed=4)
    bf16 = scrambled_model(small_config(dtype="bfloat16"), seed=4)
    tokens_BT, valid_BT, positions_BT = helpers.left_pad(PROMPTS)
    ref = forward(model, tokens_BT, positions_BT, valid_BT)
    out, cache = forward_cache(bf16, tokens_BT, positions_BT, valid_BT, init_cache(bf16.cfg, 4, 8))
    h = nnx.eval_shape(lambda m: m.hidden(tokens_BT, positions_BT, valid_BT)[0], bf16)
    assert out.dtype == jnp.float32 and h.dtype == jnp.bfloat16
    ref, out = np.asarray(ref)[valid_BT], np.asarray(out)[valid_BT]
    assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()
    assert cache.k_LBSJE.dtype == jnp.bfloat16


def test_unembed_weight_and_logical_axes():
    for tied in (True, False):
        model = init_model(small_config(tie_word_embeddings=tied), seed=0)
        w_DV = model.unembed_weight()
        assert w_DV.shape == (37, 257)
        if tied:
            np.testing.assert_array_equal(w_DV, model.embed_VD[...].T)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            names = var.get_metadata()["out_sharding"]
            assert len(names) == var.get_value().ndim, path
            assert set(names) <= LOGICAL_AXES, path
            # Decoder layers' params are stacked: a leading [L] "layers" axis, nothing else has one.
            stacked = path[0] == "layers"
            assert (names[0] == "layers") == stacked, path
            assert not stacked or var.get_value().shape[0] == model.cfg.num_layers, path


def test_config_validation_names_the_field():
    for overrides, field in [
        (dict(num_kv_heads=3), "num_heads"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(arch="gpt2"), "arch"),
        (dict(dtype="float16"), "dtype"),
        (dict(param_dtype="int8"), "param_dtype"),
        (dict(head_dim=9), "head_dim"),
        (dict(attention_bias=False), "attention_bias"),
    ]:
        with pytest.raises(ValueError, match=field):
            small_config(**overrides)
    assert small_config(arch="llama", hidden_size=44).attention_bias is False


def test_config_hf_dict_roundtrip_and_rejections():
    cfg = small_config(rope_theta=5000.0, tie_word_embeddings=False)
    d = cfg.to_hf_dict(bos_token_id=1, eos_token_id=2)
    assert d["architectures"] == ["Qwen2ForCausalLM"] and d["eos_token_id"] == 2
    assert TransformerConfig.from_hf_dict(d) == cfg
    assert TransformerConfig.from_hf_dict(d, dtype="bfloat16").dtype == "bfloat16"
    llama = small_config(arch="llama", hidden_size=44)
    assert TransformerConfig.from_hf_dict(llama.to_hf_dict()) == llama
    # transformers 5 style rope_parameters
    d5 = dict(d, rope_parameters={"rope_type": "default", "rope_theta": 7.0})
    del d5["rope_theta"]
    assert TransformerConfig.from_hf_dict(d5).rope_theta == 7.0
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        TransformerConfig.from_hf_dict({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="'su' is not supported"):
        TransformerConfig.from_hf_dict(dict(d, rope_scaling={"rope_type": "su", "factor": 4.0}))
    with pytest.raises(ValueError, match="llama3.*missing"):
        TransformerConfig.from_hf_dict(dict(d, rope_parameters={"rope_type": "llama3"}))


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["dots_saveable", "full"])
def test_scanned_and_unrolled_layers_compute_the_same(remat):
    """One param layout, two programs: `scan_layers` changes how the layers run, not what they compute."""
    import dataclasses

    cfg = small_config(num_layers=3, remat=remat)
    assert cfg.scan_layers  # the default
    scanned = scrambled_model(cfg, seed=4)
    unrolled = nnx.merge(
        nnx.graphdef(init_model(dataclasses.replace(cfg, scan_layers=False))), nnx.state(scanned)
    )
    tokens_BP, valid_BP, positions_BP = helpers.left_pad(PROMPTS)

    def loss(model):
        logits_BTV, _ = model(tokens_BP, positions_BP, valid_BP)
        return jnp.mean(jnp.where(valid_BP[..., None], logits_BTV, 0.0) ** 2), logits_BTV

    (_, logits_s), g_s = nnx.value_and_grad(loss, has_aux=True)(scanned)
    (_, logits_u), g_u = nnx.value_and_grad(loss, has_aux=True)(unrolled)
    eps = np.finfo(np.float32).eps
    scale = np.abs(np.asarray(logits_u)).max()
    np.testing.assert_allclose(logits_s, logits_u, rtol=0, atol=100 * eps * scale)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_s), nnx.to_flat_state(g_u)):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        np.testing.assert_allclose(
            a, b, rtol=0, atol=100 * eps * max(np.abs(b).max(), eps), err_msg=str(path)
        )


def test_backward_writes_no_transposed_activations():
    """The weight gradients take the saved activations as they are (`transformer.dense`).

    From 3-D einsums XLA:CPU wrote a transposed copy [F, N] of each MLP activation gradient
    before its weight-gradient dot (a quarter of a SwiGLU MLP's forward + backward time); the
    optimized program of the whole model's gradient must hold no array shaped [X, N]
    transposed from [B, T, X] by a copy or transpose, for any layer width X.
    """
    import re

    cfg = small_config(hidden_size=48, intermediate_size=80, vocab_size=96)
    model = scrambled_model(cfg, seed=1)
    B, T = 6, 11
    N = B * T
    tokens = jnp.asarray(np.arange(N).reshape(B, T) % cfg.vocab_size, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    valid = jnp.ones((B, T), bool)
    graphdef, params = nnx.split(model)

    def loss(params):
        logits_BTV, _ = nnx.merge(graphdef, params)(tokens, positions, valid)
        return jnp.mean(logits_BTV**2)

    text = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    widths = {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim}
    widths |= {cfg.num_kv_heads * cfg.head_dim, cfg.vocab_size}
    transposed = {f"[{x},{N}]" for x in widths}
    offenders = [
        line.strip()[:160]
        for line in text.splitlines()
        if re.match(r"\s*%(copy|transpose)\S* = f32", line)
        and any(shape in line.split("=", 1)[1][:40] for shape in transposed)
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.slow
def test_library_attention_computes_what_einsum_attention_does():
    """`attention="xla"` (jax.nn.dot_product_attention, the call that "cudnn" makes on a GPU) gives
    the einsum path's logits and gradients on left-padded prompts, to float32 rounding."""
    import dataclasses

    cfg = small_config(num_layers=2)
    einsum = scrambled_model(cfg, seed=5)
    library = nnx.merge(
        nnx.graphdef(init_model(dataclasses.replace(cfg, attention="xla"))), nnx.state(einsum)
    )
    tokens_BP, valid_BP, positions_BP = helpers.left_pad(PROMPTS)

    def loss(model):
        logits_BTV, _ = model(tokens_BP, positions_BP, valid_BP)
        return jnp.mean(jnp.where(valid_BP[..., None], logits_BTV, 0.0) ** 2), logits_BTV

    (_, logits_l), g_l = nnx.value_and_grad(loss, has_aux=True)(library)
    (_, logits_e), g_e = nnx.value_and_grad(loss, has_aux=True)(einsum)
    eps = np.finfo(np.float32).eps
    valid = np.asarray(valid_BP)
    scale = np.abs(np.asarray(logits_e)[valid]).max()
    np.testing.assert_allclose(
        np.asarray(logits_l)[valid], np.asarray(logits_e)[valid], rtol=0, atol=100 * eps * scale
    )
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_l), nnx.to_flat_state(g_e)):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        np.testing.assert_allclose(
            a, b, rtol=0, atol=100 * eps * max(np.abs(b).max(), eps), err_msg=str(path)
        )


def test_cudnn_attention_is_refused_off_a_gpu_and_outside_bfloat16():
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.config.model import ModelConfig

    with pytest.raises(ValueError, match="attention: cudnn needs dtype bfloat16"):
        small_config(attention="cudnn")
    with pytest.raises(ValueError, match="attention: unknown 'flash'"):
        small_config(attention="flash")
    with pytest.raises(ConfigError, match="model.attention=cudnn needs model.dtype=bfloat16"):
        ModelConfig(attention="cudnn")
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is here: cudnn is allowed")
    model = init_model(small_config(attention="cudnn", dtype="bfloat16"))
    tokens_BP, valid_BP, positions_BP = helpers.left_pad(PROMPTS)
    with pytest.raises(ValueError, match="model.attention=cudnn needs an NVIDIA GPU; .* cpu"):
        model(tokens_BP, positions_BP, valid_BP)
