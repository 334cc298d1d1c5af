"""An independent float64 NumPy/Python re-implementation of the released CPPO code's semantics (and of
the GSPO and CISPO papers' objectives).

Written with plain loops and Python sorting on purpose, so that it shares no structure with the
JAX code it checks (cppo_jax.algo.cppo, cppo_jax.algo.loss). Names follow the project's shape suffixes.
"""

from __future__ import annotations

import math

import numpy as np


def _mean(xs) -> float:
    return math.fsum(xs) / len(xs)


def _std_unbiased(xs) -> float:
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def group_advantages(rewards_QG, scale: str = "group", eps: float = 1e-4) -> np.ndarray:
    """A = (r - group mean) / (std + eps) with ddof=1; "batch" std over all; "none" no scaling."""
    r_QG = np.asarray(rewards_QG, dtype=np.float64)
    Q, G = r_QG.shape
    if scale == "batch":
        batch_std = _std_unbiased([float(x) for x in r_QG.ravel()])
    adv_QG = np.zeros((Q, G))
    for q in range(Q):
        row = [float(x) for x in r_QG[q]]
        mean = _mean(row)
        if scale == "group":
            denom = _std_unbiased(row) + eps
        elif scale == "batch":
            denom = batch_std + eps
        else:
            denom = 1.0
        for g in range(G):
            adv_QG[q, g] = (row[g] - mean) / denom
    return adv_QG


def _select(values, k: int, metric: str) -> list[int]:
    """The k kept positions of a 1-D list, ties to the lower index, returned ascending."""
    positions = range(len(values))
    if metric == "smallest":  # drop the smallest |A|: keep the largest
        order = sorted(positions, key=lambda i: (-abs(values[i]), i))
    elif metric == "largest":  # drop the largest |A|: keep the smallest
        order = sorted(positions, key=lambda i: (abs(values[i]), i))
    else:
        raise ValueError(metric)
    return sorted(order[:k])


def prune_per_question(adv_QG, k: int, metric: str = "smallest") -> np.ndarray:
    """idx_QK: the paper's rule, k completions per question."""
    adv_QG = np.asarray(adv_QG, dtype=np.float64)
    return np.array([_select([float(a) for a in row], k, metric) for row in adv_QG], dtype=np.int64)


def prune_batch(adv_N, n_keep: int, metric: str = "smallest") -> np.ndarray:
    """idx_K: the released TRL fork, one top-k by |A| over the flattened per-process slice."""
    return np.array(_select([float(a) for a in np.ravel(adv_N)], n_keep, metric), dtype=np.int64)


def num_kept(G: int, p_num: int, p_den: int) -> int:
    """max(1, floor(G (1 - p))) for p = p_num / p_den, in integers."""
    return max(1, (G * (p_den - p_num)) // p_den)


def num_questions(b: int, p_num: int, p_den: int) -> int:
    """floor(b / (1 - p)) for p = p_num / p_den, in integers."""
    return (b * p_den) // (p_den - p_num)


def per_token_loss(logp_NT, old_NT, ref_NT, adv_N, eps_low, eps_high, beta) -> np.ndarray:
    N, T = np.shape(logp_NT)
    out_NT = np.zeros((N, T))
    for i in range(N):
        a = float(adv_N[i])
        for t in range(T):
            lp = float(logp_NT[i][t])
            ratio = math.exp(lp - float(old_NT[i][t]))
            clipped = min(max(ratio, 1.0 - eps_low), 1.0 + eps_high)
            value = -min(ratio * a, clipped * a)
            if beta != 0:
                d = float(ref_NT[i][t]) - lp
                value += beta * (math.exp(d) - d - 1.0)
            out_NT[i, t] = value
    return out_NT


def aggregate(per_token_NT, mask_NT, loss_type: str, max_completion_len=None) -> float:
    N, T = np.shape(per_token_NT)
    rows = [[float(per_token_NT[i][t]) * float(mask_NT[i][t]) for t in range(T)] for i in range(N)]
    counts = [math.fsum(float(m) for m in mask_NT[i]) for i in range(N)]
    total = math.fsum(math.fsum(r) for r in rows)
    if loss_type == "token_mean":
        return total / max(math.fsum(counts), 1.0)
    if loss_type == "seq_mean":
        return math.fsum(math.fsum(rows[i]) / max(counts[i], 1.0) for i in range(N)) / N
    if loss_type == "dr_grpo":
        return total / (N * max_completion_len)
    raise ValueError(loss_type)


def _k3(ref_lp: float, lp: float) -> float:
    d = ref_lp - lp
    return math.exp(d) - d - 1.0


def gspo_loss(logp_NT, old_NT, ref_NT, adv_N, mask_NT, eps_low, eps_high, beta) -> float:
    """GSPO (Zheng et al. 2025, eq. 5-7), negated: -1/G sum_i min(s_i A_i, clip(s_i) A_i) with
    s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|), the product over y_i's tokens; plus beta times each
    sequence's mean k3 KL, averaged over sequences."""
    N, T = np.shape(logp_NT)
    terms = []
    for i in range(N):
        toks = [t for t in range(T) if float(mask_NT[i][t]) > 0]
        n = max(len(toks), 1)
        joint = math.prod(math.exp(float(logp_NT[i][t]) - float(old_NT[i][t])) for t in toks)
        s = joint ** (1.0 / n)
        a = float(adv_N[i])
        value = -min(s * a, min(max(s, 1.0 - eps_low), 1.0 + eps_high) * a) if toks else 0.0
        if beta != 0:
            value += beta * math.fsum(_k3(ref_NT[i][t], logp_NT[i][t]) for t in toks) / n
        terms.append(value)
    return math.fsum(terms) / N


def cispo_loss(logp_NT, old_NT, ref_NT, adv_N, mask_NT, cap, beta) -> float:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5), negated: -1/sum_i |o_i| sum_i sum_t
    sg(r_hat_it) A_i log pi(o_it), r_hat = min(pi / pi_old, cap) (no lower bound); plus beta times the
    token-mean k3 KL. As a value: the weight is a number here, so only the loss's value is checked."""
    N, T = np.shape(logp_NT)
    total, count = [], 0.0
    for i in range(N):
        for t in range(T):
            if float(mask_NT[i][t]) == 0:
                continue
            lp = float(logp_NT[i][t])
            r_hat = min(math.exp(lp - float(old_NT[i][t])), cap)
            value = -r_hat * float(adv_N[i]) * lp
            if beta != 0:
                value += beta * _k3(ref_NT[i][t], lp)
            total.append(value)
            count += 1.0
    return math.fsum(total) / max(count, 1.0)


def policy_loss(
    logp_NT,
    old_NT,
    ref_NT,
    adv_N,
    mask_NT,
    loss_type="token_mean",
    eps_low=0.2,
    eps_high=0.2,
    beta=0.04,
    max_completion_len=None,
    cispo_cap=5.0,
):
    """(loss, metrics) with the same metric names as cppo_jax.algo.loss.policy_loss."""
    if loss_type == "gspo":
        loss = gspo_loss(logp_NT, old_NT, ref_NT, adv_N, mask_NT, eps_low, eps_high, beta)
    elif loss_type == "cispo":
        loss = cispo_loss(logp_NT, old_NT, ref_NT, adv_N, mask_NT, cispo_cap, beta)
    else:
        per_tok = per_token_loss(logp_NT, old_NT, ref_NT, adv_N, eps_low, eps_high, beta)
        loss = aggregate(per_tok, mask_NT, loss_type, max_completion_len)
    N, T = np.shape(logp_NT)
    n_masked = low = high = kl = ratio_sum = dev_sum = 0.0
    for i in range(N):
        a = float(adv_N[i])
        toks = [t for t in range(T) if float(mask_NT[i][t]) > 0]
        seq_log_ratio = math.fsum(float(logp_NT[i][t]) - float(old_NT[i][t]) for t in toks)
        seq_ratio = math.exp(seq_log_ratio / max(len(toks), 1))
        for t in range(T):
            m = float(mask_NT[i][t])
            ratio = math.exp(float(logp_NT[i][t]) - float(old_NT[i][t]))
            if loss_type == "gspo":  # every token carries its sequence's ratio
                ratio = seq_ratio
            n_masked += m
            ratio_sum += m * ratio
            dev_sum += m * abs(ratio - 1.0)
            if loss_type == "cispo":
                high += m * (ratio > cispo_cap)
            else:
                low += m * (ratio < 1.0 - eps_low and a < 0)
                high += m * (ratio > 1.0 + eps_high and a > 0)
            if beta != 0:
                kl += m * _k3(ref_NT[i][t], logp_NT[i][t])
    n_masked = max(n_masked, 1.0)
    metrics = {
        "loss": loss,
        "kl": kl / n_masked,
        "clip_ratio/low_mean": low / n_masked,
        "clip_ratio/high_mean": high / n_masked,
        "clip_ratio/region_mean": (low + high) / n_masked,
        "ratio/mean": ratio_sum / n_masked,
        "ratio/abs_dev_mean": dev_sum / n_masked,
    }
    return loss, metrics


def token_logps(logits_NTV, targets_NT, temperature: float = 1.0) -> np.ndarray:
    """log-softmax(logits / temperature) at the targets, one row at a time."""
    z_NTV = np.asarray(logits_NTV, dtype=np.float64) / temperature
    N, T, _ = z_NTV.shape
    out_NT = np.zeros((N, T))
    for i in range(N):
        for t in range(T):
            row = z_NTV[i, t]
            top = row.max()
            lse = top + math.log(math.fsum(math.exp(x - top) for x in row))
            out_NT[i, t] = row[int(targets_NT[i][t])] - lse
    return out_NT


def token_entropy(logits_NTV, temperature: float = 1.0) -> np.ndarray:
    z_NTV = np.asarray(logits_NTV, dtype=np.float64) / temperature
    N, T, _ = z_NTV.shape
    out_NT = np.zeros((N, T))
    for i in range(N):
        for t in range(T):
            row = z_NTV[i, t] - z_NTV[i, t].max()
            probs = np.exp(row) / np.exp(row).sum()
            out_NT[i, t] = -sum(p * math.log(p) for p in probs if p > 0)
    return out_NT


def completion_ends(ids_NC, end_ids, length_N=None) -> tuple[np.ndarray, np.ndarray]:
    """(valid_NC, finished_N), one token at a time: valid up to and including the first end id
    (any of `end_ids`, an id or a tuple) among each row's first length_N[i] tokens (all when None),
    finished when there is one."""
    ends = (end_ids,) if isinstance(end_ids, int) else tuple(end_ids)
    N, C = np.shape(ids_NC)
    valid_NC, finished_N = np.zeros((N, C), bool), np.zeros(N, bool)
    for i in range(N):
        for t in range(C if length_N is None else int(length_N[i])):
            valid_NC[i, t] = True
            if int(ids_NC[i][t]) in ends:
                finished_N[i] = True
                break
    return valid_NC, finished_N


def informative_groups(rewards_QG, U: int) -> list[int]:
    """The U trained groups of DAPO-style filtering: groups whose rewards differ first, then the
    zero-variance ones, each in index order; returned ascending."""
    rows = [[float(x) for x in row] for row in np.asarray(rewards_QG, dtype=np.float64)]
    varied = [q for q, row in enumerate(rows) if max(row) != min(row)]
    same = [q for q, row in enumerate(rows) if max(row) == min(row)]
    return sorted((varied + same)[:U])


def proportional_probs(adv_QG) -> np.ndarray:
    """q_g = |A_g| / sum |A| per group (uniform for a group of zeros)."""
    out = []
    for row in np.asarray(adv_QG, dtype=np.float64):
        total = math.fsum(abs(float(a)) for a in row)
        out.append([abs(float(a)) / total if total > 0 else 1.0 / len(row) for a in row])
    return np.array(out)
