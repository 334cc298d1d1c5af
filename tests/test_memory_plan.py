"""The memory plan's numbers against what a live tiny Trainer holds and what XLA allocates for its step.

`layout.memory_plan` (what `trainer.dry_run=true` prints, and the plan for the paper's configs on 8 x 80 GB)
predicts per-device bytes. Here a real Trainer of a tiny config is built on this CPU and measured:
  resident: the bytes of every params / AdamW state / reference-params shard on the device (live arrays);
  train step: XLA's buffer assignment of the compiled train step with the Trainer's own arguments
    (arguments + outputs - donated aliases + temporaries: gradients, activations, the logits chunk).
Each must be within 20% of the plan's figure for the same config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from cppo_jax import plan
from cppo_jax.config.files import apply_overrides
from cppo_jax.models.hf_read import read_hf_config
from cppo_jax.planning import memory as layout
from cppo_jax.train import device_fns as step_lib
from cppo_jax.train.trainer import Trainer
from tests.conftest import build_arith_model_dir
from tests.test_trainer import small_config


def _device_bytes(tree, device) -> int:
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def _batch_spec(sh) -> step_lib.Batch:
    """The shapes of a step's batch of `sh` (mu = 1: no old-policy log-probs)."""
    S, f32 = jax.ShapeDtypeStruct, jnp.float32
    T = sh.P + sh.C
    return step_lib.Batch(
        S((sh.M, T), jnp.int32),
        S((sh.M, T), jnp.bool_),
        S((sh.M, sh.C), f32),
        S((sh.M,), f32),
        None,
        S((sh.M, sh.C), f32),
    )


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_plan_matches_the_measured_memory_of_a_tiny_trainer(tmp_path, scan_layers):
    model_dir = build_arith_model_dir(tmp_path / "model", hidden=64, layers=2)
    cfg = small_config(
        tmp_path / "runs",
        model_dir,
        "rollout.max_new_tokens=24",
        "cppo.questions_per_step=4",  # Q = 8 with p = 0.5 and allocation: M = 16 kept sequences
        f"model.scan_layers={str(scan_layers).lower()}",
    )
    trainer = Trainer(cfg)
    try:
        sh, m = trainer.shapes, cfg.model
        tcfg = read_hf_config(
            model_dir,
            dtype=m.dtype,
            param_dtype=m.param_dtype,
            remat=m.remat,
            scan_layers=m.scan_layers,
        )
        mp = layout.memory_plan(
            tcfg,
            cfg.mesh.sizes(len(jax.devices())),
            rows=sh.M,
            prompt_len=sh.P,
            completion_len=sh.C,
            micro_batch=cfg.trainer.micro_batch,
            beta=cfg.cppo.beta,
            rollout_rows=sh.Q * sh.G,
        )
        device = jax.devices()[0]
        resident = _device_bytes(
            (trainer.params, trainer.opt_state, trainer.reference.params), device
        )

        batch = _batch_spec(sh)
        compiled = trainer.actor.train_step.lower(trainer.params, trainer.opt_state, batch)
        compiled = compiled.compile()
        mem = compiled.memory_analysis()
        step_peak = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )
        ref_bytes = _device_bytes(trainer.reference.params, device)
    finally:
        trainer.close()
    measured = {
        "resident (params + AdamW + reference)": (resident, mp.resident),
        # The step's arguments hold params and AdamW state; the reference params stay resident.
        "training step peak": (step_peak + ref_bytes, mp.train_peak),
        "params": (_device_bytes(trainer.params, device), mp.params),
    }
    for name, (got, want) in measured.items():
        print(
            f"{name}: measured {got / 2**20:.3f} MiB, plan {want / 2**20:.3f} MiB, {want / got:.3f}x"
        )
    for name, (got, want) in measured.items():
        assert 0.8 <= want / got <= 1.2, (name, got, want)
    # The step's temporaries are not a rounding error here: activations matter to the comparison.
    assert mem.temp_size_in_bytes > 0.2 * step_peak


def test_plan_command_prints_the_plan_for_a_machine_we_do_not_have(capsys):
    """`python -m cppo_jax.plan` (quoted in docs/scale_out.md): 7B on 8 x 80 GB, sharded over fsdp."""
    config = str(Path(__file__).resolve().parents[1] / "configs" / "math7b.py")
    args = ["--config", config, "--devices", "8", "--device-memory-gb", "80"]
    assert plan.main([*args, "mesh.data=1", "mesh.fsdp=8"]) == 0
    text = capsys.readouterr().out
    assert "mesh: data=1 fsdp=8 tensor=1 (config 1/8/1) over 8 planned device(s)" in text
    assert "7,615,616,512 parameters" in text and "fits: yes" in text
    assert plan.main([*args, "mesh.data=8"]) == 1  # pure data parallelism: a whole copy per GPU
    out = capsys.readouterr()
    assert "fits: no" in out.out and "the memory plan does not fit" in out.err
    assert "on these 8 devices mesh.data=2 mesh.fsdp=4 mesh.tensor=1 fits" in out.err
    assert plan.main([*args, "mesh.data=16"]) == 2
    assert "but there are 8" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parents[1]
MATH7B = str(ROOT / "configs" / "math7b.py")
GSM8K = str(ROOT / "configs" / "gsm8k_1p5b.py")


def test_the_plan_names_an_axis_that_cannot_shard_a_dimension(capsys):
    """Qwen2.5-7B's 3584-wide embedding on mesh.fsdp=3: 3584 = 2^9 x 7 is not a multiple of 3."""
    args = ["--config", MATH7B, "--device-memory-gb", "80"]
    assert plan.main([*args, "--devices", "3", "mesh.data=1", "mesh.fsdp=3"]) == 1
    out = capsys.readouterr()
    assert (
        "not sharded: mesh.fsdp=3 does not shard the embed dimension (3584 is not a multiple of 3)"
        in out.out
    )
    assert "(sizes that divide 3584: 2, 4, 7, 8, 14, 16, 28, 32)" in out.out
    # No layout of 3 such devices fits the 7B run; the error says which device counts do.
    assert "no layout of 3 devices fits" in out.err
    assert "4 devices with mesh.data=1 mesh.fsdp=4 mesh.tensor=1" in out.err
    # tensor=7 splits the 28 query heads but not the 4 key/value heads nor the 18944-wide MLP.
    assert plan.main([*args, "--devices", "7", "mesh.tensor=7"]) == 1
    text = capsys.readouterr().out
    assert "mesh.tensor=7 does not shard the kv_heads dimension (4 is not a multiple of 7)" in text
    assert "mesh.tensor=7 does not shard the mlp dimension (18944" in text
    assert "q_heads dimension" not in text


def _pick(capsys, config: str, devices: int, *overrides: str) -> tuple[int, str, str]:
    argv = ["--pick-mesh", "--config", config, "--devices", str(devices)]
    code = plan.main([*argv, "--device-memory-gb", "80", *overrides])
    out = capsys.readouterr()
    return code, out.out.strip(), out.err


def _mesh(line: str) -> dict[str, int]:
    pairs = dict(item.split("=") for item in line.split())
    return {k.removeprefix("mesh."): int(v) for k, v in pairs.items()}


@pytest.mark.parametrize(
    "config, devices, overrides, want",
    [
        (GSM8K, 8, (), {"data": 8, "fsdp": 1, "tensor": 1}),  # Q = 8: pure data parallel fits
        (GSM8K, 7, (), {"data": 1, "fsdp": 1, "tensor": 7}),  # 7 does not divide Q = 8
        (MATH7B, 4, (), {"data": 1, "fsdp": 4, "tensor": 1}),  # 7B needs its state sharded
        (MATH7B, 8, (), {"data": 2, "fsdp": 4, "tensor": 1}),
        # GRPO, Q = 3: data x fsdp must divide 3, so 4 devices split heads and MLP over tensor.
        (
            MATH7B,
            4,
            ("cppo.pruning_rate=0", "trainer.micro_batch=16"),
            {"data": 1, "fsdp": 1, "tensor": 4},
        ),
    ],
)
def test_pick_mesh_divides_the_questions_and_fits(capsys, config, devices, overrides, want):
    code, line, err = _pick(capsys, config, devices, *overrides)
    assert code == 0, err
    assert _mesh(line) == want and "peak" in err
    # What it picked is what the plan says fits, on exactly these devices.
    argv = ["--config", config, "--devices", str(devices), "--device-memory-gb", "80"]
    assert plan.main([*argv, *overrides, *line.split()]) == 0
    assert "fits: yes" in capsys.readouterr().out


def test_pick_mesh_refuses_with_the_plans_figures_and_a_layout_that_fits(capsys):
    code, line, err = _pick(capsys, MATH7B, 7)  # gpu_node.sh's default: 8 GPUs, 7 for the trainer
    assert code == 2 and line == ""
    assert "the memory plan does not fit: peak" in err and "GiB per device of 74.51 GiB" in err
    assert "4 devices with mesh.data=1 mesh.fsdp=4 mesh.tensor=1" in err
    # A mesh given by the user is kept and checked, not replaced.
    code, line, _ = _pick(capsys, MATH7B, 8, "mesh.data=1", "mesh.fsdp=-1")
    assert code == 0 and _mesh(line) == {"data": 1, "fsdp": 8, "tensor": 1}
    code, _, err = _pick(capsys, MATH7B, 8, "mesh.data=8")
    assert code == 2 and "on these 8 devices mesh.data=2 mesh.fsdp=4 mesh.tensor=1 fits" in err


def test_reference_and_rollout_snapshot_are_counted_in_the_compute_dtype():
    """The reference policy and the overlap's rollout snapshot only run forwards: the trainer holds them
    in the compute dtype (`transformer.forward_copy`), so with bf16 compute and float32 params each is
    exactly half the params' bytes, and both count in what stays resident through the step."""
    from cppo_jax.algo.cppo import shapes_of
    from cppo_jax.config.files import apply_overrides
    from cppo_jax.config.schema import Config
    from tests.helpers import tiny_config

    mesh = {"data": 1, "fsdp": 2, "tensor": 1}
    kw = dict(rows=8, prompt_len=5, completion_len=7)
    for dtype, share in (("bfloat16", 2), ("float32", 1)):
        tcfg = tiny_config(dtype=dtype, hidden_size=38)  # an even width: fsdp=2 shards it
        base = layout.memory_plan(tcfg, mesh, **kw)
        ref = layout.memory_plan(tcfg, mesh, beta=0.04, **kw)
        assert share * ref.reference == ref.params, dtype
        both = layout.memory_plan(tcfg, mesh, beta=0.04, overlap=True, **kw)
        assert base.reference == base.snapshot == 0 and not ref.snapshot
        assert both.snapshot == both.reference == ref.reference
        assert ref.resident - base.resident == ref.reference
        assert both.resident - ref.resident == both.snapshot
        assert both.train_peak - ref.train_peak == both.snapshot
    # A config with rollout.overlap=1 plans the snapshot; one without does not.
    vllm = ["rollout.backend=vllm", "rollout.vllm_url=http://127.0.0.1:9"]
    for overlap in (0, 1):
        cfg = apply_overrides(Config(), [*vllm, f"rollout.overlap={overlap}"])
        kwargs = layout.plan_kwargs(cfg, shapes_of(cfg), None)
        plan_ = layout.memory_plan(tiny_config(dtype="bfloat16"), mesh, **kwargs)
        assert (plan_.snapshot > 0) == bool(overlap)
    text = "\n".join(layout.memory_lines(both, "float32"))
    assert f"rollout snapshot {layout._gib(both.snapshot)}" in text


def test_plan_counts_lora_as_the_trainer_holds_it(tmp_path):
    """With model.lora the plan counts what the LoRA Trainer holds: the adapters (params, float32) and
    their AdamW moments and gradients, the frozen base in the compute dtype, no reference copy (the
    reference is the base with the adapters off), no merged copy for the embedded sampler (it runs the
    adapters unmerged on the base) but one per push to a server; each resident figure equals the live
    arrays' bytes, the train step within 20% of XLA's buffer assignment."""
    from cppo_jax.models import lora_state

    model_dir = build_arith_model_dir(tmp_path / "model", hidden=64, layers=2)
    cfg = small_config(
        tmp_path / "runs",
        model_dir,
        "rollout.max_new_tokens=24",
        "cppo.questions_per_step=4",
        "model.lora.enabled=true",
        "model.lora.rank=4",
    )
    trainer = Trainer(cfg)
    try:
        sh, m = trainer.shapes, cfg.model
        tcfg = read_hf_config(model_dir, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat)
        tcfg = lora_state.transformer_config(tcfg, m.lora)
        mesh = cfg.mesh.sizes(len(jax.devices()))
        mp = layout.memory_plan(tcfg, mesh, **layout.plan_kwargs(cfg, sh, None))
        full = layout.memory_plan(
            read_hf_config(model_dir, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat),
            mesh,
            **layout.plan_kwargs(cfg, sh, None),
        )
        device = jax.devices()[0]
        got = {
            "params": _device_bytes(trainer.params, device),
            "frozen": _device_bytes(trainer.actor.frozen, device),
            "sampler": _device_bytes(trainer.sampler_params(), device),
            "opt_state": _device_bytes(trainer.opt_state, device),
        }
        batch = _batch_spec(sh)
        args = (trainer.params, trainer.opt_state, batch, trainer.actor.frozen)
        mem = trainer.actor.train_step.lower(*args).compile().memory_analysis()
        step_peak = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )
        assert trainer.reference.params is trainer.actor.frozen  # no reference copy: the base
        # The sampler's weights are the run's own arrays (adapters and base), no copy of them.
        held = {id(x) for x in jax.tree.leaves((trainer.params, trainer.actor.frozen))}
        assert {id(x) for x in jax.tree.leaves(trainer.sampler_params())} == held
    finally:
        trainer.close()
    assert mp.params == got["params"] < full.params / 10  # the adapters alone
    assert mp.frozen == got["frozen"] == full.params and mp.merged == 0
    assert got["sampler"] == got["params"] + got["frozen"]
    assert 0 <= got["opt_state"] - mp.opt_state <= 64 and mp.opt_state == 2 * mp.params  # + counts
    assert mp.grads == mp.params and mp.reference == 0 and full.reference > 0
    assert mp.resident == mp.params + mp.opt_state + mp.frozen
    print(f"LoRA train step: XLA {step_peak / 2**20:.3f} MiB, plan {mp.train_peak / 2**20:.3f} MiB")
    assert 0.8 <= mp.train_peak / step_peak <= 1.2
    text = "\n".join(layout.memory_lines(mp, "float32"))
    assert f"frozen base (compute dtype) {layout._gib(mp.frozen)}" in text
    # In bf16 compute the frozen base and a server push's merged weights are half the float32
    # params; the adapters and their moments stay float32 (the plan only: XLA:CPU computes bf16
    # through float32).
    served = apply_overrides(cfg, ["rollout.backend=vllm", "rollout.vllm_url=http://127.0.0.1:9"])
    bf16 = layout.memory_plan(
        dataclasses.replace(tcfg, dtype="bfloat16"), mesh, **layout.plan_kwargs(served, sh, None)
    )
    assert bf16.frozen == bf16.merged == full.params // 2 and bf16.params == mp.params


def test_plan_command_with_lora_finds_fewer_gpus_for_math7b(capsys):
    """configs/math7b.py on 80 GB GPUs: with LoRA (rank 32) two GPUs fit (as data = 2, or
    fsdp = 2), and one with micro-batches of 8 rows; full fine-tuning needs four (fsdp = 4) even
    with them."""
    args = ["--config", MATH7B, "--device-memory-gb", "80"]
    lora = ["model.lora.enabled=true", "model.lora.rank=32"]
    assert plan.main([*args, "--devices", "1", *lora]) == 1
    assert "2 devices with mesh.data=2 mesh.fsdp=1" in capsys.readouterr().err
    assert plan.main([*args, "--devices", "2", "mesh.data=1", "mesh.fsdp=2", *lora]) == 0
    text = capsys.readouterr().out
    assert (
        "LoRA: the params above are the adapters; frozen base (compute dtype) 7.09 GiB" in text
    )  # 1/2
    assert "reference params 0.00 GiB" in text and "fits: yes" in text
    assert plan.main([*args, "--devices", "1", "trainer.micro_batch=8", *lora]) == 0
    assert "fits: yes" in capsys.readouterr().out
    assert plan.main([*args, "--devices", "1", "trainer.micro_batch=8"]) == 1
    assert "4 devices with mesh.data=1 mesh.fsdp=4" in capsys.readouterr().err
