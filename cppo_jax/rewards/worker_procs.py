"""The pool's side of its reward worker processes (`RewardPool`, `cppo_jax.rewards.pool`): starting one
(a fresh interpreter over a socket pair, `worker.BOOT`), killing one, and stopping them all. What a worker
runs is `cppo_jax.rewards.worker`. Host code: imports no JAX.
"""

from __future__ import annotations

import contextlib
import math
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from cppo_jax.rewards.worker import BOOT, child_env


@dataclass
class Worker:
    """The pool's handle on one worker process and the tasks it holds."""

    proc: subprocess.Popen
    conn: Connection
    start_deadline: float
    ready: bool = False
    inflight: deque = field(default_factory=deque)  # task ids handed over and not yet answered
    deadline: float = math.inf  # when the oldest unanswered task times out


def start_worker(refs: list[str], memory_limit_bytes: int, startup_timeout_s: float) -> Worker:
    """A fresh interpreter running `worker.BOOT` over one end of a socket pair, sent the reward
    references `refs` to load; it must report ready before `startup_timeout_s` (`Worker.start_deadline`)."""
    if not sys.executable:
        raise RuntimeError("RewardPool needs sys.executable to start worker interpreters")
    parent_sock, child_sock = socket.socketpair()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                BOOT,
                str(child_sock.fileno()),
                str(memory_limit_bytes),
            ],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            env=child_env(),
        )
    finally:
        child_sock.close()
    conn = Connection(parent_sock.detach())
    conn.send(("init", list(refs)))
    return Worker(proc, conn, start_deadline=time.monotonic() + startup_timeout_s)


def kill(w: Worker) -> None:
    """Kill `w`'s process (SIGKILL), reap it and close its connection."""
    w.proc.kill()
    w.proc.wait()
    w.conn.close()


def shutdown(workers: list[Worker]) -> None:
    """Ask every worker to stop, wait up to 2 s each (then kill), close the connections, empty `workers`."""
    for w in workers:
        with contextlib.suppress(OSError, ValueError):
            w.conn.send(("stop",))
    for w in workers:
        try:
            w.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.conn.close()
    workers.clear()
