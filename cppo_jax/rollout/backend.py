"""Rollout backends: where completions come from.

A backend turns Q left-padded prompts into G completions each (`sampler.Samples`, token ids and the
sampled tokens' log-probs). The embedded backend samples with the policy's own params on the training
devices; the vLLM backend (its own module) asks an external server and receives weights after updates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import jax

from cppo_jax import distributed
from cppo_jax.config import RolloutConfig
from cppo_jax.rollout.multiprocess import MainProcessBackend
from cppo_jax.rollout.sampler import make_sampler
from cppo_jax.rollout.sampling import Samples, SamplingParams
from cppo_jax.rollout.vllm_backend import VLLMBackend


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

    def close(self) -> None: ...


class EmbeddedBackend:
    """Samples with the policy's current params in this process (no weight copy needed)."""

    def __init__(self, graphdef, sp: SamplingParams):
        self.graphdef = graphdef
        self.sp = sp

    def generate(self, params, prompt_QP, prompt_valid_QP, seeds_Q, num_samples: int) -> Samples:
        fn = make_sampler(self.graphdef, num_samples, self.sp)
        return fn(params, prompt_QP, prompt_valid_QP, seeds_Q)

    def greedy(self, params, prompt_QP, prompt_valid_QP, max_new_tokens: int | None = None):
        sp = SamplingParams(
            max_new_tokens=max_new_tokens or self.sp.max_new_tokens,
            temperature=0.0,
            eos_id=self.sp.eos_id,
            pad_id=self.sp.pad_id,
            cache_dtype=self.sp.cache_dtype,
        )
        seeds_Q = jax.numpy.zeros((prompt_QP.shape[0],), jax.numpy.uint32)
        return make_sampler(self.graphdef, 1, sp)(params, prompt_QP, prompt_valid_QP, seeds_Q)

    def sync_weights(self, params, step: int) -> dict:
        return {}

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
        return EmbeddedBackend(graphdef, sp)
    if jax.process_count() == 1:
        return VLLMBackend(cfg, graphdef, sp, run_dir)
    inner = VLLMBackend(cfg, graphdef, sp, run_dir) if distributed.is_main() else None
    return MainProcessBackend(inner, sp, mesh)
