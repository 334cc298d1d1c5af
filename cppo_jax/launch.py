"""The main job: `python -m cppo_jax.launch --config configs/X.py key.path=value ...`.

A config whose `get_config()` returns a `Config` trains with CPPO; one that returns an `SFTConfig` runs
the supervised warm start. When `model.warm_start` names an SFT config and `model.init_checkpoint` does
not exist yet, the warm start runs first and writes it.

Before anything is loaded, `check_required` refuses a config without a model (`model.path` or
`model.init_checkpoint`) or with a `<required: ...>` placeholder left in it (configs/math7b.py's
`data.train`). `trainer.dry_run=true` then stops after `cppo_jax.plan.plan_report`: the data is loaded and
counted (and tokenized when the tokenizer folder exists), the shapes and step counts are derived and the
model's size is read from its config.json; no weights are needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from cppo_jax.config import Config, ConfigError, load_config

MODEL_REQUIRED = "model.path is required: a local Hugging Face folder (nothing is downloaded)"
REQUIRED_PREFIX = "<required"  # config values starting with this must be overridden


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


def _describe(cfg: Config) -> str:
    from cppo_jax.trainer import shapes_of

    sh = shapes_of(cfg)
    a = cfg.cppo
    return (
        f"CPPO: G={sh.G}, p={a.pruning_rate}, k={sh.k} kept per question, "
        f"Q={sh.Q} questions per step (allocation {'on' if a.allocation else 'off'}), "
        f"{sh.M} of {sh.Q * sh.G} completions trained, mu={a.mu}, beta={a.beta}, "
        f"prompt {sh.P} + completion {sh.C} tokens, backend {cfg.rollout.backend}"
    )


def ensure_warm_start(cfg: Config, log=print) -> None:
    target = cfg.model.init_checkpoint
    if not target or Path(target).exists() or not cfg.model.warm_start:
        return
    from cppo_jax import distributed
    from cppo_jax.sft import SFTConfig, run_sft

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


def run(cfg: Config, log=print) -> dict:
    if not cfg.trainer.dry_run:
        check_required(cfg)
    elif not cfg.model.path and not cfg.model.init_checkpoint:
        check_required(cfg)  # the model message; placeholders are reported after the plan
    log(_describe(cfg))
    if cfg.trainer.dry_run:
        from cppo_jax.plan import plan_report

        report = plan_report(cfg)
        log(report)
        check_required(cfg)  # a `<required: ...>` value left: refuse once the rest is shown
        log("dry run: config, data and shapes validated; nothing trained")
        return {"dry_run": True, "plan": report}
    from cppo_jax.trainer import Trainer

    ensure_warm_start(cfg, log)
    trainer = Trainer(cfg)
    try:
        bar = _progress(
            trainer.num_steps - trainer.start_step, cfg.logging.progress and trainer.main
        )
        summary = trainer.train(progress=bar)
    finally:
        trainer.close()
    before, after = summary["before"], summary["after"]
    log(
        f"\nheld-out accuracy ({after['n']} questions): greedy {before['accuracy']:.1%} -> "
        f"{after['accuracy']:.1%}, sampled (T = {cfg.rollout.temperature:g}, one each) "
        f"{before['sampled_accuracy']:.1%} -> {after['sampled_accuracy']:.1%}"
    )
    if summary["phases"]:
        log("\n" + summary["phases"])
    log(f"outputs: {trainer.out_dir}")
    return summary


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="cppo", dynamic_ncols=True)

    def update(m: dict) -> None:
        bar.update(1)
        bar.set_postfix(
            reward=f"{m.get('reward', 0):.2f}",
            acc=f"{m.get('accuracy', 0):.2f}",
            kept=int(m.get("cppo/kept", 0)),
            gen=f"{m.get('timing_s/rollout', 0):.1f}s",
            upd=f"{m.get('timing_s/update', 0):.2f}s",
        )

    return update


def _quiet(*_args, **_kw) -> None:
    """The log of processes other than 0: they print nothing."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cppo_jax.launch", description=__doc__)
    parser.add_argument("--config", required=True, help="a configs/*.py file defining get_config()")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    parser.add_argument("--coordinator", help="multi-process: process 0's HOST:PORT")
    parser.add_argument("--num-processes", type=int, help="multi-process: how many processes")
    parser.add_argument("--process-id", type=int, help="multi-process: this process, 0..N-1")
    args = parser.parse_args(argv)
    from cppo_jax import distributed

    try:  # before anything touches a device (see cppo_jax/distributed.py for the sources)
        distributed.initialize(
            coordinator=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from cppo_jax.sft import SFTConfig, run_sft

    try:
        cfg = load_config(args.config, args.overrides, expected=(Config, SFTConfig))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(cfg, SFTConfig):
        run_sft(cfg)
        return 0
    from cppo_jax.checkpoint import CheckpointError
    from cppo_jax.stopping import SignalStopError
    from cppo_jax.trainer import NonFiniteError
    from cppo_jax.vllm_client import RolloutServerError

    try:
        run(cfg, log=print if distributed.is_main() else _quiet)
    except (ConfigError, FileNotFoundError) as e:
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
