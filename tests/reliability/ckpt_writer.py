"""Writes checkpoints 1, 2, 3, ... of a state derived from the step, forever (killed by the test).

`python tests/reliability/ckpt_writer.py DIR` continues after the latest checkpoint in DIR, as a resumed
run does. `expected_state(step)` is what checkpoint `step` must hold.
"""

from __future__ import annotations

import sys

import numpy as np


def expected_state(step: int) -> dict:
    rng = np.random.default_rng(step)
    # Random (incompressible) data, a few MB, so that a write takes long enough to be interrupted.
    return {
        "params": {"w": rng.standard_normal((512, 512)).astype(np.float32)},
        "opt_state": {"count": np.asarray(step, np.int32), "mu": rng.standard_normal(4096)},
    }


def main(directory: str) -> None:
    from cppo_jax.train.checkpoint import Checkpointer

    ckpt = Checkpointer(directory, keep=3)
    step = (ckpt.latest_step() or 0) + 1
    while True:
        ckpt.save(step, expected_state(step), {"step": step})
        step += 1


if __name__ == "__main__":
    main(sys.argv[1])
