"""A run's programs compiled for a target without its devices, and the memory the compiler reports.

`compile_run(cfg, target)` builds the programs of one training step exactly as the trainer does (the
config's mesh, micro-batch, remat, layer scan, dtypes and shapes; `programs.build`) from abstract params:
no weights are read and nothing is allocated. Each is lowered and compiled by the target's compiler:

- a TPU topology name (`v5e:2x4`, `v5p:2x2x1`, `v4:2x2x1`, `v6e:2x4`, any name JAX accepts): libtpu
  compiles for that slice on this host, deviceless (as MaxText's `train_compile.py` does); a
  one-chip slice (`v5e:1x1`) is given its own host bounds;
- NVIDIA GPUs (`h100:8`, `h200:2x8`, `a100:1`, `b200:8`): XLA:GPU through the CUDA plugin's
  compile-only topology (`aot_gpu`);
- `cpu`: XLA:CPU on this machine's CPU devices, the same way.

For every program, per device: arguments, outputs, aliased (donated) bytes, temporaries, the total,
and the memory plan's figure for it (`layout.MemoryPlan.programs`). A run also holds state that is not
an argument of every program (the optimizer state while sampling, the reference during the update):
`Compiled.peak` adds it, and `fits` compares that peak with the usable part of the chip's HBM (`roofline.CHIPS`,
`fit.usable_fraction`: 90% of a TPU, `layout.GPU_MEM_FRACTION` of a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import time
from pathlib import Path

from cppo_jax.config.schema import Config
from cppo_jax.planning import gpu_targets as aot_gpu
from cppo_jax.planning.gpu_targets import AotError
from cppo_jax.planning.gpu_targets import quiet_stderr as _quiet_stderr

__all__ = [
    "AotError",
    "Compiled",
    "ProgramMemory",
    "compile_program",
    "compile_run",
    "libtpu_path",
    "target_devices",
]

_TOPOLOGY = re.compile(r"^v\d+[a-z]*:\d+(x\d+)*$")


def _libtpu_version() -> str | None:
    """The libtpu version this JAX asks for in its `tpu` extra (e.g. 0.0.42.*), or None."""
    from importlib import metadata

    for req in metadata.requires("jax") or ():
        m = re.match(r"libtpu\s*==\s*([\w.*]+)\s*;.*extra\s*==\s*['\"]tpu['\"]", req)
        if m:
            return m.group(1)
    return None


def libtpu_cache_folder() -> Path:
    """Where `make libtpu` installs libtpu outside the environment: installed into it (the `tpu`
    extra), JAX would try to start a TPU runtime in every process and print libtpu's warnings on a
    host without TPUs."""
    version = (_libtpu_version() or "unknown").replace("*", "x")
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cppo_jax" / f"libtpu-{version}"


def install_libtpu() -> Path:
    """pip-install the libtpu this JAX pins into `libtpu_cache_folder()` (once); returns the folder."""
    import subprocess
    import sys

    folder = libtpu_cache_folder()
    if (folder / "libtpu" / "libtpu.so").is_file():
        return folder
    version = _libtpu_version()
    if version is None:
        raise AotError("this JAX names no libtpu in its `tpu` extra: install jax[tpu] instead")
    tmp = folder.with_name(folder.name + ".partial")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp)]
    subprocess.run([*cmd, f"libtpu=={version}"], check=True)
    tmp.rename(folder)  # whole or not at all: a cut install leaves only the .partial folder
    return folder


def compiler_version(platform: str) -> str | None:
    """The version of the compiler installed for `platform` (`tpu`: libtpu, from the `libtpu`
    package or `make libtpu`'s folder; `cuda`/`gpu`: the CUDA plugin `make cuda-compiler` installs),
    or None where none is found."""
    from importlib import metadata

    if platform == "tpu":
        name, folders = "libtpu", [None, libtpu_cache_folder()]
    elif platform in ("cuda", "gpu"):
        name, folders = "jax-cuda12-plugin", [None, aot_gpu.cuda_compiler_folder()]
    else:
        return None
    for folder in folders:
        where = {} if folder is None else {"path": [str(folder)]}
        for dist in metadata.distributions(name=name, **where):
            return dist.version
    return None


def libtpu_path() -> str:
    """libtpu.so: $TPU_LIBRARY_PATH, the `libtpu` package (`pip install 'cppo_jax[tpu]'`), or the
    folder `make libtpu` fills. Raises AotError saying how to install it when none is there."""
    env = os.environ.get("TPU_LIBRARY_PATH")
    if env and Path(env).is_file():
        return env
    with contextlib.suppress(ImportError):
        import libtpu  # the package of jax[tpu]

        return libtpu.get_library_path()
    cached = libtpu_cache_folder() / "libtpu" / "libtpu.so"
    if cached.is_file():
        return str(cached)
    version = _libtpu_version() or "the version your jax[tpu] pins"
    raise AotError(
        f"compiling for a TPU topology needs libtpu (the TPU compiler), and none is installed: "
        f"run `make libtpu` or `python -m cppo_jax.planning.aot --install-libtpu` (installs libtpu=={version} "
        f"into {libtpu_cache_folder()}, outside the environment), or `pip install 'cppo_jax[tpu]'`, "
        f"or set TPU_LIBRARY_PATH to a libtpu.so"
    )


def target_devices(target: str) -> list:
    """The devices of `target` (see the module docstring), compile-only for a TPU topology."""
    import jax

    if target == "cpu":
        return jax.devices("cpu")
    if aot_gpu.is_gpu_target(target):
        return aot_gpu.gpu_devices(target)
    if not _TOPOLOGY.match(target):
        raise AotError(
            f"--compile-for {target!r}: not a target; give `cpu`, a TPU topology name "
            f"(chip:shape, e.g. v5e:2x4, v6e:2x4, v5p:2x2x1, v4:2x2x1, v5e:1x1) or GPUs "
            f"(gpu:N or gpu:HOSTSxN, e.g. h100:8, h200:2x8, a100:1, b200:8)"
        )
    path = libtpu_path()
    os.environ.setdefault("TPU_LIBRARY_PATH", path)
    # No TPU runtime is started, so no other process needs locking out of one.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    with _quiet_stderr() as held:
        try:
            # v4 compiles per TensorCore by default; a v4 slice runs one device per chip
            # ("megacore"), which is also the only layout jax.make_mesh accepts.
            kw = {"chip_config_name": "megacore"} if target.startswith("v4:") else {}
            kw.update(_host_bounds(target))
            return list(topologies.get_topology_desc(target, platform="tpu", **kw).devices)
        except Exception as e:  # libtpu's own message names what is wrong with the name
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            noise = held().strip()
            raise AotError(
                f"--compile-for {target!r}: libtpu refused the topology: {detail}"
                + (f"\n(libtpu said: {noise[-800:]})" if os.environ.get("CPPO_AOT_DEBUG") else "")
            ) from None


def _host_bounds(target: str) -> dict:
    """A slice of fewer chips than a host of its generation holds (`v5e:1x1`, one chip: libtpu
    assumes a 2x2x1 host and refuses a shape it does not divide) is a host of its own shape."""
    dims = [int(d) for d in target.split(":")[1].split("x")]
    if math.prod(dims) >= 4:
        return {}
    return {"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4}
_DTYPE_BYTES.update({"s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})


def loop_collectives(hlo_text: str, op: str) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays (dtype, shape) that collective `op` ("all-reduce", "all-gather", ...) returns
    inside a compiled program's loops: in the computations reachable from a while's body, each op
    once (a combined collective returns a tuple: every array of it)."""
    calls: dict = {}
    found: dict = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split("(")[0].split()[-1].lstrip("%")
            continue
        calls.setdefault(current, set()).update(
            re.findall(r"(?:body|condition|to_apply|calls)=%?([\w.-]+)", line)
        )
        m = re.search(r"= (.*?) " + re.escape(op) + r"(?:-start)?\(", line)
        if m:
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
                shape = tuple(int(d) for d in dims.split(",") if d)
                found.setdefault(current, []).append((dtype, shape))
    inside, todo = set(), re.findall(r"body=%?([\w.-]+)", hlo_text)
    while todo:
        c = todo.pop()
        if c not in inside:
            inside.add(c)
            todo.extend(calls.get(c, ()))
    return [x for c in sorted(inside) for x in found.get(c, [])]


def array_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return _DTYPE_BYTES.get(dtype, 4) * math.prod(shape)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """What the compiler reports for one program, per device (bytes), and its compile seconds.

    `error` holds the compiler's refusal (a program over the chip's memory) when it did not compile."""

    name: str
    arguments: int = 0
    outputs: int = 0
    aliased: int = 0  # outputs written into donated arguments
    temporaries: int = 0
    code: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    @classmethod
    def of(cls, name: str, compiled, seconds: float) -> ProgramMemory:
        m = compiled.memory_analysis()
        return cls(
            name,
            arguments=int(m.argument_size_in_bytes),
            outputs=int(m.output_size_in_bytes),
            aliased=int(m.alias_size_in_bytes),
            temporaries=int(m.temp_size_in_bytes),
            code=int(m.generated_code_size_in_bytes),
            seconds=seconds,
        )


def _compiler_options(args) -> dict | None:
    """The compiler's options for a program on the devices its arguments lie on: aot_gpu's on a GPU,
    None (XLA's defaults) elsewhere."""
    import jax

    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            if next(iter(sharding.device_set)).platform in ("cuda", "gpu"):
                return aot_gpu.compiler_options()
            return None
    return None


def compile_program(name: str, fn, args) -> ProgramMemory:
    """Lower and compile `fn(*args)` (abstract args); a compiler refusal becomes `error`."""
    t0 = time.perf_counter()
    with _quiet_stderr():
        try:
            compiled = fn.lower(*args).compile(_compiler_options(args))
        except Exception as e:
            text = str(e)
            if "RESOURCE_EXHAUSTED" not in text:  # a refusal for memory; anything else is a bug
                raise
            first = next((line for line in text.splitlines() if line.strip()), text)
            # libtpu says what it needed: "... required for HLO temporaries (128.41G) exceeds ..."
            need = re.search(r"HLO temporaries \((\d+(?:\.\d+)?)([KMG])\)", first)
            temps = (
                0
                if need is None
                else int(float(need[1]) * 2 ** {"K": 10, "M": 20, "G": 30}[need[2]])
            )
            return ProgramMemory(
                name, temporaries=temps, seconds=time.perf_counter() - t0, error=first[:400]
            )
    return ProgramMemory.of(name, compiled, time.perf_counter() - t0)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A run's programs compiled for one target with one mesh and micro-batch."""

    target: str
    devices: int
    device_kind: str
    mesh: dict[str, int]
    micro_batch: int
    programs: tuple[ProgramMemory, ...]
    resident: dict[str, int]  # state bytes per device that live through the step (see `peak`)
    args_of: dict[str, tuple[str, ...]]  # program -> the resident state it takes as arguments
    platform: str = "tpu"  # the devices' platform (tpu, cuda, cpu)

    def peak(self, program: ProgramMemory) -> int:
        """The program's total plus the resident state it does not take (alive beside it)."""
        beside = sum(b for k, b in self.resident.items() if k not in self.args_of[program.name])
        return program.total + beside

    @property
    def run_peak(self) -> int:
        return max(self.peak(p) for p in self.programs)

    @property
    def refused(self) -> list[ProgramMemory]:
        return [p for p in self.programs if p.error]


def compile_run(cfg: Config, target: str, devices=None) -> Compiled:
    """Compile `cfg`'s programs for `target` (see the module docstring)."""
    from cppo_jax.train import programs

    devices = target_devices(target) if devices is None else devices
    built = programs.build(cfg, devices)
    out = tuple(compile_program(name, fn, args) for name, (fn, args) in built.programs.items())
    return Compiled(
        target=target,
        devices=len(devices),
        device_kind=devices[0].device_kind,
        mesh=dict(built.mesh.shape),
        micro_batch=cfg.trainer.micro_batch,
        programs=out,
        resident=built.resident,
        args_of=built.args_of,
        platform=devices[0].platform,
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--install-libtpu"]:
        print(install_libtpu())
    elif sys.argv[1:] == ["--install-cuda-compiler"]:
        print(aot_gpu.install_cuda_compiler())
    else:
        raise SystemExit(
            "usage: python -m cppo_jax.planning.aot --install-libtpu | --install-cuda-compiler"
        )
