"""DPPO's pruning (arXiv 2603.04135) in static shapes: unbiased prompt and completion pruning.

DPPO prunes at two levels, prompts then completions, and rescales what it keeps so that the
expected pruned gradient is the full batch's (importance sampling over the pruning itself). Here
both levels draw a fixed number of units (static shapes) with unequal probabilities and rescale
each kept unit by the inverse of its inclusion probability (Horvitz-Thompson):

1. Prompt level (`cppo.prompt_rate` r_q > 0): of the Q rolled-out groups keep U, group q with
   probability rho_q proportional to its mean |A| (capped at 1, sum rho = U; `inclusion_probs`),
   drawn by systematic sampling (`systematic_indices`); each kept group weighs v_q = U / (Q rho_q).
2. Completion level (`cppo.metric = "dppo"`): of each kept group's G completions keep K, g with
   probability pi_g proportional to |A_g| (capped, sum pi = K), one systematic draw per question;
   each kept completion weighs w_g = K / (G pi_g).

A kept completion trains with advantage v_q w_g A_qg (`trained_advantages`): the mean over the
U K kept rows of v w A x then has expectation (1 / (Q G)) sum_qg A_qg x_qg, the unpruned mean,
for any per-completion term x (E[1{q kept}] = rho_q, E[1{g kept} | q kept] = pi_g). Units with
A = 0 (or a group whose A are all 0) carry no policy gradient, so giving them probability 0 keeps
the estimator unbiased; when fewer than n units have |A| > 0, those are all kept and the rest of the
n places are spread evenly over the zero ones. Exactly unbiased for a loss with a fixed denominator
(`cppo.loss_type` seq_mean or dr_grpo) and for the policy-gradient term only (the KL penalty is
averaged over the kept rows unweighted, as for every pruned rule here).

Letters (docs/conventions.md): Q questions rolled out, U trained, G completions per question, K
kept per question; X any leading axes, n the units drawn per row of X (U or K).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def inclusion_probs(score_XG: jax.Array, n: int) -> jax.Array:
    """pi_XG: per row, probabilities proportional to score (>= 0), capped at 1, summing to n.

    Capped proportional-to-size: the t largest scores are set to 1 and the rest scaled by
    c = (n - t) / (sum of the rest), t the smallest count for which the largest uncapped c * s is
    <= 1. A row with at most n positive scores keeps all of them (pi = 1) and spreads the other
    places evenly over its zeros. n is a static Python int in [1, G]."""
    G = score_XG.shape[-1]
    if not 1 <= n <= G:
        raise ValueError(f"n (units kept per row) must be in [1, {G}], got {n}")
    s_XG = jnp.maximum(score_XG.astype(jnp.float32), 0.0)
    desc_XG = -jnp.sort(-s_XG, axis=-1)
    tail_XG = jnp.flip(jnp.cumsum(jnp.flip(desc_XG, -1), axis=-1), -1)  # sum of desc[t:]
    t = jnp.arange(n)  # capped count candidates, 0..n-1
    rest_Xt = tail_XG[..., :n]
    c_Xt = (n - t) / jnp.where(rest_Xt > 0, rest_Xt, 1.0)
    ok_Xt = (c_Xt * desc_XG[..., :n] <= 1.0) & (rest_Xt > 0)
    t_X = jnp.argmax(ok_Xt, axis=-1)  # the first (smallest) t that fits
    c_X = jnp.take_along_axis(c_Xt, t_X[..., None], axis=-1)
    pi_XG = jnp.minimum(c_X * s_XG, 1.0)
    m_X1 = jnp.sum(s_XG > 0, axis=-1, keepdims=True)  # positive scores
    spread_X1 = (n - m_X1) / jnp.maximum(G - m_X1, 1)
    few_XG = jnp.where(s_XG > 0, 1.0, spread_X1)
    return jnp.where(m_X1 <= n, few_XG, pi_XG)


def systematic_indices(pi_XG: jax.Array, n: int, u_X: jax.Array) -> jax.Array:
    """idx_Xn (int32, ascending): Madow's systematic sampling, exactly n distinct units per row.

    With cumulative probabilities c_g = pi_1 + ... + pi_g (rescaled so that c_G = n exactly), the
    n points u, u + 1, ..., u + n - 1 (u uniform in [0, 1), one per row) each fall in one interval
    [c_(g-1), c_g): unit g is drawn with probability exactly pi_g (<= 1), never twice."""
    cum_XG = jnp.cumsum(pi_XG.astype(jnp.float32), axis=-1)
    cum_XG = cum_XG * (n / cum_XG[..., -1:])
    x_Xn = u_X[..., None] + jnp.arange(n, dtype=jnp.float32)
    idx_Xn = jnp.sum(cum_XG[..., None, :] <= x_Xn[..., :, None], axis=-1)
    return jnp.minimum(idx_Xn, pi_XG.shape[-1] - 1).astype(jnp.int32)


def completion_indices(adv_QG: jax.Array, k: int, rng: jax.Array) -> jax.Array:
    """idx_QK: per question k of G completions, g with probability pi_g ~ |A_g| (capped, sum k),
    one systematic draw per question. k = G keeps every completion."""
    Q, G = adv_QG.shape
    if k == G:
        return jnp.broadcast_to(jnp.arange(G, dtype=jnp.int32), (Q, G))
    u_Q = jax.random.uniform(rng, (Q,), jnp.float32)
    return systematic_indices(inclusion_probs(jnp.abs(adv_QG), k), k, u_Q)


def prompt_probs(adv_QG: jax.Array, U: int) -> jax.Array:
    """rho_Q: each rolled-out group's probability of being trained, ~ its mean |A| (sum U)."""
    return inclusion_probs(jnp.mean(jnp.abs(adv_QG), axis=1), U)


def prompt_indices(adv_QG: jax.Array, U: int, rng: jax.Array) -> jax.Array:
    """groups_U (int32, ascending): U of the Q groups by one systematic draw with `prompt_probs`."""
    u = jax.random.uniform(rng, (), jnp.float32)
    return systematic_indices(prompt_probs(adv_QG, U), U, u)


def trained_advantages(adv_QG: jax.Array, groups_U: jax.Array, k: int):
    """(adv_UG, trained_UG): the U trained groups' advantages and what each of their completions
    trains with, v_q w_g A_qg, v_q = U / (Q rho_q) and w_g = K / (G pi_g) (no rescaling at a level
    that prunes nothing)."""
    Q, G = adv_QG.shape
    U = groups_U.shape[0]
    adv_UG = adv_QG[groups_U]
    out_UG = adv_UG
    if k < G:
        pi_UG = inclusion_probs(jnp.abs(adv_UG), k)
        out_UG = out_UG * (k / G) / jnp.where(pi_UG > 0, pi_UG, 1.0)
    if U < Q:
        rho_U = prompt_probs(adv_QG, U)[groups_U]
        out_UG = out_UG * ((U / Q) / jnp.where(rho_U > 0, rho_U, 1.0))[:, None]
    return adv_UG, out_UG
