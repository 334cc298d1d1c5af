"""`model.attention=splash` (TPUs' Pallas splash kernel; Pallas' interpreter here) computes what the
einsum attention does on padded rows, forward and backward, on one device and sharded over a mesh;
it compiles for a TPU with no TPU attached; a GPU is refused."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.models import init_model
from tests.conftest import xla_flags

try:
    import helpers
except ImportError:  # pragma: no cover
    from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
# Rows as a step holds them: the prompt left-padded, the completion right-padded (T = 21).
SPANS = [(4, 21), (0, 21), (9, 14), (2, 11)]
T = 21


def padded_rows():
    valid_BT = np.zeros((len(SPANS), T), bool)
    for b, (lo, hi) in enumerate(SPANS):
        valid_BT[b, lo:hi] = True
    tokens_BT = np.where(
        valid_BT, (np.arange(T)[None] * 7 + np.arange(len(SPANS))[:, None]) % 250, 0
    )
    positions_BT = np.maximum(np.cumsum(valid_BT, axis=1) - 1, 0)
    return tokens_BT.astype(np.int32), valid_BT, positions_BT.astype(np.int32)


def _pair(dtype: str):
    cfg = helpers.tiny_config(head_dim=16, dtype=dtype)
    einsum = helpers.random_model(cfg, seed=3)
    splash = nnx.merge(
        nnx.graphdef(init_model(dataclasses.replace(cfg, attention="splash"))), nnx.state(einsum)
    )
    return einsum, splash


def _logits_and_grads(model, tokens_BT, valid_BT, positions_BT):
    def loss(model):
        logits_BTV, _ = model(tokens_BT, positions_BT, valid_BT)
        logits_BTV = logits_BTV.astype(jnp.float32)
        return jnp.mean(jnp.where(valid_BT[..., None], logits_BTV, 0.0) ** 2), logits_BTV

    (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return np.asarray(logits), {
        str(p): np.asarray(v.get_value(), np.float32) for p, v in nnx.to_flat_state(grads)
    }


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splash_attention_computes_what_einsum_attention_does_on_padded_rows(dtype):
    """Logits at every valid position to the compute dtype's rounding, and in float32 every
    parameter's gradient. Tolerances in units of the dtype's eps, relative to the largest magnitude:
    the logits differ by the order of float operations and splash's q scaled in the compute dtype (a
    few roundings per layer; measured 5.6 eps in float32, 2.7 in bfloat16); the kernel's backward
    rebuilds the softmax from its log-sum-exp, whose rounding grows with the scores' size (this
    random model's are tens: measured 124 eps). In bfloat16 the gradients of this random model are
    off the float32 ones by 20-80% with either attention, so they are compared in float32 only."""
    einsum, splash = _pair(dtype)
    rows = padded_rows()
    logits_e, g_e = _logits_and_grads(einsum, *rows)
    logits_s, g_s = _logits_and_grads(splash, *rows)
    valid = rows[1]
    assert np.isfinite(logits_s).all()  # padding rows too: no query row is ever empty
    eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
    scale = np.abs(logits_e[valid]).max()
    np.testing.assert_allclose(logits_s[valid], logits_e[valid], rtol=0, atol=16 * eps * scale)
    assert g_s.keys() == g_e.keys()
    if dtype != "float32":
        return
    for path in g_e:
        a, b = g_s[path], g_e[path]
        atol = 256 * eps * max(np.abs(b).max(), eps)
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=path)


def test_splash_attention_is_refused_on_a_gpu(monkeypatch):
    from cppo_jax.models import splash

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jnp.zeros((1, 4, 2, 16))
    with pytest.raises(ValueError, match="model.attention=splash is the TPU kernel.*cudnn"):
        splash.splash_attend(x, x, x, jnp.ones((1, 4), bool))


_SHARDED = """
import json, sys
import jax, numpy as np
sys.path.insert(0, {tests!r})
from test_splash import _pair, padded_rows
from cppo_jax.parallel import sharding
from cppo_jax.config.schema import MeshConfig
out = {{}}
einsum, splash = _pair("float32")
tokens, valid, positions = padded_rows()
ref = np.asarray(einsum(tokens, positions, valid)[0])
for d, f, t in [(2, 2, 1), (1, 2, 2), (1, 1, 4)]:
    mesh = sharding.make_mesh(MeshConfig(data=d, fsdp=f, tensor=t), jax.devices()[:4])
    fn = jax.jit(lambda m, a, b, c: m(a, b, c)[0])
    with sharding.use_mesh(mesh):
        got = np.asarray(fn(splash, tokens, positions, valid))
    out[f"{{d}}/{{f}}/{{t}}"] = float(np.abs(got - ref)[valid].max() / np.abs(ref[valid]).max())
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_splash_attention_under_a_mesh_matches_one_device():
    """Rows split over data/fsdp, heads over tensor (4 heads, 2 kv heads: whole groups at tensor 2;
    at tensor 4 the kv heads do not split and every device runs all heads)."""
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4"),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    code = _SHARDED.format(tests=str(ROOT / "tests"))
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    errors = json.loads(line[len("RESULT ") :])
    eps = float(np.finfo(np.float32).eps)
    assert set(errors) == {"2/2/1", "1/2/2", "1/1/4"}
    for mesh, err in errors.items():
        assert err <= 64 * eps, (mesh, err)


# The kernel's presence is read from the lowered programs; only the splash ones are compiled. The tiny
# config with 4 answers per question and no dynamic allocation: 16 sampler rows, not 512 (libtpu's
# compile time grows with the rows).
_TPU = """
import json, os, sys
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
from cppo_jax.planning import aot
from cppo_jax.train import programs
from cppo_jax.config.files import load_config
devices = aot.target_devices("v5e:2x2")
out = {}
for kind in ("einsum", "splash"):
    overrides = ["model.attention=" + kind, "mesh.data=2", "mesh.tensor=2"]
    overrides += ["cppo.num_generations=4", "cppo.allocation=false"]
    cfg = load_config(sys.argv[1], overrides)
    for name, (fn, args) in programs.build(cfg, devices).programs.items():
        if name not in ("train_step", "ref_logps"):
            continue
        lowered = fn.lower(*args)
        out[kind + " " + name] = {"kernel": "tpu_custom_call" in lowered.as_text()}
        if kind == "splash":
            m = lowered.compile().memory_analysis()
            out[kind + " " + name]["temporaries"] = m.temp_size_in_bytes
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_splash_attention_compiles_for_a_tpu_without_one():
    """The train step and the log-prob forward with the splash kernel (Mosaic, not the interpreter)
    compiled by libtpu for a v5e slice on this CPU, rows over `data` and heads over `tensor`; with
    einsum attention the same programs hold no kernel."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run(
        [sys.executable, "-c", _TPU, str(ROOT / "configs" / "tiny_cpu.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    for program in ("train_step", "ref_logps"):
        assert out[f"splash {program}"]["kernel"], program  # the Mosaic kernel is in the program
        assert not out[f"einsum {program}"]["kernel"], program
        assert out[f"splash {program}"]["temporaries"] > 0
