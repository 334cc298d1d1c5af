"""SIGTERM and SIGINT: the current step finishes, a checkpoint is saved, the run exits with 128 + signal.

The promise (cppo_jax/train/stopping.py, docs/reliability.md): after the first SIGTERM/SIGINT the run finishes
the step in flight, saves a checkpoint of it, logs a `stopped` event and exits with 143 (SIGTERM) or 130
(SIGINT); a resumed run carries on from that step. A second signal ends the process at once (the default
action), which loses nothing that was checkpointed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from cppo_jax.config.files import apply_overrides
from cppo_jax.train.checkpoint import Checkpointer
from cppo_jax.train.stopping import SignalStopError
from tests.reliability.runs import launch, metrics_steps, rewind, write_config_file


@pytest.mark.slow
def test_sigterm_mid_run_checkpoints_exits_143_and_resume_finishes(shared_trainer, tmp_path):
    """`python -m cppo_jax.launch` stopped by SIGTERM: the step in flight finishes, is checkpointed,
    the process exits 143; a run resumed from that checkpoint (the shared trainer's config, in this
    process: its programs are built) appends the next step and finishes with its checkpoint."""
    trainer, init = shared_trainer
    # Steps enough that, under load, the signal sent once step 2 is logged still lands mid-run (with 8,
    # a starved test process once saw the run finish first).
    steps = 24
    built = getattr(trainer, "_built_cfg", trainer.cfg)
    overrides = [f"trainer.out_dir={tmp_path}", "trainer.run_name=run"]
    cfg = apply_overrides(
        built, [*overrides, f"trainer.steps={steps}", "trainer.checkpoint_every=0"]
    )
    config_file = write_config_file(tmp_path / "cfg.py", cfg)
    run_dir = tmp_path / "run"
    proc = launch(config_file)
    deadline = time.time() + 600
    while time.time() < deadline and len(metrics_steps(run_dir)) < 2:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=300)
    print(f"\nSIGTERM to exit: {time.monotonic() - t0:.1f} s")
    text = out.decode()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "stopped by SIGTERM" in text
    done = metrics_steps(run_dir)
    s = done[-1]
    assert done == list(range(1, s + 1)) and 2 <= s < steps  # the step in flight was finished
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {"event": "stopped", "step": s, "signal": "SIGTERM"} in events
    assert Checkpointer(run_dir / "checkpoints").all_steps() == [s]  # checkpoint_every=0: only this
    # Nothing written beside the run folder (the config file is the test's).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.py", "run"]

    # Resumed, with one step to go (the schedule is constant): step s + 1 appended, none repeated.
    rewind(trainer, run_dir, *init, "trainer.resume=true", f"trainer.steps={s + 1}")
    trainer.train()
    assert trainer.start_step == s
    assert metrics_steps(run_dir) == list(range(1, s + 2))
    assert Checkpointer(run_dir / "checkpoints").latest_step() == s + 1


@pytest.mark.slow
def test_sigint_in_process_saves_the_finished_step(shared_trainer, tmp_path):
    """SIGINT (Ctrl-C) during step 2: step 2 completes, its state is checkpointed, `SignalStopError` says so."""
    trainer, init = shared_trainer
    rewind(trainer, tmp_path / "run", *init, "trainer.steps=3")

    def progress(metrics):
        if metrics["step"] == 2:
            signal.raise_signal(signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when started as a background job
    with pytest.raises(SignalStopError, match="stopped by SIGINT after step 2") as info:
        trainer.train(progress=progress)
    assert info.value.exit_code == 130 and info.value.step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # every output in the run folder
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored to what they were
    state, meta = Checkpointer(trainer.host.out_dir / "checkpoints").restore(None, trainer.state())
    assert meta["step"] == 2
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(trainer.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_second_signal_ends_the_process_at_once():
    code = (
        "import os, signal, time\n"
        "from cppo_jax.train.stopping import StopSignals\n"
        "with StopSignals() as stop:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    assert stop.requested == signal.SIGTERM, stop.requested\n"
        "    print('first signal recorded', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "print('not reached')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout == "first signal recorded\n", out.stderr
    assert out.returncode == -signal.SIGTERM
