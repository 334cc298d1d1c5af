"""Compiling ahead (`train.update.compile_ahead`): the first step's program compiled from the config
alone (`programs.build`), into the trainer's own function, or a failure that says why.

That `programs.build` gives the programs the trainer runs (what `plan --compile-for` compiles is that
code) is tested on the runs of tests/test_update_program.py (`test_built_programs_are_the_trainers`),
which record each program as the trainer calls it.
"""

from __future__ import annotations

import jax
import pytest

from cppo_jax.train import programs
from cppo_jax.train.trainer import Trainer
from tests.test_trainer import small_config

pytestmark = pytest.mark.slow  # each test compiles a trainer's programs


def test_compiling_ahead_leaves_the_first_step_nothing_to_compile(tmp_path, arith_model_dir):
    """What a run with a vLLM server does while the server loads (`train.update.compile_ahead`,
    from `train.loop`): the first step's program compiled from the config alone into the trainer's
    own function. The first step then compiles every program but that one; the packed run's pruning
    program is its own."""
    from cppo_jax.train.update import compile_ahead

    def compiled_names(fn) -> list[str]:
        names = []

        def listener(event, _seconds, fun_name="", **_kw):
            if event == "/jax/core/compile/backend_compile_duration":
                names.append(fun_name)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            fn()
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        return names

    for extra in ((), ("trainer.pack=true", "trainer.pack_rows=4", "trainer.pack_len=168")):
        trainer = Trainer(small_config(tmp_path / str(len(extra)), arith_model_dir, *extra))
        try:
            fused = f"jit({trainer.actor.fused.update.__name__})"  # as JAX names its compile
            event = []
            ahead = compiled_names(lambda: event.append(compile_ahead(trainer)))  # noqa: B023
            assert ahead == [fused] and event[0]["seconds"] > 0 and "error" not in event[0], ahead
            first = compiled_names(lambda: trainer.step(0))  # noqa: B023
            assert fused not in first, first
        finally:
            trainer.close()


def test_a_failed_compile_ahead_says_why_and_the_run_goes_on(
    tmp_path, arith_model_dir, monkeypatch
):
    """Compiling ahead only saves time: when it fails the event says why, and the step compiles and
    trains as without it."""
    from cppo_jax.train.update import compile_ahead

    def broken(cfg, devices, num_steps=None):
        raise ValueError("no abstract arguments for this config")

    trainer = Trainer(small_config(tmp_path, arith_model_dir))
    try:
        monkeypatch.setattr(programs, "build", broken)
        event = compile_ahead(trainer)
        assert event["error"] == "ValueError: no abstract arguments for this config", event
        metrics = trainer.step(0)
        assert metrics["cppo/kept"] > 0 and "loss" in metrics
    finally:
        trainer.close()
