"""The benchmark scripts run end to end in their --quick mode (tiny sizes) and write their reports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generation_quick(tmp_path):
    rows = load_script("generation").main(["--quick", "--out", str(tmp_path)])
    assert [(r["sequences"], r["new_tokens"]) for r in rows] == [(8, 8)]
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["compile_s"] >= 0
    report = (tmp_path / "generation.md").read_text()
    assert "| sequences N | new tokens C | embedded tokens/s" in report
    assert "| 8 | 8 |" in report and "os.cpu_count()" in report and "JAX " in report
    png = (tmp_path / "generation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_generation_vllm_requests(tmp_path):
    """The --vllm-url path against a stand-in server: one request per question, the fields vLLM needs."""
    import http.server
    import json
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, payload):
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            assert self.path == "/v1/models"
            self.reply({"data": [{"id": "tiny-qwen"}]})

        def do_POST(self):
            assert self.path == "/v1/completions"
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            n, C = body["n"], body["max_tokens"]
            choices = [{"index": i, "text": "", "finish_reason": "length"} for i in range(n)]
            self.reply({"choices": choices, "usage": {"completion_tokens": n * C}})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        gen = load_script("generation")
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert gen.vllm_model_name(url, None, 5.0) == "tiny-qwen"
        prompts = gen.make_prompts(3, 462)
        res = gen.vllm_run(url, "tiny-qwen", prompts, 4, 16, 1, None, 5.0)
    finally:
        server.shutdown()
    assert res["tokens_per_s"] > 0
    assert len(seen) == 1 + len(prompts)  # a warm-up request, then one per question
    for body in seen:
        assert body["model"] == "tiny-qwen" and body["n"] == 4 and body["max_tokens"] == 16
        assert body["ignore_eos"] is True and body["temperature"] == 1.0
    assert sorted(map(tuple, (b["prompt"] for b in seen[1:]))) == sorted(map(tuple, prompts))


def test_vs_trl_quick(tmp_path):
    """TRL's GRPOTrainer and cppo_jax (GRPO, CPPO) on a tiny model: both sides' rows, positive times.

    Builds TRL's environment (~/.cache/cppo_jax/venv-trl-<version>) on first use: about 4-5 minutes once.
    """
    vs_trl = load_script("vs_trl")
    res = vs_trl.main(["--quick", "--out", str(tmp_path)])
    size = vs_trl.QUICK
    for side in ("trl", "grpo", "cppo"):
        assert len(res["rows"][side]) == size["steps"], side
        for phase in ("rollout", "training", "step"):
            assert res[side][phase] > 0, (side, phase)
        for row in res["rows"][side]:  # the phases lie inside the step
            assert row["step"] >= row["rollout"] + row["reward"] + row["training"], (side, row)
    k = int(size["group"] * (1 - size["pruning_rate"]))
    assert res["cppo_kept"] == size["questions"] * k
    assert [r["kept"] for r in res["rows"]["grpo"]] == [size["questions"] * size["group"]] * size[
        "steps"
    ]
    report = (tmp_path / "vs_trl.md").read_text()
    assert "| TRL GRPOTrainer, GRPO (torch " in report
    assert "| cppo_jax, GRPO (p = 0) |" in report and "| cppo_jax, CPPO (p = 0.5) |" in report
    assert "TRL 1.13.0" in report and "os.cpu_count()" in report and "JAX " in report
    assert report.count("| met |") + report.count("| **missed** |") == 2
    png = (tmp_path / "vs_trl.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    raw = json.loads((tmp_path / "vs_trl.json").read_text())
    assert len(raw["results"]["rows"]["trl"]) == size["steps"]
