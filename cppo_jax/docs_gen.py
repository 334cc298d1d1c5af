"""Generate docs/configuration.md from the config dataclasses: every section and key, with its type,
default, allowed values and meaning.

    python -m cppo_jax.docs_gen            # (re)write docs/configuration.md
    python -m cppo_jax.docs_gen --check    # exit 1 when the committed file differs from the code

Where each column comes from:
- key, type, default: the dataclasses themselves (`Config` and its sections in cppo_jax/config.py, and
  `SFTConfig` in cppo_jax/sft.py);
- allowed: the validation calls in each class's `__post_init__`, read from the source (`_choice(key, value,
  options)` and `_check(cond, key, value, allowed)`, loops over literal tuples included);
- meaning: `MEANINGS[key]` when present, else the trailing `# comment` on the field's line(s) in the source.

A new field needs either a trailing comment or an entry in `MEANINGS`, otherwise generation fails and names
it; an entry in `MEANINGS` for a key that no longer exists fails too, so the two never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from cppo_jax.config import Config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "configuration.md"
SFT_PREFIX = "sft."  # keys of SFTConfig are listed as sft.<key> (set them without the prefix)

# Meanings of fields whose trailing comment is missing or too terse. Keys are dotted config paths.
MEANINGS: dict[str, str] = {
    # model.arch
    "model.arch.arch": "Architecture family of a model built from scratch (the SFT warm start).",
    "model.arch.vocab_size": "Vocabulary size; the SFT warm start replaces it with its tokenizer's.",
    "model.arch.hidden_size": "Model width D.",
    "model.arch.intermediate_size": "MLP width F.",
    "model.arch.num_layers": "Decoder layers L.",
    "model.arch.num_heads": "Query heads H.",
    "model.arch.num_kv_heads": "Key/value heads J (grouped-query attention).",
    "model.arch.head_dim": "Width of one attention head E (even: rotary embeddings).",
    "model.arch.rope_theta": "Rotary embedding base.",
    "model.arch.rms_norm_eps": "Epsilon of the RMS norms.",
    "model.arch.tie_word_embeddings": "Share the input embedding and the output projection (lm_head).",
    "model.arch.max_position_embeddings": "Longest sequence (prompt + completion) the model is built for.",
    # model
    "model.path": "The policy's model: a local Hugging Face folder (config.json, *.safetensors, "
    "tokenizer). Never a hub name: nothing is downloaded. Required unless `model.init_checkpoint` is set.",
    "model.tokenizer": "Tokenizer folder; empty: the model folder's own.",
    "model.init_checkpoint": "A Hugging Face folder the policy and the reference model start from instead "
    "of `model.path` (a warm start).",
    "model.warm_start": "An SFT config file (`get_config()` returning `SFTConfig`) run first to create "
    "`model.init_checkpoint` when that folder does not exist.",
    "model.dtype": "Compute dtype of the forward and backward passes and of the sampler's KV cache.",
    "model.param_dtype": "Storage dtype of the parameters (and so of the optimizer's updates).",
    "model.remat": "Rematerialize each decoder layer in the backward pass: less activation memory, "
    "about one more forward pass of compute.",
    "model.scan_layers": "Run the decoder layers under one `lax.scan` over their stacked params, so "
    "every program holds one copy of the layer and compiles in about the same time at any depth; "
    "false unrolls them (same params and results, one copy per layer in each program).",
    # data
    "data.task": "Prompt format, system prompt and answer parsing: `arith` (the tiny synthetic task), "
    "`gsm8k` or `math`.",
    "data.train": "Training questions: a shipped data set name (`arith`, `gsm8k`, `math500`, ...) or a "
    "local .jsonl / .jsonl.gz / .parquet file or folder.",
    "data.test": "Held-out questions evaluated before and after training (and every "
    "`trainer.eval_every` steps without a validation split); same forms as `data.train`.",
    "data.split_train": "Split of `data.train` to read.",
    "data.split_test": "Split of `data.test` to read.",
    "data.max_prompt_len": "Prompt slots P: prompts are left-padded (or cut) to this many tokens.",
    "data.system_prompt": "System prompt; unset (None): the task's own (`cppo_jax/tasks/prompts.py`, the "
    "released strings for gsm8k and math); an empty string: no system message.",
    "data.prompt_format": "`chat`: the tokenizer's chat template over [system, user] (the released "
    "code); `plain`: the system prompt and the question on their own lines, no template.",
    "data.long_prompts": "A prompt longer than `data.max_prompt_len`: `truncate` keeps its last tokens, "
    "`reject` raises an error naming the example.",
    "data.bad_rows": "A malformed data row: `skip` it (counted and reported) or raise an `error` naming "
    "the file and line.",
    "data.shuffle": "Shuffle the training questions (per epoch, from `data.seed`).",
    "data.seed": "Seed of the question order, of the validation hold-out and of the arith generator.",
    # rollout
    "rollout.backend": "Where completions come from: `embedded` (the JAX sampler on the training "
    "devices) or `vllm` (an external vLLM server, see docs/vllm.md).",
    "rollout.max_new_tokens": "Completion slots C: the most tokens sampled per completion.",
    "rollout.temperature": "Sampling temperature of training rollouts; log-probs are computed from "
    "logits divided by it too.",
    "rollout.top_p": "Nucleus sampling: keep the smallest set of tokens with this much probability.",
    "rollout.top_k": "Sample among the k most likely tokens; 0: off.",
    "rollout.vllm_url": "Base URL of the vLLM server (`backend=vllm`), e.g. http://127.0.0.1:8000.",
    "rollout.vllm_api_key": "Sent as `Authorization: Bearer <key>` to the server's /v1 routes.",
    "rollout.push_every": "Push the policy's weights to the vLLM server every this many steps.",
    "rollout.timeout_s": "Read timeout of one request to the vLLM server, in seconds.",
    "rollout.overlap": "1: generate the next step's completions (with the current weights) while the "
    "current step trains; they are trained on one update later, with the sampling weights' log-probs "
    "as the old policy. vLLM backend only.",
    # cppo
    "cppo.num_generations": "G: completions sampled per question.",
    "cppo.questions_per_step": "b: questions per step of plain GRPO; with allocation CPPO draws "
    "Q = floor(b / (1 - p)).",
    "cppo.pruning_rate": "p: the fraction of each group's completions pruned before any forward pass; "
    "k = max(1, floor(G (1 - p))) are kept. 0 is GRPO.",
    "cppo.allocation": "Dynamic allocation: draw Q = floor(b / (1 - p)) questions per step so that "
    "Q k is about b G (GRPO's trained batch).",
    "cppo.metric": "Which completions are pruned: `smallest` drops the smallest |A| (CPPO); `largest` "
    "and `random` are ablations.",
    "cppo.scope": "`question`: keep k per question (the paper's text); `process`: one top-|A| over each "
    "of `cppo.processes` slices of the step, dropping int(N p) of its N (the released TRL fork, which "
    "produced the paper's tables); `batch`: one top-|A| over the whole batch, keeping floor(Q G (1 - p)) "
    "(the released verl recipe). See docs/concepts.md.",
    "cppo.processes": "`scope=process`: how many slices (the TRL fork's training processes, one per GPU) "
    "the step's questions are cut into; must divide Q.",
    "cppo.adv_scale": "Advantage scale: `group` (r - mean) / (group std + eps); `batch` divides by the "
    "std of the whole batch; `none` is r - mean (Dr. GRPO).",
    "cppo.adv_eps": "Added to the std in the advantage's denominator.",
    "cppo.mu": "mu: policy updates per generation; with mu > 1 the old policy's log-probs are computed "
    "once before the updates.",
    "cppo.beta": "Weight of the k3 KL penalty to the reference model; 0: no reference model is kept "
    "and its forward pass is skipped.",
    "cppo.eps_low": "Lower clip range: the ratio is clipped below at 1 - eps_low.",
    "cppo.eps_high": "Upper clip range: the ratio is clipped above at 1 + eps_high (DAPO: 0.28).",
    "cppo.loss_type": "Loss aggregation: `token_mean` (released CPPO code), `seq_mean` (GRPO paper), "
    "`dr_grpo`, `dapo` (see cppo_jax/loss.py).",
    "cppo.mask_truncated": "Leave completions that hit `rollout.max_new_tokens` without an EOS out of "
    "the loss (DAPO-style).",
    # reward
    "reward.funcs": "Reward functions by registered name (`arith_accuracy`, `gsm8k_format`, "
    "`math_accuracy`, ...), `module:function` or `path/to/file.py:function`; the reward is their "
    "weighted sum. A function takes `(completion, solution)`, or TRL's keywords (`prompts`, "
    "`completions`, `completion_ids`, the data's columns) and returns a list of floats, None to abstain.",
    "reward.weights": "One weight per reward function.",
    "reward.timeout_s": "Longest time one completion may take to score; a completion over it scores 0 "
    "and is counted in `rewards/timeouts`.",
    "reward.num_workers": "Reward worker processes; 0 scores in the training process (no time bound).",
    # optim
    "optim.lr": "Peak learning rate of AdamW.",
    "optim.schedule": "Learning-rate schedule after the warm-up: `cosine` decay to 0, `linear` decay "
    "to 0, or `constant`.",
    "optim.warmup_ratio": "Fraction of the optimizer updates spent warming up linearly from 0.",
    "optim.weight_decay": "AdamW weight decay.",
    "optim.b1": "Adam's first-moment decay.",
    "optim.b2": "Adam's second-moment decay.",
    "optim.eps": "Adam's epsilon.",
    "optim.grad_clip": "Clip the gradient's global norm to this; 0: off.",
    # mesh
    "mesh.data": "Data-parallel axis: each device along it holds different questions.",
    "mesh.fsdp": "Fully sharded data-parallel axis: parameters and optimizer state are sharded along it.",
    "mesh.tensor": "Tensor-parallel axis: weight matrices are split along it.",
    # trainer
    "trainer.seed": "Seed of sampling, pruning (`metric=random`) and everything random in a step.",
    "trainer.out_dir": "Parent folder of the run folders.",
    "trainer.run_name": "The run's folder under `trainer.out_dir`; every output lands there.",
    "trainer.resume": "Continue from the latest checkpoint in the run folder (if any).",
    "trainer.keep_checkpoints": "Checkpoints kept on disk (the oldest are deleted).",
    "trainer.log_every": "Write sample completions every this many steps (metrics are written every "
    "step).",
    "trainer.eval_every": "Evaluate (validation when `data.val_size` > 0, else test) every this many "
    "steps; 0: only before and after training.",
    "trainer.eval_size": "Test questions evaluated; 0: the whole test split.",
    "trainer.micro_batch": "Kept sequences per forward/backward pass (gradient accumulation); must "
    "divide the kept sequences per step; 0: all at once.",
    "trainer.max_nan_streak": "Stop (saving the last good state) after this many non-finite steps in "
    "a row; a non-finite step skips its update.",
    "trainer.dry_run": "Load and check the config, data, tokenizer and shapes, print the plan, train "
    "nothing (no weights needed).",
    "trainer.profile_steps": "`[first, last]`, steps numbered as in metrics.jsonl: record an XLA "
    "trace of these steps under `<run>/profile` (cppo_jax/profile.py), and the train step's HLO; "
    "`[]`: no trace.",
    "trainer.compile_cache_dir": "Persistent XLA compilation cache: `auto` (`$JAX_COMPILATION_CACHE_DIR` "
    "when set, else `~/.cache/cppo_jax/xla`), a folder, or `none`. A repeated or resumed run (or "
    "another run with the same shapes) loads its programs instead of compiling them again.",
    "trainer.steps": "Steps to run; 0: one pass over the training questions (one epoch).",
    "trainer.checkpoint_every": "Save a checkpoint (orbax, under `<run>/checkpoints`) every this many "
    "steps; 0: only at the end. The last step is always saved.",
    # eval
    "eval.rule": "The headline accuracy (summary, best checkpoint): `released`, the released code's "
    "lenient rule (spec section 4: exact, single number, or last number, on the extracted answer, else "
    "on the raw text; MATH: math-verify of the boxed answer), or `strict`, accuracy reward > 0.",
    # logging
    "logging.progress": "Show a progress bar (reward, accuracy, kept, phase times).",
    "logging.tensorboard": "Write TensorBoard events under `<run>/tensorboard`.",
    "logging.samples_per_log": "Questions whose first completion is written to samples.jsonl when "
    "samples are logged; 0: none.",
    "logging.plot": "Draw `<run>/curves.png` (reward and accuracy) at the end.",
    # sft (cppo_jax/sft.py)
    "sft.out": "The Hugging Face folder written at the end (the RL run's `model.init_checkpoint`).",
    "sft.init_from": "Continue from this Hugging Face folder (weights and tokenizer) instead of a "
    "random model with the tiny tokenizer.",
    "sft.arch": "Architecture of the random model (the keys of `model.arch`).",
    "sft.data": "Data of the warm start (the keys of `data`; the arith task).",
    "sft.completion_len": "Completion tokens of the reference completions trained on.",
    "sft.batch": "Sequences per update.",
    "sft.steps": "Updates.",
    "sft.lr": "Peak learning rate (AdamW, cosine decay after the warm-up).",
    "sft.warmup": "Warm-up updates.",
    "sft.seed": "Seed of the initialisation and of the batches.",
    "sft.log_every": "Print the loss every this many updates.",
    "sft.eval_size": "Held-out questions answered greedily at the end (accuracy printed).",
    "sft.direct_fraction": "Share of targets in the direct style (expression, then answer, no worked "
    "steps; `arith.direct_completion`), drawn per row of every batch; the rest are stepwise.",
}

SECTION_NOTES: dict[str, str] = {
    "model": "What the policy is and how it is stored and computed.",
    "model.arch": "Only used to build a model from scratch (the SFT warm start of the tiny task); a "
    "model loaded from a folder takes its architecture from its config.json.",
    "data": "Where questions come from and how prompts are shaped.",
    "rollout": "How completions are sampled during training.",
    "cppo": "The algorithm: GRPO plus completion pruning (p = 0 is plain GRPO).",
    "reward": "How completions are scored (host processes, bounded in time).",
    "optim": "AdamW and its learning-rate schedule; the schedule runs over steps x mu updates.",
    "mesh": "Axis sizes of the device mesh; -1 means the rest of the devices.",
    "trainer": "The run: length, outputs, checkpoints, evaluation, safety nets.",
    "eval": "How held-out accuracy is counted; both rules are always reported.",
    "logging": "What the run writes for its user besides metrics.jsonl.",
    "sft": "The supervised warm start (`cppo_jax/sft.py`), a config file of its own whose "
    "`get_config()` returns an `SFTConfig` (configs/tiny_sft.py). Its keys are set without the "
    "`sft.` prefix, e.g. `python -m cppo_jax.launch --config configs/tiny_sft.py steps=300`.",
}

HEADER = """\
# Configuration reference

<!-- Generated by `python -m cppo_jax.docs_gen` from cppo_jax/config.py and cppo_jax/sft.py.
     Do not edit by hand: change the code (a trailing `# comment` on the field, or MEANINGS in
     cppo_jax/docs_gen.py) and regenerate; `python -m cppo_jax.docs_gen --check` runs in the tests. -->

A run is configured by a Python file whose `get_config()` returns a `Config` (see `configs/`), plus
`key.path=value` overrides on the command line:

```
python -m cppo_jax.launch --config configs/tiny_cpu.py cppo.pruning_rate=0.75 trainer.steps=20
```

An override is parsed by the field's type (`true`/`false`, numbers, `[a,b]` for tuples). Every section is
validated when it is built: a wrong value, type or key raises `ConfigError` naming the key, the value and
what is allowed (an unknown key also suggests the closest known ones). The resolved config is saved as
`<run>/config.json`. The "allowed" column lists the checks made at load time; "-" means any value of the
type.
"""

# ----------------------------------------------------------------------------------------------
# Reading the source.


def _class_source(cls) -> tuple[str, ast.ClassDef]:
    source = textwrap.dedent(inspect.getsource(cls))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef), cls
    return source, node


def field_comments(cls) -> dict[str, str]:
    """Trailing `# comments` on each field's line(s) of a dataclass (joined when several)."""
    source, node = _class_source(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            lines = range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
            found = [comments[i] for i in lines if i in comments]
            if found:
                out[stmt.target.id] = " ".join(found)
    return out


def _text(node: ast.AST, env: dict[str, str]) -> str | None:
    """A string constant or an f-string of loop variables; None when it cannot be evaluated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value.value, ast.Name) and value.value.id in env:
                parts.append(env[value.value.id])
            else:
                return None
        return "".join(parts)
    return None


def _allowed_text(node: ast.AST) -> str:
    """The `allowed` argument of `_check`, with interpolated values left out."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        text = "".join(str(v.value) for v in node.values if isinstance(v, ast.Constant))
        return text.replace(" ()", "").rstrip("= ")
    return ast.unparse(node)


def _options_text(node: ast.AST) -> str | None:
    try:
        options = ast.literal_eval(node)
    except ValueError:
        return None
    return "one of " + ", ".join(f"`{o}`" for o in options)


def _loop_names(stmt: ast.For) -> tuple[str, tuple[str, ...]] | None:
    """`for name in ("a", "b")` or `for name, x in zip(("a", "b"), ...)`: (name, ("a", "b"))."""
    target, iterable = stmt.target, stmt.iter
    if (
        isinstance(target, ast.Tuple)
        and target.elts
        and isinstance(target.elts[0], ast.Name)
        and isinstance(iterable, ast.Call)
        and isinstance(iterable.func, ast.Name)
        and iterable.func.id == "zip"
        and iterable.args
    ):
        target, iterable = target.elts[0], iterable.args[0]
    if not isinstance(target, ast.Name):
        return None
    try:
        values = ast.literal_eval(iterable)
    except ValueError:
        return None
    if isinstance(values, tuple) and all(isinstance(v, str) for v in values):
        return target.id, values
    return None


def validation_rules(cls) -> dict[str, list[str]]:
    """{dotted key: [allowed, ...]} from `_choice` / `_check` calls in the class's `__post_init__`."""
    _, node = _class_source(cls)
    rules: dict[str, list[str]] = {}

    def add(key: str | None, text: str | None) -> None:
        if key and text and text not in rules.setdefault(key, []):
            rules[key].append(text)

    def walk(stmts: list[ast.stmt], env: dict[str, str]) -> None:
        for stmt in stmts:
            loop = _loop_names(stmt) if isinstance(stmt, ast.For) else None
            if loop is not None:
                name, values = loop
                for v in values:
                    walk(stmt.body, {**env, name: v})
                continue
            for call in ast.walk(stmt):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                    continue
                if call.func.id == "_choice" and len(call.args) == 3:
                    add(_text(call.args[0], env), _options_text(call.args[2]))
                elif call.func.id == "_check" and len(call.args) == 4:
                    add(_text(call.args[1], env), _allowed_text(call.args[3]))

    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__post_init__":
            walk(stmt.body, {})
    return rules


# ----------------------------------------------------------------------------------------------
# Rendering.


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in typing.get_args(tp))
        return f"tuple[{args}]"
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def default_text(value: Any) -> str:
    if isinstance(value, str):
        return '`""`' if value == "" else f'`"{value}"`'
    if isinstance(value, tuple):
        inner = ", ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in value)
        return f"`[{inner}]`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """Table-cell text: pipes escaped; `<` outside code spans escaped (else it may open an HTML tag)."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;")
    return "`".join(parts)


def _sentence(comment: str) -> str:
    """A trailing comment as a sentence: capitalised, with a final full stop."""
    comment = comment.strip()
    if not comment:
        return ""
    comment = comment[0].upper() + comment[1:]
    return comment if comment.endswith((".", ")")) else comment + "."


@dataclasses.dataclass
class Section:
    prefix: str  # "model.arch"
    cls: type
    instance: Any  # the default value of the section


def sections() -> list[Section]:
    """`Config`'s sections (nested ones after their parent), then `SFTConfig` as `sft`."""
    out: list[Section] = []

    def visit(prefix: str, instance: Any) -> None:
        out.append(Section(prefix, type(instance), instance))
        for f in dataclasses.fields(instance):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                visit(f"{prefix}.{f.name}", value)

    for f in dataclasses.fields(Config):
        visit(f.name, getattr(Config(), f.name))
    from cppo_jax.sft import SFTConfig

    out.append(Section(SFT_PREFIX.rstrip("."), SFTConfig, SFTConfig()))
    return out


def all_keys() -> list[str]:
    """Every documented leaf key (dotted; `sft.*` for SFTConfig's own fields)."""
    keys = []
    for sec in sections():
        for f in dataclasses.fields(sec.cls):
            value = getattr(sec.instance, f.name)
            if sec.prefix == "sft" or not dataclasses.is_dataclass(value):
                keys.append(f"{sec.prefix}.{f.name}")
    return keys


def render() -> str:
    """The whole docs/configuration.md; raises ValueError when a key has no meaning."""
    rules: dict[str, list[str]] = {}
    classes = [Config] + [sec.cls for sec in sections()]
    for cls in dict.fromkeys(classes):  # each class once, in a fixed order
        for key, allowed in validation_rules(cls).items():
            rules.setdefault(key, []).extend(a for a in allowed if a not in rules[key])
    missing, used = [], set()
    parts = [HEADER.rstrip()]
    index = ["| section | class | keys |", "| --- | --- | --- |"]
    bodies = []
    for sec in sections():
        comments = field_comments(sec.cls)
        hints = typing.get_type_hints(sec.cls)
        rows = ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
        n = 0
        for f in dataclasses.fields(sec.cls):
            key = f"{sec.prefix}.{f.name}"
            value = getattr(sec.instance, f.name)
            nested = dataclasses.is_dataclass(value)
            if nested and sec.prefix != "sft":
                continue  # documented as its own section
            meaning = MEANINGS.get(key) or _sentence(comments.get(f.name, ""))
            used.add(key)
            if not meaning:
                missing.append(key)
            allowed = "; ".join(rules.get(key, [])) or "-"
            default = f"`{type(value).__name__}()`" if nested else default_text(value)
            rows.append(
                f"| `{key}` | `{type_name(hints[f.name])}` | {default} | {_cell(allowed)} "
                f"| {_cell(meaning)} |"
            )
            n += 1
        anchor = sec.prefix.replace(".", "")
        index.append(f"| [`{sec.prefix}`](#{anchor}) | `{sec.cls.__name__}` | {n} |")
        note = SECTION_NOTES.get(sec.prefix) or (inspect.getdoc(sec.cls) or "").split("\n\n")[0]
        bodies.append(f"## {sec.prefix}\n\n`{sec.cls.__name__}`. {note}\n\n" + "\n".join(rows))
    stale = sorted(set(MEANINGS) - used)
    if missing or stale:
        problems = []
        if missing:
            problems.append(
                "no meaning for config key(s) "
                + ", ".join(missing)
                + ": add a trailing `# comment` on the field or an entry in MEANINGS "
                "(cppo_jax/docs_gen.py)"
            )
        if stale:
            problems.append(
                "MEANINGS (cppo_jax/docs_gen.py) names key(s) that no longer exist: "
                + ", ".join(stale)
            )
        raise ValueError("; ".join(problems))
    parts.append("\n".join(index))
    parts.extend(bodies)
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cppo_jax.docs_gen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when the file is out of date")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the markdown file")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        text = render()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        current = out.read_text() if out.is_file() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(), text.splitlines(), str(out), "generated", lineterm="", n=1
        )
        shown = "\n".join(list(diff)[:60])
        print(
            f"{out} is out of date with the config dataclasses: run `python -m cppo_jax.docs_gen`"
            f"\n{shown}",
            file=sys.stderr,
        )
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} ({len(all_keys())} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
