"""Rotary position embeddings: the `rope_scaling` types Qwen2.5 and Llama 3.x checkpoints ship.

The math of each type follows the transformers reference (`modeling_rope_utils`) for the Llama and
Qwen2 architectures: `default`, `linear`, `dynamic` (NTK), `yarn` and `llama3`. Any other type is
refused by name. A scaling is kept as a sorted tuple of (key, value) pairs so that configs stay
hashable; `normalize_scaling` validates it once.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Per type: (required keys, optional keys with their defaults). `original_max_position_embeddings`
# defaults to the config's `max_position_embeddings`, as transformers does.
_KEYS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "linear": (("factor",), {}),
    "dynamic": (("factor",), {}),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor"),
        {"original_max_position_embeddings": None},
    ),
    "yarn": (
        ("factor",),
        {
            "original_max_position_embeddings": None,
            "attention_factor": None,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": None,
            "mscale_all_dim": None,
            "truncate": True,
        },
    ),
}
ROPE_TYPES = ("default", *_KEYS)


def normalize_scaling(scaling: Any, max_position_embeddings: int) -> tuple | None:
    """Validated `rope_scaling` as sorted (key, value) pairs with `rope_type` first; None for default.

    Accepts a Hugging Face dict (`rope_type` or the legacy `type` key) or an already normalized tuple.
    """
    if scaling is None:
        return None
    params = dict(scaling)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    params.pop("rope_theta", None)  # transformers 5 keeps the base inside `rope_parameters`
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(
            f"rope_scaling: partial_rotary_factor {partial!r} is not supported (only 1.0)"
        )
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}"
        )
    if rope_type == "default":
        if params:
            raise ValueError(
                f"rope_scaling: rope_type 'default' takes no parameters, got {sorted(params)}"
            )
        return None
    required, optional = _KEYS[rope_type]
    missing = [k for k in required if params.get(k) is None]
    unknown = sorted(set(params) - set(required) - set(optional))
    if missing or unknown:
        raise ValueError(
            f"rope_scaling {rope_type!r}: missing {missing}, unknown {unknown}; "
            f"required {list(required)}, optional {sorted(optional)}"
        )
    out: dict[str, Any] = {**optional, **{k: v for k, v in params.items() if v is not None}}
    if (
        "original_max_position_embeddings" in out
        and out["original_max_position_embeddings"] is None
    ):
        out["original_max_position_embeddings"] = max_position_embeddings
    for key, value in out.items():
        if key == "truncate":
            if not isinstance(value, bool):
                raise ValueError(f"rope_scaling: truncate must be a bool, got {value!r}")
        elif value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"rope_scaling: {key} must be a positive number, got {value!r}")
    if rope_type == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(
            f"rope_scaling: high_freq_factor {out['high_freq_factor']!r} must exceed "
            f"low_freq_factor {out['low_freq_factor']!r}"
        )
    return (("rope_type", rope_type), *sorted(out.items()))


def _base_inv_freq_K(head_dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))


def _llama3_inv_freq_K(inv_freq_K: np.ndarray, p: dict) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen_K = 2 * math.pi / inv_freq_K
    scaled_K = np.where(wavelen_K > old_len / low, inv_freq_K / factor, inv_freq_K)
    smooth_K = (old_len / wavelen_K - low) / (high - low)
    smoothed_K = (1 - smooth_K) * scaled_K / factor + smooth_K * scaled_K
    medium_K = ~(wavelen_K < old_len / high) & ~(wavelen_K > old_len / low)
    return np.where(medium_K, smoothed_K, scaled_K).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, p: dict) -> tuple[np.ndarray, float]:
    factor, old_len = p["factor"], p["original_max_position_embeddings"]
    attention_factor = p["attention_factor"]
    if attention_factor is None:
        if p["mscale"] and p["mscale_all_dim"]:
            attention_factor = _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(
                factor, p["mscale_all_dim"]
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp_K = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate_K = (1 - ramp_K).astype(np.float32)
    pos_freqs_K = theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    inv_freq_K = (1 / (factor * pos_freqs_K)) * (1 - extrapolate_K) + (
        1 / pos_freqs_K
    ) * extrapolate_K
    return inv_freq_K.astype(np.float32), float(attention_factor)


def inv_freq_and_scale(cfg, positions_BT: jax.Array | None = None) -> tuple[Any, float]:
    """Inverse frequencies [K = head_dim / 2] and the cos/sin multiplier of `cfg`'s rotary embedding.

    Only `dynamic` reads `positions_BT`: its base grows with the sequence length seen, max(position) + 1
    over the whole batch (as transformers computes it per forward), and never below
    `max_position_embeddings`.
    """
    E, theta = cfg.head_dim, cfg.rope_theta
    p = dict(cfg.rope_scaling or (("rope_type", "default"),))
    rope_type = p["rope_type"]
    if rope_type == "default":
        return _base_inv_freq_K(E, theta), 1.0
    if rope_type == "linear":
        return _base_inv_freq_K(E, theta) / np.float32(p["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq_K(_base_inv_freq_K(E, theta), p), 1.0
    if rope_type == "yarn":
        return _yarn(E, theta, p)
    # dynamic NTK: base * (factor * L / max_pos - (factor - 1)) ** (E / (E - 2)), L >= max_pos.
    max_pos, factor = cfg.max_position_embeddings, p["factor"]
    seq_len = jnp.maximum(jnp.max(positions_BT) + 1, max_pos).astype(jnp.float32)
    base = theta * (factor * seq_len / max_pos - (factor - 1)) ** (E / (E - 2))
    return 1.0 / (base ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E)), 1.0


def rope_tables(positions_BT: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [B, T, E] in float32 (Hugging Face's rotate_half layout) for `cfg`'s rotary."""
    inv_freq_K, scale = inv_freq_and_scale(cfg, positions_BT)
    angle_BTK = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_K, jnp.float32)
    angle_BTE = jnp.concatenate([angle_BTK, angle_BTK], axis=-1)
    return jnp.cos(angle_BTE) * scale, jnp.sin(angle_BTE) * scale


def apply_rope(x_BTHE: jax.Array, cos_BTE: jax.Array, sin_BTE: jax.Array) -> jax.Array:
    """Rotates each head: x * cos + rotate_half(x) * sin, computed in float32."""
    x_BTHE32 = x_BTHE.astype(jnp.float32)
    x1, x2 = jnp.split(x_BTHE32, 2, axis=-1)
    rotated_BTHE = jnp.concatenate([-x2, x1], axis=-1)
    out = x_BTHE32 * cos_BTE[:, :, None, :] + rotated_BTHE * sin_BTE[:, :, None, :]
    return out.astype(x_BTHE.dtype)
