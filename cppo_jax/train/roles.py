"""A run's roles, each built from the config by its own function, one job each (after tunix's
`RLCluster` and nanodo's `TrainState`):

  Data       the prompts: tokenizer, train/validation/test sets, question order, GRESO skipper
  Actor      the trained policy's programs: the compiled train step and log-probs, the optimizer,
             with LoRA the frozen base, the adapted model's state (adapters unmerged on it: the
             embedded sampler's) and the merge into plain weights, the packer (`trainer.pack`)
  Reference  the reference policy (beta > 0): its forward-only weights and their log-probs
  Rollout    the sampler: the backend (embedded or vLLM) and its weight push
  Host       the run's host side: run folder, reward pool, log, checkpoints, profiler

The roles are frozen: what changes during a run (params, optimizer state, counters) is the trainer's
(`Trainer.params`, `Trainer.opt_state`), passed to the roles' functions. `build(cfg)` builds them in
the order a run needs; a test can call each `build_<role>` alone. Letters as in docs/conventions.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
from flax import nnx

from cppo_jax.algo import cppo
from cppo_jax.algo.logp_sources import LogpSources
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import save_config
from cppo_jax.config.schema import Config
from cppo_jax.data import prompt_batches as pipeline
from cppo_jax.data import skipping as skip_lib
from cppo_jax.models import Tokenizer, load_hf
from cppo_jax.models import lora_state as lora_lib
from cppo_jax.models.transformer import forward_copy
from cppo_jax.observe import profile as prof
from cppo_jax.observe.runlog import RunLog, wandb_settings
from cppo_jax.packing import plan as pack_plan
from cppo_jax.packing.rows import PackedBatch, Packer
from cppo_jax.parallel import distributed
from cppo_jax.parallel import sharding as sharding_lib
from cppo_jax.rewards.pool import RewardPool
from cppo_jax.rewards.registry import TASK_EVAL, display_name
from cppo_jax.rollout.backend import make_backend
from cppo_jax.rollout.draw import StepRollout, draw_rollout
from cppo_jax.train import after_rewards, programs
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train import optimizer as optimizer_lib
from cppo_jax.train.checkpoint import Checkpointer, holds_a_run, set_aside_earlier_run


def check_vocab(tokenizer: Tokenizer, model_vocab: int, model_path: str) -> None:
    """Refuse a tokenizer with ids the model has no embedding for (the model may have more rows)."""
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids but the model {model_path} "
            f"has vocab_size {model_vocab}: they do not belong together (check model.tokenizer and "
            f"model.path / model.init_checkpoint)"
        )


@dataclasses.dataclass(frozen=True)
class Data:
    """The prompts of a run and which questions each step draws."""

    tokenizer: Tokenizer
    train_set: pipeline.PromptSet
    val_set: pipeline.PromptSet | None
    test_set: pipeline.PromptSet
    stats: dict  # skipped rows, cut prompts
    order: object  # [steps, Q] question ids (`pipeline.question_order`)
    skipper: skip_lib.PromptSkipper | None  # GRESO skipping (`data.skip`)
    num_steps: int

    def ids(self, step: int):
        """The training questions of `step` (the skipper's, when it skips)."""
        return self.order[step] if self.skipper is None else self.skipper.ids(step)


def build_data(cfg: Config, shapes: cppo.Shapes, tokenizer: Tokenizer) -> Data:
    sets = pipeline.load_prompt_sets(cfg.data, tokenizer, shapes.P, cfg.trainer.eval_size)
    n = len(sets.train)
    order = pipeline.question_order(n, shapes.Q, cfg.data.seed, cfg.data.shuffle)
    skipper = skip_lib.PromptSkipper.from_config(cfg.data, n, shapes.Q)
    num_steps = cfg.trainer.steps or pipeline.steps_per_epoch(n, shapes.Q)
    return Data(tokenizer, sets.train, sets.val, sets.test, sets.stats, order, skipper, num_steps)


def load_model(cfg: Config, path: str, mesh, tokenizer: Tokenizer) -> nnx.Module:
    """The model the run starts from, its params sharded over `mesh` by the rules."""
    model = load_hf(
        path,
        dtype=cfg.model.dtype,
        mesh=mesh,
        param_dtype=cfg.model.param_dtype,
        remat=cfg.model.remat,
        scan_layers=cfg.model.scan_layers,
        attention=cfg.model.attention,
    )
    check_vocab(tokenizer, model.cfg.vocab_size, path)
    return model


@dataclasses.dataclass(frozen=True)
class Actor:
    """The trained policy's programs; its state (params, opt_state) is passed in."""

    graphdef: nnx.GraphDef  # the model without adapters: the sampler's, evaluation's, exports'
    train_graphdef: nnx.GraphDef  # the trained model's (with LoRA: with the adapters)
    model_cfg: object  # its TransformerConfig (with LoRA: with the adapters)
    model_path: str  # the Hugging Face folder the run starts from (exports keep its fields)
    tx: object  # the optimizer
    lr_fn: Callable  # update count -> learning rate
    spec: step_lib.StepSpec
    sources: LogpSources  # where the old and behaviour log-probs come from
    train_step: Callable  # (params, opt_state, batch, *frozen_args) -> (params, opt_state, metrics)
    logps: Callable  # (params, tokens_MT, valid_MT, *frozen_args) -> logp_MC
    packer: Packer | None  # trainer.pack: the kept sequences trained in packed rows
    frozen: object | None  # LoRA: the base, frozen in the compute dtype (`lora_lib.split`)
    merge: Callable | None  # LoRA: (adapters, base, model_cfg) -> merged weights, jitted
    fused: after_rewards.Compiled | None = None  # steps 4-7 after rewards (`after_rewards`)

    @property
    def frozen_args(self) -> tuple:
        """What `train_step` and `logps` take after their arguments: the frozen base with LoRA."""
        return () if self.frozen is None else (self.frozen,)

    def policy_params(self, params):
        """`params` as weights of `graphdef`: themselves, or with LoRA the base with the adapters
        merged in (W + s A B, in the compute dtype), for a vLLM server's merged pushes and exports."""
        return params if self.merge is None else self.merge(params, self.frozen, self.model_cfg)

    def adapted_params(self, params):
        """`params` as weights of `train_graphdef`: themselves, or with LoRA the adapters beside the
        frozen base, unmerged (the model computes W x + s (x A) B, as the train step and vLLM do).
        The embedded sampler's: a merge rounds W + s A B to the compute dtype, which in bfloat16
        loses every update under half an ulp of W, so the sampler would draw from the base while the
        loss takes its samples as on-policy. No copy of the weights is made."""
        return params if self.frozen is None else nnx.merge_state(params, self.frozen)

    def logps_of(self, params, tokens_MT, valid_MT, packed: PackedBatch | None = None):
        """`params`' completion log-probs of the kept sequences (of the packed rows when given)."""
        if packed is not None:  # trainer.pack (refused with LoRA by the config)
            return self.packer.logps(params, packed)
        return self.logps(params, tokens_MT, valid_MT, *self.frozen_args)

    def learning_rate(self, opt_state) -> float:
        """The learning rate of the last update applied (TRL's `learning_rate`)."""
        applied = int(distributed.to_host(optimizer_lib.update_count(opt_state)))
        return float(self.lr_fn(max(applied - 1, 0)))


def build_actor(
    cfg: Config, model, shapes: cppo.Shapes, mesh, num_steps: int, model_path: str, data=None
):
    """(actor, params, opt_state): the actor of `model` and its initial trained state (with LoRA
    the adapters, fresh; the base goes into the actor, frozen). `data` (a `Data`): the lengths
    `trainer.pack_rows=auto` chooses R by (`pack_plan`)."""
    graphdef, params = nnx.split(model)
    train_graphdef, frozen, merge = graphdef, None, None
    if cfg.model.lora.enabled:
        model = lora_lib.with_adapters(model, cfg.model.lora, seed=cfg.trainer.seed)
        train_graphdef, params, base = lora_lib.split(model)
        params = sharding_lib.shard_params(params, mesh)
        frozen = lora_lib.cast(base, model.cfg.compute_dtype)
        del base
        merge = jax.jit(lora_lib.merge_weights, static_argnums=2)
    packer = None
    if cfg.trainer.pack:
        auto = cfg.trainer.pack_rows == "auto" and data is not None
        lengths = pack_plan.data_lengths(data.train_set, data.tokenizer, shapes.C) if auto else None
        spec = programs.step_spec(cfg, shapes)
        packer = Packer.make(cfg.trainer, shapes, graphdef, spec, mesh, lengths)
    graphdefs = (train_graphdef, graphdef)
    up = programs.update_programs(cfg, shapes, mesh, graphdefs, params, frozen, packer, num_steps)
    tx, lr_fn, spec, sources, train_step, logps, fused = up
    opt_state = sharding_lib.init_opt_state(tx, params, mesh)
    actor = Actor(
        graphdef,
        train_graphdef,
        model.cfg,
        model_path,
        tx,
        lr_fn,
        spec,
        sources,
        train_step,
        logps,
        packer,
        frozen,
        merge,
        fused,
    )
    return actor, params, opt_state


@dataclasses.dataclass(frozen=True)
class Reference:
    """The reference policy of the KL term: fixed weights and their log-prob program."""

    params: object  # forward-only copy of the initial params; with LoRA the actor's frozen base
    logps: Callable  # (params, tokens_MT, valid_MT) -> logp_MC
    packed_logps: Callable | None  # trainer.pack: (params, PackedBatch) -> logp_MC

    def logps_of(self, tokens_MT, valid_MT, packed: PackedBatch | None = None):
        """The reference policy's completion log-probs of the kept sequences: the initial model's,
        which with LoRA is the base with the adapters off (no copy of it is kept)."""
        if packed is not None:
            return self.packed_logps(self.params, packed)
        return self.logps(self.params, tokens_MT, valid_MT)


def build_reference(
    cfg: Config, actor: Actor, params, shapes: cppo.Shapes, mesh
) -> Reference | None:
    """The reference of `params`, the initial ones (call it before any update); None at beta = 0."""
    if cfg.cppo.beta <= 0:
        return None
    if actor.frozen is not None:  # the base's log-probs (adapters off): its own program
        _, base_logps = step_lib.compiled(
            actor.graphdef, actor.tx, actor.spec, mesh, actor.frozen, shapes.M
        )
        return Reference(actor.frozen, base_logps, None)
    ref_params = forward_copy(params, actor.model_cfg.compute_dtype)  # forwards only
    packed = actor.packer.logps if actor.packer is not None else None
    return Reference(ref_params, actor.logps, packed)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The sampler of the run: draws a step's completions, takes the policy's new weights."""

    backend: object  # `rollout.backend.RolloutBackend`: embedded sampler or vLLM server
    sp: object  # its sampling settings (`programs.sampling_params`)
    mesh: object
    seed: int
    G: int
    unmerged: bool = False  # LoRA, embedded: the sampler runs the adapters unmerged on the base

    def weights(self, actor: Actor, params):
        """The trained `params` as the backend's weights: the adapted model's (adapters unmerged,
        `Actor.adapted_params`) when `unmerged`, else the plain model's (`Actor.policy_params`)."""
        return actor.adapted_params(params) if self.unmerged else actor.policy_params(params)

    def draw(self, weights, data: Data, step: int) -> StepRollout:
        """`step`'s questions and G completions each sampled from `weights` (`graphdef`'s)."""
        ids = data.ids(step)
        return draw_rollout(
            self.backend, weights, data.train_set, ids, step, self.seed, self.G, self.mesh
        )

    def push(self, weights, step: int) -> dict:
        """The policy's weights after `step` updates into the backend; returns its metrics."""
        return self.backend.sync_weights(weights, step)

    def wait_ready(self) -> None:
        """Return once the backend can sample: a vLLM server still loading is waited for."""
        self.backend.wait_ready()


def build_rollout(
    cfg: Config,
    shapes: cppo.Shapes,
    tokenizer: Tokenizer,
    graphdef,
    out_dir: Path,
    mesh,
    actor=None,
) -> Rollout:
    """The rollout of `graphdef`'s weights; given the `actor`, the embedded sampler of a LoRA run
    runs its adapted model instead (`train_graphdef`: adapters unmerged, `Actor.adapted_params`)."""
    unmerged = actor is not None and actor.frozen is not None and cfg.rollout.backend == "embedded"
    if unmerged:
        graphdef = actor.train_graphdef
    sp = programs.sampling_params(cfg, shapes, tokenizer.stop_ids, tokenizer.pad_id)
    if cfg.rollout.overlap and jax.process_count() > 1:
        # The background rollout would run process 0's broadcasts beside the step's collectives.
        raise ConfigError(
            f"config key 'rollout.overlap' = 1 is not supported with {jax.process_count()} "
            "trainer processes yet; use rollout.overlap=0"
        )
    backend = make_backend(cfg.rollout, graphdef, sp, out_dir, mesh=mesh)
    return Rollout(backend, sp, mesh, cfg.trainer.seed, shapes.G, unmerged)


def run_folder(cfg: Config) -> tuple[Path, Path | None]:
    """(folder, earlier): the run's folder, made, with its config.json; an earlier run found there
    is moved to `earlier` unless the run resumes it."""
    out_dir = Path(cfg.trainer.out_dir).resolve() / cfg.trainer.run_name
    earlier = None
    if not cfg.trainer.resume and holds_a_run(out_dir):
        if jax.process_count() > 1:  # the processes share the folder: none may move it alone
            raise ConfigError(
                f"run folder {out_dir} holds an earlier run: set trainer.resume=true to "
                "continue it, or choose another trainer.run_name"
            )
        earlier = set_aside_earlier_run(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"config key 'trainer.out_dir' = {cfg.trainer.out_dir!r}: cannot create the run "
            f"folder {out_dir}: {type(e).__name__}: {e.strerror or e}"
        ) from e
    if distributed.is_main():
        save_config(cfg, out_dir / "config.json")
    return out_dir, earlier


@dataclasses.dataclass(frozen=True)
class Host:
    """The run's host side: its folder, the reward workers, the log, checkpoints, profiler."""

    out_dir: Path
    earlier_run: Path | None  # where an earlier run in this folder was moved (a fresh run)
    main: bool  # process 0 writes logs and exports
    rewards: RewardPool  # the training rewards, plus each evaluation rule (run when evaluating)
    train_fns: list[str]  # the training rewards' names
    eval_rules: dict[str, Callable]  # "eval/<rule>" -> reward function
    accuracy_fn: Callable  # the rule that says a completion is correct (GRESO, metrics)
    log: RunLog
    ckpt: Checkpointer
    tracer: prof.Tracer


def build_host(cfg: Config, out_dir: Path, earlier_run: Path | None, data: Data) -> Host:
    # Metrics name a reward by its registered name, else by its function's name (as TRL).
    funcs = [(display_name(f), w, f) for f, w in zip(cfg.reward.funcs, cfg.reward.weights)]
    eval_rules = {f"eval/{rule}": fn for rule, fn in TASK_EVAL[cfg.data.task].items()}
    rewards = RewardPool(
        funcs + [(name, 0.0, fn) for name, fn in eval_rules.items()],
        num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s,
    )
    main = distributed.is_main()
    wandb = wandb_settings(cfg) if cfg.logging.wandb else None
    log = RunLog(out_dir, tensorboard=cfg.logging.tensorboard, write=main, wandb=wandb)
    if earlier_run is not None:
        log.event("earlier_run_moved", to=str(earlier_run))
    log.event("data", train=len(data.train_set), **data.stats)  # skipped, cut prompts
    ckpt = Checkpointer(out_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints)
    tracer = prof.Tracer(out_dir, cfg.trainer.profile_steps)
    accuracy_fn = pipeline.ACCURACY_REWARD[cfg.data.task]
    names = [name for name, _, _ in funcs]
    return Host(
        out_dir, earlier_run, main, rewards, names, eval_rules, accuracy_fn, log, ckpt, tracer
    )


class Roles(NamedTuple):
    shapes: cppo.Shapes
    mesh: jax.sharding.Mesh
    data: Data
    actor: Actor
    reference: Reference | None
    rollout: Rollout
    host: Host
    params: object  # the actor's initial trained state
    opt_state: object


def build(cfg: Config, model_path: str | Path | None = None) -> Roles:
    """Every role of a run of `cfg`, in order: folder, tokenizer, mesh, model, data, actor,
    reference, rollout, host. `model_path` overrides the model the run starts from."""
    out_dir, earlier = run_folder(cfg)
    shapes = cppo.shapes_of(cfg)
    path = str(model_path or cfg.model.init_checkpoint or cfg.model.path)
    tokenizer = Tokenizer.from_dir(cfg.model.tokenizer or path)
    # The mesh: questions split whole over (data, fsdp); params sharded by the rules.
    mesh = sharding_lib.make_mesh(cfg.mesh)
    sharding_lib.check_questions(shapes.Q, mesh)
    model = load_model(cfg, path, mesh, tokenizer)
    data = build_data(cfg, shapes, tokenizer)
    actor, params, opt_state = build_actor(cfg, model, shapes, mesh, data.num_steps, path, data)
    del model
    reference = build_reference(cfg, actor, params, shapes, mesh)
    rollout = build_rollout(cfg, shapes, tokenizer, actor.graphdef, out_dir, mesh, actor)
    host = build_host(cfg, out_dir, earlier, data)
    if actor.packer is not None:  # how R was chosen (trainer.pack_rows=auto: from the data)
        packer = actor.packer
        host.log.event(
            "pack_rows", rows=packer.rows, length=packer.length, note=packer.choice.note(shapes.M)
        )
    return Roles(shapes, mesh, data, actor, reference, rollout, host, params, opt_state)
