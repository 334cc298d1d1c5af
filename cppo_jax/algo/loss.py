"""Memory-bounded token log-probs and the clipped GRPO/CPPO policy loss (pure, no model).

Letters (docs/conventions.md): M kept (trained) sequences, C completion tokens, D model width, V
vocabulary. The log-prob helper takes any [M, T] block of tokens (step.py passes the C completion
positions); inside it, X chunks of c tokens. Static (Python) arguments: loss_type, beta, eps_low,
eps_high, max_completion_len, tis_cap, cispo_cap, chunk_size, return_entropy; everything else may be
traced.

The loss mask is the caller's: `cppo.prune` builds it from the rollout's `valid_NC` and, with
`cppo.mask_truncated`, `finished_N` (both from `rollout.sampling.completion_ends`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cppo_jax.config.choices import LOSS_TYPES
from cppo_jax.models.transformer import unembed

# --------------------------------------------------------------------------- log-probs


def _check_temperature(temperature) -> None:
    if isinstance(temperature, int | float) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _chunk_logps(h_McD, w_DV, t_Mc, temperature, return_entropy):
    """One chunk of tokens: the only place a [M, c, V] float32 logits block exists."""
    z_McV = unembed(h_McD, w_DV)
    z_McV = z_McV / temperature
    lse_Mc = jax.nn.logsumexp(z_McV, axis=-1)
    logp_Mc = jnp.take_along_axis(z_McV, t_Mc[..., None], axis=-1)[..., 0] - lse_Mc
    if not return_entropy:
        return logp_Mc, None
    p_McV = jnp.exp(z_McV - lse_Mc[..., None])
    return logp_Mc, lse_Mc - jnp.sum(p_McV * z_McV, axis=-1)


def token_logps_from_hidden(
    h_MTD: jax.Array,
    w_DV: jax.Array,
    targets_MT: jax.Array,
    temperature: float = 1.0,
    chunk_size: int = 128,
    return_entropy: bool = False,
):
    """logp_MT (float32) = log-softmax(h @ w / temperature) at the targets, chunked over T.

    The T axis is cut into chunks of chunk_size tokens (the last one may be shorter); a scan
    (lax.map) visits them and each chunk is rematerialised in the backward pass (jax.checkpoint),
    so forward and backward hold a few [M, chunk_size, V] float32 blocks, never [M, T, V].
    Logits are `models.transformer.unembed(h, w)`: w cast to h's dtype, accumulated in float32.
    Inside: X chunks of c tokens.
    With return_entropy=True returns (logp_MT, entropy_MT), the entropy from the same chunks.
    """
    _check_temperature(temperature)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    M, T, D = h_MTD.shape
    if targets_MT.shape != (M, T):
        raise ValueError(f"targets_MT must be {(M, T)}, got {targets_MT.shape}")
    if T == 0:
        empty_MT = jnp.zeros((M, 0), jnp.float32)
        return (empty_MT, empty_MT) if return_entropy else empty_MT
    c = min(chunk_size, T)
    n_full, T_full = T // c, (T // c) * c

    def one(h_McD, t_Mc):
        return _chunk_logps(h_McD, w_DV, t_Mc, temperature, return_entropy)

    one = jax.checkpoint(one, prevent_cse=False)

    def per_chunk(args):
        return one(*args)

    # [M, n_full * c, D] -> [n_full, M, c, D]: chunks become the scanned axis.
    h_XMcD = h_MTD[:, :T_full].reshape(M, n_full, c, D).swapaxes(0, 1)
    t_XMc = targets_MT[:, :T_full].reshape(M, n_full, c).swapaxes(0, 1)
    logp_XMc, ent_XMc = jax.lax.map(per_chunk, (h_XMcD, t_XMc))
    logps, ents = [logp_XMc.swapaxes(0, 1).reshape(M, T_full)], []
    if return_entropy:
        ents.append(ent_XMc.swapaxes(0, 1).reshape(M, T_full))
    if T_full < T:  # the tail chunk, shorter than c
        logp_Mr, ent_Mr = one(h_MTD[:, T_full:], targets_MT[:, T_full:])
        logps.append(logp_Mr)
        ents.append(ent_Mr)
    logp_MT = jnp.concatenate(logps, axis=1) if len(logps) > 1 else logps[0]
    if not return_entropy:
        return logp_MT
    ent_MT = jnp.concatenate(ents, axis=1) if len(ents) > 1 else ents[0]
    return logp_MT, ent_MT


# --------------------------------------------------------------------------- loss


def _masked_mean(x_MC: jax.Array, mask_MC: jax.Array) -> jax.Array:
    return jnp.sum(x_MC * mask_MC) / jnp.maximum(jnp.sum(mask_MC), 1.0)


# How each loss_type averages its per-token terms: gspo is a mean over sequences (its terms are one
# value per sequence), cispo a mean over all the batch's tokens (MiniMax-M1's 1 / sum_i |o_i|).
AGGREGATION = {
    "token_mean": "token_mean",
    "seq_mean": "seq_mean",
    "dr_grpo": "dr_grpo",
    "gspo": "seq_mean",
    "cispo": "token_mean",
}


def _aggregate(per_token_MC, mask_MC, loss_type, max_completion_len):
    total = jnp.sum(per_token_MC * mask_MC)
    loss_type = AGGREGATION[loss_type]
    if loss_type == "token_mean":
        return total / jnp.maximum(jnp.sum(mask_MC), 1.0)
    if loss_type == "seq_mean":
        per_seq_M = jnp.sum(per_token_MC * mask_MC, axis=1)
        return jnp.mean(per_seq_M / jnp.maximum(jnp.sum(mask_MC, axis=1), 1.0))
    # dr_grpo: a constant denominator, so every token weighs the same whatever the lengths.
    return total / (per_token_MC.shape[0] * max_completion_len)


def _check_loss_args(loss_type, beta, ref_logp_MC, max_completion_len) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if isinstance(beta, bool) or not isinstance(beta, int | float):
        raise ValueError(f"beta must be a static Python float, got {beta!r}")
    if beta != 0 and ref_logp_MC is None:
        raise ValueError(f"beta={beta} needs ref_logp_MC (pass beta=0.0 to skip the KL term)")
    if loss_type == "dr_grpo" and (max_completion_len is None or max_completion_len < 1):
        raise ValueError(
            f'loss_type="dr_grpo" needs max_completion_len >= 1, got {max_completion_len!r}'
        )


def policy_loss(
    logp_MC: jax.Array,
    old_logp_MC: jax.Array,
    ref_logp_MC: jax.Array | None,
    adv_M: jax.Array,
    mask_MC: jax.Array,
    *,
    loss_type: str = "token_mean",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.04,
    max_completion_len: int | None = None,
    behav_logp_MC: jax.Array | None = None,
    tis_cap: float = 0.0,
    cispo_cap: float = 5.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate plus k3 KL, aggregated by loss_type; returns (loss, metrics).

    Per token: ratio = exp(logp - old); pg = -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A);
    kl = exp(ref - logp) - (ref - logp) - 1, added as beta * kl. old_logp and ref_logp get no
    gradient (with mu = 1 pass old_logp_MC = logp_MC: the ratio is 1, its gradient is not).
    beta == 0 (static) skips the KL term and never touches ref_logp_MC (it may be None); the "kl"
    metric is then 0.

    loss_type: "token_mean" (released CPPO code: sum over masked tokens / their count),
    "seq_mean" (mean per sequence, then over sequences), "dr_grpo" (sum / (M * max_completion_len)).
    Two other objectives replace the token ratio's surrogate (docs/concepts.md, "GSPO and CISPO"):
    "gspo" (Zheng et al. 2025): one ratio per sequence, s = exp(masked mean of logp - old), the
    term -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A) per sequence, put on each of its tokens and
    averaged as seq_mean (so the loss is the mean of the sequences' terms, as TRL's
    importance_sampling_level="sequence"); "cispo" (MiniMax-M1, Chen et al. 2025): the term
    -sg(min(ratio, cispo_cap)) A logp per token, no token dropped by a clip, averaged as token_mean;
    cispo_cap (static) may be inf (the plain importance-sampled policy gradient).
    Micro-batched, token_mean is DAPO's token-level mean over the whole batch (`step._grads` weighs
    each micro-batch by its share of the tokens). Empty masks give a zero loss, never a division by
    zero.
    Metrics (masked token means): loss, kl, clip_ratio/low_mean (ratio < 1 - eps_low, A < 0),
    clip_ratio/high_mean (ratio > 1 + eps_high, A > 0), clip_ratio/region_mean (either), ratio/mean and
    ratio/abs_dev_mean (mean |ratio - 1|: how far the policy is from the one that sampled).

    tis_cap > 0 (static) turns on truncated importance sampling: each token's pg term (not the KL
    term) is multiplied by `tis_weights(old_logp_MC, behav_logp_MC, mask_MC, tis_cap)`, behav_logp_MC
    being the log-probs of the policy that really sampled the tokens; metrics tis/weight_mean (masked
    mean weight) and tis/clipped_frac (masked tokens with pi_old / pi_behav > tis_cap). tis_cap = 0
    leaves the program as it was (behav_logp_MC is not read).
    """
    _check_loss_args(loss_type, beta, ref_logp_MC, max_completion_len)
    if isinstance(tis_cap, bool) or not isinstance(tis_cap, int | float) or not tis_cap >= 0:
        raise ValueError(f"tis_cap must be a static Python float >= 0 (0: off), got {tis_cap!r}")
    if tis_cap and behav_logp_MC is None:
        raise ValueError(
            f"tis_cap={tis_cap} needs behav_logp_MC (pass tis_cap=0.0 to turn TIS off)"
        )
    dtype = logp_MC.dtype
    mask_MC = mask_MC.astype(dtype)
    adv_M1 = adv_M.astype(dtype)[:, None]
    old_logp_MC = jax.lax.stop_gradient(old_logp_MC)

    if loss_type == "cispo" and not cispo_cap > 0:
        raise ValueError(
            f"cispo_cap must be a static Python float > 0 (inf: no cap), got {cispo_cap!r}"
        )

    ratio_MC, per_token_MC = _surrogate(
        logp_MC, old_logp_MC, adv_M1, mask_MC, loss_type, eps_low, eps_high, cispo_cap
    )
    if tis_cap:
        tis_MC = tis_weights(old_logp_MC, behav_logp_MC, mask_MC, tis_cap)
        per_token_MC = tis_MC * per_token_MC
    if beta != 0:
        delta_MC = jax.lax.stop_gradient(ref_logp_MC) - logp_MC
        kl_MC = jnp.exp(delta_MC) - delta_MC - 1
        per_token_MC = per_token_MC + beta * kl_MC
        kl = _masked_mean(jax.lax.stop_gradient(kl_MC), mask_MC)
    else:
        kl = jnp.zeros((), dtype)

    loss = _aggregate(per_token_MC, mask_MC, loss_type, max_completion_len)

    ratio_MC = jax.lax.stop_gradient(ratio_MC)
    if loss_type == "cispo":  # no clip region: "high" counts the tokens whose weight is capped
        low_MC = jnp.zeros_like(ratio_MC)
        high_MC = (ratio_MC > cispo_cap).astype(dtype)
    else:
        low_MC = ((ratio_MC < 1 - eps_low) & (adv_M1 < 0)).astype(dtype)
        high_MC = ((ratio_MC > 1 + eps_high) & (adv_M1 > 0)).astype(dtype)
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "kl": kl,
        "clip_ratio/low_mean": _masked_mean(low_MC, mask_MC),
        "clip_ratio/high_mean": _masked_mean(high_MC, mask_MC),
        "clip_ratio/region_mean": _masked_mean(jnp.maximum(low_MC, high_MC), mask_MC),
        "ratio/mean": _masked_mean(ratio_MC, mask_MC),
        "ratio/abs_dev_mean": _masked_mean(jnp.abs(ratio_MC - 1), mask_MC),
    }
    if tis_cap:
        is_ratio_MC = jnp.exp(old_logp_MC - jax.lax.stop_gradient(behav_logp_MC).astype(dtype))
        metrics["tis/weight_mean"] = _masked_mean(tis_MC, mask_MC)
        metrics["tis/clipped_frac"] = _masked_mean((is_ratio_MC > tis_cap).astype(dtype), mask_MC)
    return loss, metrics


def _surrogate(logp_MC, old_logp_MC, adv_M1, mask_MC, loss_type, eps_low, eps_high, cispo_cap):
    """(ratio_MC, pg_MC): the importance ratio each token's terms use (GSPO: its sequence's, on
    every token) and each token's policy-gradient term, by loss_type (see `policy_loss`)."""
    if loss_type == "gspo":
        count_M = jnp.maximum(jnp.sum(mask_MC, axis=1), 1.0)
        log_s_M = jnp.sum((logp_MC - old_logp_MC) * mask_MC, axis=1) / count_M
        s_M1 = jnp.exp(log_s_M)[:, None]
        clipped_M1 = jnp.clip(s_M1, 1 - eps_low, 1 + eps_high)
        pg_M1 = -jnp.minimum(s_M1 * adv_M1, clipped_M1 * adv_M1)
        return jnp.broadcast_to(s_M1, logp_MC.shape), jnp.broadcast_to(pg_M1, logp_MC.shape)
    ratio_MC = jnp.exp(logp_MC - old_logp_MC)
    if loss_type == "cispo":
        weight_MC = jax.lax.stop_gradient(jnp.minimum(ratio_MC, cispo_cap))
        return ratio_MC, -weight_MC * adv_M1 * logp_MC
    clipped_MC = jnp.clip(ratio_MC, 1 - eps_low, 1 + eps_high)
    return ratio_MC, -jnp.minimum(ratio_MC * adv_M1, clipped_MC * adv_M1)


def tis_weights(
    old_logp_MC: jax.Array, behav_logp_MC: jax.Array, mask_MC: jax.Array, cap: float
) -> jax.Array:
    """w_MC = min(pi_old / pi_behav, cap) per token, 0 off the mask; no gradient flows through it.

    Truncated importance sampling (Yao et al. 2025): the tokens were sampled by a behaviour policy
    (the rollout engine, or a stale snapshot) other than the old policy of the PPO ratio; weighting each
    token's policy-gradient term by w corrects the expectation, and the cap bounds its variance: a token
    the sampler under-rated (w > 1) is weighted up, never beyond cap. cap may be inf (plain IS).
    """
    log_ratio_MC = jax.lax.stop_gradient(old_logp_MC - behav_logp_MC.astype(old_logp_MC.dtype))
    w_MC = jnp.minimum(jnp.exp(log_ratio_MC), cap)
    return jnp.where(mask_MC > 0, w_MC, 0.0).astype(old_logp_MC.dtype)
