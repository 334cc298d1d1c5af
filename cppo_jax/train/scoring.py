"""Step 3 of a CPPO step on the host: decode a rollout, score it with the reward workers, and its metrics.

Each process scores the completions of its own slice of questions (`distributed.local_slice`); the
scores are then gathered so that every process holds every reward. Rewards in the style of TRL receive,
besides the completion, the prompt as the model saw it, the completion's token ids (up to and including
EOS) and the example's columns.
"""

from __future__ import annotations

import numpy as np

from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.observe.runlog import reward_metrics
from cppo_jax.parallel import distributed


def reward_contexts(tokenizer, batch, own: slice, tokens_NC, valid_NC, G: int) -> list[dict]:
    """What each of the G completions of the questions `own` of `batch` is scored with, besides its
    text and solution (rows of `tokens_NC` are those questions' completions, in order)."""
    out = []
    for q, i in enumerate(range(own.start, own.stop)):
        ids = batch.ids_nP[i][batch.valid_nP[i].astype(bool)]
        prompt = tokenizer.decode([int(t) for t in ids])
        columns = {k: v for k, v in batch.examples[i].items() if k != "prompt"}
        for r in range(q * G, (q + 1) * G):
            completion_ids = [int(t) for t, v in zip(tokens_NC[r], valid_NC[r]) if v]
            out.append({"prompt": prompt, "completion_ids": completion_ids, **columns})
    return out


def score_rollout(pool, tokenizer, batch, tokens_NC, valid_NC, G: int, only: list[str]):
    """This process's questions of `batch` scored by the reward functions `only` of `pool`, gathered over
    processes: (this process's texts, total reward [N] float64, {function: scores [N]}, pool stats)."""
    own = distributed.local_slice(len(batch))
    rows = slice(own.start * G, own.stop * G)
    texts = pipeline.decode_completions(tokenizer, tokens_NC[rows], valid_NC[rows])
    solutions = [ex["solution"] for ex in batch.examples[own] for _ in range(G)]
    contexts = reward_contexts(tokenizer, batch, own, tokens_NC[rows], valid_NC[rows], G)
    total_N, per_fn, stats = pool.score(texts, solutions, only, contexts)
    total_N = distributed.gather_rows(np.asarray(total_N, np.float64))
    per_fn = {k: distributed.gather_rows(np.asarray(v)) for k, v in sorted(per_fn.items())}
    return texts, total_N, per_fn, stats


def sampled_tokens(prompt_valid_QP, valid_NC, G: int) -> int:
    """Prompt and completion tokens of every sampled sequence (TRL's `num_tokens` counts these)."""
    return int(np.asarray(prompt_valid_QP).sum()) * G + int(valid_NC.sum())


def rollout_metrics(
    rewards_QG, per_fn, stats, valid_NC, finished_N, accuracy_fn, num_tokens
) -> dict:
    """The rollout's metrics (`runlog.reward_metrics`), reward timeouts, `accuracy` (the share of
    completions the task's accuracy reward scores above 0, when it is trained with) and `num_tokens`."""
    m = reward_metrics(rewards_QG, per_fn, valid_NC.sum(axis=1), finished_N)
    m["rewards/timeouts"] = float(stats.get("timeouts", 0))
    acc = per_fn.get(accuracy_fn)
    if acc is not None:
        m["accuracy"] = float(np.mean(np.asarray(acc) > 0))
    m["num_tokens"] = float(num_tokens)
    return m
