"""What fits on a target, found by its compiler: a mesh, the largest micro-batch and question batch.

`fit(cfg, target)` compiles `cfg`'s programs for `target` (`aot.compile_run`) on the config's mesh, or,
when the config keeps the default mesh, on the layout `compiled_memory.pick_mesh` prefers for that
many devices.
Then, where the run does not fit or fits with room, it compiles the train step and the fused step at
other micro-batches (`largest_fitting`: a bisection, log2 of the candidates) and the embedded sampler
at more questions per step, and returns a `Report` with the plan's figures beside the compiler's and
the roofline phases.
"""

from __future__ import annotations

import dataclasses

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.schema import Config
from cppo_jax.planning.aot import Compiled, compile_program, compile_run, target_devices

# The programs whose memory `trainer.micro_batch` sets: the fused step every step runs and its train
# step alone (a packed step whose sequences overflow its rows runs the phases apart); a micro-batch
# fits when both do.
UPDATE_PROGRAMS = ("train_step", "step")


@dataclasses.dataclass(frozen=True)
class Report:
    """What `fit` found: the compiled programs, the plan beside them, and the overrides that fit."""

    cfg: Config
    compiled: Compiled
    hbm_bytes: int | None  # per device (None: unknown, e.g. `cpu` without --device-memory-gb)
    planned: dict[str, int]  # the memory plan's figure per program
    phases: list  # roofline.Phase
    device: object  # roofline.Device | None
    micro_batch: int | None = None  # the largest that fits (None: not searched or none fits)
    questions: int | None = None  # the largest questions_per_step whose sampler fits
    tried: tuple[tuple[str, int, bool], ...] = ()  # (what, value, fits) in the order compiled
    rows: int = 0  # the kept sequences of a step (M): trainer.micro_batch=M is the whole batch
    fraction: float = 0.9  # of hbm_bytes a run may use (`layout.usable_fraction` of the platform)

    @property
    def usable(self) -> int | None:
        return _usable(self.hbm_bytes, self.fraction)

    @property
    def fits(self) -> bool | None:
        if self.hbm_bytes is None:
            return None
        c = self.compiled
        return not c.refused and c.run_peak <= self.usable


def usable_fraction(platform: str) -> float:
    """Of a device's memory, what a run may plan for: `layout.GPU_MEM_FRACTION` on a GPU (what JAX's
    allocator takes), `layout.USABLE` on a TPU or CPU."""
    from cppo_jax.planning.memory import GPU_MEM_FRACTION, USABLE

    return GPU_MEM_FRACTION if platform in ("cuda", "gpu") else USABLE


def _usable(hbm: int | None, fraction: float) -> int | None:
    return None if hbm is None else int(fraction * hbm)


def _with_mesh(cfg: Config, n: int, hbm: int | None, target: str = "") -> Config:
    """`cfg` with its mesh for `n` devices: the config's own (checked), or, when it keeps the default,
    the layout `compiled_memory.pick_mesh` prefers (the launch's `mesh=auto` choice, judged on the
    run peak for `target`'s compiler); when none fits, or without a memory size, the layout of the
    smallest peak (the micro-batch search starts there)."""
    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.config.run import MeshConfig
    from cppo_jax.planning import compiled_memory

    if cfg.mesh != MeshConfig():
        cfg.mesh.sizes(n)  # raises naming the keys
        return cfg
    sh = shapes_of(cfg)
    plans = compiled_memory.pick_mesh(cfg, compiled_memory.planned_model(cfg), sh, n, hbm, target)
    if not plans:
        raise ConfigError(
            f"no layout of the {n} devices has data x fsdp dividing the {sh.Q} questions per step: "
            f"set mesh.data / mesh.fsdp / mesh.tensor (product {n}) or cppo.questions_per_step"
        )
    best = plans[0] if plans[0].fits else min(plans, key=lambda p: p.peak)
    return dataclasses.replace(cfg, mesh=MeshConfig(**best.mesh))


def _divisors_for(M: int, dp: int) -> list[int]:
    """Micro-batch sizes the step accepts on dp data-parallel devices, largest first (M: whole)."""
    return [m for m in range(M, 0, -1) if M % m == 0 and m % dp == 0]


def largest_fitting(sizes: list[int], fits, known: dict[int, bool]) -> int | None:
    """The largest of the ascending `sizes` for which `fits(size)`, None if none does, given that a
    smaller size never needs more memory: the smallest is tried first when nothing known fits, then
    a bisection between the largest known to fit and the smallest known not to (log2 calls)."""
    lo, hi = -1, len(sizes)  # sizes[lo] fits (-1: none known), sizes[hi] does not (len: none)
    for size, ok in known.items():
        if size in sizes:
            i = sizes.index(size)
            lo, hi = (max(lo, i), hi) if ok else (lo, min(hi, i))
    if lo < 0:
        if hi == 0 or not fits(sizes[0]):
            return None
        lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(sizes[mid]) else (lo, mid)
    return sizes[lo]


def _set(cfg: Config, section: str, **kw) -> Config:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


def fit(
    cfg: Config,
    target: str,
    *,
    hbm_bytes: int | None = None,
    search: bool = True,
    search_questions: bool = True,
) -> Report:
    """Compile `cfg` for `target` and, with `search`, find the largest micro-batch (and questions
    per step for the embedded sampler) that the compiler fits in the device's memory."""
    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.planning import roofline
    from cppo_jax.planning.compiled_memory import planned_model as model_config
    from cppo_jax.planning.compiled_memory import program_bytes
    from cppo_jax.train.programs import build

    devices = target_devices(target)
    device = roofline.device_of(devices)
    hbm = hbm_bytes or (device.hbm_bytes if device else None)
    fraction = usable_fraction(devices[0].platform)
    cfg = _with_mesh(cfg, len(devices), hbm, target)
    compiled = compile_run(cfg, target, devices)
    sh, tcfg = shapes_of(cfg), model_config(cfg)
    mesh = cfg.mesh.sizes(len(devices))
    phases = roofline.step_phases(
        tcfg,
        sh,
        mu=cfg.cppo.mu,
        beta=cfg.cppo.beta,
        overlap=bool(cfg.rollout.overlap),
        embedded=cfg.rollout.backend == "embedded",
        tp=mesh["tensor"],
    )
    planned = program_bytes(cfg, tcfg, sh, mesh, target)
    report = Report(cfg, compiled, hbm, planned, phases, device, rows=sh.M, fraction=fraction)
    if not search or hbm is None:
        return report
    usable, tried = report.usable, []

    def train_fits(m: int) -> bool:
        c = _set(cfg, "trainer", micro_batch=0 if m == sh.M else m)
        built = build(c, devices).programs
        progs = [compile_program(n, *built[n]) for n in UPDATE_PROGRAMS if n in built]
        ok = all(not p.error and compiled.peak(p) <= usable for p in progs)
        tried.append(("trainer.micro_batch", m, ok))
        return ok

    sizes = sorted(_divisors_for(sh.M, mesh["data"] * mesh["fsdp"]))
    sizes = [sh.M] if cfg.trainer.pack else sizes  # packed rows: one forward, no micro-batches
    configured = cfg.trainer.micro_batch or sh.M
    ok = all(
        not p.error and compiled.peak(p) <= usable
        for p in compiled.programs
        if p.name in UPDATE_PROGRAMS
    )
    tried.append(("trainer.micro_batch", configured, ok))
    best_m = largest_fitting(sizes, train_fits, {configured: ok})
    best_q = _search_questions(cfg, devices, compiled, usable, tried) if search_questions else None
    return dataclasses.replace(report, micro_batch=best_m, questions=best_q, tried=tuple(tried))


def _search_questions(cfg: Config, devices, compiled: Compiled, usable: int, tried) -> int | None:
    """The largest cppo.questions_per_step (doubling from the config's, at most 8x) whose embedded
    sampler fits beside the run's state; None without an embedded sampler or when none fits."""
    from cppo_jax.train.programs import build

    if "sampler" not in compiled.args_of:
        return None
    b0, best = cfg.cppo.questions_per_step, None
    sampler = next(p for p in compiled.programs if p.name == "sampler")
    ok = not sampler.error and compiled.peak(sampler) <= usable
    tried.append(("cppo.questions_per_step", b0, ok))
    if not ok:
        return None
    best, b = b0, b0 * 2
    while b <= 8 * b0:
        try:
            fn, args = build(_set(cfg, "cppo", questions_per_step=b), devices).programs["sampler"]
        except ConfigError:  # the questions no longer split over the mesh
            break
        prog = compile_program("sampler", fn, args)
        ok = not prog.error and compiled.peak(prog) <= usable
        tried.append(("cppo.questions_per_step", b, ok))
        if not ok:
            break
        best, b = b, b * 2
    return best
