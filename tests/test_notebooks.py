"""The notebooks run top to bottom, headless, in quick mode; the committed files hold no outputs.

Each notebook runs in a fresh Jupyter kernel started from this interpreter (`sys.executable`, through a
kernelspec written to a temporary folder, so no installed kernelspec can swap in another Python), with
`CPPO_NOTEBOOK_QUICK=1` (a tiny random model, 2 steps), `TMPDIR` set to the test's temporary folder, and
XLA's backend optimisation off (`--xla_backend_optimization_level=0`) to cut compile time; none of that
changes what the cells compute.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ("quickstart.ipynb", "pruning_explained.ipynb")
ONE_CHIP = "one_chip.ipynb"  # installs from a source folder: its own first cell
KERNEL = "cppo-test-python"
CELL_TIMEOUT_S = 600


def _kernel_manager(kernels_dir: Path, tmp: Path) -> KernelManager:
    """A kernel manager whose only kernelspec runs ipykernel in this interpreter, in quick mode."""
    spec_dir = kernels_dir / KERNEL
    spec_dir.mkdir(parents=True, exist_ok=True)
    xla_flags = os.environ["XLA_FLAGS"]  # the suite's (tests/conftest.py: LLVM at -O0)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "cppo_jax tests",
        "language": "python",
        "env": {"CPPO_NOTEBOOK_QUICK": "1", "TMPDIR": str(tmp), "XLA_FLAGS": xla_flags},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(kernels_dir)])
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm)


def _execute(name: str, tmp_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    work = tmp_path / "cwd"
    work.mkdir()
    client = NotebookClient(
        nb,
        km=_kernel_manager(tmp_path / "kernels", tmp_path),
        timeout=CELL_TIMEOUT_S,
        startup_timeout=180,
        resources={"metadata": {"path": str(work)}},  # the kernel's working directory
    )
    client.execute(cleanup_kc=True)  # then shut the kernel down (nbclient keeps a given km's alive)
    return nb


def _outputs(nb) -> list[dict]:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def _text(nb) -> str:
    parts = []
    for out in _outputs(nb):
        if out.output_type == "stream":
            parts.append(out.text)
        for mime in ("text/plain", "text/markdown"):
            parts.append(str(out.get("data", {}).get(mime, "")))
    return "\n".join(parts)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for out in _outputs(nb))


def _check_ran(nb) -> None:
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "a cell did not run"
    errors = [out for out in _outputs(nb) if out.output_type == "error"]
    assert not errors, f"{errors[0].ename}: {errors[0].evalue}" if errors else ""
    assert _outputs(nb), "the notebook produced no output"


@pytest.mark.parametrize("name", [*NAMES, ONE_CHIP])
def test_committed_notebooks_have_no_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [], f"{name}: cell {i} is stored with outputs (strip them)"
        assert cell.execution_count is None, f"{name}: cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{name}: widget state stored in the metadata"


@pytest.mark.slow
def test_quickstart_runs_in_quick_mode(tmp_path):
    nb = _execute("quickstart.ipynb", tmp_path)
    _check_ran(nb)
    text = _text(nb)
    assert "quick mode: True" in text
    for needle in ("CPPO: G=4", "GRPO: Q=", "greedy test accuracy", "before:", "after:"):
        assert needle in text, needle
    assert "| questions per step |" in text  # the comparison table
    assert _images(nb) >= 2  # the CPPO curves; the comparison with GRPO
    # Quick mode wrote its runs under TMPDIR (the test's folder), not next to the notebook.
    assert not (tmp_path / "cwd" / "runs").exists()
    assert list(tmp_path.glob("cppo_quickstart_*/cppo/metrics.jsonl"))
    assert list(tmp_path.glob("cppo_quickstart_*/grpo/metrics.jsonl"))


@pytest.mark.slow
def test_one_chip_runs_end_to_end_in_quick_mode_and_names_the_one_chip_commands(tmp_path):
    """On a CPU in quick mode the one-chip notebook trains, evaluates and exports the tiny model; its
    cells name the one-chip plan and launch commands by config name."""
    source = "\n".join(c.source for c in nbformat.read(NOTEBOOKS / ONE_CHIP, as_version=4).cells)
    for name in ("gsm8k_1p5b_lora_one_chip", "gsm8k_0p5b_lora_one_chip", "gsm8k_0p5b_one_chip"):
        assert f"python -m cppo_jax.plan --config {name} --compile-for v5e:1x1" in source, name
    assert "python -m cppo_jax.launch --config gsm8k_1p5b_lora_one_chip model.path=" in source
    nb = _execute(ONE_CHIP, tmp_path)
    _check_ran(nb)
    text = _text(nb)
    assert "quick mode: True" in text and "nothing to do" in text
    assert "step 2: reward" in text and "greedy accuracy on 4 test questions" in text
    assert "model.safetensors" in text  # the export's files
    assert _images(nb) >= 1  # the live curves
    (run,) = tmp_path.glob("cppo_one_chip_*/one_chip")
    assert (run / "export" / "config.json").is_file() and (run / "summary.md").is_file()


def test_one_chip_picks_its_config_by_the_compilers_one_chip_table():
    """The memory each one-chip config needs, as the notebook holds it (NEED_GIB), is the run peak
    benchmarks/results/aot_one_chip.json compiled for that chip (v5e, v6e; the most of the GPUs),
    rounded up to 0.1 GiB, and None exactly where the compiler said it does not fit as configured."""
    import ast

    cells = nbformat.read(NOTEBOOKS / ONE_CHIP, as_version=4).cells
    tree = ast.parse("\n".join(c.source for c in cells if c.cell_type == "code"))
    (held,) = [
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "NEED_GIB"
    ]
    rows = json.loads((ROOT / "benchmarks/results/aot_one_chip.json").read_text())["rows"]
    table: dict[str, dict] = {name: {"v5e": None, "v6e": None, "gpu": None} for name in held}
    seen = set()
    for r in rows:
        chip = r["target"].split(":")[0]
        chip = chip if chip in ("v5e", "v6e") else "gpu"
        seen.add((r["config"], chip))
        if r["fits_as_configured"]:
            gib = round(r["run_peak"] / 2**30 + 0.05, 1)
            table[r["config"]][chip] = max(gib, table[r["config"]][chip] or 0)
    assert {(c, chip) for c in held for chip in ("v5e", "v6e", "gpu")} <= seen  # all compiled
    assert held == table
    assert list(held) == sorted(held, key=lambda c: ("0p5b" in c, "lora" in c))  # largest first


@pytest.mark.slow
def test_one_chip_install_cell_installs_the_source_folder_keeping_jax(tmp_path):
    """The one-chip notebook's first cell, forced on this machine in a dry run: pip is asked for the
    source folder itself (editable), with every installed jax* package pinned to its version."""
    import importlib.metadata
    import subprocess

    cell = _install_cell(ONE_CHIP)
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "CPPO_FORCE_INSTALL": "1",
        "CPPO_SOURCE": str(ROOT),
        "CPPO_PIP_ARGS": f"--dry-run --no-deps --no-build-isolation --report {report}",
    }
    ran = subprocess.run(
        [sys.executable, "-c", cell], env=env, capture_output=True, text=True, timeout=600
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    for pkg in ("jax", "jaxlib"):
        assert f"{pkg}=={importlib.metadata.version(pkg)}" in ran.stdout, ran.stdout
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "cppo_jax"
    assert item["download_info"]["url"] == ROOT.as_uri()
    assert item["download_info"]["dir_info"].get("editable") is True


@pytest.mark.slow
def test_pruning_explained_runs(tmp_path):
    nb = _execute("pruning_explained.ipynb", tmp_path)
    _check_ran(nb)
    text = _text(nb)
    assert "p = 0.875  k =  2   kept:" in text
    assert "| 1 | 0.875 | 2 | 8 | 16 | 16 | 128 |" in text  # the allocation table (b = 1)
    assert _images(nb) >= 2


def _install_cell(name: str) -> str:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
def test_install_cell_skips_an_installed_package_and_installs_the_wheel_keeping_jax(tmp_path):
    """The first cell of each notebook: nothing to do where cppo_jax imports (here, and what
    the executions above ran); on a fresh runtime it pip-installs CPPO_SOURCE (here the wheel that
    `make dist` builds, in a dry run) with every installed jax* package pinned to its version."""
    import importlib.metadata
    import subprocess

    cells = {name: _install_cell(name) for name in NAMES}
    assert len(set(cells.values())) == 1, "the notebooks' install cells differ"
    cell = cells[NAMES[0]]
    assert "make dist" in cell and "CPPO_SOURCE" in cell

    def run(**env):
        return subprocess.run(
            [sys.executable, "-c", cell],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=600,
        )

    skipped = run()
    assert skipped.returncode == 0 and "is installed: nothing to do" in skipped.stdout

    dist = tmp_path / "dist"
    made = subprocess.run(
        ["make", "-s", "dist", f"DIST={dist}"], cwd=ROOT, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr[-2000:]
    (wheel,) = dist.glob("cppo_jax-*.whl")
    report = tmp_path / "report.json"
    forced = run(
        CPPO_FORCE_INSTALL="1",
        CPPO_SOURCE=str(wheel),
        CPPO_PIP_ARGS=f"--dry-run --no-deps --report {report}",
    )
    assert forced.returncode == 0, forced.stderr[-2000:]
    for pkg in ("jax", "jaxlib"):  # the runtime's JAX, pinned
        assert f"{pkg}=={importlib.metadata.version(pkg)}" in forced.stdout, forced.stdout
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "cppo_jax" and item["download_info"]["url"].endswith(
        wheel.name
    )
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "cppo_jax/assets/tiny_arith/model.safetensors" in names  # the quick start's model
