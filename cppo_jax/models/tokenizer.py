"""Local Hugging Face tokenizer folders (host code: no JAX)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

# Files of a checkpoint folder whose `eos_token_id` (an id or a list) ends a completion.
EOS_FILES = ("generation_config.json", "config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_MARK = "\u2063cppo-end-of-turn\u2063"  # an assistant reply the chat template wraps


class Tokenizer:
    """A thin wrapper over a local HF tokenizer (fast or sentencepiece)."""

    def __init__(self, hf_tokenizer, path: str | Path):
        self.hf = hf_tokenizer
        self.path = Path(path)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder not found: {folder}")
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"{folder}: cannot load a tokenizer ({err})") from err
        return cls(hf, folder)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (no BOS/EOS unless `add_special_tokens`)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def eos_id(self) -> int:
        if self.hf.eos_token_id is None:
            raise ValueError(f"{self.path}: the tokenizer defines no eos token")
        return int(self.hf.eos_token_id)

    @functools.cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a completion, `eos_id` first: the tokenizer's eos, the `eos_token_id`
        of the folder's generation_config.json and config.json, and the special token the chat
        template closes an assistant turn with (Qwen2.5 `<|im_end|>`, Llama 3 `<|eot_id|>`)."""
        ids = [self.eos_id]
        for name in EOS_FILES:
            file = self.path / name
            if not file.is_file():
                continue
            try:
                value = json.loads(file.read_text()).get("eos_token_id")
            except (ValueError, AttributeError) as err:
                raise ValueError(f"{file}: not a JSON object ({err})") from err
            values = value if isinstance(value, list) else [] if value is None else [value]
            for v in values:
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ValueError(
                        f"{file}: eos_token_id {value!r}: each entry must be a non-negative int"
                    )
            ids += values
        end = self.end_of_turn_id()
        if end is not None:
            ids.append(end)
        return tuple(dict.fromkeys(ids))

    def end_of_turn_id(self) -> int | None:
        """The special token right after an assistant reply in the chat template, if there is one."""
        if not getattr(self.hf, "chat_template", None):
            return None
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False)
        except Exception:
            return None
        if _MARK not in text:
            return None
        after = self.encode(text.split(_MARK, 1)[1])
        special = set(self.hf.all_special_ids) | {
            i for i, t in self.hf.added_tokens_decoder.items() if t.special
        }
        return int(after[0]) if after and after[0] in special else None

    @property
    def pad_id(self) -> int:
        """The pad token id, or the eos id when the tokenizer has no pad token."""
        pad = self.hf.pad_token_id
        return self.eos_id if pad is None else int(pad)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (the model's table may be larger)."""
        return len(self.hf)

    def chat_prompt_ids(
        self, system: str, question: str, enable_thinking: bool | None = None
    ) -> list[int]:
        """The chat template applied to (system, user question), ending with the assistant turn;
        `enable_thinking` (not None) is handed to the template (`data.enable_thinking`)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        text = self.hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
        return self.encode(text)


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds a tokenizer (any of `TOKENIZER_FILES`)."""
    return bool(folder) and any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)
