"""The trainer end to end on tiny models: outputs, compilations, shapes, crash-resume, bad input."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.algo.cppo import shapes_of
from cppo_jax.config.files import apply_overrides, to_dict
from cppo_jax.config.model import ModelConfig
from cppo_jax.config.run import LoggingConfig, TrainerConfig
from cppo_jax.config.schema import (
    Config,
    CPPOConfig,
    DataConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
)
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train.checkpoint import Checkpointer
from cppo_jax.train.trainer import NonFiniteError, Trainer
from tests.helpers import SMOOTH_ADAMW_OVERRIDES, spread_reward

REQUIRED_METRICS = [
    "step",
    "reward",
    "reward_std",
    "rewards/arith_accuracy/mean",
    "rewards/arith_format/mean",
    "frac_reward_zero_std",
    "kl",
    "loss",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "cppo/questions",
    "cppo/kept",
    "cppo/tokens_trained",
    "timing_s/rollout",
    "timing_s/reward",
    "timing_s/update",
    "timing_s/step",
    "jit/compilations",
]


def small_config(out_dir: Path, model_dir: Path, *overrides: str) -> Config:
    cfg = Config(
        model=ModelConfig(init_checkpoint=str(model_dir)),
        data=DataConfig(task="arith", max_prompt_len=72, num_train=64, num_test=6),
        rollout=RolloutConfig(max_new_tokens=12),
        cppo=CPPOConfig(
            num_generations=4, questions_per_step=2, pruning_rate=0.5, allocation=True, beta=0.04
        ),
        reward=RewardConfig(num_workers=1),
        optim=OptimConfig(lr=1e-3, schedule="constant", warmup_ratio=0.0),
        trainer=TrainerConfig(steps=3, out_dir=str(out_dir), run_name="run"),
        logging=LoggingConfig(progress=False, tensorboard=False, plot=False),
    )
    return apply_overrides(cfg, list(overrides))


def run_trainer(cfg: Config):
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return trainer, summary


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory, arith_model_dir) -> dict:
    """A 10-step run with every output on (evaluations at 0, 5, 10): its config, trainer (closed),
    summary, and the collector's freeze count before the run and at each step's start."""
    cfg = small_config(
        tmp_path_factory.mktemp("ten_steps"),
        arith_model_dir,
        "trainer.steps=10",
        "logging.tensorboard=true",
        "logging.plot=true",
        "data.val_size=5",
        "trainer.eval_every=5",
    )
    trainer = Trainer(cfg)
    inner, frozen = trainer.step, []

    def spy(step):
        frozen.append(gc.get_freeze_count())
        return inner(step)

    trainer.step = spy
    frozen_before = gc.get_freeze_count()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    after = gc.get_freeze_count()
    return dict(cfg=cfg, trainer=trainer, summary=summary, frozen=(frozen_before, frozen, after))


@pytest.mark.slow
def test_a_run_keeps_its_set_up_out_of_the_collector_and_gives_it_back(ten_steps):
    """`train` collects once and freezes what set-up built (no full collection re-scans it during the
    steps), and unfreezes at the end, so a process that goes on can free the run's objects."""
    before, frozen, after = ten_steps["frozen"]
    assert len(frozen) == 10 and min(frozen) > before + 1000  # the model, data, tokenizer, ...
    assert after == before


@pytest.mark.slow
def test_outputs_metrics_and_compilations(ten_steps):
    """A 10-step run writes every promised output; XLA compilations stop growing after step 3."""
    cfg, trainer, summary = ten_steps["cfg"], ten_steps["trainer"], ten_steps["summary"]
    run_dir = trainer.host.out_dir
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 11))
    for key in REQUIRED_METRICS:
        assert key in rows[0], key
    assert rows[0]["cppo/questions"] == 4 and rows[0]["cppo/kept"] == 8
    compiles = [r["jit/compilations"] for r in rows]
    assert compiles[2] == compiles[-1], compiles
    for name in ("config.json", "samples.jsonl", "curves.png", "summary.md", "events.jsonl"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").iterdir())
    assert Checkpointer(run_dir / "checkpoints").latest_step() == 10
    assert json.loads((run_dir / "config.json").read_text()) == json.loads(json.dumps(to_dict(cfg)))
    assert 0.0 <= summary["after"]["accuracy"] <= 1.0 and summary["after"]["n"] == 6
    # Validation (never the test split) at steps 0, 5 and 10 chooses the best policy, kept as HF.
    evals = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    val_steps = [e["step"] for e in evals if e["event"] == "eval" and e["split"] == "validation"]
    assert val_steps == [0, 5, 10]
    best = json.loads((run_dir / "best" / "config.json").read_text())
    assert best["cppo_step"] in (0, 5, 10) and 0.0 <= best["cppo_val_accuracy"] <= 1.0


@pytest.mark.slow
def test_grpo_and_cppo_share_the_path_and_the_trained_shape(tmp_path, arith_model_dir):
    """p = 0 and p > 0 run the same functions; with allocation CPPO trains GRPO's batch shape."""
    shapes = {}
    for name, p, alloc in (("grpo", "0.0", "false"), ("cppo", "0.5", "true")):
        cfg = small_config(
            tmp_path,
            arith_model_dir,
            f"cppo.pruning_rate={p}",
            f"cppo.allocation={alloc}",
            f"trainer.run_name={name}",
            "trainer.steps=1",
        )
        trainer = Trainer(cfg)
        seen = []
        inner = trainer.actor.train_step

        def spy(params, opt_state, batch, inner=inner, seen=seen):
            seen.append(jax.tree.map(lambda x: x.shape, batch))
            return inner(params, opt_state, batch)

        trainer.actor = dataclasses.replace(trainer.actor, train_step=spy)
        trainer.phase_split = True  # the programs apart, so the updates' batch is seen
        metrics = trainer.step(0)
        trainer.close()
        shapes[name] = (seen[0], metrics["cppo/questions"])
    assert shapes["grpo"][0] == shapes["cppo"][0]
    assert shapes["grpo"][1] == 2 and shapes["cppo"][1] == 4
    grpo = shapes_of(small_config(tmp_path, arith_model_dir, "cppo.pruning_rate=0.0"))
    cppo_noalloc = shapes_of(small_config(tmp_path, arith_model_dir, "cppo.allocation=false"))
    assert (grpo.Q, grpo.k, grpo.M) == (2, 4, 8)
    assert (cppo_noalloc.Q, cppo_noalloc.k, cppo_noalloc.M) == (2, 2, 4)


@pytest.mark.slow
def test_short_cppo_run_raises_mean_reward(tmp_path):
    """8 CPPO steps raise the policy's mean sampled reward on its training questions.

    Measured with 64 samples per question before and after, with the same sampling seeds (common random
    numbers), out of a maximum of 3. Seen here (trainer seed 0, the test's; seeds 1 and 2): 1.12 ->
    1.52 / 1.54 / 1.54 with 8 / 8 / 4 of the 8 questions up (seed 2 would fail the last check), and
    after 6 steps +0.29 / +0.33 / +0.32: too close to the +0.2 asked to cut the run.
    """
    from tests.helpers import reward_rise_config, sampled_reward

    trainer = Trainer(reward_rise_config(tmp_path))
    try:
        before = sampled_reward(trainer, 64)
        history = [trainer.step(s) for s in range(trainer.num_steps)]
        after = sampled_reward(trainer, 64)
    finally:
        trainer.close()
    print(
        f"\nmean sampled reward {before.mean():.3f} -> {after.mean():.3f} per question {after - before}"
    )
    assert [m["cppo/kept"] for m in history] == [
        32.0
    ] * 8  # k = 4 of 16 for each of the 8 questions
    assert after.mean() > before.mean() + 0.2, (before, after)
    assert np.sum(after > before) >= 5, (before, after)  # most questions, not one outlier


@pytest.mark.slow
def test_nonfinite_loss_skips_updates_then_stops_with_state_saved(tmp_path, arith_model_dir):
    cfg = small_config(tmp_path, arith_model_dir, "trainer.steps=6", "trainer.max_nan_streak=2")
    trainer = Trainer(cfg)
    before = jax.tree.map(np.asarray, trainer.params)
    inner = trainer.actor.train_step

    def poisoned(params, opt_state, batch):
        return inner(params, opt_state, batch._replace(adv_M=batch.adv_M * jnp.nan))

    trainer.actor = dataclasses.replace(trainer.actor, train_step=poisoned)
    trainer.phase_split = True  # the programs apart, so the updates' batch is seen
    frozen_before = gc.get_freeze_count()
    with pytest.raises(NonFiniteError, match="2 non-finite steps in a row"):
        trainer.train()
    assert gc.get_freeze_count() == frozen_before  # a failed run unfreezes its objects too
    trainer.close()
    rows = (
        read_metrics(trainer.host.out_dir)
        if (trainer.host.out_dir / "metrics.jsonl").exists()
        else []
    )
    events = [
        json.loads(x) for x in (trainer.host.out_dir / "events.jsonl").read_text().splitlines()
    ]
    assert sum(e["event"] == "nonfinite_update" for e in events) == 2
    assert all(r["update_skipped"] == 1.0 for r in rows)
    after = jax.tree.map(np.asarray, trainer.params)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))
    ckpt = Checkpointer(trainer.host.out_dir / "checkpoints")
    assert ckpt.latest_step() is not None
    state, _ = ckpt.restore(None, {"params": trainer.params, "opt_state": trainer.opt_state})
    restored = jax.tree.map(np.asarray, state["params"])
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, restored)))


def test_bad_dataset_rows_are_counted_or_rejected_with_line_number(tmp_path, arith_model_dir):
    rows = [
        '{"question": "Tom has 3 pens. He buys 4 more. How many pens?", "answer": "3+4=7\\n#### 7"}',
        "{not json",
        '{"question": "no answer field"}',
        '{"question": "Ann has 9 cards. She loses 2. How many?", "answer": "9-2=7\\n#### 7"}',
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(rows * 2) + "\n")
    cfg = small_config(
        tmp_path, arith_model_dir, "data.task=gsm8k", f"data.train={path}", "trainer.steps=1"
    )
    trainer = Trainer(cfg)
    assert len(trainer.data.train_set) == 4
    assert trainer.data.stats["bad_rows"] == 4
    trainer.close()
    strict = apply_overrides(cfg, ["data.bad_rows=error", "trainer.run_name=strict"])
    with pytest.raises(ValueError, match="line 2"):
        Trainer(strict)


@pytest.mark.slow
def test_trains_from_a_users_jsonl_with_its_own_columns_and_from_parquet(tmp_path, arith_model_dir):
    """A GSM8K-like file whose columns are `problem`/`final` and whose answers are sentences
    (data.question_field, data.answer_field, data.answer_format=last_number), and a parquet file in
    GSM8K's own layout: both train a step, with the gold answers the rewards see."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    people = [("Tom", 3, 4), ("Ann", 9, 2), ("Bo", 5, 6), ("Cy", 8, 1)]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps(
                {
                    "problem": f"{n} has {a} pens and gets {b} more. How many?",
                    "final": f"So {a + b} pens.",
                }
            )
            + "\n"
            for n, a, b in people
        )
    )
    parquet = tmp_path / "train.parquet"
    rows = [
        {
            "question": f"{n} has {a} cards and {b} more. Total?",
            "answer": f"{a}+{b}={a + b}\n#### {a + b}",
        }
        for n, a, b in people
    ]
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    sources = {
        "jsonl": [
            f"data.train={jsonl}",
            "data.question_field=problem",
            "data.answer_field=final",
            "data.answer_format=last_number",
        ],
        "parquet": [f"data.train={parquet}"],
    }
    for name, overrides in sources.items():
        cfg = small_config(
            tmp_path,
            arith_model_dir,
            "data.task=gsm8k",
            "trainer.steps=1",
            f"trainer.run_name={name}",
            *overrides,
        )
        trainer = Trainer(cfg)
        try:
            answers = sorted(ex["answer"] for ex in trainer.data.train_set.examples)
            assert answers == sorted(str(a + b) for _, a, b in people), name
            assert trainer.data.stats["bad_rows"] == 0
            metrics = trainer.step(0)
            assert metrics["cppo/kept"] > 0 and math.isfinite(metrics["loss"]), name
        finally:
            trainer.close()
    bad = small_config(
        tmp_path,
        arith_model_dir,
        "data.task=gsm8k",
        f"data.train={jsonl}",
        "data.bad_rows=error",
        "trainer.run_name=bad",
    )
    with pytest.raises(ValueError, match=r"missing field\(s\) \['question', 'answer'\]"):
        Trainer(bad)  # without the column names, the file's rows lack the task's fields


@pytest.mark.slow
def test_a_fresh_run_in_a_used_folder_sets_the_earlier_run_aside(tmp_path, arith_model_dir):
    """`make demo` twice: the second run (trainer.resume=false) does not trip over the first one's
    checkpoints; the earlier run is kept whole beside it, under the first free `.earlier-<n>`."""
    cfg = small_config(tmp_path, arith_model_dir, "trainer.steps=2", "trainer.checkpoint_every=1")
    first, _ = run_trainer(cfg)
    first_metrics = (first.host.out_dir / "metrics.jsonl").read_text()
    second, _ = run_trainer(cfg)
    assert second.host.earlier_run == tmp_path / "run.earlier-1"
    assert (tmp_path / "run.earlier-1" / "metrics.jsonl").read_text() == first_metrics
    assert Checkpointer(tmp_path / "run.earlier-1" / "checkpoints").all_steps() == [1, 2]
    assert [r["step"] for r in read_metrics(second.host.out_dir)] == [
        1,
        2,
    ]  # not appended to the first
    assert Checkpointer(second.host.out_dir / "checkpoints").all_steps() == [1, 2]
    third = Trainer(cfg)
    third.close()
    assert third.host.earlier_run == tmp_path / "run.earlier-2"
    resumed = Trainer(apply_overrides(cfg, ["trainer.resume=true"]))  # a run to continue: kept
    resumed.close()
    assert resumed.host.earlier_run is None


def _launch(config_file: Path, *overrides: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "cppo_jax.launch", "--config", str(config_file), *overrides]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _params_at(run_dir: Path, step: int, like) -> list[np.ndarray]:
    state, meta = Checkpointer(run_dir / "checkpoints").restore(step, like)
    assert meta["step"] == step
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]


@pytest.mark.slow
def test_sigkill_between_checkpoints_then_resume_is_exact(tmp_path, arith_model_dir):
    """Killed after checkpoint 4 of 6, resumed: step 6 equals the uninterrupted run's, bit for bit.

    The killed run is a launch of its own (`cppo_jax.launch`, SIGKILL); the uninterrupted run and
    the resumed one train in this process."""
    cfg = small_config(tmp_path, arith_model_dir, "trainer.steps=6", "trainer.checkpoint_every=2")
    whole, _ = run_trainer(apply_overrides(cfg, ["trainer.run_name=whole"]))
    config_file = tmp_path / "cfg.py"
    config_file.write_text(
        "import json\nfrom cppo_jax.config.files import from_dict\n"
        f"DATA = json.loads({json.dumps(json.dumps(to_dict(cfg)))})\n"
        "def get_config():\n    return from_dict(DATA)\n"
    )
    killed = _launch(config_file, "trainer.run_name=killed")
    ckpt_dir = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline:
        # A step folder gets its plain name only when complete (orbax renames it into place). Poll
        # the folder itself: opening a CheckpointManager here would tidy the writer's temp folders.
        done = sorted(int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit())
        if done and done[-1] == 4:
            break
        assert killed.poll() is None, killed.stdout.read().decode()[-3000:]
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    # Only complete checkpoints are listed, and the latest one loads.
    assert Checkpointer(ckpt_dir).all_steps()[-1] in (4, 6)
    run_trainer(apply_overrides(cfg, ["trainer.run_name=killed", "trainer.resume=true"]))

    like = whole.state()
    a = _params_at(tmp_path / "whole", 6, like)
    b = _params_at(tmp_path / "killed", 6, like)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    events = (tmp_path / "killed" / "events.jsonl").read_text()
    assert '"resumed"' in events


@pytest.mark.slow
def test_a_profiled_step_runs_the_production_program_with_its_phases_named(
    tmp_path, arith_model_dir
):
    """The steps of `trainer.profile_steps` run the program every other step runs (steps 4-7 in
    one, `after_rewards`), never the phases apart; its phases are named scopes, so the dumped HLO
    (the very program, compiled) and the trace name them."""
    from cppo_jax.observe import profile

    cfg = small_config(tmp_path, arith_model_dir, "trainer.steps=3", "trainer.profile_steps=[2,3]")
    trainer = Trainer(cfg)
    calls = {"step": [], "train_step": 0}
    fused, train_step = trainer.actor.fused.update, trainer.actor.train_step

    class Step:  # the fused program, its calls' argument shapes kept
        def __call__(self, *args):
            calls["step"].append(jax.tree.map(_abstract_of, args))
            return fused(*args)

        def lower(self, *args):
            return fused.lower(*args)

    def apart(*args):
        calls["train_step"] += 1
        return train_step(*args)

    trainer.actor = dataclasses.replace(
        trainer.actor, fused=trainer.actor.fused._replace(update=Step()), train_step=apart
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert len(calls["step"]) == 3 and calls["train_step"] == 0  # profiled or not: one program
    out = trainer.host.out_dir / "profile"
    found = profile.trace_contains(out, ["rollout", "reward", "update", "weight_sync"])
    assert all(found.values()), found
    dumped = (out / "hlo" / "step.hlo.txt").read_text()
    assert dumped == fused.lower(*calls["step"][-1]).compile().as_text()  # the production program
    for scope in ("prune/", "ref_logps/", "update/"):
        assert scope in dumped, scope
    assert "old_logps/" not in dumped  # no overlap: the old policy's log-probs are the update's own
    assert "xla compilations" in (trainer.host.out_dir / "compiled_programs.md").read_text().lower()


def _abstract_of(x):
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


# ----- fidelity to the released code (issue 18) -----


@pytest.mark.slow
def test_mu2_reuses_the_batch_with_pre_update_old_logps_and_sampler_logps_match(
    tmp_path, arith_model_dir
):
    """mu = 2 outside the overlap path, at T = 0.7 with left-padded prompts.

    The training log-probs of the sampled completions equal the sampler's own; the old-policy log-probs
    are those of the params before the first update, taken from its forward (no separate pass); both
    updates get the same batch, and on the second one the policy has moved (ratio != 1).
    """
    cfg = small_config(
        tmp_path,
        arith_model_dir,
        "cppo.mu=2",
        "cppo.pruning_rate=0.0",
        "cppo.allocation=false",
        "rollout.temperature=0.7",
        "trainer.steps=1",
        *spread_reward(tmp_path),  # a random model's own rewards may all be equal: no update
        # Two programs' params after two updates are compared below: AdamW smooth in the gradient,
        # so a rounding of a near-zero gradient stays a rounding on any CPU (issue #50).
        *SMOOTH_ADAMW_OVERRIDES,
    )
    trainer = Trainer(cfg)
    try:
        sh = trainer.shapes
        tol = 256 * np.finfo(np.float32).eps  # float32 model: relative to |logp|, below
        # Training log-probs vs the sampler's, on the kept (here: all) rows.
        rollout = trainer._rollout(trainer.params, 0)
        s = rollout.samples
        lengths = np.asarray(rollout.pvalid_QP).sum(axis=1)
        assert len(set(lengths.tolist())) > 1 and lengths.max() < sh.P  # left padding, ragged
        tokens_NT = jnp.concatenate([jnp.repeat(rollout.prompt_QP, sh.G, axis=0), s.tokens_NC], 1)
        valid_NT = jnp.concatenate([jnp.repeat(rollout.pvalid_QP, sh.G, axis=0), s.valid_NC], 1)
        train_NC = np.asarray(trainer.actor.logps(trainer.params, tokens_NT, valid_NT))
        sampled_NC = np.asarray(s.logp_NC)
        valid_NC = np.asarray(s.valid_NC)
        scale = max(1.0, float(np.abs(sampled_NC[valid_NC]).max()))
        np.testing.assert_allclose(
            train_NC[valid_NC], sampled_NC[valid_NC], rtol=0, atol=tol * scale
        )

        # The step: spy on the train program and the log-prob program.
        calls, policy_logps = [], []
        inner_step, inner_logps = trainer.actor.train_step, trainer.actor.logps

        def spy(params, opt_state, batch):
            # Host copies of the state the updates start from (before it is donated).
            calls.append(jax.tree.map(np.asarray, (params, opt_state, batch)))
            return inner_step(params, opt_state, batch)

        def logps_spy(params, *args):
            policy_logps.append(params is trainer.params)
            return inner_logps(params, *args)

        trainer.actor = dataclasses.replace(trainer.actor, train_step=spy, logps=logps_spy)
        trainer.phase_split = True  # the programs apart, so the updates' batch is seen
        trainer.reference = dataclasses.replace(trainer.reference, logps=logps_spy)
        row = trainer.step(0)
        assert len(calls) == 1  # both updates in one program
        assert not any(policy_logps)  # no separate old-policy forward: only the reference's
        params, opt_state, batch = calls[0]
        assert batch.old_logp_MC is None  # the old policy: the current one, in the program
        # The program's result is two updates on the same batch, the second with the first's forward
        # (the pre-update params' log-probs) as the old policy.
        one = jax.jit(
            functools.partial(
                step_lib.one_update,
                graphdef=trainer.actor.graphdef,
                tx=trainer.actor.tx,
                spec=trainer.actor.spec,
            )
        )
        p1, o1, _, first_NC = one(params, opt_state, batch)
        start_NC = np.asarray(inner_logps(jax.tree.map(jnp.asarray, params), *batch[:2]))
        mask_NC = np.asarray(batch.mask_MC) > 0
        scale = max(1.0, float(np.abs(start_NC[mask_NC]).max()))
        np.testing.assert_allclose(
            np.asarray(first_NC)[mask_NC], start_NC[mask_NC], rtol=0, atol=tol * scale
        )
        want, _, _, _ = one(p1, o1, batch._replace(old_logp_MC=first_NC))
        for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(want)):
            a, b = np.asarray(a), np.asarray(b)  # float32 math in two programs
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))
        # The logged metrics are the second update's: the policy has moved (ratio != 1).
        moved = row["ratio/abs_dev_mean"]
        assert moved > 1000 * np.finfo(np.float32).eps, moved
    finally:
        trainer.close()


@pytest.mark.slow
def test_slice_scope_in_the_trainer_and_both_eval_rules(tmp_path, arith_model_dir):
    """cppo.scope=slice trains slices x n kept rows; evaluation reports both rules."""
    cfg = small_config(
        tmp_path, arith_model_dir, "cppo.scope=slice", "cppo.slices=2", "trainer.steps=1"
    )
    sh = shapes_of(cfg)
    # Q = 4 questions of G = 4 in 2 slices of 8 completions; each drops int(8 x 0.5) = 4.
    assert (sh.Q, sh.M) == (4, 8)
    with pytest.raises(
        Exception, match="cppo.slices' = 3 .*divisor of the 4 questions trained per step"
    ):
        shapes_of(apply_overrides(cfg, ["cppo.slices=3"]))
    trainer = Trainer(cfg)
    try:
        metrics = trainer.step(0)
        assert metrics["cppo/kept"] == 8
        result = trainer.evaluate(1)
    finally:
        trainer.close()
    assert result["rule"] == "strict" and result["accuracy"] == result["accuracy_strict"]
    assert 0.0 <= result["accuracy_strict"] <= result["accuracy_released"] <= 1.0
    assert "rewards/eval/released/mean" not in metrics  # the rules run only when evaluating


def test_rewards_see_text_decoded_with_special_tokens_skipped(arith_model_dir):
    """As released (`skip_special_tokens=True`): chat markers, EOS and padding never reach a reward."""
    from cppo_jax.data import prompt_batches as pipeline
    from cppo_jax.models import Tokenizer
    from cppo_jax.rewards import gsm8k

    tok = Tokenizer.from_dir(arith_model_dir)
    text = "<think>3+2=5</think>\n<answer>5</answer>"
    ids = tok.encode(text)
    im_start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    rows = [ids + [tok.eos_id, tok.pad_id], [im_start, *ids, tok.eos_id]]
    width = max(map(len, rows))
    tokens_NC = np.full((2, width), tok.pad_id, np.int32)
    valid_NC = np.zeros((2, width), bool)
    for i, row in enumerate(rows):
        tokens_NC[i, : len(row)] = row
        valid_NC[i, : len(row) - (i == 0)] = True  # row 0: the pad after EOS is not valid
    texts = pipeline.decode_completions(tok, tokens_NC, valid_NC)
    assert texts == [text, text]
    assert [gsm8k.format_reward(t) + gsm8k.accuracy_reward(t, "#### 5") for t in texts] == [
        3.0,
        3.0,
    ]
    # Kept, the marker would break the format reward: what the old decoding did.
    kept = tok.decode([int(t) for t in tokens_NC[1][valid_NC[1]]])
    assert kept.startswith("<|im_start|>") and gsm8k.format_reward(kept) == 0.0


def test_prompt_comes_from_data_system_prompt_and_prompt_format(tmp_path, arith_model_dir):
    """The prompt the trainer encodes: the configured system prompt through the chat template, none
    when it is empty, or the plain format without a template; a bad format names the key."""
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.data import prompt_batches as pipeline
    from cppo_jax.models import Tokenizer

    tok = Tokenizer.from_dir(arith_model_dir)
    ex = [{"question": "What is 2 + 3?", "solution": "#### 5", "answer": "5"}]

    def prompt(*overrides):
        d = small_config(tmp_path, arith_model_dir, "data.max_prompt_len=200", *overrides).data
        enc = pipeline.encode_prompts(
            ex, tok, d.task, d.max_prompt_len, d.long_prompts, d.system_prompt, d.prompt_format
        )
        return tok.decode([int(t) for t in enc.ids_nP[0][enc.valid_nP[0]]])

    default = prompt()
    assert "<|im_start|>system\nThink in <think> </think>" in default  # the task's own (None)
    custom = prompt("data.system_prompt=Answer briefly.")
    assert "<|im_start|>system\nAnswer briefly.<|im_end|>" in custom
    assert "<|im_start|>system" not in prompt("data.system_prompt=")
    assert custom.endswith("<|im_start|>assistant\n")
    assert prompt("data.system_prompt=Be brief.", "data.prompt_format=plain") == (
        "Be brief.\nWhat is 2 + 3?\n"
    )
    with pytest.raises(ConfigError, match="data.prompt_format.*'chat', 'plain'"):
        small_config(tmp_path, arith_model_dir, "data.prompt_format=jinja")


def test_model_attention_reaches_the_trainers_model(tmp_path, arith_model_dir):
    cfg = small_config(tmp_path, arith_model_dir, "model.attention=xla", "trainer.steps=1")
    trainer = Trainer(cfg)
    try:
        assert nnx.merge(trainer.actor.graphdef, trainer.params).cfg.attention == "xla"
    finally:
        trainer.close()


def test_reference_is_a_compute_dtype_copy_with_the_policys_logps(tmp_path, arith_model_dir):
    """bf16 compute, float32 params, beta > 0: the reference (forwards only) is held in bf16, half the
    policy's bytes, and its log-probs are the policy's bit for bit (every forward casts each weight to
    the compute dtype before use, so a bf16 copy changes no number)."""
    cfg = small_config(tmp_path, arith_model_dir, "model.dtype=bfloat16", "trainer.steps=1")
    trainer = Trainer(cfg)
    try:
        policy, ref = jax.tree.leaves(trainer.params), jax.tree.leaves(trainer.reference.params)
        assert {x.dtype for x in policy} == {jnp.dtype(jnp.float32)}
        assert {x.dtype for x in ref} == {jnp.dtype(jnp.bfloat16)}
        assert [x.sharding for x in ref] == [x.sharding for x in policy]
        for r, p in zip(ref, policy):
            np.testing.assert_array_equal(np.asarray(r), np.asarray(p.astype(jnp.bfloat16)))
        sh = trainer.shapes
        rng = np.random.default_rng(0)
        vocab = nnx.merge(trainer.actor.graphdef, trainer.params).cfg.vocab_size
        tokens_MT = jnp.asarray(rng.integers(1, vocab, (sh.M, sh.P + sh.C)), jnp.int32)
        valid_MT = jnp.ones((sh.M, sh.P + sh.C), bool)
        want = np.asarray(trainer.actor.logps(trainer.params, tokens_MT, valid_MT))
        got = np.asarray(trainer.actor.logps(trainer.reference.params, tokens_MT, valid_MT))
        np.testing.assert_array_equal(got, want)
    finally:
        trainer.close()
