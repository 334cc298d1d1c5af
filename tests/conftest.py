"""Shared fixtures: a tiny arith model folder (random weights + the arith tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WARM_START = ROOT / "cppo_jax" / "assets" / "tiny_arith"


def build_arith_model_dir(out: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A random tiny Qwen2 model with the arith tokenizer, saved as a Hugging Face folder."""
    from cppo_jax.models import TransformerConfig, init_model, save_hf
    from cppo_jax.models.tokenizer import Tokenizer
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer

    tok_dir = build_tokenizer(out.parent / f"{out.name}_tokenizer")
    vocab = Tokenizer.from_dir(tok_dir).vocab_size
    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 1,
        num_layers=layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=hidden // 2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    return save_hf(init_model(cfg, seed), out, tokenizer_dir=tok_dir)


@pytest.fixture(scope="session")
def arith_model_dir(tmp_path_factory) -> Path:
    return build_arith_model_dir(tmp_path_factory.mktemp("arith_model") / "model")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The list tests/test_documented_commands.py ran, with what happened to each command."""
    lines = getattr(config, "documented_commands", None)
    if lines:
        terminalreporter.section("documented commands")
        for line in lines:
            terminalreporter.write_line(line)
