"""Local Hugging Face tokenizer folders (host code: no JAX)."""

from __future__ import annotations

from pathlib import Path


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

    @property
    def pad_id(self) -> int:
        """The pad token id, or the eos id when the tokenizer has no pad token."""
        pad = self.hf.pad_token_id
        return self.eos_id if pad is None else int(pad)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (the model's table may be larger)."""
        return len(self.hf)

    def chat_prompt_ids(self, system: str, question: str) -> list[int]:
        """The chat template applied to (system, user question), ending with the assistant turn."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)
