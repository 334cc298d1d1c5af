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

Benchmarks (`eval.benchmarks.BENCHMARKS`), by default those of `data.task` (arith: arith; gsm8k: gsm8k; math: math500,
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

The layout: `eval.policy` loads the policy, `eval.benchmarks` generates and scores,
`eval.report` writes; this module is the command and `evaluate()`.

Written to `--out` (default `<run>/eval` for a run folder, `<trainer.out_dir>/eval/<folder name>` for a
Hugging Face folder, which is never written into): `<benchmark>.jsonl`, one row per completion (question
id, sample, prompt, completion, gold answer, reward per function, correct, length, truncated), and
`summary.md` / `summary.json` (benchmark, n, samples, accuracy under each rule, mean length, truncated
fraction, time; with several samples per question the accuracy is mean@n, and the unbiased pass@k for
k = 1, 2, 4, ... up to n is added), which is also printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import apply_overrides, load_config
from cppo_jax.config.schema import Config
from cppo_jax.eval import report as eval_report
from cppo_jax.eval.benchmarks import (
    BENCHMARKS,
    load_benchmark,
    resolve_benchmarks,
    reward_funcs,
    run_benchmark,
)
from cppo_jax.eval.policy import (
    EvaluationError,
    Policy,
    checkpoint_kind,
    find_tokenizer,
    load_policy,
    run_config,
)

__all__ = ["dry_run", "evaluate", "main"]


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
        resolve_benchmarks(benchmarks, cfg, max_new_tokens, samples)
    policy = load_policy(cfg, checkpoint, step)
    cfg = cfg if cfg is not None else policy.run_config
    benches = resolve_benchmarks(benchmarks, cfg, max_new_tokens, samples)
    out_dir = Path(out) if out else _default_out(cfg, policy)
    out_dir.mkdir(parents=True, exist_ok=True)

    from cppo_jax.rewards.pool import RewardPool
    from cppo_jax.rollout.backend import make_backend
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    tok = policy.tokenizer
    sp = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_id=tok.stop_ids,
        pad_id=tok.pad_id,
        cache_dtype=cfg.model.dtype,
        compact=cfg.rollout.compact,
    )
    what = f"{policy.path}" + (f" (step {policy.step})" if policy.step is not None else "")
    log(f"evaluating {what} with the {cfg.rollout.backend} backend; writing {out_dir}")
    backend = make_backend(cfg.rollout, policy.graphdef, sp, out_dir)
    pools: dict[str, RewardPool] = {}
    rows = []
    try:
        for bench in benches:
            if bench.task not in pools:
                pools[bench.task] = RewardPool(
                    reward_funcs(bench.task),
                    num_workers=cfg.reward.num_workers,
                    timeout_s=cfg.reward.timeout_s,
                )
            scored = run_benchmark(
                bench,
                cfg,
                policy,
                backend,
                pools[bench.task],
                limit=limit,
                batch_size=batch_size,
                seed=seed,
                log=log,
            )
            eval_report.write_rows(scored, tok, cfg.eval.rule, out_dir)
            row = eval_report.summary_row(scored, cfg.eval.rule)
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

    result = {
        "checkpoint": str(policy.path),
        "kind": policy.kind,
        "step": policy.step,
        "backend": cfg.rollout.backend,
        "results": rows,
        "out": str(out_dir),
    }
    table = eval_report.write_summary(out_dir, what, result)
    log("\n" + table)
    return result


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
    from cppo_jax.models.hf_io import check_weights
    from cppo_jax.train.checkpoint import Checkpointer

    path = Path(checkpoint).resolve()
    if checkpoint_kind(path) == "hf":
        if cfg is None:
            raise EvaluationError(f"{path} is a Hugging Face folder: give --config")
        check_weights(path, "--checkpoint")
        tok = find_tokenizer(cfg, path, str(path))
        what = f"model folder {path}"
    else:
        rcfg = run_config(path)
        base = rcfg.model.start_folder
        check_weights(Path(base), "model.path of the run")
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
        tok = find_tokenizer(rcfg, base, str(path))
        what = f"run {path}, checkpoint step {step if step is not None else max(steps)}"
    log(f"dry run: would evaluate {what} (tokenizer {tok.path}, backend {cfg.rollout.backend})")
    for bench in resolve_benchmarks(benchmarks, cfg, None, None):
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
            names,
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
