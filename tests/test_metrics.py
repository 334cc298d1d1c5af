"""Metrics with TRL's names and definitions, evaluation in TensorBoard, and what the launch prints."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cppo_jax.config.schema import (
    Config,
)
from cppo_jax.observe.runlog import reward_metrics
from tests.test_trainer import small_config

ROOT = Path(__file__).resolve().parents[1]
EPS64 = np.finfo(np.float64).eps
EPS32 = float(np.finfo(np.float32).eps)


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} read back from the TFRecord event files tensorboardX wrote."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]  # after length and its crc
            pos += 12 + length + 4  # and the record's crc
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


# ------------------------------------------------------------------------------ pure definitions


def test_reward_metrics_follow_trl_definitions():
    """reward_std is the mean of the per-question stds (ddof 1); a group of equal rewards whose float
    mean is inexact still counts as zero-std; per-function std skips abstentions (NaN)."""
    rewards_QG = np.array([[0.1, 0.1, 0.1], [0.0, 1.0, 3.0], [2.0, 2.5, 0.5]])
    per_fn = {"acc": [0.0, 2.0, np.nan, 2.0, 0.0, 0.0, 2.0, 2.0, 2.0], "fmt": [1.0] * 9}
    lengths_N = np.array([3, 12, 12, 5, 7, 12, 1, 2, 12])
    finished_N = lengths_N < 12
    m = reward_metrics(rewards_QG, per_fn, lengths_N, finished_N)

    groups = rewards_QG.tolist()
    flat = [x for g in groups for x in g]
    stds = [statistics.stdev(g) for g in groups]
    assert np.std(groups[0]) != 0.0  # the float mean of three 0.1s is not exactly 0.1
    rtol = 16 * EPS64
    np.testing.assert_allclose(m["reward"], statistics.fmean(flat), rtol=rtol)
    np.testing.assert_allclose(m["reward_std"], statistics.fmean(stds), rtol=rtol)
    assert m["reward_std"] != pytest.approx(statistics.stdev(flat))  # not the std over all Q G
    assert m["frac_reward_zero_std"] == pytest.approx(1 / 3, rel=rtol)
    acc = [x for x in per_fn["acc"] if not math.isnan(x)]
    np.testing.assert_allclose(m["rewards/acc/mean"], statistics.fmean(acc), rtol=rtol)
    np.testing.assert_allclose(m["rewards/acc/std"], statistics.stdev(acc), rtol=rtol)
    assert m["rewards/fmt/std"] == 0.0
    terminated = [n for n in lengths_N.tolist() if n < 12]
    assert m["completions/mean_terminated_length"] == pytest.approx(statistics.fmean(terminated))
    assert m["completions/min_terminated_length"] == min(terminated)
    assert m["completions/max_terminated_length"] == max(terminated)
    assert m["completions/clipped_ratio"] == pytest.approx(4 / 9)
    assert (m["completions/min_length"], m["completions/max_length"]) == (1, 12)


def test_reward_metrics_when_nothing_terminates_and_one_completion_per_question():
    """TRL's edge cases: no completion ended with EOS (terminated lengths 0); G = 1 (std 0)."""
    m = reward_metrics(np.array([[1.0], [0.0]]), {"f": [1.0, 0.0]}, [4, 4], [False, False])
    assert m["completions/mean_terminated_length"] == 0.0
    assert m["completions/clipped_ratio"] == 1.0
    assert m["reward_std"] == 0.0 and m["frac_reward_zero_std"] == 1.0


# ------------------------------------------------------------------------------ in a trainer


def _config(out_dir: Path, model_dir: Path, *overrides: str) -> Config:
    """The trainer tests' tiny config, with mu = 2, a linear schedule and TensorBoard on."""
    return small_config(
        out_dir,
        model_dir,
        "cppo.mu=2",
        "optim.schedule=linear",
        "logging.tensorboard=true",
        *overrides,
    )


@pytest.mark.slow
def test_trainer_logs_learning_rate_entropy_num_tokens_and_eval_in_tensorboard(
    tmp_path, arith_model_dir
):
    from cppo_jax.train.trainer import Trainer

    cfg = _config(tmp_path, arith_model_dir)
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [
        json.loads(x) for x in (trainer.host.out_dir / "metrics.jsonl").read_text().splitlines()
    ]
    steps, mu, G = 3, 2, 4
    # Linear decay from lr to 0 over steps * mu updates; a row reports its step's last update.
    for row in rows:
        u = row["step"] * mu - 1
        assert row["learning_rate"] == pytest.approx(1e-3 * (1 - u / (steps * mu)), rel=4 * EPS32)
    # Entropy of the next-token distributions, in nats: between 0 and log V.
    for row in rows:
        assert 0.0 < row["entropy"] <= math.log(trainer.data.tokenizer.vocab_size) * (1 + 4 * EPS32)
    # num_tokens: prompt and completion tokens of every sampled sequence, accumulated.
    total = 0
    for i, row in enumerate(rows):
        prompts = trainer.data.train_set.take(np.asarray(trainer.data.order[i]))
        n = len(prompts.examples) * G
        total += int(prompts.valid_nP.sum()) * G + round(row["completions/mean_length"] * n)
        assert row["num_tokens"] == total
        # The sampler's decode work: all n rows every step (no rollout.compact), some of it useful.
        assert row["rollout/row_steps"] % n == 0 and row["rollout/row_steps"] > 0
        assert 0.0 < row["rollout/useful_fraction"] <= 1.0
    # Every logged key is documented in docs/metrics.md under its own name.
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for key in rows[0]:
        name = re.sub(r"^rewards/arith_(accuracy|format)/", "rewards/<func>/", key)
        assert f"`{name}`" in doc, f"{key} is logged but not documented in docs/metrics.md"
    for key in ("reward_std", "rewards/arith_accuracy/std", "completions/mean_terminated_length"):
        assert key in rows[0], key
    tb = tensorboard_scalars(trainer.host.out_dir / "tensorboard")
    assert sorted(tb["learning_rate"]) == [1, 2, 3]
    assert sorted(tb["eval/test/accuracy"]) == [0, 3]  # before and after training, steps done
    events = [
        json.loads(x) for x in (trainer.host.out_dir / "events.jsonl").read_text().splitlines()
    ]
    last = [e for e in events if e["event"] == "eval"][-1]
    assert tb["eval/test/accuracy"][3] == pytest.approx(last["accuracy"], rel=EPS32)
    assert tb["eval/test/sampled_accuracy_strict"][3] == pytest.approx(
        last["sampled_accuracy_strict"], rel=EPS32
    )


# ------------------------------------------------------------------------------ the launch command

# A user's reward file as TRL's GRPOTrainer quick start writes one: keyword lists in, list of floats out.
USER_REWARDS = """
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]
"""


@pytest.fixture(scope="module")
def launched(tmp_path_factory, arith_model_dir):
    """`python -m cppo_jax.launch --config configs/tiny_cpu.py ...` with a user's TRL-style reward file
    (by its path) and the format reward only (no accuracy reward), the progress bar on, W&B offline;
    stdout and stderr merged."""
    tmp = tmp_path_factory.mktemp("launch")
    (tmp / "my_rewards.py").write_text(USER_REWARDS)
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the reward file is found by its path alone
    cmd = [
        sys.executable,
        "-m",
        "cppo_jax.launch",
        "--config",
        str(ROOT / "configs" / "tiny_cpu.py"),
        f"model.init_checkpoint={arith_model_dir}",
        f"reward.funcs={tmp / 'my_rewards.py'}:reward_len,arith_format",
        "reward.weights=1.0,1.0",
        "reward.num_workers=1",
        "data.num_train=64",
        "data.num_test=6",
        "cppo.num_generations=4",
        "cppo.questions_per_step=2",
        "cppo.pruning_rate=0.5",
        "rollout.max_new_tokens=12",
        "trainer.steps=3",
        "trainer.eval_every=2",
        f"trainer.out_dir={tmp}",
        "trainer.run_name=user",
        "logging.plot=false",
        "logging.progress=true",
        "logging.wandb=true",
        "logging.wandb_mode=offline",
        "logging.wandb_project=cppo-tests",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, tmp / "user"


@pytest.mark.slow
def test_evaluation_scores_accuracy_when_training_rewards_exclude_it(launched):
    """Issue #22: training rewards without the task's accuracy function no longer crash evaluation."""
    proc, run_dir = launched
    assert proc.returncode == 0, proc.stdout[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 3]
    for e in evals:
        assert 0.0 <= e["accuracy_strict"] <= 1.0 and 0.0 <= e["accuracy_released"] <= 1.0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The TRL-style reward ran on every completion: -|20 - length| < 0 (a failed call would score 0).
    for row in rows:
        assert row["rewards/reward_len/mean"] < 0 and row["rewards/reward_len/std"] >= 0
    assert "accuracy" not in rows[0]  # no training accuracy reward, so no sampled training accuracy


@pytest.mark.slow
def test_progress_bar_is_closed_before_the_summary_which_is_printed_once(launched):
    proc, _ = launched
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    assert out.count("held-out accuracy") == 1, out[-3000:]
    summary_at = out.index("held-out accuracy")
    assert "3/3" in out[:summary_at]  # the bar reached its end before the summary
    assert "cppo:" not in out[summary_at:], out[summary_at:]  # and never printed again after it
    assert "acc=" not in out  # no accuracy among the training rewards: none shown


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (`run-*.wandb`): a 7-byte header (`:W&B`, magic,
    version), then LevelDB's log format: 32 KiB blocks of records `crc32c(4) length(2) type(1) data`,
    a record split over blocks as FIRST (2), MIDDLE (3), LAST (4); FULL (1) is whole."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, parts, records = 7, 32768, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's last bytes are padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_evaluations_and_config(launched):
    proc, run = launched
    assert proc.returncode == 0, proc.stdout[-3000:]
    (file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(file)
    (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert info.project == "cppo-tests" and info.display_name == "user"
    history: dict[str, dict[int, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            for key, value in row.items():
                history.setdefault(key, {})[int(row["_step"])] = value
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(history["reward"]) == [1, 2, 3]
    for row in metrics:
        for key in ("reward", "learning_rate", "kl", "completions/mean_length"):
            assert history[key][row["step"]] == pytest.approx(row[key], rel=EPS64), key
    evals = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e["event"] == "eval"]
    assert sorted(history["eval/test/accuracy"]) == [e["step"] for e in evals] == [0, 2, 3]
    config = {i.key: json.loads(i.value_json) for i in info.config.update}
    assert config["cppo"]["pruning_rate"] == 0.5 and config["trainer"]["run_name"] == "user"
