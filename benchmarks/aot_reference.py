"""The reference policy's memory at the paper's shapes, before and after issue #31 (compiled by libtpu).

    python benchmarks/aot_reference.py           # the cases below (a few minutes on 2 cores)

The reference log-probs program of each paper config (P = 512, C = 1024, G = 16, p = 0.875 with
dynamic allocation) on the slice and mesh of benchmarks/results/aot_attention.md, three ways:
the reference held as a copy in the param dtype (float32, what the trainer kept before) with the
default attention, the copy in the compute dtype (bfloat16, what it keeps now), and that copy with
`model.attention=splash`. "Before" is today's program with only the copy's dtype put back, so the
difference is that change alone. Per device, GiB; each compile in a fresh process. Results:
aot_reference.md and .json under --out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402
from benchmarks.aot_attention import CASES  # noqa: E402

# (label, dtype of the reference copy, attention)
VARIANTS = [
    ("float32 copy, einsum (before)", "float32", "einsum"),
    ("bfloat16 copy, einsum", "bfloat16", "einsum"),
    ("bfloat16 copy, splash (now, on TPU)", "bfloat16", "splash"),
]


def measure(case: dict) -> dict:
    """One (case, variant) in this process: the reference program's compiled memory."""
    import jax.numpy as jnp

    from cppo_jax.config.files import load_config
    from cppo_jax.models import transformer
    from cppo_jax.planning import aot
    from cppo_jax.train import programs

    if case["copy"] == "float32":  # the copy kept in the param dtype, as before
        kept = transformer.forward_copy
        transformer.forward_copy = lambda params, dtype: kept(params, jnp.float32)
    d, f, t = case["mesh"]
    overrides = [
        "cppo.pruning_rate=0.875",
        f"model.attention={case['attention']}",
        f"mesh.data={d}",
        f"mesh.fsdp={f}",
        f"mesh.tensor={t}",
        *(["data.train=gsm8k"] if case["config"] == "math7b" else []),
    ]
    cfg = load_config(ROOT / "configs" / f"{case['config']}.py", overrides)
    built = programs.build(cfg, aot.target_devices(case["target"]))
    fn, args = built.programs["ref_logps"]
    m = aot.compile_program("ref_logps", fn, args)
    figures = {"arguments": m.arguments, "temporaries": m.temporaries, "total": m.total}
    return {**case, **figures, "error": m.error}


def render(rows: list[dict], out: Path, info: dict) -> None:
    def gib(n):
        return f"{n / 2**30:.2f}"

    lines = [
        "# The reference policy's memory at the paper's shapes (TPU, compiled deviceless)",
        "",
        _common.machine_line(info),
        "- Written by `python benchmarks/aot_reference.py`; compiled by libtpu, nothing run on a "
        "TPU. The reference log-probs program, p = 0.875 with dynamic allocation, P = 512, "
        "C = 1024, G = 16. Per device, GiB; the arguments are the reference copy (the batch is "
        "small beside it). 'Before' is today's program with the copy put back in float32.",
        "",
        "| config | topology | mesh | reference | arguments | temporaries | total | total / before |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config, target, mesh in CASES:
        before = None
        for label, _, _ in VARIANTS:
            r = next((x for x in rows if (x["config"], x["label"]) == (config, label)), None)
            where = f"| {config} | {target} | {'/'.join(map(str, mesh))} | {label} |"
            if r is None or r.get("failed") or r.get("error"):
                why = "not measured" if r is None else r.get("failed") or r["error"]
                lines.append(f"{where} {why} | | | |")
                continue
            before = before or r["total"]
            lines.append(
                f"{where} {gib(r['arguments'])} | {gib(r['temporaries'])} | {gib(r['total'])} | "
                f"{r['total'] / before:.2f} |"
            )
    lines += [
        "",
        "Held in float32 the copy is twice its bfloat16 size, and the program also makes "
        "bfloat16 casts of each layer's weights as it runs; splash attention then removes the "
        "[rows, heads, T, T] float32 scores (benchmarks/results/aot_attention.md).",
    ]
    (out / "aot_reference.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parent = _common.compile_cases_cli(__doc__, measure, argv)
    if parent is None:
        return
    out, info = parent
    rows = []
    for config, target, mesh in CASES:
        for label, copy, attention in VARIANTS:
            case = {"config": config, "target": target, "mesh": mesh, "label": label}
            case.update(copy=copy, attention=attention)
            rows.append(_common.run_case(Path(__file__), case, f"{config} {label}"))
            print(f"{config} {target} {label}: done", flush=True)
            (out / "aot_reference.json").write_text(json.dumps({"rows": rows}, indent=1))
    info["load_after"] = _common.load_average()
    render(rows, out, info)


if __name__ == "__main__":
    main()
