"""The weight-push routes of `VLLMBackend` (a mixin): the file route (a Hugging Face folder in one of two
slots and `reload_weights`) and the protocol route (vLLM's weight-transfer routes with the `cppo_shm`
engine, the payload diffed on the host, `weight_transfer.encode`, float32 weights cast and diffed in one
pass, `weight_transfer.encode_cast`, or encoded on the device, `device_patch.py`), each after the push folder's space check (`vllm_push.check_space`). docs/vllm.md,
"Weight sync routes".
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from cppo_jax.models.hf_io import save_hf
from cppo_jax.rollout.vllm.device_patch import DevicePatcher
from cppo_jax.rollout.vllm.probe import push_bytes, serving_graphdef
from cppo_jax.rollout.vllm.push import check_space, claim_push_folder, hf_tensors, resolve_route
from cppo_jax.rollout.vllm.weight_transfer import ProtocolPusher

__all__ = ["PushRoutes"]


class PushRoutes:
    """`VLLMBackend.push` and what it needs: `write_weights`, `resolve_route`, the device push."""

    def write_weights(self, params, graphdef=None) -> tuple[Path, int]:
        """`params` (as they are; `graphdef` defaults to the trainer's) as an HF checkpoint in the next
        of two slots (atomic): one `model.safetensors`, or shards of at most `max_shard_bytes` and their
        index above it (a 7B model in bf16 is 3 shards at the default 5 GiB). Returns (folder, bytes
        of all its safetensors files)."""
        claim_push_folder(self.weights_dir)
        slot = self.weights_dir / f"slot{self.pushes % 2}"
        model = nnx.merge(graphdef or self.graphdef, params)
        # The server read this slot two pushes ago and the other one since: removed first, so that the
        # folder never holds more than two copies (`check_space`)
        shutil.rmtree(slot, ignore_errors=True)
        save_hf(model, slot, max_shard_bytes=self.max_shard_bytes)
        return slot, sum(f.stat().st_size for f in slot.glob("*.safetensors"))

    def resolve_route(self) -> str:
        """The weight-sync route (`rollout.weight_sync`; `auto` asks the server once)."""
        if self.route is None:
            self.route = resolve_route(self.cfg.weight_sync, self.client)
            if self.route == "protocol":
                claim_push_folder(self.weights_dir)
                self.pusher = ProtocolPusher(
                    self.client,
                    self.weights_dir / "protocol",
                    full_push_every=self.cfg.full_push_every,
                )
        return self.route

    def push(self, params) -> dict:
        """Send `params` in the serving dtype by the route of `rollout.weight_sync` and reset the prefix
        cache (no check); returns bytes and timings (`pause_s`: the server could not generate).
        With an adapter push (`rollout.lora_push`) the adapters go instead, `params` unused."""
        if self.adapter_push():
            m, self.pushes = self.lora.push(), self.pushes + 1
            self.last_slot = self.lora.path
            return m
        nbytes = push_bytes(self.model_cfg(params), self.dtype(params))
        check_space(self.weights_dir, nbytes, self.url, self.free_bytes)
        if self.resolve_route() == "protocol" and self.device_patch:
            return self._push_from_device(params)
        if self.route == "protocol":
            t0 = time.perf_counter()
            cast = self.casts_on_host(params)
            # cast on the host: the float32 params as they lie, named by the serving model's layout
            graphdef = serving_graphdef(self.model_cfg(params), self.dtype(params))
            tensors = hf_tensors(graphdef, params) if cast else hf_tensors(*self.serving(params))
            t1 = time.perf_counter()
            m = self.pusher.push_cast(tensors) if cast else self.pusher.push(tensors)
            self.pushes += 1
            self.last_slot = self.pusher.root
            return {
                "weight_sync/bytes": m["bytes"],
                "write_s": t1 - t0 + m["write_s"],
                "reload_s": m["pause_s"],
                "changed_frac": m["changed_frac"],
                "full": m["full"],
                "host_bytes": float(sum(t.nbytes for t in tensors.values())),
                "host_s": t1 - t0 + m["write_s"],
            }
        t0 = time.perf_counter()
        slot, nbytes = self.write_weights(*reversed(self.serving(params)))
        t1 = time.perf_counter()
        self.client.reload_weights(str(slot))
        self.client.reset_prefix_cache()
        t2 = time.perf_counter()
        self.pushes += 1
        self.last_slot = slot
        return {
            "weight_sync/bytes": float(nbytes),
            "write_s": t1 - t0,
            "reload_s": t2 - t1,
            "changed_frac": 1.0,
            "full": 1.0,
            "host_bytes": float(nbytes),
            "host_s": t1 - t0,
        }

    def casts_on_host(self, params) -> bool:
        """Whether a push of `params` casts them to the serving dtype on the host, in one pass with the
        diff (`ProtocolPusher.push_cast`): the protocol route encoded on the host, float32 weights served
        in bfloat16 (the trainer's device is then the CPU, where its weights already lie in host memory)."""
        return (
            self.host_cast
            and not self.adapter_push()
            and self.resolve_route() == "protocol"
            and not self.device_patch
            and self.dtype(params) == "bfloat16"
            and all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
        )

    def _push_from_device(self, params) -> dict:
        """A protocol push whose patch (or full tensors) `DevicePatcher` computes on the device:
        only what is sent crosses to the host."""
        if self.patcher is None:
            self.patcher = DevicePatcher(self.model_cfg(params), self.dtype(params))
        full = self.pusher.next_is_full()
        t0 = time.perf_counter()
        entries, f = self.patcher.encode(params, full)
        t1 = time.perf_counter()
        m = self.pusher.push_entries(entries, full, f["changed"], f["total"])
        self.pushes += 1
        self.last_slot = self.pusher.root
        return {
            "weight_sync/bytes": m["bytes"],
            "write_s": t1 - t0 + m["write_s"],
            "reload_s": m["pause_s"],
            "changed_frac": m["changed_frac"],
            "full": m["full"],
            "device_s": f["device_s"],
            "host_bytes": f["host_bytes"],
            "host_s": f["fetch_s"] + m["write_s"],
        }
