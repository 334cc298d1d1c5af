"""Typed, frozen run configuration, dotted overrides and validation at load.

A config file is a Python module with `get_config() -> Config`. `load_config(path, overrides)` imports it,
applies `key.path=value` overrides (parsed by the field's declared type) and validates every section; any
problem raises `ConfigError` naming the key, the value and what is allowed. Host code: imports no JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

REQUIRED_PREFIX = "<required"  # a config value starting with this must be overridden before a run


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message names the culprit."""


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}' = {value!r} is invalid: allowed {allowed}")


def _choice(key: str, value: Any, options: tuple[str, ...]) -> None:
    _check(value in options, key, value, "one of " + ", ".join(repr(o) for o in options))


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
        _choice("model.arch.arch", self.arch, ("qwen2", "llama"))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            _check(getattr(self, name) > 0, f"model.arch.{name}", getattr(self, name), "> 0")
        _check(
            self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            "model.arch.num_kv_heads",
            self.num_kv_heads,
            f"a positive divisor of num_heads={self.num_heads}",
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
    remat: bool = False
    scan_layers: bool = True  # layers under one lax.scan (compiled once); false: unrolled

    def __post_init__(self):
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        _choice("model.param_dtype", self.param_dtype, ("float32", "bfloat16"))


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
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self):
        _choice("data.task", self.task, ("arith", "gsm8k", "math"))
        _choice("data.long_prompts", self.long_prompts, ("truncate", "reject"))
        _choice("data.prompt_format", self.prompt_format, ("chat", "plain"))
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

    def __post_init__(self):
        _choice("rollout.backend", self.backend, ("embedded", "vllm"))
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
    metric: str = "smallest"  # drop the smallest |A|; "largest" and "random" are ablations
    scope: str = "question"  # "question" (the paper), "process" (the TRL fork), "batch" (verl)
    processes: int = 1  # scope="process": slices of the step ranked separately
    adv_scale: str = "group"  # "batch" or "none" (Dr. GRPO)
    adv_eps: float = 1e-4
    mu: int = 1  # policy updates per generation
    beta: float = 0.04
    eps_low: float = 0.2
    eps_high: float = 0.2
    loss_type: str = "token_mean"
    mask_truncated: bool = False

    def __post_init__(self):
        _check(self.num_generations >= 2, "cppo.num_generations", self.num_generations, ">= 2")
        _check(
            self.questions_per_step >= 1, "cppo.questions_per_step", self.questions_per_step, ">= 1"
        )
        _check(0 <= self.pruning_rate < 1, "cppo.pruning_rate", self.pruning_rate, "in [0, 1)")
        _choice("cppo.metric", self.metric, ("smallest", "largest", "random"))
        _choice("cppo.scope", self.scope, ("question", "process", "batch"))
        _check(self.processes >= 1, "cppo.processes", self.processes, ">= 1")
        _choice("cppo.adv_scale", self.adv_scale, ("group", "batch", "none"))
        _choice("cppo.loss_type", self.loss_type, ("token_mean", "seq_mean", "dr_grpo", "dapo"))
        _check(self.adv_eps > 0, "cppo.adv_eps", self.adv_eps, "> 0")
        _check(self.mu >= 1, "cppo.mu", self.mu, ">= 1")
        _check(self.beta >= 0, "cppo.beta", self.beta, ">= 0")
        _check(0 <= self.eps_low < 1, "cppo.eps_low", self.eps_low, "in [0, 1)")
        _check(self.eps_high >= 0, "cppo.eps_high", self.eps_high, ">= 0")


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

    def __post_init__(self):
        _check(self.lr > 0, "optim.lr", self.lr, "> 0")
        _choice("optim.schedule", self.schedule, ("cosine", "constant", "linear"))
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

    def __post_init__(self):
        _choice("eval.rule", self.rule, ("released", "strict"))


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
        if self.rollout.overlap and self.rollout.backend == "embedded":
            raise ConfigError(
                "config key 'rollout.overlap' = 1 is invalid with rollout.backend='embedded': "
                "the embedded sampler runs on the training devices, so there is nothing to overlap; "
                "use rollout.backend='vllm' or rollout.overlap=0"
            )


# ----------------------------------------------------------------------------------------------
# Overrides, (de)serialisation, loading.


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse_scalar(key: str, text: str, tp: Any) -> Any:
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"config key '{key}' = {text!r} is invalid: allowed true or false")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(
                f"config key '{key}' = {text!r} is invalid: allowed an integer"
            ) from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(
                f"config key '{key}' = {text!r} is invalid: allowed a number"
            ) from None
    if tp is str:
        return text
    raise ConfigError(f"config key '{key}' has a type ({tp}) that overrides do not support")


def _parse_value(key: str, text: str, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if text.strip().lower() in ("none", "null"):
            return None
        return _parse_value(key, text, args[0])
    if origin is Literal:
        options = typing.get_args(tp)
        _choice(key, text, tuple(options))
        return text
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        body = text.strip()
        if body.startswith(("[", "(")) and body.endswith(("]", ")")):
            body = body[1:-1]
        items = [s.strip().strip("'\"") for s in body.split(",") if s.strip()]
        return tuple(_parse_scalar(key, s, elem) for s in items)
    return _parse_scalar(key, text, tp)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check (and gently convert) a Python value given in a config file or dict."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return _from_dict(tp, value, prefix=key + ".")
        raise ConfigError(
            f"config key '{key}' = {value!r} is invalid: allowed a {tp.__name__} section"
        )
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(key, value, args[0])
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' = {value!r} is invalid: allowed a list")
        return tuple(_coerce(key, v, elem) for v in value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (bool, int, float, str):
        if type(value) is not tp:
            raise ConfigError(
                f"config key '{key}' = {value!r} is invalid: allowed a {tp.__name__}, "
                f"got a {type(value).__name__}"
            )
        return value
    return value


def _unknown_key(key: str, name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key '{key}': known keys here are {', '.join(known)}{hint}")


def _from_dict(cls, data: dict, prefix: str = ""):
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in data.items():
        if name not in names:
            raise _unknown_key(prefix + name, name, names)
        kwargs[name] = _coerce(prefix + name, value, hints[name])
    return cls(**kwargs)


def from_dict(data: dict) -> Config:
    """Build a validated Config from a nested dict (for example a saved `config.json`)."""
    return _from_dict(Config, data)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def _set_override(cls, data: dict, key: str, text: str, prefix: str = "") -> None:
    """Set the dotted `key` in `data` (the raw fields of a `cls` section), parsed by the field's type."""
    head, _, rest = key.partition(".")
    names = [f.name for f in dataclasses.fields(cls)]
    if head not in names:
        raise _unknown_key(prefix + key, head, names)
    tp = _hints(cls)[head]
    if rest:
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(
                f"unknown config key '{prefix + key}': '{prefix + head}' is not a section"
            )
        _set_override(tp, data[head], rest, text, prefix + head + ".")
    elif dataclasses.is_dataclass(tp):
        raise ConfigError(
            f"config key '{prefix + key}' is a section; set one of its keys, e.g. {prefix + key}.x=..."
        )
    else:
        data[head] = _parse_value(prefix + key, text, tp)


def _raw(cfg) -> dict:
    """The fields of a config as nested dicts, without validating anything."""
    return {
        f.name: _raw(getattr(cfg, f.name))
        if dataclasses.is_dataclass(getattr(cfg, f.name))
        else getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
    }


def apply_overrides(cfg, overrides: list[str]):
    """Return a copy of `cfg` with every `key.path=value` set, then validated once as a whole.

    All overrides are applied before any section is validated, so their order never matters
    (`rollout.backend=vllm rollout.vllm_url=...` and `mesh.fsdp=-1 mesh.data=1` both work).
    """
    data = _raw(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is malformed: expected key.path=value")
        key, text = item.split("=", 1)
        _set_override(type(cfg), data, key.strip(), text.strip())
    return _from_dict(type(cfg), data)


def apply_override(cfg, key: str, text: str):
    """Return a copy of `cfg` with the dotted `key` set to `text`, parsed by the field's type."""
    return apply_overrides(cfg, [f"{key}={text}"])


CONFIG_DIRS = (Path("configs"), Path(__file__).resolve().parents[1] / "configs")


def resolve_config_path(path: str | Path) -> Path:
    """`path` itself when it is a file; a bare name (`math7b.py`, `math7b`) is looked up in CONFIG_DIRS."""
    path = Path(path)
    if path.is_file():
        return path
    tried = [str(path)]
    if path.parent == Path("."):
        name = path.name if path.suffix == ".py" else path.name + ".py"
        for folder in CONFIG_DIRS:
            candidate = folder / name
            if candidate.is_file():
                return candidate
            tried.append(str(candidate))
    raise ConfigError(f"config file {str(path)!r} does not exist (looked for {', '.join(tried)})")


def load_config(path: str | Path, overrides: list[str] = (), expected: type = Config):
    """Import a config file, call its `get_config()`, apply all overrides, then validate once."""
    path = resolve_config_path(path)
    spec = importlib.util.spec_from_file_location(f"_cppo_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(
            f"config file {str(path)!r} failed to load: {type(e).__name__}: {e}"
        ) from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {str(path)!r} defines no get_config()")
    cfg = module.get_config()
    expected_types = expected if isinstance(expected, tuple) else (expected,)
    if not isinstance(cfg, expected_types):
        raise ConfigError(
            f"config file {str(path)!r}: get_config() returned {type(cfg).__name__}, "
            f"expected {' or '.join(t.__name__ for t in expected_types)}"
        )
    return apply_overrides(cfg, list(overrides))


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
