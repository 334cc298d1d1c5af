"""The run configuration: typed, frozen dataclasses, each section validated when it is built.

`Config` holds one section per concern (model, data, rollout, cppo, reward, optim, mesh, trainer, eval,
logging). Every value a user can get wrong is checked in its section's `__post_init__`, and the error
(`ConfigError`) names the key, the value and what is allowed. The allowed values of the choice keys are
the constants below, which the modules that act on them import (one list each). Config files, overrides
and `config.json` are read and written by `cppo_jax.config_io`. Host code: imports no JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re
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
# cppo.metric: what is pruned
METRICS = ("smallest", "largest", "random", "max_variance", "proportional", "dppo")
GROUP_METRICS = ("max_variance", "proportional", "dppo")  # rules within each question's group only
SCOPES = ("question", "slice", "batch")  # cppo.scope: over what the top-k runs
# Names that changed, still read (with a FutureWarning): a saved config.json or an old override keeps working.
RENAMED_KEYS = {"cppo.processes": "cppo.slices"}  # key -> its name now
RENAMED_SCOPES = {"process": "slice"}  # cppo.scope value -> its name now
ADV_SCALES = ("group", "batch", "none")
LOSS_TYPES = ("token_mean", "seq_mean", "dr_grpo")
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


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    """Architecture of a randomly initialised model (used when `model.path` is empty)."""

    arch: str = "qwen2"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 512

    def __post_init__(self):
        _choice("model.arch.arch", self.arch, ARCHS)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            _check(getattr(self, name) > 0, f"model.arch.{name}", getattr(self, name), "> 0")
        _check(
            self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            "model.arch.num_kv_heads",
            self.num_kv_heads,
            f"a positive divisor of num_heads={self.num_heads}",
        )


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the decoder's projections: W x + (alpha / rank) B A x, the base W
    frozen and only A [in, rank], B [rank, out] (B zero at the start) trained. `enabled=false`
    (default): full fine-tuning. The rank is also checked against each target's width when the
    model is built (`models.lora.check`)."""

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS  # any of LORA_TARGETS
    dropout: float = 0.0  # only 0 (the RL peers' setting): the forward is deterministic

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        _check(
            isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank > 0,
            "model.lora.rank",
            self.rank,
            "a positive integer",
        )
        _check(self.alpha > 0, "model.lora.alpha", self.alpha, "> 0")
        _check(self.dropout == 0, "model.lora.dropout", self.dropout, "0 (no dropout)")
        for t in self.targets:
            _choice("model.lora.targets", t, LORA_TARGETS)
        _check(
            len(self.targets) > 0 and len(set(self.targets)) == len(self.targets),
            "model.lora.targets",
            self.targets,
            "a non-empty list without repeats",
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # a local Hugging Face folder; never a hub name (nothing is downloaded)
    tokenizer: str = ""  # defaults to `path`
    init_checkpoint: str = ""  # a warm-start HF folder to start the policy (and reference) from
    warm_start: str = ""  # an SFT config file that creates `init_checkpoint` when it is missing
    arch: ArchConfig = ArchConfig()
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    remat: str | bool = (
        "dots_saveable"  # REMAT_POLICIES; a boolean: true = full, false = dots_saveable
    )
    scan_layers: bool = True  # layers under one lax.scan (compiled once); false: unrolled
    # The sampler's cached steps always use einsum; xla is jax.nn.dot_product_attention anywhere.
    attention: str = "einsum"  # einsum (ours), cudnn (GPU kernel, bf16), splash (TPU), xla
    lora: LoraConfig = LoraConfig()  # low-rank adapters on a frozen base (off by default)

    def __post_init__(self):
        _choice("model.dtype", self.dtype, DTYPES)
        _choice("model.param_dtype", self.param_dtype, DTYPES)
        _choice("model.attention", self.attention, ATTENTION_KINDS)
        object.__setattr__(self, "remat", remat_policy(self.remat))
        _choice("model.remat", self.remat, REMAT_POLICIES)
        if self.attention == "cudnn" and self.dtype != "bfloat16":
            raise ConfigError(
                f"model.attention=cudnn needs model.dtype=bfloat16 (cuDNN's fused attention takes "
                f"16-bit inputs), got model.dtype={self.dtype}"
            )

    @property
    def start_folder(self) -> str:
        """The folder the policy (and the reference) start from: `init_checkpoint`, else `path`."""
        return self.init_checkpoint or self.path

    @property
    def tokenizer_folder(self) -> str:
        return self.tokenizer or self.start_folder


@dataclasses.dataclass(frozen=True)
class DataConfig:
    task: str = "arith"  # which prompt, reward and answer format
    train: str = (
        "arith"  # shipped name ("arith", "gsm8k", "math500", ...) or a local jsonl/parquet path
    )
    test: str = "arith"
    split_train: str = "train"
    split_test: str = "test"
    num_train: int = 20000  # arith only: generated training problems
    num_test: int = 256  # arith only: generated held-out problems
    val_size: int = 0  # questions held out of train for in-training validation
    max_prompt_len: int = 64
    system_prompt: str | None = None  # None: the task's own (cppo_jax/tasks/prompts.py); "": none
    prompt_format: str = "chat"  # "chat": the tokenizer's chat template; "plain": no template
    long_prompts: str = "truncate"  # or "reject"
    bad_rows: str = "skip"  # or "error"
    question_field: str = ""  # a user file's question column ("": the task's, question or problem)
    answer_field: str = ""  # its answer column ("": the task's, answer or solution)
    answer_format: str = "auto"  # how the gold answer sits in it (ANSWER_FORMATS)
    shuffle: bool = True
    seed: int = 0
    skip_zero_variance: bool = False  # GRESO: skip questions whose rewards kept zero variance
    skip_p_init: float = 0.5  # initial p_easy = p_hard (rolled out with probability p^z)
    skip_target: float = 0.25  # target zero-variance share of the step's questions
    skip_delta_p: float = 0.01  # step of p's adaptation, and p's floor

    def __post_init__(self):
        _choice("data.task", self.task, TASKS)
        for key in ("skip_p_init", "skip_target", "skip_delta_p"):
            _check(0 < getattr(self, key) <= 1, f"data.{key}", getattr(self, key), "in (0, 1]")
        _choice("data.answer_format", self.answer_format, ANSWER_FORMATS)
        _choice("data.long_prompts", self.long_prompts, ("truncate", "reject"))
        _choice("data.prompt_format", self.prompt_format, PROMPT_FORMATS)
        _choice("data.bad_rows", self.bad_rows, ("skip", "error"))
        _check(self.max_prompt_len > 0, "data.max_prompt_len", self.max_prompt_len, "> 0")
        _check(self.num_train > 0, "data.num_train", self.num_train, "> 0")
        _check(self.num_test > 0, "data.num_test", self.num_test, "> 0")
        _check(self.val_size >= 0, "data.val_size", self.val_size, ">= 0")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    backend: str = "embedded"  # or "vllm"
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    vllm_url: str = ""
    vllm_api_key: str = ""
    weights_dir: str = (
        ""  # push folder both read; relative: inside the run folder; default: <run>/weights
    )
    push_every: int = 1
    timeout_s: float = 600.0
    probe_tol: float = (
        0.0  # max |log-prob difference| server vs trainer after a push; 0: derived from the dtype
    )
    overlap: int = 0
    weight_sync: str = "auto"
    full_push_every: int = 10

    def __post_init__(self):
        _choice("rollout.backend", self.backend, BACKENDS)
        _choice("rollout.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        _check(self.full_push_every >= 1, "rollout.full_push_every", self.full_push_every, ">= 1")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", self.max_new_tokens, "> 0")
        _check(self.temperature >= 0, "rollout.temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k", self.top_k, ">= 0 (0 is off)")
        _check(self.push_every >= 1, "rollout.push_every", self.push_every, ">= 1")
        _check(self.probe_tol >= 0, "rollout.probe_tol", self.probe_tol, ">= 0 (0: from the dtype)")
        _check(
            self.temperature <= 2 or self.backend != "vllm",
            "rollout.temperature",
            self.temperature,
            "<= 2 with the vLLM backend",
        )
        _check(self.overlap in (0, 1), "rollout.overlap", self.overlap, "0 or 1")
        if self.backend == "vllm":
            _check(
                bool(self.vllm_url), "rollout.vllm_url", self.vllm_url, "a URL when backend='vllm'"
            )


@dataclasses.dataclass(frozen=True)
class CPPOConfig:
    """The algorithm: GRPO plus completion pruning (p = 0 is plain GRPO)."""

    num_generations: int = 16  # G
    questions_per_step: int = 4  # b: questions per step of plain GRPO
    pruning_rate: float = 0.0  # p
    allocation: bool = False  # draw floor(b / (1 - p)) questions
    metric: str = (
        "smallest"  # drop the smallest |A|; "max_variance": PODS; "largest", "random": ablations
    )
    scope: str = "question"  # "question" (the paper), "slice" (the TRL fork), "batch" (verl)
    slices: int = 1  # scope="slice": contiguous slices of the step, each ranked separately
    adv_scale: str = "group"  # "batch" or "none" (Dr. GRPO)
    adv_eps: float = 1e-4
    mu: int = 1  # policy updates per generation
    beta: float = 0.04
    eps_low: float = 0.2
    eps_high: float = 0.2
    loss_type: str = "token_mean"
    mask_truncated: bool = False
    filter_groups: bool = False  # train the groups with reward variance first (DAPO, static)
    filter_oversample: float = 2.0  # filter_groups: roll out floor(this * trained) questions
    tis_cap: float = 0.0  # truncated importance sampling: cap of pi_old / pi_sampler; 0: off
    prompt_rate: float = 0.0  # metric="dppo": DPPO's r_q, the rolled-out questions not trained

    def __post_init__(self):
        _check(self.num_generations >= 2, "cppo.num_generations", self.num_generations, ">= 2")
        _check(
            self.questions_per_step >= 1, "cppo.questions_per_step", self.questions_per_step, ">= 1"
        )
        _check(0 <= self.pruning_rate < 1, "cppo.pruning_rate", self.pruning_rate, "in [0, 1)")
        _choice("cppo.metric", self.metric, METRICS)
        if self.scope in RENAMED_SCOPES:
            renamed(f"cppo.scope={self.scope}", f"cppo.scope={RENAMED_SCOPES[self.scope]}")
            object.__setattr__(self, "scope", RENAMED_SCOPES[self.scope])
        _choice("cppo.scope", self.scope, SCOPES)
        if self.metric in GROUP_METRICS and self.scope != "question":
            raise ConfigError(
                f"config key 'cppo.metric' = {self.metric!r} selects within each question's group: "
                f"it needs cppo.scope='question', not {self.scope!r}"
            )
        _check(
            self.filter_oversample >= 1, "cppo.filter_oversample", self.filter_oversample, ">= 1"
        )
        _check(self.slices >= 1, "cppo.slices", self.slices, ">= 1")
        _check(0 <= self.prompt_rate < 1, "cppo.prompt_rate", self.prompt_rate, "in [0, 1)")
        if self.prompt_rate and self.metric != "dppo":
            raise ConfigError(
                f"config key 'cppo.prompt_rate' = {self.prompt_rate} prunes questions by DPPO's "
                f"rule: it needs cppo.metric='dppo', not {self.metric!r}"
            )
        if self.metric == "dppo" and self.filter_groups:
            raise ConfigError(
                "config key 'cppo.filter_groups' = True is refused with cppo.metric='dppo': its "
                "deterministic choice of groups would bias DPPO's estimator (DPPO never trains a "
                "zero-variance group when it prunes questions: use cppo.prompt_rate instead)"
            )
        _choice("cppo.adv_scale", self.adv_scale, ADV_SCALES)
        if self.loss_type == "dapo":
            raise ConfigError(
                "config key 'cppo.loss_type' = 'dapo' is no longer accepted: it computed exactly "
                "'token_mean' (tokens averaged over the whole batch, micro-batches included); for "
                "DAPO use cppo.loss_type=token_mean with cppo.eps_high=0.28 (clip-higher), and "
                "cppo.mask_truncated=true (overlong filtering) and cppo.filter_groups=true "
                "(dynamic sampling) as wanted"
            )
        _choice("cppo.loss_type", self.loss_type, LOSS_TYPES)
        if self.loss_type == "dr_grpo" and self.adv_scale != "none":
            raise ConfigError(
                f"config key 'cppo.loss_type' = 'dr_grpo' needs cppo.adv_scale='none', got "
                f"cppo.adv_scale={self.adv_scale!r}: Dr. GRPO's advantages are r - mean, without "
                "the std normalisation; set cppo.adv_scale=none"
            )
        _check(self.adv_eps > 0, "cppo.adv_eps", self.adv_eps, "> 0")
        _check(self.mu >= 1, "cppo.mu", self.mu, ">= 1")
        _check(self.beta >= 0, "cppo.beta", self.beta, ">= 0")
        _check(0 <= self.eps_low < 1, "cppo.eps_low", self.eps_low, "in [0, 1)")
        _check(self.eps_high >= 0, "cppo.eps_high", self.eps_high, ">= 0")
        _check(
            self.tis_cap == 0 or 1 <= self.tis_cap < math.inf,
            "cppo.tis_cap",
            self.tis_cap,
            "0 (off) or a finite number >= 1",
        )


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    funcs: tuple[str, ...] = ("arith_accuracy", "arith_format")
    weights: tuple[float, ...] = (1.0, 1.0)
    timeout_s: float = 5.0
    num_workers: int = 2

    def __post_init__(self):
        _check(len(self.funcs) > 0, "reward.funcs", self.funcs, "at least one reward function")
        _check(
            len(self.weights) == len(self.funcs),
            "reward.weights",
            self.weights,
            f"one weight per reward function ({len(self.funcs)})",
        )
        _check(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "> 0")
        _check(
            self.num_workers >= 0, "reward.num_workers", self.num_workers, ">= 0 (0: in-process)"
        )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    schedule: str = "cosine"
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    allow_bf16_underflow: bool = False  # bf16 params at lr < BF16_MIN_LR (see Config.__post_init__)

    def __post_init__(self):
        _check(self.lr > 0, "optim.lr", self.lr, "> 0")
        _choice("optim.schedule", self.schedule, SCHEDULES)
        _check(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", self.warmup_ratio, "in [0, 1)")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, ">= 0 (0 is off)")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Axis sizes of the device mesh; -1 means "the rest of the devices"."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        for name, size in zip(("data", "fsdp", "tensor"), sizes):
            _check(size == -1 or size >= 1, f"mesh.{name}", size, ">= 1 or -1 (the rest)")
        _check(sizes.count(-1) <= 1, "mesh", sizes, "at most one axis of size -1")

    def sizes(self, num_devices: int) -> dict[str, int]:
        """The axis sizes on `num_devices` devices, -1 resolved to the rest (what the mesh of a run
        and of a plan get); a `ConfigError` naming the keys when they do not fit the devices."""
        sizes = dataclasses.asdict(self)  # axis name -> size, in the mesh's order
        fixed = math.prod(v for v in sizes.values() if v != -1)
        given = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items())
        if -1 in sizes.values():
            if num_devices % fixed:
                raise ConfigError(
                    f"{given}: the fixed axes ({fixed} devices) do not divide the {num_devices} "
                    f"devices; choose mesh sizes whose product divides {num_devices}"
                )
            return {k: (num_devices // fixed if v == -1 else v) for k, v in sizes.items()}
        if fixed != num_devices:
            raise ConfigError(
                f"{given} = {fixed} devices, but there are {num_devices}; set the sizes so their "
                f"product is {num_devices} (one of them may be -1: the rest)"
            )
        return sizes


MESH_AXES = tuple(f.name for f in dataclasses.fields(MeshConfig))  # the mesh's axes, in order

_REMOTE_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # gs://, s3://, hdfs://, file://, ...


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    steps: int = 0  # 0: one pass over the training questions
    seed: int = 0
    out_dir: str = "runs"
    run_name: str = "run"
    resume: bool = False
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    log_every: int = 1
    eval_every: int = 0  # 0: only before and after training
    eval_size: int = 0  # 0: the whole test split
    micro_batch: int = 0  # sequences per forward/backward; 0: all kept sequences at once
    # Packed rows (cppo_jax/packing.py): the kept sequences' real tokens placed into pack_rows rows
    # of pack_len tokens (first-fit decreasing), one segment each; static per run.
    pack: bool = False
    pack_rows: int = 0  # 0: the kept sequences M (always fits, no saving); set it to gain
    pack_len: int = 0  # 0: P + C (any sequence fits)
    max_nan_streak: int = 3
    dry_run: bool = False
    profile_steps: tuple[int, ...] = ()
    # Persistent XLA compilation cache: "auto" ($JAX_COMPILATION_CACHE_DIR when set, else
    # ~/.cache/cppo_jax/xla), a folder, or "none". A repeated or resumed run skips its compiles.
    compile_cache_dir: str = "auto"

    def __post_init__(self):
        _check(self.steps >= 0, "trainer.steps", self.steps, ">= 0")
        _check(
            not _REMOTE_URL.match(self.out_dir),
            "trainer.out_dir",
            self.out_dir,
            "a folder path; remote URLs (gs://, s3://, ...) are not written to: mount the bucket "
            "(e.g. gcsfuse, s3fs) and give the mount's path",
        )
        _check(bool(self.run_name), "trainer.run_name", self.run_name, "a non-empty name")
        _check(
            "/" not in self.run_name and ".." not in self.run_name,
            "trainer.run_name",
            self.run_name,
            "a plain folder name (no '/' or '..')",
        )
        _check(
            self.keep_checkpoints >= 1, "trainer.keep_checkpoints", self.keep_checkpoints, ">= 1"
        )
        _check(self.log_every >= 1, "trainer.log_every", self.log_every, ">= 1")
        _check(self.micro_batch >= 0, "trainer.micro_batch", self.micro_batch, ">= 0")
        _check(self.pack_rows >= 0, "trainer.pack_rows", self.pack_rows, ">= 0")
        _check(
            self.pack_len in (0,) or self.pack_len >= 2,
            "trainer.pack_len",
            self.pack_len,
            "0 or >= 2",
        )
        _check(
            not (self.pack and self.micro_batch),
            "trainer.micro_batch",
            self.micro_batch,
            "0 with trainer.pack=true (all kept sequences are packed into one forward)",
        )
        _check(self.max_nan_streak >= 1, "trainer.max_nan_streak", self.max_nan_streak, ">= 1")
        _check(
            len(self.profile_steps) in (0, 2),
            "trainer.profile_steps",
            self.profile_steps,
            "[] or [first, last]",
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    rule: str = (
        "strict"  # the headline accuracy: "released" (spec section 4) or "strict" (reward > 0)
    )
    samples: int = (
        0  # python -m cppo_jax.evaluate: completions per question (0: each benchmark's own)
    )
    temperature: float | None = None  # its sampling temperature (None: each benchmark's own)
    top_p: float | None = None  # its top-p (None: each benchmark's own)

    def __post_init__(self):
        _choice("eval.rule", self.rule, EVAL_RULES)
        _check(self.samples >= 0, "eval.samples", self.samples, ">= 0")
        t, p = self.temperature, self.top_p
        _check(t is None or t >= 0, "eval.temperature", t, "None or >= 0")
        _check(p is None or 0 < p <= 1, "eval.top_p", p, "None or in (0, 1]")


WANDB_MODES = ("online", "offline")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True
    tensorboard: bool = True
    samples_per_log: int = 2
    plot: bool = True
    wandb: bool = False  # Weights & Biases (pip install wandb): metrics and evaluations
    wandb_project: str = "cppo_jax"
    wandb_entity: str | None = None  # None: the account's default
    wandb_mode: str = "online"  # or "offline": written under the run folder, `wandb sync` later

    def __post_init__(self):
        _choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)
        _check(bool(self.wandb_project), "logging.wandb_project", self.wandb_project, "a name")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    cppo: CPPOConfig = CPPOConfig()
    reward: RewardConfig = RewardConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()

    def __post_init__(self):
        lr, bf16 = self.optim.lr, self.model.param_dtype == "bfloat16"
        if bf16 and lr < BF16_MIN_LR and not self.optim.allow_bf16_underflow:
            raise ConfigError(
                f"config key 'optim.lr' = {lr!r} is too small for model.param_dtype=bfloat16: "
                f"a bf16 weight of magnitude {BF16_TYPICAL_WEIGHT} is stored to a spacing of "
                f"{BF16_TYPICAL_WEIGHT} x 2^-8 or more, and AdamW's update of about lr per step "
                f"is under half of it (lr < {BF16_MIN_LR:.2g}), so it rounds away and training "
                "changes nothing; use model.param_dtype=float32, or optim.lr >= "
                f"{BF16_MIN_LR:.2g}, or set optim.allow_bf16_underflow=true to train anyway"
            )
        if self.rollout.overlap and self.rollout.backend == "embedded":
            raise ConfigError(
                "config key 'rollout.overlap' = 1 is invalid with rollout.backend='embedded': "
                "the embedded sampler runs on the training devices, so there is nothing to overlap; "
                "use rollout.backend='vllm' or rollout.overlap=0"
            )
        if self.trainer.pack and self.model.lora.enabled:
            raise ConfigError(
                "config key 'trainer.pack' = True is not supported with model.lora.enabled=true "
                "yet (the packed forward takes no frozen base); set trainer.pack=false or "
                "model.lora.enabled=false"
            )
        r = self.rollout
        if self.cppo.tis_cap and r.backend == "vllm" and not r.overlap and r.temperature != 1:
            raise ConfigError(
                f"config key 'cppo.tis_cap' = {self.cppo.tis_cap!r} needs rollout.temperature=1 with "
                f"rollout.backend='vllm' (got {r.temperature!r}): the server returns log-probs before "
                "temperature, so they are not the sampling policy's; or use rollout.overlap=1, where "
                "the trainer computes them itself"
            )
