"""The embedded sampler with LoRA: adapters merged into the weights once per rollout, or applied in
the layers at every token, side by side in one process.

For each model size, one rollout of N sequences and C new tokens is timed both ways (compiled first,
then `--repeats` times each, interleaved): `merged` = `lora_state.merge_weights` (jitted) + the
sampler of the model without adapters (what the trainer runs); `in layers` = the sampler of the
adapted model on adapters + base. Both sample the same tokens up to rounding. The ratio is what
counts on a shared machine.

    python benchmarks/lora_sampler.py            # benchmarks/results/lora_sampler.md
    python benchmarks/lora_sampler.py --quick --out /tmp/t
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
# (hidden, MLP, layers, heads, kv heads, head dim)
SIZES = ((128, 384, 4, 4, 2, 32), (512, 1536, 8, 8, 2, 64))


def measure(size, N: int, C: int, P: int, rank: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from cppo_jax.config.model import LoraConfig
    from cppo_jax.models import TransformerConfig, init_model, lora_state
    from cppo_jax.rollout.embedded.sampler import make_sampler
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    D, F, L, H, J, E = size
    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=512,
        hidden_size=D,
        intermediate_size=F,
        num_layers=L,
        num_heads=H,
        num_kv_heads=J,
        head_dim=E,
        tie_word_embeddings=True,
        max_position_embeddings=P + C,
    )
    model = lora_state.with_adapters(init_model(cfg, 0), LoraConfig(rank=rank))
    graphdef, adapters, base = lora_state.split(model)
    plain = lora_state.base_graphdef(model.cfg)
    sp = SamplingParams(max_new_tokens=C, temperature=1.0, eos_id=(1,), pad_id=0)
    Q = N // 4
    rng = np.random.default_rng(0)
    prompt_QP = jnp.asarray(rng.integers(2, 512, (Q, P)), jnp.int32)
    valid_QP = jnp.ones((Q, P), bool)
    seeds_Q = jnp.arange(Q, dtype=jnp.uint32)
    merge = jax.jit(lora_state.merge_weights, static_argnums=2)
    merged_sampler = make_sampler(plain, 4, sp)
    layers_sampler = make_sampler(graphdef, 4, sp)
    whole = nnx.merge_state(adapters, base)

    def merged():
        w = merge(adapters, base, model.cfg)
        return merged_sampler(w, prompt_QP, valid_QP, seeds_Q)

    def in_layers():
        return layers_sampler(whole, prompt_QP, valid_QP, seeds_Q)

    runs = {"merged": merged, "in layers": in_layers}
    for fn in runs.values():  # compile
        jax.block_until_ready(fn())
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    params = sum(x.size for x in jax.tree.leaves(base))
    return {
        "size": f"D {D}, F {F}, L {L}",
        "params_m": params / 1e6,
        "rank": rank,
        "N": N,
        "C": C,
        **{f"{k}_s": statistics.median(v) for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="lora_sampler_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    info = _common.machine()
    info["load_before"] = _common.load_average()
    start = time.perf_counter()
    sizes = SIZES[:1] if args.quick else SIZES
    N, C, P = (8, 4, 4) if args.quick else (64, 40, 32)
    rows = [measure(s, N, C, P, 8, 1 if args.quick else args.repeats) for s in sizes]
    info["load_after"] = _common.load_average()
    lines = [
        "# The embedded sampler with LoRA: merged weights per rollout vs adapters in the layers",
        "",
        f"Measured {datetime.date.today().isoformat()} by `python benchmarks/lora_sampler.py"
        f"{' --quick' if args.quick else ''}` in {(time.perf_counter() - start) / 60:.1f} min.",
        "",
        _common.machine_line(info),
        f"- One rollout of N = {N} sequences ({N // 4} prompts of {P} tokens x 4), C = {C} new "
        "tokens, float32, rank 8 on every projection; median of the repeats, compiled first. "
        "`merged`: the jitted merge (W + s A B for every adapted weight) and the sampler of the "
        "model without adapters; `in layers`: the sampler of the adapted model.",
        "",
        "| model | base params | merged s | in layers s | in layers / merged |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['params_m']:.2f} M | {r['merged_s']:.3f} | "
            f"{r['in layers_s']:.3f} | {r['in layers_s'] / r['merged_s']:.2f}x |"
        )
    (out / "lora_sampler.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2 - len(rows) :]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
