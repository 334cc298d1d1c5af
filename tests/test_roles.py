"""A run's roles built one at a time from a config (`roles.build_<role>`), each checked at its job:
the data's questions, the reference's log-probs (the actor's at step 0, unchanged by updates), the
rollout's shapes, the host's folder and log; and `roles.build` gives the Trainer the same roles."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from cppo_jax.algo import cppo
from cppo_jax.models import Tokenizer
from cppo_jax.parallel import sharding as sharding_lib
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train import optimizer, roles
from tests.test_lora_train import LORA
from tests.test_trainer import small_config


def _pieces(cfg):
    """shapes, mesh, tokenizer, data, actor, params, opt_state: built as `roles.build` does."""
    shapes = cppo.shapes_of(cfg)
    mesh = sharding_lib.make_mesh(cfg.mesh)
    tokenizer = Tokenizer.from_dir(cfg.model.init_checkpoint)
    model = roles.load_model(cfg, cfg.model.init_checkpoint, mesh, tokenizer)
    data = roles.build_data(cfg, shapes, tokenizer)
    actor, params, opt_state = roles.build_actor(
        cfg, model, shapes, mesh, data.num_steps, cfg.model.init_checkpoint
    )
    return shapes, mesh, tokenizer, data, actor, params, opt_state


def _batch(shapes, data, seed=0):
    """A step's batch: M training prompts with random completions, advantages of both signs."""
    rng = np.random.default_rng(seed)
    prompts = data.train_set.take(np.arange(shapes.M) % len(data.train_set))
    tokens_MC = rng.integers(0, data.tokenizer.vocab_size, (shapes.M, shapes.C)).astype(np.int32)
    tokens_MT = np.concatenate([prompts.ids_nP, tokens_MC], axis=1).astype(np.int32)
    valid_MT = np.concatenate([prompts.valid_nP, np.ones_like(tokens_MC, bool)], axis=1)
    mask_MC = np.ones((shapes.M, shapes.C), np.float32)
    adv_M = rng.standard_normal(shapes.M).astype(np.float32)
    return tokens_MT, valid_MT, mask_MC, adv_M


def test_data_gives_each_step_its_questions(tmp_path, arith_model_dir):
    cfg = small_config(tmp_path, arith_model_dir, "trainer.steps=5")
    shapes = cppo.shapes_of(cfg)
    data = roles.build_data(cfg, shapes, Tokenizer.from_dir(arith_model_dir))
    assert data.num_steps == 5 and data.skipper is None
    assert data.val_set is None and len(data.test_set) == cfg.data.num_test
    for step in range(data.num_steps):
        ids = np.asarray(data.ids(step))
        assert ids.shape == (shapes.Q,) and len(set(ids.tolist())) == shapes.Q
        assert ids.min() >= 0 and ids.max() < len(data.train_set)
    # Consecutive steps draw different questions (a shuffled pass over the set).
    assert not np.array_equal(np.asarray(data.ids(0)), np.asarray(data.ids(1)))


@pytest.mark.parametrize("overrides", [(), LORA], ids=["full", "lora"])
def test_reference_is_the_actor_at_step_0_and_stays_there(tmp_path, arith_model_dir, overrides):
    cfg = small_config(tmp_path, arith_model_dir, *overrides)
    shapes, mesh, _, data, actor, params, opt_state = _pieces(cfg)
    reference = roles.build_reference(cfg, actor, params, shapes, mesh)
    tokens_MT, valid_MT, mask_MC, adv_M = _batch(shapes, data)
    ref_MC = np.asarray(reference.logps_of(tokens_MT, valid_MT))
    assert ref_MC.shape == (shapes.M, shapes.C) and np.isfinite(ref_MC).all()
    # Before any update the policy is the reference: the same numbers (a float32 model, the
    # reference's copy in the compute dtype; with LoRA the adapters add exactly 0 as B = 0).
    np.testing.assert_array_equal(np.asarray(actor.logps_of(params, tokens_MT, valid_MT)), ref_MC)

    batch = step_lib.Batch(tokens_MT, valid_MT, mask_MC, adv_M, None, ref_MC, None)
    for _ in range(2):  # the updates donate the params: the reference holds arrays of its own
        params, opt_state, metrics = actor.train_step(params, opt_state, batch, *actor.frozen_args)
    assert not metrics["update_skipped"]
    moved_MC = np.asarray(actor.logps_of(params, tokens_MT, valid_MT))
    assert np.abs(moved_MC - ref_MC).max() > 0  # the actor learned
    np.testing.assert_array_equal(np.asarray(reference.logps_of(tokens_MT, valid_MT)), ref_MC)
    assert int(optimizer.update_count(opt_state)) == 2
    # A constant schedule: the configured rate, as the float32 the optimizer holds.
    assert np.float32(actor.learning_rate(opt_state)) == np.float32(cfg.optim.lr)


def test_no_reference_without_a_kl_term(tmp_path, arith_model_dir):
    cfg = small_config(tmp_path, arith_model_dir, "cppo.beta=0")
    shapes, mesh, _, _, actor, params, _ = _pieces(cfg)
    assert roles.build_reference(cfg, actor, params, shapes, mesh) is None


def test_rollout_returns_what_the_step_needs(tmp_path, arith_model_dir):
    cfg = small_config(tmp_path, arith_model_dir)
    shapes, mesh, tokenizer, data, actor, params, _ = _pieces(cfg)
    rollout = roles.build_rollout(cfg, shapes, tokenizer, actor.graphdef, tmp_path, mesh)
    try:
        drawn = rollout.draw(actor.policy_params(params), data, 0)
        Q, G, P, C, N = shapes.Q, shapes.G, shapes.P, shapes.C, shapes.Q * shapes.G
        assert [ex["question"] for ex in drawn.batch.examples] == [
            data.train_set.examples[i]["question"] for i in np.asarray(data.ids(0))
        ]
        assert drawn.prompt_QP.shape == drawn.pvalid_QP.shape == (Q, P)
        s = drawn.samples
        assert s.tokens_NC.shape == s.valid_NC.shape == s.logp_NC.shape == (N, C)
        assert s.finished_N.shape == (N,)
        assert np.asarray(s.valid_NC).any(axis=1).all()  # every completion has a token
        # The same step and weights sample the same completions (seeded per question and step).
        again = rollout.draw(actor.policy_params(params), data, 0).samples
        np.testing.assert_array_equal(np.asarray(again.tokens_NC), np.asarray(s.tokens_NC))
        assert rollout.G == G
    finally:
        rollout.backend.close()


def test_host_makes_the_run_folder_and_sets_an_earlier_run_aside(tmp_path, arith_model_dir):
    cfg = small_config(tmp_path, arith_model_dir)
    out_dir, earlier = roles.run_folder(cfg)
    assert earlier is None and out_dir == (tmp_path / "run").resolve()
    assert json.loads((out_dir / "config.json").read_text())["cppo"]["beta"] == cfg.cppo.beta
    data = roles.build_data(cfg, cppo.shapes_of(cfg), Tokenizer.from_dir(arith_model_dir))
    host = roles.build_host(cfg, out_dir, earlier, data)
    try:
        assert (
            host.main
            and host.train_fns
            and set(host.eval_rules)
            == {
                "eval/released",
                "eval/strict",
            }
        )
        host.ckpt.save(0, {"x": jax.numpy.zeros(3)}, {"step": 0})  # blocks until durable
        assert host.ckpt.latest_step() == 0
    finally:
        for part in (host.tracer, host.rewards, host.log, host.ckpt):
            part.close()
    events = [json.loads(x) for x in (out_dir / "events.jsonl").read_text().splitlines()]
    assert next(e for e in events if e["event"] == "data")["train"] == len(data.train_set)
    # A fresh run in the same folder moves the earlier one aside.
    again, moved = roles.run_folder(cfg)
    assert again == out_dir and moved is not None and (moved / "checkpoints").is_dir()


def test_build_puts_the_roles_together(tmp_path, arith_model_dir):
    """`roles.build` (the Trainer's set-up): the rollout samples the actor's model, the reference
    is the actor's program on a copy of the initial params, the trained state has the rules' layout."""
    cfg = small_config(tmp_path, arith_model_dir)
    built = roles.build(cfg)
    try:
        assert built.rollout.backend.graphdef is built.actor.graphdef
        assert built.reference.logps is built.actor.logps
        ref_leaves, leaves = jax.tree.leaves(built.reference.params), jax.tree.leaves(built.params)
        assert len(ref_leaves) == len(leaves)
        assert all(r is not p for r, p in zip(ref_leaves, leaves))  # the updates donate `params`
        want = sharding_lib.param_shardings(built.params, built.mesh)
        got = jax.tree.map(lambda x: x.sharding, built.params)
        assert jax.tree.leaves(got) == jax.tree.leaves(want)
    finally:
        built.host.rewards.close()
        built.rollout.backend.close()
        built.host.log.close()
        built.host.ckpt.close()
