"""Training checkpoints: params, optimizer state and run metadata, written atomically by orbax.

Orbax writes each step into a temporary folder and renames it into place when complete, so a run killed
at any moment leaves only complete checkpoints behind (a half-written one is never listed). The metadata
(step, data position, seed, counters) is JSON: nothing is unpickled on restore.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder."""


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).resolve()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint folder {self.directory}: {e}") from e
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    ITEMS = ("state", "meta")

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Steps whose folder holds every item. A run killed while orbax deletes an old step (beyond
        `keep`) can leave that folder with some items gone: it is not a checkpoint any more."""
        return sorted(
            step
            for step in self._manager.all_steps()
            if all((self.directory / str(step) / item).is_dir() for item in self.ITEMS)
        )

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Write `state` (a pytree of arrays) and `meta` (JSON) for `step`; blocks until durable."""
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
            self._manager.wait_until_finished()
        except Exception as e:
            raise CheckpointError(
                f"writing checkpoint {step} under {self.directory} failed: {type(e).__name__}: {e}; "
                f"earlier checkpoints are untouched: {self.all_steps()}"
            ) from e

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
        """Restore `step` (default: the latest) onto the shapes/shardings of `abstract_state`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint to resume from under {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:
            raise CheckpointError(
                f"reading checkpoint {step} under {self.directory} failed: {type(e).__name__}: {e}"
            ) from e
        return out["state"], dict(out["meta"])

    def read_meta(self, step: int | None = None) -> dict:
        """The metadata of checkpoint `step` (default: the latest), without reading its arrays."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint to resume from under {self.directory}")
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:
            raise CheckpointError(
                f"reading the metadata of checkpoint {step} under {self.directory} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        return dict(out["meta"])

    def close(self) -> None:
        self._manager.close()


def holds_a_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds an earlier run: checkpoints, or logged steps."""
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        return True
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """A fresh run (trainer.resume=false) in a folder that holds an earlier one: the earlier run is
    renamed to `<run_name>.earlier-<n>` beside it (the first free n), so nothing is lost and the new
    run's checkpoints and logs do not mix with it. Returns where it went (None: nothing there)."""
    run_dir = Path(run_dir)
    if not holds_a_run(run_dir):
        return None
    n = 1
    while (dest := run_dir.with_name(f"{run_dir.name}.earlier-{n}")).exists():
        n += 1
    os.rename(run_dir, dest)
    return dest
