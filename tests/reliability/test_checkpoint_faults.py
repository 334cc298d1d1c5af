"""Checkpoints under faults: SIGKILL during a write, a write that fails (full disk), an unwritable folder.

Promises (docs/reliability.md): a process killed at any moment, during a checkpoint write too, leaves only
complete checkpoints behind, and the latest one loads; a failed write is reported naming the folder, the
previous checkpoint stays intact and the run stops instead of training on; an output folder that cannot be
created is named in a clear error before anything runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from cppo_jax.config.choices import ConfigError
from cppo_jax.train.checkpoint import Checkpointer, CheckpointError
from cppo_jax.train.trainer import Trainer
from tests.reliability.ckpt_writer import expected_state
from tests.reliability.runs import digit_steps, metrics_steps, rewind
from tests.test_trainer import small_config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _start_writer(directory: Path) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, str(HERE / "ckpt_writer.py"), str(directory)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _writing(directory: Path) -> bool:
    return any(not p.name.isdigit() and "tmp" in p.name for p in directory.glob("*"))


def _check_all_load(directory: Path) -> list[int]:
    """Every listed checkpoint restores and holds exactly what was saved for its step."""
    ckpt = Checkpointer(directory, keep=3)
    steps = ckpt.all_steps()
    like = expected_state(0)
    for step in steps:
        state, meta = ckpt.restore(step, like)
        assert meta == {"step": step}
        want = expected_state(step)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), b)
    ckpt.close()
    return steps


@pytest.mark.slow
def test_sigkill_at_random_moments_of_checkpoint_writes_leaves_only_loadable_ones(tmp_path):
    """Four kills of a process that checkpoints in a loop: two while a step folder is being written
    (its temporary folder exists), two after a random delay. After each kill every listed checkpoint
    loads with the right contents, and the restarted writer carries on after the latest one."""
    rng = random.Random(0)
    directory = tmp_path / "checkpoints"
    latest = 0
    mid_write_kills = 0
    for round_ in range(4):
        proc = _start_writer(directory)
        deadline = time.time() + 300
        # Wait until this writer has completed a checkpoint of its own.
        while time.time() < deadline and (digit_steps(directory) or [0])[-1] <= latest:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.01)
        if round_ < 2:
            while time.time() < deadline and not _writing(directory):
                assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
                time.sleep(0.001)
        else:
            time.sleep(rng.uniform(0.0, 1.0))
        mid_write_kills += _writing(directory)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        steps = _check_all_load(directory)
        assert steps and steps[-1] > latest, (steps, latest)
        assert steps == list(range(steps[0], steps[-1] + 1))
        latest = steps[-1]
    assert mid_write_kills >= 2


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """Writes past `nbytes` fail with EFBIG ("File too large") in this process: a full disk, as far as
    the checkpoint writer can tell (root ignores permissions, and there is no small tmpfs here)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.slow
def test_failed_checkpoint_write_stops_the_run_and_keeps_the_previous_one(shared_trainer, tmp_path):
    trainer, init = shared_trainer
    rewind(trainer, tmp_path / "run", *init, "trainer.steps=4", "trainer.checkpoint_every=1")
    inner = trainer.host.ckpt.save

    def save(step, state, meta):
        if step == 2:
            with _file_size_limit(1000):
                return inner(step, state, meta)
        return inner(step, state, meta)

    trainer.host.ckpt.save = save
    ckpt_dir = trainer.host.out_dir / "checkpoints"
    with pytest.raises(CheckpointError) as info:
        trainer.train()
    msg = str(info.value)
    assert f"writing checkpoint 2 under {ckpt_dir} failed" in msg and "File too large" in msg
    assert "earlier checkpoints are untouched: [1]" in msg
    assert metrics_steps(trainer.host.out_dir) == [1, 2]  # stopped: step 3 never ran
    events = [
        json.loads(x) for x in (trainer.host.out_dir / "events.jsonl").read_text().splitlines()
    ]
    assert [e["step"] for e in events if e["event"] == "checkpoint_failed"] == [2]
    ckpt = Checkpointer(ckpt_dir)
    assert ckpt.all_steps() == [1]
    state, meta = ckpt.restore(None, trainer.state())
    assert meta["step"] == 1 and all(np.isfinite(x).all() for x in jax.tree.leaves(state))
    # Space back: the next write of step 2 goes through despite the leftover temporary folder.
    ckpt.save(2, state, {"step": 2})
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()


def test_run_folder_that_cannot_be_created_is_named(tmp_path, arith_model_dir, capsys):
    from cppo_jax import launch
    from tests.reliability.runs import write_config_file

    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a regular file where the output folder's parent should be")
    cfg = small_config(blocker / "runs", arith_model_dir)
    with pytest.raises(ConfigError, match=r"'trainer.out_dir' .*cannot create the run folder"):
        Trainer(cfg)
    assert launch.main(["--config", str(write_config_file(tmp_path / "c.py", cfg))]) == 2
    err = capsys.readouterr().err
    assert f"cannot create the run folder {blocker / 'runs' / 'run'}" in err
    assert "Not a directory" in err
    # A checkpoint folder blocked the same way is named by the checkpointer.
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "checkpoints").write_text("")
    with pytest.raises(
        CheckpointError, match=r"cannot create checkpoint folder .*run2/checkpoints"
    ):
        Checkpointer(tmp_path / "run2" / "checkpoints")
