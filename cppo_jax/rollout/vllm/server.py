"""Start and stop a local vLLM server from Python (tests, notebooks, single-machine runs).

Host code: no JAX. `VLLMServer(model_dir, port, log_path)` is a context manager that

1. builds the CPU environment when it is missing (`vllm_server.sh --install-only`; a no-op once the
   cached environment exists, about 3 minutes the first time),
2. runs `vllm_server.sh --foreground MODEL_DIR PORT ...` in a new process group, bound to 127.0.0.1,
   its output in `log_path`,
3. waits for `GET /health` (failing fast, with the log's tail, when the process dies first), and
4. on exit (also on errors, and at interpreter exit as a last resort) stops the whole process group:
   SIGTERM, then SIGKILL after a grace period. No server outlives the `with` block; should this process
   die abruptly (SIGKILL), a small watchdog process kills the server's process group anyway.

The script is package data of `cppo_jax.rollout` (found through `importlib.resources`, so an installed wheel
has it too); in a clone, `launch/vllm_server.sh` is a link to the same file.

    with VLLMServer("runs/model", port=8011, log_path="runs/vllm.log") as server:
        client = VLLMClient(server.url)
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.resources
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LAUNCH_SCRIPT", "VLLMServer", "VLLMServerError", "free_port", "install"]

LAUNCH_SCRIPT = Path(str(importlib.resources.files("cppo_jax.rollout") / "vllm_server.sh"))
_LIVE: set[VLLMServer] = set()


class VLLMServerError(RuntimeError):
    """The server could not be installed or started; the message carries the log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def install(timeout_s: float = 1200.0, log_path: str | Path | None = None) -> float:
    """Build the vLLM CPU environment if missing (`vllm_server.sh --install-only`).

    Returns the seconds it took (about 0 when the cached environment exists).
    """
    t0 = time.monotonic()
    log = Path(log_path) if log_path else None
    with open(log, "a") if log else contextlib.nullcontext() as fh:
        try:
            proc = subprocess.run(
                ["bash", str(LAUNCH_SCRIPT), "--install-only"],
                stdout=fh if fh else subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                text=True,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as e:
            raise VLLMServerError(f"installing vLLM took more than {timeout_s:g} s") from e
    if proc.returncode != 0:
        out = _tail(log) if log else (proc.stdout or "")[-4000:]
        raise VLLMServerError(f"installing vLLM failed (exit {proc.returncode}):\n{out}")
    return time.monotonic() - t0


# Run by a small watchdog process: it blocks reading a pipe whose only writer is this process; EOF means this
# process has ended (however it ended, SIGKILL included), and then the server's process group is killed.
_WATCHDOG = """
import os, signal, sys
sys.stdin.buffer.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except OSError:
    pass
"""


class VLLMServer:
    """A vLLM server for `model_dir` on 127.0.0.1:`port` for the lifetime of a `with` block.

    `watchdog`: a tiny helper process kills the server's process group as soon as this process ends, even
    by SIGKILL (when `stop()` and the atexit hook never run).
    """

    def __init__(
        self,
        model_dir: str | Path,
        port: int | None = None,
        log_path: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
        install_timeout_s: float = 1200.0,
        watchdog: bool = True,
    ):
        self.model_dir = Path(model_dir).resolve()
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model folder not found: {self.model_dir}")
        self.host = host
        self.port = int(port) if port else free_port(host)
        self.log_path = Path(log_path or f"/tmp/cppo_vllm_{self.port}.log").resolve()
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.install_timeout_s = install_timeout_s
        self.watchdog = watchdog
        self._watchdog: subprocess.Popen | None = None
        self._watchdog_pipe: int | None = None
        self.proc: subprocess.Popen | None = None
        self.install_s = 0.0
        self.start_s = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self) -> VLLMServer:
        if self.proc is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        self.install_s = install(self.install_timeout_s, self.log_path)
        env = {**os.environ, "VLLM_HOST": self.host, **self.env}
        cmd = [
            "bash",
            str(LAUNCH_SCRIPT),
            "--foreground",
            str(self.model_dir),
            str(self.port),
            *self.extra_args,
        ]
        t0 = time.monotonic()
        log = open(self.log_path, "a")
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: stop() kills all of it
            )
        finally:
            log.close()
        _LIVE.add(self)
        if self.watchdog:
            self._start_watchdog()
        try:
            self._wait(t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def _wait(self, t0: float) -> None:
        while not self.healthy():
            code = self.proc.poll()
            if code is not None:
                raise VLLMServerError(
                    f"the vLLM server for {self.model_dir} exited with code {code} before "
                    f"{self.url}/health answered; last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            if time.monotonic() - t0 > self.startup_timeout_s:
                raise VLLMServerError(
                    f"{self.url}/health did not answer within {self.startup_timeout_s:g} s; last "
                    f"lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def _start_watchdog(self) -> None:
        read_fd, write_fd = os.pipe()  # both non-inheritable: the server never holds the write end
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(self.proc.pid)],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read_fd)
        self._watchdog_pipe = write_fd

    def _stop_watchdog(self) -> None:
        if self._watchdog_pipe is not None:
            os.close(
                self._watchdog_pipe
            )  # EOF: the watchdog kills the (already dead) group and exits
            self._watchdog_pipe = None
        if self._watchdog is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=5)
            self._watchdog = None

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for fault tests)."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; idempotent."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        # Children (the engine core) may outlive the leader: always finish the group off.
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.proc = None
        self._stop_watchdog()
        _LIVE.discard(self)

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __hash__(self) -> int:
        return id(self)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)
