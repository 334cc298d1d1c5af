"""The suite's shared real vLLM servers (tests/vllm_servers.py): what a test leaves changed is put back
and checked, a server that died or cannot be put back is said so and never reused, and the starts
are counted from the servers' own logs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.vllm_servers import (
    CONFIGS,
    Registry,
    Served,
    ServerLeftChangedError,
    count_starts,
)


@pytest.mark.vllm_server("arith_fp32")
def test_weights_a_test_changed_are_put_back_on_the_same_server(
    vllm_server, vllm_registry, tmp_path
):
    """Serve other weights (the start folder's tensors doubled), as a test's push would: the server
    answers otherwise; the registry's release reloads the start folder and the server answers as at
    its start again, still the same process (no new start)."""
    from safetensors.numpy import load_file, save_file

    from cppo_jax.rollout.vllm.client import VLLMClient

    changed = tmp_path / "changed"
    shutil.copytree(vllm_server.model_dir, changed)
    for f in changed.glob("*.safetensors"):
        save_file({k: 2 * v for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    proc, starts = vllm_server.server.proc, list(vllm_registry.starts)
    client = VLLMClient(vllm_server.url, model=str(vllm_server.model_dir))
    try:
        client.reload_weights(str(changed))
    finally:
        client.close()
    now = vllm_registry._fingerprint(vllm_server)
    assert now["probe log-probs"] != vllm_server.fingerprint["probe log-probs"]
    if vllm_server.plain_weights:
        assert now["checksums"] != vllm_server.fingerprint["checksums"]

    vllm_registry.release(vllm_server)

    assert vllm_registry._fingerprint(vllm_server) == vllm_server.fingerprint
    assert vllm_server.server.proc is proc and proc.poll() is None
    assert vllm_registry.starts == starts and vllm_registry.live["arith_fp32"] is vllm_server


class _Stopped:
    """A stand-in for VLLMServer whose process has already exited."""

    url, log_path = "http://127.0.0.1:1", Path("server.log")

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "pass"])
        self.proc.wait()
        self.stopped = 0

    def stop(self):
        self.stopped += 1


def test_a_server_that_died_during_a_test_is_said_and_dropped(tmp_path):
    registry = Registry(tmp_path)
    served = Served("arith_fp32", _Stopped(), tmp_path, tmp_path)
    registry.live["arith_fp32"] = served
    with pytest.raises(ServerLeftChangedError, match="arith_fp32 .* died during the test"):
        registry.release(served)
    assert "arith_fp32" not in registry.live and served.server.stopped == 1
    # A test that stops its server on purpose: no error, gone from the registry all the same.
    registry.live["arith_fp32"] = served
    registry.release(served, stops_it=True)
    assert "arith_fp32" not in registry.live


def test_a_server_that_cannot_be_put_back_is_stopped_not_reused(tmp_path):
    """Its restore fails (here nothing listens at its address): the error names the server and
    why; the next test of that configuration gets a fresh server."""
    registry = Registry(tmp_path)
    alive = _Stopped()
    alive.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    served = Served("untied_fp32", alive, tmp_path, tmp_path)
    registry.live["untied_fp32"] = served
    try:
        with pytest.raises(ServerLeftChangedError, match="untied_fp32 .* could not be put back"):
            registry.release(served)
    finally:
        alive.proc.kill()
        alive.proc.wait()
    assert "untied_fp32" not in registry.live and alive.stopped == 1


def test_an_unknown_configuration_names_the_known_ones(tmp_path):
    with pytest.raises(KeyError, match="no vLLM server configuration 'fp8'.*arith_fp32"):
        Registry(tmp_path).acquire("fp8")
    assert len(CONFIGS) <= 6  # the ceiling on real server starts in one make test


def test_starts_are_counted_from_the_servers_logs():
    """Each model a vLLM worker began to load is a start; a server refused before it loaded a model,
    and any other file, is not. (Written outside the run's temporary folder, whose logs the run's
    own count reads.)"""
    line = (
        "(EngineCore_DP0 pid=1) INFO 12-08 01:00:00 [gpu_model_runner.py:1] Starting to load model "
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a").mkdir()
        (root / "a" / "server.log").write_text(f"{line}/m\nready\n{line}/m\n")
        (root / "b.log").write_text("error: address already in use\n")
        (root / "c.txt").write_text(f"{line}/m\n")  # not a log
        starts, logs = count_starts(root)
        assert starts == 2 and logs == [root / "a" / "server.log"]


def test_the_budget_names_each_server_and_only_test_files_that_exist():
    """tests/budget.toml orders the groups (tests/conftest.py): every server configuration has a
    budget (a missing one would stop the collection), and a file budget names a test file of the
    suite (a renamed file's would go stale, its file falling back to the default)."""
    from tests.conftest import BUDGET

    tests = Path(__file__).parent
    assert set(BUDGET["servers"]) == set(CONFIGS)
    stale = [f for f in BUDGET["files"] if not (tests / f).is_file()]
    assert not stale, f"tests/budget.toml names files that are not there: {stale}"
    assert all(v > 0 for v in (*BUDGET["files"].values(), *BUDGET["servers"].values()))


class _Item:
    """What tests/conftest.py's collection hook reads of a test: its file, markers."""

    def __init__(self, path: str, server: str | None = None, stops_it: bool = False):
        self.path = Path(__file__).parent / path
        self.marks = [pytest.mark.vllm_server(server, stops_it=stops_it).mark] if server else []

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)


def test_a_servers_tests_run_together_on_one_worker_longest_group_first():
    """Under `--dist loadgroup` the tests of one server configuration, from whatever file, form one
    xdist group (one worker starts it once), the test that stops it last; groups go out longest
    budget first; every server test is also marked `vllm` (what `make test-fast` leaves out)."""
    import types

    from tests import conftest

    items = [
        _Item("test_model.py"),
        _Item("test_vllm.py", "arith_fp32", stops_it=True),
        _Item("test_vllm_lora.py", "arith_fp32"),
        _Item("test_vllm.py", "untied_fp32"),
        _Item("test_vllm.py", "arith_fp32"),
    ]
    # As xdist's workers see the options (xdist/remote.py): dist "no", loadgroup on.
    config = types.SimpleNamespace(option=types.SimpleNamespace(dist="no", loadgroup=True))
    config.getvalue = lambda name: getattr(config.option, name)
    conftest.pytest_collection_modifyitems(None, config, items)
    groups = [i.get_closest_marker("xdist_group").args[0] for i in items]
    budget = [conftest._group_budget(g) for g in groups]
    assert budget == sorted(budget, reverse=True)
    arith = [i for i in items if groups[items.index(i)] == "vllm_arith_fp32"]
    assert len(arith) == 3 and arith[-1].get_closest_marker("vllm_server").kwargs["stops_it"]
    runs = [g for n, g in enumerate(groups) if n == 0 or groups[n - 1] != g]
    assert len(runs) == len(set(groups)) == 3  # each group's tests next to each other
    assert all(
        (i.get_closest_marker("vllm") is not None)
        == (i.get_closest_marker("vllm_server") is not None)
        for i in items
    )
