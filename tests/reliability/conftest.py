"""One tiny embedded-backend Trainer shared by the in-process reliability tests (built and compiled once;
each test rewinds it to a fresh run folder with `tests.reliability.runs.rewind`)."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(scope="session")
def shared_trainer(tmp_path_factory, arith_model_dir):
    """(trainer, (params, opt_state) to start from). Built with 5 steps, no checkpoints until the end,
    max_nan_streak 2 and no reference model (beta 0: one compiled function fewer)."""
    from cppo_jax.train.trainer import Trainer
    from tests.test_trainer import small_config

    cfg = small_config(
        tmp_path_factory.mktemp("shared_trainer"),
        arith_model_dir,
        "trainer.steps=5",
        "trainer.max_nan_streak=2",
        "cppo.beta=0.0",
    )
    trainer = Trainer(cfg)
    init = jax.tree.map(lambda x: x.copy(), (trainer.params, trainer.opt_state))
    yield trainer, init
    trainer.close()
