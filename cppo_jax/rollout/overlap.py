"""`rollout.overlap = 1`: step n+1's rollout is produced while step n trains.

At the start of step n, `take` hands over step n's rollout (requested during step n - 1; made on the spot
for the first step of a run) and asks one background thread for step n + 1's, sampled from a snapshot of
the params at that moment (step n's: the update donates the live ones). So step n + 1 trains on
completions one update stale, and its old-policy log-probs are those of the snapshot (`take` returns
it), which keeps the PPO ratio exact.

A server that received new weights during a generation would mix two policies into one batch, so before
any push the trainer calls `wait` (the generation in flight ends first); `Trainer.step` waits again in a
`finally`, so that no step returns, early or by an error, with a generation running. `close` stops the
producer before the backend's client is closed: nothing new starts, queued work is cancelled, and the
generation in flight is given `close_wait_s` to end (a server that never answers is left to the client's
read timeout, and `close` says so).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from cppo_jax.models.transformer import forward_copy


@dataclasses.dataclass
class _Pending:
    step: int
    future: concurrent.futures.Future
    params: Any  # the snapshot sampling it


class Overlap:
    """The producer of the next step's rollout: `make(params, step)` run on one background thread,
    from a snapshot of the params in `snapshot_dtype` (the compute dtype: it only runs forwards)."""

    def __init__(
        self,
        make: Callable[[Any, int], Any],
        num_steps: int,
        snapshot_dtype: Any,
        close_wait_s: float = 10.0,
    ):
        self.make = make
        self.num_steps = num_steps
        self.snapshot_dtype = snapshot_dtype
        self.close_wait_s = close_wait_s
        self._pending: _Pending | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def started(self) -> bool:
        """Whether the producer thread was ever started."""
        return self._executor is not None

    def take(self, params, step: int) -> tuple[Any, Any]:
        """`step`'s rollout and the params that sampled it (None: `params`, sampled now); then request
        step + 1's from a snapshot of `params`. A failed background generation raises here."""
        if self._closed:
            raise RuntimeError("the rollout producer is closed")
        pending, self._pending = self._pending, None
        if pending is not None and pending.step == step:
            rollout, sampled_by = pending.future.result(), pending.params
        else:  # the first step of a run (or of a resumed one): nothing was requested yet
            rollout, sampled_by = self.make(params, step), None
        if step + 1 < self.num_steps:
            snapshot = forward_copy(params, self.snapshot_dtype)  # the update donates `params`
            future = self._producer().submit(self.make, snapshot, step + 1)
            self._pending = _Pending(step + 1, future, snapshot)
        return rollout, sampled_by

    def wait(self) -> float:
        """Block until no generation is in flight; the seconds waited. A failed one raises its error."""
        if self._pending is None:
            return 0.0
        t = time.perf_counter()
        self._pending.future.result()
        return time.perf_counter() - t

    def settle(self) -> float:
        """`wait` that never raises (for a `finally`: an error surfaces when its rollout is taken)."""
        if self._pending is None:
            return 0.0
        t = time.perf_counter()
        concurrent.futures.wait([self._pending.future])
        return time.perf_counter() - t

    def close(self) -> bool:
        """Stop the producer: nothing new starts, and the generation in flight gets `close_wait_s`
        seconds to end. True when the thread has stopped; False when a generation still runs (it ends
        at the client's read timeout, its result unused)."""
        self._closed = True
        pending, self._pending = self._pending, None
        if self._executor is None:
            return True
        self._executor.shutdown(wait=False, cancel_futures=True)
        if pending is not None:
            concurrent.futures.wait([pending.future], timeout=self.close_wait_s)
            if not pending.future.done():
                return False
        self._executor.shutdown(wait=True)  # the thread ends once its last item is done
        return True

    def _producer(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, "cppo-rollout")
        return self._executor
