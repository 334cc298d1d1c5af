"""Full fine-tuning vs LoRA in miniature: CPPO (p = 0.875, allocation) on the tiny arith task.

The runs of `benchmarks/paper_table.py` (the shipped warm start, `configs/tiny_cpu.py`'s settings, one
pass over the same N training questions, held-out greedy and sampled accuracy, training CPU seconds
with the first step's compilation taken out), at one pruning rate, for full fine-tuning and LoRA at
each `--ranks` on every projection. LoRA's learning rate is `--lora-lr` (default 10x the full run's,
the ratio "LoRA Without Regret" (Thinking Machines, 2025) reports as LoRA's best) and its alpha
`--alpha` (32 at every rank, as there).

    python benchmarks/lora_table.py --seeds 0 1 2 --jobs 2   # the committed table
    python benchmarks/lora_table.py --quick --out /tmp/t      # a tiny random model: a smoke test

Writes `lora_table.md`, `lora_table.json` and `lora_table.png` to `--out` (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common, paper_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def run_one(spec: dict) -> dict:
    """One pass (paper_table.run_one) with `spec`'s LoRA rank (0: full) and learning rate."""
    from cppo_jax.config.model import LoraConfig

    base = paper_table.run_config

    def config(s):
        cfg = base(s)
        model = cfg.model
        if s["rank"]:
            lora = LoraConfig(enabled=True, rank=s["rank"], alpha=s["alpha"])
            model = dataclasses.replace(model, lora=lora)
        return dataclasses.replace(
            cfg, model=model, optim=dataclasses.replace(cfg.optim, lr=s["lr"])
        )

    paper_table.run_config = config
    try:
        out = paper_table.run_one(spec)
    finally:
        paper_table.run_config = base
    return dict(out, rank=spec["rank"], lr=spec["lr"])


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for rank in dict.fromkeys(r["rank"] for r in runs):
        sel = [r for r in runs if r["rank"] == rank]
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else float("nan")  # noqa: E731
        accs, sampled = [r["after"] for r in sel], [r["after_sampled"] for r in sel]
        rows.append(
            {
                "method": "full" if not rank else f"LoRA r = {rank}",
                "rank": rank,
                "lr": sel[0]["lr"],
                "seeds": [r["seed"] for r in sel],
                "accuracy": statistics.mean(accs),
                "accuracy_sd": sd(accs),
                "sampled": statistics.mean(sampled),
                "sampled_sd": sd(sampled),
                "train_cpu_s": statistics.mean(r["train_cpu_s"] for r in sel),
                "train_s": statistics.mean(r["train_s"] for r in sel),
                "steps": sel[0]["steps"],
            }
        )
    return rows


def write_markdown(path: Path, rows, runs, info, args) -> None:
    seeds = sorted({r["seed"] for r in runs})
    before = [r["before"] for r in runs if r["before"] is not None]
    lines = [
        f"# Full fine-tuning vs LoRA in miniature: CPPO p = {args.p:g} on the tiny arith task",
        "",
        f"Measured {info['date']} by `python benchmarks/lora_table.py"
        f"{' --quick' if args.quick else ''} --seeds {' '.join(map(str, seeds))}` in "
        f"{info['wall_min']:.1f} min.",
        "",
        _common.machine_line(info),
        f"- Start: {info['start']}"
        + (
            f"; held-out greedy accuracy before training {statistics.mean(before):.1%}."
            if before
            else "."
        ),
        f"- Each run: one pass over the same {args.num_train} training questions (CPPO with "
        f"allocation, G = {args.G}, b = {args.b}, p = {args.p:g}: {rows[0]['steps']} steps), the "
        f"settings of `configs/tiny_cpu.py` otherwise; accuracy on {runs[0]['test_n']} held-out "
        "questions after the pass (mean over seeds +- sample standard deviation). LoRA: adapters on "
        f"q, k, v, o, gate, up, down, alpha {args.alpha:g}, learning rate {args.lora_lr:g} "
        f"(full: {args.lr:g}). Training CPU s: the steps' CPU seconds of the run's process, the first "
        "step's compilation removed.",
        "",
        "| method | lr | steps | accuracy | sampled accuracy | training CPU s | CPU vs full | training s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    full = next((r for r in rows if not r["rank"]), rows[0])
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['lr']:g} | {r['steps']} | {r['accuracy']:.1%} +- "
            f"{r['accuracy_sd']:.1%} | {r['sampled']:.1%} +- {r['sampled_sd']:.1%} | "
            f"{r['train_cpu_s']:.1f} | {r['train_cpu_s'] / full['train_cpu_s']:.2f}x | "
            f"{r['train_s']:.1f} |"
        )
    lines += ["", *[f"- {n}" for n in args.notes]] if args.notes else []
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rank in dict.fromkeys(r["rank"] for r in runs):
        sel = [r for r in runs if r["rank"] == rank]
        label = "full" if not rank else f"LoRA r = {rank}"
        ax.scatter([r["train_cpu_s"] for r in sel], [r["after"] for r in sel], label=label)
    ax.set_xlabel("training CPU seconds (compilation removed)")
    ax.set_ylabel("held-out greedy accuracy after the pass")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny random model: a smoke test")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=None, help="default 8 32")
    parser.add_argument("--p", type=float, default=0.875)
    parser.add_argument("--lr", type=float, default=1e-4, help="full fine-tuning's (the demo's)")
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--note", dest="notes", action="append", default=[])
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one run
    args = parser.parse_args(argv)
    if args.one:
        _common.emit(run_one(json.loads(args.one)))
        return 0
    args.num_train, args.num_test = (8, 4) if args.quick else (640, 256)
    args.ranks = args.ranks or ([2] if args.quick else [8, 32])  # quick: a 32-wide model
    args.b, args.G, args.C = (2, 4, 8) if args.quick else (4, 16, 40)
    out = args.out or (Path(tempfile.mkdtemp(prefix="lora_table_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    info = _common.machine()
    info["date"] = datetime.date.today().isoformat()
    info["load_before"] = _common.load_average()
    work = Path(tempfile.mkdtemp(prefix="lora_table_work_"))
    model_dir = ""
    info["start"] = "the shipped warm start `cppo_jax/assets/tiny_arith` (0.85M parameters)"
    if args.quick:
        model_dir = str(_common.tiny_model_dir(work / "model"))
        info["start"] = "a random 1-layer model (quick mode)"
    specs = []
    for rank in [0, *args.ranks]:
        for seed in args.seeds:
            specs.append(
                {
                    "method": "CPPO",
                    "p": args.p,
                    "seed": seed,
                    "rank": rank,
                    "alpha": args.alpha,
                    "lr": args.lora_lr if rank else args.lr,
                    "num_train": args.num_train,
                    "num_test": args.num_test,
                    "b": args.b,
                    "G": args.G,
                    "C": args.C,
                    "model_dir": model_dir,
                    "evaluate_before": not specs,
                    "out_dir": str(work / "runs"),
                    "name": f"r{rank}_s{seed}",
                }
            )

    def one(spec):
        if args.quick:
            return run_one(spec)
        return _common.run_child(Path(__file__).resolve(), spec, spec["name"])

    runs = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=1 if args.quick else args.jobs) as pool:
        for future in concurrent.futures.as_completed([pool.submit(one, s) for s in specs]):
            r = future.result()
            runs.append(r)
            (out / "lora_table.json").write_text(json.dumps({"runs": runs, "info": info}) + "\n")
            print(
                f"rank {r['rank']:2d} seed {r['seed']}: accuracy {r['after']:.3f} (sampled "
                f"{r['after_sampled']:.3f}), {r['train_cpu_s']:.1f} CPU s",
                flush=True,
            )
    info["load_after"] = _common.load_average()
    info["wall_min"] = (time.perf_counter() - start) / 60
    (out / "lora_table.json").write_text(json.dumps({"runs": runs, "info": info}) + "\n")
    runs.sort(key=lambda r: (r["rank"], r["seed"]))
    rows = summarize(runs)
    write_markdown(out / "lora_table.md", rows, runs, info, args)
    write_plot(out / "lora_table.png", runs)
    print(f"wrote {out / 'lora_table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
