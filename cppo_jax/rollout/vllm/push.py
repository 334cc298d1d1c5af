"""Where and how the vLLM backend pushes weights: the push folder, and the route chosen by
`rollout.weight_sync` (docs/vllm.md, "Weight sync routes").

- `push_folder` / `claim_push_folder`: the folder both the trainer and the server read (`rollout.weights_dir`).
- `resolve_route`: `file` (a safetensors folder and `reload_weights`) or `protocol` (vLLM's weight-transfer
  routes with the `cppo_shm` engine, `cppo_jax/rollout/vllm/weight_transfer.py`); `auto` asks the server which
  engine it was started with.
- `hf_tensors`: the policy as the HF-named numpy arrays a protocol push sends (the same names and layouts
  as the file route's checkpoint, without a tied model's copy of the embedding as `lm_head.weight`).
- `check_space` / `PushSpaceError`: before every push, the push folder's file system must hold the two
  copies a push may leave there (the slot or round the server read last, and the new one); a Docker
  container's /dev/shm is 64 MB unless started with `--shm-size`, where a 7B push needs 2 x 15.2 GB.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flax import nnx

from cppo_jax.config.schema import ConfigError
from cppo_jax.models.hf_io import state_to_hf_tensors
from cppo_jax.rollout.vllm.transport import JSONClient, RolloutServerError
from cppo_jax.rollout.vllm.weight_transfer import SHM_BACKEND, server_backend

__all__ = [
    "PUSH_MARKER",
    "PushSpaceError",
    "check_space",
    "claim_push_folder",
    "disk_free",
    "hf_tensors",
    "push_folder",
    "resolve_route",
]


def resolve_route(choice: str, client: JSONClient) -> str:
    """`file` or `protocol` for `rollout.weight_sync` = `choice`: `protocol` needs a server started with the
    `cppo_shm` weight-transfer engine (asked once through `GET /server_info`); `auto` falls back to `file`
    when it was not, `protocol` refuses."""
    if choice == "file":
        return "file"
    backend = server_backend(client)
    if backend == SHM_BACKEND:
        return "protocol"
    if choice == "protocol":
        raise ConfigError(
            f"config key 'rollout.weight_sync' = 'protocol', but the vLLM server at {client.url} offers "
            f"the weight-transfer engine {backend!r}, not {SHM_BACKEND!r}: start it with "
            f"VLLM_WEIGHT_TRANSFER=1 (launch/vllm_server.sh), or use weight_sync='auto' or 'file'"
        )
    return "file"


def hf_tensors(graphdef, params) -> dict[str, np.ndarray] | None:
    """The model `graphdef` with `params` as the HF-named host arrays a protocol push sends, in their
    dtype (None off the main process, as `state_to_hf_tensors`). A tied model's `lm_head.weight` is left
    out: it would be the embedding again, and the `cppo_shm` engine serves the embedding as the head.
    Linear weights are transposed views of the parameters, not copies: the diff reads them in memory
    order (`weight_transfer.changed_steps`), and only a tensor sent whole is copied to HF order."""
    return state_to_hf_tensors(nnx.merge(graphdef, params), tied_head=False, contiguous=False)


PUSH_MARKER = ".cppo_weight_pushes"  # written into a push folder this package created


def push_folder(weights_dir: str, run_dir: str | Path) -> Path:
    """The weight-push folder: `rollout.weights_dir` resolved against the run folder.

    Empty: `<run_dir>/weights`. A relative value must stay inside the run folder once `..` and symbolic
    links are resolved (no path traversal from a config value). An absolute value is the operator's explicit
    choice of another file system (launch/gpu_node.sh uses /dev/shm); `claim_push_folder` then makes sure
    it is a folder of its own.
    """
    run = Path(run_dir).resolve()
    if not weights_dir:
        return run / "weights"
    if Path(weights_dir).is_absolute():
        return Path(weights_dir).resolve()
    folder = (run / weights_dir).resolve()
    if folder == run or not folder.is_relative_to(run):
        raise ConfigError(
            f"config key 'rollout.weights_dir' = {weights_dir!r} is invalid: it resolves to {folder}, "
            f"outside the run folder {run}; allowed a sub-folder of the run folder, or an absolute path "
            f"for a dedicated folder elsewhere"
        )
    return folder


def claim_push_folder(folder: Path) -> None:
    """Create the push folder, or accept it when it is empty or was created by this package; refuse a
    folder holding other files, whose `slot0`/`slot1` would be replaced and removed."""
    marker = folder / PUSH_MARKER
    if marker.is_file():
        return
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(
            f"config key 'rollout.weights_dir': {folder} is not an empty folder; weight pushes need "
            f"a folder of their own (a new path, or one a previous run created)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text("weight-push slots written by cppo_jax; removed when the trainer closes\n")


class PushSpaceError(RolloutServerError):
    """The push folder's file system cannot hold a push (checked before writing), or a write failed."""


SPACE_HINT = (
    "in a Docker container /dev/shm is 64 MB unless the container is started with --shm-size "
    "(docker run --shm-size={gb}g), or set rollout.weights_dir to a folder on a disk the server also reads"
)


def disk_free(folder: Path) -> int:
    """Free bytes of the file system that holds `folder` (or its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _held(folder: Path) -> int:
    """Bytes of the files under `folder` (the slots of earlier pushes, which a push replaces)."""
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def check_space(
    folder: Path, push_bytes: int, url: str, free: Callable[[Path], int] = disk_free
) -> None:
    """Raise `PushSpaceError` unless `folder`'s file system can take two pushes of `push_bytes` (a
    push replaces the copy before last, so at most two are there), counting the files already held in
    `folder` as free. `free` is the probe of a folder's free bytes (injectable for tests)."""
    need, have = 2 * push_bytes, free(folder) + _held(folder)
    if have >= need:
        return
    raise PushSpaceError(
        f"weight push to {url}: the push folder {folder} (rollout.weights_dir) has {have / 1e9:.3g} GB "
        f"free, a push needs {need / 1e9:.3g} GB (two copies of {push_bytes / 1e9:.3g} GB of weights): "
        + SPACE_HINT.format(gb=-(-need * 5 // 4 // 2**30)),
        url=url,
    )


def write_failed(e: OSError, folder: Path, url: str, when: str) -> PushSpaceError:
    """The error a push raises when writing under `folder` failed (`e`: a full /dev/shm is ENOSPC)."""
    full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    return PushSpaceError(
        f"weight push{when} to {url} failed writing under {folder}: {type(e).__name__}: {e}"
        + (f"; the file system is full: {SPACE_HINT.format(gb='N')}" if full else ""),
        url=url,
    )
