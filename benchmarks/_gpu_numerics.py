"""gpu_check's numerical checks, each a row with `ok` that the check's exit status honours.

- `attention_rows`: the log-prob forward of padded rows (prompts left-padded, completions
  right-padded, as a step holds them) with each `model.attention` against the default einsum: no
  non-finite log-prob at a completion token, and the largest difference within the compute dtype's
  tolerance. A kind that cannot run here (cudnn off a GPU) is recorded with its error; on a GPU a
  cudnn that fails is a failure.
- `precision_row`: the embedded sampler's log-probs of the tokens it drew against the training
  forward's log-probs of the same tokens (one precision from sampler to loss): within the compute
  dtype's tolerance, and the on-policy importance weight exp(train - sampler) 1 within it.

Tolerances, per token: TOL_EPS bf16 roundings of the log-prob's size, TOL_EPS * eps * (1 + |logp|)
(eps of the compute dtype): both sides round the same matmuls in that dtype, in other orders. Rows
record the worst token's difference in units of its tolerance (`worst`: above 1 fails).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from cppo_jax.config.schema import CPPOConfig, OptimConfig
from cppo_jax.models.transformer import Transformer
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train import optimizer as optimizer_lib

TOL_EPS = 4
KINDS = ("einsum", "xla", "cudnn")


def worst(got: np.ndarray, ref: np.ndarray, dtype: str) -> tuple[float, float]:
    """(largest |got - ref|, largest |got - ref| / tolerance) over the tokens (see above)."""
    diff = np.abs(got - ref)
    tol = TOL_EPS * float(jnp.finfo(jnp.dtype(dtype)).eps) * (1 + np.abs(ref))
    return float(diff.max()), float((diff / tol).max())


def padded_batch(rng: np.random.Generator, rows: int, P: int, C: int, vocab: int):
    """tokens_MT, valid_MT, mask_MC: each prompt left-padded to P, each completion right-padded."""
    T = P + C
    tokens = rng.integers(1, vocab, size=(rows, T), dtype=np.int32)
    prompt_len = rng.integers(1, P + 1, size=rows)
    completion_len = rng.integers(1, C + 1, size=rows)
    pos = np.arange(T)[None]
    valid = (pos >= (P - prompt_len)[:, None]) & (pos < (P + completion_len)[:, None])
    tokens = np.where(valid, tokens, 0)
    mask = (np.arange(C)[None] < completion_len[:, None]).astype(np.float32)
    return tokens, valid, mask


def _logps_fn(graphdef, sh, temperature: float = 1.0):
    spec = step_lib.StepSpec.make(
        CPPOConfig(num_generations=sh.G, beta=0.04), sh.P, sh.C, temperature
    )
    tx = optimizer_lib.make_optimizer(OptimConfig(lr=1e-6), 1000)
    return step_lib.compiled(graphdef, tx, spec)[1]


def attention_rows(report, graphdef, params, tcfg, sh, rng, repeat: int, timed) -> None:
    """One row per kind in KINDS (see the module docstring)."""
    from flax import nnx

    tokens, valid, mask = padded_batch(rng, sh.Q * sh.G, sh.P, sh.C, tcfg.vocab_size)
    on = mask > 0
    base = None
    for kind in KINDS:
        row = {"attention": kind}
        try:
            cfg = dataclasses.replace(tcfg, attention=kind)
            gd = nnx.graphdef(nnx.eval_shape(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0))))
            start = time.perf_counter()
            logps_c = _logps_fn(gd, sh).lower(params, tokens, valid).compile()
            row["compile_s"] = time.perf_counter() - start
            row["seconds"], out = timed(logps_c, params, tokens, valid, repeat=repeat)
            out = np.asarray(out, np.float32)[on]
            row["nonfinite"] = int((~np.isfinite(out)).sum())
            base = out if base is None else base
            if kind == "einsum":
                row["max_abs_logp_diff"], row["worst"] = None, None
            else:
                row["max_abs_logp_diff"], row["worst"] = worst(out, base, tcfg.dtype)
            row["ok"] = row["nonfinite"] == 0 and (row["worst"] is None or row["worst"] <= 1)
        except Exception as err:  # recorded; a kind this machine cannot run is not a failure
            row["error"] = f"{type(err).__name__}: {err}"[:300]
            row["ok"] = not (kind == "cudnn" and jax.default_backend() == "gpu")
        report.data["attention"].append(row)
        report.save()


def precision_row(graphdef, params, tcfg, sh, prompts_QP, valid_QP, samples) -> dict:
    """The sampler's log-probs against the training forward's on the sampled tokens (see above)."""
    N = sh.Q * sh.G
    tokens = np.concatenate(
        [np.repeat(np.asarray(prompts_QP), sh.G, axis=0), np.asarray(samples.tokens_NC)], axis=1
    )
    valid_NC = np.asarray(samples.valid_NC)
    valid = np.concatenate([np.repeat(np.asarray(valid_QP), sh.G, axis=0), valid_NC], axis=1)
    train = np.asarray(_logps_fn(graphdef, sh)(params, tokens, valid), np.float32)
    sampled = np.asarray(samples.logp_NC, np.float32)
    on = valid_NC.astype(bool)
    diff, worst_tol = worst(train[on], sampled[on], tcfg.dtype)
    weight = np.exp(train - sampled)[on]
    row = {
        "sequences": N,
        "tokens": int(on.sum()),
        "max_abs_logp_diff": diff,
        "mean_logp_diff": float((train - sampled)[on].mean()),
        "worst": worst_tol,
        "max_abs_tis_weight_minus_1": float(np.abs(weight - 1).max()),
        "nonfinite": int((~np.isfinite(train[on])).sum() + (~np.isfinite(sampled[on])).sum()),
    }
    row["ok"] = row["nonfinite"] == 0 and row["worst"] <= 1
    return row
