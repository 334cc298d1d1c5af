"""Tests of cppo_jax.packing.pack: first-fit decreasing of a step's sequences into R rows of L tokens
(host code: NumPy, no JAX)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo_jax.packing import pack as packing

SETTINGS = settings(max_examples=60, deadline=None)


def padded_batch(p_M, c_M, P, C, seed=0):
    """tokens_MT with distinct token ids per (row, slot), valid_MT left/right padded by p_M, c_M."""
    M = len(p_M)
    tokens_MT = (np.arange(M * (P + C)).reshape(M, P + C) + 1).astype(np.int32)
    slot = np.arange(P + C)
    valid_MT = ((slot >= P - np.asarray(p_M)[:, None]) & (slot < P)) | (
        (slot >= P) & (slot < P + np.asarray(c_M)[:, None])
    )
    tokens_MT = np.where(valid_MT, tokens_MT, 0)
    return tokens_MT, valid_MT


@st.composite
def steps(draw):
    P = draw(st.integers(1, 7))
    C = draw(st.integers(1, 11))
    M = draw(st.integers(1, 13))
    p_M = draw(st.lists(st.integers(1, P), min_size=M, max_size=M))
    c_M = draw(st.lists(st.integers(0, C), min_size=M, max_size=M))
    L = draw(st.integers(P + C, 2 * (P + C) + 3))
    return P, C, np.array(p_M), np.array(c_M), L


@SETTINGS
@given(steps())
def test_every_token_placed_once_in_order(step):
    P, C, p_M, c_M, L = step
    tokens_MT, valid_MT = padded_batch(p_M, c_M, P, C)
    n_M = p_M + c_M
    R = packing.rows_for(n_M, L)
    packed = packing.pack(tokens_MT, valid_MT, P, R, L)
    # every real token appears exactly once (token ids are distinct), padding slots hold none
    placed = packed.tokens_RL[packed.segment_RL > 0]
    assert sorted(placed.tolist()) == sorted(tokens_MT[valid_MT].tolist())
    assert (packed.tokens_RL[packed.segment_RL == 0] == 0).all()
    assert packed.tokens_placed == n_M.sum()
    for m in range(len(n_M)):
        r, s, n = packed.row_M[m], packed.start_M[m], n_M[m]
        # contiguous, in order, one segment, positions from 0
        np.testing.assert_array_equal(packed.tokens_RL[r, s : s + n], tokens_MT[m][valid_MT[m]])
        assert len(set(packed.segment_RL[r, s : s + n].tolist())) == 1
        np.testing.assert_array_equal(packed.positions_RL[r, s : s + n], np.arange(n))
        # completion token j is the target of prediction src_MC[m, j] (slot l predicts l + 1)
        flat = packed.src_MC[m, : c_M[m]]
        r_j, l_j = flat // (L - 1), flat % (L - 1) + 1
        np.testing.assert_array_equal(packed.tokens_RL[r_j, l_j], tokens_MT[m, P : P + c_M[m]])
        # ... and the slot predicting it is in the same sequence
        np.testing.assert_array_equal(
            packed.segment_RL[r_j, l_j - 1], packed.segment_RL[r, s].repeat(c_M[m])
        )
    # segments of a row are numbered 1, 2, ... left to right
    for r in range(R):
        seg = packed.segment_RL[r][packed.segment_RL[r] > 0]
        starts = np.r_[True, seg[1:] != seg[:-1]]
        np.testing.assert_array_equal(seg[starts], np.arange(1, starts.sum() + 1))


@SETTINGS
@given(steps())
def test_rows_for_is_the_fewest_rows_that_pack(step):
    P, C, p_M, c_M, L = step
    tokens_MT, valid_MT = padded_batch(p_M, c_M, P, C)
    R = packing.rows_for(p_M + c_M, L)
    packing.pack(tokens_MT, valid_MT, P, R, L)
    assert -(-(p_M + c_M).sum() // L) <= R  # no fewer rows than the tokens need
    if R > 1:
        with pytest.raises(ValueError, match="trainer.pack_rows"):
            packing.pack(tokens_MT, valid_MT, P, R - 1, L)


def test_first_fit_decreasing_placement():
    # lengths 5, 3, 4, 2, 2 into rows of 7: 5 -> row 0, 4 -> row 1, 3 -> row 1, 2 -> row 0, 2 -> row 2
    row_M, start_M = packing.first_fit_decreasing(np.array([5, 3, 4, 2, 2]), rows=3, length=7)
    np.testing.assert_array_equal(row_M, [0, 1, 1, 0, 2])
    np.testing.assert_array_equal(start_M, [0, 4, 0, 5, 0])


def test_sequence_longer_than_the_row_names_pack_len():
    tokens_MT, valid_MT = padded_batch([3, 2], [5, 1], P=3, C=5)
    with pytest.raises(packing.DoesNotFitError, match=r"sequence 0 has 8 .*pack_len=7") as e:
        packing.pack(tokens_MT, valid_MT, 3, rows=4, length=7)
    assert (e.value.rows, e.value.longest) == (0, 8)  # what the trainer's `pack_overflow` logs


def test_step_that_does_not_fit_names_pack_rows_and_the_rows_needed():
    tokens_MT, valid_MT = padded_batch([3] * 4, [4] * 4, P=3, C=4)
    with pytest.raises(packing.DoesNotFitError, match=r"trainer.pack_rows=3 .* needs 4") as e:
        packing.pack(tokens_MT, valid_MT, 3, rows=3, length=8)
    assert (e.value.rows, e.value.longest) == (4, 0)


def test_bad_padding_and_mask_are_refused_naming_the_row():
    tokens_MT, valid_MT = padded_batch([2, 2], [2, 2], P=3, C=3)
    gap = valid_MT.copy()
    gap[1, 3] = False  # a hole at the completion's start
    with pytest.raises(ValueError, match="valid_MT row 1"):
        packing.pack(tokens_MT, gap, 3, rows=2, length=6)
    no_prompt = valid_MT.copy()
    no_prompt[0, :3] = False
    with pytest.raises(ValueError, match="valid_MT row 0: a completion without a prompt"):
        packing.pack(tokens_MT, no_prompt, 3, rows=2, length=6)
    mask_MC = np.zeros((2, 3), np.float32)
    mask_MC[1, 2] = 1.0  # past the completion's 2 tokens
    with pytest.raises(ValueError, match="mask_MC row 1"):
        packing.pack(tokens_MT, valid_MT, 3, rows=2, length=6, mask_MC=mask_MC)


def test_packing_imports_no_jax():
    import subprocess
    import sys

    code = "import sys, cppo_jax.packing.pack; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
