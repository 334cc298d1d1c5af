"""Reward functions by name.

A reward function takes `(completion: str, solution: str)` and returns a float. Functions are kept as
importable references `"package.module:qualname"` or `"path/to/file.py:qualname"`, so that a reward worker
(a fresh interpreter) can import the same function by name; the built-in entries are imported only when
first resolved.

TRL's calling convention works too (`is_trl_style`): a function with a `completions`, `prompts` or
`completion_ids` parameter, or only `**kwargs`, is called as TRL's GRPOTrainer calls it, with lists and
keywords: `prompts`, `completions`, `completion_ids` and the dataset's columns (`question`, `solution`,
`answer`), and returns a list of floats, None where it abstains (the score is then NaN: left out of its
mean and counted as 0 in the total, as TRL's nansum). `item_fn` calls it one completion at a time, so the
reward workers' bound in time holds for each call.

    @register("my_reward")
    def my_reward(completion: str, solution: str) -> float: ...

    fn = resolve("gsm8k_accuracy")           # a registered name
    fn = resolve("mypkg.rewards:my_reward")  # or a qualified name

Reward functions may also report events (say, a gold answer that cannot be parsed) with `note(event)`; the
counts reach the caller through `RewardPool.score`'s stats (`drain_notes` collects them per process).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from cppo_jax.config.choices import TASKS

__all__ = [
    "TASK_EVAL",
    "TASK_REWARDS",
    "RewardFn",
    "as_pair_fn",
    "display_name",
    "drain_notes",
    "is_trl_style",
    "item_fn",
    "known_names",
    "note",
    "qualified_name",
    "reference",
    "register",
    "resolve",
    "resolve_ref",
]

RewardFn = Callable[[str, str], float]

_BUILTIN: dict[str, str] = {
    # The released code's rules (spec section 4): what the paper configs use.
    "gsm8k_accuracy": "cppo_jax.rewards.gsm8k:accuracy_reward",
    "gsm8k_format": "cppo_jax.rewards.gsm8k:format_reward",
    "math_accuracy": "cppo_jax.rewards.math:accuracy_reward",
    "math_format": "cppo_jax.rewards.math:format_reward",
    # Stricter options.
    "gsm8k_accuracy_strict": "cppo_jax.rewards.gsm8k:accuracy_reward_strict",
    "gsm8k_format_strict": "cppo_jax.rewards.gsm8k:format_reward_strict",
    "math_accuracy_strict": "cppo_jax.rewards.math:accuracy_reward_strict",
    # The released evaluation rules (1.0 correct, 0.0 not): `eval.rule=released`.
    "gsm8k_eval_released": "cppo_jax.rewards.gsm8k:eval_released",
    "math_eval_released": "cppo_jax.rewards.math:eval_released",
    # The synthetic arithmetic task has GSM8K-style solutions ("#### N") and the same output format.
    "arith_accuracy": "cppo_jax.rewards.gsm8k:accuracy_reward",
    "arith_format": "cppo_jax.rewards.gsm8k:format_reward",
    "arith_eval_released": "cppo_jax.rewards.gsm8k:eval_released",
}
# Per task (`data.task`): its (accuracy, format) rewards, what an evaluation writes for each completion.
TASK_REWARDS: dict[str, tuple[str, str]] = {
    task: (f"{task}_accuracy", f"{task}_format") for task in TASKS
}
# Per task: the two accuracy rules (`eval.rule`): `strict` counts accuracy reward > 0, `released` is the
# released code's evaluation rule.
TASK_EVAL: dict[str, dict[str, str]] = {
    task: {"strict": accuracy, "released": f"{task}_eval_released"}
    for task, (accuracy, _) in TASK_REWARDS.items()
}
_REGISTRY: dict[str, str] = dict(_BUILTIN)
_NOTES: Counter[str] = Counter()


def known_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def qualified_name(fn: Callable) -> str:
    """`"module:qualname"` of a module-level function; ValueError if a worker could not import it back."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise ValueError(
            f"reward function {fn!r} has no importable name ({module}:{qualname}); define it at the top "
            "level of an importable module (not a lambda, a closure or __main__)"
        )
    ref = f"{module}:{qualname}"
    if resolve_ref(ref) is not fn:
        raise ValueError(f"reward function {fn!r} is not what {ref!r} imports to")
    return ref


def resolve_ref(ref: str) -> Callable:
    """Import `"pkg.mod:qualname"` (or `"pkg.mod.name"`) and return the object."""
    if ":" in ref:
        module_name, _, attr_path = ref.rpartition(":")
    else:
        module_name, _, attr_path = ref.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(
            f"{ref!r} is not a qualified name like 'package.module:function' or 'path/to/file.py:function'"
        )
    if module_name.endswith(".py"):
        obj = _load_file(module_name, ref)
    else:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"cannot import module {module_name!r} of reward {ref!r}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ValueError(
                f"module {module_name!r} has no attribute {attr_path!r} ({ref!r})"
            ) from e
    if not callable(obj):
        raise ValueError(f"reward {ref!r} is not callable")
    return obj


def _load_file(path: str, ref: str):
    """The module of a Python file, loaded once per process (kept in sys.modules under a name of its path)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"reward file {path!r} of {ref!r} does not exist ({file})")
    name = "cppo_reward_file_" + hashlib.sha1(str(file).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(
            f"cannot load reward file {file} of {ref!r}: {type(e).__name__}: {e}"
        ) from e
    return module


def register(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register a module-level reward function under `name` (replacing any earlier entry)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def decorator(fn: Callable) -> Callable:
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", "")
        if not module or "<" in qualname:
            raise ValueError(
                f"cannot register {fn!r} as {name!r}: reward functions must be defined at the top level "
                "of an importable module so that reward workers can import them"
            )
        _REGISTRY[name] = f"{module}:{qualname}"
        return fn

    return decorator


def reference(name_or_ref: str | Callable) -> str:
    """The importable reference of a registered name, a qualified name or a function."""
    if callable(name_or_ref):
        return qualified_name(name_or_ref)
    if not isinstance(name_or_ref, str):
        raise ValueError(f"a reward is a name, a qualified name or a function, got {name_or_ref!r}")
    if name_or_ref in _REGISTRY:
        return _REGISTRY[name_or_ref]
    if ":" in name_or_ref or "." in name_or_ref:
        module_name, sep, attr_path = name_or_ref.rpartition(":")
        if sep and module_name.endswith(
            ".py"
        ):  # a file: absolute, so workers find it from anywhere
            return f"{Path(module_name).resolve()}:{attr_path}"
        return name_or_ref
    raise ValueError(f"unknown reward {name_or_ref!r}; known rewards: {', '.join(known_names())}")


def resolve(name: str | Callable) -> Callable:
    """The function registered as `name` (or found at the qualified name `name`)."""
    if callable(name):
        return name
    ref = reference(name)
    try:
        return resolve_ref(ref)
    except ValueError as e:
        raise ValueError(f"{e}; known rewards: {', '.join(known_names())}") from e


def as_pair_fn(fn: Callable) -> Callable[[str, str], float]:
    """`fn` as a function of `(completion, solution)`: format rewards take the completion only."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in positional):
        return fn

    def completion_only(completion: str, solution: str) -> float:
        return fn(completion)

    return completion_only


def display_name(name_or_ref: str) -> str:
    """The name metrics use: a registered name as it is, else the function's name (as TRL names it)."""
    if name_or_ref in _REGISTRY or (":" not in name_or_ref and "." not in name_or_ref):
        return name_or_ref
    if ":" in name_or_ref:
        return name_or_ref.rpartition(":")[2]
    return name_or_ref.rpartition(".")[2]


_TRL_ARGS = ("prompts", "completions", "completion_ids", "completions_ids")


def is_trl_style(fn: Callable) -> bool:
    """Whether `fn` follows TRL's convention (see the module docstring) rather than `(completion, solution)`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(name in params for name in _TRL_ARGS):
        return True
    kinds = {p.kind for p in params.values()}
    return inspect.Parameter.VAR_KEYWORD in kinds and not kinds - {inspect.Parameter.VAR_KEYWORD}


def item_fn(fn: Callable) -> Callable[[str, str, dict | None], float | None]:
    """`fn` as a function of one `(completion, solution, context)`; `context` holds `prompt`,
    `completion_ids` and the example's columns (TRL-style functions only; None: empty)."""
    if not is_trl_style(fn):
        pair = as_pair_fn(fn)

        def pair_item(completion: str, solution: str, context: dict | None = None) -> float:
            return pair(completion, solution)

        return pair_item
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())

    def trl_item(completion: str, solution: str, context: dict | None = None) -> float | None:
        ctx = {"solution": solution, **(context or {})}
        ids = list(ctx.pop("completion_ids", []))
        kwargs = {"prompts": [ctx.pop("prompt", "")], "completions": [completion]}
        kwargs["completion_ids"] = kwargs["completions_ids"] = [ids]  # TRL's code; its older docs
        kwargs.update({k: [v] for k, v in ctx.items()})
        if not takes_all:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        out = fn(**kwargs)
        if not isinstance(out, (list, tuple)) or len(out) != 1:
            raise ValueError(
                f"returned {out!r}: a TRL-style reward returns a list of one float (or None) per completion"
            )
        return out[0]

    return trl_item


def note(event: str, count: int = 1) -> None:
    """Count an event in this process (for example `"math_gold_unparsed"`)."""
    _NOTES[event] += count


def drain_notes() -> dict[str, int]:
    """Return and reset this process's event counts."""
    out = dict(_NOTES)
    _NOTES.clear()
    return out
