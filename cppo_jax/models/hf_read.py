"""Reading a local Hugging Face checkpoint folder: its safetensors files (one, or shards with an
index) as numpy arrays, and its config.json as a `TransformerConfig` (safetensors' numpy API, no torch).

Only local folders are read: a path that is not a directory raises FileNotFoundError and is never
looked up on the hub. A damaged file, a missing shard or tensor raises an error naming the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from cppo_jax.models.config import TransformerConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_RAW_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}


def read_raw_tensor(file: str | Path, name: str) -> np.ndarray:
    """Reads one tensor by parsing the safetensors layout (fallback for dtypes numpy lacks)."""
    with open(file, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        info = json.loads(fh.read(header_len))[name]
        start, end = info["data_offsets"]
        fh.seek(8 + header_len + start)
        data = fh.read(end - start)
    if len(data) != end - start:
        raise ValueError(f"{file}: tensor {name!r} is truncated")
    return np.frombuffer(data, dtype=_RAW_DTYPES[info["dtype"]]).reshape(info["shape"])


def _read_file(file: Path) -> dict[str, np.ndarray]:
    try:
        with safe_open(str(file), framework="numpy") as f:
            names = list(f.keys())
            out = {}
            for name in names:
                try:
                    out[name] = f.get_tensor(name)
                except Exception as err:
                    if f.get_slice(name).get_dtype() not in _RAW_DTYPES:
                        raise ValueError(f"{file}: cannot read tensor {name!r}: {err}") from err
                    out[name] = read_raw_tensor(file, name)
            return out
    except ValueError:
        raise
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from err


def read_hf_tensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Reads every tensor of a local HF folder: (tensors, tensor name -> file path)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"{index}: not a valid safetensors index ({err})") from err
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            if not (folder / file).is_file():
                raise FileNotFoundError(
                    f"{folder / file}: shard listed in {index.name} (tensor {names[0]!r}) not found"
                )
    elif (folder / SINGLE_FILE).is_file():
        by_file = {SINGLE_FILE: None}
    else:
        raise FileNotFoundError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    tensors, sources = {}, {}
    for file, names in by_file.items():
        loaded = _read_file(folder / file)
        for name in names or []:
            if name not in loaded:
                raise ValueError(
                    f"{folder / file}: tensor {name!r} listed in {INDEX_FILE} is missing"
                )
        for name, value in loaded.items():
            tensors[name] = value
            sources[name] = str(folder / file)
    return tensors, sources


def read_hf_config(path: str | Path, **overrides) -> TransformerConfig:
    """The `TransformerConfig` of a local HF folder's config.json."""
    config_file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: not found")
    try:
        return TransformerConfig.from_hf_dict(json.loads(config_file.read_text()), **overrides)
    except ValueError as err:
        raise ValueError(f"{config_file}: {err}") from err
