"""A tiny byte-level BPE tokenizer for the `arith` task, saved as a Hugging Face tokenizer folder.

- Byte-level BPE (the `tokenizers` library) trained on generated arith text: 256 byte tokens plus up to a
  couple of hundred merges. Digits are always split one per token (as in Qwen2), so numbers are spelled
  digit by digit. No normaliser: decoding an encoding gives back any UTF-8 text exactly.
- Added tokens, one id each: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special) and `<think>`, `</think>`,
  `<answer>`, `</answer>` (not special, so decoding with `skip_special_tokens=True` keeps them).
- The folder holds `tokenizer.json`, `tokenizer_config.json` (Qwen-style ChatML `chat_template`, eos
  `<|im_end|>`, pad `<|endoftext|>`) and `special_tokens_map.json`, so that
  `transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)` loads it.

The config files are written here directly (importing transformers would import torch, which is slow), and
every file is a pure function of the arguments: the same seed gives the same bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from cppo_jax.tasks import arith
from cppo_jax.tasks.prompts import MATH_SYSTEM_PROMPT, SYSTEM_PROMPT, TINY_SYSTEM_PROMPT

__all__ = [
    "CHAT_TEMPLATE",
    "FORMAT_TOKENS",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "build_tokenizer_object",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FORMAT_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2.5's ChatML layout, without its default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _corpus(examples: Sequence[dict]) -> Iterable[str]:
    """Training text: questions, reference completions (format tags removed: they are added tokens),
    system prompts and the chat roles."""
    for ex in examples:
        yield ex["question"]
        text = arith.reference_completion(ex)
        for tag in FORMAT_TOKENS:
            text = text.replace(tag, " ")
        yield text
    for prompt in (SYSTEM_PROMPT, MATH_SYSTEM_PROMPT, TINY_SYSTEM_PROMPT):
        for tag in FORMAT_TOKENS:
            prompt = prompt.replace(tag, " ")
        yield prompt
    yield "system\nuser\nassistant\n"


def build_tokenizer_object(
    corpus_examples: int | Sequence[dict] = 2000, *, vocab_size: int = 480, seed: int = 0
) -> Tokenizer:
    """The `tokenizers.Tokenizer`; `corpus_examples` is a number of arith train problems or the problems."""
    if isinstance(corpus_examples, int):
        corpus_examples = arith.generate(corpus_examples, seed=seed, split="train")
    merges_vocab = vocab_size - len(SPECIAL_TOKENS) - len(FORMAT_TOKENS)
    if merges_vocab < 256:
        raise ValueError(
            f"vocab_size must leave room for 256 byte tokens and 7 added tokens, got {vocab_size}"
        )
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True, trim_offsets=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=merges_vocab,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(corpus_examples), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in FORMAT_TOKENS])
    return tok


def _tokenizer_config(tok: Tokenizer, max_length: int) -> dict:
    decoder = {}
    for token in (*SPECIAL_TOKENS, *FORMAT_TOKENS):
        decoder[str(tok.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_tokenizer(
    out_dir: str | os.PathLike,
    corpus_examples: int | Sequence[dict] = 2000,
    *,
    vocab_size: int = 480,
    seed: int = 0,
    max_length: int = 256,
) -> str:
    """Train the tiny tokenizer and save it as a Hugging Face tokenizer folder; return the folder's path.

    `vocab_size` caps the total vocabulary (bytes + merges + 7 added tokens); the arith corpus usually runs
    out of frequent pairs a little below it. `max_length` is written as `model_max_length`.
    """
    tok = build_tokenizer_object(corpus_examples, vocab_size=vocab_size, seed=seed)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    files = {
        "tokenizer_config.json": _tokenizer_config(tok, max_length),
        "special_tokens_map.json": {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    }
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as fh:
            json.dump(content, fh, indent=2, ensure_ascii=False, sort_keys=True)
            fh.write("\n")
    return out_dir
