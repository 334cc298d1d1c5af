"""The embedded sampler samples the policy being trained under LoRA, in bfloat16 too: it runs the
adapters unmerged on the frozen base (`Actor.adapted_params`), as the train step does, so an update
under half an ulp of the base weights, which a merge W + s A B rounded to bfloat16 loses, moves the
sampler's log-probs as it moves the training log-probs, and an on-policy batch's truncated
importance-sampling weight stays 1 within bfloat16 rounding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.models.lora import WEIGHTS
from cppo_jax.train.trainer import Trainer
from tests.conftest import build_arith_model_dir
from tests.test_trainer import small_config

D = 128  # the width: the adapters' effect grows as sqrt(D) over bfloat16 noise (see below)
TARGETS = ("q", "k", "v", "gate", "up")  # the projections whose input is the normed residual
BINADE = 2.0**-6  # |W| in [2^-6, 2^-5): one bfloat16 ulp there is 2^-13, half an ulp 2^-14


def _crafted(trainer, rng):
    """A frozen base whose adapted weights lie in one binade (|W| ~ 0.02, Qwen's scale) and whose
    embeddings share a sign vector u, and the adapters A = u, B = +-0.9 half-ulp / s: each entry
    of s A B is 0.9 of half an ulp of W, so W + s A B rounds back to W in bfloat16, while the
    unmerged delta s (x A) B sums D coherent terms (x ~ u): sqrt(D) times W x's own rounding."""
    u = np.where(rng.random(D) < 0.5, -1.0, 1.0).astype(np.float32)
    weights = {WEIGHTS[t][0] for t in TARGETS}
    flat = []
    for path, var in nnx.to_flat_state(trainer.actor.frozen):
        v, name = np.asarray(var.get_value(), np.float32), str(path[-1])
        if name == "embed_VD":
            v = u[None] + 0.25 * rng.standard_normal(v.shape).astype(np.float32)
        elif name in weights:  # 1.02 .. 1.98: off the binade's edges, where the ulp halves
            v = np.where(v < 0, -1.0, 1.0) * BINADE * (1.02 + 0.96 * rng.random(v.shape))
        flat.append((path, var.replace(jnp.asarray(v, var.get_value().dtype))))
    frozen = nnx.from_flat_state(flat)
    lora = trainer.cfg.model.lora
    s, half_ulp = lora.alpha / lora.rank, BINADE * float(jnp.finfo(jnp.bfloat16).eps) / 2
    adapters, fresh = [], []
    for path, var in nnx.to_flat_state(trainer.params):
        v = var.get_value()
        if "_a_" in str(path[-1]):  # [L, D, 1]: u along D
            x = np.broadcast_to(u.reshape(1, D, 1), v.shape)
        else:  # [L, 1, *out]
            x = np.where(rng.random(v.shape) < 0.5, -1.0, 1.0) * 0.9 * half_ulp / s
        adapters.append((path, var.replace(jnp.asarray(x, v.dtype))))
        fresh.append((path, var.replace(jnp.zeros_like(v))))
    return frozen, nnx.from_flat_state(adapters), nnx.from_flat_state(fresh)


def _training_logps(trainer, params, rollout):
    """The train step's log-probs (adapters unmerged) of a rollout's N sequences, M rows at a time."""
    G, M = trainer.shapes.G, trainer.shapes.M
    prompt = np.repeat(np.asarray(rollout.prompt_QP), G, 0)
    pvalid = np.repeat(np.asarray(rollout.pvalid_QP), G, 0)
    tokens = np.concatenate([prompt, np.asarray(rollout.samples.tokens_NC)], 1)
    valid = np.concatenate([pvalid, np.asarray(rollout.samples.valid_NC)], 1)
    frozen = trainer.actor.frozen_args
    return np.concatenate(
        [
            np.asarray(trainer.actor.logps(params, tokens[i : i + M], valid[i : i + M], *frozen))
            for i in range(0, len(tokens), M)
        ]
    )


def test_a_sub_ulp_lora_update_moves_the_sampler_as_it_moves_the_training_logps(tmp_path):
    model_dir = build_arith_model_dir(tmp_path / "model", hidden=D)
    lora = ["model.lora.enabled=true", "model.lora.rank=1", "model.lora.alpha=2"]
    cfg = small_config(
        tmp_path / "runs",
        model_dir,
        *lora,
        f"model.lora.targets=[{','.join(TARGETS)}]",
        "model.dtype=bfloat16",
        "cppo.beta=0",
    )
    trainer = Trainer(cfg)
    try:
        frozen, adapters, fresh = _crafted(trainer, np.random.default_rng(0))
        trainer.actor = dataclasses.replace(trainer.actor, frozen=frozen)
        # The premise: merged into bfloat16 weights, the update is lost (the weights are the base's).
        merged = trainer.actor.policy_params(adapters)
        for got, want in zip(jax.tree.leaves(merged), jax.tree.leaves(frozen)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

        base = trainer._rollout(fresh, 0)  # the same step: the same random numbers
        moved = trainer._rollout(adapters, 0)
        train_moved = _training_logps(trainer, adapters, moved)
        behav_moved = np.asarray(moved.samples.logp_NC)
        valid = np.asarray(moved.samples.valid_NC)

        # On-policy: the sampler's log-probs are the train step's, so the truncated importance
        # weight exp(train - behaviour) is 1 up to bfloat16 rounding of the log-probs' scale (two
        # orders of the same bfloat16 sums: the KV-cache decode and the teacher-forced forward).
        scale = float(np.abs(train_moved[valid]).max())
        tol = float(jnp.finfo(jnp.bfloat16).eps) * scale
        weight = np.exp(train_moved - behav_moved)[valid]
        assert np.abs(weight - 1).max() <= tol, (np.abs(weight - 1).max(), tol)

        # The update moves both alike: on the tokens both rollouts drew (the same prefix), the
        # sampler's change tracks the train step's, within a fraction of it (the rest bfloat16
        # noise); a merged sampler's change is exactly 0, an error of the whole change.
        same = np.cumprod(
            np.asarray(base.samples.tokens_NC) == np.asarray(moved.samples.tokens_NC), axis=1
        ).astype(bool)
        keep = valid & same
        assert keep.sum() >= valid.sum() // 2, (keep.sum(), valid.sum())
        d_train = (train_moved - _training_logps(trainer, fresh, moved))[keep]
        d_sampler = (behav_moved - np.asarray(base.samples.logp_NC))[keep]
        rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
        # The two programs' rounding apart: the fresh adapters' rollout, on-policy either way.
        noise = rms(
            (_training_logps(trainer, fresh, base) - np.asarray(base.samples.logp_NC))[keep]
        )
        print(
            f"rms change {rms(d_train):.2e}, sampler's off by {rms(d_sampler - d_train):.2e}, "
            f"rounding {noise:.2e}"
        )
        assert rms(d_train) > 2 * noise  # the update is felt above the rounding
        assert rms(d_sampler - d_train) <= 0.5 * rms(d_train)
    finally:
        trainer.close()
