"""XLA profiling helpers: named phases, a trace window over chosen steps, HLO dumps, compilation counts.

- `phase(name, times)`: a context manager that opens `jax.profiler.TraceAnnotation(name)` (so the phase
  shows as a named span in a trace) and adds its wall time in seconds to `times[name]`. The trainer's
  phases are `PHASES`: rollout, reward, ref_logps, old_logps, update, weight_sync. Wall time is only
  meaningful when the code inside blocks on its results (`jax.block_until_ready`).
- `Tracer(run_dir, steps=(first, last))`: `maybe_start(step)` calls `jax.profiler.start_trace` on
  `<run_dir>/profile` when `step` enters the window, `maybe_stop(step)` calls `jax.profiler.stop_trace`
  after `last`; `close()` stops a trace left open (a run that ended or failed inside the window). The trace
  (`plugins/profile/<time>/<host>.xplane.pb` and `<host>.trace.json.gz`) opens in TensorBoard's profile
  plugin, in XProf, or (the `.trace.json.gz`) in Perfetto / chrome://tracing.
- `dump_hlo(jitted_fn, args, out_dir, name)`: writes the optimized HLO of one compiled program
  (`fn.lower(*args).compile().as_text()`) and its StableHLO before optimization; returns size, FLOP and
  memory figures.
- `compiled_programs_report()`: XLA compilations in this process, counted by a `jax.monitoring` listener
  (installed when this module is imported), per program name with compile time, plus the sizes of the
  programs dumped with `dump_hlo`. For every module XLA compiles, set
  `XLA_FLAGS=--xla_dump_to=DIR` before starting Python.
"""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

# How many jitted programs of one kind (train steps, samplers, probes) a process keeps for reuse, the
# least recently used dropped first. Each compiled XLA:CPU program holds a dozen or more memory mappings:
# a process that builds many runs (a notebook, a sweep, the test suite) and kept them all would reach the
# kernel's limit (vm.max_map_count, 65530 by default), where LLVM's next compile fails ("Cannot allocate
# memory") and takes the process down with a segmentation fault.
KEPT_PROGRAMS = 8

__all__ = [
    "KEPT_PROGRAMS",
    "PHASES",
    "PhaseTimer",
    "Tracer",
    "compiled_programs_report",
    "dump_hlo",
    "format_programs_report",
    "phase",
    "reset_compiled_programs",
    "trace_contains",
    "trace_files",
]

# The phases of one CPPO step, in order (cppo_jax/train/trainer.py).
PHASES = ("rollout", "reward", "ref_logps", "old_logps", "update", "weight_sync")

# ----------------------------------------------------------------------------------------------
# Phases.


class PhaseTimer:
    """What `phase` yields: the phase's name and, once it has ended, its wall time in seconds."""

    __slots__ = ("name", "seconds", "start")

    def __init__(self, name: str):
        self.name = name
        self.start = time.perf_counter()
        self.seconds: float | None = None


@contextlib.contextmanager
def phase(name: str, times: dict[str, float] | None = None) -> Iterator[PhaseTimer]:
    """A named span in the XLA trace and a wall-clock timer; adds its seconds to `times[name]`.

    Seconds are added (not assigned), so a phase entered several times in a step (one per update, say)
    reports its total. The time is recorded when the block raises too.
    """
    timer = PhaseTimer(name)
    with jax.profiler.TraceAnnotation(name):
        try:
            yield timer
        finally:
            timer.seconds = time.perf_counter() - timer.start
            if times is not None:
                times[name] = times.get(name, 0.0) + timer.seconds


# ----------------------------------------------------------------------------------------------
# Trace window.


class Tracer:
    """Records an XLA trace of the steps `first..last` (inclusive) under `<run_dir>/profile`.

    Steps are whatever numbering the caller passes to `maybe_start` / `maybe_stop` (the trainer passes
    the same numbers the user configured in `trainer.profile_steps`). `steps=()` disables tracing. A run
    resumed inside the window starts tracing at its first step there; one resumed after it traces nothing.
    Only one trace may be active per process (a JAX rule).
    """

    def __init__(self, run_dir: str | Path, steps: Sequence[int] = ()):
        steps = tuple(int(s) for s in steps)
        if steps and (len(steps) != 2 or steps[0] > steps[1] or steps[0] < 0):
            raise ValueError(
                f"profile steps must be () or (first, last) with 0 <= first <= last, got {steps}"
            )
        self.steps = steps
        self.directory = Path(run_dir) / "profile"
        self.active = False
        self.done = False
        self._dumped: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.steps)

    def maybe_start(self, step: int) -> bool:
        """Start the trace when `step` is inside the window and no trace was taken yet; True if started."""
        if not self.steps or self.active or self.done:
            return False
        first, last = self.steps
        if not first <= step <= last:
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory))
        self.active = True
        return True

    def maybe_stop(self, step: int) -> bool:
        """Stop the trace once `step` reaches the window's last step; True if stopped."""
        if not self.active or step < self.steps[1]:
            return False
        self.close()
        return True

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """`maybe_start(step)`, the body under `jax.profiler.StepTraceAnnotation`, `maybe_stop(step)`."""
        self.maybe_start(step)
        try:
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                yield
        finally:
            self.maybe_stop(step)

    def close(self) -> None:
        """Stop an active trace (writes its files); safe to call at any time, more than once."""
        if self.active:
            self.active = False
            self.done = True
            jax.profiler.stop_trace()

    def files(self) -> list[Path]:
        return trace_files(self.directory)

    def dump_hlo_once(self, jitted_fn, args: Sequence[Any], name: str) -> None:
        """While a trace runs: `dump_hlo` of `jitted_fn` for arguments like `args` under `<trace>/hlo`,
        once per name. Only shapes, dtypes and shardings are read (call it before a donating call)."""
        if not self.active or name in self._dumped:
            return
        like = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array)
                else x
            ),
            tuple(args),
        )
        dump_hlo(jitted_fn, like, self.directory / "hlo", name)
        self._dumped.add(name)


def trace_files(profile_dir: str | Path) -> list[Path]:
    """The trace files written under a profile folder (`*.xplane.pb`, `*.trace.json.gz`), sorted."""
    root = Path(profile_dir)
    found = [*root.rglob("*.xplane.pb"), *root.rglob("*.trace.json.gz")]
    return sorted(p for p in found if p.is_file())


def trace_contains(profile_dir: str | Path, names: Sequence[str]) -> dict[str, bool]:
    """For each name, whether it occurs in any trace file under `profile_dir` (gunzipped if needed).

    A quick check that annotations reached the trace; for reading a trace use TensorBoard or XProf.
    """
    found = dict.fromkeys(names, False)
    for file in trace_files(profile_dir):
        data = file.read_bytes()
        if file.name.endswith(".gz"):
            data = gzip.decompress(data)
        for name in names:
            found[name] = found[name] or name.encode() in data
    return found


# ----------------------------------------------------------------------------------------------
# HLO dumps.

_DUMPED: dict[str, dict[str, Any]] = {}


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def dump_hlo(
    jitted_fn,
    args: Sequence[Any],
    out_dir: str | Path,
    name: str,
    kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Compile `jitted_fn(*args, **kwargs)` and write its HLO; returns size statistics.

    Writes `<out_dir>/<name>.hlo.txt` (the optimized HLO XLA runs: `lower(...).compile().as_text()`) and
    `<out_dir>/<name>.stablehlo.mlir` (what JAX handed to XLA). Nothing is executed and no argument is
    consumed (donation applies to calls only); `args` may be arrays or `jax.ShapeDtypeStruct`s. A program
    a call already compiled for the same shapes is reused, not compiled again.

    Returns {"name", "path", "hlo_bytes", "hlo_lines", "hlo_instructions", "stablehlo_bytes", "flops",
    "generated_code_bytes", "argument_bytes", "output_bytes", "temp_bytes"}; a figure the backend does
    not report is None.
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"dump_hlo: name must be a plain file name, got {name!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lowered = jitted_fn.lower(*args, **dict(kwargs or {}))
    stablehlo = lowered.as_text()
    compiled = lowered.compile()
    hlo = compiled.as_text() or ""
    path = out / f"{name}.hlo.txt"
    path.write_text(hlo)
    (out / f"{name}.stablehlo.mlir").write_text(stablehlo)
    lines = hlo.splitlines()
    stats: dict[str, Any] = {
        "name": name,
        "path": str(path),
        "hlo_bytes": len(hlo.encode()),
        "hlo_lines": len(lines),
        # An instruction is a line "name = type op(...)" (ROOT ones included).
        "hlo_instructions": sum(1 for line in lines if " = " in line and "(" in line),
        "stablehlo_bytes": len(stablehlo.encode()),
        "flops": None,
        "generated_code_bytes": None,
        "argument_bytes": None,
        "output_bytes": None,
        "temp_bytes": None,
    }
    with contextlib.suppress(Exception):  # not every backend implements the analyses
        cost = compiled.cost_analysis()
        if isinstance(cost, Sequence) and cost:  # older JAX: one dict per device program
            cost = cost[0]
        if isinstance(cost, Mapping):
            stats["flops"] = _number(cost.get("flops"))
    with contextlib.suppress(Exception):
        mem = compiled.memory_analysis()
        for key, attr in (
            ("generated_code_bytes", "generated_code_size_in_bytes"),
            ("argument_bytes", "argument_size_in_bytes"),
            ("output_bytes", "output_size_in_bytes"),
            ("temp_bytes", "temp_size_in_bytes"),
        ):
            stats[key] = _number(getattr(mem, attr, None))
    with _LOCK:
        _DUMPED[name] = dict(stats)
    return stats


# ----------------------------------------------------------------------------------------------
# Compilations (jax.monitoring).


def compile_cache_folder(setting: str) -> Path | None:
    """The persistent compilation cache folder of `trainer.compile_cache_dir` (None: off)."""
    import os

    if setting in ("", "none"):
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cppo_jax" / "xla"


def use_compile_cache(setting: str) -> Path | None:
    """Point JAX's persistent compilation cache at `compile_cache_folder(setting)`.

    `cppo_jax.launch` calls it before its run compiles. JAX keeps the answer of its first compile
    (cache or not), so it is reset here: a process that compiled before uses the cache from now on.
    Every program is stored, however fast it compiled (JAX's default skips those under a second: a
    run's dozens of small programs, seconds in all). Returns the folder, or None when off.
    """
    from jax.experimental.compilation_cache import compilation_cache

    folder = compile_cache_folder(setting)
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # JAX's kept answer "no cache" of an earlier compile
    return folder


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
# A program loaded from the persistent cache reports this, then a "backend compile" that was none.
_CACHE_HIT = "/jax/compilation_cache/cache_retrieval_time_sec"
_LOCK = threading.Lock()
_PROGRAMS: dict[str, dict[str, float]] = {}
_TOTALS = {"compilations": 0, "cache_hits": 0, "compile_s": 0.0, "trace_s": 0.0, "lower_s": 0.0}
_PENDING_HIT = threading.local()


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event not in (_BACKEND_COMPILE, _TRACE, _LOWER, _CACHE_HIT):
        return
    with _LOCK:
        if event == _CACHE_HIT:
            _TOTALS["cache_hits"] += 1
            _PENDING_HIT.value = True
        elif event == _BACKEND_COMPILE:
            if getattr(_PENDING_HIT, "value", False):  # loaded, not compiled
                _PENDING_HIT.value = False
                return
            name = str(kwargs.get("fun_name", "?"))
            entry = _PROGRAMS.setdefault(name, {"compilations": 0, "compile_s": 0.0})
            entry["compilations"] += 1
            entry["compile_s"] += duration
            _TOTALS["compilations"] += 1
            _TOTALS["compile_s"] += duration
        elif event == _TRACE:
            _TOTALS["trace_s"] += duration
        else:
            _TOTALS["lower_s"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def reset_compiled_programs() -> None:
    """Forget the compilations and dumps counted so far (the listener stays installed)."""
    with _LOCK:
        _PROGRAMS.clear()
        _DUMPED.clear()
        _TOTALS.update(compilations=0, cache_hits=0, compile_s=0.0, trace_s=0.0, lower_s=0.0)


def compilations() -> tuple[int, int]:
    """(XLA compilations, programs loaded from the persistent cache) in this process so far."""
    with _LOCK:
        return _TOTALS["compilations"], _TOTALS["cache_hits"]


def compiled_programs_report() -> dict[str, Any]:
    """XLA compilations in this process since import (or the last reset).

    {"compilations": n, "cache_hits": n, "compile_s": s, "trace_s": s, "lower_s": s,
     "programs": [{"name": "jit(train_step)", "compilations": n, "compile_s": s}, ...] (most time first),
     "dumped": [dump_hlo statistics, ...]}.
    A program compiled more than once with the same name usually means new shapes or new static
    arguments: in a CPPO run the counts must stop growing after the first steps.
    """
    with _LOCK:
        programs = [{"name": n, **v} for n, v in _PROGRAMS.items()]
        dumped = [dict(v) for v in _DUMPED.values()]
        totals = dict(_TOTALS)
    programs.sort(key=lambda p: (-p["compile_s"], p["name"]))
    return {**totals, "programs": programs, "dumped": dumped}


def format_programs_report(report: dict[str, Any] | None = None, top: int = 10) -> str:
    """`compiled_programs_report()` as a short markdown table (the `top` slowest programs)."""
    report = report or compiled_programs_report()
    lines = [
        f"{report['compilations']} XLA compilations, {report['compile_s']:.2f} s compiling "
        f"(+ {report['trace_s']:.2f} s tracing, {report['lower_s']:.2f} s lowering)",
        "",
        "| program | compilations | compile s |",
        "| --- | --- | --- |",
    ]
    for p in report["programs"][:top]:
        lines.append(f"| {p['name']} | {p['compilations']} | {p['compile_s']:.2f} |")
    if report["dumped"]:
        lines += [
            "",
            "| dumped program | HLO bytes | instructions | GFLOP |",
            "| --- | --- | --- | --- |",
        ]
        for d in report["dumped"]:
            gflop = "-" if d["flops"] is None else f"{d['flops'] / 1e9:.3f}"
            lines.append(f"| {d['name']} | {d['hlo_bytes']} | {d['hlo_instructions']} | {gflop} |")
    return "\n".join(lines)
