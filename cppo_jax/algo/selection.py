"""The selection rules that followed CPPO, in static shapes (pure, jit-friendly).

- `max_variance_indices`: PODS (arXiv 2504.13818), keep the k of G whose rewards vary most
  (`cppo.metric = "max_variance"`).
- `proportional_indices` / `proportional_advantages`: an unbiased pruned estimator
  (`cppo.metric = "proportional"`): k draws with replacement, completion g drawn with probability
  q_g = |A_g| / sum |A|, each kept row's advantage re-weighted to A_g / (G q_g) = sign(A_g) mean |A|,
  so that the expected kept-row mean of A * (any per-completion term) is the group's full mean
  (1 / G) sum_g A_g * term_g, the GRPO gradient's, where top-k pruning is biased toward large |A|.
- `informative_groups`: DAPO's dynamic sampling (arXiv 2503.14476) with a fixed shape
  (`cppo.filter_groups`): of the Q groups rolled out keep U, those whose rewards are not all equal
  first, where DAPO draws more batches until U informative groups are found.

Letters (docs/conventions.md): Q questions rolled out, U questions trained (`cppo.Shapes.U`), G
completions per question, K kept per question.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cppo_jax.data import skipping


def max_variance_indices(x_QG: jax.Array, k: int) -> jax.Array:
    """idx_QK: per row the k entries of largest variance (PODS' max-variance down-sampling).

    The best k-subset of sorted values is always some i lowest plus the k - i highest (PODS,
    arXiv 2504.13818), so the k + 1 splits are scored with prefix sums and the best taken (the
    smallest i on ties: an all-equal group keeps its last k); static shapes throughout. Equal
    values sort by index. PODS states the rule for a whole batch; here it runs per question."""
    Q, G = x_QG.shape
    order_QG = jnp.argsort(x_QG, axis=1, stable=True).astype(jnp.int32)
    s_QG = jnp.take_along_axis(x_QG, order_QG, axis=1).astype(jnp.float32)
    s_QG = s_QG - s_QG.mean(axis=1, keepdims=True)  # centred: the sums of squares stay well scaled
    zero = jnp.zeros((Q, 1), jnp.float32)
    c1 = jnp.concatenate([zero, jnp.cumsum(s_QG, axis=1)], axis=1)  # [Q, G + 1] prefix sums
    c2 = jnp.concatenate([zero, jnp.cumsum(s_QG * s_QG, axis=1)], axis=1)
    i = jnp.arange(k + 1)  # i lowest + (k - i) highest
    sum1 = c1[:, i] + c1[:, G:] - c1[:, G - k + i]
    sum2 = c2[:, i] + c2[:, G:] - c2[:, G - k + i]
    var_Qi = sum2 / k - (sum1 / k) ** 2  # i: the k + 1 splits
    best_Q = jnp.argmax(var_Qi, axis=1)  # first maximum: the smallest i
    pos = jnp.arange(G)
    keep_QG = (pos < best_Q[:, None]) | (pos >= G - k + best_Q[:, None])
    picked_QK = jnp.argsort(~keep_QG, axis=1, stable=True)[:, :k]  # sorted positions kept
    return jnp.sort(jnp.take_along_axis(order_QG, picked_QK, axis=1), axis=1)


def proportional_probs(adv_QG: jax.Array) -> jax.Array:
    """q_QG: each completion's draw probability, |A| / sum |A| in its group (uniform where every A
    is 0: such a group carries no gradient whatever is drawn)."""
    abs_QG = jnp.abs(adv_QG).astype(jnp.float32)
    total_Q1 = jnp.sum(abs_QG, axis=1, keepdims=True)
    G = adv_QG.shape[1]
    return jnp.where(total_Q1 > 0, abs_QG / jnp.where(total_Q1 > 0, total_Q1, 1.0), 1.0 / G)


def proportional_indices(adv_QG: jax.Array, k: int, rng: jax.Array) -> jax.Array:
    """idx_QK: k draws per question, with replacement, completion g with probability q_g
    (`proportional_probs`), sorted ascending (a completion drawn twice is trained twice). k = G
    keeps every completion once: nothing is pruned, the estimator is the full gradient."""
    Q, G = adv_QG.shape
    if k == G:
        return jnp.broadcast_to(jnp.arange(G, dtype=jnp.int32), (Q, G))
    logq_QG = jnp.log(proportional_probs(adv_QG))  # log 0 = -inf: never drawn
    idx_QK = jax.random.categorical(rng, logq_QG[:, None, :], axis=-1, shape=(Q, k))
    return jnp.sort(idx_QK.astype(jnp.int32), axis=1)


def proportional_advantages(adv_QG: jax.Array, k: int) -> jax.Array:
    """The advantage each completion trains with when drawn by `proportional_indices`:
    A_g / (G q_g) = sign(A_g) * mean_g |A| (A itself when k = G: nothing was pruned)."""
    if k == adv_QG.shape[1]:
        return adv_QG
    return jnp.sign(adv_QG) * jnp.mean(jnp.abs(adv_QG), axis=1, keepdims=True)


def informative_groups(rewards_QG: jax.Array, U: int) -> jax.Array:
    """groups_U (int32, ascending): U of the Q groups, those whose rewards are not all equal first
    (lower index first among equals): DAPO's dynamic sampling with the batch drawn once. When fewer
    than U groups are informative, the first zero-variance ones fill the batch (`filter_counts`)."""
    same_Q = jnp.all(rewards_QG == rewards_QG[:, :1], axis=1)
    order_Q = jnp.argsort(same_Q, stable=True).astype(jnp.int32)  # False (informative) first
    return jnp.sort(order_Q[:U])


def filter_counts(rewards_QG, U: int) -> dict[str, float]:
    """Host metrics of `informative_groups`: zero-variance groups rolled out, dropped and trained."""
    zero = int(np.sum(skipping.zero_variance(rewards_QG)))
    dropped = min(zero, np.shape(rewards_QG)[0] - U)
    return {
        "filter/zero_variance_groups": float(zero),
        "filter/dropped": float(dropped),
        "filter/zero_variance_trained": float(zero - dropped),
    }
