"""Score completions in worker processes, each call bounded in time and memory.

math-verify bounds its own work with SIGALRM, which only works in a main thread and cannot interrupt C code
(a huge integer power, a pathological regex). `RewardPool` therefore runs every reward call in a worker
process and enforces the bound from outside:

1. Workers are fresh interpreters (`subprocess` + exec: nothing is forked from a parent that may hold JAX
   threads, and unlike multiprocessing's spawn the parent's `__main__` is not re-imported, so a training
   script's imports stay out of the workers). Each sets RLIMIT_AS (`memory_limit_bytes`), imports the reward
   functions by qualified name, warms them up and reports ready (`cppo_jax.rewards.worker`; the pool
   starts, kills and stops them with `cppo_jax.rewards.worker_procs`).
2. `score` cuts the batch into chunks of up to `chunk_size` items and hands them to idle workers. A worker runs the calls
   of its chunk in order and answers after each one.
3. Each call has `timeout_s` seconds, counted from the previous answer (or the hand-over). A call that
   overruns scores 0.0 and is counted in `timeouts`; its worker is killed (SIGKILL) and replaced, and the
   rest of its chunk goes back to the queue. A call that raises, returns a non-finite or non-numeric value,
   or takes its worker down scores 0.0 and is counted in `errors`.

So `score` always returns, after at most about `timeout_s` per hostile call plus worker restarts.

    with RewardPool([("accuracy", 1.0, "gsm8k_accuracy"), ("format", 1.0, "gsm8k_format")]) as pool:
        total_N, per_func, stats = pool.score(completions, solutions)

`funcs` entries are `(name, weight, fn)` with `fn` a registered name (`cppo_jax.rewards.registry`), a
qualified name `"pkg.module:function"` or a module-level function; `(name, weight)` and a bare `name` use the
registered function of that name (weight 1.0). `per_func` holds the unweighted scores (NaN where a TRL-style
function abstained with None); `total` their weighted sum, abstentions left out. `num_workers=0` calls the functions in this process, without any time bound (for debugging).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait

import numpy as np

from cppo_jax.rewards import registry
from cppo_jax.rewards.worker import call
from cppo_jax.rewards.worker_procs import Worker, kill, shutdown, start_worker

__all__ = ["RewardPool"]

logger = logging.getLogger(__name__)


@dataclass
class _Spec:
    name: str
    weight: float
    ref: str


def _parse_spec(entry) -> _Spec:
    if isinstance(entry, str):
        entry = (entry, 1.0)
    if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
        raise ValueError(f"a reward is name, (name, weight) or (name, weight, fn); got {entry!r}")
    name, weight = entry[0], entry[1]
    fn = entry[2] if len(entry) == 3 else name
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    try:
        weight = float(weight)
    except (TypeError, ValueError):
        raise ValueError(f"weight of reward {name!r} must be a number, got {weight!r}") from None
    if not math.isfinite(weight):
        raise ValueError(f"weight of reward {name!r} must be finite, got {weight!r}")
    return _Spec(name, weight, registry.reference(fn))


class RewardPool:
    """Worker processes that score (completion, solution) pairs with several reward functions."""

    def __init__(
        self,
        funcs: Sequence,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        memory_limit_bytes: int | None = 2 << 30,
        chunk_size: int = 8,
        startup_timeout_s: float = 120.0,
    ):
        self.specs = [_parse_spec(f) for f in funcs]
        if not self.specs:
            raise ValueError("RewardPool needs at least one reward function")
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique, got {names}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_limit_bytes = memory_limit_bytes or 0
        self.chunk_size = chunk_size
        self.startup_timeout_s = float(startup_timeout_s)
        self.totals = {"timeouts": 0, "errors": 0, "restarts": 0, "items": 0}
        self._workers: list[Worker] = []
        self._inline: list[Callable] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, shutdown, self._workers)
        if num_workers == 0:
            self._inline = [registry.item_fn(registry.resolve_ref(s.ref)) for s in self.specs]
            return
        try:
            for _ in range(num_workers):
                self._workers.append(self._start_worker())
            while not all(w.ready for w in self._workers):
                self._wait_startup()
        except BaseException:
            self.close()
            raise

    # ----- worker management -----

    def _start_worker(self) -> Worker:
        refs = [spec.ref for spec in self.specs]
        return start_worker(refs, self.memory_limit_bytes, self.startup_timeout_s)

    def _replace(self, w: Worker) -> None:
        kill(w)
        self._workers[self._workers.index(w)] = self._start_worker()
        self.totals["restarts"] += 1

    def _on_startup_message(self, w: Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            code = w.proc.wait()
            raise RuntimeError(
                f"a reward worker exited during start-up (exit code {code}; its stderr is above; "
                f"memory_limit_bytes={self.memory_limit_bytes})"
            ) from None
        if msg[0] == "init_error":
            raise ValueError(f"a reward worker cannot load the reward functions: {msg[1]}")
        w.ready = True

    def _wait_startup(self) -> None:
        starting = [w for w in self._workers if not w.ready]
        timeout = max(0.0, min(w.start_deadline for w in starting) - time.monotonic())
        for conn in wait([w.conn for w in starting], timeout=timeout):
            self._on_startup_message(next(w for w in starting if w.conn is conn))
        now = time.monotonic()
        for w in starting:
            if not w.ready and now >= w.start_deadline:
                raise RuntimeError(
                    f"a reward worker did not start within {self.startup_timeout_s} s"
                )

    # ----- scoring -----

    def score(
        self,
        completions: Sequence[str],
        solutions: Sequence[str],
        only: Sequence[str] | None = None,
        contexts: Sequence[dict] | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict]:
        """Score each completion against its solution with every reward function (or those named in `only`).

        `contexts` (one dict per completion: `prompt`, `completion_ids`, the example's columns) is what
        TRL-style functions receive as keywords besides the completion (`registry.item_fn`).

        Returns `(total_N, per_func, stats)`: the weighted sum (float64 [N]) of the functions run, the
        unweighted scores of each function run by name, and `stats` with `timeouts`, `errors`, `restarts` (this call), per-function
        `timeouts_per_func` and `errors_per_func`, `notes` (events the functions reported, e.g.
        `math_gold_unparsed`) and `wall_s`.
        """
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if len(completions) != len(solutions):
            raise ValueError(
                f"completions and solutions differ in length: {len(completions)} vs {len(solutions)}"
            )
        if contexts is not None and len(contexts) != len(completions):
            raise ValueError(
                f"contexts and completions differ in length: {len(contexts)} vs {len(completions)}"
            )
        for what, seq in (("completions", completions), ("solutions", solutions)):
            for i, s in enumerate(seq):
                if not isinstance(s, str):
                    raise ValueError(f"{what}[{i}] is {type(s).__name__}, not str")
        names = [s.name for s in self.specs]
        unknown = sorted(set(only or ()) - set(names))
        if unknown:
            raise ValueError(f"unknown reward name(s) {unknown} in `only`; this pool has {names}")
        js = [j for j, name in enumerate(names) if only is None or name in only]
        t0 = time.monotonic()
        n, f = len(completions), len(self.specs)
        scores_FN = np.zeros((f, n), dtype=np.float64)
        run = _Run(f)
        ctx = contexts if contexts is not None else [None] * n
        if self._inline:
            self._score_inline(completions, solutions, ctx, scores_FN, run, js)
        elif n:
            self._score_workers(completions, solutions, ctx, scores_FN, run, js)
        weights_F = np.array([self.specs[j].weight for j in js], dtype=np.float64)
        total_N = np.nansum(weights_F[:, None] * scores_FN[js], axis=0)
        per_func = {names[j]: scores_FN[j].copy() for j in js}
        stats = {
            "timeouts": sum(run.timeouts),
            "errors": sum(run.errors),
            "restarts": run.restarts,
            "timeouts_per_func": {names[j]: run.timeouts[j] for j in js},
            "errors_per_func": {names[j]: run.errors[j] for j in js},
            "notes": dict(run.notes),
            "wall_s": time.monotonic() - t0,
        }
        self.totals["timeouts"] += stats["timeouts"]
        self.totals["errors"] += stats["errors"]
        self.totals["items"] += n
        return total_N, per_func, stats

    def _score_inline(self, completions, solutions, ctx, scores_FN, run: _Run, js) -> None:
        f = len(self.specs)
        for i, (c, s) in enumerate(zip(completions, solutions)):
            for j in js:
                status, value = call(self._inline[j], c, s, ctx[i])
                run.record(i * f + j, status, value, registry.drain_notes(), scores_FN)

    def _score_workers(self, completions, solutions, ctx, scores_FN, run: _Run, js) -> None:
        n, f = len(completions), len(self.specs)
        # Chunks of at most chunk_size items, small enough that every worker gets several.
        per_chunk = max(1, min(self.chunk_size, -(-n // (4 * len(self._workers)))))
        queue: deque[list[int]] = deque()
        for start in range(0, n, per_chunk):
            items = range(start, min(n, start + per_chunk))
            queue.append([i * f + j for i in items for j in js])
        remaining = n * len(js)
        restarts0 = self.totals["restarts"]
        while remaining:
            # Hand chunks to idle workers.
            for w in self._workers:
                if w.ready and not w.inflight and queue:
                    chunk = queue.popleft()
                    tasks = [
                        (t, t % f, completions[t // f], solutions[t // f], ctx[t // f])
                        for t in chunk
                    ]
                    try:
                        w.conn.send(("run", tasks))
                    except (OSError, ValueError):
                        queue.appendleft(chunk)
                        self._replace(w)
                        continue
                    w.inflight.extend(chunk)
                    w.deadline = time.monotonic() + self.timeout_s
            # Wait for answers, start-ups, or the next deadline.
            watched = [w for w in self._workers if w.inflight or not w.ready]
            if not watched:
                raise RuntimeError("RewardPool lost track of its tasks")  # cannot happen
            now = time.monotonic()
            next_deadline = min(w.deadline if w.ready else w.start_deadline for w in watched)
            for conn in wait([w.conn for w in watched], timeout=max(0.0, next_deadline - now)):
                w = next(w for w in self._workers if w.conn is conn)
                if not w.ready:
                    self._on_startup_message(w)
                    continue
                remaining -= self._drain_answers(w, scores_FN, run, queue)
            # Kill workers whose oldest call overran.
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.inflight and now >= w.deadline:
                    task = w.inflight.popleft()
                    run.record(task, "timeout", None, {}, scores_FN)
                    remaining -= 1
                    logger.warning(
                        "reward %r timed out after %.1f s on item %d; restarting its worker",
                        self.specs[task % f].name,
                        self.timeout_s,
                        task // f,
                    )
                    if w.inflight:
                        queue.appendleft(list(w.inflight))
                    self._replace(w)
                elif not w.ready and now >= w.start_deadline:
                    raise RuntimeError(
                        f"a reward worker did not start within {self.startup_timeout_s} s"
                    )
        run.restarts = self.totals["restarts"] - restarts0

    def _drain_answers(self, w: Worker, scores_FN, run: _Run, queue: deque) -> int:
        """Record every answer waiting on `w`'s connection; return how many tasks finished."""
        done = 0
        try:
            while w.inflight and w.conn.poll():
                task, status, value, notes = w.conn.recv()
                expected = w.inflight.popleft()
                if task != expected:
                    raise RuntimeError(f"reward worker answered task {task}, expected {expected}")
                run.record(task, status, value, notes, scores_FN)
                done += 1
                w.deadline = time.monotonic() + self.timeout_s
        except (EOFError, OSError):
            # The worker died (a crash, or the kernel enforcing a limit): blame its current call.
            task = w.inflight.popleft()
            run.record(task, "error", f"worker exited with code {w.proc.wait()}", {}, scores_FN)
            done += 1
            if w.inflight:
                queue.appendleft(list(w.inflight))
            self._replace(w)
        return done

    # ----- lifetime -----

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        funcs = ", ".join(f"{s.name}={s.weight:g}*{s.ref}" for s in self.specs)
        return f"RewardPool({funcs}; workers={self.num_workers}, timeout_s={self.timeout_s})"


class _Run:
    """Counters of one `score` call."""

    def __init__(self, num_funcs: int):
        self.num_funcs = num_funcs
        self.timeouts = [0] * num_funcs
        self.errors = [0] * num_funcs
        self.restarts = 0
        self.notes: dict[str, int] = {}

    def record(self, task: int, status: str, value, notes: dict[str, int], scores_FN) -> None:
        i, j = divmod(task, self.num_funcs)
        for k, v in notes.items():
            self.notes[k] = self.notes.get(k, 0) + v
        if status == "ok":
            scores_FN[j, i] = value
            return
        if status == "abstain":  # a TRL-style None: no score, not an error
            scores_FN[j, i] = np.nan
            return
        scores_FN[j, i] = 0.0
        if status == "timeout":
            self.timeouts[j] += 1
        else:
            self.errors[j] += 1
            logger.debug("reward call failed on item %d: %s", i, value)
