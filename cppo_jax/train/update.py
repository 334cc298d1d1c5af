"""Steps 4-7 of the trainer's step, after the rewards: how the trainer runs `after_rewards`' program.

`after_rewards(trainer, rollout, rewards_QG, sample_params, step, times)` updates the trainer's
params and optimizer state and returns the step's training metrics as floats. Two ways, both the
programs `programs.update_programs` builds (the ones `plan --compile-for` compiles):

- padded (the default): one program (`Actor.fused.update`: pruning, reference and snapshot
  log-probs, the mu updates) and one fetch of its metrics; timed as the phase `update`;
- packed (`trainer.pack`): the host packs the kept sequences between pruning and the forwards, so
  pruning is a program of its own (`Actor.fused.prune`), the packing fetches the kept tokens, and
  reference + snapshot + updates of the packed batch are one program; timed as `update`.

The steps of `trainer.profile_steps` run the same program: its phases are `jax.named_scope`s
(`prune`, `ref_logps`, `old_logps`, `update`), named in its HLO (dumped under the trace) and in the
trace's ops. Per-phase wall times need the phases as separate programs: `Trainer.phase_split` (the
benchmarks' and the tests' reference, the sequence the fused program equals,
tests/test_update_program.py) and a packed step whose kept sequences do not fit their rows run them.

Host round trips and programs per step are counted in docs/metrics.md ("One step's programs").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cppo_jax.algo import cppo
from cppo_jax.models.transformer import forward_copy
from cppo_jax.observe import profile as prof
from cppo_jax.parallel import distributed
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train.after_rewards import Rolled, pruning_key


def compile_ahead(trainer) -> dict:
    """Compile the program the first step runs after its rewards before any rollout exists, from the
    config's abstract arguments (`programs.build`: the shapes, dtypes and shardings the step's
    arguments will have, tests/test_programs.py), into the trainer's own jitted function, whose first
    call then compiles nothing. For a run whose rollout server is still loading (`train.loop`).
    Returns the `compiled_ahead` event's fields: the seconds spent (0 where the steps run the
    phases apart), and the error where it failed: it only saves time, so the run goes on without."""
    import time

    from cppo_jax.train import programs

    if trainer.phase_split:
        return {"seconds": 0.0}
    t0 = time.perf_counter()
    try:
        built = programs.build(trainer.cfg, jax.devices(), trainer.num_steps)  # the trainer's mesh
        _, args = built.programs["step"]
        trainer.actor.fused.update.lower(*args).compile()
    except Exception as e:  # the first step compiles it then, and says why if it cannot
        return {
            "seconds": round(time.perf_counter() - t0, 3),
            "error": f"{type(e).__name__}: {e}"[:400],
        }
    return {"seconds": round(time.perf_counter() - t0, 3)}


def fetch(metrics) -> dict:
    """The program's replicated metrics as floats: each process's first shard is the whole value."""
    m = jax.device_get(jax.tree.map(lambda x: x.addressable_data(0), metrics))
    return {k: float(v) for k, v in m.items()}


def rolled_of(trainer, rollout, rewards_QG) -> Rolled:
    """The rollout and rewards as the fused programs take them, in their declared layout."""
    s, mesh = rollout.samples, trainer.mesh
    sampler_logps = s.logp_NC if trainer.actor.sources.behav == "sampler" else None
    rolled = Rolled(
        distributed.rows(np.asarray(rewards_QG, np.float32), mesh),
        rollout.prompt_QP,
        rollout.pvalid_QP,
        s.tokens_NC,
        s.valid_NC,
        s.finished_N,
        sampler_logps,
    )
    at = trainer.actor.fused.rolled_sharding
    return rolled if at is None else jax.device_put(rolled, at)  # a no-op where they lie so


def _state_args(trainer, sample_params) -> tuple:
    """(ref_params, snap_params): the reference's own params (None at beta = 0 and with LoRA) and
    the snapshot that sampled (None unless the step needs it; the first step of a run sampled
    with the current params: a forward copy of them, so every step has the same program)."""
    actor, ref = trainer.actor, trainer.reference
    ref_params = ref.params if ref is not None and actor.frozen is None else None
    snap = None
    if actor.sources.needs_snapshot:
        dtype = actor.model_cfg.compute_dtype
        snap = sample_params if sample_params is not None else forward_copy(trainer.params, dtype)
    return ref_params, snap


def after_rewards(trainer, rollout, rewards_QG, sample_params, step: int, times: dict) -> dict:
    """Steps 4-7 (see the module docstring): new params and optimizer state; the metrics."""
    if trainer.phase_split:
        return _split(trainer, rollout, rewards_QG, sample_params, step, times)
    actor, mesh, tracer = trainer.actor, trainer.mesh, trainer.host.tracer
    rolled = rolled_of(trainer, rollout, rewards_QG)
    step_i32 = distributed.global_array(np.int32(step), mesh)
    ref_params, snap = _state_args(trainer, sample_params)
    if actor.packer is None:
        with prof.phase("update", times):
            args = (trainer.params, trainer.opt_state, step_i32, rolled, ref_params, snap)
            args = (*args, *actor.frozen_args)
            tracer.dump_hlo_once(actor.fused.update, args, "step")  # before donating
            trainer.params, trainer.opt_state, m = actor.fused.update(*args)
            return fetch(m)
    with prof.phase("update", times):
        pruned = actor.fused.prune(step_i32, rolled)
        packed = actor.packer.batch(
            pruned.tokens_MT, pruned.valid_MT, pruned.mask_MC, pruned.adv_M, trainer.host.log, step
        )
        if packed is not None:
            packed = packed._replace(behav_logp_MC=pruned.behav_logp_MC)
            args = (trainer.params, trainer.opt_state, packed, ref_params, snap)
            tracer.dump_hlo_once(actor.fused.update, args, "step")
            trainer.params, trainer.opt_state, m = actor.fused.update(*args)
            return {**fetch(m), **actor.packer.metrics}
    # The kept sequences do not fit R rows (`Packer.batch`): this step trains on the padded batch,
    # by the padded programs (the phases apart, compiled the first time it happens).
    return _split(trainer, rollout, rewards_QG, sample_params, step, times, pruned=pruned)


def _block(x):
    return jax.block_until_ready(x)


def _split(
    trainer, rollout, rewards_QG, sample_params, step: int, times: dict, pruned=None
) -> dict:
    """The phases as separate programs, each timed (see the module docstring). `pruned`: this
    step's pruning, already run (a packed step whose sequences do not fit its rows: trained on the
    padded batch)."""
    cfg, actor, s, host = trainer.cfg, trainer.actor, rollout.samples, trainer.host
    pack = pruned is None
    if pruned is None:
        pruned = cppo.prune(
            distributed.global_array(np.asarray(rewards_QG, np.float32), trainer.mesh),
            pruning_key(cfg.trainer.seed, step),
            rollout.prompt_QP,
            rollout.pvalid_QP,
            s.tokens_NC,
            s.valid_NC,
            s.finished_N,
            s.logp_NC if actor.sources.behav == "sampler" else None,
            shapes=trainer.shapes,
            algo=cfg.cppo,
            mesh=trainer.mesh,
        )
    tokens_MT, valid_MT = pruned.tokens_MT, pruned.valid_MT
    # 6. Reference log-probs, and the overlap snapshot's (the old policy's, or with cppo.tis_cap
    # the behaviour policy's: `logp_sources`), kept completions only. When the old policy is the
    # current one its log-probs come from the update's own forward, in the train step.
    src, ref, old, behav = actor.sources, None, None, pruned.behav_logp_MC
    packed = None
    if actor.packer is not None and pack:  # None: the step does not fit R rows, trained padded
        packed = actor.packer.batch(
            tokens_MT, valid_MT, pruned.mask_MC, pruned.adv_M, host.log, step
        )
    with prof.phase("ref_logps", times):
        if cfg.cppo.beta > 0:
            ref = _block(trainer.reference.logps_of(tokens_MT, valid_MT, packed))
    with prof.phase("old_logps", times):
        if src.needs_snapshot:  # the params that sampled (one update behind after step 1)
            sampled_by = trainer.params if sample_params is None else sample_params
            snap = _block(actor.logps_of(sampled_by, tokens_MT, valid_MT, packed))
            old = snap if src.old == "snapshot" else None
            behav = snap if src.behav == "snapshot" else behav
    sample_params = sampled_by = None  # the snapshot that sampled: not kept through the update

    # 7. mu updates, one program; its metrics (the last update's) fetched once.
    if packed is None:
        train_batch = step_lib.Batch(
            tokens_MT, valid_MT, pruned.mask_MC, pruned.adv_M, old, ref, behav
        )
    else:
        train_batch = packed._replace(old_logp_MC=old, ref_logp_MC=ref, behav_logp_MC=behav)
    args = (trainer.params, trainer.opt_state, train_batch, *actor.frozen_args)  # before donating
    host.tracer.dump_hlo_once(actor.train_step, args, "train_step")
    with prof.phase("update", times):
        trainer.params, trainer.opt_state, m = actor.train_step(*args)
        m = fetch(m)
    m["learning_rate"] = actor.learning_rate(trainer.opt_state)
    m["cppo/tokens_trained"] = float(distributed.to_host(jnp.sum(pruned.mask_MC)))
    return m if actor.packer is None else {**m, **actor.packer.metrics}
