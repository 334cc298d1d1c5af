"""Several processes, one run: `jax.distributed` from the environment, and moving data across processes.

A multi-host run starts one process per host (or per GPU); `initialize()` connects them before anything
touches a device, after which `jax.devices()` lists every process's devices and the mesh spans them all.
Where the coordinator comes from, first match wins:

  1. explicit: `launch --coordinator HOST:PORT --num-processes N --process-id I` (or the same as
     CPPO_COORDINATOR, CPPO_NUM_PROCESSES, CPPO_PROCESS_ID, and CPPO_LOCAL_DEVICE_IDS=0,1,...);
  2. CPPO_DISTRIBUTED=auto: `jax.distributed.initialize()` without arguments, JAX finding the cluster
     itself (a TPU pod's metadata: what launch/tpu_pod.sh sets); CPPO_DISTRIBUTED=off: one process;
  3. JAX's own variables: JAX_COORDINATOR_ADDRESS with JAX_NUM_PROCESSES and JAX_PROCESS_ID;
  4. SLURM with more than one task (SLURM_NTASKS > 1): JAX reads the node list and task id itself;
  5. a TPU pod slice with several workers (TPU_WORKER_HOSTNAMES lists more than one): JAX asks the
     TPU metadata itself.
Nothing matched: a single process, nothing is initialized.

Every process runs the same program on its own devices (SPMD). Each draws the whole global batch of
question ids (cheap) and scores the rewards of its own contiguous slice of questions (the slice
`pipeline.question_order(process_index=i, process_count=n)` gives); the rewards are then gathered so
every process holds the same global values. Only process 0 writes logs and Hugging Face exports and
talks to a vLLM server (`rollout.multiprocess.MainProcessBackend`); checkpoints are written by all processes together (orbax).
Collectives between CPU processes use gloo.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np


class DistributedError(ValueError):
    """The distributed settings are incomplete or inconsistent; the message names the variable."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How `initialize` would call `jax.distributed.initialize` (None: let JAX detect it)."""

    source: str  # "explicit", "auto", "jax", "slurm", "tpu"
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    def kwargs(self) -> dict:
        out = {}
        if self.coordinator is not None:
            out["coordinator_address"] = self.coordinator
        if self.num_processes is not None:
            out["num_processes"] = self.num_processes
        if self.process_id is not None:
            out["process_id"] = self.process_id
        if self.local_device_ids is not None:
            out["local_device_ids"] = list(self.local_device_ids)
        return out


def _int(value: str | int, name: str, minimum: int) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{name}={value!r} is not an integer") from None
    if n < minimum:
        raise DistributedError(f"{name}={n} is invalid: allowed >= {minimum}")
    return n


def detect(
    env: Mapping[str, str] | None = None,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> Plan | None:
    """The multi-process plan from explicit arguments or `env` (default os.environ); None: one process."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get("CPPO_COORDINATOR") or None
    if num_processes is None and env.get("CPPO_NUM_PROCESSES"):
        num_processes = env["CPPO_NUM_PROCESSES"]
    if process_id is None and env.get("CPPO_PROCESS_ID"):
        process_id = env["CPPO_PROCESS_ID"]
    if coordinator or num_processes is not None or process_id is not None:
        missing = [
            name
            for name, value in (
                ("--coordinator / CPPO_COORDINATOR", coordinator),
                ("--num-processes / CPPO_NUM_PROCESSES", num_processes),
                ("--process-id / CPPO_PROCESS_ID", process_id),
            )
            if value is None
        ]
        if missing:
            raise DistributedError(
                f"a multi-process run needs the coordinator, the process count and this process's id; "
                f"missing: {', '.join(missing)}"
            )
        if ":" not in coordinator:
            raise DistributedError(
                f"CPPO_COORDINATOR={coordinator!r} is invalid: allowed HOST:PORT (process 0's host)"
            )
        n = _int(num_processes, "CPPO_NUM_PROCESSES", 1)
        i = _int(process_id, "CPPO_PROCESS_ID", 0)
        if i >= n:
            raise DistributedError(
                f"CPPO_PROCESS_ID={i} is invalid for CPPO_NUM_PROCESSES={n}: allowed 0..{n - 1}"
            )
        local = env.get("CPPO_LOCAL_DEVICE_IDS")
        ids = (
            tuple(_int(x, "CPPO_LOCAL_DEVICE_IDS", 0) for x in local.split(",")) if local else None
        )
        return Plan("explicit", coordinator, n, i, ids)
    mode = env.get("CPPO_DISTRIBUTED", "")
    if mode not in ("", "auto", "off"):
        raise DistributedError(f"CPPO_DISTRIBUTED={mode!r} is invalid: allowed auto, off or unset")
    if mode == "off":
        return None
    if mode == "auto":
        return Plan("auto")  # JAX detects the cluster itself (TPU metadata, SLURM, MPI, ...)
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return Plan("jax")  # jax.distributed.initialize reads JAX_* itself
    if env.get("SLURM_JOB_ID") and _int(env.get("SLURM_NTASKS", "1"), "SLURM_NTASKS", 1) > 1:
        return Plan("slurm")
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(hosts) > 1:
        return Plan("tpu")
    return None


def initialize(
    env: Mapping[str, str] | None = None,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> Plan | None:
    """Connect this process to the others (see the module docstring); call before touching devices."""
    plan = detect(env, coordinator, num_processes, process_id)
    if plan is None:
        return None
    import jax

    # CPU devices of several processes talk through gloo (the default, none, cannot cross processes).
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**plan.kwargs())
    return plan


def process_index() -> int:
    import jax

    return jax.process_index()


def process_count() -> int:
    import jax

    return jax.process_count()


def is_main() -> bool:
    """Process 0: the one that writes logs and exports and talks to a rollout server."""
    return process_index() == 0


def local_slice(rows: int) -> slice:
    """This process's contiguous share of `rows` (rows must divide by the process count)."""
    n, i = process_count(), process_index()
    if rows % n:
        raise DistributedError(f"{rows} rows do not split over {n} processes")
    per = rows // n
    return slice(i * per, (i + 1) * per)


def _whole(x) -> np.ndarray:
    """`x`'s whole value as numpy; an array spread over processes is gathered (a collective)."""
    import jax
    from jax.experimental import multihost_utils

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def to_host(tree):
    """Numpy copies of `tree`'s arrays, whole, on every process (gathered when they span processes).

    With several processes every process must call this for the same arrays (it is a collective).
    """
    import jax

    return jax.tree.map(_whole, tree)


def to_main(tree):
    """Numpy copies of `tree`'s arrays, whole, on process 0; None elsewhere.

    Every process must call this (a collective), but the arrays are gathered one at a time and the
    other processes drop each at once: they never hold more than one array's copy, where `to_host`
    gives each of them the whole tree (a model copy per host for a weight push or an export).
    """
    import jax

    main = is_main()

    def one(x):
        whole = _whole(x)
        return whole if main else None

    out = jax.tree.map(one, tree)
    return out if main else None


def gather_rows(local: np.ndarray) -> np.ndarray:
    """Every process's `local` rows concatenated in process order (a collective)."""
    if process_count() == 1:
        return np.asarray(local)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def global_array(host: np.ndarray, mesh, names: Sequence[str | None] | None = None):
    """`host` (the same whole value on every process) as one array laid out on `mesh` by `names`.

    `names` are logical axis names (`cppo_jax.parallel.sharding.RULES`), e.g. ("batch", None) splits rows over
    the data axes; None replicates. Each process supplies only the pieces its own devices hold.
    """
    import jax

    from cppo_jax.parallel import sharding as sharding_lib

    host = np.asarray(host)
    if mesh is None:
        return jax.numpy.asarray(host)
    names = (None,) * host.ndim if names is None else tuple(names)
    sharding = sharding_lib.named(mesh, names, host.shape)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def rows(host: np.ndarray, mesh):
    """`host` split by its leading dim over the mesh's data axes (replicated if they do not divide)."""
    host = np.asarray(host)
    return global_array(host, mesh, ("batch",) + (None,) * (host.ndim - 1))
