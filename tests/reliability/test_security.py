"""Outputs stay under the run folder; nothing is unpickled from a checkpoint, a model folder or a server.

Promises (docs/reliability.md): no config value sends outputs or weight pushes outside the run folder by
path traversal (`trainer.run_name`, a relative `rollout.weights_dir`); an absolute `rollout.weights_dir`
(a dedicated folder on another file system, e.g. /dev/shm) must be new, empty or created by cppo_jax, so a
mistaken path never has files replaced or removed; restoring a checkpoint, loading a model and reading a
server's answers never call the unpickler.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import apply_overrides
from cppo_jax.config.schema import Config, RolloutConfig
from cppo_jax.rollout.embedded.sampling import SamplingParams
from cppo_jax.rollout.vllm.backend import PUSH_MARKER, VLLMBackend, claim_push_folder, push_folder
from cppo_jax.train.checkpoint import Checkpointer
from tests.reliability.ckpt_writer import expected_state
from tests.test_vllm_client import FakeVLLM

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", ["../elsewhere", "a/../../elsewhere", ".", "weights/../.."])
def test_relative_weights_dir_cannot_leave_the_run_folder(tmp_path, value):
    with pytest.raises(ConfigError, match=r"'rollout.weights_dir' = .* outside the run folder"):
        push_folder(value, tmp_path / "run")


def test_weights_dir_symlink_out_of_the_run_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(ConfigError, match="outside the run folder"):
        push_folder("link/weights", run)
    assert push_folder("", run) == run.resolve() / "weights"
    assert push_folder("pushes/a", run) == run.resolve() / "pushes" / "a"
    assert push_folder(str(tmp_path / "shm"), run) == (tmp_path / "shm").resolve()


def test_run_name_cannot_traverse():
    for name in ("../../etc", "a/b", ".."):
        with pytest.raises(ConfigError, match=r"'trainer.run_name'"):
            apply_overrides(Config(), [f"trainer.run_name={name}"])


def test_absolute_weights_dir_must_be_a_folder_of_its_own(tmp_path, arith_model_dir):
    from flax import nnx

    from cppo_jax.models import load_hf

    theirs = tmp_path / "home"
    theirs.mkdir()
    (theirs / "slot0").mkdir()
    (theirs / "slot0" / "notes.txt").write_text("someone else's file")
    graphdef, params = nnx.split(load_hf(arith_model_dir))
    cfg = RolloutConfig(backend="vllm", vllm_url="http://127.0.0.1:9", weights_dir=str(theirs))
    backend = VLLMBackend(cfg, graphdef, SamplingParams(max_new_tokens=4), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"is not an empty folder; weight pushes need a folder"):
        backend.write_weights(params)
    backend.close()
    assert (theirs / "slot0" / "notes.txt").read_text() == "someone else's file"
    # A new folder is claimed, written, and removed again on close.
    fresh = tmp_path / "shm" / "cppo_weights"
    backend = VLLMBackend(
        RolloutConfig(backend="vllm", vllm_url="http://127.0.0.1:9", weights_dir=str(fresh)),
        graphdef,
        SamplingParams(max_new_tokens=4),
        tmp_path / "run",
    )
    slot, nbytes = backend.write_weights(params)
    assert slot.parent == fresh and nbytes > 0 and (fresh / PUSH_MARKER).is_file()
    claim_push_folder(fresh)  # a folder cppo_jax made is accepted again (e.g. after a crash)
    backend.close()
    assert not fresh.exists()


def _refuse_unpickling(monkeypatch) -> list[str]:
    """Every entry point of the unpickler raises (and is recorded) from now on in this test."""
    calls: list[str] = []

    def refuse(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"pickle.{name} called")

        return fn

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse(name))
    with pytest.raises(AssertionError):
        pickle.loads(pickle.dumps(1))  # the guard is live
    calls.clear()
    return calls


def _looks_pickled(data: bytes) -> bool:
    return len(data) > 2 and data[0] == 0x80 and 2 <= data[1] <= 5 and data.rstrip().endswith(b".")


def test_nothing_is_unpickled_from_checkpoints_models_or_servers(
    tmp_path, arith_model_dir, monkeypatch
):
    ckpt = Checkpointer(tmp_path / "checkpoints")
    ckpt.save(3, expected_state(3), {"step": 3})
    for f in (tmp_path / "checkpoints").rglob("*"):
        if f.is_file():
            assert not _looks_pickled(f.read_bytes()), f
    calls = _refuse_unpickling(monkeypatch)
    state, meta = ckpt.restore(None, expected_state(0))
    assert meta == {"step": 3}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected_state(3))):
        np.testing.assert_array_equal(np.asarray(a), b)
    ckpt.close()

    from cppo_jax.models import load_hf
    from cppo_jax.rollout.vllm.client import VLLMClient

    assert load_hf(arith_model_dir).cfg.vocab_size > 0
    fake = FakeVLLM("ok")
    try:
        groups = VLLMClient(fake.url, timeout_s=5.0).complete([[5, 6]], n=2, max_tokens=3)
    finally:
        fake.close()
    assert len(groups[0]) == 2
    assert calls == []


def test_package_source_has_no_unpickling_calls():
    """The package never calls an unpickler or a loader that may unpickle (torch.load, allow_pickle)."""
    pattern = re.compile(
        r"\bpickle\.loads?\b|\bUnpickler\b|\bcloudpickle\b|\bdill\b|\bjoblib\b|"
        r"torch\.load\b|allow_pickle\s*=\s*True|\beval\(|\bexec\("
    )
    hits = []
    for path in sorted((ROOT / "cppo_jax").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []


def test_vllm_server_is_loopback_by_default_with_an_api_key_option_and_documented_private():
    import inspect

    from cppo_jax.rollout.vllm.server import VLLMServer

    script = (ROOT / "launch" / "vllm_server.sh").read_text()
    assert 'HOST="${VLLM_HOST:-127.0.0.1}"' in script
    assert '--api-key "$VLLM_API_KEY"' in script
    assert inspect.signature(VLLMServer.__init__).parameters["host"].default == "127.0.0.1"
    docs = (ROOT / "docs" / "vllm.md").read_text()
    assert "not guarded by `--api-key`" in docs and "private" in docs
    assert "rollout.vllm_api_key" in docs
