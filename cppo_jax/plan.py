"""The plan of a run, built without weights: data, shapes, tokenizer, model size (what a dry run prints).

`plan_report(cfg)` loads the config's data (records counted, bad rows reported, the validation split held
out), tokenizes every prompt through the real pipeline when the tokenizer folder exists (else says it did
not), derives the shapes of one step (Q, G, k, M, P, C) and the number of steps, reads the model's size
from `config.json` in its folder (or, without one, from `KNOWN_MODELS` by name) and plans the memory
per device on the config's mesh (`memory_plan`): params, AdamW moments, gradients, reference params,
activations with and without remat, the logits chunk and the rollout KV cache, ending in `fits: yes/no`.

Problems a run would hit later (a micro-batch that does not divide the kept sequences, a question batch
that does not split over the processes or the mesh's data axes, prompts longer than `data.max_prompt_len` with
`data.long_prompts=reject`) raise here, with the key that causes them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

from cppo_jax import pipeline
from cppo_jax.config import Config, ConfigError

__all__ = [
    "KNOWN_MODELS",
    "MemoryPlan",
    "ModelSize",
    "find_known_model",
    "has_tokenizer",
    "memory_lines",
    "memory_plan",
    "model_folder",
    "model_size",
    "plan_report",
    "resolve_mesh",
    "tokenizer_folder",
]

# config.json of the paper's models (the fields that fix the parameter count).
KNOWN_MODELS: dict[str, dict] = {
    "Qwen2.5-1.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
}
# Names that identify a known model: "Qwen2.5-1.5B-Instruct", "qwen2_5_1p5b", "gsm8k_1p5b", "math7b", ...
_NAME_PATTERNS = (
    ("Qwen2.5-1.5B-Instruct", re.compile(r"(?<![\d.])1[._p]5b(?![a-z\d])")),
    ("Qwen2.5-7B-Instruct", re.compile(r"(?<![\d.])7b(?![a-z\d])")),
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_BYTES = {"float32": 4, "bfloat16": 2}


def model_folder(cfg: Config) -> str:
    """The folder the policy starts from (as the Trainer picks it)."""
    return cfg.model.init_checkpoint or cfg.model.path


def tokenizer_folder(cfg: Config) -> str:
    return cfg.model.tokenizer or model_folder(cfg)


def has_tokenizer(folder: str | Path) -> bool:
    return bool(folder) and any((Path(folder) / f).is_file() for f in _TOKENIZER_FILES)


def find_known_model(*names: str) -> str | None:
    """The `KNOWN_MODELS` entry the first matching name points to (a path's last part, a run name)."""
    for name in names:
        if not name:
            continue
        text = Path(name).name.lower() or name.lower()
        for known, pattern in _NAME_PATTERNS:
            if pattern.search(text):
                return known
    return None


@dataclasses.dataclass(frozen=True)
class ModelSize:
    source: str  # where the architecture came from
    params: int
    hf_config: dict

    @property
    def layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])


def model_size(hf_config: dict, source: str = "config.json") -> ModelSize:
    """Exact parameter count of a config.json dict, from the tensors this project's loader reads."""
    from cppo_jax.models.hf_io import name_table
    from cppo_jax.models.transformer import TransformerConfig

    try:
        tcfg = TransformerConfig.from_hf_dict(hf_config)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    params = sum(math.prod(entry.nnx_shape) for entry in name_table(tcfg))
    return ModelSize(source, params, dict(hf_config))


def _model_plan(cfg: Config) -> ModelSize | None:
    folder = model_folder(cfg)
    config_file = Path(folder) / "config.json" if folder else None
    if config_file is not None and config_file.is_file():
        try:
            hf = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file}: not valid JSON ({e})") from e
        return model_size(hf, str(config_file))
    known = find_known_model(
        cfg.model.path, cfg.model.init_checkpoint, cfg.model.tokenizer, cfg.trainer.run_name
    )
    if known is None:
        return None
    return model_size(KNOWN_MODELS[known], f"known sizes of {known} (by name; no config.json)")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _data_section(cfg: Config, shapes, lines: list[str]) -> int:
    """Load, count and (when possible) tokenize the data; returns the number of training questions."""
    from cppo_jax.launch import REQUIRED_PREFIX

    d = cfg.data
    missing_train = d.train.startswith(REQUIRED_PREFIX)
    if missing_train:
        train, val, stats = [], [], {}
    else:
        train, stats = pipeline.load_examples(d, "train")
        train, val = pipeline.holdout_validation(d, train)
        if not train:
            raise ValueError(
                f"data.train={d.train!r} (split {d.split_train!r}) holds no usable rows"
            )
    test, test_stats = pipeline.load_examples(d, "test")
    if not test:
        raise ValueError(f"data.test={d.test!r} (split {d.split_test!r}) holds no usable rows")
    eval_n = min(cfg.trainer.eval_size, len(test)) if cfg.trainer.eval_size else len(test)
    lines.append("data:")
    if missing_train:
        detail = d.train[len(REQUIRED_PREFIX) :].strip(" :>")
        lines.append(f"  train: NOT SET: data.train is required: {detail}")
    else:
        lines.append(
            f"  train: {d.train!r} split {d.split_train!r}: {len(train) + len(val)} records "
            f"({stats.get('bad_rows', 0)} bad rows skipped)"
            + (f", {len(val)} held out for validation" if val else "")
        )
    for lineno, reason in stats.get("bad_row_lines", [])[:3]:
        lines.append(f"    bad row {lineno}: {reason}")
    lines.append(
        f"  test: {d.test!r} split {d.split_test!r}: {len(test)} records "
        f"({test_stats.get('bad_rows', 0)} bad rows skipped), {eval_n} evaluated"
    )

    folder = tokenizer_folder(cfg)
    if not has_tokenizer(folder):
        where = repr(folder) if folder else "no folder configured"
        lines.append(f"tokenizer: none found ({where}): prompts not tokenized")
        return len(train)
    from cppo_jax.models import Tokenizer

    tok = Tokenizer.from_dir(folder)
    chat = "yes" if getattr(tok.hf, "chat_template", None) else "NO (required)"
    lines.append(
        f"tokenizer: {folder}: {tok.vocab_size} ids, eos {tok.hf.eos_token!r} ({tok.eos_id}), "
        f"pad id {tok.pad_id}, chat template {chat}"
    )
    parts = [("train", train), ("validation", val), ("test", test[:eval_n])]
    for name, examples in parts:
        if not examples:
            continue
        try:
            enc = pipeline.encode_prompts(examples, tok, d.task, shapes.P, d.long_prompts)
        except ValueError as e:
            raise ValueError(f"{name} prompts: {e}") from e
        lengths = enc.valid_nP.sum(axis=1)
        lines.append(
            f"  {name} prompts: {len(enc)} tokenized, length mean {lengths.mean():.0f} "
            f"max {lengths.max()} of P={shapes.P}; {enc.truncated} cut from the left to fit"
        )
    return len(train)


def _check_batching(cfg: Config, shapes, processes: int) -> None:
    m = cfg.trainer.micro_batch
    if m and m < shapes.M and shapes.M % m:
        raise ConfigError(
            f"config key 'trainer.micro_batch' = {m} is invalid: allowed a divisor of the "
            f"{shapes.M} kept sequences per step (or 0)"
        )
    if shapes.Q % processes:
        raise ConfigError(
            f"the {shapes.Q} questions per step do not split over {processes} processes: "
            f"adjust cppo.questions_per_step (Q={shapes.Q} from b={cfg.cppo.questions_per_step}, "
            f"p={cfg.cppo.pruning_rate}, allocation={cfg.cppo.allocation})"
        )


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of a training step's dominant buffers on one mesh (see `memory_plan`)."""

    mesh: dict[str, int]
    params: int  # the policy, sharded by the rules
    opt_state: int  # AdamW mu and nu, in the params' dtype and layout
    grads: int  # the gradient (x2 with micro-batches: the accumulator and one micro-batch's)
    gathered: int  # fsdp > 1: one layer's and the vocabulary matrices' weights gathered for use
    reference: int  # the reference model's params (beta > 0)
    rows: int  # sequences per device in one forward/backward (a micro-batch)
    tokens: int  # T = P + C - 1 positions per sequence in the forward
    activations_remat: int
    activations_no_remat: int
    remat: bool
    logits_chunk: int
    rollout_kv: int  # the embedded sampler's KV cache, Q*G sequences split over (data, fsdp)
    device_bytes: int | None = None

    @property
    def activations(self) -> int:
        return self.activations_remat if self.remat else self.activations_no_remat

    @property
    def resident(self) -> int:
        return self.params + self.opt_state + self.reference

    @property
    def train_peak(self) -> int:
        return self.resident + self.grads + self.gathered + self.activations + self.logits_chunk

    @property
    def rollout_peak(self) -> int:
        return self.resident + self.gathered + self.rollout_kv

    @property
    def peak(self) -> int:
        return max(self.train_peak, self.rollout_peak)

    @property
    def fits(self) -> bool | None:
        """peak <= 90% of the device (the rest: XLA workspace, fragmentation); None if unknown."""
        return None if self.device_bytes is None else self.peak <= 0.9 * self.device_bytes


def _shard_bytes(shape, names, axis_sizes, itemsize: int) -> int:
    from cppo_jax.sharding import logical_spec

    spec = logical_spec(names, shape, axis_sizes)
    n = math.prod(shape)
    for axes in spec:
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            n //= axis_sizes[axis]
    return n * itemsize


@functools.lru_cache(maxsize=8)
def _param_shapes(tcfg) -> tuple[tuple[tuple, tuple[int, ...], tuple[str | None, ...]], ...]:
    """(path, shape, logical axis names) of every parameter of the model `tcfg` describes."""
    from flax import nnx

    from cppo_jax.models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(tcfg, rngs=nnx.Rngs(0)))
    out = []
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        shape = tuple(var.get_value().shape)
        names = tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape))
        out.append((tuple(path), shape, names))
    return tuple(out)


def _split(n: int, size: int) -> int:
    """n over `size` devices when it divides, else whole (the rules' fallback)."""
    return n // size if size > 1 and n % size == 0 else n


def memory_plan(
    tcfg,
    mesh: dict[str, int],
    *,
    rows: int,
    prompt_len: int,
    completion_len: int,
    micro_batch: int = 0,
    beta: float = 0.0,
    logp_chunk: int = 64,
    rollout_rows: int = 0,
    device_bytes: int | None = None,
) -> MemoryPlan:
    """Per-device bytes of one training step of `tcfg` (a TransformerConfig) on a (data, fsdp, tensor) mesh.

    Params, AdamW moments, gradients and reference params are exact: every parameter's shard under
    `cppo_jax.sharding.RULES`; with fsdp > 1 one layer's weights and the vocabulary matrices are
    counted once more, gathered whole along fsdp where they are used. Activations are an estimate for the dense attention of
    models/transformer.py, per layer and token of a forward/backward of `rows` (or `micro_batch`)
    sequences split over (data, fsdp), heads/MLP/vocab split over tensor where they divide:
      saved for the backward: compute-dtype layer input, two normed inputs and the mid-layer residual
        (4D), q/k/v before and after RoPE (2(H+2J)E), the attention output (HE), gate, up and their
        product (3F), and three float32 [H, T] score-sized buffers (scores, masked scores, probs);
      with remat only the layer input (D) is kept per layer and one layer's set is rebuilt;
      plus the backward's working set of one layer: three more float32 score-sized buffers.
    The logits chunk is 3 float32 [rows, chunk, V] buffers (logits, probs, their gradient).
    Fitted against XLA's buffer assignment of the train step on CPU (tests/test_sharding.py).
    """
    axis = {a: int(mesh.get(a, 1)) for a in ("data", "fsdp", "tensor")}
    dp, tp = axis["data"] * axis["fsdp"], axis["tensor"]
    pb = _BYTES[tcfg.param_dtype]
    cb = _BYTES[tcfg.dtype]
    shapes = _param_shapes(tcfg)
    params = sum(_shard_bytes(shape, names, axis, pb) for _, shape, names in shapes)
    # FSDP gathers a weight whole along fsdp where it is used: one layer and the vocabulary matrices.
    unsharded = {**axis, "fsdp": 1}
    gathered = 0
    if axis["fsdp"] > 1:
        gathered = sum(  # the decoder layers' params are stacked [L, ...]: one layer is 1/L
            _shard_bytes(shape, names, unsharded, pb) // (shape[0] if path[0] == "layers" else 1)
            for path, shape, names in shapes
            if path[0] in ("layers", "embed_VD", "lm_head_DV")
        )
    m = micro_batch if 0 < micro_batch < rows else rows
    n = _split(m, dp) if m % dp == 0 else m  # sequences per device (replicated if uneven)
    T = prompt_len + completion_len - 1
    D, F, L, E = tcfg.hidden_size, tcfg.intermediate_size, tcfg.num_layers, tcfg.head_dim
    H, J = _split(tcfg.num_heads, tp), _split(tcfg.num_kv_heads, tp)
    F, V = _split(F, tp), _split(tcfg.vocab_size, tp)
    scores = 4 * H * T  # one float32 [H, T] row of scores per token
    if (
        tcfg.scan_layers
    ):  # per token: matmul outputs kept (run_layers), scores twice (fitted on CPU)
        layer = cb * (2 * D + (H + 2 * J) * E + H * E + 2 * F) + 2 * scores
    else:  # per token, unrolled: XLA keeps the elementwise results too
        layer = cb * (4 * D + 2 * (H + 2 * J) * E + H * E + 3 * F) + 3 * scores
    work = 3 * scores  # per token, one layer's backward
    edges = cb * D + 4 * D  # embeddings out and the final norm, per token
    batch = (T + 1) * 5 + completion_len * 4 * 3 + 4  # tokens, valid, mask, old, ref, adv per row
    no_remat = n * T * (L * layer + work + edges) + n * batch
    remat = n * T * (L * cb * D + layer + work + edges) + n * batch
    grads = params * (2 if m < rows else 1)
    kv_rows = _split(rollout_rows, dp) if rollout_rows % dp == 0 else rollout_rows
    kv = 2 * L * J * E * (prompt_len + completion_len) * kv_rows * cb
    return MemoryPlan(
        mesh=axis,
        params=params,
        opt_state=2 * params,
        grads=grads,
        gathered=gathered,
        reference=params if beta > 0 else 0,
        rows=n,
        tokens=T,
        activations_remat=remat,
        activations_no_remat=no_remat,
        remat=tcfg.remat,
        logits_chunk=3 * n * min(logp_chunk, completion_len) * V * 4,
        rollout_kv=kv,
        device_bytes=device_bytes,
    )


def resolve_mesh(cfg: Config, num_devices: int) -> dict[str, int]:
    """The mesh sizes a run on `num_devices` devices gets from `cfg.mesh` (as sharding.make_mesh)."""
    sizes = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    given = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items())
    if -1 in sizes.values():
        if num_devices % fixed:
            raise ConfigError(f"{given}: the fixed axes do not divide the {num_devices} devices")
        return {k: (num_devices // fixed if v == -1 else v) for k, v in sizes.items()}
    if fixed != num_devices:
        raise ConfigError(
            f"{given} = {fixed} devices, but the plan is for {num_devices}; make the product "
            f"{num_devices} (one axis may be -1: the rest)"
        )
    return sizes


def _memory_section(
    cfg: Config,
    shapes,
    size: ModelSize | None,
    lines: list[str],
    num_devices: int | None,
    device_memory_gb: float | None,
) -> None:
    import jax

    devices = jax.devices()
    planned = num_devices or len(devices)
    where = (
        f"{planned} planned device(s)"
        if num_devices
        else f"{planned} {devices[0].platform} device(s), {jax.process_count()} process(es)"
    )
    mesh = resolve_mesh(cfg, planned)
    m = cfg.mesh
    lines.append(
        f"mesh: data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']} "
        f"(config {m.data}/{m.fsdp}/{m.tensor}) over {where}"
    )
    dp = mesh["data"] * mesh["fsdp"]
    if shapes.Q % dp:
        raise ConfigError(
            f"the {shapes.Q} questions per step do not split over mesh.data={mesh['data']} x "
            f"mesh.fsdp={mesh['fsdp']} = {dp} data-parallel devices: adjust "
            f"cppo.questions_per_step (Q={shapes.Q}) or mesh.data / mesh.fsdp"
        )
    if size is None:
        lines.append(
            "model: size unknown (no config.json in the model folder and no known model name); "
            "memory not estimated"
        )
        return
    hf = size.hf_config
    n = size.params
    tied = "tied" if hf.get("tie_word_embeddings") else "untied"
    lines.append(
        f"model: {n:,} parameters ({n / 1e9:.2f} B; {hf.get('model_type')}, {size.layers} layers, "
        f"{tied} embeddings) from {size.source}"
    )
    from cppo_jax.models.transformer import TransformerConfig

    tcfg = TransformerConfig.from_hf_dict(
        hf,
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        remat=cfg.model.remat,
        scan_layers=cfg.model.scan_layers,
    )
    if device_memory_gb is not None:
        device_bytes = int(device_memory_gb * 1e9)
    else:
        stats = devices[0].memory_stats() or {}
        device_bytes = stats.get("bytes_limit")
    plan = memory_plan(
        tcfg,
        mesh,
        rows=shapes.M,
        prompt_len=shapes.P,
        completion_len=shapes.C,
        micro_batch=cfg.trainer.micro_batch,
        beta=cfg.cppo.beta,
        rollout_rows=shapes.Q * shapes.G if cfg.rollout.backend == "embedded" else 0,
        device_bytes=device_bytes,
    )
    lines.extend(memory_lines(plan, cfg.model.param_dtype))
    max_pos = hf.get("max_position_embeddings")
    if max_pos and max_pos < shapes.P + shapes.C:
        lines.append(
            f"  WARNING: P + C = {shapes.P + shapes.C} tokens exceed the model's "
            f"max_position_embeddings={max_pos}"
        )


def memory_lines(plan: MemoryPlan, param_dtype: str) -> list[str]:
    """The report's lines for a `MemoryPlan`, ending with `fits: yes|no|unknown`."""
    mesh = plan.mesh
    use, other = ("with", "without") if plan.remat else ("without", "with")
    act_other = plan.activations_no_remat if plan.remat else plan.activations_remat
    lines = [
        f"memory per device (mesh data={mesh['data']} fsdp={mesh['fsdp']} "
        f"tensor={mesh['tensor']}; sharded by cppo_jax.sharding.RULES):",
        f"  params ({param_dtype}) {_gib(plan.params)}; AdamW moments mu+nu ({param_dtype}; no "
        f"separate master copy: the params are it) {_gib(plan.opt_state)}; gradients "
        f"{_gib(plan.grads)}; reference params {_gib(plan.reference)}; weights gathered over "
        f"fsdp for use {_gib(plan.gathered)}",
        f"  activations of {plan.rows} sequence(s) x {plan.tokens} tokens on this device "
        f"{use} remat (model.remat): {_gib(plan.activations)} ({other} remat: {_gib(act_other)}); "
        f"logits chunk {_gib(plan.logits_chunk)}",
        f"  training step peak {_gib(plan.train_peak)}; rollout peak (embedded KV cache "
        f"{_gib(plan.rollout_kv)}) {_gib(plan.rollout_peak)}",
    ]
    if plan.fits is None:
        lines.append(
            f"fits: unknown (device memory unknown; peak {_gib(plan.peak)} per device; plan for "
            f"a machine with plan_report(cfg, num_devices=..., device_memory_gb=...))"
        )
    else:
        verdict = "yes" if plan.fits else "no"
        lines.append(
            f"fits: {verdict} (peak {_gib(plan.peak)} per device of {_gib(plan.device_bytes)} "
            f"= {plan.device_bytes / 1e9:.0f} GB, 90% usable)"
            + (
                ""
                if plan.fits
                else "; raise mesh.fsdp, set model.remat=true or trainer.micro_batch"
            )
        )
    return lines


def plan_report(
    cfg: Config, num_devices: int | None = None, device_memory_gb: float | None = None
) -> str:
    """The dry-run report (see the module docstring); raises on a problem the run would hit.

    The memory plan is for this machine's devices, or for `num_devices` devices of
    `device_memory_gb` GB each (e.g. 8 and 80 for 8 x 80 GB).
    """
    import jax

    from cppo_jax.trainer import shapes_of

    sh = shapes_of(cfg)
    processes = jax.process_count()
    _check_batching(cfg, sh, processes)
    lines = [f"plan: run {cfg.trainer.run_name!r} under {cfg.trainer.out_dir!r}"]
    n_train = _data_section(cfg, sh, lines)
    lines.append(
        f"shapes: Q={sh.Q} questions/step ({sh.Q // processes} per process), G={sh.G}, k={sh.k}, "
        f"M={sh.M} kept sequences, P={sh.P} prompt + C={sh.C} completion tokens"
    )
    if n_train:
        per_epoch = pipeline.steps_per_epoch(n_train, sh.Q)
        steps = cfg.trainer.steps or per_epoch
        lines.append(
            f"steps: {per_epoch} per epoch of {n_train} questions; {steps} to run "
            f"({steps * sh.Q / n_train:.2f} epochs), {steps * cfg.cppo.mu} optimizer updates"
        )
    else:
        lines.append("steps: unknown until data.train is set")
    lines.append(
        f"rollout: backend {cfg.rollout.backend}"
        + (f" at {cfg.rollout.vllm_url}" if cfg.rollout.backend == "vllm" else "")
        + f", temperature {cfg.rollout.temperature}, top-p {cfg.rollout.top_p}"
    )
    _memory_section(cfg, sh, _model_plan(cfg), lines, num_devices, device_memory_gb)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m cppo_jax.plan --config C [--devices 8 --device-memory-gb 80] key=value ...`."""
    import argparse
    import sys

    from cppo_jax.config import load_config

    parser = argparse.ArgumentParser(
        prog="python -m cppo_jax.plan", description=plan_report.__doc__
    )
    parser.add_argument("--config", required=True, help="a configs/*.py file defining get_config()")
    parser.add_argument("--devices", type=int, help="plan for this many devices (default: these)")
    parser.add_argument("--device-memory-gb", type=float, help="memory of one planned device, GB")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        print(plan_report(cfg, args.devices, args.device_memory_gb))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
