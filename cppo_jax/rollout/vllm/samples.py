"""vLLM's completions as the static-shape `Samples` the trainer takes (host arrays turned into JAX ones).

Split from `cppo_jax/rollout/vllm/backend.py` (which re-exports it); see that module's docstring for the
rules (`valid` and `finished` by the sampler's own `sampling.completion_ends`, which the server's "stop" vs
"length" must agree with).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cppo_jax.rollout.embedded.sampling import Samples, SamplingParams, completion_ends
from cppo_jax.rollout.vllm.client import Completion, ResponseError

__all__ = ["samples_from_completions", "strip_padding"]


def samples_from_completions(
    groups: list[list[Completion]], num_samples: int, sp: SamplingParams, url: str = ""
) -> Samples:
    """Static-shape `Samples` [Q*G, C] from per-question completions (prompt-major rows).

    `valid_NC` and `finished_N` come from `sampling.completion_ends` on the server's token ids, as
    the embedded sampler's do; a completion that goes on after an end id, or whose `finish_reason`
    disagrees with the rule (the server stopped on an id that is not one of `sp.eos_id`), raises
    `ResponseError`."""
    G, C = num_samples, sp.max_new_tokens
    N = len(groups) * G
    tokens_NC = np.full((N, C), sp.pad_id, np.int32)
    logp_NC = np.zeros((N, C), np.float32)
    length_N = np.zeros((N,), np.int64)
    stop_N = np.zeros((N,), bool)
    for q, group in enumerate(groups):
        if len(group) != G:
            raise ResponseError(
                f"{url}: question {q} came back with {len(group)} completions, expected {G}",
                url=url,
            )
        for j, c in enumerate(group):
            row, n = q * G + j, len(c.token_ids)
            if n > C:
                raise ResponseError(
                    f"{url}: completion {j} of question {q} has {n} tokens, more than {C}", url=url
                )
            tokens_NC[row, :n] = c.token_ids
            logp_NC[row, :n] = c.logprobs
            length_N[row] = n
            stop_N[row] = c.finish_reason == "stop"
    valid_NC, finished_N = completion_ends(tokens_NC, sp.eos_id, length_N, xp=np)
    for row in range(N):
        q, j, n, used = row // G, row % G, int(length_N[row]), int(valid_NC[row].sum())
        if used != n:
            raise ResponseError(
                f"{url}: completion {j} of question {q} goes on after EOS (ids {list(sp.eos_id)}) at "
                f"token {used - 1} of {n}: the server ignored the stop token",
                url=url,
            )
        if stop_N[row] != finished_N[row]:
            reason = "stop" if stop_N[row] else "length"
            raise ResponseError(
                f"{url}: completion {j} of question {q} has finish_reason {reason!r}, but its end "
                f"ids (ids {list(sp.eos_id)}) say {'finished' if finished_N[row] else 'truncated'}: "
                f"the server stops on other ids than the trainer (last token "
                f"{int(tokens_NC[row, n - 1])})",
                url=url,
            )
    # Decoded positions: C when any sequence was truncated, else 1 + the last EOS position.
    steps = int(length_N.max()) if N else 0
    return Samples(
        jnp.asarray(tokens_NC),
        jnp.asarray(logp_NC),
        jnp.asarray(valid_NC),
        jnp.asarray(finished_N),
        jnp.int32(steps),
    )


def strip_padding(prompt_QP, prompt_valid_QP) -> list[list[int]]:
    """The Q left-padded prompts as token lists without their padding (one request each)."""
    prompt_QP = np.asarray(prompt_QP)
    valid_QP = np.asarray(prompt_valid_QP).astype(bool)
    prompts = [[int(t) for t in row[valid]] for row, valid in zip(prompt_QP, valid_QP)]
    for q, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {q} has no valid token")
    return prompts
