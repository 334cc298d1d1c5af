"""The allowed values of the config's choice keys, and the checks that name a wrong value.

One list per choice key (the modules that act on a choice import its list from here), the names that
changed (`RENAMED_KEYS`, `RENAMED_SCOPES`), and `ConfigError` with the two checks every section's
`__post_init__` makes: `_check(cond, key, value, allowed)` and `_choice(key, value, options)`. They keep
their underscores: they are the config modules' own helpers, and tools/docs_gen.py reads their calls by
these names to list each key's allowed values. Host code: imports no JAX.
"""

from __future__ import annotations

import warnings
from typing import Any

REQUIRED_PREFIX = "<required"  # a config value starting with this must be overridden before a run

# The allowed values of the choice keys (imported by the modules that act on them).
TASKS = ("arith", "gsm8k", "math")  # data.task: prompt, rewards and answer format
ARCHS = ("qwen2", "llama")
DTYPES = ("float32", "bfloat16")
# How a whole sequence attends (models.config.TransformerConfig.attention explains each).
ATTENTION_KINDS = ("einsum", "xla", "cudnn", "splash")
# model.remat: what each decoder layer keeps for its backward pass (tools/config_meanings.py says
# what each keeps); the booleans of older configs name the two that ran before: true -> "full",
# false -> "dots_saveable".
REMAT_POLICIES = ("save_all", "full", "minimal", "dots_saveable")
PROMPT_FORMATS = ("chat", "plain")
ANSWER_FORMATS = ("auto", "boxed", "last_number", "whole")
BACKENDS = ("embedded", "vllm")
# rollout.weight_sync: how the vLLM backend pushes weights (docs/vllm.md, "Weight sync routes")
WEIGHT_SYNCS = ("auto", "file", "protocol")
# rollout.lora_push: what a LoRA run pushes to vLLM (docs/vllm.md, "LoRA runs")
LORA_PUSHES = ("auto", "adapter", "merged")
# cppo.metric: what is pruned
METRICS = ("smallest", "largest", "random", "max_variance", "proportional", "dppo")
GROUP_METRICS = ("max_variance", "proportional", "dppo")  # rules within each question's group only
SCOPES = ("question", "slice", "batch")  # cppo.scope: over what the top-k runs
# Names that changed, still read (with a FutureWarning): a saved config.json or an old override keeps working.
RENAMED_KEYS = {"cppo.processes": "cppo.slices"}  # key -> its name now
RENAMED_SCOPES = {"process": "slice"}  # cppo.scope value -> its name now
ADV_SCALES = ("group", "batch", "none")
# cppo.loss_type: the clipped token ratio averaged three ways, then GSPO's sequence ratio and
# CISPO's capped, stop-gradient token weight (cppo_jax/algo/loss.py, docs/concepts.md)
LOSS_TYPES = ("token_mean", "seq_mean", "dr_grpo", "gspo", "cispo")
# With model.param_dtype=bfloat16, the smallest optim.lr an update survives: bf16 keeps 8 significant
# bits, so a weight w is stored to a spacing of at least |w| 2^-8, and an update under half of it,
# |w| 2^-9, rounds back to w. AdamW moves each weight by about lr per step; at the magnitude of a
# typical weight (0.02: the N(0, 0.02) init of models/transformer.py and Hugging Face's
# initializer_range) a smaller lr leaves every weight of at least that size unchanged.
BF16_TYPICAL_WEIGHT = 0.02
BF16_MIN_LR = BF16_TYPICAL_WEIGHT * 2**-9  # 3.9e-5
SCHEDULES = ("cosine", "constant", "linear")
EVAL_RULES = ("released", "strict")  # eval.rule: the two accuracy rules, always both reported
# model.lora.targets: the decoder projections an adapter can be put on (attention's q, k, v, o and
# the MLP's gate, up, down; PEFT's q_proj ... down_proj).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
WANDB_MODES = ("online", "offline")  # logging.wandb_mode


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message names the culprit."""


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}' = {value!r} is invalid: allowed {allowed}")


def _choice(key: str, value: Any, options: tuple[str, ...]) -> None:
    _check(value in options, key, value, "one of " + ", ".join(repr(o) for o in options))


def renamed(old: str, new: str) -> None:
    """Say (a FutureWarning, shown by default) that `old` is read as `new`, the name it has now."""
    warnings.warn(
        f"config: {old!r} is an old name, read as {new!r}; write {new!r}",
        FutureWarning,
        stacklevel=3,
    )


def remat_policy(value: str | bool) -> str | bool:
    """`model.remat` with an older config's boolean (a file's, or an override's text) named."""
    if isinstance(value, bool) or value in ("true", "false"):
        return "full" if value in (True, "true") else "dots_saveable"
    return value


MODEL_REQUIRED = "model.path is required: a local Hugging Face folder (nothing is downloaded)"
