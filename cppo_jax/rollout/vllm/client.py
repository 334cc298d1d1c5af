"""HTTP client of an external vLLM server: token-id completions, weight reloads, probe log-probs.

Host code: the standard library only (`http.client`, `json`, threads), no JAX and no `requests`.

Routes used (vLLM's OpenAI-compatible server, started by `launch/vllm_server.sh`):
  - `POST /v1/completions` with token-id prompts, `return_token_ids`, `logprobs: 0` (the sampled tokens'
    log-probabilities) and, for the weight probe, `prompt_logprobs: 0`;
  - `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}` and
    `POST /reset_prefix_cache?reset_running_requests=true` (dev routes, on only with
    `VLLM_SERVER_DEV_MODE=1`): requests running across a push are preempted and go on with their KV
    recomputed under the new weights (a partial rollout), so no block of the old weights survives;
  - `GET /health`, `GET /v1/models`, and `GET /server_info?config_format=json` (dev route) for the dtype the
    server computes in, so that the trainer checks a push against the same dtype.

Security: the dev routes are NOT guarded by vLLM's `--api-key` (only `/v1/*` is); anyone who can reach the
port can replace the served weights with any folder on the server's disk. Run the server on loopback or a
private network only. With an API key set, the client sends `Authorization: Bearer <key>` on every request.

Robustness: timeouts, retries and the error classes are the transport's (`vllm_http`; the errors are
importable from here too). Nothing is ever padded or guessed: fewer choices than asked, a wrong token count
or bad JSON is a `ResponseError`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cppo_jax.rollout.vllm.transport import (
    JSONClient,
    ResponseError,
    RolloutServerError,
    WeightSyncError,
)

__all__ = [
    "Completion",
    "ResponseError",
    "RolloutServerError",
    "VLLMClient",
    "WeightSyncError",
]


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids, their log-probs and why it ended ("stop" or "length")."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str


# After a push: every cached block was computed by the old weights. Running requests (rollouts
# queued ahead, `rollout.max_staleness >= 2`) hold blocks, and without `reset_running_requests` vLLM
# would refuse the reset ({"success": false}) and keep serving old blocks to later requests.
RESET_PREFIX_CACHE = "/reset_prefix_cache?reset_running_requests=true"


def reset_prefix_cache(client) -> None:
    """Reset the server's prefix cache (`RESET_PREFIX_CACHE`) through `client.request`; a reset the
    server answers as failed raises `ResponseError`."""
    out = client.request("POST", RESET_PREFIX_CACHE, None, what="resetting the prefix cache")
    if isinstance(out, dict) and out.get("success") is False:
        raise ResponseError(
            f"POST {client.url}{RESET_PREFIX_CACHE} answered {out}: the server kept its prefix "
            "cache, so blocks computed by the old weights could be served after the push",
            url=client.url,
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


class VLLMClient(JSONClient):
    """A thread-safe client of one vLLM server: completions, weight reloads, probe log-probs.

    Transport, timeouts and retries are `JSONClient`'s; `max_workers` bounds the concurrent per-prompt
    requests of `generate`; `model` names the served model (default: asked from `GET /v1/models`).
    """

    def __init__(
        self, url: str, *, max_workers: int = 32, model: str | None = None, **transport: Any
    ):
        """`transport`: `JSONClient`'s keywords (api_key, timeouts, retries, backoff)."""
        super().__init__(url, **transport)
        self._model = model
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------
    # Routes

    def model_name(self) -> str:
        """The served model's name (`GET /v1/models`; the `--model` value unless renamed)."""
        with self._lock:
            if self._model is None:
                out = self.request("GET", "/v1/models", what="listing the served models")
                try:
                    self._model = str(out["data"][0]["id"])
                except (TypeError, KeyError, IndexError) as e:
                    raise ResponseError(
                        f"GET {self.url}/v1/models answered no model: {str(out)[:200]}",
                        url=self.url,
                    ) from e
            return self._model

    def set_model(self, name: str) -> None:
        """Send later requests to the served model (or loaded LoRA adapter) `name`."""
        with self._lock:
            self._model = name

    def served_dtype(self) -> str | None:
        """The dtype the server computes in ("bfloat16", "float16", "float32"), from the dev route
        `GET /server_info`; None when the server has no such route (HTTP 404)."""
        try:
            out = self.request(
                "GET", "/server_info?config_format=json", what="reading the served dtype"
            )
        except RolloutServerError as e:
            if e.status == 404:
                return None
            raise
        try:
            raw = str(out["vllm_config"]["model_config"]["dtype"])
        except (TypeError, KeyError) as e:
            raise ResponseError(
                f"GET {self.url}/server_info answered no vllm_config.model_config.dtype: "
                f"{str(out)[:200]!r}",
                url=self.url,
            ) from e
        name = raw.removeprefix("torch.")
        if name not in ("bfloat16", "float16", "float32"):
            raise ResponseError(
                f"GET {self.url}/server_info: unknown model dtype {raw!r} "
                f"(expected bfloat16, float16 or float32)",
                url=self.url,
            )
        return name

    def reload_weights(self, weights_path: str) -> None:
        """Every worker reloads its weights in place from the HF folder `weights_path`."""
        payload = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}}
        out = self.request(
            "POST", "/collective_rpc", payload, what=f"reloading weights from {weights_path}"
        )
        if not isinstance(out, dict) or not isinstance(out.get("results"), list):
            raise ResponseError(
                f"POST {self.url}/collective_rpc (reload_weights) answered {str(out)[:200]!r}, "
                f'expected {{"results": [...]}}',
                url=self.url,
            )

    def reset_prefix_cache(self) -> None:
        reset_prefix_cache(self)

    # ------------------------------------------------------------------------------------------
    # Completions

    def _completion_payload(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        stop_token_ids: Sequence[int],
        extra: dict | None = None,
    ) -> dict:
        payload = {
            "model": self.model_name(),
            "prompt": prompts,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": False,
        }
        if top_k > 0:
            payload["top_k"] = top_k
        if seed is not None:
            payload["seed"] = int(seed)
        if stop_token_ids:
            payload["stop_token_ids"] = [int(t) for t in stop_token_ids]
        payload.update(extra or {})
        return payload

    def _parse_choices(
        self, out: Any, prompts: list[list[int]], n: int, max_tokens: int, what: str
    ) -> list[list[Completion]]:
        """Validated choices, grouped by prompt (choice i belongs to prompt i // n)."""
        where = f"POST {self.url}/v1/completions ({what})"

        def bad(msg: str) -> ResponseError:
            return ResponseError(f"{where}: {msg}", url=self.url)

        if not isinstance(out, dict) or not isinstance(out.get("choices"), list):
            raise bad(f"no 'choices' list in the answer: {str(out)[:200]!r}")
        choices = out["choices"]
        want = len(prompts) * n
        if len(choices) != want:
            raise bad(
                f"asked for {want} completions ({len(prompts)} prompts x n={n}), got {len(choices)}"
            )
        by_index: dict[int, dict] = {}
        for pos, c in enumerate(choices):
            if not isinstance(c, dict):
                raise bad(f"choice {pos} is not an object: {str(c)[:100]!r}")
            index = c.get("index", pos)
            if not _is_int(index) or not 0 <= index < want or index in by_index:
                raise bad(f"choice {pos} has index {index!r}: expected distinct 0..{want - 1}")
            by_index[index] = c
        grouped: list[list[Completion]] = []
        for p, prompt in enumerate(prompts):
            group = []
            for j in range(n):
                i = p * n + j
                c = by_index[i]
                ids = c.get("token_ids")
                if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
                    raise bad(f"choice {i} (prompt {p}) has no list of int 'token_ids'")
                lps = (c.get("logprobs") or {}).get("token_logprobs")
                if not isinstance(lps, list) or not all(_is_number(x) for x in lps):
                    raise bad(f"choice {i} (prompt {p}) has no numeric 'logprobs.token_logprobs'")
                if len(lps) != len(ids):
                    raise bad(
                        f"choice {i} (prompt {p}): {len(ids)} token ids but {len(lps)} log-probs"
                    )
                reason = c.get("finish_reason")
                if reason not in ("stop", "length"):
                    raise bad(f"choice {i} (prompt {p}) has finish_reason {reason!r}")
                if len(ids) > max_tokens or (reason == "length" and len(ids) != max_tokens):
                    raise bad(
                        f"choice {i} (prompt {p}): {len(ids)} tokens with finish_reason "
                        f"{reason!r} and max_tokens={max_tokens}"
                    )
                if reason == "stop" and not ids:
                    raise bad(f"choice {i} (prompt {p}) stopped with no token")
                echoed = c.get("prompt_token_ids")
                if echoed is not None and list(echoed) != list(prompt):
                    raise bad(
                        f"choice {i} belongs to prompt {p}, but echoes a different prompt "
                        f"({len(echoed)} tokens, sent {len(prompt)}): answers out of order?"
                    )
                group.append(Completion(tuple(ids), tuple(float(x) for x in lps), reason))
            grouped.append(group)
        return grouped

    def complete(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        what: str = "generating completions",
        extra: dict | None = None,
    ) -> list[list[Completion]]:
        """One `/v1/completions` request for all `prompts`; `n` completions of each, in prompt order.
        `extra`: more fields of the request (vLLM's sampling parameters)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        payload = self._completion_payload(
            [list(map(int, p)) for p in prompts],
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=stop_token_ids,
            extra=extra,
        )
        out = self.request("POST", "/v1/completions", payload, what=what)
        return self._parse_choices(out, payload["prompt"], n, max_tokens, what)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        seeds: Sequence[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        decode_tokens: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """`n` completions of each prompt, in prompt order.

        With `seeds`, one request per prompt (sent concurrently; the server batches them), seeded
        `seeds[q]`: sample j of prompt q is then seeded `seeds[q] + j` by vLLM, so callers space the
        seeds at least n apart. Without, one request for all prompts (greedy evaluation).

        `decode_tokens` (benchmarks; with `seeds`): how many tokens the server decodes for each
        completion (prompt-major, each at least `max_tokens`), whatever it samples: one request per
        completion, seeded `seeds[q] + j` as vLLM seeds sample j, with `ignore_eos` and no stop ids,
        then cut here at its first stop id or at `max_tokens`. What comes back is what the plain
        request samples (ignoring the end id changes no distribution, only when decoding stops); the
        server's work follows `decode_tokens` (e.g. a reasoning model's skewed lengths on a model
        whose own completions are short).
        """
        if decode_tokens is not None:
            return self._decoding(
                prompts,
                n,
                max_tokens,
                seeds,
                decode_tokens,
                stop_token_ids,
                dict(temperature=temperature, top_p=top_p, top_k=top_k),
            )
        common = dict(
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
        )
        if temperature == 0.0 and n > 1:
            # vLLM refuses n > 1 when greedy; every greedy sample is the same, so ask for one.
            common["n"] = 1
            groups = self.generate(prompts, seeds=seeds, **common)
            return [group * n for group in groups]
        if seeds is None:
            return self.complete(prompts, **common)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        pool = self._executor()

        def one(q: int) -> list[Completion]:
            (group,) = self.complete(
                [prompts[q]], seed=int(seeds[q]), what=f"prompt {q} of {len(prompts)}", **common
            )
            return group

        futures = [pool.submit(one, q) for q in range(len(prompts))]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()

    def _decoding(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        seeds: Sequence[int] | None,
        decode_tokens: Sequence[int],
        stop_token_ids: Sequence[int],
        sampling: dict,
    ) -> list[list[Completion]]:
        """`generate` with `decode_tokens` (see there)."""
        if seeds is None or len(seeds) != len(prompts):
            raise ValueError(f"decode_tokens needs one seed per prompt, got {seeds!r}")
        lengths = [int(t) for t in decode_tokens]
        if len(lengths) != len(prompts) * n:
            raise ValueError(
                f"{len(lengths)} decode_tokens for {len(prompts)} prompts x n={n} completions"
            )
        if min(lengths, default=max_tokens) < max_tokens:
            raise ValueError(
                f"decode_tokens {min(lengths)} < max_tokens {max_tokens}: a completion would be cut "
                "shorter than the plain request cuts it"
            )
        stops = {int(t) for t in stop_token_ids}
        # every completion in flight at once, as the plain requests' n = G samples each are (the
        # client's pool, max_workers requests, would hold the server's batch to max_workers sequences)
        pool = ThreadPoolExecutor(len(lengths), thread_name_prefix="vllm-decode")

        def one(i: int) -> Completion:
            q, j = divmod(i, n)
            ((c,),) = self.complete(
                [prompts[q]],
                n=1,
                max_tokens=lengths[i],
                seed=int(seeds[q]) + j,
                what=f"completion {j} of prompt {q}, {lengths[i]} tokens decoded",
                extra={"ignore_eos": True},
                **sampling,
            )
            ends = [t for t, tok in enumerate(c.token_ids[:max_tokens]) if tok in stops]
            if ends:
                end = ends[0] + 1
                return Completion(c.token_ids[:end], c.logprobs[:end], "stop")
            return Completion(c.token_ids[:max_tokens], c.logprobs[:max_tokens], "length")

        futures = [pool.submit(one, i) for i in range(len(lengths))]
        try:
            done = [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [done[q * n : (q + 1) * n] for q in range(len(prompts))]

    def prompt_logprobs(self, ids: Sequence[int]) -> tuple[list[float], int, float]:
        """The server's log-probs of a probe sequence at temperature 0 (for weight checks).

        Returns (log p(ids[i] | ids[:i]) for i = 1..T-1, the greedy next token, its log-prob).
        """
        ids = [int(t) for t in ids]
        what = "probe log-probs"
        payload = self._completion_payload(
            [ids],
            n=1,
            max_tokens=1,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=0,
            stop_token_ids=(),
            extra={"prompt_logprobs": 0},
        )
        out = self.request("POST", "/v1/completions", payload, what=what)
        ((greedy,),) = self._parse_choices(out, [ids], 1, 1, what)
        raw = out["choices"][0].get("prompt_logprobs")
        where = f"POST {self.url}/v1/completions ({what})"
        if not isinstance(raw, list) or len(raw) != len(ids):
            raise ResponseError(
                f"{where}: expected 'prompt_logprobs' with {len(ids)} entries, got "
                f"{str(raw)[:200]!r}",
                url=self.url,
            )
        lps = []
        for i in range(1, len(ids)):
            entry = raw[i]
            item = entry.get(str(ids[i])) if isinstance(entry, dict) else None
            value = item.get("logprob") if isinstance(item, dict) else item
            if not _is_number(value):
                raise ResponseError(
                    f"{where}: prompt_logprobs[{i}] has no log-prob for token {ids[i]}: "
                    f"{str(entry)[:200]!r}",
                    url=self.url,
                )
            lps.append(float(value))
        return lps, greedy.token_ids[0], greedy.logprobs[0]

    # ------------------------------------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="vllm-client")
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
