"""The vLLM rollout backend: completions from an external vLLM server, verified weight pushes.

`VLLMBackend` implements `cppo_jax.rollout.backend.RolloutBackend` on top of `cppo_jax.rollout.vllm.client.VLLMClient`:

- `generate`: one `/v1/completions` request per question (its left padding stripped), `n = G`, seeded
  `seeds_Q[q] * G` so that the per-sample seeds (seed + j) of different questions never overlap; the answers
  come back as the same `Samples` the embedded sampler returns (tokens padded with `pad_id` after EOS,
  log-probs 0 there, `valid` and `finished` by the sampler's own rule, `sampling.completion_ends`, which
  the server's "stop" vs "length" must agree with).
- `sync_weights(params, step)`: write the policy as a Hugging Face checkpoint, cast to the dtype the server
  computes in (`GET /server_info`; bf16 halves the bytes of an fp32 policy), into one of two alternating
  slots under `rollout.weights_dir` (default `<run_dir>/weights`; written to a temporary sibling and renamed
  into place, so the server never reads half a file), ask the server to reload it (`/collective_rpc`
  `reload_weights`), reset its prefix cache, then VERIFY: the server's log-probs of a fixed probe sequence
  (prompt log-probs and the greedy next token, temperature 0) must equal the trainer's own, computed here in
  JAX from exactly the weights written and in the server's dtype (like with like), within a tolerance
  derived from that dtype and the model's own rounding noise on the probe (`vllm_probe`) or `rollout.probe_tol` when set. A mismatch raises
  `WeightSyncError` (expected vs got, max diff) before any further rollout can use stale weights.
  With `rollout.weight_sync` = protocol (or auto, against a server started with the `cppo_shm` engine) the
  same tensors go through vLLM's weight-transfer routes instead of a folder and a reload: full pushes, and
  in between sparse patches of the changed serving-dtype elements (`rollout.full_push_every`;
  `cppo_jax/rollout/vllm/weight_transfer.py`); the probe check after every push is the same, and a refused one
  makes the next push full. A LoRA run may push its adapters instead (`rollout.lora_push`,
  `cppo_jax/rollout/vllm/lora.py`).

The server must be reachable by the trainer and must read `weights_dir` at the same path (same machine or a
shared file system). The dev routes it needs are unauthenticated: keep it on loopback or a private network
(see `cppo_jax/rollout/vllm/client.py` and docs/vllm.md).

Log-probs returned in `Samples.logp_NC` are the server's (vLLM computes them before temperature unless it
runs with `--logprobs-mode processed_logprobs`); the trainer recomputes the log-probs it trains on.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.config.schema import RolloutConfig
from cppo_jax.models.hf_io import DEFAULT_SHARD_BYTES
from cppo_jax.models.transformer import DTYPES
from cppo_jax.rollout.embedded.sampling import Samples, SamplingParams
from cppo_jax.rollout.vllm.client import (
    ResponseError,
    RolloutServerError,
    VLLMClient,
    WeightSyncError,
)
from cppo_jax.rollout.vllm.device_patch import DevicePatcher
from cppo_jax.rollout.vllm.lora import LoraPusher, make_lora_pusher
from cppo_jax.rollout.vllm.probe import (
    default_probe_ids,
    probe_fn,
    probe_tolerance,
    push_bytes,
    serving_graphdef,
)
from cppo_jax.rollout.vllm.push import (
    PUSH_MARKER,
    claim_push_folder,
    disk_free,
    push_folder,
    write_failed,
)
from cppo_jax.rollout.vllm.routes import PushRoutes
from cppo_jax.rollout.vllm.samples import samples_from_completions, strip_padding
from cppo_jax.rollout.vllm.weight_transfer import ProtocolPusher

__all__ = [
    "PUSH_MARKER",
    "ResponseError",
    "RolloutServerError",
    "VLLMBackend",
    "WeightSyncError",
    "claim_push_folder",
    "push_bytes",
    "push_folder",
    "samples_from_completions",
]


class VLLMBackend(PushRoutes):
    """Rollouts from an external vLLM server (see the module docstring)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        graphdef,
        sp: SamplingParams,
        run_dir: str | Path,
        *,
        client: VLLMClient | None = None,
        probe_tol: float | None = None,
        probe_ids: list[int] | None = None,
        serve_dtype: str | None = None,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        free_bytes=disk_free,
    ):
        self.cfg = cfg
        self.max_shard_bytes = int(max_shard_bytes)  # the file route's shard size (save_hf)
        self.free_bytes = (
            free_bytes  # probe of the push folder's free bytes (`vllm_push.check_space`)
        )
        self.graphdef = graphdef
        self.sp = sp
        self.client = client or VLLMClient(
            cfg.vllm_url,
            api_key=cfg.vllm_api_key,
            timeout_s=cfg.timeout_s,
            startup_wait_s=cfg.server_wait_s,
        )
        self.weights_dir = push_folder(cfg.weights_dir, run_dir)
        # An absolute tolerance when given (or rollout.probe_tol > 0), else derived from the dtype.
        tol = probe_tol if probe_tol is not None else cfg.probe_tol
        self.probe_tol: float | None = float(tol) if tol else None
        self._probe_ids = probe_ids
        self.serve_dtype = serve_dtype  # None: asked from the server at the first push
        self._model_cfg = None
        self.pushes = 0
        self.synced_step: int | None = None
        self.last_slot: Path | None = None
        self.unconfirmed: str | None = None  # why the last push failed its check, until one passes
        self._push_done = threading.Event()  # cleared while a push runs (`_ensure_synced` waits)
        self._push_done.set()
        self.last_margin = 0.0  # max |diff| / tolerance of the last check (< 1: passed)
        self._pushed_ref = None  # weak reference to the params object last confirmed on the server
        self.route: str | None = None  # "file" or "protocol", resolved at the first push
        self.pusher: ProtocolPusher | None = None
        # protocol pushes encoded on the device (`device_patch.py`), else on the host (numpy): on the
        # device where it is an accelerator; on XLA:CPU the two measured in either order under load
        # (benchmarks/results/weight_sync.md), the host path is the default there
        self.device_patch = jax.default_backend() != "cpu"
        # float32 weights served in bf16 and diffed on the host: cast in the diff's pass (`casts_on_host`)
        self.host_cast = True
        self.patcher: DevicePatcher | None = None
        self.lora: LoraPusher | None = None  # rollout.lora_push = adapter: pushes adapters only
        self._lora_parts, self._lora_resolved = None, False
        # benchmarks: N -> how many tokens the server decodes for each of a rollout's N completions
        # (`VLLMClient.generate`'s decode_tokens: a skewed length distribution's work on a model whose
        # own completions are short; the completions trained are the plain ones)
        self.decode_tokens: Callable[[int], Sequence[int]] | None = None

    def attach_lora(self, train_graphdef, frozen, adapters_fn) -> None:
        """A LoRA run: pushes may send the adapters only (`rollout.lora_push`, `vllm_lora.py`).
        `adapters_fn()` gives the current adapters on `frozen`, the base the server started from."""
        self._lora_parts = (train_graphdef, frozen, adapters_fn)

    def adapter_push(self) -> bool:
        """Whether pushes send the adapters (resolved at the first push; `auto` asks the server)."""
        if not self._lora_resolved:
            self.lora = make_lora_pusher(self.cfg, self._lora_parts, self.client, self.weights_dir)
            self._lora_resolved = True
        return self.lora is not None

    # ------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.client.url

    def model_cfg(self, params):
        if self._model_cfg is None:
            self._model_cfg = nnx.merge(self.graphdef, params).cfg
        return self._model_cfg

    def probe_ids(self, params) -> list[int]:
        if self._probe_ids is None:
            self._probe_ids = default_probe_ids(self.model_cfg(params).vocab_size)
        return self._probe_ids

    def dtype(self, params) -> str:
        """The dtype the server computes in (asked once; else the trainer's compute dtype)."""
        if self.serve_dtype is None:
            self.serve_dtype = self.client.served_dtype() or self.model_cfg(params).dtype
        return self.serve_dtype

    def serving(self, params) -> tuple:
        """(graphdef, params) of the model as the server runs it: weights cast to its dtype."""
        graphdef = serving_graphdef(self.model_cfg(params), self.dtype(params))
        dt = DTYPES[self.serve_dtype]
        return graphdef, jax.tree.map(lambda x: x.astype(dt), params)

    def _ensure_synced(self, params) -> None:
        # A push in progress on another thread (rollouts queued ahead: rollout.max_staleness >= 2)
        # is waited for; a generation already running goes on across it (a partial rollout).
        self._push_done.wait()
        if self.unconfirmed is not None:
            raise WeightSyncError(
                f"refusing to roll out from {self.url}: the last weight push was not confirmed "
                f"({self.unconfirmed}); call sync_weights again once the server is fixed",
                url=self.url,
            )
        if self.synced_step is None:  # the server still serves whatever it started with
            self.sync_weights(params, 0)

    def generate(self, params, prompt_QP, prompt_valid_QP, seeds_Q, num_samples: int) -> Samples:
        self._ensure_synced(params)
        prompts = strip_padding(prompt_QP, prompt_valid_QP)
        G = int(num_samples)
        seeds = [int(s) * G for s in np.asarray(seeds_Q).astype(np.int64)]
        groups = self.client.generate(
            prompts,
            n=G,
            max_tokens=self.sp.max_new_tokens,
            seeds=seeds,
            temperature=self.sp.temperature,
            top_p=self.sp.top_p,
            top_k=self.sp.top_k,
            stop_token_ids=list(self.sp.eos_id),
            decode_tokens=None
            if self.decode_tokens is None
            else self.decode_tokens(len(seeds) * G),
        )
        return samples_from_completions(groups, G, self.sp, self.url)

    def greedy(self, params, prompt_QP, prompt_valid_QP, max_new_tokens: int | None = None):
        """Greedy completions (evaluation) of exactly `params`: when they are not the params object
        last pushed (e.g. with rollout.push_every > 1), they are pushed first."""
        self._ensure_synced(params)
        if self._pushed_ref is not None and self._pushed_ref() is not params:
            self.sync_weights(params, self.synced_step)
        prompts = strip_padding(prompt_QP, prompt_valid_QP)
        C = int(max_new_tokens or self.sp.max_new_tokens)
        groups = self.client.generate(
            prompts, n=1, max_tokens=C, temperature=0.0, stop_token_ids=list(self.sp.eos_id)
        )
        sp = SamplingParams(max_new_tokens=C, eos_id=self.sp.eos_id, pad_id=self.sp.pad_id)
        return samples_from_completions(groups, 1, sp, self.url)

    # ------------------------------------------------------------------------------------------

    def expected_probe(self, params) -> np.ndarray:
        """The trainer's probe log-probs [T, V] of `params` as the server runs them (or of the adapters
        pushed on the frozen base)."""
        if self.lora is not None:
            return self.lora.expected_probe(self.probe_ids(params), self.dtype(params))
        graphdef, served = self.serving(params)
        ids = jnp.asarray(self.probe_ids(params), jnp.int32)
        return np.asarray(probe_fn(graphdef)(served, ids))

    def probe_noise(self, params, lp_TV: np.ndarray) -> float:
        """The trainer's own rounding noise on the probe: the largest |log-prob in the serving dtype -
        log-prob of the same (cast) weights in float32| over the checked entries; 0 serving float32."""
        if self.serve_dtype == "float32":
            return 0.0
        ids = np.asarray(self.probe_ids(params))
        if self.lora is not None:  # the adapted model: base and adapters as served, in float32
            exact_TV = self.lora.expected_probe(list(ids), self.serve_dtype, compute="float32")
        else:
            cfg, (_, served) = self.model_cfg(params), self.serving(params)
            exact_TV = probe_fn(serving_graphdef(cfg, self.serve_dtype, compute="float32"))(
                served, jnp.asarray(ids, jnp.int32)
            )
        err_TV = np.abs(lp_TV - np.asarray(exact_TV))
        top = int(lp_TV[-1].argmax())  # the greedy next token's
        return float(max(err_TV[np.arange(len(ids) - 1), ids[1:]].max(), err_TV[-1, top]))

    def tolerance(self, want_T: np.ndarray, noise: float = 0.0) -> np.ndarray:
        """Per-position tolerance: `probe_tol` when set, else derived from the serving dtype and the
        model's rounding `noise` (`probe_noise`)."""
        if self.probe_tol is not None:
            return np.full(np.shape(want_T), self.probe_tol)
        return probe_tolerance(self.serve_dtype, want_T, noise)

    def verify(self, params, step: int | None = None) -> float:
        """Compare the server's probe log-probs with the trainer's (same weights, same dtype); raise
        `WeightSyncError` on a mismatch. Returns the max absolute difference."""
        ids = self.probe_ids(params)
        lp_TV = self.expected_probe(params)
        got_prompt, got_token, got_token_lp = self.client.prompt_logprobs(ids)
        want_prompt = lp_TV[np.arange(len(ids) - 1), ids[1:]]
        diffs = np.abs(np.asarray(got_prompt, np.float64) - want_prompt)
        noise = 0.0 if self.probe_tol is not None else self.probe_noise(params, lp_TV)
        tol = self.tolerance(want_prompt, noise)
        when = f" at step {step}" if step is not None else ""
        where = f"weight push{when} to {self.url} (slot {self.last_slot}, {self.serve_dtype})"
        worst = int(np.argmax(diffs / tol))
        max_diff = float(diffs.max())
        if not np.isfinite(max_diff) or diffs[worst] > tol[worst]:
            raise WeightSyncError(
                f"{where} not confirmed: probe check 'prompt log-probs' failed at position "
                f"{worst + 1} (token {ids[worst + 1]}): expected {want_prompt[worst]:.6f} (trainer), "
                f"got {got_prompt[worst]:.6f} (server); |diff| {diffs[worst]:.3g} > tolerance "
                f"{tol[worst]:.3g} (max |diff| {max_diff:.3g}). The server is serving other weights "
                f"than the trainer's.",
                url=self.url,
            )
        # The greedy next token: its log-prob must match, and it must be (tied with) the argmax.
        last = lp_TV[-1]
        token_diff = abs(got_token_lp - float(last[got_token]))
        argmax_gap = float(last.max()) - float(last[got_token])
        token_tol = float(self.tolerance(np.array([last.max()]), noise)[0])
        if token_diff > token_tol or argmax_gap > token_tol:
            raise WeightSyncError(
                f"{where} not confirmed: probe check 'greedy next token' failed: the server chose "
                f"token {got_token} with log-prob {got_token_lp:.6f}; the trainer gives it "
                f"{float(last[got_token]):.6f} and prefers token {int(last.argmax())} "
                f"({float(last.max()):.6f}); |diff| {max(token_diff, argmax_gap):.3g} > tolerance "
                f"{token_tol:.3g}",
                url=self.url,
            )
        self.last_margin = max(float((diffs / tol).max()), token_diff / token_tol)
        return max(max_diff, token_diff)

    def wait_ready(self) -> None:
        """Wait for a server that is still starting (`rollout.server_wait_s`; `JSONClient`)."""
        self.client.wait_until_up()

    def sync_weights(self, params, step: int) -> dict:
        """Push `params` to the server and confirm them with the probe check (see the module
        docstring). Until a push is confirmed, `generate` and `greedy` refuse to run."""
        self.unconfirmed = "push in progress"
        self._push_done.clear()
        t0 = time.perf_counter()
        try:
            # cast once; push and verify cast no further (an adapter push casts only the adapters). A
            # push cast on the host (`casts_on_host`) casts in its diff: the check's cast comes after
            host_cast = self.casts_on_host(params)
            served = params if self.adapter_push() or host_cast else self.serving(params)[1]
            jax.block_until_ready(served)
            cast_s = time.perf_counter() - t0
            try:
                metrics = self.push(served)
            except (
                OSError
            ) as e:  # a full /dev/shm: ENOSPC; a RolloutServerError like any failed push
                when = f" at step {step}" if step is not None else ""
                raise write_failed(e, self.weights_dir, self.url, when) from e
            t = time.perf_counter()
            if host_cast:
                served = self.serving(params)[1]
            diff = self.verify(served, step)
        except BaseException as e:
            self.unconfirmed = f"{type(e).__name__}: {e}"
            if self.pusher is not None:
                self.pusher.invalidate()  # the next push is a full one
            if self.patcher is not None:
                self.patcher.invalidate()
            raise
        finally:
            self._push_done.set()
        if self.route == "protocol":
            self.pusher.confirm()  # the base of the next sparse push
            if self.patcher is not None:
                self.patcher.confirm()
        self.unconfirmed = None
        self.synced_step = int(step)
        try:
            self._pushed_ref = weakref.ref(params)
        except TypeError:  # not weak-referenceable (a plain dict): no automatic push before greedy
            self._pushed_ref = None
        return {
            "weight_sync/bytes": metrics["weight_sync/bytes"],
            "weight_sync/probe_max_abs_diff": diff,
            "weight_sync/probe_diff_over_tol": self.last_margin,
            "weight_sync/write_s": metrics["write_s"],
            "weight_sync/reload_s": metrics["reload_s"],
            "weight_sync/pause_s": metrics["reload_s"],
            "weight_sync/changed_frac": metrics["changed_frac"],
            "weight_sync/full": metrics["full"],
            "weight_sync/verify_s": time.perf_counter() - t,
            "weight_sync/probe_s": time.perf_counter() - t,
            "weight_sync/device_s": cast_s + metrics.get("device_s", 0.0),
            "weight_sync/host_bytes": metrics.get("host_bytes", metrics["weight_sync/bytes"]),
            "weight_sync/host_s": metrics.get("host_s", metrics["write_s"]),
            "weight_sync/trainer_s": cast_s + metrics["write_s"],
            "weight_sync/total_s": time.perf_counter() - t0,
        }

    def close(self) -> None:
        """Close the client and delete the two push slots (transient copies of the policy; the
        trainer's checkpoints hold its state). The server keeps running."""
        if self.lora is not None:
            self.lora.close()
        self.client.close()
        if not (self.weights_dir / PUSH_MARKER).is_file():
            return  # never claimed: nothing of ours to remove
        for name in ("slot0", "slot1", "protocol"):
            shutil.rmtree(self.weights_dir / name, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.weights_dir / PUSH_MARKER).unlink()
            self.weights_dir.rmdir()  # only when empty
