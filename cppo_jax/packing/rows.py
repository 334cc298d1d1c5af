"""The device side of packed training rows (`trainer.pack`): the batch the step takes when the kept
sequences are packed (`cppo_jax.packing.pack`, on the host), and their completion log-probs.

Letters (docs/conventions.md): M kept sequences, C completion slots; locally R packed rows and L
tokens per row. Everything per sequence (mask, advantages, old/reference/behaviour log-probs)
stays [M, C] as in `step.Batch`: only the forward runs on [R, L], and its log-probs are gathered
back to [M, C] (`src_MC`), so the loss is `loss.policy_loss` unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cppo_jax.algo import loss as loss_lib
from cppo_jax.config.choices import ConfigError
from cppo_jax.packing import pack as packing
from cppo_jax.packing import plan as pack_plan
from cppo_jax.parallel.sharding import batch_sharding, data_parallel_size, gather_cast, use_mesh


class PackedBatch(NamedTuple):
    tokens_RL: jax.Array  # int32: the packed sequences (`packing.Packed`)
    segment_RL: jax.Array  # int32: sequence ids within a row, 0 padding
    positions_RL: jax.Array  # int32: RoPE positions, from 0 per sequence
    src_MC: jax.Array  # int32: flat index into the [R, L - 1] next-token log-probs
    mask_MC: jax.Array  # float32: completion tokens that count in the loss
    adv_M: jax.Array  # float32
    old_logp_MC: jax.Array | None
    ref_logp_MC: jax.Array | None
    behav_logp_MC: jax.Array | None = None


def packed_batch(packed, mask_MC, adv_M, old_logp_MC=None, ref_logp_MC=None, behav_logp_MC=None):
    """A `PackedBatch` of a host `packing.Packed` and the step's per-sequence arrays."""
    return PackedBatch(
        np.asarray(packed.tokens_RL, np.int32),
        np.asarray(packed.segment_RL, np.int32),
        np.asarray(packed.positions_RL, np.int32),
        np.asarray(packed.src_MC, np.int32),
        mask_MC,
        adv_M,
        old_logp_MC,
        ref_logp_MC,
        behav_logp_MC,
    )


def packed_completion_logps(model, batch: PackedBatch, spec, return_entropy: bool = False):
    """logp_MC (and entropy_MC with `return_entropy`) of the packed rows, as `step.completion_logps`
    gives them for the padded ones: one forward of the R rows (attention within each sequence),
    next-token log-probs at every slot, gathered to [M, C]. Slots past a completion's end read
    slot 0's value (finite; their loss weight is 0)."""
    seg_RL = batch.segment_RL
    h_RLD, _ = model.hidden(batch.tokens_RL, batch.positions_RL, seg_RL > 0, segment_BT=seg_RL)
    w_DV = gather_cast(
        model.unembed_weight(), ("embed", "vocab"), (None, "vocab"), model.cfg.compute_dtype
    )
    out = loss_lib.token_logps_from_hidden(
        h_RLD[:, :-1],
        w_DV,
        batch.tokens_RL[:, 1:],
        temperature=spec.temperature,
        chunk_size=spec.logp_chunk,
        return_entropy=return_entropy,
    )
    outs = out if return_entropy else (out,)
    gathered = tuple(jnp.take(x_RX.reshape(-1), batch.src_MC, axis=0) for x_RX in outs)
    return gathered if return_entropy else gathered[0]


class Packer:
    """The trainer's packing (`trainer.pack`): rows and length fixed for the run, the host packing of
    each step's kept sequences, and the jitted packed log-probs (reference / snapshot policies)."""

    def __init__(self, graphdef, spec, rows: int, length: int, mesh=None, seqs: int = 0):
        """`seqs`: the kept sequences M, whose split over a mesh's (data, fsdp) devices (the train
        step's batch layout) the R rows must share."""
        if jax.process_count() > 1:
            raise ConfigError(
                f"config key 'trainer.pack' = True is not supported with {jax.process_count()} "
                "trainer processes yet (the host packs the whole step); use trainer.pack=false"
            )
        if mesh is not None and seqs and batch_sharding(mesh, rows) != batch_sharding(mesh, seqs):
            raise ConfigError(
                f"config key 'trainer.pack_rows' = {rows} is invalid: allowed a row count split "
                f"over the mesh's data x fsdp devices as the {seqs} kept sequences are "
                f"({batch_sharding(mesh, seqs).spec}), e.g. a multiple of {data_parallel_size(mesh)}"
            )
        self.rows, self.length, self.prompt_len = rows, length, spec.prompt_len
        self.choice: pack_plan.RowChoice | None = None  # how R was chosen (`make`)
        self.overflow_steps = 0  # steps trained padded since the packer was built
        self.metrics: dict[str, float] = {}  # the last step's (`batch`), see docs/metrics.md
        # the train step's batch layout (rows over data x fsdp), given to the packed arrays
        self.sharding = None if mesh is None else batch_sharding(mesh, seqs or rows)

        def logps(params, batch):
            with use_mesh(mesh):
                return packed_completion_logps(nnx.merge(graphdef, params), batch, spec)

        self.logps = jax.jit(logps)  # (params, PackedBatch) -> logp_MC

    def _metrics(self, needed: int, overflow: bool) -> dict[str, float]:
        return {
            "pack/rows_needed": float(needed),
            "pack/overflow": float(overflow),
            "pack/overflow_steps": float(self.overflow_steps),
        }

    @classmethod
    def make(cls, trainer_cfg, shapes, graphdef, spec, mesh=None, lengths=None) -> Packer:
        """The packer of a run: R and L of `pack_plan.choice` (`lengths`: the run's data lengths,
        for `trainer.pack_rows=auto`; None: R = M); `choice` says how R was chosen."""
        dp = 1 if mesh is None else data_parallel_size(mesh)
        choice = pack_plan.choice(trainer_cfg, shapes, lengths, dp)
        packer = cls(graphdef, spec, choice.rows, choice.length, mesh, seqs=shapes.M)
        packer.choice = choice
        return packer

    def batch(self, tokens_MT, valid_MT, mask_MC, adv_M, log=None, step: int = 0):
        """The step's kept sequences packed (old / reference / behaviour log-probs unset), or None
        when they do not fit R rows of L: the step then trains on the padded batch (the padded
        programs, compiled the first time it happens; the same loss and gradient), logged as a
        `pack_overflow` event to `log` (a `RunLog`) and counted in `metrics`."""
        tokens_MT, valid_MT, mask_np = jax.device_get((tokens_MT, valid_MT, mask_MC))
        try:
            packed = packing.pack(
                tokens_MT, valid_MT, self.prompt_len, self.rows, self.length, mask_MC=mask_np
            )
        except packing.DoesNotFitError as e:
            self.overflow_steps += 1
            self.metrics = self._metrics(e.rows, overflow=True)
            if log is not None:
                log.event(
                    "pack_overflow",
                    step=step,
                    rows=self.rows,
                    rows_needed=e.rows,
                    longest=e.longest,
                )
            return None
        self.metrics = self._metrics(int(packed.row_M.max(initial=-1)) + 1, overflow=False)
        batch = packed_batch(packed, mask_MC, adv_M)
        if self.sharding is None:
            return batch
        placed = jax.device_put(batch[:4], self.sharding)
        return batch._replace(**dict(zip(PackedBatch._fields[:4], placed)))
