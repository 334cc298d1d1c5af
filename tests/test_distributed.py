"""Several processes, one run: two `jax.distributed` processes on localhost train like one process.

The two-process run and its single-process reference run in subprocesses with fake CPU devices
(XLA_FLAGS must be set before JAX starts); CPU collectives go through gloo. Both train the same tiny
config for 3 steps on the same (data=2, fsdp=2) mesh of 4 devices: 2 processes x 2 devices, and
1 process x 4 devices. The workers write their final parameters as .npz; the assertions are here. The
two processes then check what else needs several: the rollout server reached from process 0 alone,
and an export of a larger model split over both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cppo_jax.parallel import distributed
from tests.conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
OVERRIDES = [
    "trainer.steps=3",
    "mesh.data=2",
    "mesh.fsdp=2",
    "cppo.beta=0.0",  # no reference log-probs: one program less to compile
    "cppo.mask_truncated=false",
    "rollout.max_new_tokens=24",
]
# The shipped warm start: its completions earn different rewards, so every step has a gradient.
MODEL = ROOT / "cppo_jax" / "assets" / "tiny_arith"


# ---------------------------------------------------------------------------------------------
# Where the coordinator comes from (no JAX involved)
# ---------------------------------------------------------------------------------------------


def test_detect_reads_explicit_jax_slurm_and_tpu_settings():
    explicit = {"CPPO_COORDINATOR": "10.0.0.1:1234", "CPPO_NUM_PROCESSES": "4"}
    plan = distributed.detect({**explicit, "CPPO_PROCESS_ID": "3"})
    assert plan.source == "explicit"
    assert plan.kwargs() == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
    }
    # Flags (launch --coordinator ...) win over the environment.
    flags = distributed.detect(explicit, process_id=1, coordinator="h:9")
    assert flags.kwargs()["process_id"] == 1 and flags.coordinator == "h:9"
    assert distributed.detect({"JAX_COORDINATOR_ADDRESS": "h:1"}).source == "jax"
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}
    assert distributed.detect(slurm).source == "slurm"
    assert distributed.detect(slurm).kwargs() == {}  # JAX reads SLURM's variables itself
    assert distributed.detect({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert distributed.detect({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}).source == "tpu"
    assert distributed.detect({"TPU_WORKER_HOSTNAMES": "t0"}) is None
    assert distributed.detect({}) is None
    assert distributed.detect({"CPPO_DISTRIBUTED": "auto"}).kwargs() == {}
    assert distributed.detect({**slurm, "CPPO_DISTRIBUTED": "off"}) is None


def test_detect_names_what_is_missing_or_wrong():
    with pytest.raises(
        distributed.DistributedError, match="missing: --process-id / CPPO_PROCESS_ID"
    ):
        distributed.detect({"CPPO_COORDINATOR": "h:1", "CPPO_NUM_PROCESSES": "2"})
    with pytest.raises(distributed.DistributedError, match="CPPO_PROCESS_ID=2 is invalid.*0..1"):
        distributed.detect({"CPPO_COORDINATOR": "h:1"}, num_processes=2, process_id=2)
    with pytest.raises(distributed.DistributedError, match="allowed HOST:PORT"):
        distributed.detect({}, coordinator="h", num_processes=2, process_id=0)
    with pytest.raises(distributed.DistributedError, match="CPPO_DISTRIBUTED='yes' is invalid"):
        distributed.detect({"CPPO_DISTRIBUTED": "yes"})
    with pytest.raises(distributed.DistributedError, match="CPPO_NUM_PROCESSES='two'"):
        distributed.detect({"CPPO_NUM_PROCESSES": "two"}, coordinator="h:1", process_id=0)


def test_launch_refuses_incomplete_flags(capsys):
    from cppo_jax import launch

    rc = launch.main(["--config", "configs/tiny_cpu.py", "--coordinator", "h:1"])
    assert rc == 2
    assert "missing: --num-processes" in capsys.readouterr().err
    # The SLURM script's argv shape: overrides, then the task's own --process-id (parsed: 5 >= 2).
    argv = ["--config", "c.py", "--coordinator", "h:1", "--num-processes", "2", "a.b=1", "c.d=2"]
    assert launch.main([*argv, "--process-id", "5"]) == 2
    assert "CPPO_PROCESS_ID=5 is invalid for CPPO_NUM_PROCESSES=2" in capsys.readouterr().err


def test_warm_start_is_not_run_by_every_process(tmp_path, monkeypatch):
    from cppo_jax import launch
    from cppo_jax.config.choices import ConfigError
    from cppo_jax.config.files import load_config

    target = tmp_path / "warm"
    cfg = load_config(ROOT / "configs" / "tiny_cpu.py", [f"model.init_checkpoint={target}"])
    monkeypatch.setattr(distributed, "process_count", lambda: 2)
    with pytest.raises(
        ConfigError, match=r"2 processes would each run the warm start.*tiny_sft\.py"
    ):
        launch.ensure_warm_start(cfg)
    assert not target.exists()


# ---------------------------------------------------------------------------------------------
# Two processes on localhost
# ---------------------------------------------------------------------------------------------


def _train_worker(model_dir: str, out_dir: str, result: str) -> None:
    """Runs in each subprocess: connect (from CPPO_* variables), train, save, export, write params."""
    plan = distributed.initialize()
    import jax
    from flax import nnx
    from test_trainer import small_config

    from cppo_jax.models import save_hf
    from cppo_jax.train.trainer import Trainer

    cfg = small_config(Path(out_dir), Path(model_dir), *OVERRIDES)
    trainer = Trainer(cfg)
    try:
        for step in range(3):  # Trainer.step, not train(): no evaluation (its compile) needed here
            trainer.host.log.metrics(trainer.step(step))
        trainer.save(3)
        model = nnx.merge(trainer.actor.graphdef, trainer.params)
        save_hf(model, trainer.host.out_dir / "export", tokenizer_dir=trainer.data.tokenizer.path)
    finally:
        trainer.close()
    flat = jax.tree_util.tree_flatten_with_path(trainer.params)[0]
    host = distributed.to_host([leaf for _, leaf in flat])  # every process joins the gather
    rollout = _rollout_server_check(trainer)
    export = _export_check(out_dir) if jax.process_count() > 1 else None
    info = {
        "plan": None if plan is None else plan.source,
        "processes": jax.process_count(),
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "rewards": [row["reward"] for row in trainer.host.log.history],
        "losses": [row["loss"] for row in trainer.host.log.history],
        "grad_norms": [row["grad_norm"] for row in trainer.host.log.history],
        "rollout": rollout,
        "export": export,
    }
    if distributed.is_main():
        names = [jax.tree_util.keystr(path) for path, _ in flat]
        np.savez(result + ".npz", **dict(zip(names, host)))
    Path(f"{result}.{jax.process_index()}.json").write_text(json.dumps(info))


class _FakeServer:
    """Stands in for the vLLM backend on process 0: completions computed from prompts and seeds."""

    def __init__(self, columns: int):
        self.columns = columns
        self.pushed: list[tuple[int, float]] = []

    def generate(self, params, prompt_QP, prompt_valid_QP, seeds_Q, num_samples):
        from cppo_jax.rollout.embedded.sampling import Samples

        tokens = _fake_tokens(prompt_QP, seeds_Q, num_samples, self.columns)
        N, C = tokens.shape
        ones = np.ones((N, C), bool)
        return Samples(tokens, np.zeros((N, C), np.float32), ones, ones[:, 0], np.int32(C))

    def greedy(self, params, prompt_QP, prompt_valid_QP, max_new_tokens=None):
        seeds = np.zeros(prompt_QP.shape[0], np.int64)
        return self.generate(params, prompt_QP, prompt_valid_QP, seeds, 1)

    def wait_ready(self):
        pass

    def sync_weights(self, params, step):
        import jax

        from cppo_jax.rollout.vllm.client import RolloutServerError

        if step == 99:
            raise RolloutServerError("the server is down")
        total = float(sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree.leaves(params)))
        self.pushed.append((step, total))
        return {"weight_sync/bytes": 1.0}

    def close(self):
        pass


def _fake_tokens(prompt_QP, seeds_Q, G, C) -> np.ndarray:
    base = prompt_QP.astype(np.int64).sum(axis=1) + 7 * np.asarray(seeds_Q, np.int64)
    tokens = base[:, None, None] + np.arange(G)[None, :, None] + 3 * np.arange(C)[None, None, :]
    return (tokens % 50).reshape(-1, C).astype(np.int32)


def _rollout_server_check(trainer) -> dict:
    """Process 0 alone talks to the (fake) server; every process gets its completions."""
    from cppo_jax.rollout.multiprocess import MainProcessBackend
    from cppo_jax.rollout.vllm.client import RolloutServerError

    fake = _FakeServer(columns=5)
    backend = MainProcessBackend(
        fake, dataclasses.replace(trainer.rollout.sp, max_new_tokens=5), trainer.mesh
    )
    out = {"sync": backend.sync_weights(trainer.params, 3)}
    prompts = np.arange(4 * 6, dtype=np.int32).reshape(4, 6)
    seeds = np.arange(4, dtype=np.uint32) + 11
    mesh = trainer.mesh
    args = [distributed.rows(x, mesh) for x in (prompts, np.ones((4, 6), bool), seeds)]
    samples = backend.generate(trainer.params, *args, 2)
    out["tokens"] = distributed.to_host(samples.tokens_NC).tolist()
    out["tokens_spec"] = str(samples.tokens_NC.sharding.spec)
    greedy = backend.greedy(trainer.params, *args[:2])
    out["greedy"] = distributed.to_host(greedy.tokens_NC).tolist()
    out["pushed"] = fake.pushed
    try:
        backend.sync_weights(trainer.params, 99)
    except RolloutServerError as e:
        out["failure"] = str(e)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(devices: int, args: list[str], extra_env: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CPPO_", "JAX_", "SLURM_"))}
    env.update(
        XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
        JAX_PLATFORMS="cpu",
        **extra_env,
    )
    code = (
        "import sys; sys.path.insert(0, 'tests'); import test_distributed as t; "
        f"t._train_worker(*{args!r})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributed")
    port = _free_port()
    multi = [
        _spawn(
            2,
            [str(MODEL), str(tmp / "multi"), str(tmp / "multi")],
            {
                "CPPO_COORDINATOR": f"127.0.0.1:{port}",
                "CPPO_NUM_PROCESSES": "2",
                "CPPO_PROCESS_ID": str(i),
            },
        )
        for i in range(2)
    ]
    single = _spawn(4, [str(MODEL), str(tmp / "single"), str(tmp / "single")], {})
    _wait([*multi, single])
    return tmp


@pytest.mark.slow
def test_two_processes_train_like_one(two_process_runs):
    tmp = two_process_runs
    infos = [json.loads((tmp / f"multi.{i}.json").read_text()) for i in range(2)]
    ref = json.loads((tmp / "single.0.json").read_text())
    assert [i["processes"] for i in infos] == [2, 2] and ref["processes"] == 1
    assert [i["plan"] for i in infos] == ["explicit", "explicit"] and ref["plan"] is None
    assert [i["devices"] for i in infos] == [4, 4] and ref["devices"] == 4
    assert [i["local_devices"] for i in infos] == [2, 2]
    # The same completions and rewards on both processes and in the reference (same seeds).
    assert infos[0]["rewards"] == infos[1]["rewards"] == ref["rewards"]
    assert max(ref["grad_norms"]) > 0, ref  # there was something to learn
    assert np.allclose(infos[0]["losses"], ref["losses"], atol=TOL)
    got, want = np.load(tmp / "multi.npz"), np.load(tmp / "single.npz")
    assert sorted(got.files) == sorted(want.files) and len(got.files) > 5
    errs = {k: float(np.max(np.abs(got[k] - want[k]))) for k in want.files}
    print("max |multi - single| per parameter:", max(errs.values()))
    assert max(errs.values()) < TOL, errs
    # And 3 steps trained something: the params left their starting point.
    import jax
    from flax import nnx

    from cppo_jax.models import load_hf

    start = nnx.state(load_hf(MODEL), nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(start)[0]
    start = {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}
    assert sorted(start) == sorted(want.files)
    assert max(float(np.max(np.abs(start[k] - want[k]))) for k in want.files) > 1e-4


@pytest.mark.slow
def test_only_process_0_talks_to_the_rollout_server(two_process_runs):
    tmp = two_process_runs
    main, other = (json.loads((tmp / f"multi.{i}.json").read_text())["rollout"] for i in range(2))
    prompts = np.arange(4 * 6).reshape(4, 6)
    seeds = np.arange(4) + 11
    want = _fake_tokens(prompts, seeds, 2, 5).tolist()
    assert main["tokens"] == other["tokens"] == want  # process 1 got process 0's completions
    assert main["tokens_spec"] == other["tokens_spec"] == "P(('data', 'fsdp'),)"
    assert main["greedy"] == other["greedy"] == _fake_tokens(prompts, np.zeros(4), 1, 5).tolist()
    # One push, from process 0, of the whole (gathered) params; the other process pushed nothing.
    params = np.load(tmp / "multi.npz")
    total = sum(float(np.abs(params[k].astype(np.float64)).sum()) for k in params.files)
    assert len(main["pushed"]) == 1 and main["pushed"][0][0] == 3
    assert main["pushed"][0][1] == pytest.approx(total, rel=1e-9)
    assert (
        other["pushed"] == [] and other["sync"] == {} and main["sync"] == {"weight_sync/bytes": 1.0}
    )
    # A server failure on process 0 stops both processes (no one waits forever in a collective).
    assert main["failure"] == "the server is down"
    assert "failed on process 0" in other["failure"]


@pytest.mark.slow
def test_only_process_0_writes(two_process_runs):
    run = two_process_runs / "multi" / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # one writer: each step once
    assert (run / "config.json").is_file()
    # The export gathers the params from both processes; process 0 writes them, whole.
    from cppo_jax.models import load_hf

    exported = load_hf(run / "export")
    got = np.load(two_process_runs / "multi.npz")
    embed = np.asarray(exported.embed_VD.get_value())
    assert np.array_equal(embed, got["['embed_VD'].value"])
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [3]


def _track_gathers() -> dict:
    """Counts the bytes of gathered arrays alive at once (each gather's result, until it is freed):
    every cross-process gather goes through `multihost_utils.process_allgather`."""
    import weakref

    from jax.experimental import multihost_utils

    seen = {"live": 0, "peak": 0}
    gather = multihost_utils.process_allgather

    def tracked(x, *args, **kwargs):
        out = gather(x, *args, **kwargs)
        n = out.nbytes
        seen["live"] += n
        seen["peak"] = max(seen["peak"], seen["live"])
        weakref.finalize(out, lambda: seen.__setitem__("live", seen["live"] - n))
        return out

    multihost_utils.process_allgather = tracked
    return seen


def _export_check(out_dir: str) -> dict:
    """Each of the two processes: a ~28 MB float32 model split over both processes' devices
    (fsdp = 4), then save_hf to out_dir/big_export; the most bytes of gathered arrays it held at
    once."""
    import jax
    from flax import nnx

    from cppo_jax.config.run import MeshConfig
    from cppo_jax.models import TransformerConfig, init_model, save_hf
    from cppo_jax.parallel import sharding

    cfg = TransformerConfig(
        arch="qwen2",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=768,
        num_layers=8,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
    )
    graphdef, params = nnx.split(init_model(cfg, 0))
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=4, tensor=1))
    params = sharding.shard_params(params, mesh)
    leaves = jax.tree.leaves(params)
    model = nnx.merge(graphdef, params)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    largest = max(x.size * x.dtype.itemsize for x in leaves)
    # The arrays split over both processes (the replicated ones are read where they are).
    spread = sum(x.size * x.dtype.itemsize for x in leaves if not x.is_fully_replicated)
    assert all(not x.is_fully_addressable for x in leaves if x.ndim > 1)
    seen = _track_gathers()
    save_hf(model, Path(out_dir) / "big_export")
    return {"held": seen["peak"], "total": total, "spread": spread, "largest": largest}


@pytest.mark.slow
def test_an_export_gathers_the_model_on_process_0_alone(two_process_runs):
    """save_hf with several processes: process 0 holds the whole model and writes it; the other
    process joins the gathers one array at a time and drops each: it never holds more than the
    largest array (a gather of the whole tree on every process held a model copy on each)."""
    infos = [json.loads((two_process_runs / f"multi.{i}.json").read_text()) for i in range(2)]
    main, other = (info["export"] for info in infos)
    total, largest = main["total"], main["largest"]
    assert largest < total / 4  # one array at a time is well under a model copy
    assert main["spread"] > 0.99 * total
    assert main["held"] >= main["spread"]  # process 0 gathers the whole model (the count sees it)
    assert other["held"] <= largest, (other, total)  # the other one a single array at a time
    from cppo_jax.models import load_hf

    exported = load_hf(two_process_runs / "multi" / "big_export")  # process 0 wrote the whole model
    assert exported.cfg.num_layers == 8 and exported.embed_VD.get_value().shape == (1024, 256)
