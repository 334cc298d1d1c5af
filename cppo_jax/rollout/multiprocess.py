"""Several trainer processes, one rollout server: only process 0 talks to it, every process gets the result.

`make_backend` wraps the vLLM backend in `MainProcessBackend` when `jax.process_count() > 1` (see
`cppo_jax.parallel.distributed` for how the processes are connected).
"""

from __future__ import annotations

import weakref

import jax
import numpy as np
from jax.experimental import multihost_utils

from cppo_jax.parallel import distributed
from cppo_jax.rollout.embedded.sampling import Samples
from cppo_jax.rollout.vllm.client import RolloutServerError


class MainProcessBackend:
    """A rollout backend (the vLLM one) used by process 0 alone, its results shared with every process.

    Every process calls every method (they are collectives): the prompts and params are gathered to the
    host, process 0 asks `inner` (None on the other processes), and the completions are broadcast and
    laid out on `mesh` as global arrays. A failure on process 0 is broadcast too, so every process
    raises `RolloutServerError` instead of waiting for a collective that never comes.
    """

    def __init__(self, inner, sp, mesh):
        self.inner = inner if distributed.is_main() else None
        self.sp = sp
        self.mesh = mesh
        self._host_params = None  # the host copy of the params last pushed, and whose they were
        self._synced_of = None

    def _host(self, params):
        if self._synced_of is not None and self._synced_of() is params:
            return self._host_params
        host = distributed.to_main(params)  # the whole model on process 0 alone
        try:
            ref = weakref.ref(params)
        except TypeError:
            ref = None
        self._host_params, self._synced_of = host, ref
        return host

    def _on_main(self, fn, template=None):
        """`fn()` on process 0; with a `template` (its result's shapes) the result goes to every
        process, without one only process 0 gets it (None elsewhere)."""
        result, error = template, None
        if self.inner is not None:
            try:
                result = fn()
            except Exception as e:  # re-raised below, once the others were told
                error = e
        flag = np.asarray([0 if error is None else 1], np.int32)
        shared = None if template is None else jax.tree.map(np.asarray, result)
        if error is not None:
            shared = template
        shared, failed = multihost_utils.broadcast_one_to_all(
            (shared, flag), is_source=distributed.is_main()
        )
        if error is not None:
            raise error
        if int(failed[0]):
            raise RolloutServerError(
                "the rollout server failed on process 0 (its log has the cause); stopping here too"
            )
        return result if template is None else shared

    def _samples(self, fn, n_rows: int, columns: int):
        template = Samples(
            np.zeros((n_rows, columns), np.int32),
            np.zeros((n_rows, columns), np.float32),
            np.zeros((n_rows, columns), bool),
            np.zeros((n_rows,), bool),
            np.zeros((), np.int32),
        )
        host = self._on_main(lambda: Samples(*(np.asarray(x) for x in fn()[:5])), template)
        return Samples(*(distributed.rows(x, self.mesh) for x in host[:4]), host[4])

    def generate(self, params, prompt_QP, prompt_valid_QP, seeds_Q, num_samples: int):
        prompts, valid, seeds = distributed.to_host((prompt_QP, prompt_valid_QP, seeds_Q))
        host = self._host(params)
        return self._samples(
            lambda: self.inner.generate(host, prompts, valid, seeds, num_samples),
            prompts.shape[0] * num_samples,
            self.sp.max_new_tokens,
        )

    def greedy(self, params, prompt_QP, prompt_valid_QP, max_new_tokens: int | None = None):
        prompts, valid = distributed.to_host((prompt_QP, prompt_valid_QP))
        host = self._host(params)
        return self._samples(
            lambda: self.inner.greedy(host, prompts, valid, max_new_tokens),
            prompts.shape[0],
            max_new_tokens or self.sp.max_new_tokens,
        )

    def sync_weights(self, params, step: int) -> dict:
        self._synced_of = None
        host = self._host(params)  # every process joins the gather
        metrics = self._on_main(lambda: self.inner.sync_weights(host, step))
        return metrics or {}

    def wait_ready(self) -> None:
        self._on_main(lambda: self.inner.wait_ready())  # a failure on process 0 reaches every one

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
