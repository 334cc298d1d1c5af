"""Steps 4-7 after the rewards as one program (`train.after_rewards`, run by `train.update`).

The fused step trains as the phases apart (`Trainer.phase_split`: pruning, the reference's and the
snapshot's log-probs, the mu updates, each its own program): one trainer runs each step's steps 4-7
both ways from the same params, optimizer state and rollout, for mu = 1 and 2, beta 0 and > 0, with
and without tis_cap, with LoRA, packed rows and overlap; a step after rewards runs one program (two
with packing) and waits for the device once (two), whatever mu, and the program compiles once a
run; a 2-device mesh trains to the one-device params.

The same runs record each program as the trainer calls it (the fused one, and the phases apart as
in `trainer.profile_steps`: "train_step", "ref_logps"; and the sampler): `programs.build` gives those
programs, so what `plan --compile-for` compiles is that code. Each recorded call, lowered with the
arguments it got, gives the same program text as `programs.build`'s function lowered with its
abstract arguments (shapes, dtypes and shardings built from the config alone).
"""

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

from cppo_jax.rollout import backend as backend_lib
from cppo_jax.train import programs
from cppo_jax.train import update as update_lib
from cppo_jax.train.trainer import Trainer
from tests.conftest import xla_flags
from tests.helpers import SMOOTH_ADAMW_OVERRIDES, spread_reward
from tests.step_counts import count_after_rewards
from tests.test_overlap import overlap_trainer
from tests.test_trainer import small_config

pytestmark = pytest.mark.slow  # each test compiles a trainer's programs, or starts a process

ROOT = Path(__file__).resolve().parents[1]
EPS = float(np.finfo(np.float32).eps)
STEPS = 2
PACK = ("trainer.pack=true", "trainer.pack_rows=4", "trainer.pack_len=168")
TIS = ("cppo.mu=2", "cppo.tis_cap=2")  # also the mesh test's run


def _host(tree):
    return jax.tree.map(np.asarray, tree)


class Recorder:
    """Wraps a jitted function: calls pass through, the first call's arguments are kept."""

    def __init__(self, fn):
        self.fn, self.args = fn, None

    def __call__(self, *args):
        if self.args is None:
            self.args = jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    if isinstance(x, jax.Array)
                    else x
                ),
                args,
            )
        return self.fn(*args)

    def lower(self, *args):
        return self.fn.lower(*args)


def _record(trainer: Trainer, mp: pytest.MonkeyPatch) -> dict:
    """The trainer's programs wrapped in `Recorder`s, by `programs.build`'s names (the sampler's
    once the backend makes it)."""
    actor, ref = trainer.actor, trainer.reference
    fused = actor.fused._replace(update=Recorder(actor.fused.update))
    trainer.actor = dataclasses.replace(actor, train_step=Recorder(actor.train_step), fused=fused)
    recorded = {"step": trainer.actor.fused.update, "train_step": trainer.actor.train_step}
    # The reference's log-probs: of the packed rows the packer's program; with LoRA the base's
    # forward, its own program; else the actor's program on the reference's copy.
    if actor.packer is not None:
        assert ref.packed_logps is actor.packer.logps
        recorded["ref_logps"] = Recorder(ref.packed_logps)
        trainer.reference = dataclasses.replace(ref, packed_logps=recorded["ref_logps"])
    elif ref is not None:
        assert (ref.logps is actor.logps) == (actor.frozen is None)
        recorded["ref_logps"] = Recorder(ref.logps)
        trainer.reference = dataclasses.replace(ref, logps=recorded["ref_logps"])
    made = backend_lib.make_sampler

    def recording_make_sampler(*args, **kw):  # the rollout's sampler, as the backend calls it
        return recorded.setdefault("sampler", Recorder(made(*args, **kw)))

    mp.setattr(backend_lib, "make_sampler", recording_make_sampler)
    return recorded


def _trainer(folder: Path, model_dir: Path, overrides, overlap: bool) -> Trainer:
    """small_config's trainer with a reward spread over any text (the weights move every step) and
    AdamW made smooth in the gradient (`SMOOTH_ADAMW_OVERRIDES`): two programs' params after an
    update then differ by their roundings, not by up to an lr step per near-zero gradient (issue
    #50)."""
    overrides = (*SMOOTH_ADAMW_OVERRIDES, *overrides)
    if overlap:
        return overlap_trainer(folder, model_dir, *overrides)[0]
    return Trainer(small_config(folder, model_dir, *spread_reward(folder), *overrides))


def _both_ways(folder: Path, model_dir: Path, overrides, overlap: bool) -> dict:
    """STEPS steps of one trainer, each step's steps 4-7 run twice from the same params, optimizer
    state and rollout (and overlap snapshot): first the phases apart, then fused, the run going on
    from the fused result (so its params are a fused run's). Host copies: per step the state at
    the start, after the phases apart and after the fused program, the phases' metrics and timed
    phases, and the step's row (the fused program's metrics); the programs as called (`_record`)."""
    trainer = _trainer(folder, model_dir, overrides, overlap)
    inner, steps = update_lib.after_rewards, []

    def both(trainer, rollout, rewards_QG, sample_params, step, times):
        state = (trainer.params, trainer.opt_state)
        start, copy = _host(state), jax.tree.map(jnp.copy, state)  # the programs donate them
        trainer.phase_split, split_times = True, {}
        split_m = inner(trainer, rollout, rewards_QG, sample_params, step, split_times)
        split = _host((trainer.params, trainer.opt_state))
        (trainer.params, trainer.opt_state), trainer.phase_split = copy, False
        fused_m = inner(trainer, rollout, rewards_QG, sample_params, step, times)
        fused = _host((trainer.params, trainer.opt_state))
        phases = set(split_times)
        steps.append(dict(start=start, split=split, fused=fused, split_m=split_m, phases=phases))
        return fused_m

    try:
        with pytest.MonkeyPatch.context() as mp:
            recorded = _record(trainer, mp)
            mp.setattr(update_lib, "after_rewards", both)
            rows = [trainer.step(s) for s in range(STEPS)]
    finally:
        trainer.close()
    for step, row in zip(steps, rows):
        step["row"] = row
    return {"steps": steps, "cfg": trainer.cfg, "recorded": recorded}


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory, arith_model_dir):
    """`_both_ways` of (overrides, overlap), run once per module."""
    done = {}

    def run(overrides, overlap: bool) -> dict:
        if (overrides, overlap) not in done:
            folder = tmp_path_factory.mktemp("both_ways")
            done[overrides, overlap] = _both_ways(folder, arith_model_dir, overrides, overlap)
        return done[overrides, overlap]

    return run


def _max_abs_diff(x, y) -> float:
    return max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


@pytest.mark.parametrize(
    "overrides,overlap",
    [
        ((), False),  # mu = 1, beta > 0
        (("cppo.mu=2", "cppo.beta=0"), False),  # old log-probs from the first update's forward
        (TIS, False),  # behaviour log-probs: the sampler's
        (("model.lora.enabled=true", "model.lora.rank=3"), False),  # the reference: the base
        (PACK, False),  # pruning apart, the packed batch's forwards and updates fused
        (("cppo.mu=2",), True),  # overlap: the snapshot is the old policy
        (("cppo.tis_cap=2", "cppo.beta=0"), True),  # overlap + TIS: the snapshot is the behaviour
    ],
)
def test_the_fused_step_trains_as_the_phases_apart(both_ways, overrides, overlap):
    """Each step, from the same state and rollout: the same params, optimizer state and metrics."""
    for s in both_ways(overrides, overlap)["steps"]:
        start, (split, split_opt), (fused, fused_opt) = s["start"][0], s["split"], s["fused"]
        scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(split))
        assert _max_abs_diff(start, split) > 1e3 * EPS * scale  # the step did train
        # The same float32 math in one program or in four: XLA may fuse it differently, and each
        # CPU's code generation rounds in its own way; with AdamW smooth in the gradient (`_trainer`)
        # a rounding stays a rounding through the step's updates (issue #35 measured 0.0 at the
        # defaults). A wrong batch, old policy or reference moves the params by ~lr x a gradient
        # difference, far above this.
        assert _max_abs_diff(fused, split) <= 16 * EPS * scale
        # AdamW's moments (the clipped gradient, linearly) and its count, which the next step
        # starts from: within 64 roundings of each array's largest magnitude; counts equal.
        for a, b in zip(jax.tree.leaves(fused_opt), jax.tree.leaves(split_opt), strict=True):
            if np.issubdtype(b.dtype, np.integer):
                np.testing.assert_array_equal(a, b)
            else:
                assert np.max(np.abs(a - b)) <= 64 * EPS * float(np.max(np.abs(b))), b.shape
        got, want = s["row"], s["split_m"]
        assert got["cppo/tokens_trained"] == want["cppo/tokens_trained"] > 0
        assert got["learning_rate"] == want["learning_rate"] > 0
        assert got["update_skipped"] == want["update_skipped"] == 0.0
        for key in ("loss", "grad_norm", "entropy"):
            assert abs(got[key] - want[key]) <= 64 * EPS * max(1.0, abs(want[key])), key
        assert "timing_s/update" in got and "timing_s/ref_logps" not in got
        assert {"update", "ref_logps"} <= s["phases"]


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # mu = 1, beta > 0
        ("cppo.mu=2", "model.dtype=bfloat16"),  # the old log-probs from the first update's forward
        PACK,  # packed rows
        (
            "model.lora.enabled=true",
            "model.lora.rank=3",
        ),  # adapters + frozen base, unmerged sampler
    ],
)
def test_built_programs_are_the_trainers(both_ways, overrides):
    run = both_ways(overrides, False)
    built = programs.build(run["cfg"], jax.devices()).programs
    recorded = run["recorded"]
    assert set(built) == set(recorded)
    for name, (fn, args) in built.items():
        rec = recorded[name]
        assert jax.tree.structure(args) == jax.tree.structure(rec.args), name
        want = rec.lower(*rec.args).as_text()
        assert fn.lower(*args).as_text() == want, name


@pytest.mark.parametrize("overrides,programs", [(("cppo.mu=3",), 1), (PACK, 2)])
def test_one_program_and_one_wait_after_rewards_whatever_mu(
    tmp_path, arith_model_dir, overrides, programs
):
    """Counted from an XLA trace (`tests/step_counts.py`); main before issue #35 ran 15 programs
    and waited 6 times (docs/metrics.md). Padded, that program is the fused one, called once a
    step with (params, opt_state, step, rolled, reference, snapshot)."""
    trainer = _trainer(tmp_path, arith_model_dir, overrides, overlap=False)
    calls, fused = [], trainer.actor.fused
    update = fused.update

    def spy(*args):
        calls.append(len(args))
        return update(*args)

    trainer.actor = dataclasses.replace(trainer.actor, fused=fused._replace(update=spy))
    try:
        trainer.step(0)  # compiles
        counts = [count_after_rewards(trainer, s, tmp_path / f"trace{s}") for s in (1, 2)]
    finally:
        trainer.close()
    for c in counts:
        # padded: the fused program; packed: pruning, then the packed batch's program. The
        # packing's fetch of the kept tokens is the second wait.
        assert c["programs"] == programs, c
        assert c["waits"] == programs, c
        assert c["metrics"]["update_skipped"] == 0.0 and c["metrics"]["cppo/tokens_trained"] > 0
        assert np.isfinite(c["metrics"]["loss"])
    assert calls == [6 if programs == 1 else 5] * 3  # packed: (params, opt_state, batch, ref, snap)
    assert update._cache_size() == 1  # one compile for the three steps


def _as_dict(cfg, folder: Path) -> dict:
    """`cfg` on a data = 2 mesh, its run written under `folder`."""
    from cppo_jax.config.files import apply_overrides, to_dict

    return to_dict(apply_overrides(cfg, ["mesh.data=2", f"trainer.out_dir={folder}"]))


def test_a_two_device_mesh_trains_as_one_device(tmp_path, both_ways, arith_model_dir):
    """The fused program on a data = 2 mesh (fake CPU devices, in a subprocess) trains to the
    one-device params (the TIS case's fused run above): the rollout's rows and the batch split over
    the devices."""
    one = both_ways(TIS, False)
    out = tmp_path / "two.npz"
    code = (
        "import json, jax, numpy as np\n"
        "from cppo_jax.config.files import from_dict\n"
        "from cppo_jax.train.trainer import Trainer\n"
        f"cfg = from_dict(json.loads({json.dumps(json.dumps(_as_dict(one['cfg'], tmp_path)))}))\n"
        "t = Trainer(cfg)\n"
        f"rows = [t.step(s) for s in range({STEPS})]\n"
        "leaves = [np.asarray(x) for x in jax.tree.leaves(t.params)]\n"
        "t.close()\n"
        f"np.savez({str(out)!r}, *leaves)\n"
        "print(json.dumps({'loss': [r['loss'] for r in rows], 'devices': len(jax.devices()),"
        " 'mesh': t.cfg.mesh.data}))\n"
    )
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"))
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["devices"] == 2 and got["mesh"] == 2 and one["cfg"].cppo.mu == 2
    two = list(np.load(out).values())
    want = jax.tree.leaves(one["steps"][-1]["fused"][0])
    scale = max(float(np.max(np.abs(x))) for x in want)
    # Sums split over two devices round differently (measured: 17 eps x the largest param at AdamW's
    # default eps; here smooth in the gradient, as in `_trainer`, so that holds on any CPU: issue #50).
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(two, want)) <= 128 * EPS * scale
    for a, b in zip(got["loss"], [s["row"]["loss"] for s in one["steps"]]):
        assert abs(a - b) <= 128 * EPS * max(1.0, abs(b))
