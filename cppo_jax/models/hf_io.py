"""Hugging Face checkpoint folders <-> `Transformer` (safetensors, numpy API, no torch): the table
of HF tensor names and layouts, a model to and from HF tensors, `load_hf` and `save_hf`.

The folder's files are read by `models/hf_read.py`: only local folders, a path that is not a
directory raises FileNotFoundError and is never looked up on the hub.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from cppo_jax.models.hf_read import INDEX_FILE, SINGLE_FILE, read_hf_config, read_hf_tensors
from cppo_jax.models.transformer import Transformer, TransformerConfig, has_o_bias
from cppo_jax.parallel import sharding as sharding_lib

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor and the NNX parameter it becomes.

    `n_in` is None for a plain reshape (embeddings, norms, biases); otherwise the entry is a
    torch linear weight [out, in] whose NNX layout puts the first `n_in` dims as inputs. Decoder
    layers' params are stacked [L, ...]: `layer` is this tensor's index in its parameter's stack
    (`nnx_shape` is one layer's shape).
    """

    hf_name: str
    path: tuple
    nnx_shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    n_in: int | None = None
    layer: int | None = None

    def to_nnx(self, w: np.ndarray) -> np.ndarray:
        return (w.T if self.n_in else w).reshape(self.nnx_shape)

    def to_hf(self, p: np.ndarray, contiguous: bool = True) -> np.ndarray:
        """The HF tensor of NNX parameter value `p`; with `contiguous` False a linear weight is the
        transposed view of `p` (no copy; `weight_transfer.changed_steps` diffs it in memory order)."""
        if self.n_in:
            p = p.reshape(math.prod(self.nnx_shape[: self.n_in]), -1).T
        p = p.reshape(self.hf_shape)
        return np.ascontiguousarray(p) if contiguous else p


def _linear(hf_name, path, nnx_shape, n_in, layer=None) -> _Entry:
    hf_shape = (math.prod(nnx_shape[n_in:]), math.prod(nnx_shape[:n_in]))
    return _Entry(hf_name, path, tuple(nnx_shape), hf_shape, n_in, layer)


def _plain(hf_name, path, nnx_shape, hf_shape=None, layer=None) -> _Entry:
    return _Entry(hf_name, path, tuple(nnx_shape), tuple(hf_shape or nnx_shape), None, layer)


def name_table(cfg: TransformerConfig) -> list[_Entry]:
    """Every HF tensor of `cfg`'s checkpoint (without the tied lm_head) and its NNX parameter."""
    V, D, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    H, J, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    table = [
        _plain("model.embed_tokens.weight", ("embed_VD",), (V, D)),
        _plain("model.norm.weight", ("final_norm", "scale_D"), (D,)),
    ]
    if not cfg.tie_word_embeddings:
        table.append(_linear("lm_head.weight", ("lm_head_DV",), (D, V), 1))
    for i in range(cfg.num_layers):
        hf, nn = f"model.layers.{i}.", ("layers",)
        attn, mlp = hf + "self_attn.", hf + "mlp."
        # Gemma 3's post_attention_layernorm normalises the attention output; the pre-MLP norm
        # is its pre_feedforward_layernorm. Qwen/Llama's post_attention_layernorm is the pre-MLP.
        if cfg.gemma:
            norms = {
                "input_layernorm": "attn_norm",
                "post_attention_layernorm": "post_attn_norm",
                "pre_feedforward_layernorm": "mlp_norm",
                "post_feedforward_layernorm": "post_mlp_norm",
            }
        else:
            norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
        table += [
            _plain(f"{hf}{name}.weight", (*nn, ours, "scale_D"), (D,), layer=i)
            for name, ours in norms.items()
        ]
        if cfg.qk_norm:
            table += [
                _plain(attn + "q_norm.weight", (*nn, "attn", "q_norm_E"), (E,), layer=i),
                _plain(attn + "k_norm.weight", (*nn, "attn", "k_norm_E"), (E,), layer=i),
            ]
        table += [
            _linear(attn + "q_proj.weight", (*nn, "attn", "q_DHE"), (D, H, E), 1, i),
            _linear(attn + "k_proj.weight", (*nn, "attn", "k_DJE"), (D, J, E), 1, i),
            _linear(attn + "v_proj.weight", (*nn, "attn", "v_DJE"), (D, J, E), 1, i),
            _linear(attn + "o_proj.weight", (*nn, "attn", "o_HED"), (H, E, D), 2, i),
            _linear(mlp + "gate_proj.weight", (*nn, "mlp", "gate_DF"), (D, F), 1, i),
            _linear(mlp + "up_proj.weight", (*nn, "mlp", "up_DF"), (D, F), 1, i),
            _linear(mlp + "down_proj.weight", (*nn, "mlp", "down_FD"), (F, D), 1, i),
        ]
        if cfg.attention_bias:
            table += [
                _plain(attn + "q_proj.bias", (*nn, "attn", "q_bias_HE"), (H, E), (H * E,), i),
                _plain(attn + "k_proj.bias", (*nn, "attn", "k_bias_JE"), (J, E), (J * E,), i),
                _plain(attn + "v_proj.bias", (*nn, "attn", "v_bias_JE"), (J, E), (J * E,), i),
            ]
        if has_o_bias(cfg):
            table.append(_plain(attn + "o_proj.bias", (*nn, "attn", "o_bias_D"), (D,), layer=i))
    return table


def _ignored(name: str, cfg: TransformerConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight"
    )


# ---------------------------------------------------------------------------------------------
# Model <-> dict of HF tensors
# ---------------------------------------------------------------------------------------------


def state_to_hf_tensors(
    model: Transformer, *, tied_head: bool = True, contiguous: bool = True
) -> dict[str, np.ndarray] | None:
    """All parameters as HF-named numpy arrays (torch layouts) in the param dtype.

    Tied models also get `lm_head.weight`, a copy of the embedding (vLLM's CPU backend needs it on a
    reload from files), unless `tied_head` is False. `contiguous` False: linear weights are transposed
    views of the parameters (`_Entry.to_hf`), not copies in HF order. With
    several processes every process must call this (parameters are gathered across them, one at a
    time) and only process 0 gets the tensors (None elsewhere: no other host holds a model copy).
    """
    from cppo_jax.parallel import distributed

    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    host = distributed.to_main({path: var.get_value() for path, var in params.items()})
    if host is None:
        return None
    tensors = {
        e.hf_name: e.to_hf(host[e.path] if e.layer is None else host[e.path][e.layer], contiguous)
        for e in name_table(model.cfg)
    }
    if model.cfg.tie_word_embeddings and tied_head:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    return tensors


def hf_tensors_to_model(
    cfg: TransformerConfig,
    tensors: dict[str, np.ndarray],
    *,
    sources: dict[str, str] | None = None,
    default_source: str = "<tensors>",
    mesh: jax.sharding.Mesh | None = None,
) -> Transformer:
    """Builds a `Transformer` from HF-named tensors (inverse of `state_to_hf_tensors`).

    Every tensor is checked (missing, wrong shape, unexpected) before any parameter is built.
    `sources` maps tensor names to the file they came from, for error messages (a missing
    tensor is reported against `default_source`). With a `mesh`, each parameter is placed on it
    by its logical axis names and `cppo_jax.parallel.sharding.RULES`.
    """
    sources = sources or {}
    where = lambda name: sources.get(name, default_source)  # noqa: E731
    table = name_table(cfg)
    known = {e.hf_name for e in table}
    for name in tensors:
        if name not in known and not _ignored(name, cfg):
            raise ValueError(f"{where(name)}: unexpected tensor {name!r} for a {cfg.arch} model")
    for e in table:
        if e.hf_name not in tensors:
            raise ValueError(f"{where(e.hf_name)}: tensor {e.hf_name!r} is missing")
        got = tuple(tensors[e.hf_name].shape)
        if got != e.hf_shape:
            raise ValueError(
                f"{where(e.hf_name)}: tensor {e.hf_name!r} has shape {got}, expected {e.hf_shape}"
            )
    dtype = cfg.weight_dtype
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = {}
    if mesh is not None:
        placed = sharding_lib.param_shardings(abstract_state, mesh)
        shardings = {path: var.get_value() for path, var in nnx.to_flat_state(placed)}
    host: dict[tuple, np.ndarray | list] = {}
    for e in table:
        value = e.to_nnx(np.asarray(tensors[e.hf_name])).astype(dtype)
        if e.layer is None:
            host[e.path] = value
        else:  # layers' tensors in order, stacked below
            host.setdefault(e.path, []).append(value)
    values = {}
    for path, value in host.items():
        value = np.stack(value) if isinstance(value, list) else value
        if mesh is None:
            values[path] = jnp.asarray(value, dtype=dtype)
        else:  # each device receives only its shard
            values[path] = jax.device_put(value, shardings[path])
    flat = [(path, var.replace(values[path])) for path, var in nnx.to_flat_state(abstract_state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def load_hf(
    path: str | Path,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    *,
    param_dtype: str = "float32",
    remat: str | bool = "dots_saveable",
    scan_layers: bool = True,
    attention: str = "einsum",
) -> Transformer:
    """Loads a local HF folder (single or sharded safetensors) as a `Transformer`.

    `dtype` is the compute dtype, `param_dtype` the storage dtype of the parameters, `remat`
    names what each layer keeps for the backward pass (`TransformerConfig.remat`), `scan_layers` runs the layers under
    one scan (else unrolled), `attention` is `TransformerConfig.attention`; with a `mesh` the parameters are sharded on it by the rules of
    `cppo_jax.parallel.sharding`.
    """
    cfg = read_hf_config(
        path,
        dtype=dtype,
        param_dtype=param_dtype,
        remat=remat,
        scan_layers=scan_layers,
        attention=attention,
    )
    tensors, sources = read_hf_tensors(path)
    index = Path(path) / INDEX_FILE
    default = index if index.is_file() else Path(path) / SINGLE_FILE
    return hf_tensors_to_model(
        cfg, tensors, sources=sources, default_source=str(default), mesh=mesh
    )


DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' save_pretrained default (5 GB)
_DTYPE_NAMES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _source_dtype(config: dict) -> str | None:
    """The dtype a HF config.json says its weights are in (`dtype`, or the older `torch_dtype`)."""
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in _DTYPE_NAMES else None


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Tensors packed in order into shards of at most `max_bytes` (a larger tensor alone)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards


def save_hf(
    model: Transformer,
    path: str | Path,
    extra_config: dict | None = None,
    tokenizer_dir: str | Path | None = None,
    *,
    source_dir: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Writes a folder that transformers loads and vLLM serves as it is, atomically.

    Weights go in HF names and layouts, in `dtype` (default: the dtype `source_dir`'s config.json
    names, else the param dtype), in one `model.safetensors` or, above `max_shard_bytes`, in shards
    with an index. `config.json` is `source_dir`'s (the checkpoint the run started from: eos/bos ids,
    rope scaling and every other field kept) with the architecture fields and dtype written anew and
    `extra_config` added last. `generation_config.json` is copied from `source_dir`, the tokenizer files
    from `tokenizer_dir` (default `source_dir`). The folder is built beside `path` and renamed into
    place; an existing `path` is replaced only once the new folder is complete. With several
    processes every process calls this: the parameters are gathered to process 0 (one at a time:
    no other host holds a model copy) and process 0 alone writes.
    """
    path = Path(path)
    source = Path(source_dir) if source_dir is not None else None
    base: dict = {}
    if source is not None and (source / "config.json").is_file():
        base = json.loads((source / "config.json").read_text())
    dtype = dtype or _source_dtype(base) or model.cfg.param_dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype {dtype!r} is not one of {sorted(_DTYPE_NAMES)}")
    tensors = state_to_hf_tensors(model)
    if tensors is None:  # not process 0: it joined the gathers; process 0 alone writes
        return path
    tensors = {k: np.ascontiguousarray(v.astype(_DTYPE_NAMES[dtype])) for k, v in tensors.items()}
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else source
    if tok_dir is not None and not tok_dir.is_dir():
        raise FileNotFoundError(f"tokenizer folder not found: {tok_dir}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        os.chmod(tmp, 0o755)
        shards = _shards(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(v.nbytes for v in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = {**base, **model.cfg.to_hf_dict(torch_dtype=dtype)}
        if "dtype" in base:
            config["dtype"] = dtype
        config.update(extra_config or {})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if source is not None and (source / GENERATION_CONFIG).is_file():
            shutil.copy2(source / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        if tok_dir is not None:
            for file in sorted(tok_dir.iterdir()):
                if file.is_file() and file.name in TOKENIZER_FILES:
                    shutil.copy2(file, tmp / file.name)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / path.name)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def check_weights(folder: Path, key: str) -> None:
    """Every tensor the loader reads is listed, with its shape, in the folder's safetensors headers;
    a ConfigError naming the config key `key` otherwise (checked before any weight is read)."""
    import json

    from safetensors import safe_open

    from cppo_jax.config.choices import ConfigError

    try:
        tcfg = read_hf_config(folder)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"config key '{key}' = '{folder}': {e}") from e
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise ConfigError(
                f"config key '{key}': {index} is not a safetensors index ({e})"
            ) from e
    else:
        files = [SINGLE_FILE]
    shapes: dict[str, tuple] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ConfigError(
                f"config key '{key}' = '{folder}': weight file {name} not found (a Hugging Face "
                f"folder holds {SINGLE_FILE} or {INDEX_FILE} and its shards)"
            )
        try:
            with safe_open(str(path), framework="np") as f:
                for t in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shapes[t] = tuple(f.get_slice(t).get_shape())
        except Exception as e:  # safetensors raises its own error types
            raise ConfigError(f"config key '{key}': {path} is not a safetensors file ({e})") from e
    for entry in name_table(tcfg):
        got = shapes.get(entry.hf_name)
        if got != tuple(entry.hf_shape):
            what = "missing" if got is None else f"of shape {got}"
            raise ConfigError(
                f"config key '{key}' = '{folder}': tensor {entry.hf_name} is {what}; config.json "
                f"needs shape {tuple(entry.hf_shape)}"
            )
