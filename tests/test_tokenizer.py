"""The host-side tokenizer wrapper over local Hugging Face tokenizer folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cppo_jax.models.tokenizer import Tokenizer

try:
    import helpers
except ImportError:  # pragma: no cover - run as a package
    from tests import helpers


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return helpers.make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def test_encode_decode_and_special_ids(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    text = "What is 12 + 30? The answer is \\boxed{42}.\nDone!"
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.eos_id == 2 and tok.pad_id == 0
    assert 3 < tok.vocab_size <= 257
    assert max(ids) < tok.vocab_size
    assert tok.decode([*ids, tok.eos_id]) == text + "<|im_end|>"
    assert tok.decode([*ids, tok.eos_id], skip_special_tokens=True) == text


def test_chat_prompt_ids(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    ids = tok.chat_prompt_ids("Be brief.", "What is 1 + 1?")
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(ids) == expected
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> stays one special token
    no_system = tok.decode(tok.chat_prompt_ids("", "Hi"))
    assert no_system == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_pad_falls_back_to_eos(tok_dir, tmp_path):
    d = tmp_path / "nopad"
    d.mkdir()
    for p in tok_dir.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    special = d / "special_tokens_map.json"
    if special.exists():
        mapping = json.loads(special.read_text())
        mapping.pop("pad_token", None)
        special.write_text(json.dumps(mapping))
    tok = Tokenizer.from_dir(d)
    assert tok.hf.pad_token_id is None
    assert tok.pad_id == tok.eos_id == 2


def test_missing_template_and_folder(tmp_path):
    d = helpers.make_tokenizer_dir(tmp_path, chat_template=None, name="plain")
    tok = Tokenizer.from_dir(d)
    with pytest.raises(ValueError, match=r"plain.*chat template"):
        tok.chat_prompt_ids("s", "q")
    with pytest.raises(FileNotFoundError, match="no_tokenizer_here"):
        Tokenizer.from_dir(tmp_path / "no_tokenizer_here")


def test_host_module_imports_no_jax():
    code = (
        "import sys; from cppo_jax.models import Tokenizer; import cppo_jax.models.tokenizer; "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1]
    )
