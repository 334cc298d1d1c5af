"""RL that learns: a short seeded run of the demo raises accuracy on held-out questions it never saw.

The demo's own config (configs/tiny_cpu.py: the shipped warm start, CPPO p = 0.875 with allocation,
G = 16, the format + accuracy reward) with only its step count cut. Figures behind the margin are in
docs/learning.md: 10 steps take greedy held-out accuracy from 2.3% to 35.5% / 30.1% / 32.4% (trainer
seeds 0, 1, 2: gain +30.4 points, standard deviation 2.7), so a 15-point floor fails only if learning
itself breaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cppo_jax.config.files import load_config
from cppo_jax.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
MIN_GAIN = 0.15  # 5.6 standard deviations of the seed-to-seed spread of the gain
MIN_SAMPLED_GAIN = 0.05  # about 2 standard errors of a 256-question one-sample accuracy


def test_short_run_raises_held_out_accuracy(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu.py",
        [
            f"trainer.steps={STEPS}",
            f"trainer.out_dir={tmp_path}",
            "trainer.checkpoint_every=0",
            "logging.progress=false",
            "logging.plot=false",
        ],
    )
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
        trained = {
            trainer.data.train_set.examples[i]["solution"]
            for step in range(STEPS)
            for i in trainer.data.order[step]
        }
        held_out = [ex["solution"] for ex in trainer.data.test_set.examples]
    finally:
        trainer.close()
    # The solution string spells out the whole arithmetic: no held-out problem was trained on.
    assert len(trained) == STEPS * trainer.shapes.Q
    assert not trained & set(held_out)
    assert len(held_out) >= 256
    before, after = summary["before"], summary["after"]
    print(
        f"\nheld-out accuracy after {STEPS} steps: greedy {before['accuracy']:.1%} -> "
        f"{after['accuracy']:.1%}, sampled {before['sampled_accuracy']:.1%} -> "
        f"{after['sampled_accuracy']:.1%}"
    )
    assert after["accuracy"] >= before["accuracy"] + MIN_GAIN, (before, after)
    # One T = 1 sample per question, same seeds before and after: +12.5 / +11.8 points measured.
    assert after["sampled_accuracy"] >= before["sampled_accuracy"] + MIN_SAMPLED_GAIN, (
        before,
        after,
    )


def test_direct_style_has_the_r1_layout_and_the_answer():
    from cppo_jax.rewards.gsm8k import accuracy_reward, format_reward
    from cppo_jax.tasks import arith

    for ex in arith.generate(50, seed=0, split="train"):
        text = arith.direct_completion(ex)
        assert "=" not in text and ";" not in text  # no worked steps
        assert format_reward(text) == 1.0 and accuracy_reward(text, ex["solution"]) == 2.0
        start, *rest = arith.steps_of(ex)
        assert text.startswith(f"<think>{start.split('=')[0]}")
        assert text.count("+") + text.count("-") == len(rest) + 1


def test_direct_fraction_out_of_range_names_the_key():
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.train.sft import SFTConfig

    with pytest.raises(ConfigError, match=r"sft\.direct_fraction.*1\.5.*\[0, 1\]"):
        SFTConfig(direct_fraction=1.5)


@pytest.mark.parametrize(
    "fields, key",
    [
        (dict(steps=20, warmup=30), "sft.warmup"),  # optax's cosine decay needs steps > warmup
        (dict(steps=0), "sft.steps"),
        (dict(batch=0), "sft.batch"),
        (dict(lr=0.0), "sft.lr"),
    ],
)
def test_sft_settings_out_of_range_name_the_key(fields, key):
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.train.sft import SFTConfig

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        SFTConfig(**fields)
