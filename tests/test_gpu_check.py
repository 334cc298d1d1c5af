"""benchmarks/gpu_check.py runs at tiny shapes with only the GPU image's packages (issue #20).

The GPU machine has jax, flax, optax, orbax-checkpoint, transformers and numpy, but not grain, vllm,
math-verify or tensorboardX: the script runs here with those hidden from the import system, and its
JSON and markdown come out with every figure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING_ON_GPU_IMAGE = ("grain", "vllm", "math_verify", "tensorboardX")

RUNNER = """
import importlib.abc, runpy, sys
HIDDEN = {hidden!r}
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: not on the GPU image)")
        return None
sys.meta_path.insert(0, Hide())
sys.argv = ["gpu_check.py", "--quick", "--repeat", "1", "--out", {out!r}]
try:
    runpy.run_path({script!r}, run_name="__main__")
finally:
    print("IMPORTED", sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN))
"""


@pytest.mark.slow
def test_gpu_check_runs_without_the_packages_the_gpu_image_lacks(tmp_path):
    code = RUNNER.format(
        hidden=MISSING_ON_GPU_IMAGE,
        out=str(tmp_path),
        script=str(ROOT / "benchmarks" / "gpu_check.py"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **{
                k: v
                for k, v in os.environ.items()
                if k not in ("VLLM_PYTHON", "XLA_PYTHON_CLIENT_MEM_FRACTION")
            },
            "JAX_PLATFORMS": "cpu",
            "VLLM_PYTHON": str(tmp_path / "no-vllm" / "python"),
        },
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    # The install path: the launch's memory share set before JAX started, a CPU allowed in --quick,
    # no server environment here (recorded, not a failure).
    from cppo_jax.planning import memory as layout

    install = data["install"]
    assert install["ok"] and install["platform"] == "cpu"
    assert float(install["mem_fraction"]) == layout.USABLE_FRACTION
    assert "not checked" in install["vllm"] and install["planned_device_bytes"] is None
    assert [r["p"] for r in data["update"]] == [0.0, 0.875]
    full, pruned = data["update"]
    assert (full["rows"], pruned["rows"]) == (2 * 16, 2 * 2)  # Q = 2, k = G and k = 2
    for r in data["update"]:
        assert r["loss_finite"] and r["tokens_per_s"] > 0 and r["compile_s"] > 0
        assert r["mfu"] is None  # no known peak for a CPU: not made up
    einsum, xla, cudnn = data["attention"]
    assert einsum["attention"] == "einsum" and einsum["seconds"] > 0
    # Padded rows through jax.nn.dot_product_attention: every completion log-prob finite, within
    # the bf16 tolerance of einsum's.
    assert xla["ok"] and xla["nonfinite"] == 0 and 0 <= xla["worst"] <= 1
    assert "model.attention=cudnn needs an NVIDIA GPU" in cudnn["error"]  # recorded, not raised
    assert cudnn["ok"]  # off a GPU; on one, a cudnn that fails fails the check
    # One precision from sampler to loss: the sampler's log-probs are the training forward's.
    precision = data["precision"]
    assert precision["ok"] and precision["tokens"] == 2 * 16 * 16 and precision["worst"] <= 1
    assert data["sampler"]["tokens_per_s"] > 0
    assert data["memory"]["plan_train_peak"] > data["memory"]["plan_resident"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| update" in md and "Embedded sampler" in md and "Peak device memory" in md
    # The compiler's memory per program, as `plan --compile-for` prints it for TPUs.
    names = [r["name"] for r in data["programs"]]
    assert names == [
        "train_step p=0.0",
        "logps p=0.0",
        "train_step p=0.875",
        "logps p=0.875",
        "sampler",
    ]
    for r in data["programs"]:
        assert (
            r["total"]
            == r["arguments"] + r["outputs"] - r["aliased"] + r["temporaries"] + r["code"]
        )
        assert r["arguments"] > 0
    assert "Compiled memory per program" in md


def test_gpu_check_fails_when_jax_sees_no_gpu_and_names_the_install():
    from benchmarks.gpu_check import failures, install_row

    row = install_row(quick=False, fraction_note="")  # this machine: JAX on a CPU
    assert not row["ok"]
    (problem,) = failures({"install": row, "update": [], "attention": []})
    assert "no GPU" in problem and "make setup-gpu" in problem


def test_gpu_check_fails_on_a_nan_or_a_difference_over_the_tolerance():
    sys.path.insert(0, str(ROOT))
    from benchmarks import _gpu_numerics as numerics
    from benchmarks.gpu_check import failures

    ref = np.array([-1.0, -3.0, -10.0])
    eps = 2.0**-7  # bfloat16's
    tol = numerics.TOL_EPS * eps * (1 + np.abs(ref))
    assert numerics.worst(ref + 0.5 * tol, ref, "bfloat16")[1] == pytest.approx(0.5)
    assert numerics.worst(ref + 2 * tol, ref, "bfloat16")[1] == pytest.approx(2.0)
    good = {
        "update": [{"p": 0.0, "loss_finite": True}],
        "attention": [{"attention": "cudnn", "ok": True}],
        "precision": {"ok": True},
    }
    assert failures(good) == []
    bad = {
        "update": [{"p": 0.0, "loss_finite": False}],
        "attention": [{"attention": "cudnn", "ok": False, "nonfinite": 3}],
        "precision": {"ok": False, "worst": 2.0},
    }
    found = failures(bad)
    assert len(found) == 3 and "non-finite loss" in found[0] and "cudnn" in found[1]
