"""Question order (grain): deterministic, per-epoch complete, process-sharded, resumable; validation split."""

from __future__ import annotations

import dataclasses

import grain
import numpy as np
import pytest

from cppo_jax.config.schema import DataConfig
from cppo_jax.data import prompt_batches as pipeline


def _batches(ds, steps: int) -> list[list[int]]:
    return [[int(i) for i in ds[s]] for s in range(steps)]


def test_order_is_deterministic_by_seed_and_seeds_differ():
    a = _batches(pipeline.question_order(23, 4, seed=3, shuffle=True), 12)
    b = _batches(pipeline.question_order(23, 4, seed=3, shuffle=True), 12)
    c = _batches(pipeline.question_order(23, 4, seed=4, shuffle=True), 12)
    assert a == b
    assert a != c
    assert all(len(x) == 4 for x in a)


def test_every_question_once_per_epoch_with_a_new_order_each_epoch():
    n, Q = 24, 6  # n % Q == 0: each epoch is exactly n / Q steps
    ds = pipeline.question_order(n, Q, seed=0, shuffle=True)
    per_epoch = n // Q
    epochs = [
        np.concatenate([ds[s] for s in range(e * per_epoch, (e + 1) * per_epoch)]) for e in range(3)
    ]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(n))
    assert epochs[0].tolist() != epochs[1].tolist()  # reshuffled each epoch
    unshuffled = pipeline.question_order(n, Q, seed=0, shuffle=False)
    assert np.concatenate([unshuffled[s] for s in range(per_epoch)]).tolist() == list(range(n))


def test_process_shards_are_disjoint_and_make_up_the_global_batch():
    n, Q, P = 37, 12, 4
    whole = pipeline.question_order(n, Q, seed=7, shuffle=True)
    shards = [
        pipeline.question_order(n, Q, seed=7, shuffle=True, process_index=i, process_count=P)
        for i in range(P)
    ]
    for step in range(9):
        parts = [np.asarray(s[step]) for s in shards]
        assert all(len(p) == Q // P for p in parts)
        assert (
            np.concatenate(parts).tolist() == np.asarray(whole[step]).tolist()
        )  # contiguous slices
        flat = np.concatenate(parts)
        assert len(set(flat.tolist())) == Q  # disjoint (Q <= n: no repeats within a step)


def test_process_sharding_errors_name_the_problem():
    with pytest.raises(ValueError, match="does not split evenly over 5 processes"):
        pipeline.question_order(20, 12, 0, True, process_index=0, process_count=5)
    with pytest.raises(ValueError, match="process_index=3"):
        pipeline.question_order(20, 12, 0, True, process_index=3, process_count=3)
    with pytest.raises(ValueError, match="no questions"):
        pipeline.question_order(0, 4, 0, True)


def test_resume_at_step_s_draws_the_uninterrupted_batch():
    make = lambda: pipeline.question_order(  # noqa: E731
        19, 8, seed=5, shuffle=True, process_index=1, process_count=2
    )
    no_threads = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    uninterrupted = iter(make().to_iter_dataset(no_threads))
    seen = [next(uninterrupted).tolist() for _ in range(10)]
    for s in (0, 3, 9):
        assert make()[s].tolist() == seen[s]  # random access by step: what the trainer does
    # grain's own iterator state round-trips too.
    it = iter(make().to_iter_dataset(no_threads))
    for _ in range(4):
        next(it)
    state = it.get_state()
    resumed = iter(make().to_iter_dataset(no_threads))
    resumed.set_state(state)
    assert next(resumed).tolist() == seen[4]


def test_split_validation_is_seeded_disjoint_and_complete():
    examples = [{"question": f"q{i}"} for i in range(30)]
    train, val = pipeline.split_validation(examples, 7, seed=1)
    assert len(val) == 7 and len(train) == 23
    ids = lambda xs: [x["question"] for x in xs]  # noqa: E731
    assert not set(ids(train)) & set(ids(val))
    assert sorted(ids(train) + ids(val)) == sorted(ids(examples))
    assert ids(train) == [q for q in ids(examples) if q not in set(ids(val))]  # order kept
    assert pipeline.split_validation(examples, 7, seed=1) == (train, val)
    assert pipeline.split_validation(examples, 7, seed=2)[1] != val
    assert pipeline.split_validation(examples, 0, seed=1) == (examples, [])
    with pytest.raises(ValueError, match="leaves no training questions"):
        pipeline.split_validation(examples, 30, seed=1)


def test_holdout_validation_uses_arith_validation_split_else_train_sample():
    cfg = DataConfig(task="arith", train="arith", val_size=5, num_train=40)
    train, _ = pipeline.load_examples(cfg, "train")
    kept, val = pipeline.holdout_validation(cfg, train)
    assert kept == train and len(val) == 5
    test, _ = pipeline.load_examples(cfg, "test")
    questions = {ex["question"] for ex in val}
    assert not questions & {ex["question"] for ex in train + test}
    other = dataclasses.replace(
        cfg, train="somewhere.jsonl"
    )  # a non-arith source: held out of train
    kept, val = pipeline.holdout_validation(other, train)
    assert (
        len(kept) == 35
        and len(val) == 5
        and not {e["question"] for e in val} & {e["question"] for e in kept}
    )
