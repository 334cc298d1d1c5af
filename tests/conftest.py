"""Shared fixtures: a tiny arith model folder (random weights + the arith tokenizer).

Also one persistent XLA compilation cache for the subprocesses the suite starts (trainers, launch
scripts, notebooks, benchmarks' quick runs): each would otherwise compile the same programs again. The
suite's own process keeps compiling in memory (JAX reads the variable when it is imported, which
happens here first), so tests that count compilations see every compile. The cache lives in a fresh
folder per session, removed at the end, so a run never reuses programs from an earlier checkout.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jax  # noqa: F401  (imported before the cache variable is set: see above)
import pytest

_CACHE_VAR = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = None
if _CACHE_VAR not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="cppo_test_xla_cache_")
    os.environ[_CACHE_VAR] = _OWN_CACHE


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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
