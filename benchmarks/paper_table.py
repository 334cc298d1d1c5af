"""The paper's table in miniature: GRPO vs CPPO with allocation on the tiny arith task, one pass each.

Every run starts from the shipped warm start (`cppo_jax/assets/tiny_arith`) with the demo's settings
(`configs/tiny_cpu.py`: G = 16, b = 4 questions per GRPO step, 40 new tokens, mu = 1, beta = 0.04, the
demo's learning rate) and makes one pass over the same N training questions: GRPO (p = 0) in N / b
steps, CPPO with allocation at p in {0.5, 0.75, 0.875, 0.9375} in N / Q steps of Q = b / (1 - p)
questions, keeping k = G (1 - p) completions each. A matched-questions control (`--control-k k`) runs
GRPO with only k completions per question and the same Q as CPPO keeping k of G: the same questions
and trained completions per update, without the choice among G. Held-out accuracy is the trainer's
evaluation on the arith test split, greedy and one sample per question at the rollout temperature. Training time is the sum of the trainer's step times (`timing_s/step`: rollout to update), with
the first step's compilation taken out (its time minus the median step); evaluation is not counted.
Each run is its own process; `--jobs` of them run at a time (on a machine shared with other work,
parallel runs get a larger share of it; their CPU seconds, also reported, are disturbed less than
wall time).

    python benchmarks/paper_table.py --seeds 0 1 2 --jobs 2  # the committed table, ~1 h on 2 cores
    python benchmarks/paper_table.py --quick --out /tmp/t  # a tiny random model: a smoke test

Writes `paper_table.md` and `paper_table.png` (training reward and accuracy against training seconds)
to `--out` (default: benchmarks/results; with --quick a temporary folder unless --out is given).
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
if str(ROOT) not in sys.path:  # run from the checkout this file is in, not an installed copy
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BASE_CONFIG = ROOT / "configs" / "tiny_cpu.py"
CPPO_RATES = (0.5, 0.75, 0.875, 0.9375)
SAVED_ARGS = (
    "quick",
    "p",
    "seeds",
    "num_train",
    "num_test",
    "b",
    "G",
    "C",
    "control_k",
    "in_process",
    "jobs",
)


def run_config(spec: dict):
    """The demo config, changed to one pass over `num_train` questions at pruning rate `p`."""
    from cppo_jax.config.files import load_config

    cfg = load_config(BASE_CONFIG)
    model = cfg.model
    if spec.get("model_dir"):
        model = dataclasses.replace(model, init_checkpoint=spec["model_dir"], warm_start="")
    return dataclasses.replace(
        cfg,
        model=model,
        data=dataclasses.replace(cfg.data, num_train=spec["num_train"], num_test=spec["num_test"]),
        rollout=dataclasses.replace(cfg.rollout, max_new_tokens=spec["C"]),
        cppo=dataclasses.replace(
            cfg.cppo,
            num_generations=spec["G"],
            questions_per_step=spec["b"],
            pruning_rate=spec["p"],
            allocation=spec["p"] > 0,
        ),
        reward=dataclasses.replace(cfg.reward, num_workers=1),
        trainer=dataclasses.replace(
            cfg.trainer,
            steps=0,  # one pass over the training questions
            seed=spec["seed"],
            out_dir=spec["out_dir"],
            run_name=spec["name"],
            checkpoint_every=0,
        ),
        logging=dataclasses.replace(
            cfg.logging, progress=False, tensorboard=False, samples_per_log=0, plot=False
        ),
    )


def run_one(spec: dict) -> dict:
    """One pass of training; test accuracy (greedy and sampled) before (if asked) and after."""
    from cppo_jax.train.trainer import Trainer

    trainer = Trainer(run_config(spec))
    try:
        before = trainer.evaluate(0, sampled=True) if spec["evaluate_before"] else None
        history, cpu_s = [], []
        for step in range(trainer.num_steps):
            c0 = time.process_time()
            history.append(trainer.step(step))
            cpu_s.append(time.process_time() - c0)
        after = trainer.evaluate(trainer.num_steps, sampled=True)
        lr = trainer.cfg.optim.lr
    finally:
        trainer.close()
    sh = trainer.shapes
    steps_s = [m["timing_s/step"] for m in history]
    rest = steps_s[1:] or steps_s
    compile_s = max(0.0, steps_s[0] - statistics.median(rest))
    compile_cpu_s = max(0.0, cpu_s[0] - statistics.median(cpu_s[1:] or cpu_s))
    return {
        "method": spec["method"],
        "lr": lr,
        "p": spec["p"],
        "seed": spec["seed"],
        "G": sh.G,
        "Q": sh.Q,
        "k": sh.k,
        "steps": trainer.num_steps,
        "questions": trainer.num_steps * sh.Q,
        "kept_per_question": sorted({int(m["cppo/kept"]) // sh.Q for m in history}),
        "before": before and before["accuracy"],
        "before_sampled": before and before["sampled_accuracy"],
        "after": after["accuracy"],
        "after_sampled": after["sampled_accuracy"],
        "test_n": len(trainer.data.test_set),
        "step_s": steps_s,
        "compile_s": compile_s,
        "train_s": sum(steps_s) - compile_s,
        "cpu_s": cpu_s,
        "train_cpu_s": sum(cpu_s) - compile_cpu_s,
        "reward": [m["reward"] for m in history],
        "accuracy": [m.get("accuracy", float("nan")) for m in history],
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def summarize(runs: list[dict]) -> list[dict]:
    """One row per method: accuracy and time as mean (and spread) over seeds; speedup vs GRPO."""
    rows = []
    for method, p in dict.fromkeys((r["method"], r["p"]) for r in runs):  # in the runs' order
        sel = [r for r in runs if (r["method"], r["p"]) == (method, p)]
        accs = [r["after"] for r in sel]
        sampled = [r["after_sampled"] for r in sel]
        times = [r["train_s"] for r in sel]
        rows.append(
            {
                "method": method,
                "p": p,
                "G": sel[0]["G"],
                "k": sel[0]["k"],
                "Q": sel[0]["Q"],
                "steps": sel[0]["steps"],
                "questions": sel[0]["questions"],
                "seeds": [r["seed"] for r in sel],
                "accuracy": statistics.mean(accs),
                "accuracy_sd": statistics.stdev(accs) if len(accs) > 1 else None,
                "sampled": statistics.mean(sampled),
                "sampled_sd": statistics.stdev(sampled) if len(sampled) > 1 else None,
                "train_s": statistics.mean(times),
                "train_cpu_s": statistics.mean(r["train_cpu_s"] for r in sel),
                "compile_s": statistics.mean(r["compile_s"] for r in sel),
            }
        )
    grpo = next(r for r in rows if r["method"] == "GRPO")
    for r in rows:
        r["speedup"] = grpo["train_s"] / r["train_s"]
        r["speedup_cpu"] = grpo["train_cpu_s"] / r["train_cpu_s"]
    return rows


def write_markdown(path: Path, rows: list[dict], runs: list[dict], info: dict, args) -> None:
    flag = " --quick" if args.quick else ""
    before = [r["before"] for r in runs if r["before"] is not None]
    before_sampled = [r["before_sampled"] for r in runs if r["before_sampled"] is not None]
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        "# The paper's table in miniature: GRPO vs CPPO (with allocation) on the tiny arith task",
        "",
        f"Measured {info['date']} by `python benchmarks/paper_table.py{flag}"
        f"{' --seeds ' + ' '.join(map(str, seeds)) if seeds != [0] else ''}` in "
        f"{info['wall_min']:.1f} min.",
        "",
        _common.machine_line(info),
        f"- Start: {info['start']}; test accuracy before training: greedy "
        f"{statistics.mean(before):.1%}, sampled {statistics.mean(before_sampled):.1%} "
        f"({runs[0]['test_n']} held-out arith questions)."
        if before
        else f"- Start: {info['start']}.",
        f"- Training: the settings of `configs/tiny_cpu.py` (temperature 1, {args.C} new tokens, "
        f"mu = 1, beta = 0.04, AdamW {runs[0]['lr']:g} constant, reward = accuracy + format), G = "
        f"{args.G}, b = {args.b} questions per GRPO step; every run makes **one pass over the same "
        f"{args.num_train} training questions** (CPPO with allocation takes Q = b / (1 - p) per step, "
        "so fewer steps)"
        + (
            f"; the control `GRPO (G = {args.control_k})` samples only {args.control_k} completions "
            f"per question for Q = {_control_b(args)} questions per step: the questions and trained "
            "completions of CPPO keeping the same k of G, without the choice among G"
            if args.control_k
            else ""
        )
        + ". Sizes were cut to fit the time budget of one run on this machine: "
        f"{args.num_train} training questions, {runs[0]['test_n']} test questions, "
        f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))})"
        + ("; one seed only: three did not fit the time budget." if len(seeds) == 1 else ".")
        + " With so few questions, accuracy differences of a few points are within noise.",
        "- Accuracy: on the held-out arith test split after the pass, greedy and sampled (one "
        "completion per question at temperature 1, the same random numbers before and after)"
        + (" (mean over seeds, +- sample standard deviation)." if len(seeds) > 1 else "."),
        "- Training time: the sum of the trainer's step times (rollout, reward, reference, update), "
        "the first step's compilation removed (its time minus the median step); evaluation not "
        "counted. Speedup = GRPO's training time / this row's. Training CPU s: the same steps in "
        "CPU seconds of the run's process (`time.process_time`, all its threads; reward workers "
        "not counted), which other jobs on a shared machine disturb far less than wall time. "
        + (
            f"Each run is a fresh process; {args.jobs} ran at a time."
            if not args.in_process
            else "All runs in one process (quick mode)."
        ),
        "",
        "| method | G | p | k | Q | steps | accuracy | sampled accuracy | training time s | speedup | "
        "training CPU s | speedup (CPU) | compile s (excluded) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        acc, sampled = f"{r['accuracy']:.1%}", f"{r['sampled']:.1%}"
        if r["accuracy_sd"] is not None:
            acc += f" +- {r['accuracy_sd']:.1%}"
            sampled += f" +- {r['sampled_sd']:.1%}"
        lines.append(
            f"| {r['method']} | {r['G']} | {r['p']:g} | {r['k']} | {r['Q']} | {r['steps']} | {acc} | "
            f"{sampled} | "
            f"{r['train_s']:.1f} | {r['speedup']:.2f}x | {r['train_cpu_s']:.1f} | "
            f"{r['speedup_cpu']:.2f}x | {r['compile_s']:.1f} |"
        )
    if args.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in args.notes]
    path.write_text("\n".join(lines) + "\n")


def _control_b(args) -> int:
    """The control's questions per step: CPPO's Q when it keeps `control_k` of G (with allocation)."""
    from cppo_jax.algo.cppo import num_questions

    return num_questions(args.b, 1 - args.control_k / args.G, True)


def _label(r: dict) -> str:
    return r["method"] if r["p"] == 0 else f"CPPO p={r['p']:g}"


def _smooth(values: list[float], width: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - width + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def write_plot(path: Path, runs: list[dict], info: dict) -> None:
    import itertools

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    methods = dict.fromkeys(_label(r) for r in runs)
    colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for r in runs:
        # CPU seconds of training, compilation removed from the first step (as in the table).
        compile_cpu = max(0.0, r["cpu_s"][0] - statistics.median(r["cpu_s"][1:] or r["cpu_s"]))
        t = [x - compile_cpu for x in itertools.accumulate(r["cpu_s"])]
        width = max(1, len(t) // 8)
        label = f"{_label(r)} (seed {r['seed']})"
        c = colors[_label(r)]
        ax1.plot(t, _smooth(r["reward"], width), "-", color=c, label=label, marker=".")
        ax2.plot(t, _smooth(r["accuracy"], width), "-", color=c, label=label, marker=".")
        ax2.plot([t[-1]], [r["after"]], "*", color=c, markersize=12)
    ax1.set_xlabel("training CPU seconds (compilation removed)")
    ax1.set_ylabel("mean reward of the step's completions")
    ax2.set_xlabel("training CPU seconds (compilation removed)")
    ax2.set_ylabel("accuracy of the step's completions")
    ax1.set_title("Training reward (running mean over ~1/8 of the run)", fontsize=10)
    ax2.set_title("Training accuracy; star: held-out greedy accuracy after the pass", fontsize=10)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(args, raw: Path) -> tuple[list[dict], dict]:
    """Every run, one process each; raw results saved to `raw` as they come."""
    start = time.perf_counter()
    info = _common.machine()
    info["date"] = datetime.date.today().isoformat()
    info["load_before"] = _common.load_average()
    work = Path(tempfile.mkdtemp(prefix="paper_table_work_"))
    model_dir = ""
    info["start"] = "the shipped warm start `cppo_jax/assets/tiny_arith` (0.85M parameters)"
    if args.quick:
        model_dir = str(_common.tiny_model_dir(work / "model"))
        info["start"] = "a random 1-layer model (quick mode)"

    methods = [("GRPO", 0.0, args.G, args.b)]
    methods += [("CPPO", p, args.G, args.b) for p in args.p]
    if args.control_k:
        methods.append((f"GRPO (G = {args.control_k})", 0.0, args.control_k, _control_b(args)))
    specs = []
    for method, p, G, b in methods:  # the longest runs first
        for seed in args.seeds:
            specs.append(
                {
                    "method": method,
                    "p": p,
                    "seed": seed,
                    "num_train": args.num_train,
                    "num_test": args.num_test,
                    "b": b,
                    "G": G,
                    "C": args.C,
                    "model_dir": model_dir,
                    "evaluate_before": not specs,
                    "out_dir": str(work / "runs"),
                    "name": f"{method.split()[0]}_G{G}_p{p:g}_s{seed}",
                }
            )

    def one(spec: dict) -> dict:
        if args.in_process:
            return run_one(spec)
        return _common.run_child(Path(__file__).resolve(), spec, spec["name"])

    runs = []
    jobs = 1 if args.in_process else args.jobs
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, spec) for spec in specs]
        for future in concurrent.futures.as_completed(futures):
            r = future.result()
            runs.append(r)
            saved = dict(info, args={k: getattr(args, k) for k in SAVED_ARGS})
            raw.write_text(json.dumps({"runs": runs, "info": saved}, indent=1) + "\n")
            print(
                f"{r['method']:<12} p={r['p']:<6g} seed={r['seed']} Q={r['Q']:3d} k={r['k']:2d} steps={r['steps']:3d}: "
                f"accuracy {r['after']:.3f} (sampled {r['after_sampled']:.3f}), training {r['train_s']:.1f}s "
                f"({r['train_cpu_s']:.1f} CPU s; compile {r['compile_s']:.1f}s)",
                flush=True,
            )
    info["load_after"] = _common.load_average()
    info["wall_min"] = (time.perf_counter() - start) / 60
    saved = dict(info, args={k: getattr(args, k) for k in SAVED_ARGS})
    raw.write_text(json.dumps({"runs": runs, "info": saved}, indent=1) + "\n")
    return runs, info


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny random model: a smoke test")
    parser.add_argument("--out", type=Path, default=None, help="folder for paper_table.md/.png")
    parser.add_argument("--p", type=float, nargs="*", default=None, help="CPPO pruning rates")
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--num-train", type=int, default=None, help="training questions")
    parser.add_argument("--num-test", type=int, default=None, help="held-out questions")
    parser.add_argument("--b", type=int, default=None, help="questions per GRPO step")
    parser.add_argument("--G", type=int, default=None)
    parser.add_argument("--C", type=int, default=None, help="new tokens per completion")
    parser.add_argument(
        "--control-k",
        type=int,
        default=None,
        help="GRPO with this many completions per question, Q matched to CPPO keeping k of G (0: off)",
    )
    parser.add_argument("--note", dest="notes", action="append", default=[], help="a notes line")
    parser.add_argument("--in-process", action="store_true", help="all runs in this process")
    parser.add_argument("--jobs", type=int, default=5, help="runs (processes) at a time")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the .md/.png from the raw paper_table.json in --out (no training)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one run
    args = parser.parse_args(argv)
    if args.one:
        _common.emit(run_one(json.loads(args.one)))
        return []
    args.p = args.p or ([0.5] if args.quick else list(CPPO_RATES))
    args.seeds = args.seeds or [0]
    args.num_train = args.num_train or (8 if args.quick else 640)
    args.num_test = args.num_test or (4 if args.quick else 256)
    args.b = args.b or (2 if args.quick else 4)
    args.G = args.G or (4 if args.quick else 16)
    args.C = args.C or (8 if args.quick else 40)
    if args.control_k is None:
        args.control_k = 2
    if args.quick:
        args.in_process = True
    for p in args.p:
        from cppo_jax.algo.cppo import num_questions

        Q = num_questions(args.b, p, True)
        if args.num_train % Q:
            raise ValueError(f"--num-train {args.num_train} is not a multiple of Q = {Q} (p = {p})")
    if args.control_k and args.num_train % _control_b(args):
        raise ValueError(f"--num-train {args.num_train} is not a multiple of the control's Q")
    out = args.out or (Path(tempfile.mkdtemp(prefix="paper_table_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)

    raw = out / "paper_table.json"
    if args.report_only:
        saved = json.loads(raw.read_text())
        runs, info = saved["runs"], saved["info"]
        for k, v in info.pop("args").items():
            setattr(args, k, v)
        info.setdefault("load_after", "n/a")
        info.setdefault("wall_min", float("nan"))
    else:
        runs, info = measure(args, raw)
    runs.sort(key=lambda r: (r["method"] != "GRPO", r["G"] != args.G, r["p"], r["seed"]))
    rows = summarize(runs)
    write_markdown(out / "paper_table.md", rows, runs, info, args)
    write_plot(out / "paper_table.png", runs, info)
    print(f"wrote {out / 'paper_table.md'} and {out / 'paper_table.png'}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
