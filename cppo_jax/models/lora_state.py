"""A LoRA model split into its adapters (trained) and its frozen base, and merged back into plain
weights: what the trainer, the sampler and the exports need of `models.lora`'s adapters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.config.model import LoraConfig
from cppo_jax.models.lora import WEIGHTS, check, names
from cppo_jax.models.transformer import Transformer, init_adapter_value


def transformer_config(cfg, lora: LoraConfig):
    """`cfg` (a TransformerConfig) with `lora`'s adapters (checked against its widths)."""
    check(lora, cfg)
    return dataclasses.replace(
        cfg, lora_rank=lora.rank, lora_alpha=float(lora.alpha), lora_targets=tuple(lora.targets)
    )


def with_adapters(base_model, lora: LoraConfig, seed: int = 0):
    """A model holding `base_model`'s weights (the same arrays) and fresh adapters (B = 0)."""
    cfg = transformer_config(base_model.cfg, lora)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, adapters, _ = nnx.split(abstract, nnx.LoRAParam, ...)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(adapters):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        flat.append((path, var.replace(jnp.asarray(init_adapter_value(path, shape, rng), dtype))))
    _, base_state = nnx.split(base_model)
    return nnx.merge(graphdef, nnx.from_flat_state(flat), base_state)


def split(model):
    """(graphdef, adapters, base): the trained adapters and the frozen rest, a state with the
    paths of the model without adapters; `nnx.merge(graphdef, adapters, base)` is `model`."""
    return nnx.split(model, nnx.LoRAParam, ...)


def base_graphdef(cfg) -> nnx.GraphDef:
    """The graphdef of `cfg`'s model without adapters (the base's forward: adapters off)."""
    plain = dataclasses.replace(cfg, lora_rank=0, lora_alpha=16.0, lora_targets=())
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(plain, rngs=nnx.Rngs(0))))
    return graphdef


def merge_weights(adapters, base, cfg):
    """The base state with each adapted weight replaced by W + s A B (in W's dtype): a model
    without adapters that computes the adapted one (the sampler's, the vLLM push's, an export's)."""
    scale = cfg.lora_alpha / cfg.lora_rank
    flat_a = dict(nnx.to_flat_state(adapters))
    out = []
    for path, var in nnx.to_flat_state(base):
        owner, name = path[:-1], path[-1]
        target = next((t for t, (w, _, _) in WEIGHTS.items() if w == name), None)
        a_name, b_name = names(target) if target else ("", "")
        if target is None or (*owner, a_name) not in flat_a:
            out.append((path, var))
            continue
        w = var.get_value()
        a, b = flat_a[(*owner, a_name)].get_value(), flat_a[(*owner, b_name)].get_value()
        lead = w.ndim - len(WEIGHTS[target][1]) - len(WEIGHTS[target][2])  # 1: stacked [L]
        a_x = a.reshape(*a.shape[:lead], -1, a.shape[-1]).astype(jnp.float32)
        b_x = b.reshape(*b.shape[: lead + 1], -1).astype(jnp.float32)
        ab = jnp.matmul(a_x, b_x).reshape(w.shape)
        out.append((path, var.replace((w.astype(jnp.float32) + scale * ab).astype(w.dtype))))
    return nnx.from_flat_state(out)


def cast(base, dtype):
    """`base` with its floating arrays in `dtype` (the frozen base lives in the compute dtype)."""

    def one(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(one, base)


def numpy_adapters(adapters) -> dict[tuple, np.ndarray] | None:
    """path -> host array of each adapter on process 0, None on the others (every process calls it:
    an adapter sharded over processes is gathered, as `distributed.to_main` does for exports)."""
    from cppo_jax.parallel import distributed

    flat = nnx.to_flat_state(adapters)
    arrays = distributed.to_main([v.get_value() for _, v in flat])
    if arrays is None:
        return None
    return {path: np.asarray(a) for (path, _), a in zip(flat, arrays)}
