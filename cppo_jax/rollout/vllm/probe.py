"""The probe check's trainer side: a fixed probe sequence, the trainer's log-probs of it as the server
computes them (weights cast to the serving dtype, logits rounded to it), and the tolerance a right push
stays within (`probe_tolerance`: derived from the dtype and the model's own rounding noise).

`VLLMBackend.verify` (cppo_jax/rollout/vllm/backend.py) compares the server's answer with these.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.config.schema import ConfigError
from cppo_jax.models.transformer import DTYPES, Transformer
from cppo_jax.observe.profile import KEPT_PROGRAMS

__all__ = [
    "PROBE_COMPILER_OPTIONS",
    "PROBE_EPS_FACTOR",
    "PROBE_LEN",
    "PROBE_NOISE_FACTOR",
    "default_probe_ids",
    "probe_fn",
    "probe_tolerance",
    "push_bytes",
    "serving_graphdef",
]

PROBE_LEN = 12
# The derived probe tolerance, in units of the serving dtype's machine epsilon per unit of log-prob:
# |server - trainer| <= PROBE_EPS_FACTOR[dtype] * eps(dtype) * (1 + |log-prob|). Measured on tiny Qwen2s
# (docs/vllm.md): a right push differs by at most 1.0 eps (1 + |lp|) in bfloat16 (rounding dominates) and
# 3.6 eps (1 + |lp|) in float32 (accumulation order dominates); the factors leave 3x and 9x margin.
PROBE_EPS_FACTOR = {"bfloat16": 3.0, "float32": 32.0}
# Plus, below float32, PROBE_NOISE_FACTOR x the model's own rounding noise on the probe (`probe_noise`):
# through many layers a bf16 error grows past the eps (1 + |lp|) term (a random Qwen2 after lr 1e-3
# updates: our bf16 log-probs 0.06-0.20 from float32, the server's 0.11-0.22, the two 0.31 apart, where
# 3 eps (1 + |lp|) gives 0.21); the server's noise measured at most 2.9x ours, hence 3.
PROBE_NOISE_FACTOR = 3.0


def probe_tolerance(dtype: str, want_T: np.ndarray, noise: float = 0.0) -> np.ndarray:
    """Per-position tolerance [T] for probe log-probs `want_T` computed in `dtype` on both sides.

    Two implementations of the same network in the same dtype differ by rounding: each activation and the
    logits carry a relative error of order eps(dtype), and log-softmax subtracts logits of the size of the
    log-prob, so a log-prob's error scales with eps(dtype) times (1 + its magnitude). `noise` is how far
    this model's log-probs in `dtype` are from its float32 ones (`probe_noise`): the error that layers
    amplify, which the other implementation makes too.
    """
    eps = float(jnp.finfo(DTYPES[dtype]).eps)
    derived = PROBE_EPS_FACTOR[dtype] * eps * (1.0 + np.abs(np.asarray(want_T, np.float64)))
    return derived + PROBE_NOISE_FACTOR * noise


def default_probe_ids(vocab_size: int, length: int = PROBE_LEN, seed: int = 1234) -> list[int]:
    """A fixed probe sequence: ids from a seeded generator below min(vocab, 256), which every
    byte-level tokenizer covers (vLLM rejects prompt ids its tokenizer does not know)."""
    high = min(vocab_size, 256)
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3 if high > 8 else 0, high, size=length)]


@functools.lru_cache(maxsize=KEPT_PROGRAMS)
def probe_fn(graphdef):
    """Jitted log-softmax of the model's logits on one probe row: [T] ids -> [T, V] log-probs.

    The logits are rounded to the model's compute dtype first, as vLLM's are (its lm_head runs in the
    model dtype; log-probs are taken in float32 from those logits).

    Compiled without while-loop invariant code motion (`PROBE_COMPILER_OPTIONS`): XLA:CPU computes bf16
    dots in float32, and that pass hoists the upcast of every layer's weights out of the scan over
    layers, a float32 copy of the whole model beside the bf16 one (a 1.5B model's probe needed 6.36 GB
    of temporaries, 0.60 GB of the 500M's 2.03 GB stay without it; the probe is 12 tokens, the loop's
    speed does not matter)."""

    def fn(params, ids_T):
        model = nnx.merge(graphdef, params)
        T = ids_T.shape[0]
        logits_1TV, _ = model(
            ids_T[None], jnp.arange(T, dtype=jnp.int32)[None], jnp.ones((1, T), bool)
        )
        logits_TV = logits_1TV[0].astype(model.cfg.compute_dtype).astype(jnp.float32)
        return jax.nn.log_softmax(logits_TV, axis=-1)

    return jax.jit(fn, compiler_options=PROBE_COMPILER_OPTIONS)


PROBE_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


@functools.cache
def serving_graphdef(model_cfg, dtype: str, compute: str | None = None):
    """The graph of a model of config `model_cfg` whose weights are stored and computed in `dtype`
    (what the server runs): the trainer's parameters, cast, merge into it. `compute`: compute in that
    dtype instead (weights cast layer by layer, no whole copy: the probe's float32 reference)."""
    if dtype not in DTYPES:
        raise ConfigError(
            f"the vLLM server computes in {dtype}, which the weight push cannot write and check; "
            f"allowed {sorted(DTYPES)} (launch/vllm_server.sh: VLLM_DTYPE)"
        )
    cfg = dataclasses.replace(model_cfg, dtype=compute or dtype, param_dtype=dtype, remat=False)
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]


def push_bytes(model_cfg, dtype: str) -> int:
    """Bytes of tensor data one push writes for a model of config `model_cfg` in `dtype` (the safetensors
    header, a few KB, aside): every parameter, plus the `lm_head.weight` copy of a tied embedding."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    if model_cfg.tie_word_embeddings:
        n += model_cfg.vocab_size * model_cfg.hidden_size
    return n * jnp.dtype(DTYPES[dtype]).itemsize
