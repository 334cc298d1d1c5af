"""JSON over HTTP to a vLLM server: timeouts, retries with backoff, and the errors every caller sees.

Host code: the standard library only (`http.client`, `json`), no JAX and no `requests`.

Robustness: every request has a connect timeout and a read timeout; connection errors (refused, reset, closed
early) and 5xx answers are retried a bounded number of times with exponential backoff; a read timeout is not
retried (a generation that did not answer in `timeout_s` will not answer faster the second time). A server
that stays down, answers 4xx, times out or answers something malformed raises `RolloutServerError` (or its
subclass `ResponseError`), whose message names the URL and what failed.

Security: with an API key set, every request carries `Authorization: Bearer <key>`; vLLM's dev routes are not
guarded by it (see `vllm_client`).
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.parse
from typing import Any

__all__ = ["JSONClient", "ResponseError", "RolloutServerError", "WeightSyncError"]


class RolloutServerError(RuntimeError):
    """The rollout server could not be used: down, timed out, refused the request, answered badly."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status


class ResponseError(RolloutServerError):
    """The server answered, but the answer is malformed or incomplete (never retried, never padded)."""


class WeightSyncError(RolloutServerError):
    """A weight push was not confirmed: the server's probe log-probs differ from the trainer's."""


class _ConnectFailedError(Exception):
    """The TCP connect itself failed (refused, timed out, unreachable): always worth a retry."""


_RETRYABLE = (
    ConnectionError,  # refused, reset, aborted, broken pipe
    http.client.RemoteDisconnected,
    http.client.IncompleteRead,
    http.client.BadStatusLine,
)


class JSONClient:
    """JSON requests to one server, thread-safe (a fresh connection per request).

    `timeout_s` bounds the wait for an answer (read timeout); `connect_timeout_s` the TCP connect.
    Connection errors and 5xx answers are retried `retries` times, waiting `backoff_s`, 2 `backoff_s`,
    4 `backoff_s`, ... (at most `max_backoff_s`) in between. With `startup_wait_s` > 0 the first request
    waits until `GET /health` answers 200, up to that many seconds: a server still loading its model
    (started beside the trainer, as launch/gpu_node.sh does) is waited for, not retried into an error.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str = "",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        startup_wait_s: float = 0.0,
    ):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(
                f"rollout.vllm_url = {url!r} is not an http(s) URL like http://127.0.0.1:8011"
            )
        self.url = url.rstrip("/")
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._https else 80)
        self._prefix = parsed.path.rstrip("/")
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(min(connect_timeout_s, timeout_s))
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.startup_wait_s = float(startup_wait_s)
        self._up = self.startup_wait_s <= 0  # True once /health answered (or no wait asked)
        self._up_lock = threading.Lock()

    def _headers(self, body: bytes | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _once(self, method: str, path: str, body: bytes | None, timeout_s: float):
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.connect_timeout_s)
        try:
            try:
                conn.connect()
            except OSError as e:
                raise _ConnectFailedError(f"connect failed: {type(e).__name__}: {e}") from e
            conn.sock.settimeout(timeout_s)  # from here on: the read timeout
            conn.request(method, self._prefix + path, body=body, headers=self._headers(body))
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        what: str,
        timeout_s: float | None = None,
        retries: int | None = None,
        raw: bool = False,
    ) -> Any:
        """Send one JSON request (with retries); return the decoded JSON answer (`raw`: the answer's
        text, for routes that answer plain text, e.g. vLLM's LoRA routes).

        `what` says in words what the request was for (it appears in every error message).
        """
        if not self._up:
            self.wait_until_up()
        body = None if payload is None else json.dumps(payload).encode()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        retries = self.retries if retries is None else retries
        where = f"{method} {self.url}{path}"
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                status, data = self._once(method, path, body, timeout_s)
            except _ConnectFailedError as e:
                last = str(e)
                continue
            except TimeoutError as e:
                # The connection was made but no answer came: the server is stuck; not retried.
                raise RolloutServerError(
                    f"{what}: {where} did not answer within the read timeout of {timeout_s:g} s "
                    f"(rollout.timeout_s); the server accepted the connection but sent nothing back",
                    url=self.url,
                ) from e
            except _RETRYABLE as e:
                last = f"{type(e).__name__}: {e}"
                continue
            except OSError as e:  # e.g. no route to host, name resolution
                last = f"{type(e).__name__}: {e}"
                continue
            if status >= 500:
                last = f"HTTP {status}: {data[:300].decode(errors='replace')}"
                continue
            if status >= 400:
                hint = ""
                if status == 401:
                    hint = " (wrong or missing rollout.vllm_api_key)"
                elif status == 404 and path.split("?")[0] in (
                    "/collective_rpc",
                    "/reset_prefix_cache",
                ):
                    hint = " (start the server with VLLM_SERVER_DEV_MODE=1: launch/vllm_server.sh does)"
                raise RolloutServerError(
                    f"{what}: {where} answered HTTP {status}{hint}: "
                    f"{data[:500].decode(errors='replace')}",
                    url=self.url,
                    status=status,
                )
            if raw:
                return data.decode(errors="replace")
            try:
                return json.loads(data) if data.strip() else None
            except ValueError as e:
                raise ResponseError(
                    f"{what}: {where} answered HTTP {status} with malformed JSON ({e}): "
                    f"{data[:200].decode(errors='replace')!r}",
                    url=self.url,
                    status=status,
                ) from e
        raise RolloutServerError(
            f"{what}: {where} failed {retries + 1} times in a row (last: {last}); "
            f"is the vLLM server at {self.url} running? (launch/vllm_server.sh MODEL_DIR PORT)",
            url=self.url,
        )

    # ------------------------------------------------------------------------------------------
    # Health

    def health(self, timeout_s: float = 5.0) -> bool:
        """True when `GET /health` answers 200 now (no retries)."""
        try:
            status, _ = self._once("GET", "/health", None, timeout_s)
        except (OSError, http.client.HTTPException, _ConnectFailedError):
            return False
        return status == 200

    def wait_healthy(self, timeout_s: float = 180.0, poll_s: float = 1.0) -> float:
        """Wait until `GET /health` answers 200; return the seconds waited. Raises
        `RolloutServerError` naming the URL when it has not answered within `timeout_s`."""
        t0 = time.monotonic()
        while not self.health():
            if time.monotonic() - t0 > timeout_s:
                raise RolloutServerError(
                    f"{self.url}/health did not answer 200 within {timeout_s:g} s "
                    f"(rollout.server_wait_s); is the vLLM server at {self.url} starting? "
                    f"(launch/vllm_server.sh MODEL_DIR PORT)",
                    url=self.url,
                )
            time.sleep(poll_s)
        return time.monotonic() - t0

    def wait_until_up(self) -> None:
        """Wait for a server that is still starting, up to `startup_wait_s` (once; any thread). The
        first request calls it; a caller may call it earlier, e.g. before installing signal handlers."""
        with self._up_lock:
            if self._up:
                return
            if not self.health():
                print(
                    f"waiting up to {self.startup_wait_s:g} s for the vLLM server at {self.url} "
                    f"(GET /health)",
                    file=sys.stderr,
                    flush=True,
                )
                waited = self.wait_healthy(self.startup_wait_s)
                print(f"{self.url} answered after {waited:.1f} s", file=sys.stderr, flush=True)
            self._up = True
