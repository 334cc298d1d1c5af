"""What a training run does when its rollout server misbehaves, end to end through `Trainer.train`.

A small misbehaving HTTP server on 127.0.0.1 (`tests.test_vllm_client.FakeVLLM`) stands in for vLLM for the
faults a real server cannot be made to produce on demand; the real server killed mid-run is
`tests/test_vllm.py::TestTiedServer::test_server_killed_mid_run`. The fake answers every request well
until the first training step is done, then turns bad. Promised outcome for each fault: retries with
backoff where a retry can help, then `RolloutServerError` naming the server and the fault, a checkpoint of
the last finished step (it loads), a `rollout_server_error` event, and no metrics row for a step trained on
a wrong batch. A transient 5xx is retried and the run finishes.
"""

from __future__ import annotations

import re
import shutil
import socket
import time

import jax
import pytest

from cppo_jax.rollout.vllm.backend import VLLMBackend
from cppo_jax.rollout.vllm.client import (
    ResponseError,
    RolloutServerError,
    VLLMClient,
    WeightSyncError,
)
from cppo_jax.train.checkpoint import Checkpointer
from cppo_jax.train.trainer import Trainer
from tests.reliability.runs import metrics_steps, read_events, rewind
from tests.test_trainer import small_config
from tests.test_vllm_client import FakeVLLM

pytestmark = pytest.mark.slow  # every case trains through `Trainer.train`


class FaultyVLLM(FakeVLLM):
    """FakeVLLM whose completions turn bad once `fault` is set: "500" (always), "500x2" (the next two
    requests), "few", "malformed" (as in FakeVLLM), or "hang" (answers after `hang_s`)."""

    def __init__(self):
        super().__init__("ok")
        self.fault: str | None = None
        self.faulted = 0
        self.hang_s = 3.0

    def answer(self, method, path, payload, count):
        if self.fault is None or path != "/v1/completions":
            return super().answer(method, path, payload, count)
        self.faulted += 1
        if self.fault == "hang":
            time.sleep(self.hang_s)
            return super().answer(method, path, payload, count)
        if self.fault == "500x2":
            if self.faulted <= 2:
                return 500, {"error": "internal"}
            return super().answer(method, path, payload, count)
        self.mode = self.fault
        try:
            return super().answer(method, path, payload, count)
        finally:
            self.mode = "ok"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, arith_model_dir):
    """One fake server and one Trainer for every case (each case rewinds it to a fresh run folder)."""
    fake = FaultyVLLM()
    tmp = tmp_path_factory.mktemp("rollout_faults")
    cfg = small_config(
        tmp,
        arith_model_dir,
        "trainer.steps=3",
        "cppo.beta=0.0",
        f"rollout.vllm_url={fake.url}",
        "rollout.backend=vllm",
        "rollout.timeout_s=1.0",
    )
    mp = pytest.MonkeyPatch()
    real_verify = VLLMBackend.verify
    # The fake cannot compute this model's log-probs: the probe check passes unless a case restores it.
    mp.setattr(VLLMBackend, "verify", lambda self, params, step=None: 0.0)
    trainer = Trainer(cfg)
    trainer.rollout.backend.client.backoff_s = 0.05
    init = jax.tree.map(lambda x: x.copy(), (trainer.params, trainer.opt_state))
    yield fake, trainer, init, tmp, real_verify, mp
    trainer.close()
    mp.undo()
    fake.close()


def _run_with_fault_after_step_1(setup, name, fault, monkey=None):
    fake, trainer, init, tmp, real_verify, mp = setup
    run_dir = tmp / name
    rewind(trainer, run_dir, *init)
    fake.fault, fake.faulted = None, 0

    def progress(metrics):
        if metrics["step"] == 1:
            if fault == "stale":
                mp.setattr(VLLMBackend, "verify", real_verify)
            else:
                fake.fault = fault

    try:
        with pytest.raises(RolloutServerError) as info:
            trainer.train(progress=progress)
        _drain(trainer)
    finally:
        fake.fault = None
        mp.setattr(VLLMBackend, "verify", lambda self, params, step=None: 0.0)
    return run_dir, info.value


def _drain(trainer) -> None:
    """Wait for the other questions' requests still in flight when the first one failed (the error does
    not wait for them), so that they do not spill into the next case's counts."""
    client = trainer.rollout.backend.client
    if client._pool is not None:
        client._pool.shutdown(wait=True)
        client._pool = None


def _assert_stopped_with_checkpoint(trainer, run_dir, err, step: int):
    assert trainer.rollout.backend.url in str(err)
    assert f"checkpoint of step {step} saved under {run_dir / 'checkpoints'}" in str(err)
    assert metrics_steps(run_dir) == [1]  # nothing logged (or trained on) from a bad batch
    assert [e["step"] for e in read_events(run_dir) if e["event"] == "rollout_server_error"] == [
        step
    ]
    _, meta = Checkpointer(run_dir / "checkpoints").restore(None, trainer.state())
    assert meta["step"] == step


@pytest.mark.parametrize(
    ("fault", "error", "match"),
    [
        ("500", RolloutServerError, r"failed 4 times in a row \(last: HTTP 500"),
        ("few", ResponseError, r"asked for 4 completions .*got 3"),
        ("malformed", ResponseError, "malformed JSON"),
        ("hang", RolloutServerError, r"did not answer within the read timeout of 1(\.0)? s"),
    ],
    ids=["5xx", "few_choices", "malformed_json", "hang"],
)
def test_bad_answers_stop_the_run_with_a_checkpoint(setup, fault, error, match):
    fake, trainer = setup[0], setup[1]
    run_dir, err = _run_with_fault_after_step_1(setup, fault, fault)
    assert isinstance(err.__cause__, error), repr(err.__cause__)
    assert re.search(match, str(err)), str(err)
    _assert_stopped_with_checkpoint(trainer, run_dir, err, 1)
    if fault in ("few", "malformed", "hang"):
        # Not retried: a wrong answer stays wrong, and a hung server is not asked again.
        assert fake.faulted <= trainer.shapes.Q


def test_stale_weights_after_a_push_stop_the_run_before_any_rollout(setup):
    """The server keeps serving other weights after the push of step 2 (the probe check fails): the
    run stops with the step-2 state checkpointed and never rolls out from the stale server."""
    fake, trainer = setup[0], setup[1]
    run_dir, err = _run_with_fault_after_step_1(setup, "stale", "stale")
    assert isinstance(err.__cause__, WeightSyncError) and "not confirmed" in str(err)
    assert "step 2" in str(err) and "prompt log-probs" in str(err)
    ckpt = Checkpointer(run_dir / "checkpoints")
    assert ckpt.all_steps() == [2]  # step 2's update was fine; only the push failed
    # The last request was the probe that caught it: no rollout from the stale server followed.
    last = [r for r in fake.requests if r[1] == "/v1/completions"][-1]
    assert last[3].get("prompt_logprobs") is not None
    assert trainer.rollout.backend.unconfirmed is not None
    trainer.rollout.backend.unconfirmed = None  # for the next case


def test_transient_5xx_is_retried_and_the_run_finishes(setup):
    fake, trainer, init, tmp, *_ = setup
    run_dir = tmp / "transient"
    rewind(trainer, run_dir, *init)

    def progress(metrics):
        if metrics["step"] == 1:
            fake.fault, fake.faulted = "500x2", 0

    try:
        trainer.train(progress=progress)
    finally:
        fault_hits, fake.fault = fake.faulted, None
    assert fault_hits > 2  # two 500s, then answers
    assert metrics_steps(run_dir) == [1, 2, 3]
    assert Checkpointer(run_dir / "checkpoints").latest_step() == 3


def test_server_down_at_start_is_a_fast_clear_error(setup):
    _, trainer, init, tmp, *_ = setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    rewind(trainer, tmp / "down", *init)
    real = trainer.rollout.backend.client
    trainer.rollout.backend.client = VLLMClient(url, timeout_s=1.0, backoff_s=0.05)
    trainer.rollout.backend.synced_step = None
    try:
        with pytest.raises(RolloutServerError) as info:
            trainer.train()
    finally:
        trainer.rollout.backend.client = real
    assert url in str(info.value) and "running" in str(info.value)
    assert metrics_steps(tmp / "down") == []  # nothing trained, nothing to lose


def test_first_push_comes_after_the_compile_ahead_and_the_server_wait(setup, monkeypatch):
    """The trainer compiles while the server loads: the first step's program is compiled ahead, then
    the server waited for, then the weights pushed (on 63ffd83 the push, which waits for the server,
    came first)."""
    _, trainer, init, tmp, *_ = setup
    rewind(trainer, tmp / "order", *init, "trainer.steps=1")
    backend, log, order = trainer.rollout.backend, trainer.host.log, []
    real_event, real_wait, real_sync = log.event, backend.wait_ready, backend.sync_weights

    def event(name, **fields):
        order.append(name)
        return real_event(name, **fields)

    monkeypatch.setattr(log, "event", event)
    monkeypatch.setattr(backend, "wait_ready", lambda: (order.append("wait"), real_wait())[1])
    monkeypatch.setattr(
        backend, "sync_weights", lambda p, s: (order.append(f"push {s}"), real_sync(p, s))[1]
    )
    trainer.train()
    assert order[:3] == ["compiled_ahead", "wait", "push 0"], order
    assert "push 1" in order


def _space_fault(setup, name, monkeypatch, *, at_start: bool, oserror: bool = False):
    """A run whose push folder is too small (the free-space probe says 1 kB) from the start or after
    step 1, or whose write fails with ENOSPC (a full /dev/shm) after step 1."""
    import errno

    from cppo_jax.rollout.vllm import routes as vllm_routes

    _, trainer, init, tmp, *_ = setup
    run_dir = tmp / name
    rewind(trainer, run_dir, *init)
    backend = trainer.rollout.backend

    def fault():
        if not oserror:
            monkeypatch.setattr(backend, "free_bytes", lambda folder: 1000)
            return

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(vllm_routes, "save_hf", full)

    if at_start:
        for slot in backend.weights_dir.glob("slot*"):  # the earlier cases' (a push replaces them)
            shutil.rmtree(slot)
        fault()
    try:
        with pytest.raises(RolloutServerError) as info:
            trainer.train(progress=lambda m: fault() if m["step"] == 1 else None)
        _drain(trainer)
    finally:
        monkeypatch.undo()
        backend.unconfirmed = None  # for the next case
    return run_dir, info.value


def test_push_folder_too_small_is_named_with_a_checkpoint(setup, monkeypatch):
    """Checked before the first push: a push folder whose file system cannot hold two copies of the
    weights (the free-space probe says 1 kB) stops the run with an error naming the folder, Docker's
    --shm-size and rollout.weights_dir, and a checkpoint of the starting state."""
    from cppo_jax.rollout.vllm.push import PushSpaceError

    trainer = setup[1]
    run_dir, err = _space_fault(setup, "space", monkeypatch, at_start=True)
    assert isinstance(err.__cause__, PushSpaceError), repr(err.__cause__)
    assert "--shm-size" in str(err) and "rollout.weights_dir" in str(err)
    assert str(trainer.rollout.backend.weights_dir) in str(err)
    assert f"checkpoint of step 0 saved under {run_dir / 'checkpoints'}" in str(err)
    assert metrics_steps(run_dir) == []
    events = [e["step"] for e in read_events(run_dir) if e["event"] == "rollout_server_error"]
    assert events == [0]
    _, meta = Checkpointer(run_dir / "checkpoints").restore(None, trainer.state())
    assert meta["step"] == 0
    assert not list(trainer.rollout.backend.weights_dir.glob("slot*"))  # nothing was written


def test_full_push_folder_mid_write_is_a_push_failure_with_a_checkpoint(setup, monkeypatch):
    """An OSError while writing (ENOSPC: /dev/shm filled by something else) ends as any failed push:
    a RolloutServerError naming the folder and the fix, the finished step checkpointed."""
    from cppo_jax.rollout.vllm.push import PushSpaceError

    run_dir, err = _space_fault(setup, "enospc", monkeypatch, at_start=False, oserror=True)
    assert isinstance(err.__cause__, PushSpaceError), repr(err.__cause__)
    assert isinstance(err.__cause__.__cause__, OSError)
    assert "No space left on device" in str(err) and "--shm-size" in str(err)
    assert "checkpoint of step 2 saved" in str(err)
    assert Checkpointer(run_dir / "checkpoints").all_steps() == [2]
