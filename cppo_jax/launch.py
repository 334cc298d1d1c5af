"""The main job: `python -m cppo_jax.launch --config configs/X.py key.path=value ...`.

A config whose `get_config()` returns a `Config` trains with CPPO; one that returns an `SFTConfig` runs
the supervised warm start. When `model.warm_start` names an SFT config and `model.init_checkpoint` does
not exist yet, the warm start runs first and writes it.

Before anything is loaded, `check_required` refuses a config without a model (`model.path` or
`model.init_checkpoint`) or with a `<required: ...>` placeholder left in it (configs/math7b.py's
`data.train`), and `check_startable` what the run would fail on when it starts: a model folder that does
not exist or lacks config.json or a weight tensor (names and shapes are read from the safetensors
headers, not the weights), a tokenizer without a chat template, a reward name nothing resolves to.
`trainer.dry_run=true` runs both and stops after `cppo_jax.plan.plan_run`: the data is loaded and counted
and its prompts tokenized, the shapes and step counts are derived, the mesh is laid out on this machine's
devices (or `--devices N`) and the memory plan is checked against the device memory (or
`--device-memory-gb GB`); it fails, with the layouts that fit, when the plan does not. A dry run passes
exactly when the real run would start (a vLLM server is not contacted).

The mesh: `mesh=auto` (the default) is laid out by `cppo_jax.plan.choose_mesh` for the devices JAX sees
and the memory each has (`--device-memory-gb` when JAX does not know it, as on a CPU): the most
data-parallel layout whose data x fsdp divides the questions per step and whose memory plan fits, logged
before the model is loaded; when none fits the plan is printed and the run refused, before any weight is
read. On GPUs the launch sets XLA_PYTHON_CLIENT_MEM_FRACTION to `layout.USABLE_FRACTION` (unless it is
set) before JAX starts, so the plan's usable share is the one JAX preallocates.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from cppo_jax.config.choices import MODEL_REQUIRED, REQUIRED_PREFIX, ConfigError
from cppo_jax.config.files import load_config
from cppo_jax.config.schema import Config


def _placeholders(section, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) of every string value that is still a `<required: ...>` placeholder."""
    found = []
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        key = prefix + field.name
        if dataclasses.is_dataclass(value):
            found += _placeholders(value, key + ".")
        elif isinstance(value, str) and value.startswith(REQUIRED_PREFIX):
            found.append((key, value))
    return found


def check_required(cfg: Config) -> None:
    """Raise ConfigError unless a model is named and no `<required: ...>` placeholder is left."""
    if not cfg.model.path and not cfg.model.init_checkpoint:
        raise ConfigError(
            f"{MODEL_REQUIRED}; set model.path=/path/to/model (a folder with config.json, "
            f"*.safetensors and the tokenizer) or model.init_checkpoint=..."
        )
    for key, value in _placeholders(cfg):
        detail = value[len(REQUIRED_PREFIX) :].strip(" :>")
        raise ConfigError(f"config key '{key}' is required: {detail}")


def _model_key(cfg: Config) -> str:
    return "model.init_checkpoint" if cfg.model.init_checkpoint else "model.path"


def _has_chat_template(folder: Path) -> bool:
    import json

    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(config.is_file() and json.loads(config.read_text()).get("chat_template"))
    except ValueError:
        return False


def check_startable(cfg: Config) -> None:
    """Raise ConfigError naming the key when the run would fail on start (see the module docstring)."""
    from cppo_jax.models.hf_io import check_weights
    from cppo_jax.models.tokenizer import has_tokenizer
    from cppo_jax.rewards import registry

    key, folder = _model_key(cfg), Path(cfg.model.start_folder)
    warm_start = bool(cfg.model.init_checkpoint and cfg.model.warm_start and not folder.exists())
    if not warm_start:  # else the warm start writes it, tokenizer included
        if not folder.is_dir():
            raise ConfigError(
                f"config key '{key}' = '{folder}': no such folder (a local Hugging Face folder "
                f"with config.json, *.safetensors and the tokenizer; nothing is downloaded)"
            )
        check_weights(folder, key)
    tok_key = "model.tokenizer" if cfg.model.tokenizer else key
    tok = Path(cfg.model.tokenizer) if cfg.model.tokenizer else folder
    if cfg.model.tokenizer or not warm_start:
        if not has_tokenizer(tok):
            raise ConfigError(
                f"config key '{tok_key}' = '{tok}': no tokenizer there (tokenizer.json or "
                f"tokenizer_config.json); set model.tokenizer=/path/to/tokenizer"
            )
        if not _has_chat_template(tok):
            raise ConfigError(
                f"config key '{tok_key}' = '{tok}': the tokenizer has no chat template (prompts are "
                f"built with it); use an instruct model's tokenizer or add chat_template"
            )
    for name in cfg.reward.funcs:
        try:
            registry.resolve(name)
        except ValueError as e:
            raise ConfigError(f"config key 'reward.funcs' = {list(cfg.reward.funcs)}: {e}") from e
    shown = [registry.display_name(name) for name in cfg.reward.funcs]
    twice = sorted({n for n in shown if shown.count(n) > 1})
    if twice:  # metrics name a function by its name alone (as TRL)
        raise ConfigError(
            f"config key 'reward.funcs' = {list(cfg.reward.funcs)}: more than one reward function is "
            f"named {', '.join(twice)}; rename one (metrics are logged as rewards/<name>/mean)"
        )


def _describe(cfg: Config) -> str:
    from cppo_jax.algo.cppo import shapes_of

    sh = shapes_of(cfg)
    a = cfg.cppo
    return (
        f"CPPO: G={sh.G}, p={a.pruning_rate}, k={sh.k} kept per question, "
        f"Q={sh.Q} questions per step (allocation {'on' if a.allocation else 'off'}"
        f"{f'; the {sh.U} with reward variance first trained' if a.filter_groups else ''}), "
        f"{sh.M} of {sh.Q * sh.G} completions trained, mu={a.mu}, beta={a.beta}, "
        f"prompt {sh.P} + completion {sh.C} tokens, backend {cfg.rollout.backend}"
    )


def resolve_mesh(cfg: Config, log=print, device_memory_gb: float | None = None) -> Config:
    """`cfg` with `mesh=auto` (the default) replaced by `plan.choose_mesh`'s layout for this machine's
    devices (of `device_memory_gb` GB when given, else of the memory JAX reports), logged; a mesh
    set in the config is kept. When no layout fits, the plan is logged and a ConfigError raised,
    before anything is loaded."""
    if not cfg.mesh.auto:
        return cfg
    import jax

    from cppo_jax.config.files import apply_overrides
    from cppo_jax.models.known import config_model_size
    from cppo_jax.plan import choose_mesh, plan_run
    from cppo_jax.planning import memory as layout

    devices = jax.devices()
    if config_model_size(cfg) is None:  # e.g. a warm start not written yet: nothing to plan
        log(
            f"mesh=auto: the model's size is unknown before it is loaded ({_model_key(cfg)}); "
            f"all {len(devices)} device(s) on mesh.data"
        )
        return cfg
    if device_memory_gb is not None:
        device_bytes = int(device_memory_gb * 1e9)
    else:
        device_bytes = layout.device_memory(jax.local_devices()[0])
    try:
        choice = choose_mesh(
            cfg, len(devices), device_bytes, platform=devices[0].platform, devices=devices
        )
    except ConfigError:
        log(plan_run(cfg, None, device_memory_gb).text)  # the plan, with the layouts that fit
        raise
    log(choice.note)
    return apply_overrides(cfg, list(choice.overrides))


def ensure_warm_start(cfg: Config, log=print) -> None:
    target = cfg.model.init_checkpoint
    if not target or Path(target).exists() or not cfg.model.warm_start:
        return
    from cppo_jax.parallel import distributed
    from cppo_jax.train.sft import SFTConfig, run_sft

    if distributed.process_count() > 1:  # N processes would each train and write it
        raise ConfigError(
            f"model.init_checkpoint={target} does not exist and {distributed.process_count()} processes "
            f"would each run the warm start: run it once first, in one process: python -m "
            f"cppo_jax.launch --config {cfg.model.warm_start} out={target}"
        )
    sft_cfg = load_config(cfg.model.warm_start, [f"out={target}"], expected=SFTConfig)
    log(
        f"no warm-start checkpoint at {target}: running the supervised warm start ({cfg.model.warm_start})"
    )
    run_sft(sft_cfg, log=log)


def run(
    cfg: Config,
    log=print,
    num_devices: int | None = None,
    device_memory_gb: float | None = None,
) -> dict:
    """Train (or, with trainer.dry_run, plan: for `num_devices` devices of `device_memory_gb` GB
    when given, else for this machine)."""
    if not cfg.trainer.dry_run:
        check_required(cfg)
    elif not cfg.model.path and not cfg.model.init_checkpoint:
        check_required(cfg)  # the model message; placeholders are reported after the plan
    check_startable(cfg)
    log(_describe(cfg))
    if cfg.trainer.dry_run:
        from cppo_jax.plan import not_fitting_error, plan_run

        plan = plan_run(cfg, num_devices, device_memory_gb)
        log(plan.text)
        check_required(cfg)  # a `<required: ...>` value left: refuse once the rest is shown
        if plan.memory is not None and plan.memory.fits is False:
            raise not_fitting_error(plan)
        log(
            "dry run: config, model files, tokenizer, rewards, data, mesh and memory validated; nothing trained"
        )
        return {"dry_run": True, "plan": plan.text}
    if num_devices is not None:
        raise ConfigError("--devices plans a machine: give it with trainer.dry_run=true")
    cfg = resolve_mesh(cfg, log, device_memory_gb)  # before any weight is read
    from cppo_jax.train.trainer import Trainer

    ensure_warm_start(cfg, log)
    if cfg.mesh.auto:  # the warm start has written the model whose size was unknown
        cfg = resolve_mesh(cfg, log, device_memory_gb)
    trainer = Trainer(cfg)
    host = trainer.host
    if host.earlier_run is not None:
        log(
            f"{host.out_dir} held an earlier run: moved to {host.earlier_run} "
            "(trainer.resume=true continues a run instead)"
        )
    bar = None
    try:
        bar = _progress(trainer.num_steps - trainer.start_step, cfg.logging.progress and host.main)
        summary = trainer.train(progress=bar)
    finally:
        if bar is not None:
            bar.close()  # before the summary: an open bar prints itself again when collected
        trainer.close()
    before, after = summary["before"], summary["after"]
    # before and after on the same questions: the sample's share of the whole-split evaluation
    same = "subset_" if "subset_accuracy" in after else ""
    log(
        f"\nheld-out accuracy ({before['n']} questions): greedy {before['accuracy']:.1%} -> "
        f"{after[same + 'accuracy']:.1%}, sampled (T = {cfg.rollout.temperature:g}, one each) "
        f"{before['sampled_accuracy']:.1%} -> {after[same + 'sampled_accuracy']:.1%}"
        + (
            f"; after, the whole split ({after['n']}): greedy {after['accuracy']:.1%}"
            if same
            else ""
        )
    )
    if summary["phases"]:
        log("\n" + summary["phases"])
    log(f"outputs: {host.out_dir}")
    return summary


class _Progress:
    """The tqdm bar of a run: called with each step's metrics; `close` before printing anything else."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="cppo", dynamic_ncols=True)

    def __call__(self, m: dict) -> None:
        self.bar.update(1)
        shown = {"reward": f"{m.get('reward', 0):.2f}"}
        if "accuracy" in m:  # only when an accuracy reward is among the training rewards
            shown["acc"] = f"{m['accuracy']:.2f}"
        shown.update(
            kept=int(m.get("cppo/kept", 0)),
            gen=f"{m.get('timing_s/rollout', 0):.1f}s",
            upd=f"{m.get('timing_s/update', 0):.2f}s",
        )
        self.bar.set_postfix(shown)

    def close(self) -> None:
        self.bar.close()


def _progress(total: int, enabled: bool) -> _Progress | None:
    return _Progress(total) if enabled else None


def _quiet(*_args, **_kw) -> None:
    """The log of processes other than 0: they print nothing."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cppo_jax.launch", description=__doc__)
    parser.add_argument("--config", required=True, help="a configs/*.py file defining get_config()")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    parser.add_argument("--coordinator", help="multi-process: process 0's HOST:PORT")
    parser.add_argument("--num-processes", type=int, help="multi-process: how many processes")
    parser.add_argument("--process-id", type=int, help="multi-process: this process, 0..N-1")
    parser.add_argument(
        "--devices", type=int, help="with trainer.dry_run=true: plan for N devices (default: these)"
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        help="memory of one device, GB, for the plan and mesh=auto (default: this device's, if known; "
        "with trainer.dry_run=true and --devices, a planned machine's)",
    )
    args = parser.parse_intermixed_args(argv)
    from cppo_jax.parallel import distributed
    from cppo_jax.planning import memory as layout

    fraction_note = layout.set_gpu_memory_fraction()  # before JAX starts a GPU backend

    try:  # before anything touches a device (see cppo_jax/parallel/distributed.py for the sources)
        distributed.initialize(
            coordinator=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from cppo_jax.train.sft import SFTConfig, run_sft

    try:
        cfg = load_config(args.config, args.overrides, expected=(Config, SFTConfig))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(cfg, SFTConfig):
        run_sft(cfg)
        return 0
    if not cfg.trainer.dry_run:  # before anything compiles
        from cppo_jax.observe.profile import use_compile_cache

        use_compile_cache(cfg.trainer.compile_cache_dir)
    from cppo_jax.rollout.vllm.client import RolloutServerError
    from cppo_jax.train.checkpoint import CheckpointError
    from cppo_jax.train.stopping import SignalStopError
    from cppo_jax.train.trainer import NonFiniteError

    try:
        log = print if distributed.is_main() else _quiet
        if fraction_note:
            log(fraction_note)
        run(cfg, log=log, num_devices=args.devices, device_memory_gb=args.device_memory_gb)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the plan's data checks (rows, prompt lengths) name their key
        if not cfg.trainer.dry_run:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SignalStopError as e:  # SIGTERM/SIGINT: checkpoint saved; 128 + signal, like the shell
        print(str(e), file=sys.stderr)
        return e.exit_code
    except (CheckpointError, NonFiniteError, RolloutServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
