"""Config files, dotted overrides and (de)serialisation: the way into and out of `cppo_jax.config.schema`.

`load_config(path, overrides)` imports a config file (a Python module with `get_config()`), applies
`key.path=value` overrides (each parsed by the field's declared type) and builds the config once, so every
section validates after all overrides; any problem raises `ConfigError` naming the key, the value and what
is allowed. `from_dict` / `to_dict` / `save_config` read and write the `config.json` of a run. Host code:
imports no JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from cppo_jax.config.choices import RENAMED_KEYS, ConfigError, _choice, renamed
from cppo_jax.config.schema import Config


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse_scalar(key: str, text: str, tp: Any) -> Any:
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"config key '{key}' = {text!r} is invalid: allowed true or false")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(
                f"config key '{key}' = {text!r} is invalid: allowed an integer"
            ) from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(
                f"config key '{key}' = {text!r} is invalid: allowed a number"
            ) from None
    if tp is str:
        return text
    raise ConfigError(f"config key '{key}' has a type ({tp}) that overrides do not support")


def _parse_value(key: str, text: str, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if text.strip().lower() in ("none", "null"):
            return None
        for tp in args[:-1]:  # the first member that parses (int | str: "3" an int)
            try:
                return _parse_value(key, text, tp)
            except ConfigError:
                pass
        return _parse_value(key, text, args[-1])
    if origin is Literal:
        options = typing.get_args(tp)
        _choice(key, text, tuple(options))
        return text
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        body = text.strip()
        if body.startswith(("[", "(")) and body.endswith(("]", ")")):
            body = body[1:-1]
        items = [s.strip().strip("'\"") for s in body.split(",") if s.strip()]
        return tuple(_parse_scalar(key, s, elem) for s in items)
    return _parse_scalar(key, text, tp)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check (and gently convert) a Python value given in a config file or dict."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return _from_dict(tp, value, prefix=key + ".")
        raise ConfigError(
            f"config key '{key}' = {value!r} is invalid: allowed a {tp.__name__} section"
        )
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if any(type(value) is a for a in args):  # e.g. a boolean where str | bool is allowed
            return value
        return _coerce(key, value, args[0])
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' = {value!r} is invalid: allowed a list")
        return tuple(_coerce(key, v, elem) for v in value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (bool, int, float, str):
        if type(value) is not tp:
            raise ConfigError(
                f"config key '{key}' = {value!r} is invalid: allowed a {tp.__name__}, "
                f"got a {type(value).__name__}"
            )
        return value
    return value


def _unknown_key(key: str, name: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key '{key}': known keys here are {', '.join(known)}{hint}")


def _current_name(prefix: str, name: str) -> str:
    """A field's name now, for `name` in the section `prefix` (an old name is read, with a warning)."""
    new = RENAMED_KEYS.get(prefix + name)
    if new is None:
        return name
    renamed(prefix + name, new)
    return new.rpartition(".")[2]


def _from_dict(cls, data: dict, prefix: str = ""):
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in data.items():
        name = _current_name(prefix, name)
        if name not in names:
            raise _unknown_key(prefix + name, name, names)
        kwargs[name] = _coerce(prefix + name, value, hints[name])
    return cls(**kwargs)


def from_dict(data: dict) -> Config:
    """Build a validated Config from a nested dict (for example a saved `config.json`)."""
    return _from_dict(Config, data)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def _set_override(cls, data: dict, key: str, text: str, prefix: str = "") -> None:
    """Set the dotted `key` in `data` (the raw fields of a `cls` section), parsed by the field's type."""
    head, _, rest = key.partition(".")
    head = _current_name(prefix, head)
    names = [f.name for f in dataclasses.fields(cls)]
    if head not in names:
        raise _unknown_key(prefix + key, head, names)
    tp = _hints(cls)[head]
    if rest:
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(
                f"unknown config key '{prefix + key}': '{prefix + head}' is not a section"
            )
        _set_override(tp, data[head], rest, text, prefix + head + ".")
    elif dataclasses.is_dataclass(tp):
        raise ConfigError(
            f"config key '{prefix + key}' is a section; set one of its keys, e.g. {prefix + key}.x=..."
        )
    else:
        data[head] = _parse_value(prefix + key, text, tp)


def _raw(cfg) -> dict:
    """The fields of a config as nested dicts, without validating anything."""
    return {
        f.name: _raw(getattr(cfg, f.name))
        if dataclasses.is_dataclass(getattr(cfg, f.name))
        else getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
    }


def apply_overrides(cfg, overrides: list[str]):
    """Return a copy of `cfg` with every `key.path=value` set, then validated once as a whole.

    All overrides are applied before any section is validated, so their order never matters
    (`rollout.backend=vllm rollout.vllm_url=...` and `mesh.fsdp=-1 mesh.data=1` both work).
    """
    data = _raw(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is malformed: expected key.path=value")
        key, text = item.split("=", 1)
        _set_override(type(cfg), data, key.strip(), text.strip())
    return _from_dict(type(cfg), data)


def apply_override(cfg, key: str, text: str):
    """Return a copy of `cfg` with the dotted `key` set to `text`, parsed by the field's type."""
    return apply_overrides(cfg, [f"{key}={text}"])


# Where a bare name is looked for: ./configs, the package's own copy (a wheel's: setup.py ships the
# repository's configs/ as cppo_jax/configs), the repository's configs/ (a source tree, editable).
CONFIG_DIRS = (
    Path("configs"),
    Path(__file__).resolve().parents[1] / "configs",
    Path(__file__).resolve().parents[2] / "configs",
)


def known_configs() -> list[str]:
    """The names a bare `--config` finds (each `<name>.py` defining `get_config()` in CONFIG_DIRS)."""
    names = set()
    for folder in CONFIG_DIRS:
        if folder.is_dir():
            names.update(
                p.stem
                for p in folder.glob("*.py")
                if not p.stem.startswith("_") and "def get_config" in p.read_text()
            )
    return sorted(names)


def resolve_config_path(path: str | Path) -> Path:
    """`path` itself when it is a file; a bare name (`math7b.py`, `math7b`) is looked up in
    CONFIG_DIRS; else an error naming the known configs."""
    path = Path(path)
    if path.is_file():
        return path
    tried = [str(path)]
    if path.parent == Path("."):
        name = path.name if path.suffix == ".py" else path.name + ".py"
        for folder in CONFIG_DIRS:
            candidate = folder / name
            if candidate.is_file():
                return candidate
            tried.append(str(candidate))
        known = known_configs()
        close = difflib.get_close_matches(Path(name).stem, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"config {str(path)!r} is neither a file nor a shipped config: the known configs are "
            f"{', '.join(known) or '(none found)'}{hint} (or give the path of a .py file defining "
            f"get_config(); looked for {', '.join(tried)})"
        )
    raise ConfigError(f"config file {str(path)!r} does not exist (looked for {', '.join(tried)})")


def load_config(path: str | Path, overrides: list[str] = (), expected: type = Config):
    """Import a config file, call its `get_config()`, apply all overrides, then validate once."""
    path = resolve_config_path(path)
    spec = importlib.util.spec_from_file_location(f"_cppo_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(
            f"config file {str(path)!r} failed to load: {type(e).__name__}: {e}"
        ) from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {str(path)!r} defines no get_config()")
    cfg = module.get_config()
    expected_types = expected if isinstance(expected, tuple) else (expected,)
    if not isinstance(cfg, expected_types):
        raise ConfigError(
            f"config file {str(path)!r}: get_config() returned {type(cfg).__name__}, "
            f"expected {' or '.join(t.__name__ for t in expected_types)}"
        )
    return apply_overrides(cfg, list(overrides))


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
