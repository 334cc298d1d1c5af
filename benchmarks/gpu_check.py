"""One prepared check for a lent GPU: the update phase, the sampler and memory of a 1.5B-shaped model.

    python benchmarks/gpu_check.py              # on the GPU machine (one H200: under 8 minutes)
    python benchmarks/gpu_check.py --quick      # tiny shapes, any machine (the suite runs this on CPU)

A randomly initialised model with Qwen2.5-1.5B's shape (`models.known.KNOWN_MODELS`), bf16 compute over f32
params (the paper configs' setting), G = 16 completions of 512 tokens per question. It measures, with
the project's own jitted functions (`step.compiled`, `sampler.make_sampler`):

- the update phase at p = 0 (all Q * G completions) and p = 0.875 (k = 2 kept per question): reference
  log-probs plus one policy update, in trained tokens/s and model FLOP utilisation;
- the embedded sampler's tokens/s (Q prompts x G samples, completions run to the length limit);
- compile seconds of each program;
- the log-prob forward of padded rows with `model.attention=cudnn` (`jax.nn.dot_product_attention`'s
  fused kernel) and `xla` against the default einsum attention, and the sampler's log-probs against
  the training forward's (`_gpu_numerics`: a NaN or a difference over the bf16 tolerance fails the
  check, exit status 1);
- peak device memory against `cppo_jax.planning.memory.memory_plan`'s figure for the same shapes, and each
  program's compiled memory (`memory_analysis()`, the table `plan --compile-for` prints for TPUs:
  XLA:GPU cannot compile without a GPU) beside the measured peak.

First it checks the install path of docs/running.md (`make setup-gpu`): the memory share the launch sets
(`layout.set_gpu_memory_fraction`, before JAX starts), that JAX sees a GPU (off `--quick`, a CPU fails the
check, naming `make setup-gpu`), the memory the plan counts per device (`layout.device_memory`), and, when
the server's environment is here (`VLLM_PYTHON`, else `.venv-vllm-gpu`), that its vLLM loads the
project's weight-transfer plugin (`launch/check_vllm.py`; absent: recorded, not a failure).

It needs only jax, flax, optax and numpy from the project's dependencies (NOT grain, vllm, math-verify
or tensorboardX, which the GPU image lacks): the modules it imports are the model, step, sampler,
sharding, loss and plan modules. Results go to `--out` (default benchmarks/results) as gpu_check.json
and gpu_check.md, written after every measurement, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from benchmarks import _gpu_numerics as numerics  # noqa: E402
from cppo_jax.algo.cppo import num_kept  # noqa: E402
from cppo_jax.config.schema import CPPOConfig, OptimConfig  # noqa: E402
from cppo_jax.models.known import KNOWN_MODELS  # noqa: E402
from cppo_jax.models.transformer import TransformerConfig, init_model  # noqa: E402
from cppo_jax.planning import memory as layout  # noqa: E402
from cppo_jax.planning.aot import ProgramMemory  # noqa: E402
from cppo_jax.rollout.embedded.sampler import make_sampler  # noqa: E402
from cppo_jax.rollout.embedded.sampling import SamplingParams  # noqa: E402
from cppo_jax.train import device_fns as step_lib  # noqa: E402
from cppo_jax.train import optimizer as optimizer_lib  # noqa: E402

# Dense bf16 peak FLOP/s by device kind (vendor datasheets, without sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
}


@dataclasses.dataclass(frozen=True)
class Shapes:
    Q: int  # questions per step
    G: int  # completions per question
    P: int  # prompt slots
    C: int  # completion slots
    micro_batch: int  # sequences per forward/backward in the update (0: all)


FULL = Shapes(Q=4, G=16, P=256, C=512, micro_batch=16)
QUICK = Shapes(Q=2, G=16, P=8, C=16, micro_batch=8)


def model_config(quick: bool) -> TransformerConfig:
    if quick:
        return TransformerConfig(
            arch="qwen2",
            vocab_size=384,
            hidden_size=64,
            intermediate_size=160,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            dtype="bfloat16",
            param_dtype="float32",
            remat=True,
        )
    hf = dict(KNOWN_MODELS["Qwen2.5-1.5B-Instruct"])
    tcfg = TransformerConfig.from_hf_dict(hf)
    return dataclasses.replace(tcfg, dtype="bfloat16", param_dtype="float32", remat=True)


def param_count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def train_flops_per_token(tcfg: TransformerConfig, n_params: int, T: int) -> float:
    """Model FLOPs of forward + backward per trained token: 6 N plus causal attention (PaLM's count)."""
    attn = 6 * tcfg.num_layers * tcfg.num_heads * tcfg.head_dim * T  # 12 L H E T, halved for causal
    return 6 * n_params + attn


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_BF16_FLOPS.items():
        if name.lower() in kind.lower():
            return flops
    return None


def peak_memory(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def _batch(rng: np.random.Generator, sh: Shapes, rows: int, vocab: int, with_ref: bool):
    T = sh.P + sh.C
    tokens = rng.integers(1, vocab, size=(rows, T), dtype=np.int32)
    valid = np.ones((rows, T), bool)
    mask = np.ones((rows, sh.C), np.float32)
    adv = rng.standard_normal(rows).astype(np.float32)
    return step_lib.Batch(
        jnp.asarray(tokens),
        jnp.asarray(valid),
        jnp.asarray(mask),
        jnp.asarray(adv),
        None,
        jnp.zeros((rows, sh.C), jnp.float32) if with_ref else None,
    )


def _timed(fn, *args, repeat: int):
    """(seconds per call after one warm call, last result)."""
    out = jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeat):
        out = jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeat, out


class Report:
    def __init__(self, out: Path, meta: dict):
        self.out = out
        self.data = {
            "meta": meta,
            "update": [],
            "attention": [],
            "sampler": None,
            "precision": None,
            "memory": None,
            "programs": [],
        }

    def program(self, name: str, compiled, seconds: float) -> None:
        """The compiler's memory of one program (as `plan --compile-for` prints it) and the
        device's peak so far (measured after the program ran)."""
        m = ProgramMemory.of(name, compiled, seconds)
        row = {**dataclasses.asdict(m), "total": m.total, "measured_peak": None}
        self.data["programs"].append(row)

    def measured(self, device) -> None:
        """The device's peak so far, set on the programs compiled since the last call."""
        for row in self.data["programs"]:
            if row["measured_peak"] is None:
                row["measured_peak"] = peak_memory(device)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.data))


def _ok(row: dict) -> str:
    return "ok" if row.get("ok") else "FAILED"


def failures(data: dict) -> list[str]:
    """What makes the check fail: a non-finite loss, an attention row or the precision row not ok."""
    out = [f"install: {p}" for p in (data.get("install") or {}).get("problems", [])]
    out += [f"update p={r['p']}: non-finite loss" for r in data["update"] if not r["loss_finite"]]
    out += [f"attention {r['attention']}: {r}" for r in data["attention"] if not r["ok"]]
    if data.get("precision") and not data["precision"]["ok"]:
        out.append(f"precision: {data['precision']}")
    return out


def markdown(data: dict) -> str:
    m = data["meta"]
    lines = [
        "# GPU check (benchmarks/gpu_check.py)",
        "",
        f"Device: {m['device_kind']} ({m['platform']}), jax {m['jax']}; model: {m['model']} "
        f"({m['params'] / 1e6:.1f}M params), compute {m['dtype']}, params {m['param_dtype']}, "
        f"remat on; Q = {m['Q']}, G = {m['G']}, prompt {m['P']} + completion {m['C']} tokens, "
        f"micro-batch {m['micro_batch']}.",
        "",
    ]
    inst = data.get("install")
    if inst:
        gib = lambda n: "unknown" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
        lines += [
            f"Install: JAX sees {inst['devices']} {inst['platform']} device(s); "
            f"{layout.MEM_FRACTION_VAR}={inst['mem_fraction']} (JAX's pool {gib(inst['bytes_limit'])}, "
            f"the plan counts {gib(inst['planned_device_bytes'])} per device at "
            f"{layout.USABLE_FRACTION:.0%} usable); vLLM: {inst['vllm']}"
            + "".join(f"; PROBLEM: {p}" for p in inst["problems"]),
            "",
        ]
    lines += [
        "| phase | p | sequences | trained tokens/s | MFU | step s | compile s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["update"]:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| update (ref log-probs + 1 update) | {r['p']} | {r['rows']} | "
            f"{r['tokens_per_s']:,.0f} | {mfu} | {r['seconds']:.3f} | {r['compile_s']:.1f} |"
        )
    if data["attention"]:
        lines += [
            "",
            "Log-prob forward of padded rows (prompts left-padded, completions right-padded), "
            "each attention against einsum at the completion tokens:",
            "",
            "| attention | seconds | compile s | max abs log-prob difference | worst token, in "
            "tolerances | non-finite | ok |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in data["attention"]:
            if "error" in r:
                lines.append(f"| {r['attention']} | failed: {r['error']} | | | | | {_ok(r)} |")
            else:
                diff, tol = r["max_abs_logp_diff"], r["worst"]
                lines.append(
                    f"| {r['attention']} | {r['seconds']:.3f} | {r['compile_s']:.1f} | "
                    f"{'-' if diff is None else f'{diff:.3g}'} | "
                    f"{'-' if tol is None else f'{tol:.3g}'} | {r['nonfinite']} | {_ok(r)} |"
                )
    s = data["sampler"]
    if s:
        lines += [
            "",
            f"Embedded sampler: {s['sequences']} sequences x {s['new_tokens']} new tokens: "
            f"{s['tokens_per_s']:,.0f} tokens/s ({s['seconds']:.2f} s a call; compile {s['compile_s']:.1f} s).",
        ]
    pr = data.get("precision")
    if pr:
        lines += [
            "",
            f"Sampler vs training log-probs of the same {pr['tokens']} sampled tokens (one "
            f"precision from sampler to loss): max difference {pr['max_abs_logp_diff']:.3g} "
            f"(worst token {pr['worst']:.3g} of its tolerance; mean {pr['mean_logp_diff']:.2g}), "
            f"max |TIS weight - 1| "
            f"{pr['max_abs_tis_weight_minus_1']:.3g}, non-finite {pr['nonfinite']}: {_ok(pr)}.",
        ]
    if data.get("programs"):
        lines += [
            "",
            "Compiled memory per program (`memory_analysis()`, as `plan --compile-for` prints it) "
            "and the device's peak measured after it ran (the peak of the run so far), GiB:",
            "",
            "| program | arguments | outputs | donated | temporaries | total | measured peak so far |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in data["programs"]:
            peak = "n/a" if r["measured_peak"] is None else f"{r['measured_peak'] / 2**30:.2f}"
            lines.append(
                f"| {r['name']} | {r['arguments'] / 2**30:.2f} | {r['outputs'] / 2**30:.2f} | "
                f"{r['aliased'] / 2**30:.2f} | {r['temporaries'] / 2**30:.2f} | "
                f"{r['total'] / 2**30:.2f} | {peak} |"
            )
    mem = data["memory"]
    if mem:
        measured = (
            "n/a" if mem["measured_peak"] is None else f"{mem['measured_peak'] / 2**30:.2f} GiB"
        )
        lines += [
            "",
            f"Peak device memory: measured {measured}; plan (train step, p = 0) "
            f"{mem['plan_train_peak'] / 2**30:.2f} GiB.",
        ]
    if data["update"] and len(data["update"]) == 2:
        a, b = data["update"]
        lines += [
            "",
            f"Update-phase speedup p = {b['p']} vs p = 0: {a['seconds'] / b['seconds']:.2f}x.",
        ]
    return "\n".join(lines) + "\n"


def install_row(quick: bool, fraction_note: str) -> dict:
    """The install path's checks (see the module docstring)."""
    import os
    import subprocess

    device = jax.devices()[0]
    row = {
        "platform": device.platform,
        "devices": jax.device_count(),
        "mem_fraction": os.environ.get(layout.MEM_FRACTION_VAR),
        "fraction_note": fraction_note,
        "bytes_limit": (device.memory_stats() or {}).get("bytes_limit"),
        "planned_device_bytes": layout.device_memory(device),
        "vllm": None,
        "problems": [],
    }
    if device.platform != "gpu" and not quick:
        row["problems"].append(
            f"JAX sees {jax.device_count()} {device.platform} device(s), no GPU: build the trainer's "
            f"environment with make setup-gpu (CUDA JAX; JAX_CUDA=cuda for CUDA 12) or install "
            f'pip install -e ".[cuda13]" into this one'
        )
    vllm_py = Path(os.environ.get("VLLM_PYTHON") or ROOT / ".venv-vllm-gpu" / "bin" / "python")
    if vllm_py.exists():
        plugin = ROOT / "cppo_jax" / "rollout" / "vllm_plugin"
        proc = subprocess.run(
            [str(vllm_py), str(ROOT / "launch" / "check_vllm.py"), str(plugin)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        row["vllm"] = (proc.stdout.strip() or proc.stderr.strip())[-2000:]
        if proc.returncode:
            row["problems"].append(f"the server's vLLM ({vllm_py}): {proc.stderr.strip()[-1000:]}")
    else:
        row["vllm"] = f"no server environment at {vllm_py} (make setup-gpu builds it): not checked"
    row["ok"] = not row["problems"]
    return row


def run(quick: bool, out: Path, repeat: int, fraction_note: str = "") -> dict:
    sh = QUICK if quick else FULL
    tcfg = model_config(quick)
    device = jax.devices()[0]
    model = init_model(tcfg, seed=0)
    from flax import nnx

    graphdef, params = nnx.split(model)
    del model
    n_params = param_count(params)
    report = Report(
        out,
        {
            "device_kind": getattr(device, "device_kind", "?"),
            "platform": device.platform,
            "jax": jax.__version__,
            "python": platform.python_version(),
            "model": "tiny (quick)" if quick else "Qwen2.5-1.5B-shaped, random",
            "params": n_params,
            "dtype": tcfg.dtype,
            "param_dtype": tcfg.param_dtype,
            **dataclasses.asdict(sh),
        },
    )
    report.data["install"] = install_row(quick, fraction_note)
    report.save()
    rng = np.random.default_rng(0)
    optim = OptimConfig(lr=1e-6)
    peak = peak_flops(device)
    T = sh.P + sh.C - 1  # positions in the forward
    per_token = train_flops_per_token(tcfg, n_params, T)
    for p in (0.0, 0.875):
        algo = CPPOConfig(num_generations=sh.G, pruning_rate=p, mu=1, beta=0.04)
        k = num_kept(sh.G, p)
        rows = sh.Q * k
        mb = sh.micro_batch if rows > sh.micro_batch else 0
        spec = step_lib.StepSpec.make(algo, sh.P, sh.C, 1.0, micro_batch=mb)
        tx = optimizer_lib.make_optimizer(optim, 1000)
        train_step, logps = step_lib.compiled(graphdef, tx, spec)
        p_copy = jax.tree.map(jnp.copy, params)
        opt_state = tx.init(p_copy)
        batch = _batch(rng, sh, rows, tcfg.vocab_size, with_ref=True)
        start = time.perf_counter()
        step_c = train_step.lower(p_copy, opt_state, batch).compile()
        logps_c = logps.lower(params, batch.tokens_MT, batch.valid_MT).compile()
        compile_s = time.perf_counter() - start
        report.program(f"train_step p={p}", step_c, compile_s)
        report.program(f"logps p={p}", logps_c, compile_s)
        ref_s, _ = _timed(logps_c, params, batch.tokens_MT, batch.valid_MT, repeat=repeat)
        # The update donates params and state: carry them through the repeats.
        state = [p_copy, opt_state]

        def update(state=state, batch=batch, step_c=step_c):
            state[0], state[1], metrics = step_c(state[0], state[1], batch)
            return metrics

        upd_s, metrics = _timed(update, repeat=repeat)
        report.measured(device)
        seconds = ref_s + upd_s
        tokens = rows * T
        flops = tokens * (per_token + 2 * n_params)  # + the reference forward
        report.data["update"].append(
            {
                "p": p,
                "k": k,
                "rows": rows,
                "seconds": seconds,
                "ref_seconds": ref_s,
                "update_seconds": upd_s,
                "tokens_per_s": tokens / seconds,
                "mfu": None if peak is None else flops / seconds / peak,
                "compile_s": compile_s,
                "loss_finite": bool(np.isfinite(float(metrics["loss"]))),
            }
        )
        report.save()
        if p == 0.0:
            plan = layout.memory_plan(
                tcfg,
                {"data": 1, "fsdp": 1, "tensor": 1},
                rows=rows,
                prompt_len=sh.P,
                completion_len=sh.C,
                micro_batch=mb,
                beta=0.04,
            )
            report.data["memory"] = {
                "measured_peak": peak_memory(device),
                "plan_train_peak": plan.train_peak,
                "plan_resident": plan.resident,
            }
            report.save()
        del state, p_copy, opt_state, step_c, logps_c

    numerics.attention_rows(report, graphdef, params, tcfg, sh, rng, repeat, _timed)

    # eos_id = vocab_size is never sampled: every completion runs to the length limit.
    sp = SamplingParams(
        max_new_tokens=sh.C, eos_id=tcfg.vocab_size, pad_id=0, cache_dtype=tcfg.dtype
    )
    sampler = make_sampler(graphdef, sh.G, sp)
    prompts = jnp.asarray(rng.integers(1, tcfg.vocab_size, size=(sh.Q, sh.P), dtype=np.int32))
    valid = jnp.ones((sh.Q, sh.P), bool)
    seeds = jnp.arange(sh.Q, dtype=jnp.uint32)
    start = time.perf_counter()
    sampler_c = sampler.lower(params, prompts, valid, seeds).compile()
    compile_s = time.perf_counter() - start
    report.program("sampler", sampler_c, compile_s)
    seconds, samples = _timed(sampler_c, params, prompts, valid, seeds, repeat=max(1, repeat // 2))
    report.measured(device)
    new_tokens = int(np.asarray(samples.valid_NC).sum()) if hasattr(samples, "valid_NC") else None
    n_seq = sh.Q * sh.G
    report.data["sampler"] = {
        "sequences": n_seq,
        "new_tokens": sh.C,
        "tokens_generated": new_tokens,
        "seconds": seconds,
        "tokens_per_s": n_seq * sh.C / seconds,
        "compile_s": compile_s,
    }
    report.data["precision"] = numerics.precision_row(
        graphdef, params, tcfg, sh, prompts, valid, samples
    )
    mem = report.data["memory"]
    if mem is not None:
        mem["measured_peak"] = peak_memory(device)
    report.save()
    return report.data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls after a warm one")
    args = parser.parse_args(argv)
    fraction_note = layout.set_gpu_memory_fraction()  # as cppo_jax.launch: before JAX starts
    data = run(args.quick, args.out, args.repeat, fraction_note)
    print(markdown(data))
    failed = failures(data)
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
