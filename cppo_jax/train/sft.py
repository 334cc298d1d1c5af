"""Supervised warm start for the tiny `arith` task: random weights to a partial solver.

Builds the tiny byte-level BPE tokenizer, initialises a small Qwen2-architecture model, trains it on
reference completions (loss on completion tokens only, same left-padded prompt layout as RL) and
writes a Hugging Face folder (weights, config, tokenizer) that the RL config starts from.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.model import ArchConfig
from cppo_jax.config.schema import DataConfig
from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.models import Tokenizer, TransformerConfig, init_model, load_hf, save_hf
from cppo_jax.tasks import arith
from cppo_jax.tasks.tiny_tokenizer import build_tokenizer
from cppo_jax.train import device_fns as step_lib


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    out: str = "runs/tiny_sft"  # the HF folder written at the end
    init_from: str = ""  # continue from this HF folder (weights and tokenizer) instead of random
    arch: ArchConfig = ArchConfig()
    data: DataConfig = DataConfig()
    completion_len: int = 48
    batch: int = 64
    steps: int = 600
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    log_every: int = 50
    eval_size: int = 128
    # Share of targets written in the direct style (`arith.direct_completion`: the expression, then
    # the answer, no worked steps), drawn afresh for every row of every batch; the rest are stepwise.
    direct_fraction: float = 0.0

    def __post_init__(self):
        for key, ok, allowed in (
            ("batch", self.batch >= 1, ">= 1"),
            ("steps", self.steps >= 1, ">= 1"),
            ("lr", self.lr > 0, "> 0"),
            ("warmup", 0 <= self.warmup < self.steps, f"in [0, steps={self.steps})"),
        ):
            if not ok:
                raise ConfigError(
                    f"config key 'sft.{key}' = {getattr(self, key)!r} is invalid: allowed {allowed}"
                )
        if not 0.0 <= self.direct_fraction <= 1.0:
            raise ConfigError(
                f"config key 'sft.direct_fraction' = {self.direct_fraction!r}: must be in [0, 1]"
            )


def arch_to_model_config(arch: ArchConfig, vocab_size: int) -> TransformerConfig:
    fields = dataclasses.asdict(arch)
    fields["vocab_size"] = vocab_size
    fields["attention_bias"] = arch.arch == "qwen2"
    return TransformerConfig(**fields)


def _completion_arrays(tokenizer: Tokenizer, examples, C: int, style=arith.reference_completion):
    ids = np.full((len(examples), C), tokenizer.pad_id, np.int32)
    valid = np.zeros((len(examples), C), bool)
    for i, ex in enumerate(examples):
        row = tokenizer.encode(style(ex))[: C - 1] + [tokenizer.eos_id]
        ids[i, : len(row)] = row
        valid[i, : len(row)] = True
    return ids, valid


def run_sft(cfg: SFTConfig, log=print) -> Path:
    out = Path(cfg.out).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.init_from:
            tok_dir = Path(cfg.init_from)
            tokenizer = Tokenizer.from_dir(tok_dir)
            model = load_hf(cfg.init_from)
        else:
            tok_dir = build_tokenizer(Path(tmp) / "tokenizer")
            tokenizer = Tokenizer.from_dir(tok_dir)
            mcfg = arch_to_model_config(cfg.arch, tokenizer.vocab_size)
            model = init_model(mcfg, cfg.seed)
        graphdef, params = nnx.split(model)

        P, C = cfg.data.max_prompt_len, cfg.completion_len
        train, _ = pipeline.load_examples(cfg.data, "train")
        prompts = pipeline.encode_prompts(train, tokenizer, cfg.data.task, P, "truncate")
        # [2, n, T]: every training question written stepwise (style 0) and direct (style 1).
        tokens, valids = [], []
        for style in (arith.reference_completion, arith.direct_completion):
            ids, valid = _completion_arrays(tokenizer, train, C, style)
            tokens.append(np.concatenate([prompts.ids_nP, ids], axis=1))
            valids.append(np.concatenate([prompts.valid_nP, valid], axis=1))
        tokens_SnT, valid_SnT = np.stack(tokens), np.stack(valids)

        spec = step_lib.StepSpec(
            prompt_len=P,
            temperature=1.0,
            loss_type="token_mean",
            eps_low=0.2,
            eps_high=0.2,
            beta=0.0,
            mu=1,
            max_completion_len=C,
        )
        sched = optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, cfg.warmup, cfg.steps, cfg.lr * 0.05
        )
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
        opt_state = tx.init(params)

        def loss_fn(params, tokens, valid):
            m = nnx.merge(graphdef, params)
            logp = step_lib.completion_logps(m, tokens, valid, spec)
            mask = valid[:, P:].astype(jnp.float32)
            return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def update(params, opt_state, tokens, valid):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, valid)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        rng = np.random.default_rng(cfg.seed)
        t0 = time.perf_counter()
        for step in range(cfg.steps):
            idx = rng.integers(0, len(train), cfg.batch)
            # No extra draw when direct_fraction is 0: the batches of the stepwise-only runs stay.
            style = np.zeros(cfg.batch, np.int64)
            if cfg.direct_fraction > 0:
                style = (rng.random(cfg.batch) < cfg.direct_fraction).astype(np.int64)
            params, opt_state, loss = update(
                params,
                opt_state,
                jnp.asarray(tokens_SnT[style, idx]),
                jnp.asarray(valid_SnT[style, idx]),
            )
            if (step + 1) % cfg.log_every == 0 or step == 0:
                log(
                    f"sft step {step + 1}/{cfg.steps} loss {float(loss):.4f} "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
        nnx.update(model, params)
        save_hf(model, out, tokenizer_dir=tok_dir)
        acc = greedy_accuracy(graphdef, params, tokenizer, cfg, C)
        log(
            f"sft: greedy held-out accuracy {acc:.1%} on {cfg.eval_size} test questions; wrote {out}"
        )
    return out


def greedy_accuracy(graphdef, params, tokenizer: Tokenizer, cfg: SFTConfig, C: int) -> float:
    """Fraction of `cfg.eval_size` held-out arith questions answered correctly by greedy decoding."""
    from cppo_jax.rewards.gsm8k import accuracy_reward
    from cppo_jax.rollout.backend import EmbeddedBackend
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    test = arith.generate(cfg.eval_size, seed=cfg.data.seed, split="test")
    prompts = pipeline.encode_prompts(
        test, tokenizer, cfg.data.task, cfg.data.max_prompt_len, "truncate"
    )
    sp = SamplingParams(
        max_new_tokens=C, temperature=0.0, eos_id=tokenizer.stop_ids, pad_id=tokenizer.pad_id
    )
    out = EmbeddedBackend(graphdef, sp).greedy(
        params, jnp.asarray(prompts.ids_nP), jnp.asarray(prompts.valid_nP)
    )
    tokens, valid = np.asarray(out.tokens_NC), np.asarray(out.valid_NC)
    correct = 0
    for ex, row, ok in zip(test, tokens, valid):
        text = tokenizer.decode(
            [int(t) for t, v in zip(row, ok) if v and t not in tokenizer.stop_ids]
        )
        correct += accuracy_reward(text, ex["solution"]) > 0
    return correct / len(test)
