"""What an evaluation writes: one row per completion, a summary row per benchmark and the summary files.

`<benchmark>.jsonl` holds one row per completion (question id, sample, prompt, completion, gold answer,
reward per function, correct under the headline rule and under each rule, length, truncated);
`summary.md` / `summary.json` hold one row per benchmark (n, samples, accuracy under each rule (with
several samples per question: mean@n, and the unbiased pass@k for k = 1, 2, 4, ... up to n), mean
length, truncated fraction, time). Host code: imports no JAX.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from cppo_jax.eval.benchmarks import Scored

__all__ = ["pass_at_k", "summary_row", "summary_table", "write_rows", "write_summary"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al., 2021):
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _pass_at(correct_N: np.ndarray, samples: int) -> dict[str, float]:
    """pass@k for k = 1, 2, 4, ... up to `samples`, averaged over questions (rows question-major)."""
    counts = correct_N.reshape(-1, samples).sum(axis=1)
    ks = sorted({2**i for i in range(samples.bit_length()) if 2**i <= samples} | {samples})
    return {
        f"pass@{k}": float(np.mean([pass_at_k(samples, int(c), k) for c in counts])) for k in ks
    }


def write_rows(scored: Scored, tokenizer, rule: str, out_dir: Path) -> Path:
    """`<out_dir>/<benchmark>.jsonl`, one row per (question, sample); `rule` is the headline rule."""
    bench, prompts, S = scored.bench, scored.prompts, scored.bench.samples
    path = out_dir / f"{bench.name}.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for q, ex in enumerate(scored.examples):
            prompt = tokenizer.decode([int(t) for t in prompts.ids_nP[q][prompts.valid_nP[q]]])
            for j in range(S):
                i = q * S + j
                row = {
                    "benchmark": bench.name,
                    "id": q,
                    "sample": j,
                    "prompt": prompt,
                    "completion": scored.texts[i],
                    "gold": ex["answer"],
                    "rewards": {name: float(v[i]) for name, v in scored.rewards.items()},
                    "correct": bool(scored.correct[rule][i]),
                    **{f"correct_{r}": bool(c[i]) for r, c in scored.correct.items()},
                    "length": int(scored.lengths_N[i]),
                    "truncated": bool(not scored.finished_N[i]),
                }
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def summary_row(scored: Scored, rule: str) -> dict:
    """The benchmark's line of the summary; `accuracy` is under `rule`, `accuracy_<r>` under each."""
    bench = scored.bench
    return {
        "benchmark": bench.name,
        "n": len(scored.examples),
        "samples": bench.samples,
        "accuracy": float(scored.correct[rule].mean()),
        "rule": rule,
        **{f"accuracy_{r}": float(c.mean()) for r, c in scored.correct.items()},
        **(_pass_at(scored.correct[rule], bench.samples) if bench.samples > 1 else {}),
        "mean_length": float(scored.lengths_N.mean()),
        "truncated": float(np.mean(~scored.finished_N)),
        "time_s": scored.time_s,
        "max_new_tokens": bench.max_new_tokens,
        "temperature": bench.temperature,
        "top_p": bench.top_p,
        "prompts_cut": scored.prompts.truncated,
        "reward_timeouts": int(scored.stats["timeouts"]),
        "reward_errors": int(scored.stats["errors"]),
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
    sampled = [r for r in rows if any(k.startswith("pass@") for k in r)]
    if sampled:  # mean@n is the accuracy above; pass@k under the headline rule
        lines += [
            "",
            "| benchmark | samples | mean@n | pass@k (unbiased) |",
            "| --- | --- | --- | --- |",
        ]
        for r in sampled:
            ks = ", ".join(f"{k} {v:.2%}" for k, v in r.items() if k.startswith("pass@"))
            lines.append(f"| {r['benchmark']} | {r['samples']} | {r['accuracy']:.2%} | {ks} |")
    return "\n".join(lines)


def write_summary(out_dir: Path, what: str, result: dict) -> str:
    """`summary.md` (headed by `what`, the checkpoint) and `summary.json` (`result`); returns the table."""
    table = summary_table(result["results"])
    (out_dir / "summary.md").write_text(f"checkpoint: {what}\n\n" + table + "\n")
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return table
