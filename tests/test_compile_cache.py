"""A repeated run loads its programs from the persistent compilation cache instead of compiling them.

`trainer.compile_cache_dir` (default `auto`: ~/.cache/cppo_jax/xla) is set by `cppo_jax.launch` before
anything compiles. The same command run twice in fresh processes: the first fills the folder, the
second's first step loads programs (`jit/cache_hits`) and compiles fewer, with the same results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cppo_jax.observe.profile import compile_cache_folder

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, config_file: Path, cache: Path, name: str) -> dict:
    """The first step's metrics of `cppo_jax.launch --config config_file` in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    cmd = [
        sys.executable,
        "-m",
        "cppo_jax.launch",
        "--config",
        str(config_file),
        f"trainer.run_name={name}",
        f"trainer.compile_cache_dir={cache}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rows[0]


@pytest.mark.slow
def test_a_repeated_run_compiles_less(tmp_path, arith_model_dir):
    """The command: a one-step run of tests/test_trainer.py's small config, written as a config
    file (its tiny random model compiles faster than the demo's: 36 CPU s for this test against
    47 with configs/tiny_cpu.py)."""
    from cppo_jax.config.files import to_dict
    from tests.test_trainer import small_config

    cfg = small_config(tmp_path, arith_model_dir, "trainer.steps=1")
    config_file = tmp_path / "cfg.py"
    config_file.write_text(
        "import json\nfrom cppo_jax.config.files import from_dict\n"
        f"DATA = json.loads({json.dumps(json.dumps(to_dict(cfg)))})\n"
        "def get_config():\n    return from_dict(DATA)\n"
    )
    cache = tmp_path / "xla_cache"
    first = _run(tmp_path, config_file, cache, "first")
    stored = list(cache.rglob("*"))
    assert stored, "the first run stored no compiled program"
    second = _run(tmp_path, config_file, cache, "second")
    assert first["jit/cache_hits"] == 0 and second["jit/cache_hits"] > 0, (first, second)
    assert second["jit/compilations"] < first["jit/compilations"], (first, second)
    assert second["reward"] == first["reward"] and second["loss"] == first["loss"]


def test_cache_folder_setting(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache_folder("auto") == tmp_path / "cppo_jax" / "xla"
    assert compile_cache_folder("none") is None
    assert compile_cache_folder("/x/y") == Path("/x/y")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/from/env")
    assert compile_cache_folder("auto") == Path("/from/env")


def test_the_suite_process_goes_back_to_the_suites_cache(tmp_path):
    """An in-process launch points the persistent cache at its own folder; the suite's fixture puts
    the process back on the session's folder."""
    import jax
    import jax.numpy as jnp

    from cppo_jax.observe.profile import use_compile_cache
    from tests.conftest import restore_suite_compilation

    def stored(folder: Path) -> set[str]:
        return {p.name for p in folder.rglob("*") if p.is_file()}

    suite, cache = Path(os.environ["CPPO_TEST_XLA_CACHE"]), tmp_path / "xla_cache"
    jax.jit(lambda x: jnp.tan(x) * 1.75)(jnp.ones(5)).block_until_ready()  # JAX has decided
    try:
        assert use_compile_cache(str(cache)) == cache
        jax.jit(lambda x: jnp.sin(x) * 3.25)(jnp.ones(7)).block_until_ready()
        written = stored(cache)
        assert written, "use_compile_cache did not turn the cache on in this process"
    finally:
        restore_suite_compilation()

    def compiled_after_the_restore(x):  # its cache entries are named after it: jit_<name>-...
        return jnp.cos(x) * 5.5

    jax.jit(compiled_after_the_restore)(jnp.ones(9)).block_until_ready()
    assert stored(cache) == written, "a program compiled after the restore went to the run's folder"
    assert any("compiled_after_the_restore" in n for n in stored(suite)), (
        "missed the suite's folder"
    )


def test_every_suite_process_shares_the_sessions_cache():
    """The one-process suite and each of `make test`'s workers store every program in the session's
    one folder (the starting process's), which their subprocesses inherit."""
    from tests import conftest

    folder = os.environ["CPPO_TEST_XLA_CACHE"]
    assert conftest._SUITE_CACHE_CONFIG["jax_compilation_cache_dir"] == folder
    assert conftest._SUITE_CACHE_CONFIG["jax_persistent_cache_min_compile_time_secs"] == 0
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == folder and Path(folder).is_dir()
