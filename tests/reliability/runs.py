"""Helpers for the reliability tests: runs of the tiny trainer in a subprocess, read back from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cppo_jax.config.files import to_dict
from cppo_jax.config.schema import Config


def write_config_file(path: Path, cfg: Config) -> Path:
    """A config file whose get_config() returns `cfg` (so `python -m cppo_jax.launch` can run it)."""
    path.write_text(
        "import json\nfrom cppo_jax.config.files import from_dict\n"
        f"DATA = json.loads({json.dumps(json.dumps(to_dict(cfg)))})\n"
        "def get_config():\n    return from_dict(DATA)\n"
    )
    return path


def launch(config_file: Path, *overrides: str) -> subprocess.Popen:
    """`python -m cppo_jax.launch --config config_file overrides...`, output piped. The run uses the
    suite's persistent XLA compilation cache (tests/conftest.py: in the environment), so the programs
    it shares with this process's trainers are compiled once."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "cppo_jax.launch", "--config", str(config_file), *overrides]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def metrics_steps(run_dir: Path) -> list[int]:
    """The `step` of every complete row of metrics.jsonl (empty while there is none)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [int(json.loads(x)["step"]) for x in path.read_text().splitlines() if x.endswith("}")]


def digit_steps(ckpt_dir: Path) -> list[int]:
    """Step folders orbax has renamed into place. Polled instead of opening a CheckpointManager,
    which would tidy the writer's temporary folders."""
    return sorted(int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit())


def rewind(trainer, run_dir: Path, params, opt_state, *overrides: str) -> None:
    """Point an existing Trainer at a fresh run folder and starting state, so that several fault cases
    share one Trainer (and its compiled functions) yet each writes and checks its own outputs.

    `overrides` change `trainer.*` keys that shape nothing compiled (steps, checkpoint_every,
    max_nan_streak, ...), applied to the config the Trainer was built with."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from cppo_jax.config.files import apply_overrides
    from cppo_jax.observe.runlog import RunLog
    from cppo_jax.train.checkpoint import Checkpointer

    if not hasattr(trainer, "_built_cfg"):
        trainer._built_cfg = trainer.cfg
    trainer.cfg = apply_overrides(trainer._built_cfg, list(overrides))
    trainer.num_steps = trainer.cfg.trainer.steps
    trainer.host.log.close()
    trainer.host.ckpt.close()
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer.host = dataclasses.replace(
        trainer.host,
        out_dir=run_dir,
        log=RunLog(run_dir, tensorboard=False),
        ckpt=Checkpointer(run_dir / "checkpoints", keep=trainer.cfg.trainer.keep_checkpoints),
    )
    # Copies: the train step donates its inputs.
    trainer.params = jax.tree.map(jnp.copy, params)
    trainer.opt_state = jax.tree.map(jnp.copy, opt_state)
    trainer.start_step = trainer.params_step = trainer.nan_streak = 0
    trainer.evals = []


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
