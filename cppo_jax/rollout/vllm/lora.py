"""Adapter-only weight pushes to a vLLM server started with LoRA (`rollout.lora_push`, docs/lora.md).

With `model.lora.enabled` the trained state is the adapters; the frozen base is what the server started
from (`model.path`, the same folder). Instead of the merged model (every weight, the full size), each push
of `LoraPusher.push`:

1. writes the adapters as a PEFT folder (`peft_io.save_adapter`: float32 A and B) into
   `<weights_dir>/lora/v<n>` (a temporary sibling renamed into place; process 0 only);
2. `POST /v1/load_lora_adapter {"lora_name": "cppo-lora-<n>", "lora_path": ...}`: a new name per version,
   so the server's prefix cache (keyed by the adapter) cannot serve blocks computed by an older version;
3. sends the generation and probe requests to that name (`model` of `/v1/completions`);
4. `POST /v1/unload_lora_adapter` of the previous name, and deletes its folder.

`VLLMBackend.sync_weights` then runs its probe check against the new name, the trainer's log-probs coming
from `expected_probe`: the adapted model (base and adapters cast to the serving dtype, in which vLLM
computes the LoRA product) on the probe sequence.

`make_lora_pusher` turns `rollout.lora_push` into a pusher or None (the merged push): `auto` asks
`GET /server_info` whether the server runs with LoRA, `adapter` insists, `merged` never asks.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.config.schema import ConfigError, RolloutConfig
from cppo_jax.models import lora_state, peft_io
from cppo_jax.models.transformer import DTYPES
from cppo_jax.rollout.vllm.client import RolloutServerError, VLLMClient
from cppo_jax.rollout.vllm.probe import probe_fn, serving_graphdef
from cppo_jax.rollout.vllm.push import claim_push_folder

__all__ = ["ADAPTER_PREFIX", "LoraPusher", "make_lora_pusher", "server_lora_rank"]

ADAPTER_PREFIX = "cppo-lora-"  # + the push count: the adapter's name on the server
SERVER_HINT = (
    "start the server with --enable-lora --max-lora-rank R (R >= model.lora.rank) and "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (launch/vllm_server.sh: VLLM_LORA_RANK=R)"
)


def server_lora_rank(client: VLLMClient) -> int | None:
    """The server's `--max-lora-rank`, or None when it runs without LoRA (or has no `/server_info`)."""
    try:
        out = client.request(
            "GET", "/server_info?config_format=json", what="reading the LoRA config"
        )
    except RolloutServerError as e:
        if e.status == 404:
            return None
        raise
    lora = (out.get("vllm_config") or {}).get("lora_config") if isinstance(out, dict) else None
    if not isinstance(lora, dict):
        return None
    return int(lora.get("max_lora_rank") or 0) or None


def make_lora_pusher(
    cfg: RolloutConfig, parts: tuple | None, client: VLLMClient, weights_dir: Path
) -> LoraPusher | None:
    """The adapter pusher `rollout.lora_push` asks for, or None for the merged push. `parts`: what
    `VLLMBackend.attach_lora` was given (None: not a LoRA run, or several trainer processes)."""
    if cfg.lora_push == "merged" or (parts is None and cfg.lora_push == "auto"):
        return None
    if parts is None:
        raise ConfigError(
            "config key 'rollout.lora_push' = 'adapter' needs model.lora.enabled=true and a single "
            "trainer process (with several, process 0 pushes merged weights); use "
            "rollout.lora_push=merged or auto"
        )
    rank = server_lora_rank(client)
    if rank is None:
        if cfg.lora_push == "auto":
            return None
        raise RolloutServerError(
            f"config key 'rollout.lora_push' = 'adapter', but the vLLM server at {client.url} runs "
            f"without LoRA (GET /server_info: no lora_config): {SERVER_HINT}; or use "
            f"rollout.lora_push=merged",
            url=client.url,
        )
    claim_push_folder(weights_dir)
    return LoraPusher(client, weights_dir / "lora", *parts, base_model=client.model_name())


class LoraPusher:
    """Pushes the adapters of a LoRA run to a vLLM server (see the module docstring).

    `train_graphdef`: the LoRA model's graph; `frozen`: its base (the server's own weights);
    `adapters_fn()`: the current adapters (an nnx.State of `LoRAParam`s); `base_model`: recorded in
    `adapter_config.json` (the server's name of its base model, its folder).
    """

    def __init__(
        self, client: VLLMClient, folder: Path, train_graphdef, frozen, adapters_fn, base_model=""
    ):
        self.client = client
        self.folder = Path(folder)
        self.train_graphdef = train_graphdef
        self.frozen = frozen
        self.adapters_fn = adapters_fn
        self.base_model = str(base_model)
        self.model_cfg = nnx.merge(train_graphdef, adapters_fn(), frozen).cfg
        self.version = 0  # pushes made; the next adapter is named ADAPTER_PREFIX + version
        self.name: str | None = None  # the adapter the requests go to
        self.path: Path | None = None
        self.adapters = None  # the adapters last written (what `expected_probe` checks)

    def push(self) -> dict:
        """Write the current adapters, load them under a new name, route requests to it, unload the
        previous one; returns bytes and timings (as `VLLMBackend.push`)."""
        t0 = time.perf_counter()
        self.adapters = self.adapters_fn()
        name = f"{ADAPTER_PREFIX}{self.version}"
        final, tmp = self.folder / f"v{self.version}", self.folder / f".v{self.version}.tmp"
        for old in (final, tmp):
            shutil.rmtree(old, ignore_errors=True)
        peft_io.save_adapter(self.adapters, self.model_cfg, tmp, self.base_model)
        tmp.rename(final)
        nbytes = sum(f.stat().st_size for f in final.iterdir())
        t1 = time.perf_counter()
        self.load(name, final)
        previous, previous_path = self.name, self.path
        self.name, self.path = name, final
        self.version += 1
        self.client.set_model(name)
        if previous is not None:
            self.unload(previous)
            shutil.rmtree(previous_path, ignore_errors=True)
        return {
            "weight_sync/bytes": float(nbytes),
            "write_s": t1 - t0,
            "reload_s": time.perf_counter() - t1,
            "changed_frac": 1.0,
            "full": 1.0,
        }

    def load(self, name: str, path: Path) -> None:
        payload = {"lora_name": name, "lora_path": str(path)}
        try:
            self.client.request(
                "POST",
                "/v1/load_lora_adapter",
                payload,
                what=f"loading LoRA adapter {name}",
                retries=0,
                raw=True,
            )
        except RolloutServerError as e:
            r = self.model_cfg.lora_rank
            why = str(e)  # an HTTP 500 comes back as the last of the attempts: its answer alone
            if "(last: " in why:
                why = why.split("(last: ", 1)[1].rsplit("); is the vLLM server", 1)[0]
            raise RolloutServerError(
                f"the vLLM server at {self.client.url} refused the LoRA adapter {name} (rank {r}, "
                f"{path}): {why}. Either the server runs without runtime LoRA loading or its "
                f"--max-lora-rank is below {r}: {SERVER_HINT}; or lower model.lora.rank, or set "
                f"rollout.lora_push=merged",
                url=self.client.url,
                status=e.status,
            ) from e

    def unload(self, name: str, retries: int | None = None) -> None:
        self.client.request(
            "POST",
            "/v1/unload_lora_adapter",
            {"lora_name": name},
            what=f"unloading LoRA adapter {name}",
            retries=retries,
            raw=True,
        )

    def expected_probe(self, ids: list[int], dtype: str, compute: str | None = None) -> np.ndarray:
        """The trainer's probe log-probs [T, V] of the adapters last pushed on the frozen base, both
        cast to the serving `dtype` (like with like: the server computes base and LoRA in it), or
        computed in `compute` (the float32 reference of `VLLMBackend.probe_noise`)."""
        graphdef = serving_graphdef(self.model_cfg, dtype, compute)
        dt = DTYPES[dtype]
        params = nnx.merge_state(
            lora_state.cast(self.adapters, dt), lora_state.cast(self.frozen, dt)
        )
        return np.asarray(probe_fn(graphdef)(params, jnp.asarray(ids, jnp.int32)))

    def close(self) -> None:
        """Unload the last adapter (best effort: the server may be gone) and delete the folders."""
        if self.name is not None:
            with contextlib.suppress(RolloutServerError):
                self.unload(self.name, retries=0)
        shutil.rmtree(self.folder, ignore_errors=True)
