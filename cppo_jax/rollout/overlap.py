"""`rollout.overlap = 1`: later steps' rollouts are produced while the current step trains.

`rollout.max_staleness = k` (1 by default) bounds how far ahead: at the start of step n, `take` hands
over step n's rollout (requested earlier; made on the spot for the first step of a run) and asks one
background thread for steps n + 1 ... n + k not asked for yet.

k = 1: step n + 1's rollout is sampled from a snapshot of the params at that moment (step n's: the
update donates the live ones). So step n + 1 trains on completions one update stale, and its
old-policy log-probs are those of the snapshot (`take` returns it), which keeps the PPO ratio exact.
A server that received new weights during a generation would mix two policies into one batch, so
before any push the trainer calls `wait` (the generation in flight ends first); `Trainer.step` waits
again in a `finally`, so that no step returns, early or by an error, with a generation running.

k >= 2 (as verl's and AReaL's asynchronous trainers): up to k generations run at once, each on its
own thread, sampling from the weights the backend serves (a server batches their requests, so the
next step's fill the places of the current one's finished completions instead of leaving the engine
to its longest ones), and pushes land while they run, so a rollout may continue across a weight
update (a partial rollout). No snapshot sampled it, so the loss corrects it with TIS against the sampler's
own per-token log-probs (`logp_sources`). Each rollout records the policy version the backend
served when its generation began (`served()`: the update count of the last confirmed push, read
before the first request, so never newer than any token's); the trainer drops a rollout older than
k updates and samples the step's questions again from the current weights (nothing is lost: a
step always trains its own questions). The queue is not checkpointed: a stop discards it, and a
resumed run asks again from its first step (nothing is trained twice).

`close` stops the producer before the backend's client is closed: nothing new starts, queued work
is cancelled, and the generation in flight is given `close_wait_s` to end (a server that never
answers is left to the client's read timeout, and `close` says so).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from cppo_jax.models.transformer import forward_copy


class Taken(NamedTuple):
    """A step's rollout, what sampled it and when."""

    rollout: Any
    sampled_by: Any  # k = 1: the snapshot that sampled it; None: the current params or the server's
    version: int | None  # updates in the weights served as its generation began (None: unknown)


@dataclasses.dataclass
class _Pending:
    step: int
    future: concurrent.futures.Future  # (rollout, version)
    params: Any  # k = 1: the snapshot sampling it; else None (the backend's own weights)


class Overlap:
    """The producer of later steps' rollouts: `make(params, step)` run on background threads (one
    per step ahead), for k = 1 from a snapshot of the params in `snapshot_dtype` (the compute dtype: it only runs
    forwards), for k >= 2 with `params` None (the weights the backend serves); `served()` gives
    the policy version the backend serves (None: not known)."""

    def __init__(
        self,
        make: Callable[[Any, int], Any],
        num_steps: int,
        snapshot_dtype: Any,
        close_wait_s: float = 10.0,
        ahead: int = 1,
        served: Callable[[], int | None] = lambda: None,
    ):
        if ahead < 1:
            raise ValueError(f"ahead = {ahead}: the overlap runs at least one step ahead")
        self.make = make
        self.num_steps = num_steps
        self.snapshot_dtype = snapshot_dtype
        self.close_wait_s = close_wait_s
        self.ahead = ahead
        self.served = served
        self._pending: dict[int, _Pending] = {}  # by step, in the order asked
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def started(self) -> bool:
        """Whether the producer thread was ever started."""
        return self._executor is not None

    @property
    def queued(self) -> list[int]:
        """The steps whose rollouts are asked for and not taken yet, in order."""
        return list(self._pending)

    def take(self, params, step: int) -> Taken:
        """`step`'s rollout, the params that sampled it (None: `params`, sampled now, or with k >= 2
        the backend's weights) and the version served as it began; then ask for the steps up to
        step + k. A failed background generation raises here."""
        if self._closed:
            raise RuntimeError("the rollout producer is closed")
        pending = self._pending.pop(step, None)
        if pending is not None:
            rollout, version = pending.future.result()
            taken = Taken(rollout, pending.params, version)
        else:  # the first step of a run (or of a resumed one): nothing was asked for yet
            version = self.served()
            taken = Taken(self.make(params, step), None, version)
        for s in range(step + 1, min(step + self.ahead, self.num_steps - 1) + 1):
            if s in self._pending:
                continue
            # k = 1: a snapshot, as the update donates `params`; else the backend's weights
            snapshot = forward_copy(params, self.snapshot_dtype) if self.ahead == 1 else None
            future = self._producer().submit(self._produce, snapshot, s)
            self._pending[s] = _Pending(s, future, snapshot)
        return taken

    def _produce(self, params, step: int):
        version = self.served()  # before the first request: never newer than any token's policy
        return self.make(params, step), version

    def wait(self) -> float:
        """Block until no generation is in flight or queued; the seconds waited. A failed one raises
        its error."""
        t = time.perf_counter()
        for pending in list(self._pending.values()):
            pending.future.result()
        return time.perf_counter() - t if self._pending else 0.0

    def settle(self) -> float:
        """`wait` that never raises (for a `finally`: an error surfaces when its rollout is taken)."""
        if not self._pending:
            return 0.0
        t = time.perf_counter()
        concurrent.futures.wait([p.future for p in self._pending.values()])
        return time.perf_counter() - t

    def close(self) -> bool:
        """Stop the producer: nothing new starts, queued generations are cancelled, and those in
        flight get `close_wait_s` seconds to end. True when the threads have stopped; False when a
        generation still runs (it ends at the client's read timeout, its result unused)."""
        self._closed = True
        pending, self._pending = list(self._pending.values()), {}
        if self._executor is None:
            return True
        self._executor.shutdown(wait=False, cancel_futures=True)
        if pending:
            futures = [p.future for p in pending]
            concurrent.futures.wait(futures, timeout=self.close_wait_s)
            if not all(f.done() for f in futures):
                return False
        self._executor.shutdown(wait=True)  # the thread ends once its last item is done
        return True

    def _producer(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self.ahead, "cppo-rollout")
        return self._executor
