"""Model layer: the NNX decoder, Hugging Face checkpoint I/O and the tokenizer wrapper.

Exports resolve lazily, so `from cppo_jax.models import Tokenizer` (host code) imports no JAX.

May import: parallel, config.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Cache": "kv_cache",
    "Transformer": "transformer",
    "TransformerConfig": "transformer",
    "init_cache": "kv_cache",
    "init_model": "transformer",
    "repeat_cache": "kv_cache",
    "load_hf": "hf_io",
    "save_hf": "hf_io",
    "Tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__():
    return __all__
