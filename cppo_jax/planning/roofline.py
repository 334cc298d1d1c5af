"""FLOPs of a step's phases from the model, and the least time each can take on a chip (a roofline).

The FLOPs come from the model's shapes, not from `compiled.cost_analysis()`, which counts a loop body
(the layer scan, the micro-batch loop, the decode loop) once. Per matmul weight and token 2 FLOPs
forward, 6 forward and backward (+2 with remat: the forward again); attention as computed here (dense
einsum over all T x T pairs): 4 H E FLOPs per pair and layer forward; the logits only where log-probs
are taken (the C completion positions). Generation counts all C new tokens (the most a step decodes).

A phase takes at least max(FLOPs / peak FLOP/s, bytes it must read / HBM bandwidth) per device: the
datasheet figures of `CHIPS`. That bound ignores collectives, kernel efficiency and the host: a real
step is slower, often several times (decode in particular); it is a floor to plan against.

Letters as in docs/conventions.md; N here is sequences, W weight elements.
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Datasheet figures of one chip (all its TensorCores)."""

    name: str
    hbm_bytes: int
    bf16_flops: float  # peak dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    source: str


# Keyed by the JAX device_kind of the chip's devices. Sources: Google Cloud TPU system architecture
# pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e), the chip specification tables.
CHIPS = {
    "TPU v4": Chip("v4", 32 * GiB, 275e12, 1200e9, "cloud.google.com/tpu/docs/v4"),
    "TPU v5 lite": Chip("v5e", 16 * GiB, 197e12, 819e9, "cloud.google.com/tpu/docs/v5e"),
    "TPU v5": Chip("v5p", 95 * GiB, 459e12, 2765e9, "cloud.google.com/tpu/docs/v5p"),
    "TPU v6 lite": Chip("v6e", 32 * GiB, 918e12, 1640e9, "cloud.google.com/tpu/docs/v6e"),
}
# NVIDIA GPUs (`--compile-for h100:8`): HBM and bandwidth from the spec the compiler reads
# (`aot_gpu.spec_field`, XLA's figures as CUDA reports them), peak dense bf16 FLOP/s (tensor cores,
# without sparsity) from NVIDIA's datasheets (nvidia.com/en-us/data-center/h100, /h200, /a100,
# /dgx-b200: the per-GPU figure).
GPU_BF16_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2250e12}


def _gpu_chips() -> dict[str, Chip]:
    from cppo_jax.planning import gpu_targets as aot_gpu

    out = {}
    for gpu, flops in GPU_BF16_FLOPS.items():
        spec = f"XLA's {aot_gpu.GPUS[gpu]} spec; NVIDIA datasheet"
        hbm = int(aot_gpu.spec_field(gpu, "device_memory_size"))
        bandwidth = aot_gpu.spec_field(gpu, "memory_bandwidth")
        out[aot_gpu.device_name(gpu)] = Chip(gpu, hbm, flops, bandwidth, spec)
    return out


CHIPS.update(_gpu_chips())


def devices_per_chip(devices) -> int:
    """How many of `devices` share one chip (2 for v4's compile topology: one per TensorCore)."""
    coords = [tuple(getattr(d, "coords", ()) or ()) for d in devices]
    if not coords or not coords[0]:
        return 1
    return max(coords.count(c) for c in set(coords))


@dataclasses.dataclass(frozen=True)
class Device:
    """One device of a target: its share of its chip."""

    chip: Chip
    share: int  # devices per chip

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes // self.share

    @property
    def flops(self) -> float:
        return self.chip.bf16_flops / self.share

    @property
    def bandwidth(self) -> float:
        return self.chip.hbm_bandwidth / self.share


def device_of(devices) -> Device | None:
    chip = CHIPS.get(devices[0].device_kind)
    return None if chip is None else Device(chip, devices_per_chip(devices))


def _layer_weights(tcfg) -> int:
    """Matmul weight elements of the decoder layers (what every token multiplies)."""
    D, F, E = tcfg.hidden_size, tcfg.intermediate_size, tcfg.head_dim
    H, J = tcfg.num_heads, tcfg.num_kv_heads
    return tcfg.num_layers * (D * (H + 2 * J) * E + H * E * D + 3 * D * F)


def forward_flops(tcfg, rows: int, positions: int, logit_positions: int) -> float:
    """One forward of `rows` sequences of `positions` tokens, logits at `logit_positions` of them."""
    attention = 4 * tcfg.num_layers * tcfg.num_heads * tcfg.head_dim * positions**2
    per_row = 2 * positions * _layer_weights(tcfg) + attention
    return rows * (per_row + 2 * logit_positions * tcfg.hidden_size * tcfg.vocab_size)


def decode_flops(tcfg, sequences: int, prompt_len: int, new_tokens: int) -> float:
    """Generating `new_tokens` for each of `sequences` after `prompt_len` prompt slots."""
    W = _layer_weights(tcfg) + tcfg.hidden_size * tcfg.vocab_size
    context = new_tokens * prompt_len + new_tokens * (new_tokens - 1) / 2  # keys read, summed
    attention = 4 * tcfg.num_layers * tcfg.num_heads * tcfg.head_dim * context
    return sequences * (2 * new_tokens * W + attention)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    flops: float  # all devices together
    bytes_read: float  # per device, the least it must read from HBM


def step_phases(tcfg, shapes, *, mu: int, beta: float, overlap: bool, embedded: bool, tp: int = 1):
    """The phases of one step with their FLOPs and least bytes read per device (`tp`: tensor
    shards, which split the weights each device reads)."""
    cb = 2 if tcfg.dtype == "bfloat16" else 4
    weights = (_layer_weights(tcfg) + tcfg.hidden_size * tcfg.vocab_size) * cb / tp
    T = shapes.P + shapes.C - 1
    fwd = forward_flops(tcfg, shapes.M, T, shapes.C)
    phases = []
    if embedded:
        N, L, J, E = shapes.Q * shapes.G, tcfg.num_layers, tcfg.num_kv_heads, tcfg.head_dim
        prefill = forward_flops(tcfg, shapes.Q, shapes.P, 1)
        # Each decode step reads the weights and the keys/values in use (on average half of C).
        kv = 2 * L * J * E * cb * (shapes.Q * shapes.P + N * shapes.C / 2) / tp
        phases.append(
            Phase(
                "rollout",
                prefill + decode_flops(tcfg, N, shapes.P, shapes.C),
                shapes.C * (weights + kv),
            )
        )
    if beta > 0:
        phases.append(Phase("ref_logps", fwd, weights))
    if overlap:
        phases.append(Phase("old_logps", fwd, weights))
    recompute = 1 if tcfg.remat == "full" else 0  # minimal recomputes attention only
    phases.append(Phase("update", mu * (3 + recompute) * fwd, mu * 3 * weights))
    return phases


def bound_seconds(phase: Phase, device: Device, devices: int) -> float:
    """The least time of `phase` on `devices` devices: compute or HBM reads, whichever is longer."""
    return max(phase.flops / (devices * device.flops), phase.bytes_read / device.bandwidth)
