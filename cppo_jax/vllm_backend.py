"""The vLLM rollout backend: completions from an external vLLM server, verified weight pushes.

`VLLMBackend` implements `cppo_jax.rollout.RolloutBackend` on top of `cppo_jax.vllm_client.VLLMClient`:

- `generate`: one `/v1/completions` request per question (its left padding stripped), `n = G`, seeded
  `seeds_Q[q] * G` so that the per-sample seeds (seed + j) of different questions never overlap; the answers
  come back as the same `Samples` the embedded sampler returns (tokens padded with `pad_id` after EOS,
  log-probs 0 there, `valid` up to and including EOS, `finished` for "stop" vs "length").
- `sync_weights(params, step)`: write the policy as a Hugging Face checkpoint into one of two alternating
  slots under `rollout.weights_dir` (default `<run_dir>/weights`; written to a temporary sibling and renamed
  into place, so the server never reads half a file), ask the server to reload it (`/collective_rpc`
  `reload_weights`), reset its prefix cache, then VERIFY: the server's log-probs of a fixed probe sequence
  (prompt log-probs and the greedy next token, temperature 0) must equal the trainer's own, computed here in
  JAX from the same params, within `probe_tol`. A mismatch raises `WeightSyncError` (expected vs got, max
  diff) before any further rollout can use stale weights.

The server must be reachable by the trainer and must read `weights_dir` at the same path (same machine or a
shared file system). The dev routes it needs are unauthenticated: keep it on loopback or a private network
(see `cppo_jax/vllm_client.py` and docs/vllm.md).

Log-probs returned in `Samples.logp_NC` are the server's (vLLM computes them before temperature unless it
runs with `--logprobs-mode processed_logprobs`); the trainer recomputes the log-probs it trains on.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.config import ConfigError, RolloutConfig
from cppo_jax.models.hf_io import SINGLE_FILE, save_hf
from cppo_jax.sampler import Samples, SamplingParams
from cppo_jax.vllm_client import (
    Completion,
    ResponseError,
    RolloutServerError,
    VLLMClient,
    WeightSyncError,
)

__all__ = [
    "DEFAULT_PROBE_TOL",
    "ResponseError",
    "RolloutServerError",
    "VLLMBackend",
    "WeightSyncError",
    "default_probe_ids",
    "samples_from_completions",
]

DEFAULT_PROBE_TOL = 1e-3
PROBE_LEN = 12


def default_probe_ids(vocab_size: int, length: int = PROBE_LEN, seed: int = 1234) -> list[int]:
    """A fixed probe sequence: ids from a seeded generator below min(vocab, 256), which every
    byte-level tokenizer covers (vLLM rejects prompt ids its tokenizer does not know)."""
    high = min(vocab_size, 256)
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3 if high > 8 else 0, high, size=length)]


def samples_from_completions(
    groups: list[list[Completion]], num_samples: int, sp: SamplingParams, url: str = ""
) -> Samples:
    """Static-shape `Samples` [Q*G, C] from per-question completions (prompt-major rows)."""
    G, C = num_samples, sp.max_new_tokens
    N = len(groups) * G
    tokens_NC = np.full((N, C), sp.pad_id, np.int32)
    logp_NC = np.zeros((N, C), np.float32)
    valid_NC = np.zeros((N, C), bool)
    finished_N = np.zeros((N,), bool)
    for q, group in enumerate(groups):
        if len(group) != G:
            raise ResponseError(
                f"{url}: question {q} came back with {len(group)} completions, expected {G}",
                url=url,
            )
        for j, c in enumerate(group):
            row, n = q * G + j, len(c.token_ids)
            if n > C:
                raise ResponseError(
                    f"{url}: completion {j} of question {q} has {n} tokens, more than {C}", url=url
                )
            ids = np.asarray(c.token_ids, np.int64)
            eos_at = np.flatnonzero(ids == sp.eos_id)
            if eos_at.size and eos_at[0] != n - 1:
                raise ResponseError(
                    f"{url}: completion {j} of question {q} goes on after EOS (id {sp.eos_id}) at "
                    f"token {eos_at[0]} of {n}: the server ignored the stop token",
                    url=url,
                )
            tokens_NC[row, :n] = ids
            logp_NC[row, :n] = c.logprobs
            valid_NC[row, :n] = True
            finished_N[row] = c.finish_reason == "stop"
    # Decoded positions: C when any sequence was truncated, else 1 + the last EOS position.
    steps = int(valid_NC.sum(axis=1).max()) if N else 0
    return Samples(
        jnp.asarray(tokens_NC),
        jnp.asarray(logp_NC),
        jnp.asarray(valid_NC),
        jnp.asarray(finished_N),
        jnp.int32(steps),
    )


@functools.cache
def _probe_fn(graphdef):
    """Jitted log-softmax of the model's logits on one probe row: [T] ids -> [T, V] log-probs."""

    def fn(params, ids_T):
        model = nnx.merge(graphdef, params)
        T = ids_T.shape[0]
        logits_1TV, _ = model(
            ids_T[None], jnp.arange(T, dtype=jnp.int32)[None], jnp.ones((1, T), bool)
        )
        return jax.nn.log_softmax(logits_1TV[0].astype(jnp.float32), axis=-1)

    return jax.jit(fn)


class VLLMBackend:
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
    ):
        self.cfg = cfg
        self.graphdef = graphdef
        self.sp = sp
        self.client = client or VLLMClient(
            cfg.vllm_url, api_key=cfg.vllm_api_key, timeout_s=cfg.timeout_s
        )
        self.weights_dir = push_folder(cfg.weights_dir, run_dir)
        tol = probe_tol if probe_tol is not None else getattr(cfg, "probe_tol", DEFAULT_PROBE_TOL)
        self.probe_tol = float(tol)
        self._probe_ids = probe_ids
        self.pushes = 0
        self.synced_step: int | None = None
        self.last_slot: Path | None = None
        self.unconfirmed: str | None = None  # why the last push failed its check, until one passes
        self._pushed_ref = None  # weak reference to the params object last confirmed on the server

    # ------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.client.url

    def probe_ids(self, params) -> list[int]:
        if self._probe_ids is None:
            vocab = nnx.merge(self.graphdef, params).cfg.vocab_size
            self._probe_ids = default_probe_ids(vocab)
        return self._probe_ids

    def _ensure_synced(self, params) -> None:
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
        prompts = _strip_padding(prompt_QP, prompt_valid_QP)
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
            stop_token_ids=[self.sp.eos_id],
        )
        return samples_from_completions(groups, G, self.sp, self.url)

    def greedy(self, params, prompt_QP, prompt_valid_QP, max_new_tokens: int | None = None):
        """Greedy completions (evaluation) of exactly `params`: when they are not the params object
        last pushed (e.g. with rollout.push_every > 1), they are pushed first."""
        self._ensure_synced(params)
        if self._pushed_ref is not None and self._pushed_ref() is not params:
            self.sync_weights(params, self.synced_step)
        prompts = _strip_padding(prompt_QP, prompt_valid_QP)
        C = int(max_new_tokens or self.sp.max_new_tokens)
        groups = self.client.generate(
            prompts, n=1, max_tokens=C, temperature=0.0, stop_token_ids=[self.sp.eos_id]
        )
        sp = SamplingParams(max_new_tokens=C, eos_id=self.sp.eos_id, pad_id=self.sp.pad_id)
        return samples_from_completions(groups, 1, sp, self.url)

    # ------------------------------------------------------------------------------------------

    def write_weights(self, params) -> tuple[Path, int]:
        """The policy as an HF checkpoint in the next of two slots (atomic); returns (folder, bytes)."""
        claim_push_folder(self.weights_dir)
        slot = self.weights_dir / f"slot{self.pushes % 2}"
        model = nnx.merge(self.graphdef, params)
        save_hf(model, slot)
        return slot, (slot / SINGLE_FILE).stat().st_size

    def push(self, params) -> dict:
        """Write, reload and reset the prefix cache (no check); returns timings."""
        t0 = time.perf_counter()
        slot, nbytes = self.write_weights(params)
        t1 = time.perf_counter()
        self.client.reload_weights(str(slot))
        self.client.reset_prefix_cache()
        t2 = time.perf_counter()
        self.pushes += 1
        self.last_slot = slot
        return {"weight_sync/bytes": float(nbytes), "write_s": t1 - t0, "reload_s": t2 - t1}

    def verify(self, params, step: int | None = None) -> float:
        """Compare the server's probe log-probs with the trainer's; raise `WeightSyncError` on a
        mismatch. Returns the max absolute difference."""
        ids = self.probe_ids(params)
        got_prompt, got_token, got_token_lp = self.client.prompt_logprobs(ids)
        lp_TV = np.asarray(_probe_fn(self.graphdef)(params, jnp.asarray(ids, jnp.int32)))
        want_prompt = lp_TV[np.arange(len(ids) - 1), ids[1:]]
        diffs = np.abs(np.asarray(got_prompt, np.float64) - want_prompt)
        when = f" at step {step}" if step is not None else ""
        where = f"weight push{when} to {self.url} (slot {self.last_slot})"
        worst = int(np.argmax(diffs))
        max_diff = float(diffs[worst])
        if not np.isfinite(max_diff) or max_diff > self.probe_tol:
            raise WeightSyncError(
                f"{where} not confirmed: probe check 'prompt log-probs' failed at position "
                f"{worst + 1} (token {ids[worst + 1]}): expected {want_prompt[worst]:.6f} (trainer), "
                f"got {got_prompt[worst]:.6f} (server); max |diff| {max_diff:.3g} > tolerance "
                f"{self.probe_tol:g}. The server is serving other weights than the trainer's.",
                url=self.url,
            )
        # The greedy next token: its log-prob must match, and it must be (tied with) the argmax.
        last = lp_TV[-1]
        token_diff = abs(got_token_lp - float(last[got_token]))
        argmax_gap = float(last.max()) - float(last[got_token])
        if token_diff > self.probe_tol or argmax_gap > self.probe_tol:
            raise WeightSyncError(
                f"{where} not confirmed: probe check 'greedy next token' failed: the server chose "
                f"token {got_token} with log-prob {got_token_lp:.6f}; the trainer gives it "
                f"{float(last[got_token]):.6f} and prefers token {int(last.argmax())} "
                f"({float(last.max()):.6f}); |diff| {max(token_diff, argmax_gap):.3g} > tolerance "
                f"{self.probe_tol:g}",
                url=self.url,
            )
        return max(max_diff, token_diff)

    def sync_weights(self, params, step: int) -> dict:
        """Push `params` to the server and confirm them with the probe check (see the module
        docstring). Until a push is confirmed, `generate` and `greedy` refuse to run."""
        self.unconfirmed = "push in progress"
        try:
            metrics = self.push(params)
            t = time.perf_counter()
            diff = self.verify(params, step)
        except BaseException as e:
            self.unconfirmed = f"{type(e).__name__}: {e}"
            raise
        self.unconfirmed = None
        self.synced_step = int(step)
        try:
            self._pushed_ref = weakref.ref(params)
        except TypeError:  # not weak-referenceable (a plain dict): no automatic push before greedy
            self._pushed_ref = None
        return {
            "weight_sync/bytes": metrics["weight_sync/bytes"],
            "weight_sync/probe_max_abs_diff": diff,
            "weight_sync/write_s": metrics["write_s"],
            "weight_sync/reload_s": metrics["reload_s"],
            "weight_sync/verify_s": time.perf_counter() - t,
        }

    def close(self) -> None:
        """Close the client and delete the two push slots (transient copies of the policy; the
        trainer's checkpoints hold its state). The server keeps running."""
        self.client.close()
        if not (self.weights_dir / PUSH_MARKER).is_file():
            return  # never claimed: nothing of ours to remove
        for i in range(2):
            shutil.rmtree(self.weights_dir / f"slot{i}", ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.weights_dir / PUSH_MARKER).unlink()
            self.weights_dir.rmdir()  # only when empty


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


def _strip_padding(prompt_QP, prompt_valid_QP) -> list[list[int]]:
    prompt_QP = np.asarray(prompt_QP)
    valid_QP = np.asarray(prompt_valid_QP).astype(bool)
    prompts = [[int(t) for t in row[valid]] for row, valid in zip(prompt_QP, valid_QP)]
    for q, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {q} has no valid token")
    return prompts
