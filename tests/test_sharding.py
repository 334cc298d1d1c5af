"""Sharded results equal single-device results; the rules fall back to replication; the memory plan.

The mesh tests run in one subprocess with 8 fake CPU devices (XLA_FLAGS must be set before JAX starts,
and this pytest process has already started it with one device). The worker prints its measurements as
JSON; the assertions are made here. A train step runs on two meshes, (2, 2, 2) (every axis: rows over
data x fsdp, params over fsdp and tensor) and (1, 1, 8) (tensor alone, where the rules fall back to
replication); the prune step also on (8, 1, 1) and (2, 4, 1) (one question a device); the sampler, the
vocabulary-split draw, mu = 2 and a checkpoint restored onto another mesh on those meshes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cppo_jax import plan
from cppo_jax.config.files import load_config
from cppo_jax.config.run import MeshConfig
from cppo_jax.parallel import sharding as sharding_lib
from cppo_jax.planning import memory as layout
from tests.conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
MESHES = [(2, 2, 2), (1, 1, 8)]  # a train step on each, against one device
PRUNE_MESHES = [(8, 1, 1), (2, 4, 1), *MESHES]  # the prune step on each
TOL = 1e-5
# The fake-device worker compiles its programs with the suite's XLA flags (tests/conftest.py).
WORKER_FLAGS = xla_flags("--xla_force_host_platform_device_count=8")


# ---------------------------------------------------------------------------------------------
# Rules, mesh construction, errors (this process: one device)
# ---------------------------------------------------------------------------------------------


def test_rules_map_logical_names_and_fall_back_to_replication():
    from jax.sharding import PartitionSpec as P

    sizes = {"data": 2, "fsdp": 4, "tensor": 8}
    spec = sharding_lib.logical_spec
    assert spec(("embed", "q_heads", "head_dim"), (24, 8, 4), sizes) == P("fsdp", "tensor")
    assert spec(("embed", "kv_heads", "head_dim"), (24, 2, 4), sizes) == P("fsdp")  # 2 % 8
    assert spec(("vocab", "embed"), (61, 24), sizes) == P(None, "fsdp")  # a prime vocabulary
    assert spec(("embed", "mlp"), (23, 40), sizes) == P(None, "tensor")
    assert spec(("batch", None), (16, 5), sizes) == P(("data", "fsdp"))
    assert spec(("batch",), (6,), sizes) == P("data")  # the longest prefix that divides
    assert spec(("batch",), (7,), sizes) == P()
    assert spec(("batch",), (16,), {"data": 1, "fsdp": 8, "tensor": 1}) == P("fsdp")
    assert spec(("norm",), (24,), sizes) == P()
    with pytest.raises(ValueError, match="'heads' has no rule"):
        spec(("heads",), (8,), sizes)


def test_make_mesh_resolves_the_rest_and_names_the_keys_on_a_mismatch():
    import jax

    mesh = sharding_lib.make_mesh(MeshConfig())
    assert dict(mesh.shape) == {"data": len(jax.devices()), "fsdp": 1, "tensor": 1}
    with pytest.raises(ValueError, match=r"mesh\.data=2 x mesh\.fsdp=1 x mesh\.tensor=1 = 2"):
        sharding_lib.make_mesh(MeshConfig(data=2))
    with pytest.raises(ValueError, match=r"mesh\.fsdp=3.*do not divide the 1 devices"):
        sharding_lib.make_mesh(MeshConfig(data=-1, fsdp=3))


# ---------------------------------------------------------------------------------------------
# 8 fake devices
# ---------------------------------------------------------------------------------------------


def _worker() -> dict:
    """Runs in the subprocess: single-device reference, then every mesh of MESHES."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from cppo_jax.algo import cppo
    from cppo_jax.config.schema import CPPOConfig, OptimConfig
    from cppo_jax.models.transformer import TransformerConfig, init_model
    from cppo_jax.train import device_fns as step_lib
    from cppo_jax.train import optimizer as optimizer_lib
    from cppo_jax.train.checkpoint import Checkpointer
    from tests.helpers import SMOOTH_ADAMW

    assert len(jax.devices()) == 8
    # H = 8 divides every mesh axis; J = 2 does not divide tensor = 8, V = 61 divides nothing.
    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=61,
        hidden_size=24,
        intermediate_size=40,
        num_layers=1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=4,
    )
    graphdef, params = nnx.split(init_model(cfg, 0))
    host_params = jax.device_get(params)
    Q, G, K, P, C = 8, 4, 2, 5, 6
    M = Q * K
    rng = np.random.default_rng(0)
    prompt_QP = rng.integers(1, 61, (Q, P)).astype(np.int32)
    prompt_QP[:, -1] = np.arange(Q)  # the last prompt token names the question
    pvalid_QP = np.ones((Q, P), bool)
    pvalid_QP[:, :2] = rng.random((Q, 2)) < 0.5
    tokens_NC = rng.integers(0, 61, (Q * G, C)).astype(np.int32)
    cvalid_NC = np.cumsum(rng.random((Q * G, C)) < 0.2, axis=1) == 0
    cvalid_NC[:, 0] = True
    finished_N = ~cvalid_NC[:, -1]
    rewards_QG = rng.integers(0, 3, (Q, G)).astype(np.float32)
    key = jax.random.PRNGKey(0)
    spec = step_lib.StepSpec.make(CPPOConfig(beta=0.04, mu=1), P, C, 1.0, logp_chunk=C)
    # Params after one update or more of two programs (a mesh, one device) are compared: AdamW
    # smooth in the gradient (SMOOTH_ADAMW), whose derivative in the gradient is at most ~lr/eps,
    # so a rounding stays a rounding on any CPU (issue #50).
    ocfg = OptimConfig(**SMOOTH_ADAMW, warmup_ratio=0.0, schedule="constant", grad_clip=0.0)
    tx = optimizer_lib.make_optimizer(ocfg, 10)

    shapes = cppo.Shapes(Q=Q, G=G, k=K, M=M, P=P, C=C, U=Q)
    algo = CPPOConfig(num_generations=G, mask_truncated=True)

    def prune(mesh):
        """The trainer's prune step (advantages, top-k, gather) on `mesh`: the kept rows' (tokens,
        valid, mask, advantages); on a mesh also where they lie and the collectives it compiles to."""
        args = (
            jnp.asarray(rewards_QG),
            key,
            prompt_QP,
            pvalid_QP,
            tokens_NC,
            cvalid_NC,
            finished_N,
        )
        kw = dict(shapes=shapes, algo=algo, mesh=mesh)
        pruned = cppo.prune(*args, **kw)
        kept = (pruned.tokens_MT, pruned.valid_MT, pruned.mask_MC, pruned.adv_M)
        if mesh is None:
            return kept, {}
        hlo = cppo.prune.lower(*args, **kw).compile().as_text()
        shards = [
            (s.device.id, np.asarray(s.data)[:, P - 1].tolist())
            for s in pruned.tokens_MT.addressable_shards
        ]
        return kept, {
            "kept_per_device": {dev: len(q) for dev, q in shards},
            "questions_per_device": {dev: sorted(set(q)) for dev, q in shards},
            "gather_collectives": [
                op
                for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce")
                if op in hlo
            ],
        }

    def specs_on(mesh) -> dict:
        p_sh = sharding_lib.param_shardings(host_params, mesh)
        return {
            "q_DHE": str(p_sh["layers"]["attn"]["q_DHE"].get_value().spec),
            "k_DJE": str(p_sh["layers"]["attn"]["k_DJE"].get_value().spec),
            "embed_VD": str(p_sh["embed_VD"].get_value().spec),
        }

    def run(mesh, kept):
        """One train step on `mesh` (None: one device) on the `kept` rows of its prune step."""
        if mesh is None:
            params = jax.tree.map(jnp.asarray, host_params)
        else:
            params = sharding_lib.shard_params(host_params, mesh)
        opt = sharding_lib.init_opt_state(tx, params, mesh)
        train_step, logps = step_lib.compiled(graphdef, tx, spec, mesh=mesh, params=params, rows=M)
        tokens_MT, valid_MT, mask_MC, adv_M = kept
        lp = logps(params, tokens_MT, valid_MT)
        batch = step_lib.Batch(tokens_MT, valid_MT, mask_MC, adv_M, lp - 0.01, lp + 0.02)
        new_params, new_opt, metrics = train_step(params, opt, batch)
        # After one AdamW step (no clipping) mu = (1 - b1) * the gradient.
        grads = jax.tree.map(lambda mu: mu / (1 - ocfg.b1), new_opt[-1][0].mu)
        values = {
            "logps": lp,
            "loss": metrics["loss"],
            "grads": grads,
            "params": new_params,
            "metrics": metrics,
            "batch": (tokens_MT, valid_MT, mask_MC, adv_M),
        }
        return values, (new_params, new_opt, batch, train_step, logps)

    def max_err(a, b) -> float:
        diffs = jax.tree.map(
            lambda x, y: float(
                np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
            ),
            a,
            b,
        )
        return max(jax.tree.leaves(diffs))

    base, (*_, one_step, one_logps) = run(None, prune(None)[0])
    base = jax.device_get(base)
    out = {"meshes": {}}
    states = {}
    for shape in PRUNE_MESHES:
        mesh = sharding_lib.make_mesh(MeshConfig(*shape))
        kept, where = prune(mesh)
        out["meshes"][str(shape)] = {**where, "specs": specs_on(mesh)}
        if shape not in MESHES:
            continue
        values, state = run(mesh, kept)
        states[shape] = (mesh, state)
        out["meshes"][str(shape)].update(
            err={k: max_err(values[k], base[k]) for k in ("logps", "loss", "grads", "params")},
            err_batch=max_err(jax.device_get(values["batch"]), base["batch"]),
            grad_norm=float(values["metrics"]["grad_norm"]),
        )
    out["base_grad_norm"] = float(base["metrics"]["grad_norm"])
    out["sampler"] = _sampler_on_a_mesh(
        graphdef, host_params, states[(2, 2, 2)][0], prompt_QP, pvalid_QP, G, C, max_err
    )
    out["choose_split"] = _choose_split_on_a_mesh(states[(2, 2, 2)][0])
    try:  # data x fsdp = 8 data-parallel devices
        sharding_lib.check_questions(12, sharding_lib.make_mesh(MeshConfig(2, 4, 1)))
    except ValueError as e:
        out["q_error"] = str(e)

    # A checkpoint written on (2, 2, 2) after 2 steps restores onto (1, 1, 8), whose step 3 equals
    # the uninterrupted run's step 3 on (2, 2, 2).
    import tempfile

    _, (params_a, opt_a, batch_a, step_a, _) = states[(2, 2, 2)]  # after step 1
    _, (params_b, opt_b, batch_b, step_b, _) = states[(1, 1, 8)]
    params_a, opt_a, _ = step_a(params_a, opt_a, batch_a)  # step 2
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(Path(tmp) / "ckpt")
        ckpt.save(2, {"params": params_a, "opt_state": opt_a}, {"step": 2})
        target = {"params": params_b, "opt_state": opt_b}
        restored, meta = ckpt.restore(None, target)
        ckpt.close()
    # (1, 1, 8) splits some leaves over tensor and replicates others (the rules' fallbacks)
    same_layout = all(
        x.sharding == y.sharding
        for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True)
    )
    saved = {"params": params_a, "opt_state": opt_a}
    err_restored = max_err(jax.device_get(restored), jax.device_get(saved))
    got = step_b(restored["params"], restored["opt_state"], batch_b)  # step 3, (1, 1, 8)
    want = step_a(*jax.tree.map(jnp.copy, (params_a, opt_a)), batch_a)  # uninterrupted
    out["restore"] = {
        "layout": same_layout,
        "meta_step": meta["step"],
        "err_restored": err_restored,
        "err_next_step": max_err(got, want),
        "step_3_moved": max_err(got[0], params_a),
        "global_norm": float(optax.global_norm(got[0])),
    }

    # mu = 2 in one program (a scan, the first update's log-probs carried) on (2, 2, 2), with
    # micro-batches of the sharded batch, no old log-probs given (the old policy the current one),
    # against two updates of the one-device step, each given the log-probs of the params before the
    # first (the same as mu = 2 on one device: test_step.py).
    mesh = states[(2, 2, 2)][0]
    batch = states[(2, 2, 2)][1][2]._replace(old_logp_MC=None)
    sp = step_lib.StepSpec(**{**spec.__dict__, "mu": 2, "micro_batch": 8})
    params = sharding_lib.shard_params(host_params, mesh)
    opt = sharding_lib.init_opt_state(tx, params, mesh)
    step, _ = step_lib.compiled(graphdef, tx, sp, mesh=mesh, params=params, rows=M)
    got = jax.device_get(step(params, opt, batch)[::2])  # params and metrics
    params = jax.tree.map(jnp.asarray, host_params)
    opt = sharding_lib.init_opt_state(tx, params, None)
    batch = jax.tree.map(lambda x: jnp.asarray(jax.device_get(x)), batch)
    batch = batch._replace(old_logp_MC=one_logps(params, batch.tokens_MT, batch.valid_MT))
    for _ in range(2):
        params, opt, metrics = one_step(params, opt, batch)
    want = jax.device_get((params, metrics))
    out["mu2"] = {
        "err_params": max_err(got[0], want[0]),
        "err_metrics": max_err(got[1], want[1]),
        "ratio_moved": float(got[1]["ratio/abs_dev_mean"]),
    }
    return out


def _sampler_on_a_mesh(graphdef, host_params, mesh, prompt_QP, pvalid_QP, G, C, max_err) -> dict:
    """The embedded sampler with its declared shardings (`sampler.sampler_shardings`) on `mesh`
    against one device: the same samples, returned split by rows; params handed over replicated are
    moved to where the rules keep them, so the program always takes the weights in place. Row
    compaction (`rollout.compact`) on the mesh, with a third of the vocabulary ending a row so that
    rows do end early, against one device without it: the same samples, fewer row-steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cppo_jax.parallel import distributed
    from cppo_jax.rollout.backend import EmbeddedBackend
    from cppo_jax.rollout.embedded import sampler as sampler_lib
    from cppo_jax.rollout.embedded.sampler import make_sampler, place, sampler_shardings
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    Q, P = prompt_QP.shape
    sp = SamplingParams(max_new_tokens=C, temperature=1.0, eos_id=(0,), pad_id=0)
    seeds_Q = np.arange(Q, dtype=np.uint32)
    one = EmbeddedBackend(graphdef, sp).generate(
        jax.tree.map(jnp.asarray, host_params), prompt_QP, pvalid_QP, seeds_Q, G
    )
    rows = functools.partial(distributed.rows, mesh=mesh)
    backend = EmbeddedBackend(graphdef, sp, mesh)
    prompts = (rows(prompt_QP), rows(pvalid_QP), rows(seeds_Q))
    sharded = backend.generate(sharding_lib.shard_params(host_params, mesh), *prompts, G)
    replicated = jax.device_put(
        host_params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    moved = backend.generate(replicated, *prompts, G)
    greedy_one = EmbeddedBackend(graphdef, sp).greedy(
        jax.tree.map(jnp.asarray, host_params), prompt_QP, pvalid_QP
    )
    greedy = backend.greedy(replicated, *prompts[:2])
    V = jax.tree.leaves(host_params["embed_VD"])[0].shape[0]
    # 8 rows (one sample a question): compacted loops of 5, 3, 2 and 1 rows after the first
    ends = dataclasses.replace(sp, eos_id=tuple(range(0, V, 3)))
    plain = EmbeddedBackend(graphdef, ends).generate(
        jax.tree.map(jnp.asarray, host_params), prompt_QP, pvalid_QP, seeds_Q, 1
    )
    compact = EmbeddedBackend(graphdef, dataclasses.replace(ends, compact=True), mesh).generate(
        sharding_lib.shard_params(host_params, mesh), *prompts, 1
    )
    placed = sampler_shardings(mesh, replicated, Q, P, G, sp)
    compiled = make_sampler(graphdef, G, sp, placed).lower(*place((replicated, *prompts), placed))
    compiled = compiled.compile()
    rules = sharding_lib.param_shardings(replicated, mesh)
    sums = [  # every array an all-reduce returns (a combined one returns a tuple)
        [int(d) for d in dims.split(",") if d]
        for m in re.finditer(r"= (.*?) all-reduce(?:-start)?\(", compiled.as_text())
        for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1))
    ]
    return {
        "compact_equal": bool(
            np.array_equal(*jax.device_get((compact.tokens_NC, plain.tokens_NC)))
        ),
        "err_logp_compact": max_err(compact.logp_NC, plain.logp_NC),
        "row_steps": [int(compact.row_steps), int(plain.row_steps)],
        "logit_sums": [d for d in sums if V in d],
        "split": str(sampler_lib.vocab_split(mesh, sp)[2]),
        "tokens_equal": bool(np.array_equal(*jax.device_get((sharded.tokens_NC, one.tokens_NC)))),
        "moved_equal": bool(np.array_equal(*jax.device_get((moved.tokens_NC, one.tokens_NC)))),
        "greedy_equal": bool(
            np.array_equal(*jax.device_get((greedy.tokens_NC, greedy_one.tokens_NC)))
        ),
        "err_logp": max_err(sharded.logp_NC, one.logp_NC),
        "out_specs": [str(x.sharding.spec) for x in sharded[:4]],
        "params_in_place": all(
            got.is_equivalent_to(want.get_value(), x.ndim)
            for got, want, x in zip(
                jax.tree.leaves(compiled.input_shardings[0][0]),
                jax.tree.leaves(rules, is_leaf=lambda v: hasattr(v, "get_value")),
                jax.tree.leaves(replicated),
            )
        ),
    }


def _choose_split_on_a_mesh(mesh) -> dict:
    """`sampling.choose_split` (logits split by vocabulary over fsdp x tensor, rows over data)
    against `choose` on whole rows: random logits of a vocabulary of 1,001 (padded to 1,004), at
    temperatures 1, 0.7 and 0 (greedy, with the largest logit tied across two shards in every
    row): the tokens drawn and their log-probs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cppo_jax.rollout.embedded import sampler as sampler_lib
    from cppo_jax.rollout.embedded.sampling import SamplingParams, choose, choose_split

    rng = np.random.default_rng(0)
    N, V = 64, 1001
    sampled_NV = (3.0 * rng.standard_normal((N, V))).astype(np.float32)
    tied_NV = sampled_NV.copy()
    tied_NV[:, [5, 900]] = sampled_NV.max() + 1.0  # a tie across shards: the first one wins
    u_N = rng.random(N, dtype=np.float32)
    out = {}
    for temperature in (1.0, 0.7, 0.0):
        logits_NV = tied_NV if temperature == 0.0 else sampled_NV
        sp = SamplingParams(max_new_tokens=4, temperature=temperature)
        split = sampler_lib.vocab_split(mesh, sp)
        Vp = split.padded(V)
        padded_NV = np.pad(logits_NV, ((0, 0), (0, Vp - V)), constant_values=7.0)  # never drawn
        x = jax.device_put(
            padded_NV,
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(split.rows, split.axes)),
        )
        fn = jax.jit(lambda x, u, sp=sp, split=split: choose_split(x, u, sp, split._replace(V=V)))
        got = jax.device_get(fn(x, jnp.asarray(u_N)))
        want = jax.device_get(jax.jit(lambda x, u, sp=sp: choose(x, u, sp))(logits_NV, u_N))
        out[str(temperature)] = {
            "same_tokens": int((got[0] == want[0]).sum()),
            "logp_rel": float(np.max(np.abs(got[1] - want[1]) / np.abs(want[1]).clip(1e-3))),
            "greedy_first": bool((got[0] == 5).all()) if temperature == 0.0 else None,
            "max_token": int(got[0].max()),
            "distinct": len(set(got[0].tolist())),
        }
    out["N"] = N
    return out


@pytest.fixture(scope="module")
def mesh_results():
    env = {**os.environ, "XLA_FLAGS": WORKER_FLAGS, "JAX_PLATFORMS": "cpu"}
    code = (
        "import json, sys; sys.path.insert(0, 'tests'); import test_sharding as t; "
        "print('RESULT ' + json.dumps(t._worker()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESHES)
def test_sharded_step_equals_single_device(mesh_results, shape):
    r = mesh_results["meshes"][str(shape)]
    print(shape, r["err"], r["specs"])
    for name, err in r["err"].items():
        assert err < TOL, (name, err)
    assert r["err_batch"] < 1e-7
    assert abs(r["grad_norm"] - mesh_results["base_grad_norm"]) < TOL


@pytest.mark.slow
def test_mu2_in_one_program_sharded_equals_single_device(mesh_results):
    """mu = 2 in one program on (2, 2, 2), micro-batched, equals the two updates on one device."""
    r = mesh_results["mu2"]
    print(r)
    assert r["err_params"] < TOL and r["err_metrics"] < TOL, r
    assert r["ratio_moved"] > 0.0  # the second update ran on the first's old log-probs


@pytest.mark.slow
def test_sampler_declares_its_shardings_and_samples_like_one_device(mesh_results):
    """#31: the embedded sampler under the mesh takes the params where the rules keep them (even when
    handed a replicated copy) and returns the samples split by rows, sampling what one device does."""
    r = mesh_results["sampler"]
    print(r)
    assert r["tokens_equal"] and r["moved_equal"] and r["greedy_equal"], r
    assert r["err_logp"] < TOL, r
    # the logits split by vocabulary over fsdp x tensor (sampler.vocab_split), never summed whole;
    # row compaction on the mesh draws the same tokens, decoding fewer row-steps (rows ended early)
    assert r["split"] == "('fsdp', 'tensor')" and r["logit_sums"] == [], r
    assert r["compact_equal"] and r["err_logp_compact"] < TOL, r
    assert r["row_steps"][0] < r["row_steps"][1], r
    assert r["params_in_place"], r
    assert r["out_specs"] == ["P(('data', 'fsdp'),)"] * 4, r  # tokens, logps, valid, finished


@pytest.mark.slow
def test_vocabulary_split_draw_is_the_whole_rows_draw(mesh_results):
    """`choose_split` draws, from the same uniform numbers, the token `choose` draws on the whole
    row, sampled and greedy (ties to the first column), never a padding column; the log-probs equal
    to float32 rounding of a V-term sum (relative eps x V)."""
    import numpy as np

    r = mesh_results["choose_split"]
    print(r)
    tol = float(np.finfo(np.float32).eps) * 1001
    for t in ("1.0", "0.7", "0.0"):
        assert r[t]["same_tokens"] == r["N"], r
        assert r[t]["logp_rel"] < tol and r[t]["max_token"] < 1001, r
    assert r["1.0"]["distinct"] > r["N"] // 4, r  # draws spread over the vocabulary
    assert r["0.0"]["greedy_first"], r


@pytest.mark.slow
def test_rules_place_params_with_fallback(mesh_results):
    specs = {shape: mesh_results["meshes"][str(shape)]["specs"] for shape in PRUNE_MESHES}
    assert specs[(2, 2, 2)] == {  # decoder params are stacked [L, ...]: the layers axis is whole
        "q_DHE": "P(None, 'fsdp', 'tensor')",
        "k_DJE": "P(None, 'fsdp', 'tensor')",
        "embed_VD": "P(None, 'fsdp')",  # vocab 61 does not divide: replicated
    }
    assert specs[(1, 1, 8)] == {
        "q_DHE": "P(None, None, 'tensor')",
        "k_DJE": "P()",  # 2 kv heads on 8 tensor devices: replicated
        "embed_VD": "P()",
    }
    assert specs[(8, 1, 1)]["q_DHE"] == "P()"  # pure data parallelism


@pytest.mark.slow
@pytest.mark.parametrize("shape", PRUNE_MESHES)
def test_each_device_prunes_its_own_questions(mesh_results, shape):
    r = mesh_results["meshes"][str(shape)]
    data, fsdp, _ = shape
    dp = data * fsdp
    Q, K = 8, 2
    counts = set(r["kept_per_device"].values())
    assert counts == {Q * K // dp}, r["kept_per_device"]  # equal kept counts on every device
    for questions in r["questions_per_device"].values():
        assert len(questions) == Q // dp  # whole questions: all k kept of each are local
    assert r["gather_collectives"] == [], "pruning moved data between devices"


@pytest.mark.slow
def test_questions_must_split_over_the_data_axes(mesh_results):
    msg = mesh_results["q_error"]
    assert "cppo.questions_per_step" in msg and "mesh.data=2" in msg and "mesh.fsdp=4" in msg


@pytest.mark.slow
def test_checkpoint_from_one_mesh_restores_onto_another(mesh_results):
    """2 steps on (2, 2, 2), saved, restored onto (1, 1, 8): step 3 equals the uninterrupted one."""
    r = mesh_results["restore"]
    print(r)
    assert r["layout"], "restored arrays are not in the target mesh's layout"
    assert r["meta_step"] == 2
    assert r["err_restored"] == 0.0, r  # a checkpoint round trip is exact
    assert r["err_next_step"] < TOL, r
    assert r["step_3_moved"] > 100 * TOL, (
        r
    )  # step 3 changed the params (the comparison is not idle)


# ---------------------------------------------------------------------------------------------
# The memory plan
# ---------------------------------------------------------------------------------------------


def test_plan_for_the_paper_configs_on_8_x_80gb(tmp_path, capsys):
    from test_launch import QWEN25_1P5B, QWEN25_7B

    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.models.transformer import TransformerConfig

    verdicts = {}
    for name, hf, config in [
        ("math7b", QWEN25_7B, "configs/math7b.py"),
        ("gsm8k_1p5b", QWEN25_1P5B, "configs/gsm8k_1p5b.py"),
    ]:
        for shape in [(8, 1, 1), (1, 8, 1), (2, 2, 2)]:
            overrides = ["model.path=/m"] + [
                f"mesh.{a}={s}" for a, s in zip(("data", "fsdp", "tensor"), shape)
            ]
            cfg = load_config(ROOT / config, overrides)
            sh = shapes_of(cfg)
            m = cfg.model
            tcfg = TransformerConfig.from_hf_dict(
                hf, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat
            )
            mp = layout.memory_plan(
                tcfg,
                cfg.mesh.sizes(8),
                rows=sh.M,
                prompt_len=sh.P,
                completion_len=sh.C,
                beta=cfg.cppo.beta,
                rollout_rows=sh.Q * sh.G,
                device_bytes=80 * 10**9,
            )
            print(f"--- {name} (G={sh.G}, Q={sh.Q}, M={sh.M}) on 8 x 80 GB, mesh {shape}")
            print("\n".join(layout.memory_lines(mp, m.param_dtype)))
            verdicts[name, shape] = mp.fits
    # Qwen2.5-7B at G = 16, fp32 params, AdamW and a reference: pure data parallelism holds a
    # whole copy of everything on each GPU (too much); sharding params over fsdp fits.
    assert verdicts["math7b", (8, 1, 1)] is False
    assert verdicts["math7b", (1, 8, 1)] is True and verdicts["math7b", (2, 2, 2)] is True
    assert verdicts["gsm8k_1p5b", (8, 1, 1)] is True


def test_plan_report_prints_the_per_device_plan(tmp_path):
    from test_launch import QWEN25_7B, _fake_model, _jsonl

    model = _fake_model(tmp_path, "m", QWEN25_7B)
    train = _jsonl(tmp_path / "t.jsonl", [{"problem": "1 + 1?", "solution": "$\\boxed{2}$"}] * 24)
    overrides = [f"model.path={model}", f"data.train={train}", "mesh.data=1", "mesh.fsdp=-1"]
    cfg = load_config(ROOT / "configs" / "math7b.py", overrides)
    text = plan.plan_report(cfg, num_devices=8, device_memory_gb=80)
    print(text)
    assert "mesh: data=1 fsdp=8 tensor=1" in text
    assert "memory per device (mesh data=1 fsdp=8 tensor=1" in text
    assert "fits: yes" in text
    bad = load_config(ROOT / "configs" / "math7b.py", [*overrides[:2], "mesh.data=16"])
    with pytest.raises(ValueError, match=r"mesh\.data=16.*but there are 8"):
        plan.plan_report(bad, num_devices=8, device_memory_gb=80)


@pytest.mark.slow
def test_memory_estimate_matches_xla_for_a_tiny_model():
    """The plan's per-device estimate vs XLA's buffer assignment of the real train step (CPU)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cppo_jax.config.schema import CPPOConfig, OptimConfig
    from cppo_jax.models.transformer import Transformer, TransformerConfig
    from cppo_jax.train import device_fns as step_lib
    from cppo_jax.train import optimizer as optimizer_lib

    N, P, C = 16, 16, 48
    tcfg = TransformerConfig(
        arch="qwen2",
        vocab_size=509,
        hidden_size=64,
        intermediate_size=131,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(tcfg, rngs=nnx.Rngs(0))))
    spec = step_lib.StepSpec.make(CPPOConfig(beta=0.04, mu=1), P, C, 1.0, logp_chunk=16)
    tx = optimizer_lib.make_optimizer(OptimConfig(), 10)
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    batch = step_lib.Batch(
        S((N, P + C), jnp.int32),
        S((N, P + C), jnp.bool_),
        S((N, C), f32),
        S((N,), f32),
        S((N, C), f32),
        S((N, C), f32),
    )
    train_step, _ = step_lib.compiled(graphdef, tx, spec)
    compiled = train_step.lower(params, jax.eval_shape(tx.init, params), batch).compile()
    mem = compiled.memory_analysis()
    measured = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    mp = layout.memory_plan(
        tcfg, {}, rows=N, prompt_len=P, completion_len=C, beta=0.04, logp_chunk=16
    )
    estimate = mp.train_peak - mp.reference  # the reference params are not a train-step argument
    print(f"train step: XLA {measured / 2**20:.2f} MiB, plan {estimate / 2**20:.2f} MiB")
    assert 0.8 < estimate / measured < 1.25
    assert mp.activations_remat < mp.activations_no_remat
