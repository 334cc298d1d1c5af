"""Low-rank adapters (LoRA) on the decoder's projections, and the frozen base they sit on.

A target projection y = x W (W [*in, *out], e.g. q's [D, H, E]) gets y = x W + s (x A) B with
A [*in, r], B [r, *out], s = alpha / r (PEFT's scaling), B zero at the start so the adapted model
starts as the base. The adapters are `nnx.LoRAParam`s beside their weight, stacked under [L] like the
other layer params, so they run under the same layer scan; their logical axes are the weight's input
and output names and `lora_rank` (in `sharding.RULES`: never split). Letters as in
docs/conventions.md; r is the rank.

Why not qwix's `LoraProvider`: its model surgery intercepts the dot products a module's call makes
and creates the adapters on the first call; this model's layers run as merged copies of a stacked
state inside `lax.scan`, and `apply_lora_to_model` on it fails in the surgery (qwix 0.1.8: an
`IndexError` taking layer i of a 0-dimensional array it added, scanned or unrolled). Adapters written
here are ordinary stacked params: sharded, scanned, checkpointed and exported as the rest.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from cppo_jax.config.choices import LORA_TARGETS, ConfigError
from cppo_jax.config.model import LoraConfig
from cppo_jax.models.matmul import dense

# target -> (its weight's attribute on Attention / MLP, the letters of the weight's input and
# output dims, how many leading dims are the input)
WEIGHTS = {
    "q": ("q_DHE", "D", "HE"),
    "k": ("k_DJE", "D", "JE"),
    "v": ("v_DJE", "D", "JE"),
    "o": ("o_HED", "HE", "D"),
    "gate": ("gate_DF", "D", "F"),
    "up": ("up_DF", "D", "F"),
    "down": ("down_FD", "F", "D"),
}
ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
assert set(WEIGHTS) == set(LORA_TARGETS)


def names(target: str) -> tuple[str, str]:
    """The attribute names of `target`'s A and B, e.g. ("q_a_Dr", "q_b_rHE")."""
    _, ins, outs = WEIGHTS[target]
    return f"{target}_a_{ins}r", f"{target}_b_r{outs}"


def _dims(cfg, letters: str) -> tuple[int, ...]:
    size = {
        "D": cfg.hidden_size,
        "F": cfg.intermediate_size,
        "H": cfg.num_heads,
        "J": cfg.num_kv_heads,
        "E": cfg.head_dim,
    }
    return tuple(size[c] for c in letters)


def widths(cfg) -> dict[str, tuple[int, int]]:
    """target -> (input width, output width) of its weight for a `TransformerConfig`."""
    return {
        t: (math.prod(_dims(cfg, ins)), math.prod(_dims(cfg, outs)))
        for t, (_, ins, outs) in WEIGHTS.items()
    }


def check(lora: LoraConfig, cfg) -> None:
    """`model.lora.rank` at most every target's width (a larger rank adds nothing a full-rank
    update lacks, and PEFT users expect the error), checked against the model's `cfg`."""
    w = widths(cfg)
    for t in lora.targets:
        if lora.rank > min(w[t]):
            raise ConfigError(
                f"config key 'model.lora.rank' = {lora.rank} is invalid: above the width of the "
                f"{t!r} projection ({w[t][0]} -> {w[t][1]}); allowed 1 .. {min(w[t])} for it"
            )


def add(module: nnx.Module, cfg, targets: tuple[str, ...], rngs: nnx.Rngs, layers: int) -> None:
    """Adds A (PEFT's init: uniform within +-1/sqrt(in)) and B (zeros) for each of `targets` that
    `cfg.lora_targets` names, stacked over `layers`, to `module` (an Attention or MLP)."""
    lead, lead_names = ((layers,), ("layers",)) if layers else ((), ())
    r, dtype = cfg.lora_rank, cfg.weight_dtype
    for t in targets:
        if t not in cfg.lora_targets:
            continue
        weight, ins, outs = WEIGHTS[t]
        logical = getattr(module, weight).get_metadata()["out_sharding"][len(lead) :]
        in_names, out_names = logical[: len(ins)], logical[len(ins) :]
        in_shape, out_shape = _dims(cfg, ins), _dims(cfg, outs)
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rngs.params(), (*lead, *in_shape, r), jnp.float32, -bound, bound)
        a_name, b_name = names(t)
        setattr(module, a_name, _lora_param(a.astype(dtype), (*lead_names, *in_names, "lora_rank")))
        b = jnp.zeros((*lead, r, *out_shape), dtype)
        setattr(module, b_name, _lora_param(b, (*lead_names, "lora_rank", *out_names)))


def _lora_param(value, logical: tuple[str, ...]) -> nnx.LoRAParam:
    return nnx.LoRAParam(value, out_sharding=logical, eager_sharding=False)


def delta(module: nnx.Module, target: str, x: jax.Array) -> jax.Array | None:
    """s (x A) B for `target` in x's dtype, or None when `module` has no adapter for it."""
    a_name, b_name = names(target)
    if not hasattr(module, a_name):
        return None
    cfg, dt = module.cfg, x.dtype
    n_in = len(WEIGHTS[target][1])
    xa = dense(x, getattr(module, a_name)[...].astype(dt), n_in=n_in)
    scale = jnp.asarray(cfg.lora_alpha / cfg.lora_rank, dt)
    return dense(xa, getattr(module, b_name)[...].astype(dt)) * scale


def apply(module: nnx.Module, target: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """y plus `target`'s adapter delta of input x (y itself when it has none)."""
    d = delta(module, target, x)
    return y if d is None else y + d
