"""Non-finite numbers and hostile model output, through `Trainer.train` (the shared tiny Trainer).

Promises (docs/reliability.md): a NaN or inf reward is detected, its step's update skipped (params
unchanged) and logged; the streak counter resets on a good step, and `trainer.max_nan_streak` bad steps
in a row stop the run with the last good state checkpointed. A completion of only special tokens, or one
that runs to `rollout.max_new_tokens` without EOS, is scored and logged like any other. (NaN in the loss or
gradients: tests/test_trainer.py::test_nonfinite_loss_skips_updates_then_stops_with_state_saved.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cppo_jax.rollout.embedded.sampling import Samples
from cppo_jax.train.checkpoint import Checkpointer
from cppo_jax.train.trainer import NonFiniteError
from tests.reliability.runs import metrics_steps, read_events, rewind


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_nonfinite_rewards_skip_reset_then_stop_with_the_last_good_state(
    shared_trainer, tmp_path, monkeypatch
):
    trainer, init = shared_trainer
    run_dir = tmp_path / "run"
    rewind(trainer, run_dir, *init)
    score = trainer.host.rewards.score
    poison = {2: np.nan, 4: np.inf, 5: -np.inf}  # 1-based steps; step 3 is good in between
    calls = {"train": 0}
    params_after = {}

    def scored(texts, solutions, *only):
        total, per_fn, stats = score(texts, solutions, *only)
        if len(texts) == trainer.shapes.Q * trainer.shapes.G:  # a training step, not an evaluation
            calls["train"] += 1
            bad = poison.get(calls["train"])
            if bad is not None:
                total = np.asarray(total, np.float64).copy()
                total[1] = bad
        return total, per_fn, stats

    def progress(metrics):
        params_after[int(metrics["step"])] = _leaves(trainer.params)

    monkeypatch.setattr(trainer.host.rewards, "score", scored)
    with pytest.raises(NonFiniteError, match="2 non-finite steps in a row") as info:
        trainer.train(progress=progress)
    assert "max_nan_streak" in str(info.value)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["update_skipped"] for r in rows] == [0.0, 1.0, 0.0, 1.0]  # step 5 raised
    skipped = [e["step"] for e in read_events(run_dir) if e["event"] == "nonfinite_rewards"]
    assert skipped == [1, 3, 4]  # 0-based indices of steps 2, 4, 5
    # A skipped step leaves the params as they were.
    for a, b in zip(params_after[1], params_after[2]):
        np.testing.assert_array_equal(a, b)
    # The stop saved the last good state: the params after step 3.
    ckpt = Checkpointer(run_dir / "checkpoints")
    state, meta = ckpt.restore(None, trainer.state())
    assert meta["step"] == 4 and meta["nan_streak"] == 2
    for a, b in zip(_leaves(state["params"]), params_after[3]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_special_token_and_max_length_completions_score_and_log(
    shared_trainer, tmp_path, monkeypatch
):
    """Rollouts replaced by hostile completions: only special tokens (im_start/im_end/pad ids), or a
    run of one token to max_new_tokens without EOS. The steps train, score 0 and log the text."""
    trainer, init = shared_trainer
    run_dir = tmp_path / "run"
    rewind(trainer, run_dir, *init, "trainer.steps=2")
    tok, sh = trainer.data.tokenizer, trainer.shapes
    N, C = sh.Q * sh.G, sh.C
    start_id = tok.hf.convert_tokens_to_ids("<|im_start|>")
    tokens = np.full((N, C), tok.pad_id, np.int32)
    valid = np.zeros((N, C), bool)
    finished = np.zeros((N,), bool)
    for n in range(N):
        if n % 2 == 0:  # specials only: <|im_start|> <|endoftext|> <|im_start|> ... <|im_end|>
            ids = [start_id, tok.pad_id] * 2 + [tok.eos_id]
            tokens[n, : len(ids)] = ids
            valid[n, : len(ids)] = True
            finished[n] = True
        else:  # max length, no EOS
            tokens[n] = tok.encode("9")[0]
            valid[n] = True
    hostile = Samples(
        jnp.asarray(tokens),
        jnp.zeros((N, C), jnp.float32),
        jnp.asarray(valid),
        jnp.asarray(finished),
        jnp.int32(C),
    )
    generate = trainer.rollout.backend.generate
    monkeypatch.setattr(
        trainer.rollout.backend,
        "generate",
        lambda params, prompt_QP, *a: (
            hostile if prompt_QP.shape[0] == sh.Q else generate(params, prompt_QP, *a)
        ),
    )
    trainer.train()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics_steps(run_dir) == [1, 2]
    for r in rows:
        assert r["update_skipped"] == 0.0 and np.isfinite(r["loss"])
        assert r["rewards/arith_accuracy/mean"] == 0.0
        assert r["completions/clipped_ratio"] == 0.5 and r["completions/max_length"] == C
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    # Completion 0 of each question is specials only: decoded with them skipped (as released), empty.
    assert samples and all(s["completion"] == "" for s in samples)
