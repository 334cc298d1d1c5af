"""Masks, memory-bounded token log-probs and the clipped GRPO/CPPO policy loss (pure, no model).

Letters: N sequences (the kept Q * K completions), C completion tokens, T tokens, D model width,
V vocabulary. Static (Python) arguments: loss_type, beta, eps_low, eps_high, max_completion_len,
chunk_size, return_entropy; everything else may be traced.

Masking truncated completions (`mask_truncated`) is the caller's choice: pass
`apply_truncation_mask(mask_NC, truncated_N(...))`, i.e. mask * (1 - truncated), to `policy_loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cppo_jax.config import LOSS_TYPES

# --------------------------------------------------------------------------- masks


def _eos_NC(completion_ids_NC: jax.Array, eos_id, valid_NC: jax.Array | None) -> jax.Array:
    """Where a completion holds an end id: `eos_id` is one id or a tuple of ids."""
    is_eos_NC = jnp.isin(completion_ids_NC, jnp.asarray(eos_id, completion_ids_NC.dtype))
    if valid_NC is not None:
        is_eos_NC = is_eos_NC & valid_NC.astype(bool)
    return is_eos_NC


def completion_mask(
    completion_ids_NC: jax.Array, eos_id, valid_NC: jax.Array | None = None
) -> jax.Array:
    """mask_NC (float32): 1 for tokens up to and including the first EOS (all tokens if none).

    With valid_NC (padding), only valid positions count as EOS and the mask is and-ed with it.
    """
    is_eos_NC = _eos_NC(completion_ids_NC, eos_id, valid_NC).astype(jnp.int32)
    eos_before_NC = jnp.cumsum(is_eos_NC, axis=1) - is_eos_NC  # EOS strictly before t
    mask_NC = eos_before_NC == 0
    if valid_NC is not None:
        mask_NC = mask_NC & valid_NC.astype(bool)
    return mask_NC.astype(jnp.float32)


def truncated_N(
    completion_ids_NC: jax.Array, eos_id, valid_NC: jax.Array | None = None
) -> jax.Array:
    """bool_N: True where a completion has no EOS (it hit the length limit)."""
    return ~jnp.any(_eos_NC(completion_ids_NC, eos_id, valid_NC), axis=1)


def apply_truncation_mask(mask_NC: jax.Array, truncated: jax.Array) -> jax.Array:
    """mask * (1 - truncated): drop every token of truncated completions (DAPO-style option)."""
    keep_N = 1 - truncated.astype(mask_NC.dtype)
    return mask_NC * keep_N[:, None]


# --------------------------------------------------------------------------- log-probs


def _check_temperature(temperature) -> None:
    if isinstance(temperature, int | float) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def token_logps_from_logits(
    logits_NTV: jax.Array, targets_NT: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """logp_NT (float32): log-softmax(logits / temperature) at the targets. For small V only."""
    _check_temperature(temperature)
    z_NTV = logits_NTV.astype(jnp.float32) / temperature
    logp_NTV = jax.nn.log_softmax(z_NTV, axis=-1)
    return jnp.take_along_axis(logp_NTV, targets_NT[..., None], axis=-1)[..., 0]


def token_entropy(logits_NTV: jax.Array, temperature: float = 1.0) -> jax.Array:
    """ent_NT (float32): entropy of softmax(logits / temperature). For small V only."""
    _check_temperature(temperature)
    z_NTV = logits_NTV.astype(jnp.float32) / temperature
    logp_NTV = jax.nn.log_softmax(z_NTV, axis=-1)
    return -jnp.sum(jnp.exp(logp_NTV) * logp_NTV, axis=-1)


def _chunk_logps(h_NcD, w_DV, t_Nc, temperature, return_entropy):
    """One chunk of tokens: the only place a [N, c, V] float32 logits block exists."""
    z_NcV = jnp.einsum("ncd,dv->ncv", h_NcD, w_DV, preferred_element_type=jnp.float32)
    z_NcV = z_NcV / temperature
    lse_Nc = jax.nn.logsumexp(z_NcV, axis=-1)
    logp_Nc = jnp.take_along_axis(z_NcV, t_Nc[..., None], axis=-1)[..., 0] - lse_Nc
    if not return_entropy:
        return logp_Nc, None
    p_NcV = jnp.exp(z_NcV - lse_Nc[..., None])
    return logp_Nc, lse_Nc - jnp.sum(p_NcV * z_NcV, axis=-1)


def token_logps_from_hidden(
    h_NTD: jax.Array,
    w_DV: jax.Array,
    targets_NT: jax.Array,
    temperature: float = 1.0,
    chunk_size: int = 128,
    return_entropy: bool = False,
):
    """logp_NT (float32) = log-softmax(h @ w / temperature) at the targets, chunked over T.

    The T axis is cut into chunks of chunk_size tokens (the last one may be shorter); a scan
    (lax.map) visits them and each chunk is rematerialised in the backward pass (jax.checkpoint),
    so forward and backward hold a few [N, chunk_size, V] float32 blocks, never [N, T, V].
    Logits are h @ w accumulated in float32 (h and w may be bfloat16). Inside: X chunks of c tokens.
    With return_entropy=True returns (logp_NT, entropy_NT), the entropy from the same chunks.
    """
    _check_temperature(temperature)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    N, T, D = h_NTD.shape
    if targets_NT.shape != (N, T):
        raise ValueError(f"targets_NT must be {(N, T)}, got {targets_NT.shape}")
    if T == 0:
        empty_NT = jnp.zeros((N, 0), jnp.float32)
        return (empty_NT, empty_NT) if return_entropy else empty_NT
    c = min(chunk_size, T)
    n_full, T_full = T // c, (T // c) * c

    def one(h_NcD, t_Nc):
        return _chunk_logps(h_NcD, w_DV, t_Nc, temperature, return_entropy)

    one = jax.checkpoint(one, prevent_cse=False)

    def per_chunk(args):
        return one(*args)

    # [N, n_full * c, D] -> [n_full, N, c, D]: chunks become the scanned axis.
    h_XNcD = h_NTD[:, :T_full].reshape(N, n_full, c, D).swapaxes(0, 1)
    t_XNc = targets_NT[:, :T_full].reshape(N, n_full, c).swapaxes(0, 1)
    logp_XNc, ent_XNc = jax.lax.map(per_chunk, (h_XNcD, t_XNc))
    logps, ents = [logp_XNc.swapaxes(0, 1).reshape(N, T_full)], []
    if return_entropy:
        ents.append(ent_XNc.swapaxes(0, 1).reshape(N, T_full))
    if T_full < T:  # the tail chunk, shorter than c
        logp_Nr, ent_Nr = one(h_NTD[:, T_full:], targets_NT[:, T_full:])
        logps.append(logp_Nr)
        ents.append(ent_Nr)
    logp_NT = jnp.concatenate(logps, axis=1) if len(logps) > 1 else logps[0]
    if not return_entropy:
        return logp_NT
    ent_NT = jnp.concatenate(ents, axis=1) if len(ents) > 1 else ents[0]
    return logp_NT, ent_NT


# --------------------------------------------------------------------------- loss


def _masked_mean(x_NT: jax.Array, mask_NT: jax.Array) -> jax.Array:
    return jnp.sum(x_NT * mask_NT) / jnp.maximum(jnp.sum(mask_NT), 1.0)


def _aggregate(per_token_NT, mask_NT, loss_type, max_completion_len, num_tokens_in_batch):
    total = jnp.sum(per_token_NT * mask_NT)
    if loss_type == "token_mean":
        return total / jnp.maximum(jnp.sum(mask_NT), 1.0)
    if loss_type == "dapo":
        n_tokens = jnp.sum(mask_NT) if num_tokens_in_batch is None else num_tokens_in_batch
        return total / jnp.maximum(n_tokens, 1.0)
    if loss_type == "seq_mean":
        per_seq_N = jnp.sum(per_token_NT * mask_NT, axis=1)
        return jnp.mean(per_seq_N / jnp.maximum(jnp.sum(mask_NT, axis=1), 1.0))
    # dr_grpo: a constant denominator, so every token weighs the same whatever the lengths.
    return total / (per_token_NT.shape[0] * max_completion_len)


def _check_loss_args(loss_type, beta, ref_logp_NT, max_completion_len) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if isinstance(beta, bool) or not isinstance(beta, int | float):
        raise ValueError(f"beta must be a static Python float, got {beta!r}")
    if beta != 0 and ref_logp_NT is None:
        raise ValueError(f"beta={beta} needs ref_logp_NT (pass beta=0.0 to skip the KL term)")
    if loss_type == "dr_grpo" and (max_completion_len is None or max_completion_len < 1):
        raise ValueError(
            f'loss_type="dr_grpo" needs max_completion_len >= 1, got {max_completion_len!r}'
        )


def policy_loss(
    logp_NT: jax.Array,
    old_logp_NT: jax.Array,
    ref_logp_NT: jax.Array | None,
    adv_N: jax.Array,
    mask_NT: jax.Array,
    *,
    loss_type: str = "token_mean",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.04,
    max_completion_len: int | None = None,
    num_tokens_in_batch: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate plus k3 KL, aggregated by loss_type; returns (loss, metrics).

    Per token: ratio = exp(logp - old); pg = -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A);
    kl = exp(ref - logp) - (ref - logp) - 1, added as beta * kl. old_logp and ref_logp get no
    gradient (with mu = 1 pass old_logp_NT = logp_NT: the ratio is 1, its gradient is not).
    beta == 0 (static) skips the KL term and never touches ref_logp_NT (it may be None); the "kl"
    metric is then 0.

    loss_type: "token_mean" (released CPPO code: sum over masked tokens / their count),
    "seq_mean" (mean per sequence, then over sequences), "dr_grpo" (sum / (N * max_completion_len)),
    "dapo" (sum / tokens of the whole batch: num_tokens_in_batch when micro-batching, else this
    call's masked tokens). Empty masks give a zero loss, never a division by zero.
    Metrics (masked token means): loss, kl, clip_ratio/low_mean (ratio < 1 - eps_low, A < 0),
    clip_ratio/high_mean (ratio > 1 + eps_high, A > 0), clip_ratio/region_mean (either), ratio/mean and
    ratio/abs_dev_mean (mean |ratio - 1|: how far the policy is from the one that sampled).
    """
    _check_loss_args(loss_type, beta, ref_logp_NT, max_completion_len)
    dtype = logp_NT.dtype
    mask_NT = mask_NT.astype(dtype)
    adv_N1 = adv_N.astype(dtype)[:, None]
    old_logp_NT = jax.lax.stop_gradient(old_logp_NT)

    ratio_NT = jnp.exp(logp_NT - old_logp_NT)
    clipped_NT = jnp.clip(ratio_NT, 1 - eps_low, 1 + eps_high)
    per_token_NT = -jnp.minimum(ratio_NT * adv_N1, clipped_NT * adv_N1)
    if beta != 0:
        delta_NT = jax.lax.stop_gradient(ref_logp_NT) - logp_NT
        kl_NT = jnp.exp(delta_NT) - delta_NT - 1
        per_token_NT = per_token_NT + beta * kl_NT
        kl = _masked_mean(jax.lax.stop_gradient(kl_NT), mask_NT)
    else:
        kl = jnp.zeros((), dtype)

    loss = _aggregate(per_token_NT, mask_NT, loss_type, max_completion_len, num_tokens_in_batch)

    ratio_NT = jax.lax.stop_gradient(ratio_NT)
    low_NT = ((ratio_NT < 1 - eps_low) & (adv_N1 < 0)).astype(dtype)
    high_NT = ((ratio_NT > 1 + eps_high) & (adv_N1 > 0)).astype(dtype)
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "kl": kl,
        "clip_ratio/low_mean": _masked_mean(low_NT, mask_NT),
        "clip_ratio/high_mean": _masked_mean(high_NT, mask_NT),
        "clip_ratio/region_mean": _masked_mean(jnp.maximum(low_NT, high_NT), mask_NT),
        "ratio/mean": _masked_mean(ratio_NT, mask_NT),
        "ratio/abs_dev_mean": _masked_mean(jnp.abs(ratio_NT - 1), mask_NT),
    }
    return loss, metrics
