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
  output too) and, for the one layer rebuilt in the backward, its three float32 score buffers,
  its compute-dtype probabilities, six MLP-wide and eleven hidden-wide buffers per token
  (`save_all`: the plan's activations);
  with fsdp > 1, the unembedding gathered whole in the compute dtype, its whole gradient and that
  gradient summed over devices, both in the compute dtype (a float32 embedding is looked up in
  its shard: `sharding.gather_cast`, `Transformer.hidden`); two float32 vocabulary-sized
  gradient buffers (the lookup's and the unembedding's, before they are summed);
- a log-prob forward (reference): its params (a compute-dtype copy) and tokens for all the step's
  rows, one layer's float32 score buffer (two on v5e), float32 queries and MLP products, the
  logits of one chunk, and with fsdp > 1 each vocabulary matrix gathered whole (a compute-dtype
  table is looked up gathered; on v6e outside the layer loop, so the larger of the two counts);
- the embedded sampler: its params, the compute-dtype copy of its shard (the layers and, twice, the
  vocabulary matrix: lookup and logits), the completion keys/values of every cache segment (the
  cache grows by copying into a segment twice as long, and each segment's buffer stays assigned:
  about 1.94x the final cache at C = 1024; its key/value heads split with the query heads,
  `_sampler_kv_heads`) and two float32 [N, V] logits buffers.

Where generations' compilers differ (`REF_SCORE_BUFFERS`, `GATHERS_APART`), `target` (the topology
`--compile-for` names) picks the terms; without one the plan counts as for v5p and v4.

`run_peak` adds the run's state alive beside each program (the AdamW state while sampling, the
reference during the update) and takes the largest. `run_plan` is `layout.memory_plan`'s terms with
these programs and that peak: the one plan that the launch's `mesh=auto`, `plan`, `plan --pick-mesh`,
`gpu_node.sh` and `aot.fit` judge a layout by (`pick_mesh`, `fit_advice`); where a compiler is
installed, `plan --compile-for` sets the compiler's own figure beside it and judges by that.

The constants above were read from the compilers named in `CALIBRATED_WITH`; `calibration_note` says
whether the compiler at hand is that one, or that the plan is unchecked for it.
"""

from __future__ import annotations

import dataclasses

from cppo_jax.config.choices import BF16_MIN_LR
from cppo_jax.planning import memory as layout
from cppo_jax.planning.gpu_targets import GPUS
from cppo_jax.planning.memory import (
    _BYTES,
    MemoryPlan,
    _gib,
    _param_shapes,
    _shard_bytes,
    _split,
    mesh_overrides,
)
from cppo_jax.rollout.embedded.segments import SEGMENT_LEN, compact_buckets, segment_ends

VOCAB = ("embed_VD", "lm_head_DV")  # the vocabulary matrices' parameter paths

# Where TPU generations' compilers (libtpu 0.0.42) lay out the same log-prob forward differently,
# read from the buffer assignments (`xla_dump_to`) of the reference program:
# - float32 [rows, H, T, T] score buffers alive at once: v5e keeps two, adjacent in its heap (the
#   1.5B at mesh 2/4/1: 2 x f32[2,2,6,1535,1535]; at 1/1/8: 2 x f32[16,2,6,1535,1535]; the 7B at
#   1/8/1: 2 x f32[6,4,7,1535,1535]); v6e, v5p and v4 one (the softmax written over the scores).
REF_SCORE_BUFFERS = {"v5e": 2}
# - with fsdp > 1, v6e gathers the vocabulary matrices outside the layer loop: the 7B's peak on
#   v6e at 1/8/1 is the gathered embedding and its relaid copy (2 x bf16[152064,3584]) beside the
#   params, with no score buffer alive; v5e, v5p and v4 keep the gathered matrices through the loop
#   (v5e's 7B heap at 1/8/1 holds both gathered matrices and both score buffers at disjoint offsets).
GATHERS_APART = ("v6e",)
# XLA:GPU writes the reference's softmax output in float32 (4 bytes) or bf16 (2) by its cost model,
# case by case (see `program_bytes`); the plan counts a value between: 4 + 2.6 bytes per score
# against 6 and 8, 10% over the bf16 choice and 17.5% under the float32 one on that term.
GPU_SOFTMAX_BYTES = 2.6
TPU_LANES = 128  # a TPU vector register's minor dimension: narrower minor dimensions are padded
# The compilers (distribution, version) whose buffer assignments the terms and constants of this
# module were read from, and checked against in benchmarks/results/aot_tpu.md and aot_gpu.md.
CALIBRATED_WITH = {"tpu": ("libtpu", "0.0.42.1"), "gpu": ("jax-cuda12-plugin", "0.10.2")}
# Device kinds (as JAX reports them, lower case) to the generation whose terms they take.
_TPU_KINDS = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6", "v6e"), ("v5", "v5p"), ("v4", "v4"))


def planned_model(cfg):
    """The TransformerConfig the programs of `cfg` are built for: the model's, with `model.lora`'s
    adapters when enabled (`programs.model_config` gives the base's alone)."""
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.models.known import config_model_size, transformer_config

    size = config_model_size(cfg)
    if size is None:
        raise ConfigError(
            f"model.path={cfg.model.path!r}: no config.json there and no known model name, so its "
            f"programs cannot be planned"
        )
    tcfg = transformer_config(cfg, size)
    if not cfg.model.lora.enabled:
        return tcfg
    from cppo_jax.models import lora_state

    return lora_state.transformer_config(tcfg, cfg.model.lora)


def program_bytes(cfg, tcfg, shapes, mesh: dict[str, int], target: str = "") -> dict[str, int]:
    """Per-device bytes of each program of a step of `cfg` (see the module docstring) compiled
    for `target` (a topology name, `v5e:2x4`: its generation picks the terms that differ)."""
    generation = target.split(":")[0]
    gpu = generation in GPUS  # XLA:GPU's buffer assignment differs where `gpu` is tested below
    # libtpu's, where `narrow` is: heads narrower than a TPU's lanes (no target counts as a TPU's;
    # `cpu`, XLA:CPU's compile, keeps the terms read before the lanes were)
    tpu = generation not in GPUS and generation != "cpu"
    narrow = tpu and tcfg.head_dim < TPU_LANES
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
    lora = bool(plan.frozen)  # the params are the adapters; the base is frozen in the compute dtype
    layers_copy = (plan.params - vocab_shard) * cb // pb if pb != cb and not lora else 0
    vocab_c = V * D * cb  # one vocabulary matrix whole over fsdp, in the compute dtype
    # The unembedding gathered in the compute dtype, its gradient whole and that gradient's sum
    # over devices (the embedding is looked up in its shard); without fsdp the cast and gradient.
    vocab_train = 3 * vocab_c if fsdp > 1 else 2 * vocab_c
    # Two float32 vocabulary matrices (of the shard) beyond the parameter's own gradient: the
    # lookup's gradient scattered in float32 and the unembedding's cast to float32 before they are
    # summed (read from the buffer assignment of the 1.5B step on v5p-8, and within 5% of the
    # compiler for the 1.5B on fsdp = 2 and 4; the untied 7B on fsdp = 8 holds more: 0.82).
    vocab_train += 2 * V * D * 4 // fsdp
    if lora:  # a frozen vocabulary: no gradient of it; with fsdp > 1 the matrix gathered for use
        vocab_train = vocab_c if fsdp > 1 else 0
        if gpu:  # XLA:GPU casts the frozen unembedding to float32 for the logits' backward and
            # keeps its relaid compute-dtype copy (f32[1536,151936] and bf16[1536,151936] in the
            # 1.5B + LoRA step at 8/1/1 on h100, the largest buffers of its heap at 2 rows)
            vocab_train = V * D * 4 // fsdp + vocab_c
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
        # The backward of the layer rebuilt also holds, per token, six compute-dtype MLP-wide
        # buffers (gate, up, their product and the three gradients) and the residual stream's
        # work: four float32 and seven compute-dtype [rows, T, D] buffers. Counted (not derived)
        # in the buffer assignment of the 7B's step at 1/1/4 on v5p: 6 x bf16[48,1535,4736],
        # 2 x f32[48,1535,3584] and 2 x f32[73680,3584], 7 x bf16[48,1535,3584]; the 1.5B's at
        # 1/1/4 holds the same kinds (bf16[16,1535,2240], f32[16,1535,1536], bf16[16,1535,1536]).
        backward = 6 * cb * F + (4 * 4 + 7 * cb) * D
        if lora:
            # No frozen weight's gradient is computed: the rebuilt layer's work is five MLP-wide
            # and four hidden-wide compute-dtype buffers and two float32 hidden-wide ones per token
            # (fitted to the 1.5B + LoRA step at 1/1/1 on h100, 9.69 GiB of temporaries against
            # the full step's 10.98 less its gradients; with it every LoRA step in aot_gpu.md is
            # within 0.86-1.11 of XLA:GPU, where the full step's count gave 1.28, and libtpu's
            # LoRA steps within 0.92-1.12: the 7B on v5e-8 13.72 GiB, the one-chip configs)
            backward = 5 * cb * F + (2 * 4 + 4 * cb) * D
        kept_all = n * T * L * kept[tcfg.remat]
        # (two on a TPU with heads narrower than its lanes: the 0.5B's 64-wide heads on v5e keep
        # f32[16,2,7,1535,1535] and its transpose, the mask fused into the scores' matmul)
        score_buffers = 2 if narrow else 3
        work = n * T * (score_buffers * H * scores + backward)
        # and the probabilities cast to the compute dtype for the values' einsum (`attend`), kept
        # for the backward of the layer rebuilt: bf16[16,2,6,1535,1535] of the 1.5B at 1/1/8 on
        # v5e, bf16[16,3,1535,1535] at 1/1/4 on v5p, bf16[6,4,7,1535,1535] of the 7B on v6e.
        work += n * T * H * scores * cb // 4
    else:  # save_all: not compiled at these sizes; the plan's (CPU-fitted) estimate
        kept_all, work = plan.activations_no_remat, 0
    resident = 3 * plan.params + plan.frozen + n_all * row + plan.grads + kept_all
    if gpu:
        # XLA:GPU (the 1.5B's step at 1/1/1 on h100, `xla_dump_to`'s memory-usage report): the
        # layers' weights are cast one layer at a time inside the loop (bf16[1,8960,1536], no
        # bf16[28, ...] copy), and the vocabulary's phase (its float32 gradient buffers, the
        # compute-dtype casts, the logits chunk), which runs before the layers' backward, reuses
        # the heap that the rebuilt layer's work takes after it: four f32[16,12,1535,1535]-sized
        # slots hold the scores, the MLP buffers and the bf16 unembedding in turn.
        out = {"train_step": resident + max(work, vocab_train + plan.logits_chunk)}
    else:
        out = {"train_step": resident + plan.logits_chunk + work + vocab_train + layers_copy}
        if narrow:  # with narrow heads the vocabulary's phase reuses the layer's heap (the
            # 0.5B's step on one v5e: f32[16,64,151936] at an offset inside a score buffer's slot)
            vocab_phase = plan.logits_chunk + vocab_train
            out = {"train_step": resident + max(work, vocab_phase) + layers_copy}
    if cfg.cppo.beta > 0:
        logits = plan.logits_chunk // 3 * n_all // max(n, 1)  # one chunk of logits, all rows
        # Float32 score buffers [rows, H, T, T] (one: the softmax computed in place of the scores;
        # v5e two, `REF_SCORE_BUFFERS`), two MLP products and the queries in float32 [rows, T, H, E]
        # (`rope.apply_rope` rotates in float32; v6e's peak at 1/1/8 holds the 1.5B's whole-head
        # f32[16,1535,12,128] beside the scores). H is every head where tensor does not divide the
        # query heads: the rules (`sharding.logical_spec`) then replicate attention over tensor.
        # (with heads narrower than the lanes, v5e fuses the mask into the scores' matmul and
        # keeps one: the 0.5B's 64-wide heads, f32[16,2,7,1535,1535] once on one v5e chip; and
        # with one key/value head per device: the 7B at 2/4/4 on v5e:4x8, f32[6,1,7,1535,1535])
        two = not narrow and J > 1
        buffers = REF_SCORE_BUFFERS.get(generation, 1) if two else 1
        forward = n_all * T * (buffers * H * scores + 2 * F * cb + 4 * H * E) + logits
        if narrow or (tpu and axis["data"] * fsdp * tp == 1):
            # On one chip, and with heads narrower than the lanes, the MLP's products and the
            # logits take the scores' heap in turn: the 1.5B's reference has 4.18 GiB of
            # temporaries on one v5e as at 1/1/8, where those buffers are 8x smaller (v6e: 2.39 at
            # both); the 0.5B's logits lie inside its score buffer's slot. The larger counts.
            mlp_logits = n_all * T * 2 * F * cb + logits
            forward = max(n_all * T * (buffers * H * scores + 4 * H * E), mlp_logits)
        if gpu:
            # XLA:GPU holds the float32 scores (padded: f32[32,1536,9216] for the 1.5B's 16 rows
            # of 1535 tokens), the softmax's output, the float32 queries, the mask (a byte per
            # key) and the unembedding relaid in the compute dtype (bf16[1536,37984] of the
            # 1.5B at 1/1/4) at once; the MLP's products and the logits take the same heap later.
            # Its cost model writes the softmax's output in float32 or in the compute dtype from
            # case to case: in bf16 for the 1.5B at 1/1/1 and 1/1/8 on h100 and a100 (2.73 GiB
            # of temporaries), in float32 for the same programs on h200 and b200 (3.57 GiB), for
            # the 1.5B at 1/1/2 and 1/1/4 and for the 7B on h100. The plan counts GPU_SOFTMAX_BYTES
            # for it (`xla_dump_to`'s reports).
            softmax = int(H * scores * (4 + GPU_SOFTMAX_BYTES) / 4)  # its f32 scores and output
            mask = scores // 4  # one byte per key of each query, shared by the heads
            forward = n_all * T * (softmax + 4 * H * E + mask) + V * D * cb
        # fsdp > 1 gathers the (compute-dtype) vocabulary matrix whole; else the copy is already it.
        # (each vocabulary matrix once: an untied model gathers the embedding for the lookup too)
        mats = sum(1 for path, _, _ in params_shapes if path[0] in VOCAB)
        gathered_c = mats * vocab_c if fsdp > 1 else 0
        # (on GPUs too: the 7B's gathered bf16[152064,3584] shares the scores' slot at 2/4/1)
        # (and on v5e where it keeps one score buffer: the 7B's bf16[38016,3584] and its relaid
        # copy share the scores' offsets at 2/4/4 on v5e:4x8)
        apart = generation in GATHERS_APART or gpu or (generation in REF_SCORE_BUFFERS and not two)
        if fsdp > 1 and apart:  # a gathered matrix and its relaid copy
            work = max(forward, 2 * vocab_c)
        else:
            work = forward + gathered_c
        # (LoRA: the reference is the frozen base's forward, the base its argument)
        out["ref_logps"] = plan.reference + plan.frozen + n_all * (T + 1) * 5 + work
    if cfg.rollout.backend == "embedded":
        rows = shapes.Q * shapes.G
        N = _split(rows, dp) if rows % dp == 0 else rows
        # Keys and values of every cache segment: the compiler keeps each segment's buffer, not
        # only the one being grown into (`segments.segment_ends`: 64 + 128 + ... + C slots).
        slots = sum(segment_ends(C, SEGMENT_LEN)) if C > 1 else 0
        if gpu:  # the last segment's keys and values (bf16[28,8,2,16,1024,128] each of the
            # 1.5B at 1/1/1 on h100) hold their own slots; the smaller segments share slots
            # with the weight copies and with each other (the 896, 448 and 445 MiB slots)
            slots = C
        # A TPU lays out the cache's head dimension in its 128 lanes: the 0.5B's 64-wide heads
        # take twice their bytes (bf16[24,8,2,16,1024,64] in a 1.5 GiB slot on v5e, not 0.75)
        lanes = -(-E // TPU_LANES) * TPU_LANES if narrow else E
        kv = 2 * L * _sampler_kv_heads(tcfg, tp) * lanes * slots * N * cb
        if cfg.rollout.compact and C > 1:  # (`rollout.compact`) the first compacted loop's rows
            # gathered while the uncompacted caches are still alive: each with the full C slots
            # and its question's prompt slots (the later loops' are smaller)
            B = _split(compact_buckets(rows)[1], dp)
            P = shapes.P
            kv += 2 * L * _sampler_kv_heads(tcfg, tp) * lanes * (C + P) * B * cb
        vocab_copy = 2 * vocab_shard * cb // pb if pb != cb and not lora else 0  # lookup, logits
        if lora:  # the frozen unembedding cast to float32 for the logits (f32[75968,1536] of the
            # 1.5B + LoRA sampler at 1/1/2 on h100: a quarter of its temporaries)
            vocab_copy = V * D * 4 // fsdp
        weights = plan.frozen if lora else plan.params  # LoRA: it samples with the base's weights
        out["sampler"] = weights + layers_copy + vocab_copy + kv + 2 * N * V * 4
    return out


def _sampler_kv_heads(tcfg, tp: int) -> int:
    """Key/value heads per device of the sampler's cache. The sampler is traced without the
    activation rules (`rollout/embedded/sampler.py`), so the compiler lays out the cache after the queries:
    with the query heads split over tensor, each device's block of H/tp heads reads the key/value
    heads of its groups only, J/tp of them or, when tp exceeds J, one (the 1.5B's 2 kv heads on
    tensor = 4: bf16[28, 1, 1, 16, 128, 1024] per cache segment on v5p, half the rules' whole J);
    without the split (tp does not divide H) the cache keeps every head (`_split`'s fallback)."""
    H, J = tcfg.num_heads, tcfg.num_kv_heads
    if tp > 1 and H % tp == 0 and tp % J == 0:
        return 1
    return _split(J, tp)


def resident_bytes(cfg, tcfg, shapes, mesh: dict[str, int]) -> dict[str, int]:
    """The state a run keeps through a step, per device: params, AdamW state, the reference and
    the overlap snapshot (compute-dtype copies)."""
    plan = layout.memory_plan(tcfg, mesh, **layout.plan_kwargs(cfg, shapes, None))
    out = {"params": plan.params, "opt_state": plan.opt_state}
    if plan.frozen:
        out["base"] = plan.frozen
    if plan.reference:
        out["reference"] = plan.reference
    if plan.snapshot:
        out["snapshot"] = plan.snapshot
    return out


def run_peak(cfg, tcfg, shapes, mesh: dict[str, int], target: str = "") -> int:
    """The largest of the programs' totals plus the state beside each (see the module docstring)."""
    return _peak(
        program_bytes(cfg, tcfg, shapes, mesh, target), resident_bytes(cfg, tcfg, shapes, mesh)
    )


def _peak(programs: dict[str, int], resident: dict[str, int]) -> int:
    from cppo_jax.train.programs import ARGS_OF  # the programs' own argument lists (imports JAX)

    return max(
        total + sum(b for k, b in resident.items() if k not in ARGS_OF[name])
        for name, total in programs.items()
    )


def target_of(platform: str, device_kind: str = "") -> str:
    """The generation whose compiler's terms plan a run on `platform` devices of `device_kind`: a
    GPU its own where known (else h100's, XLA:GPU's), a TPU its generation (else v5p's and v4's),
    `cpu` on the CPU."""
    kind = device_kind.lower()
    if platform in ("gpu", "cuda"):
        return next((g for g in GPUS if g in kind), "h100")
    if platform == "tpu":
        return next((gen for key, gen in _TPU_KINDS if key in kind), "")
    return "cpu"


def calibration_note(platform: str, version: str | None) -> str:
    """Whether the plan's constants were read from this compiler (`version` of the one compiling
    for `platform`), or the plan is unchecked for it."""
    family = "gpu" if platform in ("gpu", "cuda") else platform
    if family not in CALIBRATED_WITH:
        return "the plan's terms are calibrated on TPU and GPU compilers, not this one"
    name, read = CALIBRATED_WITH[family]
    if version == read:
        return f"the plan's constants were read from this compiler ({name} {read})"
    return (
        f"the plan is UNCHECKED for {name} {version or '(version unknown)'}: its constants were "
        f"read from {name} {read}'s buffer assignments (rerun benchmarks/aot.py to check them)"
    )


def run_plan(
    cfg, tcfg, shapes, mesh: dict[str, int], device_bytes: int | None = None, target: str = ""
) -> MemoryPlan:
    """The plan of a run of `cfg` on `mesh`: `layout.memory_plan`'s terms with each program's bytes
    and the run peak for `target`'s compiler (`peak` and `fits` are the run peak's)."""
    plan = layout.memory_plan(tcfg, mesh, **layout.plan_kwargs(cfg, shapes, device_bytes))
    programs = program_bytes(cfg, tcfg, shapes, mesh, target)
    return dataclasses.replace(
        plan,
        programs=tuple(programs.items()),
        run_peak=_peak(programs, resident_bytes(cfg, tcfg, shapes, mesh)),
        target=target,
    )


def pick_mesh(
    cfg, tcfg, shapes, num_devices: int, device_bytes: int | None, target: str = ""
) -> list[MemoryPlan]:
    """The plans of every candidate layout of `num_devices`, the one to use first (`layout.preference`:
    fitting, then the most data parallel, the fewest tensor shards); empty when no layout's data
    axes divide the questions. `device_bytes` None: nothing is judged to fit."""
    meshes = layout.candidate_meshes(num_devices, shapes.Q)
    plans = [run_plan(cfg, tcfg, shapes, m, device_bytes, target) for m in meshes]
    return sorted(plans, key=layout.preference)


def fitting_layouts(
    cfg, tcfg, shapes, device_bytes: int, target: str = "", counts: range = range(1, 17)
) -> list[tuple[int, MemoryPlan]]:
    """(device count, its preferred plan) for every count in `counts` with a layout that fits."""
    out = []
    for n in counts:
        plans = pick_mesh(cfg, tcfg, shapes, n, device_bytes, target)
        if plans and plans[0].fits:
            out.append((n, plans[0]))
    return out


def fit_advice(cfg, tcfg, shapes, num_devices: int, device_bytes: int, target: str = "") -> str:
    """What fits instead: the preferred layout of these devices, else device counts that have one."""
    plans = pick_mesh(cfg, tcfg, shapes, num_devices, device_bytes, target)
    if plans and plans[0].fits:
        best = plans[0]
        return (
            f"on these {num_devices} devices {mesh_overrides(best.mesh)} fits "
            f"(peak {_gib(best.peak)} per device)"
        )
    if plans:
        close = min(plans, key=lambda p: p.peak)
        head = (
            f"no layout of {num_devices} devices fits (the smallest peak: "
            f"{mesh_overrides(close.mesh)}, {_gib(close.peak)} per device)"
        )
    else:
        head = (
            f"no layout of {num_devices} devices has data x fsdp dividing the {shapes.Q} questions "
            f"per step"
        )
    found = fitting_layouts(cfg, tcfg, shapes, device_bytes, target)
    if not found:
        return (
            f"{head}; no layout of 1 to 16 such devices fits either: lower rollout.max_new_tokens "
            f"or set trainer.micro_batch, cppo.beta=0 or model.param_dtype=bfloat16 (with "
            f"optim.lr >= {BF16_MIN_LR:.2g} or optim.allow_bf16_underflow=true)"
        )
    options = "; ".join(
        f"{n} devices with {mesh_overrides(p.mesh)} (peak {_gib(p.peak)})" for n, p in found[:4]
    )
    return f"{head}; layouts that fit devices of this size: {options}"
