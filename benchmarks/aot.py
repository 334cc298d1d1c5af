"""The paper configs compiled for TPU slices and GPUs on this CPU (deviceless): memory per program, fits.

    python benchmarks/aot.py                 # both paper configs, p = 0 and 0.875, four topologies
    python benchmarks/aot.py --suite gpu     # ... full and LoRA on 1, 2, 4, 8 H100s and 8 H200s
    python benchmarks/aot.py --suite one_chip   # the one-chip configs on v5e, v6e, H100, A100
    python benchmarks/aot.py --cases gsm8k_1p5b:0.875:v5e:2x4   # some cases (kept beside the others)
    python benchmarks/aot.py --render        # the tables again from aot_tpu.json
    python benchmarks/aot.py --render --replan   # ... with the plan of the current code
    python benchmarks/aot.py --quick         # tiny_cpu at small shapes, v5e:2x2 and cpu (the suite)

Each case runs `cppo_jax.planning.fit.fit` in a fresh process (its own host memory): the config at its paper
shapes (P = 512, C = 1024, G = 16; p = 0.875 with dynamic allocation, or p = 0), the mesh the plan
prefers on that topology, the train step, the reference log-probs and the embedded sampler compiled by
libtpu, and, when the whole batch does not fit, the largest micro-batch that does (found by compiling).
The compiler's figures are stored in aot_tpu.json as measured, each row with the commit that built its
programs and the plan's figure of that commit; `--render --replan` sets the current code's plan beside
the same compiles instead (to judge a fix of the plan; not for rows whose programs changed since).
Results: aot_tpu.md and aot_tpu.json under --out (aot_gpu.*, aot_one_chip.* for the other suites).
GPU programs are compiled by XLA:GPU through the CUDA plugin's compile-only topology (`make
cuda-compiler`); one GPU fits within `layout.GPU_MEM_FRACTION` of its HBM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

CONFIGS = ("gsm8k_1p5b", "math7b")
RATES = ("0.875", "0")
TOPOLOGIES = ("v5e:2x4", "v6e:2x4", "v5p:2x2x1", "v4:2x2x1", "v5e:4x4", "v5e:4x8")
PLAN_TOLERANCE = 0.15  # the plan within 15% of the compiler, per program
QUICK = [("tiny_cpu", "0.75", "v5e:2x2", "full"), ("tiny_cpu", "0.75", "cpu", "full")]
# --quick's shapes: G = 4, b = 1 question (4 with allocation), 8 new tokens; libtpu compiles them in
# about a third of the CPU seconds of the demo's own (G = 16, 16 questions, 40 new tokens).
QUICK_SHAPES = ["cppo.num_generations=4", "cppo.questions_per_step=1", "rollout.max_new_tokens=8"]
ONE_CHIP = (
    "gsm8k_0p5b_one_chip",
    "gsm8k_0p5b_lora_one_chip",
    "gsm8k_1p5b_lora_one_chip",
    "gsm8k_1p5b_one_chip",
)
# Each suite: its store (NAME.json, NAME.md), title and cases (config, p, target, variant); "config"
# as p keeps the config's own rate, variant "lora" adds model.lora.enabled=true, "compact"
# rollout.compact=true.
SUITES = {
    "tpu": {
        "store": "aot_tpu",
        "title": "The paper configs compiled for TPU slices on a CPU (deviceless, libtpu)",
        "compiler": "libtpu, nothing run on a TPU",
        "cases": [(c, p, t, "full") for c in CONFIGS for p in RATES for t in TOPOLOGIES],
    },
    "gpu": {
        "store": "aot_gpu",
        "title": "The paper configs compiled for NVIDIA GPUs on a CPU (deviceless, XLA:GPU)",
        "compiler": "XLA:GPU through the CUDA plugin's compile-only topology (`make "
        "cuda-compiler`), nothing run on a GPU; a GPU fits within "
        "`layout.GPU_MEM_FRACTION` of its HBM (the XLA_PYTHON_CLIENT_MEM_FRACTION `cppo_jax.launch` sets)",
        "cases": [
            (c, p, t, v)
            for t in ("h100:8", "h200:8", "h100:4", "h100:2", "h100:1")
            for c in CONFIGS
            for v in ("lora", "full")
            for p in RATES
        ],
    },
    "one_chip": {
        "store": "aot_one_chip",
        "title": "The one-chip configs compiled for one TPU chip or one GPU on a CPU (deviceless)",
        "compiler": "libtpu for v5e / v6e (90% of a chip usable), XLA:GPU for H100 / A100 ("
        "`layout.GPU_MEM_FRACTION`); nothing run on either",
        "cases": [
            (c, "config", t, "full")
            for c in ONE_CHIP
            for t in ("v5e:1x1", "v6e:1x1", "h100:1", "a100:1")
        ],
    },
    # The 2026 models (issue #48) under the MATH recipe at p = 0.875: Qwen3-4B (the config's own),
    # Qwen3-8B and Gemma 3 4B's text decoder (sized by name: models.known), variant "model=NAME".
    "models": {
        "store": "aot_models",
        "title": "Qwen3-4B / 8B and Gemma 3 4B compiled for v5e-8 and 8 H100s on a CPU (deviceless)",
        "compiler": "libtpu for v5e-8 (90% of a chip usable), XLA:GPU for 8 H100s "
        "(`layout.GPU_MEM_FRACTION`); nothing run on either",
        "cases": [
            ("math_qwen3_4b", "config", t, v)
            for v in ("full", "model=Qwen3-8B", "model=gemma-3-4b-it")
            for t in ("v5e:2x4", "h100:8")
        ],
    },
    # The embedded sampler with row compaction (`rollout.compact`, issue #49): its gathered caches
    # beside the plan's count of them, on one chip and on a slice / node.
    "compact": {
        "store": "aot_compact",
        "title": "The embedded sampler with row compaction (rollout.compact) compiled on a CPU "
        "(deviceless)",
        "compiler": "libtpu for v5e (90% of a chip usable), XLA:GPU for H100 "
        "(`layout.GPU_MEM_FRACTION`); nothing run on either",
        "cases": [
            ("gsm8k_1p5b_lora_one_chip", "config", t, "compact") for t in ("v5e:1x1", "h100:1")
        ]
        + [("gsm8k_1p5b", "config", t, "compact") for t in ("v5e:2x4", "h100:8")],
    },
}
# Qwen2.5-0.5B-Instruct's config.json (its shapes; no weights): models.known sizes only the paper's
# two models, so the 0.5B configs are compiled with model.path at this folder.
SHAPES_0P5B = ROOT / "benchmarks" / "shapes" / "Qwen2.5-0.5B-Instruct"


def overrides_of(config: str, rate: str, variant: str = "full") -> list[str]:
    extra = ["data.train=gsm8k"] if config.startswith("math") else []  # shapes only: no data read
    if "0p5b" in config:
        extra.append(f"model.path={SHAPES_0P5B}")
    if variant == "lora":
        extra.append("model.lora.enabled=true")
    elif variant == "compact":
        extra.append("rollout.compact=true")
    elif variant.startswith("model="):  # another model under the config's recipe, sized by name
        extra.append(f"model.path={variant.removeprefix('model=')}")
    return ([] if rate == "config" else [f"cppo.pruning_rate={rate}"]) + extra


def key_of(row: dict) -> tuple:
    return (row["config"], row["rate"], row["target"], row.get("variant", "full"))


def measure(case: dict) -> dict:
    """One case in this process: `aot_fit.fit` and its rows."""
    from cppo_jax.config.files import load_config
    from cppo_jax.planning import fit as aot_fit
    from cppo_jax.planning import report as aot_report

    cfg = load_config(ROOT / "configs" / f"{case['config']}.py", case["overrides"])
    t0 = time.perf_counter()
    report = aot_fit.fit(cfg, case["target"], search=True, search_questions=False)
    c = report.compiled
    return {
        **case,
        "mesh": c.mesh,
        "micro_batch": report.cfg.trainer.micro_batch,
        "fits_as_configured": report.fits,
        "micro_batch_found": report.micro_batch,
        "tried": report.tried,
        "hbm_bytes": report.hbm_bytes,
        "usable_fraction": report.fraction,
        "device_kind": c.device_kind,
        "devices": c.devices,
        "resident": c.resident,
        "run_peak": c.run_peak,
        "programs": aot_report.program_rows(report),
        "phases": aot_report.phase_rows(report),
        "seconds": round(time.perf_counter() - t0, 1),
        "commit": _commit(),
    }


def _commit() -> str:
    """The checkout's commit (the code that built the programs), with + when it has changes."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "cppo_jax"], capture_output=True, text=True, cwd=ROOT
    )
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def plan_programs(row: dict) -> dict[str, int]:
    """The current plan's figure per program for a stored case (its mesh and micro-batch)."""
    import dataclasses

    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.config.files import load_config
    from cppo_jax.config.run import MeshConfig
    from cppo_jax.planning.compiled_memory import planned_model as model_config
    from cppo_jax.planning.compiled_memory import program_bytes

    cfg = load_config(ROOT / "configs" / f"{row['config']}.py", row["overrides"])
    cfg = dataclasses.replace(
        cfg,
        mesh=MeshConfig(**row["mesh"]),
        trainer=dataclasses.replace(cfg.trainer, micro_batch=row["micro_batch"]),
    )
    return program_bytes(cfg, model_config(cfg), shapes_of(cfg), row["mesh"], row["target"])


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def render(
    rows: list[dict],
    out: Path,
    info: dict,
    before: list[dict] = (),
    replan: bool = False,
    suite: str = "tpu",
) -> str:
    spec = SUITES[suite]
    lines = [
        f"# {spec['title']}",
        "",
        _common.machine_line(info) if "cpu" in info else "",
        f"- Written by `python benchmarks/aot.py --suite {suite}`; compiled with {spec['compiler']}. "
        "Figures per device, GiB. `peak` = the program's total plus the run's state alive beside it "
        "(the optimizer state while sampling, the reference during the update). `plan` is "
        "`cppo_jax.planning.compiled_memory`'s estimate of the program's total, "
        + (
            f"of the current code ({_commit()}: `--render --replan`), beside programs compiled at "
            "the row's commit."
            if replan
            else "at the row's commit."
        ),
        "",
        "| config | p | topology | mesh | micro-batch | program | args | temps | total | peak | "
        "plan | plan/compiled | compile s | fits | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    worst = 0.0
    failed = [r for r in rows if "failed" in r]
    rows = [r for r in rows if "failed" not in r]
    for row in rows:
        stored = {p["program"]: p["plan"] for p in row["programs"]}
        planned = plan_programs(row) if replan else stored
        mesh = "/".join(str(row["mesh"][a]) for a in ("data", "fsdp", "tensor"))
        fits = {True: "yes", False: "no", None: "unknown"}[row["fits_as_configured"]]
        for p in row["programs"]:
            plan = planned.get(p["program"])
            head = (
                f"| {_name(row)} | {row['rate']} | {row['target']} | {mesh} | "
                f"{row['micro_batch'] or 'whole'} | {p['program']} | "
            )
            if p["error"]:  # refused: libtpu names the temporaries it needed, not the arguments
                lines.append(
                    f"{head}refused | needs {_gib(p['temporaries'])} | | | {_gib(plan)} | - | "
                    f"{p['compile_s']} | {fits} | {row.get('commit', '?')} |"
                )
                continue
            ratio = plan / p["total"] if plan and p["total"] else None
            if ratio is not None:
                worst = max(worst, abs(ratio - 1))
            lines.append(
                f"{head}{_gib(p['arguments'])} | "
                f"{_gib(p['temporaries'])} | {_gib(p['total'])} | {_gib(p['peak'])} | "
                f"{_gib(plan)} | {'-' if ratio is None else f'{ratio:.2f}'} | {p['compile_s']} | "
                f"{fits} | {row.get('commit', '?')} |"
            )
    for r in failed:
        lines.append(
            f"| {_name(r)} | {r['rate']} | {r['target']} | - | - | all | the compile process "
            f"died ({r['failed']}) | | | | | | | - | {r.get('commit', '?')} |"
        )
    lines += [
        "",
        f"Largest |plan/compiled - 1| over all programs the compiler accepted: {worst:.3f} "
        f"(target {PLAN_TOLERANCE:.2f}).",
        "",
    ]
    done = {key_of(r) for r in rows} | {key_of(r) for r in failed}
    missing = [c for c in spec["cases"] if c not in done]
    if missing:  # the suite's cases this store has no row for (not compiled yet)
        lines += [
            f"Not compiled in the runs stored here ({len(missing)} of {len(spec['cases'])} cases): "
            + ", ".join(
                f"{c}{' + LoRA' if v == 'lora' else ''} p={p} {t}" for c, p, t, v in missing
            )
            + ".",
            "",
        ]
    lines += _fit_lines(rows) + _flops_lines(rows) + _before_lines(rows, before) + _notes()
    text = "\n".join(lines) + "\n"
    (out / f"{spec['store']}.md").write_text(text)
    return text


def _name(row: dict) -> str:
    variant = row.get("variant", "full")
    if variant.startswith("model="):
        return f"{row['config']} ({variant.removeprefix('model=')})"
    return row["config"] + {"lora": " + LoRA", "compact": " + compact"}.get(variant, "")


def _fits_searched(row: dict) -> bool:
    """A micro-batch was found for the update and every other program fits as it is (the sampler
    and the reference do not change with the micro-batch)."""
    usable = (row["hbm_bytes"] or 0) * row.get("usable_fraction", 0.9)
    others = [p for p in row["programs"] if p["program"] not in ("train_step", "step")]
    fit = all(not p["error"] and p["peak"] is not None and p["peak"] <= usable for p in others)
    return row["micro_batch_found"] is not None and fit


def _fit_lines(rows: list[dict]) -> list[str]:
    out = [
        "## What fits",
        "",
        "| config | p | topology | HBM per device | run peak | fits as configured | "
        "largest micro-batch that fits (compiled) | case s (compiles and search) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        found = r["micro_batch_found"]
        out.append(
            f"| {_name(r)} | {r['rate']} | {r['target']} | {_gib(r['hbm_bytes'])} | "
            f"{_gib(r['run_peak'])} | "
            f"{ {True: 'yes', False: 'no', None: 'unknown'}[r['fits_as_configured']] } | "
            f"{'none' if found is None else found} | {r.get('seconds', '-')} |"
        )
    smallest: dict[tuple, str] = {}
    for r in sorted(rows, key=lambda r: r["devices"] * (r["hbm_bytes"] or 0)):
        key = (_name(r), r["rate"])
        if key not in smallest and (r["fits_as_configured"] or _fits_searched(r)):
            smallest[key] = r["target"]
    out += (
        [""]
        + [
            f"- {c} at p = {p}: the smallest listed topology that fits (by HBM in all) is {t}."
            for (c, p), t in sorted(smallest.items())
        ]
        + [""]
    )
    return out


def _flops_lines(rows: list[dict]) -> list[str]:
    out = [
        "## FLOPs per step and the least step time (roofline, datasheet figures)",
        "",
        "| config | p | topology | "
        + " | ".join(("rollout", "ref_logps", "update"))
        + " | least s per step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        by = {ph["phase"]: ph for ph in r["phases"]}
        cells = [
            f"{by[n]['flops']:.2e} FLOPs, {by[n].get('bound_s', 0):.2f} s" if n in by else "-"
            for n in ("rollout", "ref_logps", "update")
        ]
        total = sum(ph.get("bound_s", 0.0) for ph in r["phases"])
        out.append(
            f"| {_name(r)} | {r['rate']} | {r['target']} | "
            + " | ".join(cells)
            + f" | {total:.1f} |"
        )
    return out + [""]


def _before_lines(rows: list[dict], before: list[dict]) -> list[str]:
    """Earlier compiles of the same cases (`before` in aot_tpu.json, with the commit they ran at)
    beside today's: what a change of the code did to the compiled memory."""
    if not before:
        return []
    now = {(r["config"], r["rate"], r["target"]): r for r in rows}
    out = [
        "## Before and after",
        "",
        "| config | p | topology | program | before: commit, total | now: total | run peak before -> now |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in before:
        r = now.get((b["config"], b["rate"], b["target"]))
        if r is None or r["mesh"] != b["mesh"] or r["micro_batch"] != b["micro_batch"]:
            continue  # compare like with like: the same mesh and micro-batch
        totals = {p["program"]: p["total"] for p in r["programs"]}
        for p in b["programs"]:
            out.append(
                f"| {b['config']} | {b['rate']} | {b['target']} | {p['program']} | "
                f"{b['commit']}: {_gib(p['total'])} | {_gib(totals.get(p['program']))} | "
                f"{_gib(b['run_peak'])} -> {_gib(r['run_peak'])} |"
            )
    return [*out, ""]


def _notes() -> list[str]:
    return [
        "## What a compile cannot tell",
        "",
        "- Time: the compiler says what fits, not how fast it runs. The step times above are lower "
        "bounds from the datasheet peak FLOP/s and HBM bandwidth; real kernels, collectives over "
        "ICI, the host and the decode loop's overheads make a step slower, often several times.",
        "- Collectives' speed and the overlap of communication with compute.",
        "- Runtime memory outside the program: fragmentation, the runtime's reserve (the plan "
        "keeps 10% aside), host memory. v4 is compiled one device per chip (megacore), as a v4 "
        "slice runs.",
        "",
    ]


def run_case(case: dict) -> dict:
    env_cmd = [sys.executable, __file__, "--one", json.dumps(case)]
    # Compile seconds are measured: no program loaded from a persistent compilation cache (a caller's,
    # e.g. the test suite's) instead of compiled.
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false"
    )
    proc = subprocess.run(env_cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(_common.RESULT_TAG):
            return json.loads(line[len(_common.RESULT_TAG) :])
    # A compile that dies (a signal from libtpu, no Python error) is recorded, and the others go on.
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    print(f"case {case} failed with exit code {proc.returncode}: {tail}", file=sys.stderr)
    return {**case, "failed": f"exit code {proc.returncode}: {tail}", "commit": _commit()}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--cases", nargs="*", help="config:p:topology (topology may hold a colon)")
    ap.add_argument("--render", action="store_true", help="only write the tables from the JSON")
    ap.add_argument(
        "--replan", action="store_true", help="the current code's plan beside the compiles"
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--suite", choices=sorted(SUITES), default="tpu")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        _common.emit(measure(json.loads(args.one)))
        return []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"{SUITES[args.suite]['store']}.json"
    data = json.loads(store.read_text()) if store.is_file() and not args.quick else {"rows": []}
    if args.cases:  # config[+lora]:p:target
        wanted = []
        for c in args.cases:
            config, rate, target = c.split(":", 2)
            name, _, variant = config.partition("+")
            wanted.append((name, rate, target, variant or "full"))
    elif args.quick:
        wanted = QUICK
    else:
        wanted = SUITES[args.suite]["cases"]
    info = {**_common.machine(), "load_before": _common.load_average()}
    if not args.render:
        for config, rate, target, variant in wanted:
            case = {
                "config": config,
                "rate": rate,
                "target": target,
                "variant": variant,
                "overrides": overrides_of(config, rate, variant)
                + (QUICK_SHAPES if args.quick else []),
            }
            row = run_case(case)
            data["rows"] = [r for r in data["rows"] if key_of(r) != key_of(case)]
            data["rows"].append(row)
            order = {
                k: i
                for i, k in enumerate(SUITES[args.suite]["cases"] + QUICK + SUITES["tpu"]["cases"])
            }
            data["rows"].sort(key=lambda r: order.get(key_of(r), 999))
            data["quick"] = bool(args.quick)
            store.write_text(json.dumps(data, indent=1))
            print(
                f"{config} p={rate} {target}: {row.get('seconds', '-')} s, "
                f"fits {row.get('fits_as_configured', row.get('failed'))}",
                flush=True,
            )
    info["load_after"] = _common.load_average()
    if args.render and data.get("machine"):  # the machine the stored rows were compiled on
        info = data["machine"]
    elif not args.render:
        data["machine"] = info
        store.write_text(json.dumps(data, indent=1))
    render(data["rows"], out, info, data.get("before", []), replan=args.replan, suite=args.suite)
    return data["rows"]


if __name__ == "__main__":
    main()
