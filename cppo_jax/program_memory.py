"""The plan's figure for each compiled program of a step: what `plan --compile-for` sets beside the
compiler's.

`program_bytes(cfg, mesh)` is, per device, the total (arguments + temporaries) of the train step, the
reference log-probs and the embedded sampler, as the TPU compiler lays them out. Its terms were read
from the compiler's buffer assignment of Qwen2.5-1.5B's step on v5e-8 (`xla_dump_to`'s memory-usage
report) and are checked against every compile in benchmarks/results/aot_tpu.md:

- compute-dtype copies: each program casts the layers' shard once (when the params' dtype differs)
  and gathers the unembedding whole over fsdp (split over tensor) in the compute dtype;
- train step: params, AdamW state and the whole batch; the gradient (x2 with micro-batches) and the
  logits chunk of `layout.memory_plan`; what the remat policy keeps of every layer (`full`: its
  input; `minimal`: the projections' outputs too; `dots_saveable`: attention's float32 scores and
  output too) and one layer's three float32 score buffers and MLP products rebuilt in the backward
  (`save_all`: the plan's activations);
  with fsdp > 1, the unembedding gathered whole in the compute dtype, its whole gradient and that
  gradient summed over devices, both in the compute dtype (a float32 embedding is looked up in
  its shard: `sharding.gather_cast`, `Transformer.hidden`); two float32 vocabulary-sized
  gradient buffers (the lookup's and the unembedding's, before they are summed);
- a log-prob forward (reference): its params (a compute-dtype copy) and tokens for all the step's
  rows, one layer's float32 score buffer and MLP products, the logits of one chunk, and with
  fsdp > 1 each vocabulary matrix gathered whole (a compute-dtype table is looked up gathered);
- the embedded sampler: its params, the compute-dtype copy of its shard (the layers and, twice, the
  vocabulary matrix: lookup and logits), the completion keys/values of every cache segment (the
  cache grows by copying into a segment twice as long, and each segment's buffer stays assigned:
  about 1.94x the final cache at C = 1024) and two float32 [N, V] logits buffers.

`run_peak` adds the run's state alive beside each program (the AdamW state while sampling, the
reference during the update) and takes the largest: what `aot_fit` picks a mesh by.
"""

from __future__ import annotations

from cppo_jax import layout
from cppo_jax.layout import _BYTES, _param_shapes, _shard_bytes, _split
from cppo_jax.rollout.segments import SEGMENT_LEN, segment_ends

VOCAB = ("embed_VD", "lm_head_DV")  # the vocabulary matrices' parameter paths


def program_bytes(cfg, tcfg, shapes, mesh: dict[str, int]) -> dict[str, int]:
    """Per-device bytes of each program of a step of `cfg` (see the module docstring)."""
    kw = layout.plan_kwargs(cfg, shapes, None)
    plan = layout.memory_plan(tcfg, mesh, **kw)
    axis = plan.mesh
    dp, tp, fsdp = axis["data"] * axis["fsdp"], axis["tensor"], axis["fsdp"]
    pb, cb = _BYTES[tcfg.param_dtype], _BYTES[tcfg.dtype]
    D, L, E = tcfg.hidden_size, tcfg.num_layers, tcfg.head_dim
    H, J = _split(tcfg.num_heads, tp), _split(tcfg.num_kv_heads, tp)
    F, V = _split(tcfg.intermediate_size, tp), _split(tcfg.vocab_size, tp)
    T, C, n = plan.tokens, shapes.C, plan.rows
    params_shapes = _param_shapes(tcfg)
    vocab_shard = sum(
        _shard_bytes(shape, names, axis, pb)
        for path, shape, names in params_shapes
        if path[0] in VOCAB
    )
    layers_copy = (plan.params - vocab_shard) * cb // pb if pb != cb else 0
    vocab_c = V * D * cb  # one vocabulary matrix whole over fsdp, in the compute dtype
    # The unembedding gathered in the compute dtype, its gradient whole and that gradient's sum
    # over devices (the embedding is looked up in its shard); without fsdp the cast and gradient.
    vocab_train = 3 * vocab_c if fsdp > 1 else 2 * vocab_c
    # Two float32 vocabulary matrices (of the shard) beyond the parameter's own gradient: the
    # lookup's gradient scattered in float32 and the unembedding's cast to float32 before they are
    # summed (read from the buffer assignment of the 1.5B step on v5p-8, and within 5% of the
    # compiler for the 1.5B on fsdp = 2 and 4; the untied 7B on fsdp = 8 holds more: 0.82).
    vocab_train += 2 * V * D * 4 // fsdp
    n_all = _split(shapes.M, dp) if shapes.M % dp == 0 else shapes.M
    row = (T + 1) * 5 + C * 4 * 3 + 4  # tokens, valid, mask, old, ref, adv
    if cfg.trainer.pack:  # R rows: tokens, segments, positions; the M sequences' [C] arrays
        n_all, row = n, (T + 1) * 12 + (C * 4 * 4 + 4) * n_all // max(n, 1)
    # Per token and layer, what the remat policy keeps for the backward (read from the compiler's
    # buffer assignment): the layer's input (full); the projections' outputs too (minimal: gate,
    # up, q, o, down, k, v); attention's float32 scores and its output too (dots_saveable). Plus
    # the backward's work on one layer: three float32 score buffers and two MLP products.
    kept = {"full": cb * D, "minimal": cb * (2 * D + H * E + 2 * F + 2 * J * E)}
    # Attention's [T, T] float32 scores per query token and head (none with the splash kernel,
    # which walks blocks and keeps one float32 log-sum-exp per query and head).
    scores = 4 * T if tcfg.attention != "splash" else 4
    kept["dots_saveable"] = kept["minimal"] + H * scores + cb * H * E
    if tcfg.remat in kept:
        activations = n * T * (L * kept[tcfg.remat] + 3 * H * scores + 2 * cb * F)
    else:  # save_all: not compiled at these sizes; the plan's (CPU-fitted) estimate
        activations = plan.activations_no_remat
    out = {
        "train_step": 3 * plan.params
        + n_all * row
        + plan.grads
        + plan.logits_chunk
        + activations
        + vocab_train
        + layers_copy
    }
    if cfg.cppo.beta > 0:
        logits = plan.logits_chunk // 3 * n_all // max(n, 1)  # one chunk of logits, all rows
        # One float32 score buffer [rows, H, T, T] (the softmax is computed in place of the
        # scores; read from the compiles of 7B and of tensor-parallel layouts) and two MLP products.
        forward = n_all * T * (H * scores + 2 * F * cb) + logits
        # fsdp > 1 gathers the (compute-dtype) vocabulary matrix whole; else the copy is already it.
        # (each vocabulary matrix once: an untied model gathers the embedding for the lookup too)
        mats = sum(1 for path, _, _ in params_shapes if path[0] in VOCAB)
        gathered_c = mats * vocab_c if fsdp > 1 else 0
        out["ref_logps"] = plan.reference + n_all * (T + 1) * 5 + forward + gathered_c
    if cfg.rollout.backend == "embedded":
        rows = shapes.Q * shapes.G
        N = _split(rows, dp) if rows % dp == 0 else rows
        # Keys and values of every cache segment: the compiler keeps each segment's buffer, not
        # only the one being grown into (`segments.segment_ends`: 64 + 128 + ... + C slots).
        slots = sum(segment_ends(C, SEGMENT_LEN)) if C > 1 else 0
        kv = 2 * L * J * E * slots * N * cb
        vocab_copy = 2 * vocab_shard * cb // pb if pb != cb else 0  # the lookup's and the logits'
        out["sampler"] = plan.params + layers_copy + vocab_copy + kv + 2 * N * V * 4
    return out


def resident_bytes(cfg, tcfg, shapes, mesh: dict[str, int]) -> dict[str, int]:
    """The state a run keeps through a step, per device: params, AdamW state, the reference and
    the overlap snapshot (compute-dtype copies)."""
    plan = layout.memory_plan(tcfg, mesh, **layout.plan_kwargs(cfg, shapes, None))
    out = {"params": plan.params, "opt_state": plan.opt_state}
    if plan.reference:
        out["reference"] = plan.reference
    if plan.snapshot:
        out["snapshot"] = plan.snapshot
    return out


ARGS_OF = {  # the resident state each program takes as arguments (the rest is alive beside it)
    "train_step": ("params", "opt_state"),
    "ref_logps": ("reference",),
    "old_logps": ("snapshot",),
    "sampler": ("params",),
}


def run_peak(cfg, tcfg, shapes, mesh: dict[str, int]) -> int:
    """The largest of the programs' totals plus the state beside each (see the module docstring)."""
    programs = program_bytes(cfg, tcfg, shapes, mesh)
    resident = resident_bytes(cfg, tcfg, shapes, mesh)
    return max(
        total + sum(b for k, b in resident.items() if k not in ARGS_OF[name])
        for name, total in programs.items()
    )
