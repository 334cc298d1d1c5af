"""The benchmark scripts run end to end in their --quick mode (tiny sizes) and write their reports."""

from __future__ import annotations

import importlib.util
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
