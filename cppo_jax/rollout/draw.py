"""Steps 1-2 of a CPPO step: draw the step's Q questions and sample G completions of each.

Every process draws the whole global batch of question ids (cheap: `pipeline.question_order` gives
step `step`'s row) and lays prompts and seeds out as global arrays over the mesh. Question q of step
`step` is sampled with seed `pipeline.sample_seeds(seed, step * Q + q)`, so each question of each step
has its own random numbers, the same however the batch is split or the run is resumed.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.parallel import distributed
from cppo_jax.rollout.embedded.sampling import Samples


@dataclasses.dataclass
class StepRollout:
    """One step's questions and their sampled completions."""

    step: int
    batch: pipeline.PromptSet
    prompt_QP: jax.Array
    pvalid_QP: jax.Array
    samples: Samples
    seconds: float  # wall time of the generation itself


def draw_rollout(
    backend, params, prompts: pipeline.PromptSet, question_ids, step: int, seed: int, G: int, mesh
) -> StepRollout:
    """The questions `question_ids` of `prompts` (step `step`'s) and G completions each from
    `backend` sampling with `params`, waited for."""
    batch = prompts.take(np.asarray(question_ids))
    Q = len(batch)
    prompt_QP = distributed.rows(batch.ids_nP, mesh)
    pvalid_QP = distributed.rows(batch.valid_nP, mesh)
    seeds = pipeline.sample_seeds(seed, step * Q + np.arange(Q))
    seeds_Q = distributed.rows(seeds.astype(np.uint32), mesh)
    t = time.perf_counter()
    samples = jax.block_until_ready(backend.generate(params, prompt_QP, pvalid_QP, seeds_Q, G))
    return StepRollout(step, batch, prompt_QP, pvalid_QP, samples, time.perf_counter() - t)
