"""`python -m cppo_jax.plan --compile-for TARGET`: a run's programs compiled without the target's devices.

The TPU compiles run in one subprocess for the module (`tpu_run`): libtpu is loaded only there (it is
installed outside the environment by `make libtpu`, which `make test` runs), never into the suite's
process, and once. The command line runs there first, in that process (`run_in_process`: what it
writes, libtpu's C++ logging included, captured as a shell shows it), then the compiler's own figures
and HLO are read for the checks. The `cpu` target compiles with XLA:CPU in the suite's process.
The tiny config, with 4 answers per question and no dynamic allocation (`SMALL`: 16 sampler rows and
4 train rows, not 512 and 64; libtpu's compile time grows with the rows), compiles in seconds; the
paper configs are in benchmarks/results/aot_tpu.md. The CPU tests of LoRA's verdict and of a run
that fits nowhere share one model and shape (`wide`), so that each program compiles once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from cppo_jax import plan as plan_cli
from cppo_jax.config.files import load_config
from cppo_jax.planning import aot
from cppo_jax.planning import fit as aot_fit
from cppo_jax.train import programs
from tests.documented import run_in_process

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.py")
# Q = 4 questions of G = 4 answers, k = 1 kept: 16 sampler rows, M = 4 train rows (micro-batches 1, 2, 4).
SMALL = ("cppo.num_generations=4", "cppo.allocation=false")
FIELDS = {  # report key -> CompiledMemoryStats attribute
    "arguments": "argument_size_in_bytes",
    "outputs": "output_size_in_bytes",
    "donated": "alias_size_in_bytes",
    "temporaries": "temp_size_in_bytes",
}


def plan(*args: str) -> tuple[int, str, str]:
    """`python -m cppo_jax.plan --config TINY ARGS` in this process: exit status, stdout, stderr."""
    return run_in_process(plan_cli.main, ["--config", TINY, *args])


# The TPU run's mesh: fsdp over the 4 devices, so that the compiled programs show whether the sampler
# gathers its weights (the plan's own pick for 4 devices, data = 4, is checked without a compile).
FSDP = ("mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1")

# In one process: the command lines first (before anything else loads libtpu); then the compiler's
# own figures for the programs the first one compiled, read without cppo_jax.planning.aot
# (programs.build on the target's devices, then jax's lower/compile/memory_analysis), and which
# collectives run inside those programs' loops, and on what shapes: HLO text parsed here (the loop
# bodies are the computations reachable from a while's body=).
_TPU = textwrap.dedent(
    """
    import dataclasses, json, os, sys
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from cppo_jax import plan
    from tests.documented import run_in_process
    tiny, report, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    out = {}
    for name, args in [
        ("run", ["--compile-for", "v5e:2x2", "--no-search", "--json", report, *overrides]),
        ("unknown", ["--compile-for", "v9x:2x2"]),
        ("mesh", ["--compile-for", "v5e:2x2", "mesh.data=3"]),
    ]:
        out[name] = run_in_process(plan.main, ["--config", tiny, *args])
    print("RESULT " + json.dumps(out), flush=True)

    import jax
    from jax.experimental import topologies
    from cppo_jax.planning import aot
    from cppo_jax.train import programs
    from cppo_jax.config.files import load_config
    os.environ["TPU_LIBRARY_PATH"] = aot.libtpu_path()
    devices = topologies.get_topology_desc("v5e:2x2", platform="tpu").devices
    cfg = load_config(tiny, overrides)
    built = programs.build(cfg, devices)

    def loop_gathers(text, op="all-gather"):
        return [list(shape) for _, shape in aot.loop_collectives(text, op)]

    raw = {}
    loops = {"params": [list(x.shape) for x in jax.tree.leaves(built.programs["sampler"][1][0])]}
    for name, (fn, args) in built.programs.items():
        compiled = fn.lower(*args).compile()
        m = compiled.memory_analysis()
        raw[name] = {k: getattr(m, k) for k in dir(m) if k.endswith("_in_bytes")}
        if name in ("sampler", "train_step"):
            loops[name] = loop_gathers(compiled.as_text())
        if name == "sampler":
            loops["rows"] = [str(s.spec) for s in jax.tree.leaves(compiled.output_shardings)]
            loops["sampler_sums"] = loop_gathers(compiled.as_text(), "all-reduce")
    print("RAW " + json.dumps(raw), flush=True)
    # top-p: the logits gathered by vocabulary (sampler.vocab_split), summed per token
    cut = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, top_p=0.9))
    fn, args = programs.build(cut, devices).programs["sampler"]
    loops["top_p_sums"] = loop_gathers(fn.lower(*args).compile().as_text(), "all-reduce")
    loops["V"] = programs.model_config(cfg).vocab_size
    print("LOOPS " + json.dumps(loops), flush=True)
    """
)


@pytest.fixture(scope="module")
def tpu_run(tmp_path_factory):
    """What `_TPU` found: "run", "unknown", "mesh" (exit status, stdout, stderr of each command
    line), "report" (the first one's --json), "RAW" and "LOOPS"."""
    report = tmp_path_factory.mktemp("tpu") / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_LIBRARY_PATH")}
    res = subprocess.run(
        [sys.executable, "-c", _TPU, TINY, str(report), *SMALL, *FSDP],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=1800,
    )
    found = {}
    for line in res.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("RESULT", "RAW", "LOOPS"):
            found.update(json.loads(value) if key == "RESULT" else {key: json.loads(value)})
    assert {"run", "RAW", "LOOPS"} <= set(found), (found.get("run"), res.stderr[-3000:])
    return {**found, "report": json.loads(report.read_text())}


def _check_against(report: dict, raw: dict) -> None:
    assert {p["program"] for p in report["programs"]} == set(raw)
    for p in report["programs"]:
        for key, attr in FIELDS.items():
            assert p[key] == raw[p["program"]][attr], (p["program"], key)
        assert p["total"] == (
            p["arguments"]
            + p["outputs"]
            - p["donated"]
            + p["temporaries"]
            + raw[p["program"]]["generated_code_size_in_bytes"]
        )


@pytest.mark.slow
def test_tpu_compile_of_a_tiny_run_reports_the_compilers_figures(tpu_run):
    """`--compile-for v5e:2x2 --no-search` on this CPU (the tiny run on an fsdp mesh): every
    program's figures equal to the compiler's own, the roofline's phases, and none of libtpu's
    warnings about a host without TPUs on the user's stderr."""
    code, text, stderr = tpu_run["run"]
    assert code == 0, stderr[-3000:]
    assert "compiled for v5e:2x2: 4 x TPU v5 lite" in text
    for name in ("train_step", "ref_logps", "sampler"):
        assert f"  {name} " in text
    assert "fits: yes" in text
    # libtpu's warnings about a host without TPUs do not reach the user.
    assert "TPU_WORKER_HOSTNAMES" not in stderr and "libtpu" not in stderr.lower()
    report = tpu_run["report"]
    assert report["fits"] is True and report["device_kind"] == "TPU v5 lite"
    assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}  # the config's, as given
    _check_against(report, tpu_run["RAW"])
    # FLOPs come from the model, per phase; the least time from the v5e datasheet figures.
    phases = {p["phase"]: p for p in report["phases"]}
    assert set(phases) == {"rollout", "ref_logps", "update"}
    assert all(p["flops"] > 0 and p["bound_s"] > 0 for p in phases.values())


def test_a_config_without_a_mesh_gets_the_plans_pick_for_the_target():
    """The tiny config keeps the default mesh: `fit` compiles it on the layout the plan prefers for
    the target's 4 devices of a v5e's memory, all data parallel (the launch's `mesh=auto`)."""
    from cppo_jax.config.run import MeshConfig
    from cppo_jax.planning import roofline

    hbm = roofline.CHIPS["TPU v5 lite"].hbm_bytes
    cfg = aot_fit._with_mesh(load_config(TINY, list(SMALL)), 4, hbm, "v5e:2x2")
    assert cfg.mesh == MeshConfig(data=4, fsdp=1, tensor=1)


@pytest.mark.slow
def test_sampler_keeps_weights_in_place_while_the_train_step_gathers_them(tpu_run):
    """The embedded sampler on an fsdp mesh (tiny config, v5e:2x2, fsdp = 4) decodes with its
    weights where they lie: its loops all-gather activations ([Q, G, D] rows), never a parameter,
    so no device reads the whole model per token (what gathering the weights once per rollout would
    cost). The train step's layer loop does gather parameters (FSDP), which shows the check can see
    one. The samples come back split by rows over the mesh. Nor do the loops sum [rows, V] logits
    per token: they are computed and sampled split by vocabulary."""
    out = tpu_run["LOOPS"]
    shapes = {tuple(s) for s in out["params"]} | {tuple(s[1:]) for s in out["params"] if s}
    sampler = [tuple(g) for g in out["sampler"]]
    assert sampler, "the sampler's decode loops moved nothing: not an fsdp layout"
    assert not shapes & set(sampler), f"a parameter gathered per decode step: {sampler}"
    assert shapes & {tuple(g) for g in out["train_step"]}, out["train_step"]
    # tokens, logps, valid, finished by rows; the decode count and the row-steps replicated
    assert out["rows"] == ["P('fsdp',)"] * 4 + ["P()"] * 2
    # The logits split by vocabulary (sampler.vocab_split): no per-token sum of [rows, V] partial
    # logits, only per-row figures; with top-p (the gathered path) the sum is there, so the check
    # sees one.
    V = out["V"]
    assert not [s for s in out["sampler_sums"] if V in s], out["sampler_sums"]
    assert [s for s in out["top_p_sums"] if V in s], out["top_p_sums"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[str, ...]:
    """The overrides of LoRA's verdict and of the run that fits nowhere: a wider random model (768
    wide, 4 layers: weights over activations, so that LoRA's recipe fits where full fine-tuning does
    not), completions of 8 tokens and `SMALL`'s rows. Both compile the same programs of it (the
    whole batch and micro-batch 1, full and LoRA), each once in a session: the compilation cache
    holds them."""
    from tests.conftest import build_arith_model_dir

    model = build_arith_model_dir(tmp_path_factory.mktemp("wide") / "model", hidden=768, layers=4)
    return (
        f"model.init_checkpoint={model}",
        "model.warm_start=",
        "rollout.max_new_tokens=8",
        *SMALL,
    )


def _raw_cpu(*overrides: str, only: tuple[str, ...] = ()) -> dict:
    cfg = load_config(TINY, list(overrides))
    raw = {}
    for name, (fn, args) in programs.build(cfg, jax.devices("cpu")).programs.items():
        if only and name not in only:
            continue
        m = fn.lower(*args).compile().memory_analysis()
        raw[name] = {k: getattr(m, k) for k in dir(m) if k.endswith("_in_bytes")}
    return raw


def _peak(raw: dict, name: str) -> int:
    """A program's total plus the run's state beside it (tiny_cpu: params, AdamW, reference)."""
    m = raw[name]
    total = sum(m[a] for a in FIELDS.values() if a != "alias_size_in_bytes")
    return total - m["alias_size_in_bytes"] + m["generated_code_size_in_bytes"]


@pytest.mark.slow
def test_cpu_compile_finds_the_largest_micro_batch_that_fits(tmp_path):
    """`--compile-for cpu` goes the same way with XLA:CPU. The device memory is set between the
    update's peak at micro-batch 2 and at 4 (of M = 4 rows), measured here: the search must settle
    on 2 (the smallest tried first, then a bisection step) and say so, with figures equal to the
    compiler's own. The update's peak: the larger of the fused step's (it takes the reference) and
    the train step's with the reference beside it."""
    whole = _raw_cpu(*SMALL)
    m2 = _raw_cpu(*SMALL, "trainer.micro_batch=2", only=("train_step", "step"))
    beside = whole["ref_logps"]["argument_size_in_bytes"]  # the reference, alive during the update
    need = {
        m: max(_peak(r, "train_step") + beside, _peak(r, "step")) for m, r in ((4, whole), (2, m2))
    }
    assert need[2] < need[4]
    memory = (need[2] + need[4]) / 2 / 0.9  # 90% of a device is usable
    out = tmp_path / "report.json"
    code, stdout, stderr = plan(
        "--compile-for",
        "cpu",
        "--device-memory-gb",
        f"{memory / 1e9:.9f}",
        "--json",
        str(out),
        *SMALL,
    )
    assert code == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fits"] is False and report["micro_batch_found"] == 2
    assert report["tried"][:3] == [["trainer.micro_batch", m, m < 4] for m in (4, 1, 2)]
    assert "largest micro-batch that fits: trainer.micro_batch=2" in stdout
    assert "run with: mesh.data=1 mesh.fsdp=1 mesh.tensor=1 trainer.micro_batch=2" in stdout
    _check_against(report, whole)


def test_largest_fitting_bisects():
    sizes = [1, 2, 4, 8, 16, 32, 64]
    for limit in [0, 1, 3, 8, 63, 64]:
        calls = []

        def fits(m, limit=limit, calls=calls):
            calls.append(m)
            return m <= limit

        want = max((m for m in sizes if m <= limit), default=None)
        assert aot_fit.largest_fitting(sizes, fits, {64: limit >= 64}) == want
        assert len(calls) <= 4  # the smallest, then log2 of the rest
        assert 64 not in calls


def _one_error(res: tuple[int, str, str], exit_code: int, needle: str) -> None:
    """The command exited with `exit_code` and one `error: ` line holding `needle`, no traceback."""
    code, stdout, stderr = res
    assert code == exit_code, (stdout[-2000:], stderr[-2000:])
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], stderr[-2000:]
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_bad_tpu_input_is_one_clear_message(tpu_run):
    """A topology libtpu refuses, and a mesh that does not divide the target's devices."""
    _one_error(tpu_run["unknown"], 2, "--compile-for 'v9x:2x2': libtpu refused the topology")
    _one_error(tpu_run["mesh"], 2, "mesh.data=3")


def test_a_name_that_is_no_target_is_one_clear_message():
    _one_error(plan("--compile-for", "tpu-big"), 2, "--compile-for 'tpu-big': not a target")


@pytest.mark.slow
def test_nothing_that_fits_is_one_clear_message(wide):
    """Nothing fits in 1 MB per device, at any micro-batch, nor LoRA's recipe: one message naming
    the keys."""
    res = plan("--compile-for", "cpu", "--device-memory-gb", "0.001", *wide)
    _one_error(res, 1, "no trainer.micro_batch fits the train step")


def test_without_libtpu_the_message_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached libtpu there
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)  # none in the environment
    code, _, stderr = plan("--compile-for", "v5e:2x2")
    assert code == 2
    assert "needs libtpu" in stderr and "make libtpu" in stderr
    assert "Traceback" not in stderr


def test_libtpu_version_is_the_one_jax_pins():
    """The folder `make libtpu` fills is keyed by the version JAX's tpu extra asks for."""
    version = aot._libtpu_version()
    assert version and version.startswith("0.0.")
    assert aot.libtpu_cache_folder().name == "libtpu-" + version.replace("*", "x")


@pytest.mark.slow
def test_cpu_compile_of_packed_rows_is_within_15_percent_of_the_plan(tmp_path):
    """`trainer.pack=true` with R chosen from the data (tiny arith: prompts ~66 + solutions ~29
    tokens, two to a row of 224: R = 32 + 5% = 34 of M = 64): the plan prints R and L and
    counts the train step at R x L rows, within 15% of what XLA:CPU compiles for it (the padded
    config's plan is 0.88 of its compile too). On a device too small the search tries no
    micro-batch (packing has none) and says it does not fit."""
    pack = ("trainer.pack=true", "trainer.pack_len=224")
    code, stdout, stderr = plan(*pack)
    assert code == 0, stderr[-3000:]
    assert "packed rows: R=34 rows of L=224 tokens (53% of M=64)" in stdout
    assert "activations of 34 sequence(s) x 223 tokens" in stdout
    out = tmp_path / "report.json"
    code, stdout, stderr = plan(
        "--compile-for", "cpu", "--device-memory-gb", "0.1", *pack, "--json", str(out)
    )
    assert code == 1 and "these do not fit: train_step" in stderr, stderr[-3000:]
    assert "trainer.pack: R=34 rows of L=224 tokens" in stdout
    report = json.loads(out.read_text())
    assert report["tried"][0] == ["trainer.micro_batch", 64, False]
    assert [t for t in report["tried"] if t[0] == "trainer.micro_batch"] == [report["tried"][0]]
    step = next(p for p in report["programs"] if p["program"] == "train_step")
    assert 0.85 <= step["plan"] / step["peak"] <= 1.15, step


@pytest.mark.slow
def test_full_fine_tuning_that_fits_nowhere_gets_loras_compiled_verdict(tmp_path, wide):
    """Where full fine-tuning fits at no micro-batch, `--compile-for` compiles LoRA's recipe
    (`config_model.LORA_RECIPE`) and, when that fits, exits 0 naming its overrides: a one-chip
    user's verdict. The wider model (weights over activations) and a device sized between the two
    runs' smallest peaks, both measured here at micro-batch 1."""
    from cppo_jax.config.model import LORA_RECIPE

    def smallest_peak(*extra: str) -> int:
        out = tmp_path / "smallest.json"
        code, _, stderr = plan(
            "--compile-for", "cpu", "--no-search", *wide, *extra, "--json", str(out)
        )
        assert code == 0, stderr[-3000:]
        return json.loads(out.read_text())["run_peak"]

    full, lora = (
        smallest_peak("trainer.micro_batch=1"),
        smallest_peak(*LORA_RECIPE, "trainer.micro_batch=1"),
    )
    assert lora < full
    memory = (lora + full) / 2 / 0.9  # 90% of a device is usable
    out = tmp_path / "report.json"
    code, stdout, stderr = plan(
        "--compile-for",
        "cpu",
        "--device-memory-gb",
        f"{memory / 1e9:.9f}",
        *wide,
        "--json",
        str(out),
    )
    assert code == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fits"] is False and report["fit_overrides"] == ""
    found = report["lora"]
    assert found["fits"] or found["fit_overrides"]
    assert "verdict: full fine-tuning does not fit cpu; LoRA fits" in stdout
    assert f"run with: {' '.join(LORA_RECIPE)}" in stdout
    if not found["fits"]:
        assert f"trainer.micro_batch={found['micro_batch_found']}" in stdout.splitlines()[-1]
