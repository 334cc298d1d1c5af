"""Evaluation of a checkpoint on the paper's benchmarks (spec section 5), every question scored.

    python -m cppo_jax.evaluate --config configs/gsm8k_1p5b.py --checkpoint PATH \\
        [--benchmarks gsm8k,math500,amc23,aime24] [--out DIR] [key.path=value ...]

PATH is either
- a Hugging Face folder (config.json + safetensors, e.g. one written by `save_hf`, a downloaded
  Qwen2.5 folder, or the shipped tiny warm start `cppo_jax/assets/tiny_arith`); the tokenizer is
  `model.tokenizer` when set, else the folder's own, else that of the config's model folder. No
  `model.path` is needed: the folder is the model; or
- a training run folder (`<trainer.out_dir>/<run_name>`, holding config.json and checkpoints/): the
  run's orbax checkpoint (the latest, or `--step N`) is restored onto the model built from the run's
  config.json and the config.json of its `model.init_checkpoint` / `model.path` (refused with
  "model.path is required: ..." when the run names neither). `--config` may then be left out: the
  run's own config is used (overrides still apply).

Benchmarks (`BENCHMARKS`), by default those of `data.task` (arith: arith; gsm8k: gsm8k; math: math500,
amc23, aime24):

| name | data | decoding | new tokens |
| --- | --- | --- | --- |
| gsm8k | GSM8K test, 1319 | greedy | 1024 |
| math500 | MATH-500, 500 | greedy | 1024 |
| amc23 | AMC23, 40 | mean of 4 samples, T 0.6, top-p 0.95 | 3072 |
| aime24 | AIME24, 30 | mean of 4 samples, T 0.6, top-p 0.95 | 3072 |
| arith | the arith test split (data.num_test) | greedy | rollout.max_new_tokens |

A completion is scored under both rules (`cppo_jax.rewards.registry.TASK_EVAL`): `released`, the released
code's lenient evaluation (spec section 4; `gsm8k_eval_released`, `math_eval_released`), and `strict`, the
task's accuracy reward > 0. `accuracy` is the rule `eval.rule` names (the paper configs: released), and
`accuracy_released` / `accuracy_strict` are both.

`--max-new-tokens` and `--samples` override the token budget (all benchmarks) and the number of samples
(sampled benchmarks); `--limit N` scores only the first N questions. Prompts are built exactly as in
training (system prompt of the task, chat template, `data.max_prompt_len`, `data.long_prompts`).
The system prompt is `data.system_prompt` for benchmarks of `data.task`, else the benchmark task's own.
Generation runs in batches of `--batch-size` sequences with the configured rollout backend (embedded
JAX sampler, or vLLM with `rollout.backend=vllm rollout.vllm_url=...`); the last batch is padded by
repeating questions and the extra outputs dropped, so every question is scored exactly once per sample.
Rewards run in a time-bounded `RewardPool` (`reward.timeout_s`, `reward.num_workers`).

Written to `--out` (default `<run>/eval` for a run folder, `<trainer.out_dir>/eval/<folder name>` for a
Hugging Face folder, which is never written into): `<benchmark>.jsonl`, one row per completion (question
id, sample, prompt, completion, gold answer, reward per function, correct, length, truncated), and
`summary.md` / `summary.json` (benchmark, n, samples, accuracy under each rule, mean length, truncated
fraction, time),
which is also printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from cppo_jax import pipeline
from cppo_jax.config import Config, ConfigError
from cppo_jax.config_io import apply_overrides, from_dict, load_config

__all__ = [
    "BENCHMARKS",
    "DEFAULT_BENCHMARKS",
    "TASK_REWARDS",
    "Benchmark",
    "EvaluationError",
    "Policy",
    "checkpoint_kind",
    "evaluate",
    "load_benchmark",
    "load_policy",
    "main",
    "summary_table",
]


class EvaluationError(ValueError):
    """A user error in an evaluation request (benchmark name, option); the message names it."""


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    source: str  # data set name (cppo_jax.datasets) or "arith"
    task: str  # prompt and reward family: arith, gsm8k or math
    samples: int = 1  # completions per question; accuracy is their mean
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int | None = 1024  # None: rollout.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and self.samples == 1


BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k": Benchmark("gsm8k", "gsm8k", "gsm8k"),
    "math500": Benchmark("math500", "math500", "math"),
    "amc23": Benchmark("amc23", "amc23", "math", 4, 0.6, 0.95, 3072),
    "aime24": Benchmark("aime24", "aime24", "math", 4, 0.6, 0.95, 3072),
    "arith": Benchmark("arith", "arith", "arith", max_new_tokens=None),
}
DEFAULT_BENCHMARKS: dict[str, tuple[str, ...]] = {
    "arith": ("arith",),
    "gsm8k": ("gsm8k",),
    "math": ("math500", "amc23", "aime24"),
}
# (accuracy, format) reward of each task, written to each row; correctness is by rule (TASK_EVAL).
TASK_REWARDS: dict[str, tuple[str, str]] = {
    "arith": ("arith_accuracy", "arith_format"),
    "gsm8k": ("gsm8k_accuracy", "gsm8k_format"),
    "math": ("math_accuracy", "math_format"),
}
RULES = ("released", "strict")
_SEED_STRIDE = 1_000_003


# ----------------------------------------------------------------------------------------------
# Checkpoints.


@dataclasses.dataclass
class Policy:
    graphdef: Any
    params: Any
    tokenizer: Any
    kind: str  # "hf" or "run"
    path: Path
    step: int | None = None  # the restored training step (run folders)
    run_config: Config | None = None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EvaluationError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise EvaluationError(f"{path}: expected a JSON object")
    return data


def checkpoint_kind(path: str | Path) -> str:
    """ "hf" for a Hugging Face folder, "run" for a training run folder; errors name the folder."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{path} has no config.json: it is neither a Hugging Face folder (config.json + "
            f"*.safetensors) nor a training run folder (config.json + checkpoints/)"
        )
    data = _read_json(config_file)
    if "cppo" in data and "model" in data:
        if not (path / "checkpoints").is_dir():
            raise FileNotFoundError(
                f"{path} is a training run folder without checkpoints/: the run saved no checkpoint"
            )
        return "run"
    return "hf"


def run_config(path: str | Path) -> Config:
    """The validated Config a training run saved in its config.json."""
    return from_dict(_read_json(Path(path) / "config.json"))


def _tokenizer(folders: list[str | Path], where: str):
    from cppo_jax.models import Tokenizer
    from cppo_jax.models.tokenizer import has_tokenizer

    for folder in folders:
        if folder and has_tokenizer(folder):
            return Tokenizer.from_dir(folder)
    tried = ", ".join(str(f) for f in folders if f) or "none"
    raise FileNotFoundError(
        f"no tokenizer for {where} (looked in: {tried}); set model.tokenizer=/path/to/tokenizer"
    )


def load_policy(cfg: Config | None, checkpoint: str | Path, step: int | None = None) -> Policy:
    """Model definition, params and tokenizer of a Hugging Face folder or a training run folder."""
    from flax import nnx

    from cppo_jax.models import load_hf

    path = Path(checkpoint).resolve()
    kind = checkpoint_kind(path)
    if kind == "hf":
        if cfg is None:
            raise EvaluationError(
                f"{path} is a Hugging Face folder: give --config (prompts, rewards, backend)"
            )
        if step is not None:
            raise EvaluationError(
                f"--step applies to training run folders; {path} is a model folder"
            )
        model = load_hf(
            path,
            dtype=cfg.model.dtype,
            param_dtype=cfg.model.param_dtype,
            scan_layers=cfg.model.scan_layers,
        )
        graphdef, params = nnx.split(model)
        folders = [cfg.model.tokenizer, path, cfg.model.init_checkpoint, cfg.model.path]
        return Policy(graphdef, params, _tokenizer(folders, str(path)), kind, path)
    return _load_run(path, step)


def _load_run(path: Path, step: int | None) -> Policy:
    import jax
    from flax import nnx

    from cppo_jax import step as step_lib
    from cppo_jax.checkpoint import Checkpointer
    from cppo_jax.launch import MODEL_REQUIRED
    from cppo_jax.models.hf_io import read_hf_config
    from cppo_jax.models.transformer import Transformer

    rcfg = run_config(path)
    base = rcfg.model.init_checkpoint or rcfg.model.path
    if not base:
        raise ConfigError(
            f"{path / 'config.json'}: {MODEL_REQUIRED}; the run names neither model.path nor "
            f"model.init_checkpoint, so its architecture is unknown"
        )
    # The architecture only (no weights read): the Trainer's params are load_hf(base, dtype).
    tcfg = read_hf_config(base, dtype=rcfg.model.dtype)
    abstract = nnx.eval_shape(lambda: Transformer(tcfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract)
    tx = step_lib.make_optimizer(rcfg.optim, 1)  # the state's structure does not depend on length
    target = {"params": abstract_params, "opt_state": jax.eval_shape(tx.init, abstract_params)}
    ckpt = Checkpointer(path / "checkpoints", keep=rcfg.trainer.keep_checkpoints)
    try:
        state, meta = ckpt.restore(step, target)
    finally:
        ckpt.close()
    tokenizer = _tokenizer([rcfg.model.tokenizer, base, rcfg.model.path], f"run {path}")
    restored = int(meta.get("step", step if step is not None else -1))
    return Policy(graphdef, state["params"], tokenizer, "run", path, restored, rcfg)


# ----------------------------------------------------------------------------------------------
# Benchmarks.


def load_benchmark(bench: Benchmark, cfg: Config) -> list[dict]:
    """The benchmark's examples (`{"question", "solution", "answer"}`), in file order."""
    if bench.source == "arith":
        from cppo_jax.tasks import arith

        return arith.generate(cfg.data.num_test, seed=cfg.data.seed, split="test")
    from cppo_jax import datasets

    return datasets.load_examples(bench.source, "test", strict=cfg.data.bad_rows == "error")


def _resolve(
    names: list[str] | None, cfg: Config, max_new_tokens: int | None, samples: int | None
) -> list[Benchmark]:
    names = list(names or DEFAULT_BENCHMARKS[cfg.data.task])
    out = []
    for name in names:
        if name not in BENCHMARKS:
            raise EvaluationError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
        b = BENCHMARKS[name]
        b = dataclasses.replace(
            b,
            max_new_tokens=max_new_tokens or b.max_new_tokens or cfg.rollout.max_new_tokens,
            samples=samples if samples and b.samples > 1 else b.samples,
        )
        out.append(b)
    if len(set(names)) != len(names):
        raise EvaluationError(f"benchmark listed twice in {names}")
    return out


def _generate(backend, policy: Policy, prompts, bench: Benchmark, batch_size: int, seed: int):
    """Tokens, validity and finished flags of every (question, sample), question-major."""
    import jax.numpy as jnp

    S, C = bench.samples, bench.max_new_tokens
    per_call = max(1, batch_size // S)  # questions per call
    n = len(prompts)
    tokens, valid, finished = [], [], []
    for lo in range(0, n, per_call):
        idx = np.arange(lo, lo + per_call) % n  # pad the last batch by repeating questions
        part = prompts.take(idx)
        ids_QP, valid_QP = jnp.asarray(part.ids_nP), jnp.asarray(part.valid_nP)
        if bench.greedy:
            out = backend.greedy(policy.params, ids_QP, valid_QP, max_new_tokens=C)
        else:
            # Per-question seeds from the question's index: samples do not depend on the batching.
            seeds_Q = jnp.asarray((seed * _SEED_STRIDE + idx) % (2**31), jnp.uint32)
            out = backend.generate(policy.params, ids_QP, valid_QP, seeds_Q, S)
        keep = min(per_call, n - lo) * S  # ... and drop the padding's outputs
        tokens.append(np.asarray(out.tokens_NC)[:keep])
        valid.append(np.asarray(out.valid_NC)[:keep])
        finished.append(np.asarray(out.finished_N)[:keep])
    return np.concatenate(tokens), np.concatenate(valid), np.concatenate(finished)


def _run_benchmark(
    bench: Benchmark,
    cfg: Config,
    policy: Policy,
    backend,
    pool,
    *,
    limit: int | None,
    batch_size: int,
    seed: int,
    out_dir: Path,
    log,
) -> dict:
    from cppo_jax.sampler import SamplingParams

    t0 = time.perf_counter()
    examples = load_benchmark(bench, cfg)
    if limit:
        examples = examples[:limit]
    if not examples:
        raise EvaluationError(f"benchmark {bench.name!r} has no questions")
    tok = policy.tokenizer
    prompts = pipeline.encode_prompts(
        examples,
        tok,
        bench.task,
        cfg.data.max_prompt_len,
        cfg.data.long_prompts,
        system_prompt=cfg.data.system_prompt if bench.task == cfg.data.task else None,
        prompt_format=cfg.data.prompt_format,
    )
    # Backends read their sampling parameters at call time; each benchmark sets its own.
    backend.sp = SamplingParams(
        max_new_tokens=bench.max_new_tokens,
        temperature=bench.temperature,
        top_p=bench.top_p,
        eos_id=tok.stop_ids,
        pad_id=tok.pad_id,
        cache_dtype=cfg.model.dtype,
    )
    S = bench.samples
    how = "greedy" if bench.greedy else f"{S} samples at T {bench.temperature}, top-p {bench.top_p}"
    log(
        f"{bench.name}: {len(examples)} questions, {how}, {bench.max_new_tokens} new tokens"
        + (
            f" ({prompts.truncated} prompts cut to {cfg.data.max_prompt_len})"
            if prompts.truncated
            else ""
        )
    )
    tokens_NC, valid_NC, finished_N = _generate(backend, policy, prompts, bench, batch_size, seed)
    texts = pipeline.decode_completions(tok, tokens_NC, valid_NC)
    solutions = [ex["solution"] for ex in examples for _ in range(S)]
    _, per_fn, stats = pool.score(texts, solutions)
    correct = {rule: np.asarray(per_fn.pop(f"eval/{rule}")) > 0 for rule in RULES}
    correct_N = correct[cfg.eval.rule]
    lengths_N = valid_NC.sum(axis=1)
    elapsed = time.perf_counter() - t0

    with open(out_dir / f"{bench.name}.jsonl", "w", encoding="utf-8") as fh:
        for q, ex in enumerate(examples):
            prompt = tok.decode([int(t) for t in prompts.ids_nP[q][prompts.valid_nP[q]]])
            for j in range(S):
                i = q * S + j
                row = {
                    "benchmark": bench.name,
                    "id": q,
                    "sample": j,
                    "prompt": prompt,
                    "completion": texts[i],
                    "gold": ex["answer"],
                    "rewards": {name: float(v[i]) for name, v in per_fn.items()},
                    "correct": bool(correct_N[i]),
                    **{f"correct_{rule}": bool(c[i]) for rule, c in correct.items()},
                    "length": int(lengths_N[i]),
                    "truncated": bool(not finished_N[i]),
                }
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {
        "benchmark": bench.name,
        "n": len(examples),
        "samples": S,
        "accuracy": float(correct_N.mean()),
        "rule": cfg.eval.rule,
        **{f"accuracy_{rule}": float(c.mean()) for rule, c in correct.items()},
        "mean_length": float(lengths_N.mean()),
        "truncated": float(np.mean(~finished_N)),
        "time_s": elapsed,
        "max_new_tokens": bench.max_new_tokens,
        "temperature": bench.temperature,
        "top_p": bench.top_p,
        "prompts_cut": prompts.truncated,
        "reward_timeouts": int(stats["timeouts"]),
        "reward_errors": int(stats["errors"]),
    }


def summary_table(rows: list[dict]) -> str:
    """The markdown summary: benchmark, n, samples, accuracy (headline rule, then each), mean length,
    truncated fraction, time."""
    lines = [
        "| benchmark | n | samples | accuracy | released | strict | mean length | truncated | time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['benchmark']} | {r['n']} | {r['samples']} | {r['accuracy']:.2%} ({r['rule']}) | "
            f"{r['accuracy_released']:.2%} | {r['accuracy_strict']:.2%} | "
            f"{r['mean_length']:.1f} | {r['truncated']:.2%} | {r['time_s']:.1f} |"
        )
    return "\n".join(lines)


def _default_out(cfg: Config, policy: Policy) -> Path:
    if policy.kind == "run":
        return policy.path / "eval"
    return Path(cfg.trainer.out_dir) / "eval" / policy.path.name


def evaluate(
    cfg: Config | None,
    checkpoint: str | Path,
    benchmarks: list[str] | None = None,
    out: str | Path | None = None,
    *,
    step: int | None = None,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    samples: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    log=print,
) -> dict:
    """Evaluate `checkpoint` (see the module docstring); returns the summary rows and where they went.

    `cfg` None means the run folder's own config. `batch_size` counts sequences per generation call
    (questions x samples).
    """
    for name, value in (
        ("--batch-size", batch_size),
        ("--max-new-tokens", max_new_tokens),
        ("--samples", samples),
        ("--limit", limit),
    ):
        if value is not None and value < 1:
            raise EvaluationError(f"{name} must be >= 1, got {value}")
    if cfg is not None:  # check the request before loading anything
        _resolve(benchmarks, cfg, max_new_tokens, samples)
    policy = load_policy(cfg, checkpoint, step)
    cfg = cfg if cfg is not None else policy.run_config
    benches = _resolve(benchmarks, cfg, max_new_tokens, samples)
    out_dir = Path(out) if out else _default_out(cfg, policy)
    out_dir.mkdir(parents=True, exist_ok=True)

    from cppo_jax.rewards.pool import RewardPool
    from cppo_jax.rewards.registry import TASK_EVAL
    from cppo_jax.rollout import make_backend
    from cppo_jax.sampler import SamplingParams

    tok = policy.tokenizer
    sp = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_id=tok.stop_ids,
        pad_id=tok.pad_id,
        cache_dtype=cfg.model.dtype,
    )
    what = f"{policy.path}" + (f" (step {policy.step})" if policy.step is not None else "")
    log(f"evaluating {what} with the {cfg.rollout.backend} backend; writing {out_dir}")
    backend = make_backend(cfg.rollout, policy.graphdef, sp, out_dir)
    pools: dict[str, RewardPool] = {}
    rows = []
    try:
        for bench in benches:
            if bench.task not in pools:
                funcs = [(name, 1.0, name) for name in TASK_REWARDS[bench.task]]
                funcs += [(f"eval/{r}", 0.0, fn) for r, fn in TASK_EVAL[bench.task].items()]
                pools[bench.task] = RewardPool(
                    funcs, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s
                )
            row = _run_benchmark(
                bench,
                cfg,
                policy,
                backend,
                pools[bench.task],
                limit=limit,
                batch_size=batch_size,
                seed=seed,
                out_dir=out_dir,
                log=log,
            )
            rows.append(row)
            log(
                f"{bench.name}: accuracy {row['accuracy']:.2%} ({row['rule']} rule; released "
                f"{row['accuracy_released']:.2%}, strict {row['accuracy_strict']:.2%}) on "
                f"{row['n']} questions ({row['time_s']:.1f} s)"
            )
    finally:
        backend.close()
        for pool in pools.values():
            pool.close()

    table = summary_table(rows)
    header = f"checkpoint: {what}\n\n"
    (out_dir / "summary.md").write_text(header + table + "\n")
    result = {
        "checkpoint": str(policy.path),
        "kind": policy.kind,
        "step": policy.step,
        "backend": cfg.rollout.backend,
        "results": rows,
        "out": str(out_dir),
    }
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    log("\n" + table)
    return result


# ----------------------------------------------------------------------------------------------
# Command line.


def dry_run(
    cfg: Config | None,
    checkpoint: str | Path,
    benchmarks: list[str] | None = None,
    *,
    step: int | None = None,
    limit: int | None = None,
    log=print,
) -> None:
    """`--dry-run`: what `evaluate` would load and score, checked without reading weights."""
    from cppo_jax.checkpoint import Checkpointer
    from cppo_jax.launch import _check_weights

    path = Path(checkpoint).resolve()
    if checkpoint_kind(path) == "hf":
        if cfg is None:
            raise EvaluationError(f"{path} is a Hugging Face folder: give --config")
        _check_weights(path, "--checkpoint")
        folders = [cfg.model.tokenizer, path, cfg.model.init_checkpoint, cfg.model.path]
        what = f"model folder {path}"
    else:
        rcfg = run_config(path)
        base = rcfg.model.init_checkpoint or rcfg.model.path
        _check_weights(Path(base), "model.path of the run")
        ckpt = Checkpointer(path / "checkpoints")
        try:
            steps = ckpt.all_steps()
        finally:
            ckpt.close()
        if not steps or (step is not None and step not in steps):
            raise EvaluationError(
                f"{path / 'checkpoints'}: no checkpoint {step or ''} (has {steps})"
            )
        cfg = cfg if cfg is not None else rcfg
        folders = [rcfg.model.tokenizer, base, rcfg.model.path]
        what = f"run {path}, checkpoint step {step if step is not None else max(steps)}"
    tok = _tokenizer(folders, str(path))
    log(f"dry run: would evaluate {what} (tokenizer {tok.path}, backend {cfg.rollout.backend})")
    for bench in _resolve(benchmarks, cfg, None, None):
        n = len(load_benchmark(bench, cfg))
        n = min(n, limit) if limit else n
        log(
            f"  {bench.name}: {n} questions x {bench.samples} sample(s), {bench.max_new_tokens} tokens"
        )


def _config_for(config: str | None, checkpoint: str, overrides: list[str]) -> Config | None:
    if config:
        return load_config(config, overrides)
    if checkpoint_kind(checkpoint) != "run":
        raise EvaluationError(
            f"--config is required: {checkpoint} is a Hugging Face folder, not a training run folder"
        )
    return apply_overrides(run_config(checkpoint), overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cppo_jax.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="a configs/*.py file (default: a run folder's own config)")
    parser.add_argument("--checkpoint", required=True, help="a Hugging Face or training run folder")
    parser.add_argument("--benchmarks", default="", help="comma-separated: " + ",".join(BENCHMARKS))
    parser.add_argument("--out", default="", help="output folder")
    parser.add_argument("--step", type=int, default=None, help="run folders: checkpoint step")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per generation call")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="override, all benchmarks")
    parser.add_argument("--samples", type=int, default=None, help="override, sampled benchmarks")
    parser.add_argument("--limit", type=int, default=None, help="first N questions of each")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check config, folders and benchmarks; generate nothing",
    )
    parser.add_argument("overrides", nargs="*", help="key.path=value config overrides")
    args = parser.parse_intermixed_args(argv)
    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()] or None
    try:
        cfg = _config_for(args.config, args.checkpoint, args.overrides)
        if args.dry_run:
            dry_run(cfg, args.checkpoint, names, step=args.step, limit=args.limit)
            return 0
        evaluate(
            cfg,
            args.checkpoint,
            [b.strip() for b in args.benchmarks.split(",") if b.strip()] or None,
            args.out or None,
            step=args.step,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            samples=args.samples,
            limit=args.limit,
            seed=args.seed,
        )
    except (ConfigError, EvaluationError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
