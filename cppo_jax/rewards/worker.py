"""The worker side of `RewardPool`: the interpreter a worker runs and the one guarded reward call.

A worker is started as `python -c BOOT <fd> <memory limit>`: it sets RLIMIT_AS before importing anything
else, then `serve(fd)` loads the reward functions named by the pool, warms them up, reports ready and
answers `("run", tasks)` messages, one answer per call, until EOF or `("stop",)`. `call` turns whatever a
reward function does (a number, None, a non-finite value, an exception) into `(status, value)`; the pool
uses it too when `num_workers=0`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

from cppo_jax.rewards import registry

__all__ = ["BOOT", "call", "child_env", "serve"]

_WARMUP = ("<think>1+1=2</think>\n<answer>$\\boxed{2}$</answer>", "so 1+1 = \\boxed{2}. #### 2")

# Run by each worker: set the memory limit before anything else is imported, then serve.
BOOT = """
import resource, sys
limit = int(sys.argv[2])
if limit > 0:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError) as e:
        print(f"reward worker: cannot set RLIMIT_AS to {limit} bytes: {e}", file=sys.stderr)
from cppo_jax.rewards.worker import serve
serve(int(sys.argv[1]))
"""


def child_env() -> dict[str, str]:
    """The worker's environment: this interpreter's import path, one BLAS/OpenMP thread."""
    env = dict(os.environ)
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    return env


def call(fn: Callable, completion: str, solution: str, context=None) -> tuple[str, object]:
    """Call one `registry.item_fn`; ("ok", float), ("abstain", None) or ("error", reason)."""
    try:
        value = fn(completion, solution, context)
        if value is None:
            return "abstain", None
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            return "error", f"returned {type(value).__name__}, not a number"
        value = float(value)
        if not math.isfinite(value):
            return "error", f"returned {value}"
        return "ok", value
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # also math-verify's TimeoutException, a BaseException
        return "error", f"{type(e).__name__}: {str(e)[:200]}"


def serve(fd: int) -> None:
    """Entry point of a worker interpreter (see BOOT): load the functions, then answer tasks until EOF."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)  # they log whole inputs on timeouts
    conn = Connection(fd)
    _, refs = conn.recv()
    try:
        fns = [registry.item_fn(registry.resolve_ref(ref)) for ref in refs]
    except BaseException as e:
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    for fn in fns:
        call(fn, *_WARMUP)
    registry.drain_notes()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "run":
            return
        for task, j, completion, solution, context in msg[1]:
            status, value = call(fns[j], completion, solution, context)
            conn.send((task, status, value, registry.drain_notes()))
