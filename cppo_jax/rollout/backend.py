"""Rollout backends: where completions come from.

A backend turns Q left-padded prompts into G completions each (`sampler.Samples`, token ids and the
sampled tokens' log-probs). The embedded backend samples with the policy's own params on the training
devices; the vLLM backend (its own module) asks an external server and receives weights after updates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import jax
import numpy as np

from cppo_jax.config.schema import RolloutConfig
from cppo_jax.parallel import distributed
from cppo_jax.rollout.embedded.sampler import make_sampler, place, sampler_shardings
from cppo_jax.rollout.embedded.sampling import Samples, SamplingParams
from cppo_jax.rollout.multiprocess import MainProcessBackend
from cppo_jax.rollout.vllm.backend import VLLMBackend


class RolloutBackend(Protocol):
    def generate(
        self, params, prompt_QP, prompt_valid_QP, seeds_Q, num_samples: int
    ) -> Samples: ...

    def greedy(
        self, params, prompt_QP, prompt_valid_QP, max_new_tokens: int | None = None
    ) -> Samples:
        """One greedy completion per prompt (evaluation)."""
        ...

    def sync_weights(self, params, step: int) -> dict:
        """Make the backend sample from `params` from now on; returns timings/metrics."""
        ...

    def wait_ready(self) -> None:
        """Return once the backend can sample (a server still starting is waited for)."""
        ...

    def close(self) -> None: ...


class EmbeddedBackend:
    """Samples with the policy's current params in this process (no weight copy needed). On a `mesh`
    the sampler's shardings are declared (`sampler.sampler_shardings`): the params where they lie,
    prompts and samples split by rows."""

    def __init__(self, graphdef, sp: SamplingParams, mesh=None):
        self.graphdef = graphdef
        self.sp = sp
        self.mesh = mesh

    def generate(self, params, prompt_QP, prompt_valid_QP, seeds_Q, num_samples: int) -> Samples:
        return self._sample(self.sp, num_samples, params, prompt_QP, prompt_valid_QP, seeds_Q)

    def _sample(self, sp: SamplingParams, num_samples: int, *args) -> Samples:
        if self.mesh is None:
            return make_sampler(self.graphdef, num_samples, sp)(*args)
        Q, P = args[1].shape
        shardings = sampler_shardings(self.mesh, args[0], Q, P, num_samples, sp)
        return make_sampler(self.graphdef, num_samples, sp, shardings)(*place(args, shardings))

    def greedy(self, params, prompt_QP, prompt_valid_QP, max_new_tokens: int | None = None):
        sp = SamplingParams(
            max_new_tokens=max_new_tokens or self.sp.max_new_tokens,
            temperature=0.0,
            eos_id=self.sp.eos_id,
            pad_id=self.sp.pad_id,
            cache_dtype=self.sp.cache_dtype,
            compact=self.sp.compact,
        )
        seeds_Q = distributed.rows(np.zeros((prompt_QP.shape[0],), np.uint32), self.mesh)
        return self._sample(sp, 1, params, prompt_QP, prompt_valid_QP, seeds_Q)

    def sync_weights(self, params, step: int) -> dict:
        return {}

    def wait_ready(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_backend(
    cfg: RolloutConfig, graphdef, sp: SamplingParams, run_dir: Path, mesh=None
) -> RolloutBackend:
    """The configured backend: embedded (default) or an external vLLM server.

    With several processes only process 0 talks to the server (`multiprocess.MainProcessBackend`
    shares its completions with the others, laid out on `mesh`).
    """
    if cfg.backend == "embedded":
        return EmbeddedBackend(graphdef, sp, mesh)
    if jax.process_count() == 1:
        return VLLMBackend(cfg, graphdef, sp, run_dir)
    inner = VLLMBackend(cfg, graphdef, sp, run_dir) if distributed.is_main() else None
    return MainProcessBackend(inner, sp, mesh)
