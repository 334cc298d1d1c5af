"""The vocabulary matrices under fsdp: cast to the compute dtype on the shard, then gathered.

A float32 [V, D] matrix gathered whole and then cast held a whole float32 copy per device (and its
whole float32 gradient before the reduce-scatter); `sharding.gather_cast` casts first, and the
embedding lookup reads the table as it is sharded. Checked on 8 fake CPU devices in a subprocess
(XLA_FLAGS must be set before JAX starts): its log-probs and gradient equal one device's within
bfloat16 rounding; and compiled by the TPU compiler for v5e:2x4 (deviceless, libtpu loaded only in
its subprocess): no float32 vocabulary-sized all-gather or all-reduce in the train step.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
V, D = 61, 32
EPS_BF16 = float(2.0**-7)  # bfloat16's machine epsilon (8 significant bits)


def _worker(target: str) -> dict:
    """`target` "cpu": numerics on 8 fake CPU devices; a TPU topology: the compiled HLO's
    collectives of vocabulary-sized arrays, from the TPU compiler (XLA:CPU gathers float32 and
    casts after, whatever the program says, so its HLO says nothing about a TPU's)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cppo_jax.config.run import MeshConfig
    from cppo_jax.config.schema import CPPOConfig
    from cppo_jax.models import TransformerConfig, init_model
    from cppo_jax.parallel import sharding as sharding_lib
    from cppo_jax.planning import aot
    from cppo_jax.train import device_fns as step_lib

    M, P, C = 8, 6, 5
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, V, (M, P + C)), jnp.int32)
    valid = np.ones((M, P + C), bool)
    valid[::2, :2] = False
    batch = step_lib.Batch(
        tokens,
        jnp.asarray(valid),
        jnp.asarray(valid[:, P:], jnp.float32),
        jnp.asarray(rng.standard_normal(M), jnp.float32),
        None,
        jnp.asarray(-rng.uniform(1.0, 4.0, (M, C)), jnp.float32),
    )
    spec = step_lib.StepSpec.make(CPPOConfig(beta=0.04, mu=2), P, C, 1.0, logp_chunk=2)
    out = {}
    for tied in (True, False):
        cfg = TransformerConfig(
            arch="qwen2",
            vocab_size=V,
            hidden_size=D,
            intermediate_size=48,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            tie_word_embeddings=tied,
            dtype="bfloat16",
            param_dtype="float32",
        )
        graphdef, params = nnx.split(init_model(cfg, seed=3))

        def grads(params, batch, mesh=None, graphdef=graphdef):
            with sharding_lib.use_mesh(mesh):
                _, _, g, logp = step_lib._grads(params, graphdef, batch, spec)
            return g, logp

        if target != "cpu":
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            os.environ["TPU_LIBRARY_PATH"] = aot.libtpu_path()
            devices = aot.target_devices(target)
        else:
            devices = jax.devices()
        mesh = sharding_lib.make_mesh(MeshConfig(data=1, fsdp=8), devices=devices)
        p_sh = sharding_lib.param_shardings(params, mesh)
        b_sh = sharding_lib.batch_sharding(mesh, M)
        fn = jax.jit(functools.partial(grads, mesh=mesh), in_shardings=(p_sh, b_sh))
        if target != "cpu":
            abstract = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                (params, batch),
                (p_sh, jax.tree.map(lambda _, s=b_sh: s, batch)),
            )
            hlo = fn.lower(*abstract).compile().as_text()
            vocab = re.compile(rf"(f32|bf16)(\[{V},{D}\]|\[{D},{V}\])")
            found = set()  # (dtype, op) of each collective whose result is vocabulary-sized
            for line in hlo.splitlines():
                op = re.search(r"= .*? (all-gather|all-reduce|reduce-scatter)(-start)?\(", line)
                if op:
                    result = line[: op.start(1)]
                    found |= {(m.group(1), op.group(1)) for m in vocab.finditer(result)}
            out[str(tied)] = sorted(found)
            continue
        one = jax.jit(grads)(params, batch)
        sharded_params = sharding_lib.shard_params(params, mesh)
        g1, lp1 = jax.device_get(one)
        g8, lp8 = jax.device_get(fn(sharded_params, batch))
        rel = {
            jax.tree_util.keystr(path): float(
                np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(a))
            )
            for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g8))
        }
        out[str(tied)] = {
            "grad_rel": rel,
            "logp_err": float(np.max(np.abs(np.asarray(lp1) - np.asarray(lp8)))),
        }
    return out


def _run(target: str, env: dict) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, 'tests'); import test_vocab_gather as t; "
        f"print('RESULT ' + json.dumps(t._worker({target!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def on_cpu():
    flags = xla_flags("--xla_force_host_platform_device_count=8")
    return _run("cpu", {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"})


@pytest.fixture(scope="module")
def on_tpu():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_LIBRARY_PATH")}
    return _run("v5e:2x4", {**env, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_vocab_matrices_are_gathered_in_the_compute_dtype(on_tpu, tied):
    found = {tuple(x) for x in on_tpu[str(tied)]}
    assert not any(dtype == "f32" for dtype, _ in found), found
    assert any(dtype == "bf16" for dtype, _ in found), found  # moved in the compute dtype


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_sharded_logps_and_grads_equal_one_device_within_bf16(on_cpu, tied):
    r = on_cpu[str(tied)]
    # The same bfloat16 forward with sums in another order: log-probs within a few roundings.
    assert r["logp_err"] < 4 * EPS_BF16, r["logp_err"]
    # Gradients: bfloat16 products summed in another order (the vocabulary's over devices in
    # bfloat16), a few roundings of the largest terms; the layers' differ as much.
    for name, rel in r["grad_rel"].items():
        assert rel < 4 * EPS_BF16, (name, rel)
