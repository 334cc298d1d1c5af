"""Tests of cppo_jax.packing.plan: the packed rows `trainer.pack_rows=auto` chooses from a run's lengths
(host code: NumPy, no JAX), and the config key that asks for it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cppo_jax.algo.cppo import Shapes
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.run import TrainerConfig
from cppo_jax.packing import plan as pack_plan

L = 24


def _margin(needed: int) -> int:
    return needed + math.ceil(pack_plan.MARGIN * needed)


@pytest.mark.parametrize("U, M", [(13, 26), (7, 7), (5, 13)])
def test_sequences_of_half_a_row_take_half_the_rows_plus_the_margin(U, M):
    """Every sequence L/2 long (prompt L/4 + completion L/4): first-fit decreasing puts two to a
    row in every step, so the quantile is ceil(M / 2) and R adds the stated margin."""
    prompt_n, completion_n = np.full(11, L // 4), np.full(17, L // 4)
    rows, needed, most = pack_plan.choose_rows(prompt_n, completion_n, U, M, L)
    assert needed == most == math.ceil(M / 2)
    assert rows == min(M, _margin(needed))


def test_sequences_over_half_a_row_take_all_m_rows():
    rows, needed, _ = pack_plan.choose_rows(np.full(5, L // 2), np.full(5, 1), 4, 8, L)
    assert needed == rows == 8
    choice = pack_plan.RowChoice(rows, L, needed, 8, "lengths")
    assert "packing saves nothing" in choice.note(8)


def test_mixed_lengths_take_the_quantile_of_the_simulated_steps():
    """Short and long sequences: R sits between the fewest rows a step can take (all short) and M,
    and it is the same for the same lengths (a fixed seed)."""
    rng = np.random.default_rng(3)
    prompt_n, completion_n = rng.integers(2, 7, 101), rng.integers(1, 17, 101)
    first = pack_plan.choose_rows(prompt_n, completion_n, 11, 22, L)
    assert first == pack_plan.choose_rows(prompt_n, completion_n, 11, 22, L)
    rows, needed, most = first
    tokens_per_row = L / (prompt_n.mean() + completion_n.mean())
    assert 22 / tokens_per_row <= needed <= most <= 22
    assert rows == min(22, _margin(needed))


@pytest.mark.parametrize(
    "rows, M, dp, want",
    [(5, 16, 1, 5), (5, 16, 4, 8), (15, 16, 4, 16), (17, 16, 1, 16), (5, 18, 4, 18)],
)
def test_rows_round_up_to_split_as_the_m_sequences_do(rows, M, dp, want):
    assert pack_plan.round_rows(rows, M, dp) == want


class _WordTokenizer:
    """One token per word (what `solution_lengths` calls of a Hugging Face tokenizer)."""

    def hf(self, texts, add_special_tokens=False):
        assert add_special_tokens is False
        return {"input_ids": [t.split() for t in texts]}


def test_completion_lengths_are_the_reference_solutions_plus_eos_capped_at_c():
    examples = [
        {"solution": "three words here #### 4", "answer": "4"},  # worked: 5 words + EOS
        {"solution": "#### 7", "answer": "7"},  # the answer only: C
        {"solution": "\\boxed{9}", "answer": "9"},  # the answer only: C
        {"solution": " ".join(["w"] * 30), "answer": "w"},  # longer than C: C
    ]
    np.testing.assert_array_equal(
        pack_plan.solution_lengths(examples, _WordTokenizer(), 12), [6, 12, 12, 12]
    )


def test_choice_keeps_a_given_row_count_and_falls_back_to_m_without_lengths():
    shapes = Shapes(Q=4, G=4, k=2, M=8, P=5, C=7, U=4)
    given = pack_plan.choice(TrainerConfig(pack=True, pack_rows=3), shapes)
    assert (given.rows, given.length) == (3, 12)
    assert pack_plan.choice(TrainerConfig(pack=True, pack_rows=0), shapes).rows == 8
    blind = pack_plan.choice(TrainerConfig(pack=True), shapes, None)
    assert blind.rows == 8 and "without the data's lengths" in blind.note(8)
    lengths = (np.full(9, 3), np.full(9, 3), "test lengths")
    auto = pack_plan.choice(TrainerConfig(pack=True, pack_len=12), shapes, lengths, dp=2)
    assert (auto.rows, auto.length) == (pack_plan.round_rows(_margin(4), 8, 2), 12)
    assert "test lengths" in auto.note(8)


def test_pack_rows_is_auto_by_default_and_an_integer_when_given():
    from cppo_jax.config.files import apply_overrides
    from cppo_jax.config.schema import Config

    assert TrainerConfig().pack_rows == "auto"
    assert apply_overrides(Config(), ["trainer.pack_rows=3"]).trainer.pack_rows == 3
    assert apply_overrides(Config(), ["trainer.pack_rows=auto"]).trainer.pack_rows == "auto"
    for bad in ("many", "-1"):
        with pytest.raises(ConfigError, match="trainer.pack_rows"):
            apply_overrides(Config(), [f"trainer.pack_rows={bad}"])


def test_the_run_and_the_plan_choose_the_same_rows(tmp_path, arith_model_dir):
    """The run chooses R from the data it loaded (`roles.build_data`), the plan and the compiled
    programs from the config (`config_choice`): the same lengths, the same R."""
    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.models.tokenizer import Tokenizer
    from cppo_jax.train import roles

    try:
        from test_trainer import small_config
    except ImportError:  # tests/ became a package
        from tests.test_trainer import small_config

    cfg = small_config(tmp_path, arith_model_dir, "trainer.pack=true", "trainer.pack_len=168")
    shapes = shapes_of(cfg)
    data = roles.build_data(cfg, shapes, Tokenizer.from_dir(arith_model_dir))
    lengths = pack_plan.data_lengths(data.train_set, data.tokenizer, shapes.C)
    run = pack_plan.choice(cfg.trainer, shapes, lengths)
    assert run == pack_plan.config_choice(cfg, shapes)
    # arith's sequences (prompt + completion) take over a third of a 168-slot row: two to a row
    assert run.needed == shapes.M // 2 and run.rows == _margin(shapes.M // 2) < shapes.M
