"""`python -m cppo_jax.plan --compile-for TARGET`: a run's programs compiled without the target's devices.

The TPU compiles run in subprocesses: libtpu is loaded only there (it is installed outside the
environment by `make libtpu`, which `make test` runs), never into the suite's process. The tiny config
compiles in seconds; the paper configs are in benchmarks/results/aot_tpu.md.
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

from cppo_jax.config.files import load_config
from cppo_jax.planning import aot
from cppo_jax.planning import fit as aot_fit
from cppo_jax.train import programs

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.py")
FIELDS = {  # report key -> CompiledMemoryStats attribute
    "arguments": "argument_size_in_bytes",
    "outputs": "output_size_in_bytes",
    "donated": "alias_size_in_bytes",
    "temporaries": "temp_size_in_bytes",
}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_LIBRARY_PATH")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def plan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cppo_jax.plan", "--config", TINY, *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env=env or _env(), timeout=900
    )


# The compiler's own figures for the same programs, read without cppo_jax.planning.aot: programs.build on the
# target's devices, then jax's lower/compile/memory_analysis.
_RAW = textwrap.dedent(
    """
    import json, os, sys
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    from cppo_jax.planning import aot
    from cppo_jax.planning import fit as aot_fit
    from cppo_jax.train import programs
    from cppo_jax.config.schema import MeshConfig
    from cppo_jax.config.files import load_config
    import dataclasses
    target, mesh = sys.argv[1], json.loads(sys.argv[2])
    os.environ["TPU_LIBRARY_PATH"] = aot.libtpu_path()
    devices = topologies.get_topology_desc(target, platform="tpu").devices
    cfg = dataclasses.replace(load_config(sys.argv[3], []), mesh=MeshConfig(**mesh))
    out = {}
    for name, (fn, args) in programs.build(cfg, devices).programs.items():
        m = fn.lower(*args).compile().memory_analysis()
        out[name] = {k: getattr(m, k) for k in dir(m) if k.endswith("_in_bytes")}
    print("RAW " + json.dumps(out))
    """
)


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


def test_tpu_compile_of_a_tiny_run_reports_the_compilers_figures(tmp_path):
    out = tmp_path / "report.json"
    res = plan("--compile-for", "v5e:2x2", "--no-search", "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout
    assert "compiled for v5e:2x2: 4 x TPU v5 lite" in text
    for name in ("train_step", "ref_logps", "sampler"):
        assert f"  {name} " in text
    assert "fits: yes" in text
    # libtpu's warnings about a host without TPUs do not reach the user.
    assert "TPU_WORKER_HOSTNAMES" not in res.stderr and "libtpu" not in res.stderr.lower()
    report = json.loads(out.read_text())
    assert report["fits"] is True and report["device_kind"] == "TPU v5 lite"
    assert report["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}  # the plan's pick for 4 devices
    raw = subprocess.run(
        [sys.executable, "-c", _RAW, "v5e:2x2", json.dumps(report["mesh"]), TINY],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=900,
    )
    line = next(x for x in raw.stdout.splitlines() if x.startswith("RAW "))
    _check_against(report, json.loads(line[4:]))
    # FLOPs come from the model, per phase; the least time from the v5e datasheet figures.
    phases = {p["phase"]: p for p in report["phases"]}
    assert set(phases) == {"rollout", "ref_logps", "update"}
    assert all(p["flops"] > 0 and p["bound_s"] > 0 for p in phases.values())


# Which collectives run inside the compiled programs' loops, and on what shapes: HLO text parsed in the
# subprocess (the loop bodies are the computations reachable from a while's body=).
_LOOPS = textwrap.dedent(
    """
    import dataclasses, json, os, re, sys
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    from jax.experimental import topologies
    from cppo_jax.planning import aot
    from cppo_jax.train import programs
    from cppo_jax.config.schema import MeshConfig
    from cppo_jax.config.files import load_config
    os.environ["TPU_LIBRARY_PATH"] = aot.libtpu_path()
    devices = topologies.get_topology_desc("v5e:2x2", platform="tpu").devices
    cfg = dataclasses.replace(load_config(sys.argv[1], []), mesh=MeshConfig(data=1, fsdp=4, tensor=1))
    built = programs.build(cfg, devices)

    def loop_gathers(text, op="all-gather"):
        return [list(shape) for _, shape in aot.loop_collectives(text, op)]

    out = {"params": [list(x.shape) for x in jax.tree.leaves(built.programs["sampler"][1][0])]}
    for name in ("sampler", "train_step"):
        fn, args = built.programs[name]
        compiled = fn.lower(*args).compile()
        out[name] = loop_gathers(compiled.as_text())
        if name == "sampler":
            out["rows"] = [str(s.spec) for s in jax.tree.leaves(compiled.output_shardings)]
            out["sampler_sums"] = loop_gathers(compiled.as_text(), "all-reduce")
    # top-p: the logits gathered by vocabulary (sampler.vocab_split), summed per token
    cut = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, top_p=0.9))
    fn, args = programs.build(cut, devices).programs["sampler"]
    out["top_p_sums"] = loop_gathers(fn.lower(*args).compile().as_text(), "all-reduce")
    out["V"] = programs.model_config(cfg).vocab_size
    print("LOOPS " + json.dumps(out))
    """
)


def test_sampler_keeps_weights_in_place_while_the_train_step_gathers_them():
    """The embedded sampler on an fsdp mesh (tiny config, v5e:2x2, fsdp = 4) decodes with its
    weights where they lie: its loops all-gather activations ([Q, G, D] rows), never a parameter,
    so no device reads the whole model per token (what gathering the weights once per rollout would
    cost). The train step's layer loop does gather parameters (FSDP), which shows the check can see
    one. The samples come back split by rows over the mesh. Nor do the loops sum [rows, V] logits
    per token: they are computed and sampled split by vocabulary."""
    res = subprocess.run(
        [sys.executable, "-c", _LOOPS, TINY],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=900,
    )
    line = next((x for x in res.stdout.splitlines() if x.startswith("LOOPS ")), None)
    assert line is not None, res.stderr[-3000:]
    out = json.loads(line[6:])
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


def test_cpu_compile_finds_the_largest_micro_batch_that_fits(tmp_path):
    """`--compile-for cpu` goes the same way with XLA:CPU. The device memory is set between the
    update's peak at micro-batch 16 and at 32 (of 64 rows), measured here: the search must settle on
    16 and say so, with figures equal to the compiler's own. The update's peak: the larger of the
    fused step's (it takes the reference) and the train step's with the reference beside it."""
    whole = _raw_cpu()
    m32, m16 = (_raw_cpu(f"trainer.micro_batch={m}", only=("train_step", "step")) for m in (32, 16))
    beside = whole["ref_logps"]["argument_size_in_bytes"]  # the reference, alive during the update
    need = {
        m: max(_peak(r, "train_step") + beside, _peak(r, "step")) for m, r in ((32, m32), (16, m16))
    }
    assert need[16] < need[32]
    memory = (need[16] + need[32]) / 2 / 0.9  # 90% of a device is usable
    out = tmp_path / "report.json"
    res = plan(
        "--compile-for", "cpu", "--device-memory-gb", f"{memory / 1e9:.9f}", "--json", str(out)
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fits"] is False and report["micro_batch_found"] == 16
    assert report["tried"][0] == ["trainer.micro_batch", 64, False]
    assert "largest micro-batch that fits: trainer.micro_batch=16" in res.stdout
    assert "run with: mesh.data=1 mesh.fsdp=1 mesh.tensor=1 trainer.micro_batch=16" in res.stdout
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


@pytest.mark.parametrize(
    "args, exit_code, needle",
    [
        (["--compile-for", "v9x:2x2"], 2, "--compile-for 'v9x:2x2': libtpu refused the topology"),
        (["--compile-for", "tpu-big"], 2, "--compile-for 'tpu-big': not a target"),
        (["--compile-for", "v5e:2x2", "mesh.data=3"], 2, "mesh.data=3"),
        # Nothing fits in 1 MB per device, at any micro-batch: one message naming the keys.
        (
            ["--compile-for", "cpu", "--device-memory-gb", "0.001"],
            1,
            "no trainer.micro_batch fits the train step",
        ),
    ],
)
def test_bad_input_is_one_clear_message(args, exit_code, needle):
    res = plan(*args)
    assert res.returncode == exit_code, (res.stdout[-2000:], res.stderr[-2000:])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_without_libtpu_the_message_says_how_to_install_it(tmp_path):
    env = _env(XDG_CACHE_HOME=str(tmp_path))  # no cached libtpu there, none in the environment
    res = plan("--compile-for", "v5e:2x2", env=env)
    assert res.returncode == 2
    assert "needs libtpu" in res.stderr and "make libtpu" in res.stderr
    assert "Traceback" not in res.stderr


def test_libtpu_version_is_the_one_jax_pins():
    """The folder `make libtpu` fills is keyed by the version JAX's tpu extra asks for."""
    version = aot._libtpu_version()
    assert version and version.startswith("0.0.")
    assert aot.libtpu_cache_folder().name == "libtpu-" + version.replace("*", "x")


def test_cpu_compile_of_packed_rows_is_within_15_percent_of_the_plan(tmp_path):
    """`trainer.pack=true` with R chosen from the data (tiny arith: prompts ~66 + solutions ~29
    tokens, two to a row of 224: R = 32 + 5% = 34 of M = 64): the plan prints R and L and
    counts the train step at R x L rows, within 15% of what XLA:CPU compiles for it (the padded
    config's plan is 0.88 of its compile too). On a device too small the search tries no
    micro-batch (packing has none) and says it does not fit."""
    pack = ("trainer.pack=true", "trainer.pack_len=224")
    res = plan(*pack)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "packed rows: R=34 rows of L=224 tokens (53% of M=64)" in res.stdout
    assert "activations of 34 sequence(s) x 223 tokens" in res.stdout
    out = tmp_path / "report.json"
    res = plan("--compile-for", "cpu", "--device-memory-gb", "0.1", *pack, "--json", str(out))
    assert res.returncode == 1 and "these do not fit: train_step" in res.stderr, res.stderr[-3000:]
    assert "trainer.pack: R=34 rows of L=224 tokens" in res.stdout
    report = json.loads(out.read_text())
    assert report["tried"][0] == ["trainer.micro_batch", 64, False]
    assert [t for t in report["tried"] if t[0] == "trainer.micro_batch"] == [report["tried"][0]]
    step = next(p for p in report["programs"] if p["program"] == "train_step")
    assert 0.85 <= step["plan"] / step["peak"] <= 1.15, step


def test_full_fine_tuning_that_fits_nowhere_gets_loras_compiled_verdict(tmp_path):
    """Where full fine-tuning fits at no micro-batch, `--compile-for` compiles LoRA's recipe
    (`config_model.LORA_RECIPE`) and, when that fits, exits 0 naming its overrides: a one-chip
    user's verdict. A wider random model (768 wide, weights over activations) and a device sized
    between the two runs' smallest peaks, both measured here at micro-batch 1."""
    from cppo_jax.config.model import LORA_RECIPE
    from tests.conftest import build_arith_model_dir

    model = build_arith_model_dir(tmp_path / "wide", hidden=768, layers=4)
    base = (f"model.init_checkpoint={model}", "model.warm_start=", "rollout.max_new_tokens=8")

    def smallest_peak(*extra: str) -> int:
        out = tmp_path / "smallest.json"
        res = plan("--compile-for", "cpu", "--no-search", *base, *extra, "--json", str(out))
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(out.read_text())["run_peak"]

    full, lora = (
        smallest_peak("trainer.micro_batch=1"),
        smallest_peak(*LORA_RECIPE, "trainer.micro_batch=1"),
    )
    assert lora < full
    memory = (lora + full) / 2 / 0.9  # 90% of a device is usable
    out = tmp_path / "report.json"
    res = plan(
        "--compile-for",
        "cpu",
        "--device-memory-gb",
        f"{memory / 1e9:.9f}",
        *base,
        "--json",
        str(out),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fits"] is False and report["fit_overrides"] == ""
    found = report["lora"]
    assert found["fits"] or found["fit_overrides"]
    assert "verdict: full fine-tuning does not fit cpu; LoRA fits" in res.stdout
    assert f"run with: {' '.join(LORA_RECIPE)}" in res.stdout
    if not found["fits"]:
        assert f"trainer.micro_batch={found['micro_batch_found']}" in res.stdout.splitlines()[-1]
