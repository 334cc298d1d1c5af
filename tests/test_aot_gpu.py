"""`--compile-for` GPU targets (XLA:GPU's compile-only topology on this CPU) and one-chip TPU slices.

The GPU compiles run in a subprocess, as the TPU ones do (tests/test_aot.py): the CUDA plugin is put
on the path only there (`make cuda-compiler`, which `make test` runs, installs it outside the
environment). One subprocess for the module (`compiled`) runs the command line first
(`run_in_process`: what it writes, the plugin's C++ logging included, captured as a shell shows it),
then reads the compiler's own figures and libtpu's one-chip and 16-chip slices. The tiny config
(with 4 answers per question and no dynamic allocation: 16 sampler rows, not 512) on one H100
compiles in well under a minute; the paper configs are in benchmarks/results/aot_gpu.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cppo_jax.config.files import load_config
from cppo_jax.planning import aot, roofline
from cppo_jax.planning import fit as aot_fit
from cppo_jax.planning import gpu_targets as aot_gpu
from cppo_jax.planning import memory as layout
from cppo_jax.planning.aot import AotError, Compiled, ProgramMemory
from cppo_jax.planning.fit import Report

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.py")
SMALL = ("cppo.num_generations=4", "cppo.allocation=false")  # 16 sampler rows, M = 4 train rows


def _env() -> dict:
    drop = ("JAX_PLATFORMS", "TPU_LIBRARY_PATH", "XLA_FLAGS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize(
    "target, want",
    [("h100:8", ("h100", 1, 8)), ("h200:2x8", ("h200", 2, 8)), ("a100:1", ("a100", 1, 1))],
)
def test_gpu_targets_parse(target, want):
    assert aot_gpu.is_gpu_target(target)
    assert aot_gpu.parse(target) == want


@pytest.mark.parametrize(
    "target, needle",
    [
        ("rtx4090:8", "unknown GPU 'rtx4090'"),
        ("h100:0", "0 GPUs per host"),
        ("h100:9", "9 GPUs per host"),
        ("h100:0x8", "0 host(s)"),
        ("h100:eight", "not GPU:N or GPU:HOSTSxN"),
    ],
)
def test_bad_gpu_targets_name_the_culprit(target, needle):
    assert aot_gpu.is_gpu_target(target)
    with pytest.raises(AotError, match="--compile-for") as e:
        aot_gpu.parse(target)
    assert needle in str(e.value) and "h100:8" in str(e.value)


def test_tpu_names_are_not_gpu_targets():
    for target in ("v5e:2x4", "v5p:2x2x1", "v4:2x2x1", "cpu", "tpu-big"):
        assert not aot_gpu.is_gpu_target(target)


def test_unknown_gpu_on_the_command_line_is_one_clear_message(capsys):
    from cppo_jax.plan import main

    assert main(["--config", TINY, "--compile-for", "rtx4090:8"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "unknown GPU 'rtx4090'" in errors[0], err


def test_without_the_compiler_the_message_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    from cppo_jax.plan import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no compiler installed there
    assert main(["--config", TINY, "--compile-for", "h100:1"]) == 2
    err = capsys.readouterr().err
    assert "make cuda-compiler" in err and "--install-cuda-compiler" in err
    assert str(tmp_path) in err


def test_the_gpu_chips_come_from_their_spec_files():
    """Each GPU's spec parses to the device kind the compile-only devices report, and the roofline's
    chip of that kind takes its HBM and bandwidth from the same file (one copy of each fact)."""
    for gpu, spec in aot_gpu.GPUS.items():
        text = (aot_gpu.SPECS / f"{spec}.txtpb").read_text()
        chip = roofline.CHIPS[aot_gpu.device_name(gpu)]
        assert chip.name == gpu
        assert f"device_memory_size: {chip.hbm_bytes}" in text
        assert chip.hbm_bandwidth == aot_gpu.spec_field(gpu, "memory_bandwidth")
    h100 = roofline.CHIPS["NVIDIA H100 80GB HBM3"]
    assert 79 * 2**30 < h100.hbm_bytes < 80 * 2**30 and h100.bf16_flops == 989e12


def _report(peak_bytes: int, hbm: int, platform: str) -> Report:
    """A Report over one compiled program of `peak_bytes` (nothing beside it), no compile."""
    program = ProgramMemory("train_step", arguments=peak_bytes)
    compiled = Compiled(
        target="h100:1" if platform == "cuda" else "v5p:2x2x1",
        devices=1,
        device_kind="x",
        mesh={"data": 1, "fsdp": 1, "tensor": 1},
        micro_batch=0,
        programs=(program,),
        resident={},
        args_of={"train_step": ()},
        platform=platform,
    )
    cfg = load_config(TINY, [])
    fraction = aot_fit.usable_fraction(platform)
    return Report(cfg, compiled, hbm, {}, [], None, fraction=fraction)


def test_a_gpu_fits_in_the_memory_fraction_the_launch_gives_jax():
    """On a GPU a run fits when its peak is within layout.GPU_MEM_FRACTION of the HBM: the pool
    JAX's allocator holds once `cppo_jax.launch` has set XLA_PYTHON_CLIENT_MEM_FRACTION, which it
    sets to that same fraction (one fact for the plan, the compile report and the launch)."""
    hbm = 80 * 10**9
    frac = layout.GPU_MEM_FRACTION
    assert (
        aot_fit.usable_fraction("cuda") == frac and aot_fit.usable_fraction("tpu") == layout.USABLE
    )
    environ: dict = {}
    layout.set_gpu_memory_fraction(environ)
    assert float(environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == frac
    assert _report(int((frac + 0.02) * hbm), hbm, "cuda").fits is False
    assert _report(int((frac - 0.02) * hbm), hbm, "cuda").fits is True


# In one process: the command line first (before anything else registers the CUDA plugin); then the
# compiler's own figures for the tiny config's log-prob forward on one H100, read without
# aot.compile_run (the devices from aot_gpu, then jax's lower/compile/memory_analysis with XLA:GPU's
# options); then libtpu's devices for one-chip slices and a mesh placed on a 4 x 4 torus.
_CHILD = textwrap.dedent(
    """
    import json, sys
    from cppo_jax import plan
    from tests.documented import run_in_process
    tiny, report, small = sys.argv[1], sys.argv[2], sys.argv[3:]
    args = ["--config", tiny, "--compile-for", "h100:1", "--no-search", "--json", report, *small]
    print("RUN " + json.dumps(run_in_process(plan.main, args)), flush=True)

    from cppo_jax.planning import gpu_targets as aot_gpu
    from cppo_jax.train import programs
    from cppo_jax.config.files import load_config
    devices = aot_gpu.gpu_devices("h100:1")
    fn, args = programs.build(load_config(tiny, small), devices).programs["ref_logps"]
    m = fn.lower(*args).compile(aot_gpu.compiler_options()).memory_analysis()
    print("RAW " + json.dumps({k: getattr(m, k) for k in dir(m) if k.endswith("_in_bytes")}))

    from cppo_jax.planning import aot
    one = []
    for target in ("v5e:1x1", "v6e:1x1"):
        d = aot.target_devices(target)
        one.append([target, len(d), d[0].device_kind])
    print("ONE " + json.dumps(one))

    from cppo_jax.parallel import sharding
    from cppo_jax.config.run import MeshConfig
    devices = aot.target_devices("v6e:4x4")
    mesh = sharding.make_mesh(MeshConfig(data=8, fsdp=1, tensor=2), devices)
    ids = sorted(d.id for d in mesh.devices.flat)
    print("MESH " + json.dumps([dict(mesh.shape), ids == sorted(d.id for d in devices)]))
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """What `_CHILD` found: "RUN" (exit status, stdout, stderr of the command line), "report" (its
    --json), "RAW", "ONE" and "MESH"."""
    report = tmp_path_factory.mktemp("gpu") / "report.json"
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, TINY, str(report), *SMALL],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=1800,
    )
    found = {}
    for line in res.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("RUN", "RAW", "ONE", "MESH"):
            found[key] = json.loads(value)
    assert set(found) == {"RUN", "RAW", "ONE", "MESH"}, (found.get("RUN"), res.stderr[-3000:])
    return {**found, "report": json.loads(report.read_text())}


@pytest.mark.slow
def test_gpu_compile_of_a_tiny_run_reports_the_compilers_figures(compiled):
    code, stdout, stderr = compiled["RUN"]
    assert code == 0, stderr[-3000:]
    assert "compiled for h100:1: 1 x NVIDIA H100 80GB HBM3" in stdout
    frac = layout.GPU_MEM_FRACTION  # the fraction the launch sets (layout.USABLE_FRACTION)
    assert f"{frac:.0%} usable: JAX's XLA_PYTHON_CLIENT_MEM_FRACTION={frac}" in stdout
    assert "cuda drivers" not in stderr.lower()  # the plugin's notice is held back
    report = compiled["report"]
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["fits"] is True
    assert report["usable_fraction"] == layout.GPU_MEM_FRACTION
    assert report["hbm_bytes"] == int(aot_gpu.spec_field("h100", "device_memory_size"))
    programs = {p["program"]: p for p in report["programs"]}
    assert {"train_step", "ref_logps", "sampler"} <= set(programs)
    assert all(p["total"] > 0 and not p["error"] for p in programs.values())
    m, ref = compiled["RAW"], programs["ref_logps"]
    assert ref["arguments"] == m["argument_size_in_bytes"]
    assert ref["temporaries"] == m["temp_size_in_bytes"]
    # The roofline on the H100's datasheet figures.
    assert all(p["bound_s"] > 0 for p in report["phases"])


def test_one_chip_tpu_hosts_get_their_own_host_bounds():
    assert aot._host_bounds("v5e:1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert aot._host_bounds("v5e:2x4") == {} and aot._host_bounds("v5p:2x2x1") == {}


@pytest.mark.slow
def test_one_chip_tpu_topologies_compile_for_one_device(compiled):
    """libtpu refuses `v5e:1x1` with the default host of 2x2x1 chips; given the host's bounds, a
    one-chip slice is one device of that chip."""
    assert compiled["ONE"] == [["v5e:1x1", 1, "TPU v5 lite"], ["v6e:1x1", 1, "TPU v6 lite"]]


@pytest.mark.slow
def test_a_mesh_off_the_torus_sides_is_placed_by_splitting_a_physical_axis(compiled):
    """math7b + LoRA on a 16-chip slice needs tensor = 2 beside data = 8 (Q = 24): on v6e's 4 x 4
    torus no side is 2 long, and jax.make_mesh raised NotImplementedError ("Failed to find
    assignment for logical_axis_index 2"). The mesh is placed with a physical axis split, each of
    the 16 devices once."""
    assert compiled["MESH"] == [{"data": 8, "fsdp": 1, "tensor": 2}, True]


def test_a_mesh_that_cannot_be_placed_names_the_mesh_and_the_torus(monkeypatch):
    import jax
    from jax.experimental import mesh_utils

    from cppo_jax.config.run import MeshConfig
    from cppo_jax.parallel import sharding

    def refuse(*args, **kwargs):
        raise NotImplementedError("Failed to find assignment for logical_axis_index 2 of size 2")

    monkeypatch.setattr(jax, "make_mesh", refuse)
    monkeypatch.setattr(mesh_utils, "create_device_mesh", refuse)
    with pytest.raises(sharding.MeshError) as e:
        sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    text = str(e.value)
    assert "mesh.data=1 mesh.fsdp=1 mesh.tensor=1 cannot be placed on the slice's torus" in text
    assert "logical_axis_index 2" in text


def test_full_fine_tuning_that_does_not_fit_names_lora_with_the_plans_figure():
    """When the compiler refuses a full fine-tuning step (the 1.5B on one v5e chip), the message
    names LoRA with the plan's figure for it; a LoRA run gets no such hint."""
    import dataclasses

    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.planning.compiled_memory import planned_model, run_peak
    from cppo_jax.planning.report import no_fit_message

    refused = ProgramMemory("train_step", temporaries=31 * 2**30, error="RESOURCE_EXHAUSTED")
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    compiled = Compiled("v5e:1x1", 1, "TPU v5 lite", mesh, 0, (refused,), {}, {"train_step": ()})
    cfg = load_config("gsm8k_1p5b", [])
    message = no_fit_message(Report(cfg, compiled, 16 * 2**30, {}, [], None))
    lora = dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            cfg.model, lora=dataclasses.replace(cfg.model.lora, enabled=True)
        ),
    )
    planned = run_peak(lora, planned_model(lora), shapes_of(lora), mesh, "v5e:1x1")
    assert "model.lora.enabled=true" in message
    assert f"about {planned / 2**30:.2f}G per device" in message
    assert "model.lora" not in no_fit_message(Report(lora, compiled, 16 * 2**30, {}, [], None))
