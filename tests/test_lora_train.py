"""Training with LoRA (`model.lora.enabled`): gradients and optimizer state for the adapters only,
the base frozen in the compute dtype, the reference = the base with the adapters off (no copy), the
sampler and exports get the adapters merged in; mu > 1 runs the same program. The tests that start
from fresh adapters share one trainer for each mu (`lora_trainer`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cppo_jax.models import load_hf
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train import programs
from cppo_jax.train.trainer import Trainer
from tests.test_trainer import small_config

LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8")


def _batch(trainer, seed=0):
    """A step's batch of random tokens with advantages of both signs (so the loss has a gradient)."""
    sh, rng = trainer.shapes, np.random.default_rng(seed)
    T = sh.P + sh.C
    tokens_MT = rng.integers(0, trainer.data.tokenizer.vocab_size, (sh.M, T)).astype(np.int32)
    valid_MT = np.ones((sh.M, T), bool)
    valid_MT[:, : sh.P // 3] = False  # left padding
    mask_MC = np.ones((sh.M, sh.C), np.float32)
    adv_M = rng.standard_normal(sh.M).astype(np.float32)
    have = programs.batch_fields(trainer.cfg)
    ref = (
        np.asarray(trainer.reference.logps_of(tokens_MT, valid_MT)) if have["ref_logp_MC"] else None
    )
    return step_lib.Batch(tokens_MT, valid_MT, mask_MC, adv_M, None, ref, None)


def _host(tree):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree)


def _flat(tree: dict) -> list:
    """(path, leaf) of a nested dict, in sorted order."""
    return sorted(jax.tree_util.tree_flatten_with_path(tree)[0], key=lambda x: str(x[0]))


@pytest.fixture(scope="module")
def lora_trainer(tmp_path_factory, arith_model_dir):
    """`get(mu)`: the LoRA trainer of `mu` (small_config's), built once for the module, its params
    and optimizer state put back to the fresh adapters' on every call."""
    built = {}

    def get(mu: int) -> Trainer:
        if mu not in built:
            out = tmp_path_factory.mktemp(f"lora_mu{mu}")
            trainer = Trainer(small_config(out, arith_model_dir, *LORA, f"cppo.mu={mu}"))
            built[mu] = trainer, jax.tree.map(jnp.copy, (trainer.params, trainer.opt_state))
        trainer, fresh = built[mu]
        trainer.params, trainer.opt_state = jax.tree.map(jnp.copy, fresh)  # a step donates them
        return trainer

    yield get
    for trainer, _ in built.values():
        trainer.close()


def _plain_logps(trainer, model_dir, tokens_MT, valid_MT):
    """Completion log-probs of the model in `model_dir` loaded without adapters."""
    graphdef, params = nnx.split(load_hf(model_dir, dtype=trainer.cfg.model.dtype))
    _, logps = step_lib.compiled(graphdef, trainer.actor.tx, trainer.actor.spec)
    return np.asarray(logps(params, tokens_MT, valid_MT))


@pytest.mark.slow
@pytest.mark.parametrize("mu", [1, 2])
def test_a_step_changes_only_the_adapters(lora_trainer, mu):
    trainer = lora_trainer(mu)
    adapter_paths = {p for p, _ in nnx.to_flat_state(trainer.params)}
    assert all(str(p[-1]).split("_")[1] in ("a", "b") for p in adapter_paths)
    # The optimizer state mirrors the adapters: no moment of a base weight.
    n_adapter = sum(x.size for x in jax.tree.leaves(trainer.params))
    n_moment = sum(x.size for x in jax.tree.leaves(trainer.opt_state) if x.ndim > 0)
    assert n_moment == 2 * n_adapter  # AdamW's mu and nu
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.actor.frozen))  # compute

    batch = _batch(trainer)
    base_before, adapters_before = _host(trainer.actor.frozen), _host(trainer.params)
    params, _, metrics = trainer.actor.train_step(
        trainer.params, trainer.opt_state, batch, trainer.actor.frozen
    )
    assert float(metrics["update_skipped"]) == 0.0
    assert float(metrics["grad_norm"]) > 0
    jax.tree.map(np.testing.assert_array_equal, _host(trainer.actor.frozen), base_before)
    after = _host(params)
    moved = {
        jax.tree_util.keystr(path): float(np.abs(a - b).max())
        for (path, a), (_, b) in zip(_flat(after), _flat(adapters_before))
    }
    # B = 0 at the start, so the first update's gradient reaches only B (dL/dA = s x^T g B^T);
    # the second update of mu = 2 sees the moved B and moves A too (no weight decay here).
    assert all(v > 0 for k, v in moved.items() if "_b_" in k), moved
    a_moved = [v > 0 for k, v in moved.items() if "_a_" in k]
    assert all(a_moved) if mu > 1 else not any(a_moved), moved


@pytest.mark.slow
def test_reference_is_the_base_and_the_sampler_runs_the_adapted_model(
    lora_trainer, arith_model_dir
):
    trainer = lora_trainer(1)
    assert trainer.reference.params is trainer.actor.frozen  # no reference copy: the base
    batch = _batch(trainer)
    tokens, valid = batch.tokens_MT, batch.valid_MT
    plain = _plain_logps(trainer, arith_model_dir, tokens, valid)
    ref = np.asarray(trainer.reference.logps_of(tokens, valid))
    # The same numbers through the same program (the model without adapters): equal.
    np.testing.assert_array_equal(ref, plain)
    # Fresh adapters (B = 0): the policy is the base too.
    fresh = np.asarray(trainer.actor.logps(trainer.params, tokens, valid, trainer.actor.frozen))
    np.testing.assert_array_equal(fresh, plain)

    for _ in range(3):
        trainer.params, trainer.opt_state, _ = trainer.actor.train_step(
            trainer.params, trainer.opt_state, batch, trainer.actor.frozen
        )
    policy = np.asarray(trainer.actor.logps(trainer.params, tokens, valid, trainer.actor.frozen))
    assert np.abs(policy - plain).max() > 1e-3  # the adapters moved the policy
    np.testing.assert_array_equal(np.asarray(trainer.reference.logps_of(tokens, valid)), plain)

    # The exports' and merged pushes' weights: the adapters merged into the base, a model
    # without adapters that computes the adapted policy (float32 rounding of the sums in
    # another order). The embedded sampler runs the adapters unmerged (test_lora_sampler.py).
    merged = trainer.policy_params()
    _, merged_logps = step_lib.compiled(
        trainer.actor.graphdef, trainer.actor.tx, trainer.actor.spec
    )
    got = np.asarray(merged_logps(merged, tokens, valid))
    tol = 64 * np.finfo(np.float32).eps * np.abs(policy).max()
    np.testing.assert_allclose(got, policy, rtol=0, atol=tol)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        # gradient accumulation over the adapters (M = 4 kept rows in micro-batches of 2), truncated
        # importance sampling against the sampler's log-probs, another pruning rule
        ("trainer.micro_batch=2", "cppo.tis_cap=2", "cppo.metric=largest", "cppo.allocation=false"),
        # a bf16 base under float32 adapters, with CISPO and TIS, two updates
        ("model.dtype=bfloat16", "cppo.loss_type=cispo", "cppo.tis_cap=2", "cppo.mu=2"),
        # GSPO (its paper's clip, two updates: the second off-policy) under small_config's pruning
        # and allocation
        ("cppo.loss_type=gspo", "cppo.eps_low=0.0003", "cppo.eps_high=0.0004", "cppo.mu=2"),
    ],
)
def test_lora_steps_with_the_step_options(tmp_path, arith_model_dir, extra):
    """One whole LoRA trainer step (rollout from the adapters unmerged on the base, reference
    log-probs from the base, the update on the adapters) with each set of options (a program each,
    so several options share one): it trains every kept row, moves the float32 adapters and leaves
    the base in its compute dtype unchanged."""
    from tests.helpers import spread_reward

    cfg = small_config(tmp_path, arith_model_dir, *LORA, *spread_reward(tmp_path), *extra)
    trainer = Trainer(cfg)
    try:
        if cfg.trainer.micro_batch:  # the kept rows do split into micro-batches
            assert cfg.trainer.micro_batch < trainer.shapes.M
        dtype = jnp.dtype(cfg.model.dtype)
        assert {x.dtype for x in jax.tree.leaves(trainer.actor.frozen)} == {dtype}
        assert {x.dtype for x in jax.tree.leaves(trainer.params)} == {jnp.dtype(jnp.float32)}
        base_before, adapters_before = _host(trainer.actor.frozen), _host(trainer.params)
        row = trainer.step(0)
        assert row["update_skipped"] == 0.0 and np.isfinite(row["loss"])
        assert row["cppo/kept"] == trainer.shapes.M
        assert row["grad_norm"] > 0  # the spread reward gives non-zero advantages
        jax.tree.map(np.testing.assert_array_equal, _host(trainer.actor.frozen), base_before)
        moved = [
            float(np.abs(a - b).max())
            for (_, a), (_, b) in zip(_flat(_host(trainer.params)), _flat(adapters_before))
        ]
        assert max(moved) > 0
    finally:
        trainer.close()


@pytest.mark.slow
def test_lora_overlap_takes_the_old_logps_of_the_adapters_that_sampled(tmp_path, arith_model_dir):
    """rollout.overlap=1: the snapshot is of the adapters; step s's old log-probs are those of the
    merged weights the (stand-in) server sampled with, computed on the adapters and the base."""
    from tests.test_overlap import overlap_trainer

    trainer, backend = overlap_trainer(tmp_path, arith_model_dir, *LORA)
    seen, inner = [], trainer.actor.train_step

    def spy(params, opt_state, batch, frozen):
        seen.append(jax.tree.map(np.asarray, batch))
        return inner(params, opt_state, batch, frozen)

    trainer.actor = dataclasses.replace(trainer.actor, train_step=spy)
    trainer.phase_split = True  # the programs apart, so the updates' batch is seen
    try:
        history = [trainer.step(s) for s in range(3)]
        _, plain_logps = step_lib.compiled(
            trainer.actor.graphdef, trainer.actor.tx, trainer.actor.spec
        )
        for s, batch in enumerate(seen):
            merged = backend.sampled_with[s]  # the weights that sampled step s (merged, host)
            want = np.asarray(plain_logps(merged, batch.tokens_MT, batch.valid_MT))
            tol = 64 * np.finfo(np.float32).eps * max(1.0, np.abs(want).max())
            np.testing.assert_allclose(batch.old_logp_MC, want, rtol=0, atol=tol, err_msg=str(s))
    finally:
        trainer.close()
    assert [m["rollout/staleness"] for m in history] == [0.0, 1.0, 1.0]
    assert history[0]["ratio/abs_dev_mean"] < 1e-5
    assert all(m["ratio/abs_dev_mean"] > 1e-6 for m in history[1:])  # the adapters moved
