"""A clean stop on SIGTERM or SIGINT: finish the current step, checkpoint, exit with 128 + the signal.

`StopSignals` is a context manager for the training loop. Inside it the first SIGTERM or SIGINT only
records the signal (`requested`); the loop checks it between steps, saves a checkpoint of the last finished
step and raises `SignalStopError`. `launch.main` turns that into exit code 128 + signal number (143 for SIGTERM,
130 for SIGINT), the shell's convention for "ended by this signal". So the time from the signal to the exit
is bounded by the rest of the current step plus one checkpoint write (and closing the reward workers).

A second signal of either kind does not wait: the default action is restored and the signal re-raised, so
the process ends at once, exactly as if killed. Nothing is lost beyond the work since the last checkpoint,
which is complete (checkpoints are written atomically, see `cppo_jax.train.checkpoint`).

Handlers can only be installed from the main thread; elsewhere (a notebook worker thread, a test runner
thread) the context manager does nothing and `requested` stays None. Host code: imports no JAX.
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalStopError(Exception):
    """The run stopped on a signal after saving a checkpoint; `exit_code` is 128 + the signal."""

    def __init__(self, signum: int, step: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.step = step
        self.exit_code = 128 + signum


class StopSignals:
    def __init__(self, signals: tuple[int, ...] = SIGNALS):
        self.signals = signals
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.requested).name if self.requested else ""

    def _handle(self, signum, _frame) -> None:
        if self.requested is not None:  # the second signal: end now, as if killed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()
