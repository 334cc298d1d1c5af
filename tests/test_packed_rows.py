"""Packed training rows on the device (`cppo_jax.packing.rows`, `step` with a `PackedBatch`): the
packed forward's completion log-probs, the loss and the gradient equal the padded step's, and one
compiled step serves every packing of a run."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.config.choices import LOSS_TYPES
from cppo_jax.config.schema import CPPOConfig, OptimConfig
from cppo_jax.packing import pack as packing
from cppo_jax.packing.rows import packed_batch
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train import optimizer as optimizer_lib
from tests.conftest import xla_flags

try:
    from helpers import count_compiles, random_model, tiny_config
except ImportError:  # tests/ became a package
    from tests.helpers import count_compiles, random_model, tiny_config

EPS32 = float(np.finfo(np.float32).eps)
M, P, C = 7, 5, 11
L = P + C + 3  # a row holds the longest sequence and a short one


def _padded(seed: int, M: int = M):
    """A padded step.Batch of M sequences with random true lengths (one empty completion)."""
    rng = np.random.default_rng(seed)
    V = 257
    p_M = rng.integers(1, P + 1, M)
    c_M = rng.integers(1, C + 1, M)
    c_M[seed % M] = 0
    slot = np.arange(P + C)
    valid = ((slot >= P - p_M[:, None]) & (slot < P)) | ((slot >= P) & (slot < P + c_M[:, None]))
    tokens = np.where(valid, rng.integers(1, V, (M, P + C)), 0).astype(np.int32)
    mask = valid[:, P:].astype(np.float32)
    adv = rng.standard_normal(M).astype(np.float32)
    ref = -rng.uniform(1.0, 4.0, (M, C)).astype(np.float32)
    return step_lib.Batch(
        jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(mask), jnp.asarray(adv), None, ref
    )


def _packed(batch: step_lib.Batch, rows: int | None = None, length: int = L):
    n_M = np.asarray(batch.valid_MT).sum(axis=1)
    rows = rows or packing.rows_for(n_M, length)
    packed = packing.pack(batch.tokens_MT, batch.valid_MT, P, rows, length, mask_MC=batch.mask_MC)
    return packed_batch(packed, batch.mask_MC, batch.adv_M, None, batch.ref_logp_MC)


def _parts(loss_type="token_mean", attention="einsum", beta=0.04, mu=1):
    cfg = tiny_config(attention=attention, max_position_embeddings=64)
    graphdef, params = nnx.split(random_model(cfg, seed=5))
    adv_scale = "none" if loss_type == "dr_grpo" else "group"
    algo = CPPOConfig(beta=beta, mu=mu, loss_type=loss_type, adv_scale=adv_scale)
    spec = step_lib.StepSpec.make(algo, P, C, 1.0)
    return graphdef, params, spec


def _close(actual, expected, ulps: int = 16):
    """Equal within `ulps` float32 roundings of the largest magnitude of `expected`."""
    expected = np.asarray(expected)
    scale = max(float(np.abs(expected).max()), EPS32)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=ulps * EPS32 * scale)


@pytest.mark.parametrize(
    "attention", ["einsum", "xla", pytest.param("splash", marks=pytest.mark.slow)]
)
def test_packed_forward_logps_equal_the_padded_forwards(attention):
    graphdef, params, spec = _parts(attention=attention)
    batch = _padded(seed=1)
    packed = _packed(batch)
    assert packed.tokens_RL.shape[0] < M  # sequences really share rows
    model = nnx.merge(graphdef, params)
    padded_MC = jax.jit(functools.partial(step_lib.completion_logps, spec=spec))(
        model, batch.tokens_MT, batch.valid_MT
    )
    packed_MC = jax.jit(functools.partial(step_lib.packed_completion_logps, spec=spec))(
        model, packed
    )
    mask = np.asarray(batch.mask_MC, bool)
    _close(np.where(mask, packed_MC, 0.0), np.where(mask, padded_MC, 0.0))
    # ... and a forward that let segments see each other would not be equal
    leaky = packed._replace(segment_RL=(packed.segment_RL > 0).astype(np.int32))
    leaky_MC = step_lib.packed_completion_logps(model, leaky, spec)
    assert np.abs(np.where(mask, leaky_MC - padded_MC, 0.0)).max() > 1e3 * EPS32


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss_type, attention",
    [(t, "einsum") for t in LOSS_TYPES] + [("token_mean", "xla"), ("token_mean", "splash")],
)
def test_packed_loss_and_gradient_equal_the_padded_steps(loss_type, attention):
    graphdef, params, spec = _parts(loss_type=loss_type, attention=attention)
    batch = _padded(seed=2)
    grads = jax.jit(functools.partial(step_lib._grads, graphdef=graphdef, spec=spec))
    loss, metrics, g, logp_MC = grads(params, batch=batch)
    loss_p, metrics_p, g_p, logp_p = grads(params, batch=_packed(batch))
    _close(loss_p, loss)
    for key in metrics:
        _close(metrics_p[key], metrics[key])
    mask = np.asarray(batch.mask_MC, bool)
    _close(np.where(mask, logp_p, 0.0), np.where(mask, logp_MC, 0.0))
    for (path, a), b in zip(jax.tree.leaves_with_path(g_p), jax.tree.leaves(g), strict=True):
        assert np.abs(np.asarray(b)).max() > 0, path
        _close(a, b, ulps=64)


@pytest.mark.slow
def test_one_compiled_step_serves_every_packing():
    graphdef, params, spec = _parts(mu=2)
    tx = optimizer_lib.make_optimizer(
        OptimConfig(lr=1e-3, schedule="constant", warmup_ratio=0.0), 10
    )
    train_step, _ = step_lib.compiled(graphdef, tx, spec)
    opt_state = tx.init(params)
    padded = [_padded(seed) for seed in (3, 4, 5, 6)]
    # static per run: room for every draw below (fewer rows than sequences)
    rows = max(packing.rows_for(np.asarray(b.valid_MT).sum(axis=1), L) for b in padded)
    assert rows < M
    batches = [_packed(b, rows=rows) for b in padded]
    assert len({b.src_MC.tobytes() for b in batches}) == len(batches)  # different packings
    params, opt_state, _ = train_step(params, opt_state, batches[0])
    with count_compiles() as compiles:
        for b in batches[1:]:
            params, opt_state, metrics = train_step(params, opt_state, b)
            assert np.isfinite(float(metrics["loss"]))
            assert float(metrics["update_skipped"]) == 0.0
    assert compiles["n"] == 0


def test_packed_step_refuses_micro_batches():
    graphdef, params, _ = _parts()
    spec = step_lib.StepSpec.make(CPPOConfig(beta=0.04), P, C, 1.0, micro_batch=1)
    with pytest.raises(ValueError, match="trainer.micro_batch=0"):
        step_lib._grads(params, graphdef, _packed(_padded(seed=1)), spec)


@pytest.fixture(scope="module")
def padded(tmp_path_factory, arith_model_dir):
    """(trainer, its first step's metrics): tests/test_trainer.py's small config, unpacked. The
    first step is taken here, before any test uses the trainer (the overflow test sets its state)."""
    from cppo_jax.train.trainer import Trainer

    try:
        from test_trainer import small_config
    except ImportError:  # tests/ became a package
        from tests.test_trainer import small_config

    folder = tmp_path_factory.mktemp("padded")
    trainer = Trainer(small_config(folder, arith_model_dir, "trainer.steps=3"))
    try:
        yield trainer, trainer.step(0)
    finally:
        trainer.close()


def _steps(out_dir, model_dir, *overrides: str):
    """(trainer, each step's metrics, events) of 3 steps of tests/test_trainer.py's small config."""
    import json

    from cppo_jax.train.trainer import Trainer

    try:
        from test_trainer import small_config
    except ImportError:  # tests/ became a package
        from tests.test_trainer import small_config

    trainer = Trainer(small_config(out_dir, model_dir, "trainer.steps=3", *overrides))
    try:
        rows = [trainer.step(s) for s in range(3)]
    finally:
        trainer.close()
    events = (trainer.host.out_dir / "events.jsonl").read_text().splitlines()
    return trainer, rows, [json.loads(e) for e in events]


@pytest.mark.slow
def test_trainer_pack_trains_the_padded_runs_first_step_in_half_the_rows(
    tmp_path, arith_model_dir, padded
):
    """`trainer.pack=true` in the real trainer: step 1 (same rollout, same params) gives the padded
    run's loss, KL and gradient norm; later steps compile nothing new."""
    # arith's sequences take most of their P + C = 84 slots: two to a row of 168, any two fit
    pack = ["trainer.pack=true", "trainer.pack_rows=4", "trainer.pack_len=168"]
    trainer, rows, _ = _steps(tmp_path, arith_model_dir, *pack)
    assert trainer.actor.packer.rows == 4 < trainer.shapes.M
    first_padded, first_packed = padded[1], rows[0]
    for key in ("loss", "kl", "grad_norm", "entropy"):
        _close(first_packed[key], first_padded[key], ulps=64)
    compiles = [r["jit/compilations"] for r in rows]
    assert compiles[1] == compiles[-1], compiles


def test_trainer_pack_is_refused_with_micro_batches():
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.config.run import TrainerConfig

    with pytest.raises(ConfigError, match="trainer.micro_batch"):
        TrainerConfig(pack=True, micro_batch=2)


_MESH_WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
import jax, jax.numpy as jnp, numpy as np
import test_packed_rows as t
from helpers import SMOOTH_ADAMW
from cppo_jax.train import optimizer as optimizer_lib
from cppo_jax.parallel import sharding as sharding_lib
from cppo_jax.train import device_fns as step_lib
from cppo_jax.config.schema import ConfigError, MeshConfig, OptimConfig
from cppo_jax.packing.rows import Packer

graphdef, params, spec = t._parts()
# the params after one update are compared: AdamW smooth in the gradient (issue #50)
tx = optimizer_lib.make_optimizer(OptimConfig(schedule="constant", warmup_ratio=0.0, **SMOOTH_ADAMW), 10)
batch = t._padded(seed=1, M=8)
one_step, one_logps = step_lib.compiled(graphdef, tx, spec)
ref_MC = one_logps(params, batch.tokens_MT, batch.valid_MT)
# a reference policy near the current one (a KL of order 0.1, not the random ref's exp(40))
near_MC = ref_MC + np.random.default_rng(0).uniform(-0.5, 0.5, ref_MC.shape).astype(np.float32)
batch = batch._replace(ref_logp_MC=near_MC)
new, _, metrics = one_step(jax.tree.map(jnp.copy, params), tx.init(params), batch)

mesh = sharding_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=1))
sharded = sharding_lib.shard_params(params, mesh)
opt = sharding_lib.init_opt_state(tx, sharded, mesh)
step, _ = step_lib.compiled(graphdef, tx, spec, mesh=mesh, params=sharded, rows=8)
packer = Packer(graphdef, spec, rows=4, length=2 * (t.P + t.C), mesh=mesh, seqs=8)
packed = packer.batch(batch.tokens_MT, batch.valid_MT, batch.mask_MC, batch.adv_M)
packed_ref_MC = packer.logps(sharded, packed)
packed = packed._replace(ref_logp_MC=batch.ref_logp_MC)
new_mesh, _, metrics_mesh = step(sharded, opt, jax.device_put(packed, sharding_lib.batch_sharding(mesh, 8)))
try:
    Packer(graphdef, spec, rows=3, length=32, mesh=mesh, seqs=8)
    refused = ""
except ConfigError as e:
    refused = str(e)
mask = np.asarray(batch.mask_MC, bool)
out = {{
    "logps": [np.where(mask, packed_ref_MC, 0).tolist(), np.where(mask, ref_MC, 0).tolist()],
    "loss": [float(metrics_mesh["loss"]), float(metrics["loss"])],
    "grad_norm": [float(metrics_mesh["grad_norm"]), float(metrics["grad_norm"])],
    "params": [[np.asarray(a).ravel()[:64].tolist(), np.asarray(b).ravel()[:64].tolist()]
               for a, b in zip(jax.tree.leaves(new_mesh), jax.tree.leaves(new))],
    "refused": refused,
}}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_packed_step_on_a_data_fsdp_mesh_matches_the_padded_step_on_one_device():
    """4 fake CPU devices, mesh data 2 x fsdp 2: the packed rows (4) split as the 8 kept sequences
    are; log-probs, loss, gradient norm and updated params equal one device's padded step. The
    update is AdamW smooth in the gradient (`SMOOTH_ADAMW`): at eps 1e-8 a first step is about
    lr x sign(g), and a near-zero gradient element rounded to the other sign in the other order
    would move its param by 2 lr on one CPU's code generation and not another's (issue #50)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4"),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    code = _MESH_WORKER.format(tests=str(root / "tests"))
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    _close(*out["logps"])
    _close(*out["loss"], ulps=64)  # sums over rows split over devices: another order
    _close(*out["grad_norm"], ulps=64)
    for a, b in out["params"]:
        _close(a, b, ulps=64)
    assert "trainer.pack_rows' = 3" in out["refused"]


OVERFLOW = ["trainer.pack=true", "trainer.pack_rows=3", "trainer.pack_len=230"]


@pytest.mark.slow
def test_a_step_that_does_not_fit_trains_padded_and_updates_as_an_unpacked_step(
    tmp_path, arith_model_dir, padded, monkeypatch
):
    """3 rows of 230 slots hold the 8 kept arith sequences (~77 tokens each) three to a row in
    most steps but not all (with this model and seed, the second of the 3 steps needs 4 rows: 230
    slots are 5 short of fitting it, and 10 more than the others need). The run does not stop: the
    step that does not fit trains on the padded batch (logged as `pack_overflow`, counted in
    `pack/overflow*`), the next packed step compiles nothing new, and the overflow step's update
    equals the update an unpacked trainer's program (`padded`) makes from the same params,
    optimizer state and rollout: every step's params and optimizer state are copied before it (the
    update donates them), and the first step that did not fit is run again from that copy.

    The update is compared at one step, where a rounding stays a rounding: the step's loss, KL,
    gradient norm and tokens trained, and AdamW's two moments after it (mu = b1 mu + (1 - b1) g,
    nu = b2 nu + (1 - b2) g^2 from the same mu and nu: the clipped gradient, linearly), within 64
    float32 roundings of each array's largest magnitude (the two programs add the same terms in
    their own orders). The params after it are AdamW's function of these moments, g / (sqrt(nu) +
    eps) per element, which amplifies a rounding of a near-zero gradient up to a whole step of the
    learning rate (1 / eps): over several steps, or at one, two programs' params agree only to
    about lr per element, on any CPU, so they are not what is compared."""
    import optax

    from cppo_jax.train import update as trainer_update

    inner, seen = trainer_update.after_rewards, []

    def spy(trainer, rollout, rewards_QG, sample_params, step, times):
        # a reward that varies within every group (the random model earns no arith reward:
        # advantages and the policy gradient would be zero), so the update has a real gradient
        tokens_NC = np.asarray(rollout.samples.tokens_NC)
        valid_NC = np.asarray(rollout.samples.valid_NC)
        odd_N = ((tokens_NC % 2) * valid_NC).sum(1) / np.maximum(valid_NC.sum(1), 1)
        rewards_QG = odd_N.reshape(np.shape(rewards_QG)).astype(np.float32)
        before = jax.tree.map(jnp.copy, (trainer.params, trainer.opt_state))
        m = inner(trainer, rollout, rewards_QG, sample_params, step, times)
        if m.get("pack/overflow") and not seen:
            after = jax.tree.map(jnp.copy, trainer.opt_state)  # the next step donates it
            seen.append((step, rollout, rewards_QG, sample_params, before, m, after))
        return m

    def moments(opt_state) -> list[np.ndarray]:
        trees = [optax.tree_utils.tree_get(opt_state, k) for k in ("mu", "nu")]
        return [np.asarray(x) for x in jax.tree.leaves(trees)]

    monkeypatch.setattr(trainer_update, "after_rewards", spy)
    _, steps, events = _steps(tmp_path, arith_model_dir, *OVERFLOW)
    step, rollout, rewards_QG, sample_params, (params, opt_state), over, opt_over = seen[0]
    unpacked = padded[0]
    unpacked.params, unpacked.opt_state = params, opt_state
    m_unpacked = inner(unpacked, rollout, rewards_QG, sample_params, step, {})

    overflow = [r["pack/overflow"] for r in steps]
    assert 0.0 in overflow and 1.0 in overflow, f"want a mix: pick another pack_len {overflow}"
    assert [r["pack/overflow_steps"] for r in steps] == list(np.cumsum(overflow))
    assert all((r["pack/rows_needed"] > 3) == r["pack/overflow"] for r in steps)
    overflows = [e for e in events if e.get("event") == "pack_overflow"]
    assert [e["step"] for e in overflows] == [i for i, o in enumerate(overflow) if o]
    assert all(e["rows"] == 3 and e["rows_needed"] > 3 for e in overflows)
    chosen = [e for e in events if e.get("event") == "pack_rows"]
    assert chosen and chosen[0]["rows"] == 3 and chosen[0]["length"] == 230
    first_padded = overflow.index(1.0)
    assert step == first_padded
    if first_padded + 1 < len(steps):  # the padded programs compiled once, then none
        compiles = [r["jit/compilations"] for r in steps]
        assert compiles[-1] == compiles[first_padded], compiles
    # The overflow step's update against the unpacked program's from the same state and rollout.
    for key in ("loss", "kl", "grad_norm", "cppo/tokens_trained"):
        _close(over[key], m_unpacked[key], ulps=64)
    got, want = moments(opt_over), moments(unpacked.opt_state)
    assert len(got) == len(want) > 0
    assert np.mean([np.abs(b).max() > 0 for b in want]) > 0.5  # most were trained
    for a, b in zip(got, want):
        _close(a, b, ulps=64)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    logged = [k for k in steps[0] if k.startswith("pack/")] + ["pack_rows", "pack_overflow"]
    assert len(logged) == 5 and all(f"`{k}`" in doc for k in logged), logged
