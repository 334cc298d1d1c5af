"""The run configuration: typed, frozen dataclasses, each section validated when it is built.

`Config` holds one section per concern (model, data, rollout, cppo, reward, optim, mesh, trainer, eval,
logging). Every value a user can get wrong is checked in its section's `__post_init__`, and the error
(`ConfigError`) names the key, the value and what is allowed. The sections of data, rollout, cppo,
reward and optim are here; the model's are in `cppo_jax.config.model`, the mesh's, trainer's, eval's and
logging's in `cppo_jax.config.run`. The allowed values of the choice keys are the constants of
`cppo_jax.config.choices`, which the modules that act on them import (one list each). Config files,
overrides and `config.json` are read and written by `cppo_jax.config.files`. Host code: imports no JAX.
"""

from __future__ import annotations

import dataclasses
import math

from cppo_jax.config.choices import (
    ADV_SCALES,
    ANSWER_FORMATS,
    BACKENDS,
    BF16_MIN_LR,
    BF16_TYPICAL_WEIGHT,
    GROUP_METRICS,
    LORA_PUSHES,
    LOSS_TYPES,
    METRICS,
    PROMPT_FORMATS,
    RENAMED_SCOPES,
    SCHEDULES,
    SCOPES,
    TASKS,
    WEIGHT_SYNCS,
    ConfigError,
    _check,
    _choice,
    renamed,
)

# Config files (configs/*.py, the notebooks) import every section from this module, the documented way
# to write a config: the sections defined elsewhere are re-exported (`X as X`) for them.
from cppo_jax.config.model import ArchConfig as ArchConfig
from cppo_jax.config.model import LoraConfig as LoraConfig
from cppo_jax.config.model import ModelConfig
from cppo_jax.config.run import EvalConfig, LoggingConfig, MeshConfig, TrainerConfig


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
    # Reasoning models' templates (Qwen3): True / False is passed to the chat template as its
    # `enable_thinking` (False: the template closes an empty <think></think> block, so the policy
    # answers without reasoning); None: the template's own default. Other templates ignore it.
    enable_thinking: bool | None = None
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
    # The embedded sampler gathers the rows still running into ever smaller loops (0.6 of the rows
    # of the last, `rollout.segments.compact_buckets`) as rows end: the same tokens, fewer row-steps.
    compact: bool = False
    vllm_url: str = ""
    vllm_api_key: str = ""
    weights_dir: str = (
        ""  # push folder both read; relative: inside the run folder; default: <run>/weights
    )
    push_every: int = 1
    timeout_s: float = 600.0
    server_wait_s: float = 240.0
    probe_tol: float = (
        0.0  # max |log-prob difference| server vs trainer after a push; 0: derived from the dtype
    )
    overlap: int = 0
    # With overlap: how many updates a rollout may run ahead of the update that trains on it. 1: the
    # next step's, sampled from a snapshot; k >= 2: up to k steps queued, pushes land mid-rollout
    # (partial rollouts), TIS against the sampler's log-probs; older batches dropped and resampled.
    max_staleness: int = 1
    weight_sync: str = "auto"
    full_push_every: int = 10
    lora_push: str = "auto"  # model.lora with vLLM: push the adapter only, or merged weights

    def __post_init__(self):
        _choice("rollout.backend", self.backend, BACKENDS)
        _choice("rollout.weight_sync", self.weight_sync, WEIGHT_SYNCS)
        _choice("rollout.lora_push", self.lora_push, LORA_PUSHES)
        _check(self.full_push_every >= 1, "rollout.full_push_every", self.full_push_every, ">= 1")
        _check(self.max_new_tokens > 0, "rollout.max_new_tokens", self.max_new_tokens, "> 0")
        _check(self.temperature >= 0, "rollout.temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= 0, "rollout.top_k", self.top_k, ">= 0 (0 is off)")
        _check(self.push_every >= 1, "rollout.push_every", self.push_every, ">= 1")
        _check(self.server_wait_s >= 0, "rollout.server_wait_s", self.server_wait_s, ">= 0")
        _check(self.probe_tol >= 0, "rollout.probe_tol", self.probe_tol, ">= 0 (0: from the dtype)")
        _check(
            self.temperature <= 2 or self.backend != "vllm",
            "rollout.temperature",
            self.temperature,
            "<= 2 with the vLLM backend",
        )
        _check(self.overlap in (0, 1), "rollout.overlap", self.overlap, "0 or 1")
        _check(self.max_staleness >= 1, "rollout.max_staleness", self.max_staleness, ">= 1")
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
    # loss_type="cispo": the cap of its stop-gradient weight min(pi / pi_old, cap); 5.0 is the
    # ScaleRL paper's eps_max (TRL's recommendation); MiniMax-M1 sets no lower bound, nor does this
    cispo_cap: float = 5.0
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
        _check(self.cispo_cap >= 1, "cppo.cispo_cap", self.cispo_cap, ">= 1 (inf: no cap)")
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
        if r.max_staleness > 1:
            self._check_ahead()
        if (
            self.cppo.tis_cap
            and r.backend == "vllm"
            and (not r.overlap or r.max_staleness > 1)
            and r.temperature != 1
        ):
            raise ConfigError(
                f"config key 'cppo.tis_cap' = {self.cppo.tis_cap!r} needs rollout.temperature=1 with "
                f"rollout.backend='vllm' (got {r.temperature!r}): the server returns log-probs before "
                "temperature, so they are not the sampling policy's; or use rollout.overlap=1 with "
                "rollout.max_staleness=1, where the trainer computes them itself"
            )
        if r.overlap and r.max_staleness == 1 and r.push_every > 1:
            raise ConfigError(
                f"config key 'rollout.push_every' = {r.push_every} is invalid with "
                "rollout.overlap=1 and rollout.max_staleness=1: the next step is sampled by the "
                "server while its old-policy log-probs come from a snapshot of the params at the "
                "step's start, which the server holds only when every update is pushed; use "
                "rollout.push_every=1, or rollout.max_staleness >= 2 with cppo.tis_cap (the "
                "sampler's own log-probs)"
            )

    def _check_ahead(self) -> None:
        """`rollout.max_staleness` = k >= 2: rollouts queued up to k updates ahead of the update,
        corrected by TIS against the sampler's own log-probs (`logp_sources`)."""
        r, k = self.rollout, self.rollout.max_staleness
        if not r.overlap:
            raise ConfigError(
                f"config key 'rollout.max_staleness' = {k} needs rollout.overlap=1: without it "
                "every step samples from its own weights (staleness 0)"
            )
        if not self.cppo.tis_cap:
            raise ConfigError(
                f"config key 'rollout.max_staleness' = {k} needs cppo.tis_cap > 0 (e.g. 2): a "
                "rollout queued ahead may span weight updates, so no one snapshot sampled it and "
                "only TIS against the sampler's own log-probs corrects it"
            )
        if self.data.skip_zero_variance:
            raise ConfigError(
                f"config key 'rollout.max_staleness' = {k} is not supported with "
                "data.skip_zero_variance=true yet: GRESO decides a step's questions from the "
                "rewards of the step before it, which a rollout queued k steps ahead has not seen"
            )
