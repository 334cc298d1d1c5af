"""Phase speedup: where a GRPO / CPPO step spends its time, p from 0 to 0.9375, allocation off then on.

A fixed Qwen2 model of about 20M parameters (hidden 512, 6 layers, 8 query / 2 key-value heads of 64,
MLP 1792, the arith tokenizer's 462-token vocabulary, tied embeddings) with random weights, saved as a
Hugging Face folder and trained by the real `Trainer` on arith prompts (padded to 72 slots): G = 16,
b questions per step, completions of a fixed C new tokens (random weights almost never sample EOS, and
every shape is static: rollout decodes C positions and training runs on P + C slots whatever the
contents), the paper's mu = 2 and beta = 0.04, so every step has all five phases: rollout, reward,
reference log-probs, old-policy log-probs and mu updates.

Each configuration runs in its own process (so its peak resident memory is its own): `--warmup` steps
that compile, then `--steps` measured steps whose medians are reported (the trainer's `timing_s/*`).
The training phase is reference + old-policy + update; since the step after rewards is one program
(`update_program`, issue #35) the reference and old-policy columns are 0 and their forwards are in
update. Its speedup over GRPO is compared with the ideal
G/k; with allocation the training batch stays b * G sequences, so the per-question speedup is the one
that can approach G/k.

Every phase is timed twice: wall seconds (the trainer's `timing_s/*`) and CPU seconds of the process
around the phase's device calls, the figure to compare on a machine shared with other work.

    python benchmarks/phase_speedup.py                    # the full sweep, one configuration at a time
    python benchmarks/phase_speedup.py --allocation off --jobs 5   # p sweep without allocation, 5 at once
    python benchmarks/phase_speedup.py --quick --out /tmp/p  # tiny sizes: a smoke test

The committed results came from `--allocation off --jobs 5`, then `--allocation on --p 0.5 0.875
--jobs 2 --model-dir <the same model> --out <dir>`, joined by `--report-only --merge <dir>/...json`.

Writes `phase_speedup.md` (tables, the machine, notes) and `phase_speedup.png` to `--out` (default:
benchmarks/results; with --quick a temporary folder unless --out is given).
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
TOKENIZER = ROOT / "cppo_jax" / "assets" / "tiny_arith"
PRUNING_RATES = (0.0, 0.5, 0.75, 0.875, 0.9375)
TARGET_P, TARGET_SPEEDUP = 0.875, 7.0  # issue #20: at least 7x of the ideal 8x
PHASES = ("rollout", "reward", "ref_logps", "old_logps", "update")
TRAINING = ("ref_logps", "old_logps", "update")
SAVED_ARGS = (
    "quick",
    "p",
    "b",
    "G",
    "C",
    "mu",
    "beta",
    "warmup",
    "steps",
    "in_process",
    "jobs",
    "allocation",
    "rounds",
)


def model_config(quick: bool):
    from cppo_jax.models import TransformerConfig
    from cppo_jax.models.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(TOKENIZER).vocab_size
    if quick:
        return _common.quick_config(vocab)
    return TransformerConfig(
        arch="qwen2",
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1792,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )


def build_model(out: Path, quick: bool) -> tuple[Path, int]:
    """A random model with the arith tokenizer as a Hugging Face folder; returns (folder, params)."""
    import jax
    from flax import nnx

    from cppo_jax.models import init_model, save_hf

    model = init_model(model_config(quick), seed=0)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return save_hf(model, out, tokenizer_dir=TOKENIZER), int(params)


def count_params(quick: bool) -> int:
    import jax
    from flax import nnx

    from cppo_jax.models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(model_config(quick), rngs=nnx.Rngs(0)))
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))))


def bench_config(spec: dict):
    """The trainer config of one measured configuration (`spec` from `main`)."""
    from cppo_jax.config.model import ModelConfig
    from cppo_jax.config.run import LoggingConfig, TrainerConfig
    from cppo_jax.config.schema import (
        Config,
        CPPOConfig,
        DataConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
    )

    steps = spec["warmup"] + spec["steps"]
    return Config(
        model=ModelConfig(init_checkpoint=spec["model_dir"]),
        data=DataConfig(
            task="arith", max_prompt_len=72, num_train=max(64, 32 * steps * spec["b"]), num_test=8
        ),
        rollout=RolloutConfig(max_new_tokens=spec["C"], temperature=1.0),
        cppo=CPPOConfig(
            num_generations=spec["G"],
            questions_per_step=spec["b"],
            pruning_rate=spec["p"],
            allocation=spec["allocation"],
            mu=spec["mu"],
            beta=spec["beta"],
        ),
        reward=RewardConfig(num_workers=1),
        optim=OptimConfig(lr=1e-6, schedule="constant", warmup_ratio=0.0),
        trainer=TrainerConfig(steps=steps, out_dir=spec["out_dir"], run_name=spec["name"]),
        logging=LoggingConfig(progress=False, tensorboard=False, samples_per_log=0, plot=False),
    )


def instrument_cpu(trainer) -> dict:
    """Wrap the trainer's device calls to add each one's CPU seconds (`time.process_time`: all of
    this process's threads, XLA's included) to the returned dict under its phase name.

    Every wrapped call blocks until its result is ready, as the trainer does right after it, so the
    work is counted in its phase. Reward workers are other processes and are not counted.
    """
    import jax

    cpu: dict[str, float] = {}

    def timed(fn, phase_of):
        def call(*args):
            c0 = time.process_time()
            out = jax.block_until_ready(fn(*args))
            name = phase_of(*args)
            cpu[name] = cpu.get(name, 0.0) + time.process_time() - c0
            return out

        return call

    trainer.rollout.backend.generate = timed(trainer.rollout.backend.generate, lambda *a: "rollout")
    trainer.host.rewards.score = timed(trainer.host.rewards.score, lambda *a: "reward")
    if trainer.reference is not None:  # beta > 0
        trainer.reference = dataclasses.replace(
            trainer.reference, logps=timed(trainer.reference.logps, lambda *a: "ref_logps")
        )
    # The fused step (`update_program`, the default) runs pruning, the reference's and the
    # old policy's forwards and the updates in one program: all of it counts as "update".
    fused = trainer.actor.fused
    trainer.actor = dataclasses.replace(
        trainer.actor,
        logps=timed(trainer.actor.logps, lambda *a: "old_logps"),
        train_step=timed(trainer.actor.train_step, lambda *a: "update"),
        fused=fused._replace(update=timed(fused.update, lambda *a: "update")),
    )
    return cpu


def run_one(spec: dict) -> dict:
    """Build the trainer, run warm-up then measured steps; medians per phase and peak memory."""
    import resource

    from cppo_jax.train.trainer import Trainer

    trainer = Trainer(bench_config(spec))
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cpu = instrument_cpu(trainer)
    history, cpu_steps = [], []
    try:
        for step in range(spec["warmup"] + spec["steps"]):
            cpu.clear()
            c0 = time.process_time()
            history.append(trainer.step(step))
            cpu["step"] = time.process_time() - c0
            cpu_steps.append(dict(cpu))
    finally:
        trainer.close()
    measured = history[spec["warmup"] :]
    sh = trainer.shapes
    med = {ph: statistics.median(m.get(f"timing_s/{ph}", 0.0) for m in measured) for ph in PHASES}
    med["step"] = statistics.median(m["timing_s/step"] for m in measured)
    cpu_med = {
        ph: statistics.median(c.get(ph, 0.0) for c in cpu_steps[spec["warmup"] :])
        for ph in (*PHASES, "step")
    }
    return {
        "p": spec["p"],
        "allocation": spec["allocation"],
        "Q": sh.Q,
        "G": sh.G,
        "k": sh.k,
        "M": sh.M,
        "kept_per_question": [int(m["cppo/kept"]) // sh.Q for m in measured],
        "times": med,
        "cpu": cpu_med,
        "step_times": [m["timing_s/step"] for m in measured],
        "steps_times": [
            {ph: m.get(f"timing_s/{ph}", 0.0) for ph in (*PHASES, "step")} for m in measured
        ],
        "steps_cpu": [
            {ph: c.get(ph, 0.0) for ph in (*PHASES, "step")} for c in cpu_steps[spec["warmup"] :]
        ],
        "mean_length": statistics.mean(m["completions/mean_length"] for m in measured),
        "max_length": max(m["completions/max_length"] for m in measured),
        "compiles_while_measured": measured[-1]["jit/compilations"]
        - history[spec["warmup"] - 1]["jit/compilations"]
        if spec["warmup"]
        else float("nan"),
        "rss_built_mib": rss_built,
        "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def training_s(r: dict, clock: str = "times") -> float:
    return sum(r[clock][ph] for ph in TRAINING)


def add_ratios(rows: list[dict]) -> None:
    """Training-phase speedups against GRPO (the p = 0 row), per step and per question, and the
    rollout's share of the step; by wall clock (`times`) and by CPU seconds (`cpu`)."""
    grpo = next(r for r in rows if r["p"] == 0.0)
    for r in rows:
        r["ideal"] = r["G"] / r["k"]
        for clock in ("times", "cpu"):
            if clock not in r:
                continue
            if "rounds" in r and "rounds" in grpo:  # each round against the same round's GRPO
                r[f"{clock}_round_speedups"] = [
                    training_s(g, clock) / training_s(m, clock)
                    for g, m in zip(grpo["rounds"], r["rounds"])
                ]
            base, mine = training_s(grpo, clock), training_s(r, clock)
            r[f"{clock}_training"] = mine
            r[f"{clock}_speedup_step"] = base / mine
            r[f"{clock}_speedup_question"] = (base / grpo["Q"]) / (mine / r["Q"])
            r[f"{clock}_rollout_share"] = r[clock]["rollout"] / r[clock]["step"]
        # The names the tests and the plot use: wall clock.
        r["training_s"] = r["times_training"]
        r["speedup_step"] = r["times_speedup_step"]
        r["speedup_question"] = r["times_speedup_question"]
        r["rollout_share"] = r["times_rollout_share"]


def _verdict(r: dict, clock: str) -> str:
    if r["allocation"] or r["p"] != TARGET_P:
        return ""
    met = r[f"{clock}_speedup_step"] >= TARGET_SPEEDUP
    return f" **target >= {TARGET_SPEEDUP:.0f}x: {'met' if met else 'MISSED'}**"


def _phase_table(rows: list[dict], clock: str, unit: str) -> list[str]:
    lines = [
        f"| allocation | p | Q | k | kept M | rollout {unit} | reward {unit} | reference {unit} | "
        f"old-policy {unit} | update {unit} | training {unit} | step {unit} | "
        "training speedup / step | training speedup / question | ideal G/k | "
        "generation share | peak RSS MiB (after build) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if clock not in r:
            continue
        t = r[clock]
        lines.append(
            f"| {'on' if r['allocation'] else 'off'} | {r['p']:g} | {r['Q']} | {r['k']} | {r['M']} | "
            f"{t['rollout']:.2f} | {t['reward']:.3f} | {t['ref_logps']:.2f} | {t['old_logps']:.2f} | "
            f"{t['update']:.2f} | {r[clock + '_training']:.2f} | {t['step']:.2f} | "
            f"{r[clock + '_speedup_step']:.2f}x{_verdict(r, clock)} | "
            f"{r[clock + '_speedup_question']:.2f}x | {r['ideal']:g}x | "
            f"{r[clock + '_rollout_share']:.0%} | "
            f"{r['rss_peak_mib']:,.0f} ({r['rss_built_mib']:,.0f}) |"
        )
    return lines


def write_markdown(path: Path, rows: list[dict], info: dict, args) -> None:
    flag = " --quick" if args.quick else ""
    if not args.quick and args.p != list(PRUNING_RATES):
        flag += " --p " + " ".join(f"{p:g}" for p in args.p)
    if not args.quick:
        for name, default in (("b", 1), ("G", 16), ("C", 16), ("mu", 2), ("beta", 0.04)):
            if getattr(args, name) != default:
                flag += f" --{name} {getattr(args, name):g}"
    if args.allocation != "both":
        flag += f" --allocation {args.allocation}"
    for name, default in (("warmup", 1), ("steps", 2)):
        if not args.quick and getattr(args, name) != default:
            flag += f" --{name} {getattr(args, name)}"
    if args.jobs != 1:
        flag += f" --jobs {args.jobs}"
    rounds = getattr(args, "rounds", 1)
    if rounds != 1:
        flag += f" --rounds {rounds}"
    grpo = next(r for r in rows if r["p"] == 0.0)
    target = next((r for r in rows if r["p"] == TARGET_P and not r["allocation"]), None)
    has_cpu = all("cpu" in r for r in rows)
    lines = [
        "# Phase speedup: GRPO vs CPPO, per phase",
        "",
        f"Measured {info['date']} by `python benchmarks/phase_speedup.py{flag}`"
        + (f" in {info['wall_min']:.1f} min." if info["wall_min"] == info["wall_min"] else "."),
        "",
        _common.machine_line(info),
        f"- Model: qwen2, hidden {info['model'].hidden_size}, {info['model'].num_layers} layers, "
        f"{info['model'].num_heads} heads ({info['model'].num_kv_heads} key/value) of "
        f"{info['model'].head_dim}, MLP {info['model'].intermediate_size}, vocabulary "
        f"{info['model'].vocab_size}, tied embeddings, **{info['params'] / 1e6:.1f}M parameters**, "
        "float32, random weights.",
        f"- Work per step: b = {args.b} question(s) (Q = floor(b / (1 - p)) with allocation), "
        f"G = {args.G}, arith prompts padded to 72 slots, C = {args.C} new tokens (temperature 1; mean "
        f"completion length {statistics.mean(r['mean_length'] for r in rows):.1f} of {args.C}: random "
        "weights rarely sample EOS, and every shape is static), mu = "
        f"{args.mu} updates, beta = {args.beta} (so reference and old-policy log-probs are computed), "
        "AdamW on the real `Trainer`.",
        f"- Each configuration is a fresh process: {args.warmup} warm-up step(s) (compilation), then "
        f"the **median of {args.steps} measured steps**"
        + (
            f", in {rounds} rounds (every configuration once per round, one after the other; the "
            f"medians pool the {rounds * args.steps} measured steps of the rounds, and each round's "
            "speedup is against that round's GRPO)"
            if rounds > 1
            else ""
        )
        + ". XLA compilations during measured steps: "
        f"{sorted({int(r['compiles_while_measured']) for r in rows})} (0 = none). Peak memory is the "
        "process's peak resident set (`getrusage(RUSAGE_SELF).ru_maxrss`): JAX runtime, policy, "
        "reference copy, AdamW state and step buffers; 'after build' is the same figure before the "
        "first step.",
        "- Training phase = reference + old-policy log-probs + the mu updates. Speedup per step = "
        "GRPO's training time / this row's; per question = the same per question trained (with "
        "allocation the step trains Q * k ~ b * G sequences, as GRPO does, for Q times the questions). "
        "Ideal = G / k. Generation share = rollout / whole step.",
        "- Two clocks: wall seconds (the trainer's `timing_s/*`) and CPU seconds of the process "
        "(`time.process_time`, all its threads, around each device call of the phase). On a machine "
        "shared with other jobs the wall clock of a phase stretches with the others' load, which "
        "changes while the configurations run; CPU seconds count the work done and are the figures "
        "to compare across configurations here.",
        "",
    ]
    if has_cpu:
        lines += [
            "## CPU seconds per step (medians) and the training-phase speedup",
            "",
            *_phase_table(rows, "cpu", "CPU s"),
            "",
        ]
    lines += [
        "## Wall seconds per step (medians)",
        "",
        *_phase_table(rows, "times", "s"),
        "",
        f"## Share of generation in a step (mu = {args.mu}, beta = {args.beta})",
        "",
        "| step | allocation | p | Q | k | rollout s | step s | generation share (wall) | "
        "generation share (CPU) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    share_rows = [("GRPO", grpo)] + [
        (f"CPPO p = {TARGET_P:g}", r) for r in rows if r["p"] == TARGET_P
    ]
    for name, r in share_rows:
        cpu_share = f"{r['cpu_rollout_share']:.0%}" if "cpu" in r else "-"
        lines.append(
            f"| {name} | {'on' if r['allocation'] else 'off'} | {r['p']:g} | {r['Q']} | {r['k']} | "
            f"{r['times']['rollout']:.2f} | {r['times']['step']:.2f} | {r['rollout_share']:.0%} | "
            f"{cpu_share} |"
        )
    clock = "cpu" if has_cpu else "times"
    share = grpo[f"{clock}_rollout_share"]
    lines += [
        "",
        f"Target (issue #12): generation below half of the GRPO step: "
        f"**{'met' if share < 0.5 else 'MISSED'}** ({share:.0%} by "
        f"{'CPU seconds' if has_cpu else 'wall clock'}).",
    ]
    if target is not None:
        met = target[f"{clock}_speedup_step"] >= TARGET_SPEEDUP
        unit = "CPU seconds" if has_cpu else "wall clock"
        lines += [
            "",
            "## Headline",
            "",
            f"- At p = {TARGET_P:g} without allocation the training phase runs "
            f"**{target[clock + '_speedup_step']:.2f}x** faster than GRPO's by {unit} "
            f"({target['times_speedup_step']:.2f}x by wall clock; ideal {target['ideal']:g}x; target "
            f">= {TARGET_SPEEDUP:.0f}x: {'met' if met else 'MISSED'}); the whole step "
            f"{grpo[clock]['step'] / target[clock]['step']:.2f}x.",
            *(
                [
                    f"- Per round (each against its own GRPO), by {unit}: "
                    + ", ".join(f"{x:.2f}x" for x in target[clock + "_round_speedups"])
                    + "; by wall clock: "
                    + ", ".join(f"{x:.2f}x" for x in target["times_round_speedups"])
                    + "."
                ]
                if clock + "_round_speedups" in target
                else []
            ),
            f"- Generation is {grpo[clock + '_rollout_share']:.0%} of a GRPO step and "
            f"{target[clock + '_rollout_share']:.0%} of a CPPO p = {TARGET_P:g} step (allocation "
            f"off), by {unit}.",
        ]
    if args.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in args.notes]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, rows: list[dict], info: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    clock = "cpu" if all("cpu" in r for r in rows) else "times"
    labels, bottoms = [], []
    colors = dict(zip(PHASES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")))
    names = {"ref_logps": "reference", "old_logps": "old-policy"}
    for i, r in enumerate(rows):
        labels.append(f"{r['p']:g}\n{'alloc' if r['allocation'] else 'no alloc'}")
        bottom = 0.0
        for ph in PHASES:
            ax1.bar(
                i,
                r[clock][ph],
                bottom=bottom,
                color=colors[ph],
                label=names.get(ph, ph) if i == 0 else None,
            )
            bottom += r[clock][ph]
        bottoms.append(bottom)
    ax1.set_xticks(range(len(rows)))
    ax1.set_xticklabels(labels, fontsize=7)
    ax1.set_xlabel("p (allocation)")
    ax1.set_ylabel(f"{'CPU' if clock == 'cpu' else 'wall'} seconds per step (median)")
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)
    ax1.set_title("Phases of one step", fontsize=10)

    for alloc, style in ((False, "o-"), (True, "s--")):
        if not any(r["allocation"] == alloc for r in rows if r["p"] > 0):
            continue
        sel = [r for r in rows if r["allocation"] == alloc or r["p"] == 0.0]
        sel = sorted({r["p"]: r for r in sel}.values(), key=lambda r: r["p"])
        key = "speedup_step" if not alloc else "speedup_question"
        label = "measured (wall), no allocation" if not alloc else "per question (wall), allocation"
        if alloc and clock == "cpu":
            key, label = "cpu_speedup_question", "per question (CPU s), allocation"
        ax2.plot([r["p"] for r in sel], [r[key] for r in sel], style, label=label)
    if all("cpu" in r for r in rows):
        sel = sorted(
            {r["p"]: r for r in rows if not r["allocation"]}.values(), key=lambda r: r["p"]
        )
        ax2.plot(
            [r["p"] for r in sel],
            [r["cpu_speedup_step"] for r in sel],
            "^-",
            label="measured (CPU s), no allocation",
        )
    ideal = sorted({r["p"]: r["ideal"] for r in rows}.items())
    ax2.plot(*zip(*ideal), "k:", label="ideal G/k")
    ax2.axhline(TARGET_SPEEDUP, color="grey", lw=0.8, ls="-.", label=f"target {TARGET_SPEEDUP:g}x")
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("pruning rate p")
    ax2.set_ylabel("training-phase speedup vs GRPO")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    ax2.set_title(
        f"{info['params'] / 1e6:.1f}M params, G = {args.G}, C = {args.C}, mu = {args.mu}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(args, raw: Path) -> tuple[list[dict], dict]:
    """Every configuration, one process each; raw results saved to `raw` as they come."""
    start = time.perf_counter()
    info = _common.machine()
    info["date"] = datetime.date.today().isoformat()
    info["load_before"] = _common.load_average()
    info["model"] = model_config(args.quick)
    work = Path(tempfile.mkdtemp(prefix="phase_speedup_work_"))
    if args.model_dir:  # built by an earlier invocation (the same seed gives the same weights)
        model_dir, info["params"] = args.model_dir, count_params(args.quick)
    else:
        model_dir, info["params"] = build_model(work / "model", args.quick)
    print(f"model: {info['params']:,} parameters", flush=True)

    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.allocation]
    configs = [(p, a) for a in modes for p in args.p if p > 0 or not a]
    specs = [
        {
            "p": p,
            "allocation": alloc,
            "b": args.b,
            "G": args.G,
            "C": args.C,
            "mu": args.mu,
            "beta": args.beta,
            "warmup": args.warmup,
            "steps": args.steps,
            "model_dir": str(model_dir),
            "out_dir": str(work / "runs"),
            "name": f"p{p:g}_{'alloc' if alloc else 'noalloc'}_r{rnd}",
            "round": rnd,
        }
        for rnd in range(args.rounds)  # round after round: every configuration in each
        for p, alloc in configs
    ]

    def one(spec: dict) -> dict:
        if args.in_process:
            return run_one(spec)
        return _common.run_child(Path(__file__).resolve(), spec, spec["name"])

    rows = []
    jobs = 1 if args.in_process else args.jobs
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, spec) for spec in specs]
        for future in concurrent.futures.as_completed(futures):
            r = future.result()
            rows.append(r)
            saved = {k: v for k, v in info.items() if k != "model"}
            saved["args"] = {k: getattr(args, k) for k in SAVED_ARGS}
            raw.write_text(json.dumps({"rows": rows, "info": saved}, indent=1) + "\n")
            t = r["times"]
            print(
                f"p={r['p']:<6g} alloc={r['allocation']!s:5} Q={r['Q']:3d} k={r['k']:2d}: "
                + " ".join(f"{ph}={t[ph]:.2f}" for ph in PHASES)
                + f" step={t['step']:.2f}s rss={r['rss_peak_mib']:.0f}MiB",
                flush=True,
            )
    info["load_after"] = _common.load_average()
    info["wall_min"] = (time.perf_counter() - start) / 60
    return pool_rounds(rows), info


def pool_rounds(rows: list[dict]) -> list[dict]:
    """One row per configuration: with several rounds, its phase medians over the measured steps of
    all rounds, and each round's own row kept under `rounds` (for the per-round speedups)."""
    by_config: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r.get("round", 0)):
        by_config.setdefault((r["allocation"], r["p"]), []).append(r)
    pooled = []
    for key in sorted(by_config):
        runs = by_config[key]
        if len(runs) == 1 or "steps_times" not in runs[0]:
            pooled.append(runs[0])
            continue
        row = dict(runs[0])
        for clock in ("times", "cpu"):
            steps = [s for r in runs for s in r[f"steps_{clock}"]]
            row[clock] = {ph: statistics.median(s[ph] for s in steps) for ph in steps[0]}
        row["rounds"] = [{"times": r["times"], "cpu": r["cpu"]} for r in runs]
        row["rss_peak_mib"] = max(r["rss_peak_mib"] for r in runs)
        row["rss_built_mib"] = max(r["rss_built_mib"] for r in runs)
        row["compiles_while_measured"] = max(r["compiles_while_measured"] for r in runs)
        pooled.append(row)
    return pooled


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, p in {0, 0.5}, 1 step: a smoke test"
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for phase_speedup.md/.png")
    parser.add_argument("--p", type=float, nargs="*", default=None, help="pruning rates")
    parser.add_argument("--b", type=int, default=None, help="questions per GRPO step")
    parser.add_argument("--G", type=int, default=16)
    parser.add_argument("--C", type=int, default=None, help="completion tokens")
    parser.add_argument("--mu", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--warmup", type=int, default=1, help="steps that compile, not counted")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per configuration")
    parser.add_argument(
        "--note", dest="notes", action="append", default=[], help="a line for the notes"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="all configurations in this process (faster; peak memory then covers them all)",
    )
    parser.add_argument(
        "--allocation", choices=("off", "on", "both"), default="both", help="which sweeps to run"
    )
    parser.add_argument("--jobs", type=int, default=1, help="configurations (processes) at a time")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, round after round (medians pool the rounds)",
    )
    parser.add_argument(
        "--model-dir", default="", help="reuse this model folder (from build_model)"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="*",
        default=[],
        help="with --report-only: more raw JSON files whose configurations join the table",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the .md/.png from the raw phase_speedup.json in --out (no measuring)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one configuration
    args = parser.parse_args(argv)
    if args.one:
        _common.emit(run_one(json.loads(args.one)))
        return []
    args.p = args.p or ([0.0, 0.5] if args.quick else list(PRUNING_RATES))
    if 0.0 not in args.p and args.allocation == "both":
        args.p = [0.0] + args.p
    args.b = args.b or 1
    args.C = args.C or (8 if args.quick else 16)
    args.steps = args.steps or (1 if args.quick else 2)
    if args.quick:
        args.G, args.warmup, args.in_process = 4, 1, True
    out = args.out or (Path(tempfile.mkdtemp(prefix="phase_speedup_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)

    raw = out / "phase_speedup.json"
    if args.report_only:
        saved = json.loads(raw.read_text())
        rows, info = saved["rows"], saved["info"]
        for k, v in info.pop("args").items():
            setattr(args, k, v)
        info["model"] = model_config(args.quick)
        info.setdefault("load_after", "n/a")
        info.setdefault("wall_min", float("nan"))
        for extra in args.merge:  # e.g. a sweep measured by a second invocation at the same time
            more = json.loads(Path(extra).read_text())
            seen = {(r["p"], r["allocation"]) for r in rows}
            rows += [r for r in more["rows"] if (r["p"], r["allocation"]) not in seen]
            info["wall_min"] = max(info["wall_min"], more["info"].get("wall_min", 0.0))
        rows.sort(key=lambda r: (r["allocation"], r["p"]))
    else:
        rows, info = measure(args, raw)
        saved = {k: v for k, v in info.items() if k != "model"}
        saved["args"] = {k: getattr(args, k) for k in SAVED_ARGS}
        raw.write_text(json.dumps({"rows": rows, "info": saved}, indent=1) + "\n")
    if not any(r["p"] == 0.0 for r in rows):
        print(f"no GRPO (p = 0) row: raw results in {raw}; report with --report-only --merge")
        return rows
    add_ratios(rows)
    write_markdown(out / "phase_speedup.md", rows, info, args)
    write_plot(out / "phase_speedup.png", rows, info, args)
    print(f"wrote {out / 'phase_speedup.md'} and {out / 'phase_speedup.png'}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
