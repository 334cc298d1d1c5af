"""Where and how the vLLM backend pushes weights: the push folder, and the route chosen by
`rollout.weight_sync` (docs/vllm.md, "Weight sync routes").

- `push_folder` / `claim_push_folder`: the folder both the trainer and the server read (`rollout.weights_dir`).
- `resolve_route`: `file` (a safetensors folder and `reload_weights`) or `protocol` (vLLM's weight-transfer
  routes with the `cppo_shm` engine, `cppo_jax/rollout/weight_transfer.py`); `auto` asks the server which
  engine it was started with.
- `hf_tensors`: the policy as the HF-named numpy arrays a protocol push sends (the same names and layouts
  as the file route's checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from cppo_jax.config import ConfigError
from cppo_jax.models.hf_io import state_to_hf_tensors
from cppo_jax.rollout.vllm_http import JSONClient
from cppo_jax.rollout.weight_transfer import SHM_BACKEND, server_backend

__all__ = [
    "PUSH_MARKER",
    "claim_push_folder",
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
    """The model `graphdef` with `params` as HF-named host arrays in their dtype (None off the main
    process, as `state_to_hf_tensors`)."""
    return state_to_hf_tensors(nnx.merge(graphdef, params))


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
