"""The plan of a run, built without weights: data, shapes, tokenizer, model size (what a dry run prints).

`plan_report(cfg)` loads the config's data (records counted, bad rows reported, the validation split held
out), tokenizes every prompt through the real pipeline when the tokenizer folder exists (else says it did
not), derives the shapes of one step (Q, G, k, M, P, C) and the number of steps, reads the model's size
from `config.json` in its folder (or, without one, from `models.known.KNOWN_MODELS` by name) and plans the memory
per device on the config's mesh (`compiled_memory.run_plan`): params, AdamW moments, gradients,
reference params, activations with and without remat, the logits chunk and the rollout KV cache, each
compiled program's bytes and the run peak, ending in `fits: yes/no` (judged on the run peak).

Problems a run would hit later (a micro-batch that does not divide the kept sequences, a question batch
that does not split over the processes or the mesh's data axes, prompts longer than `data.max_prompt_len` with
`data.long_prompts=reject`) raise here, with the key that causes them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from cppo_jax.config.choices import REQUIRED_PREFIX, ConfigError
from cppo_jax.config.run import MeshConfig
from cppo_jax.config.schema import Config
from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.models.known import ModelSize, config_model_size
from cppo_jax.models.known import transformer_config as base_config
from cppo_jax.models.tokenizer import Tokenizer, has_tokenizer
from cppo_jax.packing import plan as pack_plan
from cppo_jax.planning import compiled_memory
from cppo_jax.planning import memory as layout
from cppo_jax.planning.compiled_memory import run_plan, target_of
from cppo_jax.planning.memory import MemoryPlan, _gib, memory_lines

__all__ = [
    "MeshChoice",
    "NodeSplit",
    "Plan",
    "choose_mesh",
    "node_split",
    "not_fitting_error",
    "plan_report",
    "plan_run",
]


def _data_section(cfg: Config, shapes, lines: list[str]) -> int:
    """Load, count and (when possible) tokenize the data; returns the number of training questions."""
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

    folder = cfg.model.tokenizer_folder
    if not has_tokenizer(folder):
        where = repr(folder) if folder else "no folder configured"
        lines.append(f"tokenizer: none found ({where}): prompts not tokenized")
        return len(train)

    tok = Tokenizer.from_dir(folder)
    chat = "yes" if getattr(tok.hf, "chat_template", None) else "NO (required)"
    lines.append(
        f"tokenizer: {folder}: {tok.vocab_size} ids, eos {tok.hf.eos_token!r} ({tok.eos_id}), "
        f"end ids {list(tok.stop_ids)}, "
        f"pad id {tok.pad_id}, chat template {chat}"
    )
    parts = [("train", train), ("validation", val), ("test", test[:eval_n])]
    for name, examples in parts:
        if not examples:
            continue
        try:
            enc = pipeline.encode_prompts(
                examples,
                tok,
                d.task,
                shapes.P,
                d.long_prompts,
                d.system_prompt,
                d.prompt_format,
                d.enable_thinking,
            )
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
class Plan:
    """A run's plan: the report's text, its memory plan (None: model size unknown) and, when that
    does not fit, the layouts that do (`advice`)."""

    text: str
    memory: MemoryPlan | None = None
    advice: str = ""


def transformer_config(cfg: Config, size: ModelSize):
    """The TransformerConfig the run builds, with `model.lora`'s adapters when enabled."""
    tcfg = base_config(cfg, size)
    if cfg.model.lora.enabled:
        from cppo_jax.models import lora_state

        tcfg = lora_state.transformer_config(tcfg, cfg.model.lora)
    return tcfg


def _memory_section(
    cfg: Config,
    shapes,
    size: ModelSize | None,
    lines: list[str],
    num_devices: int | None,
    device_memory_gb: float | None,
) -> tuple[MemoryPlan | None, str]:
    import jax

    devices = jax.devices()
    planned = num_devices or len(devices)
    where = (
        f"{planned} planned device(s)"
        if num_devices
        else f"{planned} {devices[0].platform} device(s), {jax.process_count()} process(es)"
    )
    if device_memory_gb is not None:
        device_bytes = int(device_memory_gb * 1e9)
    else:
        device_bytes = layout.device_memory(devices[0])
    m = cfg.mesh
    mesh, note = None, ""
    platform = "gpu" if num_devices else devices[0].platform
    target = target_of(platform, "" if num_devices else devices[0].device_kind)
    if m.auto and size is not None:
        try:
            choice = choose_mesh(
                cfg,
                planned,
                device_bytes,
                platform=platform,
                devices=None if num_devices else devices,
            )
            mesh, note = choice.plan.mesh, choice.note
            if "model.attention=splash" in choice.overrides:
                cfg = dataclasses.replace(
                    cfg, model=dataclasses.replace(cfg.model, attention="splash")
                )
        except ConfigError:  # nothing fits: the plan of the smallest peak, and what fits instead
            tcfg = transformer_config(cfg, size)
            tried = compiled_memory.pick_mesh(cfg, tcfg, shapes, planned, device_bytes, target)
            mesh = min(tried, key=lambda p: p.peak).mesh if tried else None
            note = "mesh=auto: no layout fits; the one of the smallest peak below"
    mesh = mesh or m.sizes(planned)
    config = "auto" if m.auto else "/".join(str(v) for v in m.explicit().values())
    lines.append(
        f"mesh: data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']} "
        f"(config {config}) over {where}"
    )
    if note:
        lines.append(f"  {note}")
    dp = mesh["data"] * mesh["fsdp"]
    if shapes.Q % dp:
        raise ConfigError(
            f"the {shapes.Q} questions per step do not split over mesh.data={mesh['data']} x "
            f"mesh.fsdp={mesh['fsdp']} = {dp} data-parallel devices: adjust "
            f"cppo.questions_per_step (Q={shapes.Q}) or mesh.data / mesh.fsdp"
        )
    if cfg.trainer.pack:  # the rows of the train step and the log-prob forwards
        choice = pack_plan.config_choice(cfg, shapes, dp)
        lines.append(f"packed rows: {choice.note(shapes.M)}; a step needing more trains padded")
    if size is None:
        lines.append(
            "model: size unknown (no config.json in the model folder and no known model name); "
            "memory not estimated"
        )
        return None, ""
    hf = size.hf_config
    n = size.params
    tied = "tied" if hf.get("tie_word_embeddings") else "untied"
    lines.append(
        f"model: {n:,} parameters ({n / 1e9:.2f} B; {hf.get('model_type')}, {size.layers} layers, "
        f"{tied} embeddings) from {size.source}"
    )
    tcfg = transformer_config(cfg, size)
    plan = run_plan(cfg, tcfg, shapes, mesh, device_bytes, target)
    lines.extend(memory_lines(plan, cfg.model.param_dtype))
    advice = ""
    if plan.fits is False:
        advice = compiled_memory.fit_advice(cfg, tcfg, shapes, planned, device_bytes, target)
        lines.append(f"  instead: {advice}")
    max_pos = hf.get("max_position_embeddings")
    if max_pos and max_pos < shapes.P + shapes.C:
        lines.append(
            f"  WARNING: P + C = {shapes.P + shapes.C} tokens exceed the model's "
            f"max_position_embeddings={max_pos}"
        )
    return plan, advice


def plan_run(
    cfg: Config, num_devices: int | None = None, device_memory_gb: float | None = None
) -> Plan:
    """The dry-run report (see the module docstring); raises on a problem the run would hit.

    The memory plan is for this machine's devices, or for `num_devices` devices of
    `device_memory_gb` GB each (e.g. 8 and 80 for 8 x 80 GB).
    """
    import jax

    from cppo_jax.algo.cppo import shapes_of

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
    memory, advice = _memory_section(
        cfg, sh, config_model_size(cfg), lines, num_devices, device_memory_gb
    )
    return Plan("\n".join(lines), memory, advice)


def plan_report(
    cfg: Config, num_devices: int | None = None, device_memory_gb: float | None = None
) -> str:
    """The text of `plan_run`."""
    return plan_run(cfg, num_devices, device_memory_gb).text


def not_fitting_error(plan: Plan) -> ConfigError:
    mp = plan.memory
    return ConfigError(
        f"the memory plan does not fit: peak {_gib(mp.peak)} per device of {_gib(mp.device_bytes)} "
        f"({mp.device_bytes / 1e9:.0f} GB, {layout.USABLE:.0%} usable) on mesh "
        f"{layout.mesh_overrides(mp.mesh)}; {plan.advice}"
    )


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    """What `choose_mesh` decided: the plan of the layout, the overrides that select it (`mesh.*`,
    and `model.attention=splash` where it was chosen on TPUs) and a line saying why."""

    plan: MemoryPlan
    overrides: tuple[str, ...]
    note: str


def _placeable(mesh: dict[str, int], devices, allow_split: bool) -> bool:
    """Whether `mesh` maps onto `devices` (a TPU slice's torus may refuse a factorization)."""
    from cppo_jax.parallel import sharding as sharding_lib

    try:
        sharding_lib.make_mesh(MeshConfig(**mesh), devices=devices, allow_split=allow_split)
    except sharding_lib.MeshError:
        return False
    return True


def _on_devices(plans: list[MemoryPlan], devices) -> list[MemoryPlan]:
    """`plans` that `devices` can hold, in order: those placed without splitting a physical axis of
    the torus, then those that need a split, each fitting ones first."""
    strict = [p for p in plans if _placeable(p.mesh, devices, allow_split=False)]
    split = [p for p in plans if p not in strict and _placeable(p.mesh, devices, allow_split=True)]
    order = [[p for p in group if p.fits is not False] for group in (strict, split)]
    return order[0] + order[1] + [p for p in strict + split if p.fits is False]


def choose_mesh(
    cfg: Config,
    num_devices: int,
    device_bytes: int | None,
    *,
    platform: str = "gpu",
    devices=None,
) -> MeshChoice:
    """The layout a run of `cfg` on `num_devices` devices of `device_bytes` bytes each should use: the
    one function behind `mesh=auto` in `cppo_jax.launch` and `launch/gpu_node.sh` (`--pick-mesh`).

    A mesh set in the config or by overrides is kept (and checked against the questions per step).
    `mesh=auto` (the default) takes `compiled_memory.pick_mesh`'s order: of the layouts whose data x fsdp
    divides Q (tensor takes the rest of the devices, so a Q that 8 does not divide still runs on 8
    devices with fewer data-parallel ones), the most data parallel that fits `layout.USABLE_FRACTION`
    of the memory, then the fewest tensor shards. With `devices` given, only layouts that
    `sharding.make_mesh` can place on them, first those that map onto a TPU slice's torus without
    splitting a physical axis. On TPUs (`platform="tpu"`) with the
    default einsum attention, the splash kernel's plan is taken when its peak is lower (it keeps no
    [T, T] scores). Unknown memory (`device_bytes` None: a CPU): the first layout in that order.
    Raises ConfigError with the plan's figures and the layouts that fit when nothing does.
    """
    from cppo_jax.algo.cppo import shapes_of

    sh = shapes_of(cfg)
    size = config_model_size(cfg)
    if size is None:
        raise ConfigError(
            f"model.path={cfg.model.path!r}: no config.json there and no known model name, so the "
            f"memory of a layout cannot be planned"
        )
    tcfg = transformer_config(cfg, size)
    target = target_of(platform, getattr(devices[0], "device_kind", "") if devices else "")
    advice = functools.partial(
        compiled_memory.fit_advice, cfg, tcfg, sh, num_devices, device_bytes or 0, target
    )

    def candidates(tcfg) -> list[MemoryPlan]:
        return compiled_memory.pick_mesh(cfg, tcfg, sh, num_devices, device_bytes, target)

    def ordered(tcfg) -> list[MemoryPlan]:  # mesh=auto's candidates, the one to use first
        plans = candidates(tcfg)
        return plans if devices is None else _on_devices(plans, devices)

    extra: tuple[str, ...] = ()
    if not cfg.mesh.auto:
        mesh = cfg.mesh.sizes(num_devices)
        plans = [p for p in candidates(tcfg) if p.mesh == mesh]
        if not plans:
            dp = mesh["data"] * mesh["fsdp"]
            raise ConfigError(
                f"{layout.mesh_overrides(mesh)}: the {sh.Q} questions per step do not split over "
                f"data x fsdp = {dp} devices; "
                + (advice() if device_bytes else "set mesh.* so that data x fsdp divides Q")
            )
        why = "set in the config"
    else:
        plans = ordered(tcfg)
        why = "mesh=auto: the most data-parallel layout that fits, then the fewest tensor shards"
        if platform == "tpu" and cfg.model.attention == "einsum" and plans:
            alt = ordered(dataclasses.replace(tcfg, attention="splash"))
            better = layout.preference  # a better layout fits with splash, or the same one lower
            if better(alt[0]) < better(plans[0]) or (
                alt[0].mesh == plans[0].mesh and alt[0].peak < plans[0].peak
            ):
                plans, extra = alt, ("model.attention=splash",)
                why += "; model.attention=splash (TPU): its plan keeps no [T, T] attention scores"
    if not plans:
        raise ConfigError(
            advice()
            if device_bytes
            else f"no layout of {num_devices} devices has data x fsdp dividing the {sh.Q} questions "
            f"per step (or maps onto these devices): set cppo.questions_per_step or mesh.*"
        )
    best = plans[0]
    if best.fits is False:
        raise not_fitting_error(Plan("", min(plans, key=lambda p: p.peak), advice()))
    if best.fits is None:
        why += " (device memory unknown: not checked)"
    overrides = tuple(layout.mesh_overrides(best.mesh).split()) + extra
    note = f"mesh for {num_devices} device(s): {' '.join(overrides)} (peak {_gib(best.peak)} per device; {why})"
    return MeshChoice(best, overrides, note)


@dataclasses.dataclass(frozen=True)
class NodeSplit:
    """One node's GPUs split between the vLLM server (`rollout`, served `parallel`-wise over
    `serve_size` of them) and the trainer (`trainer`: its mesh=auto choice)."""

    rollout: int
    trainer: MeshChoice
    parallel: str  # "tensor" (--tensor-parallel-size) or "data" (--data-parallel-size)
    serve_size: int
    note: str

    def server_args(self) -> tuple[str, ...]:
        if self.serve_size == 1:
            return ()
        return (f"--{self.parallel}-parallel-size", str(self.serve_size))


def _serve_size(cfg: Config, gpus: int, parallel: str) -> int:
    """How many of the server's `gpus` vLLM uses: all of them data-parallel; tensor-parallel, the
    largest count that divides both `gpus` and the attention heads (vLLM's rule)."""
    if parallel == "data":
        return gpus
    size = config_model_size(cfg)
    heads = int(size.hf_config.get("num_attention_heads", 1)) if size else 1
    return max(d for d in range(1, gpus + 1) if gpus % d == 0 and heads % d == 0)


def node_split(
    cfg: Config,
    gpus: int,
    device_bytes: int | None,
    *,
    rollout_gpus: int = 0,
    parallel: str = "tensor",
) -> NodeSplit:
    """The split of a node's `gpus` GPUs that `launch/gpu_node.sh` runs: the trainer gets the most
    GPUs (at most `gpus` - 1) on which `choose_mesh` finds a layout that fits and shards every weight
    dimension its axes are meant to (no `Unsharded` line: 7 GPUs split no Qwen head count), the vLLM
    server the rest, generation being most of a step (8 x 80 GB: 4 + 4 for both paper configs; 8 x
    141 GB: 6 trainer GPUs + 2 serving for math7b's Q = 24). `rollout_gpus` > 0 fixes the server's
    share instead. The server spreads the model over its GPUs `parallel`-wise: tensor (one engine,
    which every weight push reaches through /collective_rpc) or data (an engine per GPU, faster for a
    model one GPU holds). Raises ConfigError naming what was tried when no split fits."""
    if gpus < 2 or not 0 <= rollout_gpus < gpus:
        raise ConfigError(
            f"--gpus {gpus} --rollout-gpus {rollout_gpus}: a node needs at least one GPU for the "
            f"server and one for the trainer"
        )
    counts = [gpus - rollout_gpus] if rollout_gpus else list(range(gpus - 1, 0, -1))
    tried = []
    for t in counts:
        try:
            choice = choose_mesh(cfg, t, device_bytes)
        except ConfigError as e:
            tried.append(f"{t} GPUs: {str(e).split(' per device')[0].split(';')[0]}")
            continue
        if choice.plan.unsharded and not rollout_gpus and cfg.mesh.auto:
            tried.append(f"{t} GPUs: {choice.plan.unsharded[0].line().split(':')[0]}")
            continue
        r = gpus - t
        size = _serve_size(cfg, r, parallel)
        idle = f", {r - size} idle (the heads do not split {r} ways)" if size < r else ""
        note = (
            f"node of {gpus} GPUs: vLLM on {r} ({parallel}-parallel over {size}{idle}), the "
            f"trainer on {t} with {' '.join(choice.overrides)}"
        )
        if len(counts) > 1 and tried:
            note += f"; more trainer GPUs do not fit or split the model ({'; '.join(tried)})"
        return NodeSplit(r, choice, parallel, size, note)
    raise ConfigError(
        f"no split of {gpus} GPUs gives the trainer a layout that fits: " + "; ".join(tried)
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m cppo_jax.plan --config C [--devices 8 --device-memory-gb 80] key=value ...`.

    Exit status: 0 when the plan fits (or the device memory is unknown), 1 when it does not fit
    (the report says what does), 2 on a config error. `--pick-mesh` prints only the mesh overrides
    to use on `--devices` devices of `--device-memory-gb` GB (what launch/gpu_node.sh runs).
    """
    import argparse
    import sys

    from cppo_jax.config.files import load_config

    parser = argparse.ArgumentParser(
        prog="python -m cppo_jax.plan",
        description=__doc__ + "\n" + (main.__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="a configs/*.py file defining get_config()")
    parser.add_argument("--devices", type=int, help="plan for this many devices (default: these)")
    parser.add_argument("--device-memory-gb", type=float, help="memory of one planned device, GB")
    parser.add_argument(
        "--pick-mesh",
        action="store_true",
        help="print the mesh overrides that divide the questions and fit (needs --devices and "
        "--device-memory-gb); exit 2 with the plan's figures when none does",
    )
    parser.add_argument(
        "--split-node",
        type=int,
        metavar="GPUS",
        help="print the split of a node of GPUS GPUs of --device-memory-gb GB between the vLLM server "
        "and the trainer (what launch/gpu_node.sh runs): a line 'ROLLOUT_GPUS SERVE_ARGS... -- "
        "OVERRIDES...', then the trainer's plan",
    )
    parser.add_argument(
        "--rollout-gpus",
        type=int,
        default=0,
        help="with --split-node: the server's GPUs (0: chosen)",
    )
    parser.add_argument(
        "--rollout-parallel",
        choices=("tensor", "data"),
        default="tensor",
        help="with --split-node: how vLLM spreads the model over its GPUs",
    )
    parser.add_argument(
        "--platform",
        choices=("gpu", "tpu"),
        default="gpu",
        help="with --pick-mesh: the devices' kind (tpu also weighs model.attention=splash)",
    )
    parser.add_argument(
        "--compile-for",
        metavar="TARGET",
        help="compile the run's programs for TARGET without its devices and report the compiler's "
        "memory per program beside the plan's: a TPU topology (v5e:2x4, v6e:2x4, v5p:2x2x1, "
        "v4:2x2x1, ...; needs libtpu: make libtpu) or cpu",
    )
    parser.add_argument(
        "--no-search",
        action="store_true",
        help="with --compile-for: compile the config as it is, without searching the largest "
        "micro-batch and questions per step that fit",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="with --compile-for: also write the report as JSON to FILE"
    )
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    args = parser.parse_intermixed_args(argv)
    if args.compile_for:
        return _compile_for(args)
    if args.pick_mesh and (args.devices is None or args.device_memory_gb is None):
        parser.error("--pick-mesh needs --devices N and --device-memory-gb GB")
    if args.split_node and args.device_memory_gb is None:
        parser.error("--split-node needs --device-memory-gb GB")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.split_node:
            split = node_split(
                cfg,
                args.split_node,
                int(args.device_memory_gb * 1e9),
                rollout_gpus=args.rollout_gpus,
                parallel=args.rollout_parallel,
            )
            print(
                " ".join((str(split.rollout), *split.server_args(), "--", *split.trainer.overrides))
            )
            print(split.note)
            print(split.trainer.note)
            print("\n".join(memory_lines(split.trainer.plan, cfg.model.param_dtype)))
            return 0
        if args.pick_mesh:
            chosen = choose_mesh(
                cfg, args.devices, int(args.device_memory_gb * 1e9), platform=args.platform
            )
            print(" ".join(chosen.overrides))
            print(f"{chosen.note}, of {args.device_memory_gb:g} GB", file=sys.stderr)
            return 0
        plan = plan_run(cfg, args.devices, args.device_memory_gb)
        print(plan.text)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if plan.memory is not None and plan.memory.fits is False:
        print(f"error: {not_fitting_error(plan)}", file=sys.stderr)
        return 1
    return 0


def _compile_for(args) -> int:
    """`--compile-for`: exit 0 when the run fits (as configured, or with the overrides printed),
    1 when nothing searched fits, 2 on a config error (an unknown target, a mesh that does not
    divide the target's devices, no libtpu). Full fine-tuning that fits at no micro-batch is
    compiled again with LoRA's recipe (`config.model.LORA_RECIPE`), and when that fits its
    overrides are the ones printed (exit 0), named as LoRA's: the verdict a one-chip user needs."""
    import sys

    from cppo_jax.config.files import load_config
    from cppo_jax.config.model import LORA_RECIPE
    from cppo_jax.planning import fit as compile_fit
    from cppo_jax.planning import report as compile_report

    hbm = int(args.device_memory_gb * 1e9) if args.device_memory_gb else None
    try:
        cfg = load_config(args.config, args.overrides)
        report = compile_fit.fit(cfg, args.compile_for, hbm_bytes=hbm, search=not args.no_search)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(compile_report.lines(report)))
    as_json = compile_report.as_json(report)
    fixes = compile_report.fit_overrides(report)
    lora = None
    if report.fits is False and not fixes and not args.no_search and not cfg.model.lora.enabled:
        try:  # (a config LoRA cannot take, packed rows for one, keeps the full run's verdict)
            lora_cfg = load_config(args.config, [*args.overrides, *LORA_RECIPE])
        except (ConfigError, ValueError):
            lora_cfg = None
        if lora_cfg is not None:
            recipe = " ".join(LORA_RECIPE)
            print(f"\nfull fine-tuning does not fit: compiling LoRA's recipe ({recipe})")
            try:
                lora = compile_fit.fit(lora_cfg, args.compile_for, hbm_bytes=hbm)
            except (ConfigError, ValueError) as e:
                print(f"  LoRA's recipe cannot be compiled here: {e}")
        if lora is not None:
            print("\n".join(compile_report.lines(lora)))
            as_json["lora"] = compile_report.as_json(lora)
    if args.json:
        Path(args.json).write_text(json.dumps(as_json, indent=1))
    if fixes:
        print(f"run with: {fixes}")
    if report.fits is not False or fixes:
        return 0
    if lora is not None:
        lora_fixes = compile_report.fit_overrides(lora)
        if lora.fits or lora_fixes:
            tail = f" {lora_fixes}" if lora_fixes and not lora.fits else ""
            print(f"verdict: {compile_report.lora_verdict(lora)}")
            print(f"run with: {' '.join(LORA_RECIPE)}{tail}")
            return 0
    print(f"error: {compile_report.no_fit_message(report, lora)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
