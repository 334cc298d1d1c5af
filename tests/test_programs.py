"""`programs.build` gives the programs the trainer runs: what `plan --compile-for` compiles is that code.

A real trainer takes two steps with each program recorded as it is called (the first step fused, the
program "step"; the second with the phases apart, as in `trainer.profile_steps`: "train_step",
"ref_logps"); each recorded call, lowered with the arguments it got, must give the same program text as
`programs.build`'s function lowered with its abstract arguments (shapes, dtypes and shardings built from
the config alone).
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from cppo_jax.rollout import backend as backend_lib
from cppo_jax.train import programs
from cppo_jax.train.trainer import Trainer
from tests.test_trainer import small_config


class Recorder:
    """Wraps a jitted function: calls pass through, the first call's arguments are kept."""

    def __init__(self, fn):
        self.fn, self.args = fn, None

    def __call__(self, *args):
        if self.args is None:
            self.args = jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    if isinstance(x, jax.Array)
                    else x
                ),
                args,
            )
        return self.fn(*args)

    def lower(self, *args):
        return self.fn.lower(*args)


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # mu = 1, beta > 0
        ("cppo.mu=2", "model.dtype=bfloat16"),  # the old log-probs from the first update's forward
        ("trainer.pack=true", "trainer.pack_rows=4", "trainer.pack_len=168"),  # packed rows
        (
            "model.lora.enabled=true",
            "model.lora.rank=3",
        ),  # adapters + frozen base, unmerged sampler
    ],
)
def test_built_programs_are_the_trainers(tmp_path, arith_model_dir, overrides, monkeypatch):
    cfg = small_config(tmp_path, arith_model_dir, "trainer.steps=2", *overrides)
    trainer = Trainer(cfg)
    try:
        actor, ref = trainer.actor, trainer.reference
        fused = actor.fused._replace(update=Recorder(actor.fused.update))
        trainer.actor = dataclasses.replace(
            actor, train_step=Recorder(actor.train_step), fused=fused
        )
        # The reference's log-probs: of the packed rows the packer's program; with LoRA the base's
        # forward, its own program; else the actor's program on the reference's copy.
        if actor.packer is not None:
            assert ref.packed_logps is actor.packer.logps
            trainer.reference = dataclasses.replace(ref, packed_logps=Recorder(ref.packed_logps))
        else:
            assert (ref.logps is actor.logps) == (actor.frozen is None)
            trainer.reference = dataclasses.replace(ref, logps=Recorder(ref.logps))
        seen = {}
        made = backend_lib.make_sampler

        def recording_make_sampler(*args, **kw):  # the rollout's sampler, as the backend calls it
            return seen.setdefault("sampler", Recorder(made(*args, **kw)))

        monkeypatch.setattr(backend_lib, "make_sampler", recording_make_sampler)
        trainer.step(0)  # fused
        trainer.phase_split = True
        trainer.step(1)  # the phases apart
        built = programs.build(cfg, jax.devices()).programs
        recorded = {
            "step": trainer.actor.fused.update,
            "train_step": trainer.actor.train_step,
            "ref_logps": trainer.reference.packed_logps or trainer.reference.logps,
            "sampler": seen["sampler"],
        }
        assert set(built) == set(recorded)
        for name, (fn, args) in built.items():
            rec = recorded[name]
            assert jax.tree.structure(args) == jax.tree.structure(rec.args), name
            want = rec.lower(*rec.args).as_text()
            assert fn.lower(*args).as_text() == want, name
    finally:
        trainer.close()


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
