"""The host-side tokenizer wrapper over local Hugging Face tokenizer folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
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


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_stop_ids_gather_generation_config_config_and_chat_template(tok_dir, tmp_path):
    # The tokenizer's eos (<|im_end|> = 2) also closes the template's assistant turn: one id.
    assert Tokenizer.from_dir(tok_dir).stop_ids == (2,)
    assert Tokenizer.from_dir(tok_dir).end_of_turn_id() == 2
    # A checkpoint folder listing a second end id (Qwen2.5: <|im_end|> and <|endoftext|>).
    d = _copy(tok_dir, tmp_path / "gen")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 1}))
    assert Tokenizer.from_dir(d).stop_ids == (2, 0, 1)
    # A template closing turns with another special token (Llama 3's <|eot_id|> beside the eos).
    t = helpers.make_tokenizer_dir(
        tmp_path,
        name="eot",
        chat_template=helpers.CHAT_TEMPLATE.replace("}}<|im_end|>", "}}<|endoftext|>"),
    )
    tok = Tokenizer.from_dir(t)
    assert tok.end_of_turn_id() == 0 and tok.stop_ids == (2, 0)
    # The reward text of a completion ended by the second id stops there.
    from cppo_jax.data.prompt_batches import decode_completions
    from cppo_jax.rollout.embedded.sampling import completion_ends

    ids = tok.encode("The answer is 42.")
    row = np.asarray([[*ids, 0, *tok.encode(" and more")]], np.int32)
    valid, _ = completion_ends(row, tok.stop_ids)
    assert decode_completions(tok, row, valid) == ["The answer is 42."]
    valid, _ = completion_ends(row, tok.eos_id)
    assert decode_completions(tok, row, valid)[0].endswith("more")


def test_stop_ids_refuse_a_malformed_eos_token_id(tok_dir, tmp_path):
    d = _copy(tok_dir, tmp_path / "bad")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "</s>"]}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id \[2, '</s>'\]"):
        _ = Tokenizer.from_dir(d).stop_ids
    # A template with no special token after the reply (plain text) adds nothing.
    plain = helpers.make_tokenizer_dir(
        tmp_path,
        name="plainturn",
        chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    )
    assert Tokenizer.from_dir(plain).end_of_turn_id() is None


# A reasoning model's template (as Qwen3's behaves): with enable_thinking false the generation
# prompt closes an empty think block, so the policy answers without reasoning; its default is on.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.mark.parametrize(
    "setting,tail", [("none", "assistant\n"), ("true", "assistant\n"), ("false", "</think>\n\n")]
)
def test_enable_thinking_reaches_the_chat_template(tmp_path, setting, tail):
    """`data.enable_thinking` is handed to the template as its `enable_thinking` (None: not at all,
    the template's default), for the prompts the trainer builds; a template without the variable
    gives the same prompt whatever the setting."""
    from cppo_jax.config.files import apply_overrides
    from cppo_jax.config.schema import Config
    from cppo_jax.data import prompt_batches as pipeline
    from cppo_jax.tasks import arith
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer

    plain_dir = Path(build_tokenizer(tmp_path / "plain", 200))
    thinking_dir = Path(build_tokenizer(tmp_path / "thinking", 200))
    config = json.loads((thinking_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (thinking_dir / "tokenizer_config.json").write_text(json.dumps(config))

    cfg = apply_overrides(Config(), [f"data.enable_thinking={setting}"])
    assert cfg.data.enable_thinking == {"none": None, "true": True, "false": False}[setting]
    examples = arith.generate(2, seed=0, split="test")

    def last_prompt(folder):
        tok = Tokenizer.from_dir(folder)
        d = cfg.data
        enc = pipeline.encode_prompts(
            examples, tok, d.task, 96, "reject", d.system_prompt, d.prompt_format, d.enable_thinking
        )
        return tok.decode(enc.ids_nP[0][enc.valid_nP[0]].tolist())

    assert last_prompt(thinking_dir).endswith(tail)
    plain = last_prompt(plain_dir)
    assert plain.endswith("<|im_start|>assistant\n")  # the plain template has no such variable
