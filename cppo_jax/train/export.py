"""A trained policy as a Hugging Face folder that transformers loads and vLLM serves as it is.

Every run ends with `<run>/export/` (the final policy); `best/` (validation) is written the same way;
`export_run` exports any checkpoint of a finished or stopped run (`python -m cppo_jax.export`).

A LoRA run's checkpoint holds adapters: they are merged into the starting folder's weights for
`export/`, and written as a PEFT adapter folder beside it (`export-adapter/`).

The folder keeps the starting checkpoint's config.json fields (eos/bos ids, rope scaling, ...), its
dtype (a bfloat16 checkpoint is exported in bfloat16) and its generation_config.json, with the tokenizer
files copied; weights above 5 GB are sharded with an index, as `save_pretrained` does.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
from flax import nnx

from cppo_jax.config.files import from_dict
from cppo_jax.config.schema import Config
from cppo_jax.models import lora_state
from cppo_jax.models.hf_io import load_hf, save_hf
from cppo_jax.models.hf_read import read_hf_config
from cppo_jax.models.peft_io import save_adapter
from cppo_jax.models.transformer import Transformer
from cppo_jax.train import optimizer as optimizer_lib
from cppo_jax.train.checkpoint import Checkpointer, CheckpointError

EXPORT_DIR = "export"
ADAPTER_DIR = "adapter"  # a LoRA run's adapters as a PEFT folder (models/peft_io.py)


def export_policy(
    graphdef, params, cfg: Config, out: str | Path, source: str | Path, **extra
) -> Path:
    """Write `params` (merged with `graphdef`) to `out` as a Hugging Face folder; `extra` goes into
    its config.json (e.g. the step). Every process calls it; process 0 writes."""
    return save_hf(
        nnx.merge(graphdef, params),
        out,
        extra_config=extra,
        tokenizer_dir=cfg.model.tokenizer or None,
        source_dir=source,
    )


def abstract_state(cfg: Config, source: str | Path) -> tuple[nnx.GraphDef, dict]:
    """The graph and the {params, opt_state} shapes a run's checkpoints hold, placed on one device
    (with LoRA: the adapted model's graph, and the adapters' shapes)."""
    model_cfg = read_hf_config(
        source,
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        scan_layers=cfg.model.scan_layers,
        attention=cfg.model.attention,
    )
    if cfg.model.lora.enabled:
        model_cfg = lora_state.transformer_config(model_cfg, cfg.model.lora)
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    if cfg.model.lora.enabled:
        graphdef, params, _ = lora_state.split(abstract)
    else:
        graphdef, params = nnx.split(abstract)
    opt_state = jax.eval_shape(optimizer_lib.make_optimizer(cfg.optim, 1).init, params)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)  # noqa: E731
    return graphdef, jax.tree.map(place, {"params": params, "opt_state": opt_state})


def export_run(
    run: str | Path,
    step: int | None = None,
    out: str | Path | None = None,
    source: str | Path | None = None,
) -> Path:
    """Export checkpoint `step` (default: the latest) of the run folder `run`; returns the folder.

    `source` is the Hugging Face folder the run started from (default: the run's
    `model.init_checkpoint`, else `model.path`)."""
    run = Path(run)
    config_file = run / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"--run {run}: no config.json there (not a run folder)")
    cfg = from_dict(json.loads(config_file.read_text()))
    src = Path(source or cfg.model.start_folder)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(
            f"the run's starting checkpoint {src} has no config.json (config key "
            "'model.init_checkpoint' / 'model.path'); pass --source FOLDER"
        )
    ckpt = Checkpointer(run / "checkpoints")
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise CheckpointError(f"--run {run}: no checkpoint under {ckpt.directory}")
        if step is not None and step not in steps:
            raise CheckpointError(f"--step {step}: not a checkpoint of {run} (there are {steps})")
        step = steps[-1] if step is None else step
        graphdef, abstract = abstract_state(cfg, src)
        state, _ = ckpt.restore(step, abstract)
    finally:
        ckpt.close()
    if out is None:
        out = run / (EXPORT_DIR if step == steps[-1] else f"{EXPORT_DIR}-step{step}")
    params = state["params"]
    if cfg.model.lora.enabled:  # the adapters merged into the base; and the PEFT folder beside
        base = load_hf(src, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
        model_cfg = nnx.merge(graphdef, params, nnx.state(base)).cfg
        save_adapter(params, model_cfg, Path(out).with_name(Path(out).name + "-adapter"), src)
        params = lora_state.merge_weights(params, nnx.state(base), model_cfg)
        graphdef = nnx.graphdef(base)
    return export_policy(graphdef, params, cfg, out, src, cppo_step=step)
