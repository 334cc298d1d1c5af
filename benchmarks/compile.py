"""Compile seconds of each jitted program against depth, unrolled and scanned, and the step time.

    python benchmarks/compile.py            # 2, 4, 8, 16 and 28 layers (28 = Qwen2.5-7B's depth)
    python benchmarks/compile.py --quick    # 1 and 2 layers of a smaller model, in one process (the suite)

The model has hidden 128 (4 heads of 32, 2 key/value heads, MLP 384, vocabulary 512) at every depth,
so only the number of layers changes. For each depth and `model.scan_layers` setting a fresh process
(no compilation cache, persistent or in memory) lowers and compiles the project's own programs: the
train step (`step.compiled`: forward, backward, AdamW), the log-prob function (reference / old policy)
and the embedded sampler (prefill + decode), then times 3 train steps. Results: compile.md and
compile.json under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

DEPTHS = (2, 4, 8, 16, 28)
QUICK_DEPTHS = (1, 2)
PROGRAMS = ("train_step", "logps", "sampler")
SCANNED_GROWTH_TARGET = 1.5  # issue #20: scanned compile seconds from 4 to 28 layers


def measure(spec: dict) -> dict:
    """One depth and mode, in this (fresh) process: compile seconds per program and step seconds."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from cppo_jax.config.schema import CPPOConfig, OptimConfig
    from cppo_jax.models import TransformerConfig, init_model
    from cppo_jax.rollout.embedded.sampler import make_sampler
    from cppo_jax.rollout.embedded.sampling import SamplingParams
    from cppo_jax.train import device_fns as step_lib
    from cppo_jax.train import optimizer as optimizer_lib

    width = spec["width"]
    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=512,
        hidden_size=width,
        intermediate_size=3 * width,
        num_layers=spec["layers"],
        num_heads=4,
        num_kv_heads=2,
        head_dim=width // 4,
        tie_word_embeddings=True,
        scan_layers=spec["scan"],
    )
    Q, G, P, C = 2, 16, spec["prompt"], spec["completion"]
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    spec_ = step_lib.StepSpec.make(CPPOConfig(num_generations=G, beta=0.04), P, C, 1.0)
    tx = optimizer_lib.make_optimizer(OptimConfig(lr=1e-5), 100)
    train_step, logps = step_lib.compiled(graphdef, tx, spec_)
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)
    N, T = Q * G, P + C
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (N, T)), jnp.int32)
    valid = jnp.ones((N, T), bool)
    batch = step_lib.Batch(
        tokens,
        valid,
        jnp.ones((N, C), jnp.float32),
        jnp.asarray(rng.standard_normal(N), jnp.float32),
        None,
        jnp.zeros((N, C), jnp.float32),
    )
    # eos_id = vocab_size is never sampled: every completion runs to the length limit.
    sampler = make_sampler(graphdef, G, SamplingParams(max_new_tokens=C, eos_id=cfg.vocab_size))
    prompts, prompt_valid = tokens[:Q, :P], valid[:Q, :P]
    seeds = jnp.arange(Q, dtype=jnp.uint32)
    out = {"layers": cfg.num_layers, "scan": cfg.scan_layers, "compile_s": {}}
    compiled = {}
    for name, fn, args in (
        ("train_step", train_step, (params, opt_state, batch)),
        ("logps", logps, (params, tokens, valid)),
        ("sampler", sampler, (params, prompts, prompt_valid, seeds)),
    ):
        start = time.perf_counter()
        compiled[name] = fn.lower(*args).compile()
        out["compile_s"][name] = time.perf_counter() - start
    step = compiled["train_step"]
    params_, state_ = jax.tree.map(jnp.copy, params), opt_state
    params_, state_, _ = jax.block_until_ready(step(params_, state_, batch))  # warm
    start = time.perf_counter()
    for _ in range(3):
        params_, state_, metrics = step(params_, state_, batch)
    jax.block_until_ready(metrics)
    out["step_s"] = (time.perf_counter() - start) / 3
    return out


def report(rows: list[dict], info: dict, quick: bool) -> str:
    lines = [
        "# Compile time against depth: unrolled and scanned layers",
        "",
        "Written by `benchmarks/compile.py`"
        + (" --quick" if quick else "")
        + ". Each row: a fresh "
        "process, no compilation cache; hidden 128 (quick: 32) at every depth; Q = 2 questions x "
        "G = 16 completions; seconds of `jit(...).lower(...).compile()` per program, and the mean "
        "of 3 train steps after a warm one.",
        "",
        _common.machine_line(info),
        "",
        "| layers | layers run | train step compile s | log-probs compile s | sampler compile s "
        "| all programs s | train step s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        c = r["compile_s"]
        lines.append(
            f"| {r['layers']} | {'scanned' if r['scan'] else 'unrolled'} | {c['train_step']:.1f} | "
            f"{c['logps']:.1f} | {c['sampler']:.1f} | {sum(c.values()):.1f} | {r['step_s']:.3f} |"
        )
    by = {(r["layers"], r["scan"]): sum(r["compile_s"].values()) for r in rows}
    depths = sorted({r["layers"] for r in rows})
    lo = 4 if 4 in depths else depths[0]  # the target: 4 -> 28 layers
    hi = depths[-1]
    lines += ["", f"Growth of the compile seconds of all programs from {lo} to {hi} layers:"]
    for scan in (True, False):
        if (lo, scan) in by and (hi, scan) in by:
            ratio = by[(hi, scan)] / by[(lo, scan)]
            target = ""
            if scan:
                verdict = "met" if ratio <= SCANNED_GROWTH_TARGET else "MISSED"
                target = f" (target <= {SCANNED_GROWTH_TARGET}x: **{verdict}**)"
            lines.append(f"- {'scanned' if scan else 'unrolled'}: {ratio:.2f}x{target}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _common.emit(measure(json.loads(args.one)))
        return []
    base = (
        {"width": 32, "prompt": 8, "completion": 8}
        if args.quick
        else {"width": 128, "prompt": 16, "completion": 32}
    )
    info = _common.machine()
    info["load_before"] = _common.load_average()
    rows = []
    for layers in QUICK_DEPTHS if args.quick else DEPTHS:
        for scan in (True, False):
            spec = {**base, "layers": layers, "scan": scan}
            if args.quick:  # a smoke run: in this process (every config still compiles afresh)
                rows.append(measure(spec))
            else:
                rows.append(_common.run_child(Path(__file__), spec, f"{layers} layers scan={scan}"))
            print(json.dumps(rows[-1]), flush=True)
    info["load_after"] = _common.load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    (args.out / "compile.md").write_text(report(rows, info, args.quick))
    return rows


if __name__ == "__main__":
    main()
