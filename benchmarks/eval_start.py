"""Time to the first training step with gsm8k_1p5b's evaluation settings, on the tiny rehearsal:
the whole test split evaluated before step 1 (`trainer.eval_subset=0`, what every run did before
the subset) against the default sample (`trainer.eval_subset` 256), side by side in one run.

The rehearsal is `configs/tiny_cpu.py` (the shipped tiny arith model, the embedded sampler) with
gsm8k_1p5b's evaluation settings: a test split of 1,319 questions (GSM8K's), completions of up to
1,024 tokens, greedy and sampled evaluations before training in batches of 64, one training step.
Each case runs in a fresh process (`--one`), cases interleaved over `--rounds`; from `train()` being
called to the first step beginning (the first step's end, from the progress callback, less its own
`timing_s/step`): the evaluations before training, plus the weight push and a validation (none here).
Each case stops after its first step (the evaluation after training is not part of what is timed).

    python benchmarks/eval_start.py              # benchmarks/results/eval_start.md
    python benchmarks/eval_start.py --quick --out /tmp/e   # 40 test questions, 64 tokens, subset 8
"""

from __future__ import annotations

import argparse
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

from benchmarks import _common  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FULL = {"num_test": 1319, "max_new_tokens": 1024}  # gsm8k_1p5b: GSM8K's test split, its C
QUICK = {"num_test": 40, "max_new_tokens": 64}


class _FirstStepDoneError(Exception):
    pass


def run_one(spec: dict) -> dict:
    from cppo_jax.config.files import load_config
    from cppo_jax.train.trainer import Trainer

    cfg = load_config(
        "tiny_cpu",
        [
            f"data.num_test={spec['num_test']}",
            f"rollout.max_new_tokens={spec['max_new_tokens']}",
            f"trainer.eval_subset={spec['eval_subset']}",
            "trainer.steps=1",
            f"trainer.out_dir={spec['out_dir']}",
            f"trainer.run_name={spec['name']}",
            "trainer.compile_cache_dir=none",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.plot=false",
        ],
    )
    trainer = Trainer(cfg)
    seen = {}

    def progress(metrics):  # the first step is what is timed: stop there (no final evaluation)
        seen.update(first_step_end=time.perf_counter(), step_s=metrics["timing_s/step"])
        raise _FirstStepDoneError

    try:
        t0 = time.perf_counter()
        trainer.train(progress=progress)
    except _FirstStepDoneError:
        pass
    finally:
        trainer.close()
    (before,) = trainer.evals  # the evaluation before step 1
    return {
        "eval_subset": spec["eval_subset"],
        "to_first_step_s": seen["first_step_end"] - seen["step_s"] - t0,
        "first_step_s": seen["step_s"],
        "questions_before": before["n"],
        "split_n": before["split_n"],
        "accuracy_before": before["accuracy"],
    }


def write_markdown(path: Path, rows: list[dict], info: dict, sizes: dict, rounds: int) -> None:
    by = {
        k: [r for r in rows if r["eval_subset"] == k]
        for k in dict.fromkeys(r["eval_subset"] for r in rows)
    }
    med = {k: statistics.median(r["to_first_step_s"] for r in v) for k, v in by.items()}
    whole, sample = list(by)
    lines = [
        "# Time to the first training step: evaluation before training, whole split vs a sample",
        "",
        f"Measured {info['date']} by `python benchmarks/eval_start.py` in {info['minutes']:.1f} min.",
        "",
        _common.machine_line(info),
        f"- The tiny rehearsal of gsm8k_1p5b's evaluation settings: configs/tiny_cpu.py (the shipped "
        f"tiny arith model, embedded sampler) with a test split of {sizes['num_test']} questions and "
        f"completions of up to {sizes['max_new_tokens']} tokens; greedy and sampled evaluations "
        "before training (batches of 64), then one step. Seconds from `train()` to the first step's "
        f"start, each case a fresh process, compilation cache off; median of {rounds} round(s).",
        "",
        "| trainer.eval_subset | questions evaluated before step 1 | to the first step s | "
        "first step s | vs whole split |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k, v in by.items():
        label = f"{k} (the whole split: before)" if k == 0 else f"{k} (the default: after)"
        lines.append(
            f"| {label} | {v[0]['questions_before']} of {v[0]['split_n']} | {med[k]:.1f} | "
            f"{statistics.median(r['first_step_s'] for r in v):.1f} | {med[k] / med[whole]:.2f}x |"
        )
    lines += [
        "",
        f"Time to the first step {med[whole] / med[sample]:.1f}x shorter with the sample; the "
        "evaluation after training still scores the whole split (and the sample within it).",
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="40 test questions, 64 tokens, subset 8")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one case
    args = ap.parse_args(argv)
    if args.one is not None:
        _common.emit(run_one(json.loads(args.one)))
        return []
    sizes = QUICK if args.quick else FULL
    subsets = (0, 8) if args.quick else (0, 256)
    t0 = time.perf_counter()
    info = {**_common.machine(), "load_before": _common.load_average()}
    rows = []
    with tempfile.TemporaryDirectory(prefix="eval_start_") as work:
        for r in range(args.rounds):
            for k in subsets:
                spec = {**sizes, "eval_subset": k, "out_dir": work, "name": f"s{k}_r{r}"}
                rows.append(_common.run_child(Path(__file__), spec, f"eval_subset={k}"))
    info.update(
        load_after=_common.load_average(),
        minutes=(time.perf_counter() - t0) / 60,
        date=datetime.date.today().isoformat(),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval_start.json").write_text(json.dumps({"rows": rows, "info": info}) + "\n")
    write_markdown(args.out / "eval_start.md", rows, info, sizes, args.rounds)
    return rows


if __name__ == "__main__":
    main()
