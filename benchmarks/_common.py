"""Helpers shared by the trainer benchmarks: the machine line, and one configuration per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_TAG = "RESULT "


def machine() -> dict:
    """CPU model, core count, OS, Python and JAX versions, and the JAX device kind."""
    import jax

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "device": jax.devices()[0].platform,
    }


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def machine_line(info: dict) -> str:
    return (
        f"- Machine: {info['cpu']}, os.cpu_count() = {info['cpu_count']}; {info['platform']}; "
        f"JAX {info['jax']} on {info['device']}; Python {info['python']}. 1-minute load average "
        f"{info['load_before']} before and {info['load_after']} after. **The machine was shared "
        "with other jobs during the run**, so absolute seconds are noisy; the ratios compare "
        "configurations measured in the same run."
    )


def emit(result: dict) -> None:
    """The child's answer to `run_child`: one tagged JSON line on stdout."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_child(script: Path, spec: dict, name: str) -> dict:
    """`script --one <spec>` in a fresh Python process (own peak memory, own compilations)."""
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")
    )
    proc = subprocess.run(
        [sys.executable, str(script), "--one", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_TAG))


def run_case(script: Path, case: dict, name: str) -> dict:
    """`run_child`, with a child that fails recorded as the case with its error's last line."""
    try:
        return run_child(script, case, name)
    except RuntimeError as e:
        return {**case, "failed": str(e).strip().splitlines()[-1][:300]}


def compile_cases_cli(doc: str, measure, argv: list[str] | None):
    """The command line of a benchmark that compiles each case in a child process: in the child
    (`--one SPEC`) run `measure(SPEC)` and answer; returns None there, else (the --out folder, made,
    and the machine's description with the load before)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        emit(measure(json.loads(args.one)))
        return None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out, {**machine(), "load_before": load_average()}


def quick_config(vocab_size: int):
    """The --quick smoke runs' model: a 1-layer Qwen2, hidden 32."""
    from cppo_jax.models import TransformerConfig

    return TransformerConfig(
        arch="qwen2",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )


def tiny_model_dir(out: Path) -> Path:
    """A random 1-layer Qwen2 (hidden 32) with the arith tokenizer, for the --quick smoke runs."""
    from cppo_jax.models import init_model, save_hf
    from cppo_jax.models.tokenizer import Tokenizer

    tokenizer = ROOT / "cppo_jax" / "assets" / "tiny_arith"
    cfg = quick_config(Tokenizer.from_dir(tokenizer).vocab_size)
    return save_hf(init_model(cfg, seed=0), out, tokenizer_dir=tokenizer)
