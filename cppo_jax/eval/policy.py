"""What an evaluation scores: the policy of a Hugging Face folder or of a training run folder.

`checkpoint_kind` tells the two apart (a run folder's config.json has the `cppo` and `model` sections and
it has `checkpoints/`); `load_policy` returns the model definition, params and tokenizer of either: a
Hugging Face folder is loaded as it is, a run folder's orbax checkpoint (the latest, or `step`) is restored
onto the model its config.json names (`model.init_checkpoint` or `model.path`). Errors name the folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import from_dict
from cppo_jax.config.schema import Config

__all__ = [
    "EvaluationError",
    "Policy",
    "checkpoint_kind",
    "find_tokenizer",
    "load_policy",
    "run_config",
]


class EvaluationError(ValueError):
    """A user error in an evaluation request (benchmark name, option); the message names it."""


@dataclasses.dataclass
class Policy:
    graphdef: Any
    params: Any
    tokenizer: Any
    kind: str  # "hf" or "run"
    path: Path
    step: int | None = None  # the restored training step (run folders)
    run_config: Config | None = None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EvaluationError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise EvaluationError(f"{path}: expected a JSON object")
    return data


def checkpoint_kind(path: str | Path) -> str:
    """ "hf" for a Hugging Face folder, "run" for a training run folder; errors name the folder."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{path} has no config.json: it is neither a Hugging Face folder (config.json + "
            f"*.safetensors) nor a training run folder (config.json + checkpoints/)"
        )
    data = _read_json(config_file)
    if "cppo" in data and "model" in data:
        if not (path / "checkpoints").is_dir():
            raise FileNotFoundError(
                f"{path} is a training run folder without checkpoints/: the run saved no checkpoint"
            )
        return "run"
    return "hf"


def run_config(path: str | Path) -> Config:
    """The validated Config a training run saved in its config.json."""
    return from_dict(_read_json(Path(path) / "config.json"))


def find_tokenizer(cfg: Config, folder: str | Path, where: str):
    """The tokenizer of the first of `model.tokenizer`, `folder` (the model evaluated), then the folders
    `cfg`'s model starts from that holds one; FileNotFoundError naming those looked in."""
    from cppo_jax.models.tokenizer import Tokenizer, has_tokenizer

    folders = [cfg.model.tokenizer, folder, cfg.model.start_folder, cfg.model.path]
    folders = list(dict.fromkeys(str(f) for f in folders if f))
    for f in folders:
        if has_tokenizer(f):
            return Tokenizer.from_dir(f)
    raise FileNotFoundError(
        f"no tokenizer for {where} (looked in: {', '.join(folders) or 'none'}); "
        f"set model.tokenizer=/path/to/tokenizer"
    )


def load_policy(cfg: Config | None, checkpoint: str | Path, step: int | None = None) -> Policy:
    """Model definition, params and tokenizer of a Hugging Face folder or a training run folder."""
    from flax import nnx

    from cppo_jax.models import load_hf

    path = Path(checkpoint).resolve()
    kind = checkpoint_kind(path)
    if kind == "hf":
        if cfg is None:
            raise EvaluationError(
                f"{path} is a Hugging Face folder: give --config (prompts, rewards, backend)"
            )
        if step is not None:
            raise EvaluationError(
                f"--step applies to training run folders; {path} is a model folder"
            )
        model = load_hf(
            path,
            dtype=cfg.model.dtype,
            param_dtype=cfg.model.param_dtype,
            scan_layers=cfg.model.scan_layers,
            attention=cfg.model.attention,
        )
        graphdef, params = nnx.split(model)
        return Policy(graphdef, params, find_tokenizer(cfg, path, str(path)), kind, path)
    return _load_run(path, step)


def _load_run(path: Path, step: int | None) -> Policy:
    from cppo_jax.config.choices import MODEL_REQUIRED
    from cppo_jax.train.checkpoint import Checkpointer
    from cppo_jax.train.export import abstract_state

    rcfg = run_config(path)
    base = rcfg.model.start_folder
    if not base:
        raise ConfigError(
            f"{path / 'config.json'}: {MODEL_REQUIRED}; the run names neither model.path nor "
            f"model.init_checkpoint, so its architecture is unknown"
        )
    graphdef, target = abstract_state(rcfg, base)  # the architecture only: no weights read
    ckpt = Checkpointer(path / "checkpoints", keep=rcfg.trainer.keep_checkpoints)
    try:
        state, meta = ckpt.restore(step, target)
    finally:
        ckpt.close()
    tokenizer = find_tokenizer(rcfg, base, f"run {path}")
    restored = int(meta.get("step", step if step is not None else -1))
    return Policy(graphdef, state["params"], tokenizer, "run", path, restored, rcfg)
