"""The embedded sampler's logits split by vocabulary (`sampler.vocab_split`), compiled for accelerators.

    python benchmarks/aot_vocab_split.py        # the cases below (a few minutes on 2 cores)

The sampler program of each paper config (P = 512, C = 1024, G = 16, p = 0.875 with dynamic
allocation) on a mesh with fsdp > 1, compiled deviceless (libtpu for TPUs, XLA:GPU for H100s), two
ways: the logits gathered (the unembedding split by its model dimension as the rules keep it, so
each device's logits are partial sums, all-reduced every token: the path before, which top-k / top-p
still take) and split by vocabulary (now). Per program: the all-reduce of [rows, V] logits inside
the decode loops (per token; or the reduce-scatter XLA:GPU makes of it), the bytes of all the loops' all-reduces (each op once: the layer loop's run once per
layer), the arguments, the temporaries and the total per device. Each compile in a fresh process.
Results: aot_vocab_split.md and .json under --out.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

# (config, target, mesh data / fsdp / tensor): the meshes of benchmarks/results/aot_tpu.md and
# aot_gpu.md where fsdp > 1
CASES = [
    ("gsm8k_1p5b", "v5e:2x4", (2, 4, 1)),
    ("math7b", "v5p:2x2x1", (1, 4, 1)),
    ("math7b", "h100:8", (1, 8, 1)),
]
VARIANTS = [("gathered (before)", False), ("split by vocabulary (now)", True)]


def measure(case: dict) -> dict:
    """One (case, variant) in this process: the sampler's compiled memory and loop collectives."""
    from cppo_jax.config.files import load_config
    from cppo_jax.planning import aot
    from cppo_jax.rollout.embedded import sampler
    from cppo_jax.train import programs

    if not case["split"]:
        sampler.vocab_split = lambda mesh, sp: None
    d, f, t = case["mesh"]
    overrides = ["cppo.pruning_rate=0.875", f"mesh.data={d}", f"mesh.fsdp={f}", f"mesh.tensor={t}"]
    cfg = load_config(ROOT / "configs" / f"{case['config']}.py", overrides)
    built = programs.build(cfg, aot.target_devices(case["target"]))
    fn, args = built.programs["sampler"]
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile(aot._compiler_options(args))
    m = aot.ProgramMemory.of("sampler", compiled, time.perf_counter() - t0)
    text = compiled.as_text()
    sums = aot.loop_collectives(text, "all-reduce")
    V = programs.model_config(cfg).vocab_size
    scattered = aot.loop_collectives(text, "reduce-scatter")  # XLA:GPU sums by reduce-scatter
    logits = [x for x in sums + scattered if V in x[1]]  # a sum of partial logits [rows, V]
    largest = max(logits, key=lambda x: aot.array_bytes(*x), default=("", ()))
    return {
        **case,
        "V": V,
        "largest": [largest[0], list(largest[1])],
        "largest_bytes": aot.array_bytes(*largest) if largest[1] else 0,
        "loop_bytes": sum(aot.array_bytes(*x) for x in sums),
        "arguments": m.arguments,
        "temporaries": m.temporaries,
        "total": m.total,
        "compile_s": m.seconds,
    }


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def render(rows: list[dict], out: Path, info: dict) -> None:
    lines = [
        "# The embedded sampler's logits split by vocabulary (compiled deviceless)",
        "",
        _common.machine_line(info),
        "- Written by `python benchmarks/aot_vocab_split.py`; compiled by libtpu (TPU) and XLA:GPU "
        "(H100), nothing run on either. The sampler program, p = 0.875 with dynamic allocation, "
        "P = 512, C = 1024, G = 16. Logits sum: an all-reduce (XLA:GPU: a reduce-scatter) of "
        "[rows, V] inside the decode loops, one per token; loops' all-reduces: the bytes of every all-reduce op "
        "in the loops, each op once (one decode step's, the layer loop's counted for one layer). "
        "Memory per device, GiB.",
        "",
        "| config | target | mesh | logits | logits sum per token | loops' all-reduces "
        "| arguments | temporaries | total |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        where = (
            f"| {r['config']} | {r['target']} | {'/'.join(map(str, r['mesh']))} | {r['label']} |"
        )
        if r.get("failed") or r.get("error"):
            lines.append(f"{where} {r.get('failed') or r['error']} | | | | |")
            continue
        dtype, shape = r["largest"]
        summed = f"{dtype}[{', '.join(f'{d:,}' for d in shape)}] ({_size(r['largest_bytes'])})"
        lines.append(
            f"{where} {summed if shape else 'none'} "
            f"| {_size(r['loop_bytes'])} | {r['arguments'] / 2**30:.2f} | "
            f"{r['temporaries'] / 2**30:.2f} | {r['total'] / 2**30:.2f} |"
        )
    lines += [
        "",
        "Gathered, each device multiplies its share of the model dimension and the partial "
        "logits are summed every token; split, each device holds the unembedding's columns for "
        "its share of the vocabulary (one copy laid out once per rollout, in the compute dtype) "
        "and the devices exchange per-row figures only (`sampling.choose_split`).",
    ]
    (out / "aot_vocab_split.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parent = _common.compile_cases_cli(__doc__, measure, argv)
    if parent is None:
        return
    out, info = parent
    rows = []
    for config, target, mesh in CASES:
        for label, split in VARIANTS:
            case = {"config": config, "target": target, "mesh": mesh, "label": label}
            rows.append(_common.run_case(Path(__file__), {**case, "split": split}, label))
            print(f"{config} {target} {label}: done", flush=True)
            (out / "aot_vocab_split.json").write_text(json.dumps({"rows": rows}, indent=1))
    info["load_after"] = _common.load_average()
    render(rows, out, info)


if __name__ == "__main__":
    main()
