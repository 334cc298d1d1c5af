"""Profiling helpers: named phases reach the XLA trace, the trace window, HLO dumps, compile counts."""

from __future__ import annotations

import gzip
import time

import jax
import jax.numpy as jnp
import pytest

from cppo_jax.observe import profile


def _tiny_fn():
    # A new program each call (its own constant), so that its first call compiles even where the
    # persistent compilation cache is on (in-process launch tests turn it on, storing every program).
    c = float(time.time_ns() % 1_000_003) + 1.0
    return jax.jit(lambda x, w: jnp.tanh(x @ w * c).sum(axis=-1))


def _raw(path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.name.endswith(".gz") else data


def test_phases_inside_the_window_reach_the_trace(tmp_path):
    f = _tiny_fn()
    x, w = jnp.ones((3, 7)), jnp.ones((7, 5))
    tracer = profile.Tracer(tmp_path, steps=(2, 3))
    times: dict[str, float] = {}
    started, stopped = [], []
    for step in range(1, 5):
        started.append(tracer.maybe_start(step))
        for name in profile.PHASES:
            with profile.phase(name, times):
                jax.block_until_ready(f(x + step, w))
        stopped.append(tracer.maybe_stop(step))
    tracer.close()
    assert started == [False, True, False, False]
    assert stopped == [False, False, True, False]
    assert not tracer.active and tracer.done

    files = tracer.files()
    assert files, f"no trace file under {tracer.directory}"
    assert all(str(p).startswith(str(tmp_path / "profile")) for p in files)
    blob = b"".join(_raw(p) for p in files)
    for name in profile.PHASES:
        assert name.encode() in blob, f"phase {name!r} is not in the trace"
    assert all(profile.trace_contains(tracer.directory, profile.PHASES).values())
    # Wall time accumulates over the four steps, for every phase.
    assert set(times) == set(profile.PHASES)
    assert all(t > 0 for t in times.values())


def test_phase_records_its_time_even_when_the_block_raises():
    times: dict[str, float] = {}
    with pytest.raises(RuntimeError), profile.phase("update", times) as timer:
        raise RuntimeError("boom")
    assert timer.seconds is not None and times["update"] == timer.seconds


def test_tracer_disabled_and_resumed_inside_the_window(tmp_path):
    off = profile.Tracer(tmp_path / "off")
    assert not off.enabled and not off.maybe_start(0) and not off.maybe_stop(0)
    assert not (tmp_path / "off" / "profile").exists()

    # A run resumed at step 5 inside the window (3, 6) traces from 5; the context manager form.
    f = _tiny_fn()
    tracer = profile.Tracer(tmp_path / "resumed", steps=(3, 6))
    for step in range(5, 8):
        with tracer.step(step), profile.phase("rollout"):
            jax.block_until_ready(f(jnp.ones((2, 3)), jnp.ones((3, 2))))
    assert tracer.done and not tracer.active and tracer.files()
    with pytest.raises(ValueError, match="profile steps"):
        profile.Tracer(tmp_path, steps=(4, 2))


def test_dump_hlo_and_the_compilation_report(tmp_path):
    profile.reset_compiled_programs()
    f = _tiny_fn()
    x, w = jnp.ones((3, 7)), jnp.ones((7, 5))
    jax.block_until_ready(f(x, w))
    stats = profile.dump_hlo(f, (x, jax.ShapeDtypeStruct((7, 5), jnp.float32)), tmp_path, "tiny")
    hlo = tmp_path / "tiny.hlo.txt"
    assert hlo.is_file() and hlo.stat().st_size > 0
    assert (tmp_path / "tiny.stablehlo.mlir").stat().st_size > 0
    assert "HloModule" in hlo.read_text()
    assert stats["hlo_bytes"] == hlo.stat().st_size and stats["hlo_instructions"] > 0
    assert stats["flops"] is None or stats["flops"] > 0

    report = profile.compiled_programs_report()
    # The first call compiled `f` (dump_hlo reuses that executable for the same shapes).
    assert report["compilations"] >= 1 and report["compile_s"] > 0
    assert any(p["name"].startswith("jit(") for p in report["programs"])
    assert [d["name"] for d in report["dumped"]] == ["tiny"]
    text = profile.format_programs_report(report)
    assert "XLA compilations" in text and "| tiny |" in text

    # A second call with the same shapes compiles nothing.
    before = profile.compiled_programs_report()["compilations"]
    jax.block_until_ready(f(x, w))
    assert profile.compiled_programs_report()["compilations"] == before
    with pytest.raises(ValueError, match="plain file name"):
        profile.dump_hlo(f, (x, w), tmp_path, "../escape")
