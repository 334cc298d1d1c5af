"""The text of `python -m cppo_jax.plan --compile-for TARGET`: `aot.fit`'s findings for a person."""

from __future__ import annotations

from cppo_jax.config.model import LORA_RECIPE
from cppo_jax.planning import roofline
from cppo_jax.planning.aot import compiler_version
from cppo_jax.planning.compiled_memory import calibration_note
from cppo_jax.planning.fit import UPDATE_PROGRAMS, Report
from cppo_jax.planning.memory import mesh_overrides


def _gib(n: float | None) -> str:
    """Bytes as GiB ("7.51G"), or MiB under 0.1 GiB ("12.3M")."""
    if n is None:
        return "?"
    return f"{n / 2**30:.2f}G" if n >= 2**30 / 10 else f"{n / 2**20:.1f}M"


def _ratio(plan: int | None, compiled: int) -> str:
    return "-" if not plan or not compiled else f"{plan / compiled:.2f}"


def program_rows(report: Report) -> list[dict]:
    """One row per program: the compiler's bytes per device, the plan's, compile seconds."""
    c = report.compiled
    rows = []
    for p in c.programs:
        rows.append(
            {
                "program": p.name,
                "arguments": p.arguments,
                "outputs": p.outputs,
                "donated": p.aliased,
                "temporaries": p.temporaries,
                "total": p.total,
                "peak": c.peak(p),
                "plan": report.planned.get(p.name),
                "compile_s": round(p.seconds, 1),
                "error": p.error,
            }
        )
    return rows


def phase_rows(report: Report) -> list[dict]:
    """FLOPs per phase and, on a known chip, the least time it can take (`roofline`)."""
    n, dev = report.compiled.devices, report.device
    rows = []
    for ph in report.phases:
        row = {"phase": ph.name, "flops": ph.flops}
        if dev is not None:
            row["bound_s"] = roofline.bound_seconds(ph, dev, n)
        rows.append(row)
    return rows


def _fraction_note(report: Report) -> str:
    from cppo_jax.planning.memory import GPU_MEM_FRACTION

    if report.fraction != GPU_MEM_FRACTION or report.compiled.platform not in ("cuda", "gpu"):
        return ""
    return f": JAX's XLA_PYTHON_CLIENT_MEM_FRACTION={GPU_MEM_FRACTION}"


def lines(report: Report) -> list[str]:
    c, dev = report.compiled, report.device
    where = f"{c.devices} x {c.device_kind}"
    if dev is not None:
        where += (
            f" ({dev.share} device(s) per chip; {_gib(dev.hbm_bytes)} HBM, "
            f"{dev.flops / 1e12:.0f} TFLOP/s bf16, {dev.bandwidth / 1e9:.0f} GB/s per device; "
            f"{dev.chip.source})"
        )
    M = report.cfg.trainer.micro_batch
    out = [
        f"compiled for {c.target}: {where}",
        f"  {calibration_note(c.platform, compiler_version(c.platform))}",
        f"  mesh {mesh_overrides(c.mesh)}; trainer.micro_batch={M} "
        f"({'the whole batch' if not M else f'{M} rows per micro-batch'})",
        "  per device         arguments  outputs  donated  temporaries    total   +state     peak"
        "     plan  plan/compiled  compile s",
    ]
    if report.cfg.trainer.pack:  # the rows the train step and log-prob forwards were compiled for
        from cppo_jax.algo.cppo import shapes_of
        from cppo_jax.packing.plan import config_choice

        dp = c.mesh["data"] * c.mesh["fsdp"]
        choice = config_choice(report.cfg, shapes_of(report.cfg), dp)
        out[1] += f"; trainer.pack: R={choice.rows} rows of L={choice.length} tokens"
    for r in program_rows(report):
        if r["error"]:
            out.append(f"  {r['program']:<16} REFUSED by the compiler: {r['error']}")
            continue
        out.append(
            f"  {r['program']:<16} {_gib(r['arguments']):>9} {_gib(r['outputs']):>8} "
            f"{_gib(r['donated']):>8} {_gib(r['temporaries']):>12} {_gib(r['total']):>8} "
            f"{_gib(r['peak'] - r['total']):>8} {_gib(r['peak']):>8} {_gib(r['plan']):>8} "
            f"{_ratio(r['plan'], r['total']):>14} {r['compile_s']:>10}"
        )
    out.append(
        "  (+state: the run's state alive beside the program but not its argument: "
        + ", ".join(f"{k} {_gib(v)}" for k, v in c.resident.items())
        + ")"
    )
    hbm = report.hbm_bytes
    if hbm is None:
        out.append(
            f"fits: unknown (device memory unknown; run peak {_gib(c.run_peak)} per device; "
            f"give --device-memory-gb)"
        )
    else:
        verdict = "yes" if report.fits else "no"
        refused = " (the compiler refused a program)" if c.refused else ""
        out.append(
            f"fits: {verdict}{refused} (run peak {_gib(c.run_peak)} per device of "
            f"{_gib(hbm)}, {report.fraction:.0%} usable{_fraction_note(report)})"
        )
    out.append("FLOPs per step (from the model) and the least time per phase:")
    total = 0.0
    for r in phase_rows(report):
        bound = r.get("bound_s")
        total += bound or 0.0
        tail = f", at best {bound:.2f} s" if bound is not None else ""
        out.append(f"  {r['phase']:<10} {r['flops']:.3e} FLOPs{tail}")
    if dev is not None:
        out.append(
            f"  at best {total:.1f} s per step on {c.devices} x {dev.chip.name} (datasheet peak "
            f"and HBM bandwidth; collectives, kernels and the host make a real step slower)"
        )
    out.extend(_search_lines(report))
    return out


def _search_lines(report: Report) -> list[str]:
    if not report.tried:
        return []
    out = [
        "searched with the compiler: "
        + ", ".join(f"{k.split('.')[-1]}={v} {'fits' if ok else 'no'}" for k, v, ok in report.tried)
    ]
    if report.micro_batch is None:
        out.append(
            "  no micro-batch fits: lower rollout.max_new_tokens, set cppo.beta=0, or use a "
            "larger topology"
        )
    else:
        m = 0 if report.micro_batch == report.rows else report.micro_batch
        out.append(f"  largest micro-batch that fits: trainer.micro_batch={m}")
    if report.questions is not None:
        out.append(
            f"  largest questions per step whose sampler fits (up to 8x tried): "
            f"cppo.questions_per_step={report.questions}"
        )
    return out


def fit_overrides(report: Report) -> str:
    """The overrides with which every program fits (the mesh used and the micro-batch found), or
    "" when the search found none (or the config already fits)."""
    c, usable = report.compiled, report.usable
    if usable is None or report.micro_batch is None:
        return ""
    others = [p for p in c.programs if p.name not in UPDATE_PROGRAMS]
    if any(p.error or c.peak(p) > usable for p in others):
        return ""
    m = 0 if report.micro_batch == report.rows else report.micro_batch
    return f"{mesh_overrides(c.mesh)} trainer.micro_batch={m}"


def _over(report: Report) -> list:
    c, usable = report.compiled, report.usable or 0
    return [p for p in c.programs if p.error or c.peak(p) > usable]


def _names(report: Report, over: list) -> str:
    c = report.compiled
    return ", ".join(f"{p.name} ({'refused' if p.error else _gib(c.peak(p))})" for p in over)


def no_fit_message(report: Report, lora: Report | None = None) -> str:
    """Why nothing fits, naming the keys to change; `lora`: LoRA's recipe compiled too (it did not
    fit either), named in place of the plan's LoRA figure."""
    c = report.compiled
    over = _over(report)
    names = _names(report, over)
    hints = []
    if any(p.name in UPDATE_PROGRAMS for p in over):
        hints.append("no trainer.micro_batch fits the train step")
        if lora is None:
            hints.extend(_lora_hint(report))
        else:
            hints.append(
                f"nor does LoRA's recipe ({' '.join(LORA_RECIPE)}), compiled: "
                f"{_names(lora, _over(lora))}"
            )
    if any(p.name == "sampler" for p in over):
        hints.append("the embedded sampler does not fit (rollout.backend=vllm moves it off)")
    return (
        f"on {c.target} ({c.devices} devices of {_gib(report.hbm_bytes)}, "
        f"{report.fraction:.0%} usable{_fraction_note(report)}) "
        f"with {mesh_overrides(c.mesh)} these do not fit: {names}; "
        + "; ".join(hints)
        + "; lower rollout.max_new_tokens or data.max_prompt_len, set cppo.beta=0, or compile "
        "for a larger topology"
    )


def lora_verdict(lora: Report) -> str:
    """The one-line verdict when full fine-tuning fits nowhere and LoRA's recipe, compiled, does."""
    c = lora.compiled
    how = (
        f"as configured (run peak {_gib(c.run_peak)} of {_gib(lora.usable)} usable)"
        if lora.fits
        else f"at trainer.micro_batch={lora.micro_batch} of {lora.rows} rows"
    )
    return f"full fine-tuning does not fit {c.target}; LoRA fits {how}"


def _lora_hint(report: Report) -> list[str]:
    """For full fine-tuning that does not fit: what LoRA would need, by the plan (adapters trained,
    the base frozen in the compute dtype with no AdamW state or gradient of its own)."""
    import dataclasses

    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.planning.compiled_memory import planned_model, run_peak

    cfg = report.cfg
    if cfg.model.lora.enabled or report.usable is None:
        return []
    try:  # (a config LoRA cannot take, packed rows for one, gets no hint)
        lora = dataclasses.replace(
            cfg,
            model=dataclasses.replace(
                cfg.model, lora=dataclasses.replace(cfg.model.lora, enabled=True)
            ),
        )
        mesh, target = report.compiled.mesh, report.compiled.target
        peak = run_peak(lora, planned_model(lora), shapes_of(lora), mesh, target)
    except (ConfigError, ValueError):  # or a model the plan cannot size: no figure to offer
        return []
    return [
        f"LoRA adapters instead (model.lora.enabled=true, rank {cfg.model.lora.rank}) need about "
        f"{_gib(peak)} per device by the plan ({_gib(report.usable)} usable; the plan is an "
        f"estimate, docs/aot.md): add it to this command to have the compiler answer"
    ]


def as_json(report: Report) -> dict:
    """The report as data (`--json`): programs, phases, fits and the overrides found."""
    c = report.compiled
    return {
        "target": c.target,
        "devices": c.devices,
        "device_kind": c.device_kind,
        "mesh": c.mesh,
        "micro_batch": report.cfg.trainer.micro_batch,
        "hbm_bytes": report.hbm_bytes,
        "usable_fraction": report.fraction,
        "resident": c.resident,
        "run_peak": c.run_peak,
        "fits": report.fits,
        "programs": program_rows(report),
        "phases": phase_rows(report),
        "tried": [list(t) for t in report.tried],
        "micro_batch_found": report.micro_batch,
        "questions_found": report.questions,
        "fit_overrides": fit_overrides(report),
    }
