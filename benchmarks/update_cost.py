"""Update cost: the fixed part of one optimizer update, apart from the loss and its gradient.

The 20.7M-parameter float32 model of benchmarks/phase_speedup.py (random weights) with a tiny batch
(M = 2 rows, 72 prompt slots, C = 16 completion slots, beta = 0.04 and mu = 2 as there, AdamW with the
gradient clip on), four jitted programs timed side by side in one process:

- `train step`: `step.compiled(...)`'s train step, params and optimizer state donated (as the trainer);
- `update only`: the same step without the loss and gradient (`optimizer.apply_update` on given gradients:
  the clip, the finiteness check, AdamW and the skip), donated the same way;
- `optax update (before)`: the update as `train_step` did it before it was fused (optax's
  `clip_by_global_norm` + `adamw` chain, `apply_updates`, a finiteness pass over the gradients, a
  `jnp.where` select over params and optimizer state, the norm again for the metric);
- `grads only`: the loss and gradient computation alone.

Each is called `--calls` times after one warm-up call (compilation); medians of CPU seconds of the
process (`time.process_time`, all threads) and of wall seconds. The fixed cost of an update is the
`update only` row; `train step - grads only` is the same thing measured the other way round.

    python benchmarks/update_cost.py                     # writes benchmarks/results/update_cost.md
    python benchmarks/update_cost.py --out /tmp/u --dump /tmp/u/hlo   # also XLA dumps of the programs
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from the checkout this file is in, not an installed copy
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
M, P, C = 2, 72, 16
TARGET_S = 0.1


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=7, help="measured calls per program (median)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for update_cost.md")
    ap.add_argument(
        "--dump", type=Path, default=None, help="XLA dump folder (sets --xla_dump_to; slower)"
    )
    ap.add_argument("--quick", action="store_true", help="the tiny test model (a smoke test)")
    return ap.parse_args(argv)


def optax_update(params, opt_state, grads, loss, *, tx):
    """The update as `train_step` did it before fusing (for the before/after comparison)."""
    import jax
    import jax.numpy as jnp
    import optax

    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(grads)]
    finite = jnp.isfinite(loss) & jnp.all(jnp.stack(leaves))
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    return params, opt_state, optax.global_norm(grads), finite


def build(quick: bool):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks import phase_speedup
    from cppo_jax.config.schema import CPPOConfig, OptimConfig
    from cppo_jax.models import init_model
    from cppo_jax.train import device_fns as step_lib
    from cppo_jax.train import optimizer as optimizer_lib

    mcfg = phase_speedup.model_config(quick)
    model = init_model(mcfg, seed=0)
    graphdef, params = nnx.split(model)
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    spec = step_lib.StepSpec.make(CPPOConfig(beta=0.04, mu=1), P, C, 1.0)
    tx = optimizer_lib.make_optimizer(
        OptimConfig(lr=1e-6, schedule="constant", warmup_ratio=0.0), 100
    )
    vocab = mcfg.vocab_size
    keys = jax.random.split(jax.random.key(0), 4)
    tokens = jax.random.randint(keys[0], (M, P + C), 3, vocab, dtype=jnp.int32)
    lp = -jax.random.uniform(keys[1], (M, C), jnp.float32, 1.0, 5.0)
    batch = step_lib.Batch(
        tokens,
        jnp.ones((M, P + C), bool),
        jnp.ones((M, C), jnp.float32),
        jax.random.normal(keys[2], (M,), jnp.float32),
        lp,
        lp + 0.1,
    )
    return graphdef, params, n_params, spec, tx, batch


def measure(fn, state, calls: int, donated: bool):
    """Warm-up then `calls` timed calls; `state` is threaded through when the call donates it."""
    import jax

    cpu, wall = [], []
    for i in range(calls + 1):
        c0, w0 = time.process_time(), time.perf_counter()
        out = jax.block_until_ready(fn(*state))
        c1, w1 = time.process_time(), time.perf_counter()
        if donated:
            state = (out[0], out[1], *state[2:])
        if i:
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
    return statistics.median(cpu), statistics.median(wall)


def run(args) -> dict:
    if args.dump is not None:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump} --xla_dump_hlo_as_text"
        )
    import functools

    import jax

    from benchmarks import _common
    from cppo_jax.train import device_fns as step_lib
    from cppo_jax.train import optimizer as optimizer_lib

    load_before = _common.load_average()
    graphdef, params, n_params, spec, tx, batch = build(args.quick)
    copy = lambda t: jax.tree.map(lambda x: x.copy(), t)  # noqa: E731

    grads_fn = jax.jit(lambda params, batch: step_lib._grads(params, graphdef, batch, spec))
    loss, _, grads, _ = grads_fn(params, batch)
    grads = jax.block_until_ready(grads)
    step, _ = step_lib.compiled(graphdef, tx, spec)
    update = jax.jit(functools.partial(optimizer_lib.apply_update, tx=tx), donate_argnums=(0, 1))
    before = jax.jit(functools.partial(optax_update, tx=tx), donate_argnums=(0, 1))

    rows = {}
    programs = [
        ("train step", step, lambda: (copy(params), tx.init(params), batch), True),
        ("update only", update, lambda: (copy(params), tx.init(params), grads, loss), True),
        (
            "optax update (before)",
            before,
            lambda: (copy(params), tx.init(params), grads, loss),
            True,
        ),
        ("grads only", grads_fn, lambda: (params, batch), False),
    ]
    hlo = {}
    shapes = {"f32[" + ",".join(map(str, x.shape)) + "]" for x in jax.tree.leaves(params)}
    for name, fn, make_state, donated in programs:
        # What XLA made of it: param-shaped copies, fusions, temporary bytes.
        compiled = fn.lower(*make_state()).compile()
        text = compiled.as_text()
        copies = [x for x in text.splitlines() if " copy(" in x and any(s in x for s in shapes)]
        temp = compiled.memory_analysis().temp_size_in_bytes
        hlo[name] = (len(copies), text.count(" fusion("), temp)
        rows[name] = measure(fn, make_state(), args.calls, donated)
        print(f"{name}: CPU {rows[name][0]:.3f} s, wall {rows[name][1]:.3f} s", flush=True)
    info = _common.machine()
    info.update(load_before=load_before, load_after=_common.load_average())
    return {
        "quick": args.quick,
        "rows": rows,
        "hlo": hlo,
        "params": n_params,
        "machine": info,
        "calls": args.calls,
    }


def report(result: dict, argv: list[str], minutes: float) -> str:
    from benchmarks import _common

    rows = result["rows"]
    step_cpu, step_wall = rows["train step"]
    grads_cpu, grads_wall = rows["grads only"]
    fixed_cpu, fixed_wall = rows["update only"]
    lines = [
        "# Update cost: the fixed part of an optimizer update",
        "",
        f"Measured {datetime.date.today()} by `python benchmarks/update_cost.py"
        f"{' ' + ' '.join(argv) if argv else ''}` in {minutes:.1f} min.",
        "",
        _common.machine_line(result["machine"]),
        f"- Model: the {'--quick test' if result['quick'] else '20.7M'} model of "
        f"benchmarks/phase_speedup.py ({result['params'] / 1e6:.1f}M "
        f"parameters, float32, random weights); batch M = {M} rows, P = {P} prompt slots, C = {C} "
        "completion slots, beta = 0.04, mu = 2 (old and reference log-probs given); AdamW, "
        "grad_clip = 1.0, constant learning rate 1e-6.",
        f"- Each program: 1 warm-up call (compilation), then the **median of {result['calls']} "
        "calls**; CPU seconds of the process (`time.process_time`, all threads) and wall seconds. "
        "Donated programs get their own outputs back as params and optimizer state, as in the "
        "trainer.",
        "",
        "| program | CPU s | wall s | CPU / train step | wall / train step |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, (cpu, wall) in rows.items():
        lines.append(
            f"| {name} | {cpu:.3f} | {wall:.3f} | {cpu / step_cpu:.2f} | {wall / step_wall:.2f} |"
        )
    lines += [
        "",
        "## What XLA compiled (CPU, after optimizations)",
        "",
        "| program | copies of param-shaped arrays | fusions | temporary MiB |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (copies, fusions, temp) in result["hlo"].items():
        lines.append(f"| {name} | {copies} | {fusions} | {temp / 2**20:.0f} |")
    before_cpu, before_wall = rows["optax update (before)"]
    met = "met" if fixed_wall < TARGET_S else "MISSED"
    lines += [
        "",
        "## Headline",
        "",
        f"- Fixed cost of an update (`update only`): **{fixed_cpu:.3f} CPU s, {fixed_wall:.3f} wall s**"
        f" (target < {TARGET_S} s: {met}); the optax update it replaced: {before_cpu:.3f} CPU s, "
        f"{before_wall:.3f} wall s ({before_cpu / fixed_cpu:.1f}x the CPU seconds).",
        f"- Train step - grads only: {step_cpu - grads_cpu:.3f} CPU s, "
        f"{step_wall - grads_wall:.3f} wall s.",
        "- Where the optax update's time went (XLA dump, `--dump`): `jnp.where(finite, new, old)` "
        "over the AdamW state kept old and new moments alive, so XLA copied both moments first (the "
        "param-shaped copies above); `isfinite` wrote a boolean array per gradient before reducing "
        "it; the clip's division wrote the clipped gradients out for each moment's fusion to read "
        "back; the params' fusion recomputed the moments from the copies. The update now: one "
        "reduction over the gradients (the norm serves the clip, the metric and the finiteness "
        "check), then one fusion per moment and one per param, in place, under `lax.cond`.",
        "- Copies of param-shaped arrays left in the train step are in its gradient part (the "
        "`grads only` row has them too): zero-filled broadcasts, the layer scan's gradient "
        "accumulators.",
        "- Memory traffic floor: params, gradients and two Adam moments read, params and moments "
        f"written, plus one read of the gradients for the norm: 8 x {result['params'] * 4 / 1e6:.0f} MB"
        f" = {8 * result['params'] * 4 / 1e9:.2f} GB per update.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    t0 = time.perf_counter()
    result = run(args)
    text = report(result, argv, (time.perf_counter() - t0) / 60)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "update_cost.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
