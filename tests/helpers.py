"""Shared test utilities: tiny random Hugging Face checkpoints and tokenizers, built locally.

Nothing here downloads anything. Widths are primes where the architecture allows (vocab 257,
hidden 37, MLP 67); head_dim must be even for RoPE and Llama needs hidden % heads == 0.
"""

from __future__ import annotations

import contextlib
import json
import string
from pathlib import Path

import numpy as np

# AdamW made smooth in the gradient, for tests that compare two programs' params (or what they
# sample, or their later losses) after one update or more: OptimConfig keywords, and the same as
# config overrides. AdamW's update lr * mu_hat / (sqrt(nu_hat) + eps) has a derivative in the
# gradient of up to about lr / eps: at the default eps 1e-8, a float32 rounding of a near-zero
# gradient element (two programs adding the same terms in their own orders, which differ with each
# CPU's code generation) moves that param by up to a whole lr, and the next steps carry it on
# (issue #50: red on an Intel Xeon, green on AMD EPYC). With eps = 1 the derivative is at most a few
# lr / eps = 0.1, so a rounding of the gradient stays a rounding of the params, on any CPU, and
# two programs' params after a few updates agree to a few float32 roundings of their size. lr 0.1
# keeps the steps (~0.1 g / (1 + |g|) per element) far above rounding: a wrong gradient, batch or
# update order still shows. The programs compared are the same for any optimizer settings.
SMOOTH_ADAMW = {"lr": 0.1, "eps": 1.0}
SMOOTH_ADAMW_OVERRIDES = tuple(f"optim.{k}={v}" for k, v in SMOOTH_ADAMW.items())

# Qwen-style chat markup used by `make_tokenizer_dir`.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_hf_checkpoint(
    tmp_path: str | Path,
    arch: str = "qwen2",
    tied: bool = True,
    vocab: int = 257,
    hidden: int | None = None,
    intermediate: int = 67,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 10,
    rope_theta: float = 10000.0,
    seed: int = 0,
    name: str | None = None,
    max_shard_size: str | None = None,
    torch_dtype: str = "float32",
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 32768,
    **arch_kwargs,
) -> Path:
    """Builds a tiny random Qwen2ForCausalLM / LlamaForCausalLM / Qwen3ForCausalLM /
    Gemma3ForCausalLM and saves it as safetensors; `arch_kwargs` go to its config (e.g. Gemma 3's
    sliding_window, layer_types, query_pre_attn_scalar).

    Every weight (biases and norm weights included) is randomised with torch seed `seed`, so a
    wrong layout or a forgotten bias changes the logits. `hidden` defaults to 37 (qwen2) or
    11 * heads (llama, which needs hidden % heads == 0). `max_shard_size` (e.g. "20KB") writes
    a sharded checkpoint with `model.safetensors.index.json`. `torch_dtype="bfloat16"` stores
    bf16 tensors. `rope_scaling` is a Hugging Face rope_scaling dict (e.g. llama3, yarn).
    Returns the folder `tmp_path / name`.
    """
    import torch
    import transformers

    classes = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    }
    if arch not in classes:
        raise ValueError(f"arch: {arch!r}")
    if hidden is None:
        hidden = 37 if arch in ("qwen2", "qwen3") else 11 * heads
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    if rope_scaling is not None:
        common["rope_scaling"] = dict(rope_scaling)
    common.update(arch_kwargs)
    torch.manual_seed(seed)
    config_cls, model_cls = (getattr(transformers, name) for name in classes[arch])
    model = model_cls(config_cls(**common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in pname:  # Gemma's weights w of a (1 + w) scale
                p.copy_((0.0 if arch == "gemma3" else 1.0) + 0.2 * noise)
            elif pname.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in pname or "lm_head" in pname:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    model.eval()
    out = Path(tmp_path) / (name or f"{arch}_{'tied' if tied else 'untied'}_{heads}x{kv_heads}")
    if torch_dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out


def tiny_config(**overrides):
    """A 2-layer qwen2 `TransformerConfig` (vocab 257, hidden 37, MLP 67, 4x2 heads of 10), tied."""
    from cppo_jax.models import TransformerConfig

    kwargs = dict(
        arch="qwen2",
        vocab_size=257,
        hidden_size=37,
        intermediate_size=67,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=10,
        tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def random_model(cfg, seed: int = 0):
    """A `Transformer` whose every parameter is O(1) noise (norms 1 + 0.2 N, biases 0.3 N,
    matrices N / sqrt(fan-in), embeddings N), so logits are far from uniform. NumPy-drawn."""
    import jax.numpy as jnp
    from flax import nnx

    from cppo_jax.models import init_model

    model = init_model(cfg, seed)
    rng = np.random.default_rng(seed + 1000)
    graphdef, state = nnx.split(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        noise = rng.standard_normal(value.shape, np.float32)
        name = str(path[-1])
        if name in ("scale_D", "q_norm_E", "k_norm_E"):  # Gemma's: w of a (1 + w) scale
            new = (0.0 if cfg.gemma else 1.0) + 0.2 * noise
        elif "bias" in name:
            new = 0.3 * noise
        elif name == "embed_VD":
            new = noise
        else:
            fan_in = value.shape[0] * (value.shape[1] if name == "o_HED" else 1)
            new = noise / np.sqrt(fan_in)
        flat.append((path, var.replace(jnp.asarray(new, value.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


_JITTED: dict = {}


def forward(model, tokens_BT, positions_BT, valid_BT, cache=None):
    """`model(tokens, positions, valid, cache)` under one shared nnx.jit: (logits, cache).

    Sharing the jitted function lets tests with the same config and shapes share compiles
    (eager dispatch compiles every op shape separately, which is slower on CPU).
    """
    if "forward" not in _JITTED:
        from flax import nnx

        _JITTED["forward"] = nnx.jit(lambda m, t, p, v, c: m(t, p, v, c))
    return _JITTED["forward"](model, tokens_BT, positions_BT, valid_BT, cache)


def load_hf_torch(path: str | Path):
    """The checkpoint at `path` as a float32 transformers model in eval mode (eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    )
    return model.eval()


def prune_inputs(Q: int, G: int, P: int, C: int, seed: int = 0, rewards=(0.0, 1.0, 2.0)):
    """Inputs of `cppo.prune` after a rollout: (rewards_QG, prompt_QP, pvalid_QP, tokens_NC,
    cvalid_NC, finished_N). Rewards are drawn from `rewards`; every token of question q's prompt is
    100 + q and every token of completion n is n, so a kept row names its question and completion;
    about 80% of prompt slots are valid, each completion is valid up to a random end, half finished."""
    gen = np.random.default_rng(seed)
    rewards_QG = gen.choice(np.asarray(rewards, np.float32), size=(Q, G))
    prompt_QP = 100 + np.repeat(np.arange(Q, dtype=np.int32)[:, None], P, axis=1)
    pvalid_QP = gen.random((Q, P)) < 0.8
    tokens_NC = np.repeat(np.arange(Q * G, dtype=np.int32)[:, None], C, axis=1)
    cvalid_NC = np.cumsum(gen.random((Q * G, C)) < 0.3, axis=1) == 0
    finished_N = gen.random(Q * G) < 0.5
    return rewards_QG, prompt_QP, pvalid_QP, tokens_NC, cvalid_NC, finished_N


def left_pad(seqs: list[list[int]], pad_id: int = 0, length: int | None = None):
    """Left-pads token lists: (tokens_BT int32, valid_BT bool, positions_BT int32) numpy arrays.

    Positions are cumsum(valid) - 1 clipped at 0, the convention the model expects.
    """
    T = length or max(len(s) for s in seqs)
    tokens_BT = np.full((len(seqs), T), pad_id, np.int32)
    valid_BT = np.zeros((len(seqs), T), bool)
    for b, s in enumerate(seqs):
        if s:
            tokens_BT[b, T - len(s) :] = s
            valid_BT[b, T - len(s) :] = True
    positions_BT = np.maximum(np.cumsum(valid_BT, axis=1) - 1, 0).astype(np.int32)
    return tokens_BT, valid_BT, positions_BT


def hf_logits(hf_model, tokens_BT, valid_BT) -> np.ndarray:
    """Float32 logits [B, T, V] of a transformers model on a left-padded batch.

    Uses attention_mask = valid and position_ids = cumsum(valid) - 1 clipped at 0; logits at
    padding positions are meaningless.
    """
    import torch

    valid = torch.as_tensor(np.asarray(valid_BT)).long()
    positions = (valid.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.as_tensor(np.asarray(tokens_BT)).long(),
            attention_mask=valid,
            position_ids=positions,
        )
    return out.logits.float().numpy()


def make_tokenizer_dir(
    tmp_path: str | Path,
    vocab_size: int = 257,
    chat_template: str | None = CHAT_TEMPLATE,
    name: str = "tokenizer",
) -> Path:
    """Trains a tiny byte-level BPE tokenizer and saves it as a PreTrainedTokenizerFast folder.

    Special tokens: `<|endoftext|>` (pad, id 0), `<|im_start|>` (1), `<|im_end|>` (eos, 2).
    The alphabet covers printable ASCII; at most `vocab_size` ids in total. `chat_template`
    (ChatML by default; None for none) is written into tokenizer_config.json.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = [
        string.printable,
        "system user assistant\nPlease reason step by step, and put your final answer in \\boxed{}.",
        "What is 12 + 30? The answer is 42. Therefore the final answer is \\boxed{42}.",
    ] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False
    )
    raw.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    out = Path(tmp_path) / name
    tok.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    config_file.write_text(json.dumps(config, indent=2))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (out / extra).unlink(missing_ok=True)
    return out


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compilations inside the block: {"n": count}."""
    import jax

    box = {"n": 0}

    def listener(name, _duration, **_kw):
        if name == "/jax/core/compile/backend_compile_duration":
            box["n"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield box
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def sampled_reward(trainer, n: int, seed: int = 7) -> np.ndarray:
    """Mean reward of `n` samples per training question under the trainer's current policy: [questions].

    The same `seed` gives the same per-question sampling seeds, so two calls around training compare the
    policies with common random numbers (the difference is far less noisy than either value).
    """
    import jax.numpy as jnp

    from cppo_jax.data.prompt_batches import decode_completions

    questions = trainer.data.train_set.take(np.arange(len(trainer.data.train_set)))
    seeds_Q = (np.arange(len(questions.examples), dtype=np.uint32) * 1_000 + seed).astype(np.uint32)
    samples = trainer.rollout.backend.generate(
        trainer.params,
        jnp.asarray(questions.ids_nP),
        jnp.asarray(questions.valid_nP),
        jnp.asarray(seeds_Q),
        n,
    )
    texts = decode_completions(
        trainer.data.tokenizer, np.asarray(samples.tokens_NC), np.asarray(samples.valid_NC)
    )
    solutions = [ex["solution"] for ex in questions.examples for _ in range(n)]
    total_N, _, _ = trainer.host.rewards.score(texts, solutions)
    return np.asarray(total_N, np.float64).reshape(len(questions.examples), n).mean(axis=1)


def reward_rise_config(out_dir: Path, *overrides: str):
    """A short CPPO run on 8 fixed arith questions from the shipped warm start (each step sees all 8)."""
    from cppo_jax.config.files import load_config

    return load_config(
        Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.py",
        [
            "data.num_train=8",
            "data.num_test=8",
            "cppo.questions_per_step=8",
            "cppo.pruning_rate=0.75",  # k = 4 of G = 16 kept per question
            "cppo.allocation=false",
            "optim.lr=1e-4",
            "trainer.steps=8",
            f"trainer.out_dir={out_dir}",
            "trainer.run_name=rise",
            "trainer.checkpoint_every=0",
            "reward.num_workers=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            *overrides,
        ],
    )


def spread_reward(folder: Path) -> list[str]:
    """Overrides that train on a reward spread over any text (a TRL-style file reward), so that a
    random model's groups have non-zero advantages and an update really moves the policy."""
    path = Path(folder) / "spread_reward.py"
    path.write_text(
        "def spread(completions, **kwargs):\n"
        "    return [float(sum(map(ord, c)) % 5) for c in completions]\n"
    )
    return [f"reward.funcs=[{path}:spread]", "reward.weights=[1.0]"]
