"""What a run writes for its user: metrics.jsonl, TensorBoard events, sample completions, curves.

Host code: imports no JAX. Only process 0 writes (the caller decides).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np


def _plain(value: Any) -> Any:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return value
    return value if math.isfinite(value) else str(value)


class _Discard:
    def write(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class RunLog:
    def __init__(
        self,
        out_dir: Path,
        tensorboard: bool = True,
        write: bool = True,
        wandb: dict | None = None,
    ):
        """`write=False` (processes other than 0): keeps `history`, writes nothing. `wandb`: the
        arguments of `wandb.init` (project, entity, name, mode, config) to log there too."""
        self.out_dir = Path(out_dir)
        self._tb = None
        self._wb = None
        self.history: list[dict] = []
        if not write:
            self._metrics = self._samples = self._events = _Discard()
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.out_dir / "metrics.jsonl", "a", buffering=1)
        self._samples = open(self.out_dir / "samples.jsonl", "a", buffering=1)
        self._events = open(self.out_dir / "events.jsonl", "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        if wandb is not None:
            self._wb = _start_wandb(self.out_dir, wandb)

    def metrics(self, row: dict) -> None:
        row = {k: _plain(v) for k, v in row.items()}
        self.history.append(row)
        self._metrics.write(json.dumps(row) + "\n")
        if self._tb is not None:
            step = int(row.get("step", len(self.history)))
            for key, value in row.items():
                if isinstance(value, float) and key != "step":
                    self._tb.add_scalar(key, value, step)
        if self._wb is not None:
            step = int(row.get("step", len(self.history)))
            self._wb.log({k: v for k, v in row.items() if isinstance(v, float)}, step=step)

    def samples(self, step: int, rows: list[dict]) -> None:
        for row in rows:
            self._samples.write(json.dumps({"step": step, **row}) + "\n")

    def event(self, kind: str, **fields) -> None:
        """Something a user must know about: a skipped update, a resume, a stop."""
        self._events.write(
            json.dumps({"event": kind, **{k: _plain(v) for k, v in fields.items()}}) + "\n"
        )

    def evaluation(self, result: dict) -> None:
        """An evaluation: an `eval` event, and its numbers as TensorBoard scalars `eval/<split>/<key>`
        (say `eval/test/accuracy`) at its `step` (steps done, as in metrics.jsonl)."""
        self.event("eval", **result)
        split = result.get("split", "test")
        scalars = {
            f"eval/{split}/{key}": float(value)
            for key, value in result.items()
            if key not in ("step", "n") and isinstance(_plain(value), float)
        }
        for key, value in scalars.items():
            if self._tb is not None:
                self._tb.add_scalar(key, value, int(result["step"]))
        if self._wb is not None:
            self._wb.log(scalars, step=int(result["step"]))

    def close(self) -> None:
        for f in (self._metrics, self._samples, self._events):
            f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wb is not None:
            self._wb.finish()
            self._wb = None


def wandb_settings(cfg) -> dict:
    """`wandb.init` arguments of a run's `Config`: project, entity and mode from `logging`, the run
    name, and the whole config (every key, as config.json holds it)."""
    log = cfg.logging
    return {
        "project": log.wandb_project,
        "entity": log.wandb_entity,
        "name": cfg.trainer.run_name,
        "mode": log.wandb_mode,
        "config": dataclasses.asdict(cfg),
    }


def _start_wandb(out_dir: Path, kwargs: dict):
    """A W&B run writing under `out_dir/wandb` (offline mode needs no network nor account)."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "config key 'logging.wandb' = true needs the wandb package: pip install wandb "
            "(or pip install -e '.[wandb]')"
        ) from e
    return wandb.init(dir=str(out_dir), **kwargs)


def reward_metrics(rewards_QG, per_fn: dict, lengths_N, finished_N) -> dict[str, float]:
    """The rollout's metrics with TRL's GRPOTrainer names and definitions (docs/metrics.md).

    rewards_QG: weighted total rewards; per_fn: unweighted scores of each reward function (N = Q G,
    NaN where a function abstained); lengths_N: completion tokens up to and including EOS;
    finished_N: the completion ended with EOS. Standard deviations have ddof 1 (torch's default).
    """
    rewards_QG = np.asarray(rewards_QG, np.float64)
    lengths_N = np.asarray(lengths_N, np.float64)
    finished_N = np.asarray(finished_N, bool)
    G = rewards_QG.shape[1]
    std_Q = rewards_QG.std(axis=1, ddof=1) if G > 1 else np.zeros(rewards_QG.shape[0])
    terminated = lengths_N[finished_N] if finished_N.any() else np.zeros(1)
    m = {
        "reward": float(rewards_QG.mean()),
        "reward_std": float(std_Q.mean()),  # mean of the per-question standard deviations
        "frac_reward_zero_std": float(np.mean(np.isclose(std_Q, 0.0))),
        "completions/mean_length": float(lengths_N.mean()),
        "completions/min_length": float(lengths_N.min()),
        "completions/max_length": float(lengths_N.max()),
        "completions/mean_terminated_length": float(terminated.mean()),
        "completions/min_terminated_length": float(terminated.min()),
        "completions/max_terminated_length": float(terminated.max()),
        "completions/clipped_ratio": float(np.mean(~finished_N)),
    }
    for name, values in per_fn.items():
        v = np.asarray(values, np.float64)
        v = v[~np.isnan(v)]
        m[f"rewards/{name}/mean"] = float(v.mean()) if v.size else float("nan")
        m[f"rewards/{name}/std"] = float(v.std(ddof=1)) if v.size > 1 else float("nan")
    return m


def phase_table(history: list[dict]) -> str:
    """Median time per phase and its share of the step, as a markdown table."""
    phases = [k for k in (history[0] if history else {}) if k.startswith("timing_s/")]
    if not phases:
        return ""
    steps = [r["timing_s/step"] for r in history if isinstance(r.get("timing_s/step"), float)]
    step_med = statistics.median(steps) if steps else float("nan")
    lines = ["| phase | median s | share of step |", "| --- | --- | --- |"]
    for key in phases:
        values = [r[key] for r in history if isinstance(r.get(key), float)]
        if not values:
            continue
        med = statistics.median(values)
        share = med / step_med if step_med and key != "timing_s/step" else 1.0
        lines.append(f"| {key.removeprefix('timing_s/')} | {med:.3f} | {share:.0%} |")
    return "\n".join(lines)


def plot_curves(history: list[dict], evals: list[dict], path: Path) -> None:
    """Reward per step and held-out accuracy per evaluation, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [r["step"] for r in history]
    ax1.plot(steps, [r.get("reward", float("nan")) for r in history], label="mean reward")
    ax1.set_xlabel("step")
    ax1.set_ylabel("reward")
    ax1.grid(alpha=0.3)
    ax1.legend()
    for split in sorted({e.get("split", "test") for e in evals}):
        rows = [e for e in evals if e.get("split", "test") == split]
        # The same questions at every point: the last (whole-split) evaluation's share of the
        # sample the earlier ones scored (`trainer.eval_subset`).
        accs = [e.get("subset_accuracy", e["accuracy"]) for e in rows]
        ax2.plot([e["step"] for e in rows], accs, marker="o", label=split)
    if evals:
        ax2.legend()
    ax2.set_xlabel("step")
    ax2.set_ylabel("greedy accuracy")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
