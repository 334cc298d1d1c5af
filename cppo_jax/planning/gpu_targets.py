"""NVIDIA GPUs as compile targets on a machine without them: XLA:GPU's compile-only topology.

`--compile-for h100:8` (8 GPUs on one host), `h200:2x8` (2 hosts of 8), `a100:1`, `b200:4`: the CUDA
PJRT plugin builds the devices of that topology from a GPU spec (`gpu_specs/*.txtpb`: the fields of
XLA's `GpuTargetConfigProto` its compiler reads, with the figures of openxla/xla's spec files) under
`JAX_PLATFORMS=cpu`, and XLA:GPU compiles for them on the CPU (`ptxas` from the nvcc wheel).

The compiler is three wheels (`jax-cuda12-plugin` and `jax-cuda12-pjrt` of the installed JAX's version,
`nvidia-cuda-nvcc-cu12`), installed with `--no-deps` once into `cuda_compiler_folder()`, outside the
environment (as libtpu is: inside it, every process that does not set `JAX_PLATFORMS=cpu` would try
to start CUDA), and put on `sys.path` only by the process that compiles (`gpu_devices`).

XLA:GPU compiles a program larger than the GPU (it warns and reports the figure): whether it fits is
the report's comparison with the memory JAX will have, `layout.GPU_MEM_FRACTION` of the HBM.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

from cppo_jax.config.choices import ConfigError


class AotError(ConfigError):
    """The target cannot be compiled for here (no compiler, an unknown topology or GPU); names the
    culprit. (`cppo_jax.planning.aot` raises it for TPU targets too.)"""


@contextlib.contextmanager
def quiet_stderr():
    """Hold back what C++ code writes to stderr (libtpu's warnings about a host without TPUs) and
    yield a function returning it; it is shown only if the call fails."""
    with tempfile.TemporaryFile(mode="w+b") as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield lambda: (held.seek(0), held.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


SPECS = Path(__file__).resolve().parents[1] / "gpu_specs"
# --compile-for name -> the spec file (XLA's name for the GPU's spec).
GPUS = {"h100": "h100_sxm", "h200": "h200", "a100": "a100_sxm_80", "b200": "b200"}
_TARGET = re.compile(r"^([a-z]\w*):(?:(\d+)x)?(\d+)$")
# The option XLA:GPU needs for the project's programs: with Triton's GEMM emitter on, the 1.5B's
# step fails ("Couldn't find output tile sizes that satisfy ... bf16[3070,1536]"); cuBLAS is used.
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compiler_options() -> dict:
    """XLA:GPU's options for every compile here: `COMPILER_OPTIONS`, and ptxas and libdevice
    from the nvcc wheel (not a CUDA toolkit found elsewhere on the machine)."""
    nvcc = cuda_compiler_folder() / "nvidia" / "cuda_nvcc"
    return {**COMPILER_OPTIONS, "xla_gpu_cuda_data_dir": str(nvcc)}


WHEELS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12>=12.6.85")


def is_gpu_target(target: str) -> bool:
    """Whether `target` is meant as a GPU (`h100:8`, `rtx:4`): NAME:SHAPE whose name is not a TPU
    generation's (`v5e`); not whether it is well formed (`parse` says)."""
    return ":" in target and not re.match(r"^v\d+[a-z]*:", target)


def parse(target: str) -> tuple[str, int, int]:
    """`gpu:N` or `gpu:HxN` -> (gpu, hosts, GPUs per host); AotError naming what is wrong."""
    m = _TARGET.match(target)
    known = ", ".join(GPUS)
    if m is None or m.group(1) not in GPUS:
        gpu = target.split(":")[0]
        what = f"unknown GPU {gpu!r}" if gpu not in GPUS else "not GPU:N or GPU:HOSTSxN"
        raise AotError(
            f"--compile-for {target!r}: {what}; give one of {known} as GPU:N (N GPUs on one "
            f"host, e.g. h100:8) or GPU:HOSTSxN (e.g. h100:2x8)"
        )
    gpu, hosts, per_host = m.group(1), int(m.group(2) or 1), int(m.group(3))
    if hosts < 1 or not 1 <= per_host <= 8:
        raise AotError(
            f"--compile-for {target!r}: {per_host} GPUs per host and {hosts} host(s): a host holds "
            f"1 to 8 GPUs and there is at least one host (e.g. {gpu}:8 or {gpu}:2x8)"
        )
    return gpu, hosts, per_host


def spec_text(gpu: str) -> str:
    return (SPECS / f"{GPUS[gpu]}.txtpb").read_text()


def spec_field(gpu: str, field: str) -> float:
    """A number of the GPU's spec file (`device_memory_size`, `memory_bandwidth`, `core_count`)."""
    m = re.search(rf"^\s*{field}:\s*([\d.]+)\s*$", spec_text(gpu), re.M)
    if m is None:
        raise KeyError(f"{field} not in {GPUS[gpu]}.txtpb")
    return float(m.group(1))


def device_name(gpu: str) -> str:
    """The device kind the compile-only devices report (`device_description_str`)."""
    return re.search(r'^device_description_str:\s*"([^"]+)"', spec_text(gpu), re.M).group(1)


def cuda_compiler_folder() -> Path:
    """Where `make cuda-compiler` installs the GPU compiler: keyed by the JAX version it matches."""
    import jax

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cppo_jax" / f"cuda-compiler-{jax.__version__}"


def _installed(folder: Path) -> bool:
    return (folder / "jax_plugins" / "xla_cuda12").is_dir() and (
        folder / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
    ).is_file()


def install_cuda_compiler() -> Path:
    """pip-install the GPU compiler's wheels into `cuda_compiler_folder()` (once); the folder."""
    import subprocess

    import jax

    folder = cuda_compiler_folder()
    if _installed(folder):
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp)]
    wheels = [w if ">" in w else f"{w}=={jax.__version__}" for w in WHEELS]
    subprocess.run([*cmd, *wheels], check=True)
    tmp.rename(folder)  # whole or not at all: a cut install leaves only the .partial folder
    return folder


def _not_installed() -> ConfigError:
    return AotError(
        f"compiling for a GPU needs XLA:GPU's compiler (the CUDA PJRT plugin and ptxas), and none "
        f"is installed: run `make cuda-compiler` or `python -m cppo_jax.planning.aot --install-cuda-compiler` "
        f"(installs {', '.join(WHEELS)} with --no-deps into {cuda_compiler_folder()}, outside the "
        f"environment; about 573 MB)"
    )


def _register_plugin(folder: Path) -> None:
    """Put the compiler on this process's path and register the CUDA plugin with JAX (without
    starting CUDA: the CPU stays the only backend)."""
    import jax
    from jax._src import xla_bridge as xb

    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    if not xb.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")  # no CUDA runtime: the plugin only compiles
    if "cuda" in xb._topology_factories:
        return
    if xb._plugins_registered:  # the plugins were discovered before the folder was on the path
        import importlib

        importlib.import_module("jax_plugins.xla_cuda12").initialize()
    else:
        xb._discover_and_register_pjrt_plugins()


def gpu_devices(target: str) -> list:
    """The compile-only devices of a GPU target (see the module docstring)."""
    gpu, hosts, per_host = parse(target)
    folder = cuda_compiler_folder()
    if not _installed(folder):
        raise _not_installed()
    from jax.experimental import topologies

    with quiet_stderr() as held:
        try:
            _register_plugin(folder)  # it says it found no CUDA driver: none is needed
            topo = topologies.get_topology_desc(
                platform="cuda", target_config=spec_text(gpu), topology=f"1x{hosts}x{per_host}"
            )
        except Exception as e:
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            noise = held().strip()
            raise AotError(
                f"--compile-for {target!r}: the CUDA plugin refused the topology: {detail}"
                + (f"\n(it said: {noise[-800:]})" if os.environ.get("CPPO_AOT_DEBUG") else "")
            ) from None
    return list(topo.devices)
