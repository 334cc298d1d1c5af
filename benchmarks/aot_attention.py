"""Attention's memory at the paper's shapes: einsum against TPUs' splash kernel, compiled by libtpu here.

    python benchmarks/aot_attention.py           # the cases below (about 15 minutes on 2 cores)

For each case, the train step and the reference log-probs of the paper config (P = 512, C = 1024,
G = 16, p = 0.875 with dynamic allocation) on the mesh `benchmarks/aot.py` uses for that slice, with
`model.attention=einsum` (the default) and `model.attention=splash` (Pallas' splash attention: no
[T, T] scores in memory), compiled deviceless by libtpu; per device, GiB. Each compile runs in a
fresh process. Results: aot_attention.md and .json under --out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

# (config, topology, mesh data/fsdp/tensor): the meshes aot_tpu.md's rows compile on.
CASES = [
    ("gsm8k_1p5b", "v5e:2x4", (2, 4, 1)),
    ("math7b", "v5p:2x2x1", (1, 4, 1)),
]
KINDS = ("einsum", "splash")
PROGRAMS = ("train_step", "ref_logps")


def measure(case: dict) -> dict:
    """One (case, attention) in this process: each program's compiled memory."""
    from cppo_jax.config.files import load_config
    from cppo_jax.planning import aot
    from cppo_jax.train import programs

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
    out = {}
    for name in PROGRAMS:
        fn, args = built.programs[name]
        m = aot.compile_program(name, fn, args)
        out[name] = {"arguments": m.arguments, "temporaries": m.temporaries, "total": m.total}
        out[name]["error"] = m.error
    return {**case, "programs": out, "remat": cfg.model.remat}


def render(rows: list[dict], out: Path, info: dict) -> None:
    def gib(n):
        return f"{n / 2**30:.2f}"

    lines = [
        "# Attention's memory at the paper's shapes: einsum vs splash (TPU, compiled deviceless)",
        "",
        _common.machine_line(info),
        "- Written by `python benchmarks/aot_attention.py`; compiled by libtpu, nothing run on a TPU. "
        "p = 0.875 with dynamic allocation, P = 512, C = 1024, G = 16. Per device, GiB.",
        "",
        "| config | topology | mesh | remat | program | einsum: temporaries | einsum: total "
        "| splash: temporaries | splash: total | splash / einsum total |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by = {(r["config"], r["target"], r["attention"]): r for r in rows}
    for config, target, mesh in CASES:
        e, s = by.get((config, target, "einsum")), by.get((config, target, "splash"))
        if not e or not s or "failed" in e or "failed" in s:
            why = (e or {}).get("failed") or (s or {}).get("failed") or "not measured"
            lines.append(f"| {config} | {target} | {mesh} | | all | {why} | | | | |")
            continue
        for name in PROGRAMS:
            a, b = e["programs"][name], s["programs"][name]
            if a["error"] or b["error"]:
                lines.append(
                    f"| {config} | {target} | {'/'.join(map(str, mesh))} | {e['remat']} "
                    f"| {name} | {a['error'] or '-'} | | {b['error'] or '-'} | | |"
                )
                continue
            lines.append(
                f"| {config} | {target} | {'/'.join(map(str, mesh))} | {e['remat']} | {name} | "
                f"{gib(a['temporaries'])} | {gib(a['total'])} | {gib(b['temporaries'])} | "
                f"{gib(b['total'])} | {b['total'] / a['total']:.2f} |"
            )
    lines += [
        "",
        "The splash kernel walks blocks of queries and keys with a running softmax, so the [rows, "
        "heads, T, T] float32 scores (2.95 GiB a layer for 7B's 12 rows per device here) never "
        "exist; with `model.remat=minimal` the train step already rebuilt one layer's scores at a "
        "time, so the gain is in the forward-only reference and in `full` remat's backward.",
    ]
    (out / "aot_attention.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parent = _common.compile_cases_cli(__doc__, measure, argv)
    if parent is None:
        return
    out, info = parent
    rows = []
    for config, target, mesh in CASES:
        for kind in KINDS:
            case = {"config": config, "target": target, "mesh": mesh, "attention": kind}
            rows.append(_common.run_case(Path(__file__), case, f"{config} {kind}"))
            print(f"{config} {target} {kind}: done", flush=True)
            (out / "aot_attention.json").write_text(json.dumps({"rows": rows}, indent=1))
    info["load_after"] = _common.load_average()
    render(rows, out, info)


if __name__ == "__main__":
    main()
