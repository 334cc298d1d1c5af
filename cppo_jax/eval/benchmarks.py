"""The paper's benchmarks (spec section 5): their data and decoding, and the scoring of every question.

`BENCHMARKS` names each benchmark's data, prompt/reward task, number of samples, temperature, top-p and
token budget; `DEFAULT_BENCHMARKS` those of each `data.task`. `run_benchmark` encodes a benchmark's
prompts exactly as training does, generates every (question, sample) in batches with the configured
rollout backend (the last batch padded by repeating questions, the extra outputs dropped) and scores each
completion with the task's rewards and under both accuracy rules (`rewards.registry.TASK_EVAL`) in a
time-bounded `RewardPool`. Writing the results is `cppo_jax.eval.report`'s.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from cppo_jax.config.choices import EVAL_RULES
from cppo_jax.config.schema import Config
from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.eval.policy import EvaluationError, Policy
from cppo_jax.rewards.registry import TASK_EVAL, TASK_REWARDS

__all__ = [
    "BENCHMARKS",
    "DEFAULT_BENCHMARKS",
    "Benchmark",
    "Scored",
    "load_benchmark",
    "resolve_benchmarks",
    "reward_funcs",
    "run_benchmark",
]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    source: str  # data set name (cppo_jax.data.datasets) or "arith"
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


def load_benchmark(bench: Benchmark, cfg: Config) -> list[dict]:
    """The benchmark's examples (`{"question", "solution", "answer"}`), in file order."""
    if bench.source == "arith":
        from cppo_jax.tasks import arith

        return arith.generate(cfg.data.num_test, seed=cfg.data.seed, split="test")
    from cppo_jax.data import datasets

    return datasets.load_examples(bench.source, "test", strict=cfg.data.bad_rows == "error")


def resolve_benchmarks(
    names: list[str] | None, cfg: Config, max_new_tokens: int | None, samples: int | None
) -> list[Benchmark]:
    """The benchmarks `names` (default: those of `data.task`) with the token and sample overrides:
    `samples` (the command's --samples, sampled benchmarks only), then `eval.samples`, `eval.temperature`
    and `eval.top_p` (every benchmark), else the benchmark's own protocol."""
    names = list(names or DEFAULT_BENCHMARKS[cfg.data.task])
    ev = cfg.eval
    out = []
    for name in names:
        if name not in BENCHMARKS:
            raise EvaluationError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
        b = BENCHMARKS[name]
        b = dataclasses.replace(
            b,
            max_new_tokens=max_new_tokens or b.max_new_tokens or cfg.rollout.max_new_tokens,
            samples=samples if samples and b.samples > 1 else (ev.samples or b.samples),
            temperature=b.temperature if ev.temperature is None else ev.temperature,
            top_p=b.top_p if ev.top_p is None else ev.top_p,
        )
        if b.samples > 1 and b.temperature == 0:
            raise EvaluationError(
                f"benchmark {name!r}: {b.samples} samples per question at temperature 0 would all be "
                "the same; set eval.temperature > 0 (or eval.samples=1)"
            )
        out.append(b)
    if len(set(names)) != len(names):
        raise EvaluationError(f"benchmark listed twice in {names}")
    return out


def reward_funcs(task: str) -> list[tuple[str, float, str]]:
    """The `RewardPool` entries of a task: its rewards by name, then each rule as `eval/<rule>`."""
    funcs = [(name, 1.0, name) for name in TASK_REWARDS[task]]
    return funcs + [(f"eval/{rule}", 0.0, fn) for rule, fn in TASK_EVAL[task].items()]


@dataclasses.dataclass
class Scored:
    """One benchmark's completions and scores, row i = question i // samples, sample i % samples."""

    bench: Benchmark
    examples: list[dict]
    prompts: pipeline.PromptSet
    texts: list[str]
    rewards: dict[str, np.ndarray]  # unweighted, per reward function
    correct: dict[str, np.ndarray]  # bool, per rule (EVAL_RULES)
    lengths_N: np.ndarray
    finished_N: np.ndarray
    stats: dict  # the RewardPool's (timeouts, errors, ...)
    time_s: float


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
            # Seeds from the questions' indices: samples do not depend on the batching.
            seeds_Q = jnp.asarray(pipeline.sample_seeds(seed, idx), jnp.uint32)
            out = backend.generate(policy.params, ids_QP, valid_QP, seeds_Q, S)
        keep = min(per_call, n - lo) * S  # ... and drop the padding's outputs
        tokens.append(np.asarray(out.tokens_NC)[:keep])
        valid.append(np.asarray(out.valid_NC)[:keep])
        finished.append(np.asarray(out.finished_N)[:keep])
    return np.concatenate(tokens), np.concatenate(valid), np.concatenate(finished)


def run_benchmark(
    bench: Benchmark,
    cfg: Config,
    policy: Policy,
    backend,
    pool,
    *,
    limit: int | None,
    batch_size: int,
    seed: int,
    log,
) -> Scored:
    """Generate and score every (question, sample) of `bench` (the first `limit` questions)."""
    from cppo_jax.rollout.embedded.sampling import SamplingParams

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
        enable_thinking=cfg.data.enable_thinking,
    )
    # Backends read their sampling parameters at call time; each benchmark sets its own.
    backend.sp = SamplingParams(
        max_new_tokens=bench.max_new_tokens,
        temperature=bench.temperature,
        top_p=bench.top_p,
        eos_id=tok.stop_ids,
        pad_id=tok.pad_id,
        cache_dtype=cfg.model.dtype,
        compact=cfg.rollout.compact,
    )
    S = bench.samples
    how = "greedy" if bench.greedy else f"{S} samples at T {bench.temperature}, top-p {bench.top_p}"
    cut = (
        f" ({prompts.truncated} prompts cut to {cfg.data.max_prompt_len})"
        if prompts.truncated
        else ""
    )
    log(f"{bench.name}: {len(examples)} questions, {how}, {bench.max_new_tokens} new tokens{cut}")
    tokens_NC, valid_NC, finished_N = _generate(backend, policy, prompts, bench, batch_size, seed)
    texts = pipeline.decode_completions(tok, tokens_NC, valid_NC)
    solutions = [ex["solution"] for ex in examples for _ in range(S)]
    _, per_fn, stats = pool.score(texts, solutions)
    correct = {rule: np.asarray(per_fn.pop(f"eval/{rule}")) > 0 for rule in EVAL_RULES}
    return Scored(
        bench,
        examples,
        prompts,
        texts,
        per_fn,
        correct,
        valid_NC.sum(axis=1),
        finished_N,
        stats,
        time.perf_counter() - t0,
    )
