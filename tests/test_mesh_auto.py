"""`mesh=auto`, the default: the launch lays the mesh out from the memory plan for the devices it sees
(`plan.choose_mesh`, the one function `launch/gpu_node.sh` also runs through `plan --pick-mesh`),
refuses before reading weights when nothing fits, and sets the GPU memory share the plan assumes.

The paper's model folders are `tests/test_launch.py`'s stand-ins: the released config.json and a
safetensors file whose header lists every tensor at its real shape, with no data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cppo_jax import launch, plan
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import load_config
from cppo_jax.config.run import MeshConfig
from cppo_jax.planning import memory as layout
from tests.conftest import xla_flags
from tests.test_launch import MATH7B, QWEN25_7B, _jsonl, model_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def math7b_run(tmp_path_factory) -> list[str]:
    """The overrides of a runnable math7b (a stand-in 7B folder, 48 training rows)."""
    tmp = tmp_path_factory.mktemp("math7b")
    model = model_folder(tmp, "m", QWEN25_7B)
    rows = [{"problem": f"{i} + 1?", "solution": f"$\\boxed{{{i + 1}}}$"} for i in range(48)]
    train = _jsonl(tmp / "t.jsonl", rows)
    return [f"model.path={model}", f"data.train={train}", "trainer.eval_size=8"]


def test_mesh_config_auto_and_explicit_sizes():
    assert MeshConfig().auto and MeshConfig().sizes(8) == {"data": 8, "fsdp": 1, "tensor": 1}
    # Any size set is explicit; the unset axes are 1 and data the rest unless an axis is -1.
    assert not MeshConfig(fsdp=4).auto
    assert MeshConfig(fsdp=4).sizes(8) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert MeshConfig(fsdp=-1).sizes(8) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert MeshConfig(data=-1).sizes(8) == {"data": 8, "fsdp": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="mesh.data=2 x mesh.fsdp=1 x mesh.tensor=1 = 2"):
        MeshConfig(data=2).sizes(8)
    with pytest.raises(ConfigError, match="mesh.tensor"):
        MeshConfig(tensor=-2)


# What the subprocess with 8 fake CPU devices runs: the launch's dry run with the default mesh, then a
# real launch whose Trainer is a stand-in that prints the config it gets (no weight is read).
_WORKER = """
import json, sys
from cppo_jax import launch
from cppo_jax.train import trainer
argv = json.loads(sys.argv[1])
print("DRY", launch.main([*argv, "trainer.dry_run=true"]), flush=True)
def stand_in(cfg):
    print("TRAINER " + json.dumps(dict(data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor)))
    raise SystemExit(0)
trainer.Trainer = stand_in
launch.main(argv)
"""


def test_default_mesh_on_8_devices_shards_a_model_too_big_to_replicate(math7b_run, tmp_path):
    """math7b on 8 devices of 80 GB: a whole 7B copy with AdamW per device does not fit, so the
    default mesh is not pure data parallel; the launch (dry run and real) takes the layout that
    `plan --pick-mesh` gives for the same 8 devices, and the plan says it fits."""
    argv = [
        "--config",
        MATH7B,
        *math7b_run,
        f"trainer.out_dir={tmp_path}",
        "--device-memory-gb",
        "80",
    ]
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, json.dumps(argv)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "DRY 0" in out, out[-3000:] + proc.stderr[-3000:]
    assert "mesh: data=2 fsdp=4 tensor=1 (config auto) over 8 cpu device(s)" in out
    assert "fits: yes" in out and "fits: no" not in out
    chosen = json.loads(next(ln for ln in out.splitlines() if ln.startswith("TRAINER "))[8:])
    assert chosen == {"data": 2, "fsdp": 4, "tensor": 1}
    # The same layout as the script's choice for 8 GPUs of 80 GB.
    cfg = load_config(MATH7B, math7b_run)
    picked = plan.choose_mesh(cfg, 8, int(80e9))
    assert picked.plan.mesh == chosen and picked.plan.fits
    assert "mesh for 8 device(s): mesh.data=2 mesh.fsdp=4 mesh.tensor=1" in out


def test_nothing_fits_is_refused_before_any_weight_is_read(
    math7b_run, tmp_path, capsys, monkeypatch
):
    """One device of 40 GB holds no layout of the 7B run: the plan is printed, the run refused (exit
    2) before the trainer is built, and no run folder is made."""
    from cppo_jax.train import trainer

    def never(cfg):
        raise AssertionError("the trainer was built: weights would be read")

    monkeypatch.setattr(trainer, "Trainer", never)
    out_dir = tmp_path / "runs"
    argv = ["--config", MATH7B, *math7b_run, f"trainer.out_dir={out_dir}"]
    code = launch.main([*argv, "--device-memory-gb", "40"])
    out, err = capsys.readouterr()
    assert code == 2
    assert "memory per device (mesh data=1 fsdp=1 tensor=1" in out and "fits: no" in out
    assert "the memory plan does not fit: peak" in err and "no layout of 1 devices fits" in err
    assert "layouts that fit devices of this size" in err
    assert not out_dir.exists()


def test_launch_and_the_script_choose_through_the_same_function(math7b_run, tmp_path, monkeypatch):
    """`plan --pick-mesh` (what gpu_node.sh runs) and the launch both call `plan.choose_mesh`."""
    from cppo_jax.train import trainer

    calls = []
    real = plan.choose_mesh

    def spy(cfg, n, device_bytes, **kw):
        choice = real(cfg, n, device_bytes, **kw)
        calls.append((n, device_bytes, choice.overrides))
        return choice

    monkeypatch.setattr(plan, "choose_mesh", spy)
    built = []
    monkeypatch.setattr(trainer, "Trainer", lambda cfg: built.append(cfg) or sys.exit(0))
    argv = ["--config", MATH7B, *math7b_run, f"trainer.out_dir={tmp_path}"]
    assert plan.main(["--pick-mesh", "--devices", "1", "--device-memory-gb", "300", *argv]) == 0
    with pytest.raises(SystemExit):
        launch.main([*argv, "--device-memory-gb", "300"])
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0][2] == ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1")
    assert not built[0].mesh.auto


def test_the_launch_sets_the_gpu_memory_share_the_plan_assumes(monkeypatch, capsys):
    monkeypatch.delenv(layout.MEM_FRACTION_VAR, raising=False)
    code = launch.main(["--config", "math7b.py", "trainer.dry_run=true"])
    assert code == 2 and "model.path is required" in capsys.readouterr().err  # set before that
    assert float(os.environ[layout.MEM_FRACTION_VAR]) == layout.USABLE_FRACTION
    # A share set by the user is kept and said; the plan then judges against what JAX holds.
    env = {layout.MEM_FRACTION_VAR: "0.5"}
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 is set" in layout.set_gpu_memory_fraction(env)
    assert env[layout.MEM_FRACTION_VAR] == "0.5"

    class Device:  # a GPU whose allocator holds the launch's share of 141 GB
        platform = "gpu"

        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return {"bytes_limit": self.limit}

    total = 141 * 10**9
    assert layout.device_memory(Device(int(layout.USABLE_FRACTION * total))) == pytest.approx(
        total, rel=1e-9
    )
    # JAX's default 75% pool: the plan counts only what the pool holds as usable.
    pool = int(0.75 * total)
    assert layout.USABLE_FRACTION * layout.device_memory(Device(pool)) == pytest.approx(
        pool, rel=1e-9
    )


def test_a_mesh_the_torus_cannot_hold_is_placed_split_or_refused_by_name(monkeypatch):
    """JAX's placement refuses a shape (as on a 4 x 4 TPU slice for 8 x 1 x 2): placed with a
    physical axis split, or, without that, a MeshError naming the mesh instead of a traceback."""
    import jax

    from cppo_jax.parallel import sharding

    real = jax.make_mesh

    def torus(shape, names, axis_types=None, *, devices=None):
        if tuple(shape) != (1, 1, 1):
            raise NotImplementedError("Failed to find assignment for logical_axis_index 2")
        return real(shape, names, axis_types, devices=devices)

    monkeypatch.setattr(jax, "make_mesh", torus)
    devices = jax.devices()[:1]
    assert dict(sharding.make_mesh(MeshConfig(data=1), devices).shape)["data"] == 1
    monkeypatch.setattr(
        jax, "make_mesh", lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("no"))
    )
    mesh = sharding.make_mesh(MeshConfig(data=1), devices)  # split placement
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(sharding.MeshError, match="mesh.data=1 mesh.fsdp=1 mesh.tensor=1 cannot be"):
        sharding.make_mesh(MeshConfig(data=1), devices, allow_split=False)


def test_auto_takes_the_best_layout_the_slice_can_hold(math7b_run, monkeypatch):
    """On 8 TPU chips of 32 GB (v5e) the 7B run fits only with splash attention (no einsum layout
    does); on chips of 40 GB the preferred layout is kept only where the slice places it: with the
    first refused the next is taken."""
    cfg = load_config(MATH7B, math7b_run)
    free = plan.choose_mesh(cfg, 8, int(32e9), platform="tpu", devices=None)
    assert "model.attention=splash" in free.overrides and free.plan.fits
    # No splash on a GPU: its plan is XLA:GPU's (h100's terms), einsum attention throughout, and
    # refuses a memory that holds less than its run peak.
    gpu = plan.choose_mesh(cfg, 8, int(40e9))
    assert gpu.plan.target == "h100" and not any("splash" in o for o in gpu.overrides)
    with pytest.raises(ConfigError, match="the memory plan does not fit"):
        plan.choose_mesh(cfg, 8, int(gpu.plan.peak / layout.USABLE_FRACTION * 0.95))
    # Chips of 40 GB hold several layouts: with the preferred one refused by the slice, the next.
    roomy = plan.choose_mesh(cfg, 8, int(40e9), platform="tpu", devices=None)
    refused = roomy.plan.mesh
    monkeypatch.setattr(
        plan, "_placeable", lambda mesh, devices, allow_split: mesh != refused or allow_split
    )
    placed = plan.choose_mesh(cfg, 8, int(40e9), platform="tpu", devices=["d"] * 8)
    assert placed.plan.mesh != refused and placed.plan.fits
