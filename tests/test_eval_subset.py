"""Evaluation before training bounded by default (`trainer.eval_subset`): the evaluations before and
during training score a fixed sample of the test split, said once in the log; the last scores the
whole split and the sample within it (like for like with the first); a progress bar counts the
questions of a long evaluation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import apply_overrides
from cppo_jax.train.evaluation import subset_ids
from cppo_jax.train.trainer import Trainer
from tests.test_trainer import small_config


def _config(tmp_path, model_dir, *extra):
    return small_config(
        tmp_path,
        model_dir,
        "data.num_test=20",
        "trainer.eval_subset=7",
        "trainer.steps=2",
        "trainer.eval_every=1",
        *extra,
    )


@pytest.mark.slow
def test_before_and_during_a_sample_after_the_whole_split_and_the_sample_in_it(
    tmp_path, arith_model_dir
):
    trainer = Trainer(_config(tmp_path, arith_model_dir))
    try:
        summary = trainer.train()
        events = [
            json.loads(x)
            for x in (trainer.host.out_dir / "events.jsonl").read_text().split("\n")
            if x
        ]
        # The sample's share of the last evaluation is the sample scored alone by the same params
        # (the trained ones, which the last evaluation scored).
        alone = trainer.evaluate(2, sampled=True)
    finally:
        trainer.close()
    before, after = summary["before"], summary["after"]
    assert (before["n"], before["split_n"]) == (7, 20) and "subset_n" not in before
    assert (after["n"], after["split_n"], after["subset_n"]) == (20, 20, 7)
    evals = [e for e in events if e["event"] == "eval"]
    assert [(e["step"], e["n"]) for e in evals] == [(0, 7), (1, 7), (2, 20)]  # 1: eval_every
    (said,) = [e for e in events if e["event"] == "eval_subset"]  # once, before the first
    assert (said["questions"], said["of"]) == (7, 20) and "trainer.eval_subset" in said["note"]
    assert events.index(said) < events.index(evals[0])
    summary_md = (trainer.host.out_dir / "summary.md").read_text()
    assert "7 test questions" in summary_md and "whole split (20 questions)" in summary_md

    ids = subset_ids(trainer)
    assert len(ids) == 7 and len(set(ids)) == 7 and np.all(np.diff(ids) > 0)
    assert np.array_equal(subset_ids(trainer), ids)  # a fixed draw (data.seed): the same each time
    assert alone["n"] == 7
    for key in ("accuracy_strict", "accuracy_released", "sampled_accuracy_strict"):
        assert alone[key] == after[f"subset_{key}"], key
    # A sample as large as the split, or 0, is the whole split.
    for k in (0, 20, 50):
        cfg = apply_overrides(trainer.cfg, [f"trainer.eval_subset={k}"])
        assert subset_ids(SimpleNamespace(data=trainer.data, cfg=cfg)) is None


def test_a_long_evaluation_shows_a_progress_bar_unless_progress_is_off(
    tmp_path, arith_model_dir, capsys
):
    trainer = Trainer(_config(tmp_path, arith_model_dir))
    try:
        for progress in (True, False):  # logging.progress is read by each evaluation
            trainer.cfg = apply_overrides(trainer.cfg, [f"logging.progress={progress}"])
            capsys.readouterr()
            trainer.evaluate(0, batch_size=2)  # 4 batches of the 7 questions
            err = capsys.readouterr().err
            assert ("eval step 0: 7 of 20 test questions, greedy" in err) == progress, err
    finally:
        trainer.close()


def test_eval_subset_refuses_a_negative_count():
    from cppo_jax.config.schema import Config

    with pytest.raises(ConfigError, match="trainer.eval_subset"):
        apply_overrides(Config(), ["trainer.eval_subset=-1"])
