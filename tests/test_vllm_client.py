"""The vLLM client and adapter against a small misbehaving HTTP server on 127.0.0.1 (no real vLLM).

Faults: 5xx (retried, then a clear error), connection refused, a server that accepts and never answers (read
timeout), fewer choices than asked, malformed JSON, wrong token counts, answers out of order, 4xx; plus the
Authorization header, the mapping of choices to `Samples`, and the probe check's error message.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from cppo_jax.rollout.vllm.client import (
    RESET_PREFIX_CACHE,
    Completion,
    ResponseError,
    RolloutServerError,
    VLLMClient,
    WeightSyncError,
)

EOS = 2


class _Server(ThreadingHTTPServer):
    """A listen backlog like a real server's (uvicorn: 2048), not socketserver's 5: the client sends a
    step's requests at once, and on a loaded machine a full backlog drops connection attempts, whose
    retry a second later outlasts the tests' 1 s timeouts (a flaky connect timeout, not a fault)."""

    request_queue_size = 128


class FakeVLLM:
    """A loopback HTTP server that answers like vLLM, or misbehaves as `mode` says.

    Modes: "ok", "500" (every request), "500x2" (the first two requests of each route), "few" (one
    choice fewer), "malformed" (not JSON), "count" (token_ids and logprobs of different lengths),
    "long" (more tokens than max_tokens), "shuffled" (choices in reverse order, with indices),
    "wrong_prompt" (echoes another prompt), "401", "no_dev" (404 on dev routes), "starting" (a server
    still loading: HTTP 503 on every route until /health has answered 503 twice, then "ok").
    """

    def __init__(self, mode: str = "ok"):
        self.mode = mode
        self.requests: list[tuple[str, str, dict, dict | None]] = []
        self.counts: dict[str, int] = {}
        self.prompt_logprobs: list | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str):
                n = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(n)) if n else None
                fake.requests.append((method, self.path, dict(self.headers), payload))
                count = fake.counts[self.path] = fake.counts.get(self.path, 0) + 1
                status, body = fake.answer(method, self.path, payload, count)
                self._send(status, body)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def answer(self, method, path, payload, count):
        mode = self.mode
        if mode == "500" or (mode == "500x2" and count <= 2):
            return 500, {"error": "internal"}
        if mode == "401":
            return 401, {"error": "Unauthorized"}
        if mode == "starting" and self.counts.get("/health", 0) <= 2:
            return 503, {"error": "loading"}
        if path == "/health":
            return 200, b""
        if path == "/v1/models":
            return 200, {"data": [{"id": "/models/tiny"}]}
        if path in ("/collective_rpc", RESET_PREFIX_CACHE):
            if mode == "no_dev":
                return 404, {"detail": "Not Found"}
            return 200, {"results": [None]} if path == "/collective_rpc" else b""
        if path != "/v1/completions":
            return 404, {"detail": "Not Found"}
        if mode == "malformed":
            return 200, b'{"choices": [ {"token_ids": [1, 2'
        return 200, {"choices": self.choices(payload)}

    def choices(self, payload):
        prompts, n, max_tokens = payload["prompt"], payload["n"], payload["max_tokens"]
        end = (payload.get("stop_token_ids") or [EOS])[0]  # as vLLM, end on an id it was sent
        out = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                # Deterministic: sample j of a prompt is (prompt length + j) % 3 + 1 tokens long, then
                # an end id; an odd j runs into max_tokens instead.
                length = (len(prompt) + j) % 3 + 1
                if j % 2:
                    ids, reason = [10 + j] * max_tokens, "length"
                else:
                    ids, reason = [10 + p] * (min(length, max_tokens) - 1) + [end], "stop"
                lps = [-0.5 - 0.01 * k for k in range(len(ids))]
                choice = {
                    "index": p * n + j,
                    "text": "",
                    "token_ids": ids,
                    "prompt_token_ids": prompt,
                    "logprobs": {"token_logprobs": lps, "tokens": [""] * len(ids)},
                    "finish_reason": reason,
                }
                if payload.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs or [None] + [
                        {str(t): {"logprob": -1.0, "rank": 1}} for t in prompt[1:]
                    ]
                out.append(choice)
        if self.mode == "few":
            out = out[:-1]
        elif self.mode == "count":
            out[0]["logprobs"]["token_logprobs"].append(-1.0)
        elif self.mode == "long":
            out[0]["token_ids"] = out[0]["token_ids"] + [5] * (max_tokens + 1)
            out[0]["logprobs"]["token_logprobs"] += [-1.0] * (max_tokens + 1)
        elif self.mode == "shuffled":
            out = out[::-1]
        elif self.mode == "wrong_prompt" and len(out) > 1:
            out[0]["prompt_token_ids"] = prompts[-1] + [7]
        return out

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake(request):
    server = FakeVLLM(getattr(request, "param", "ok"))
    yield server
    server.close()


def _client(url, **kw) -> VLLMClient:
    kw.setdefault("retries", 2)
    kw.setdefault("backoff_s", 0.05)
    kw.setdefault("timeout_s", 5.0)
    return VLLMClient(url, **kw)


PROMPTS = [[5, 6, 7], [8, 9], [11, 12, 13, 14]]


def test_completions_in_prompt_order(fake):
    client = _client(fake.url)
    groups = client.generate(PROMPTS, n=4, max_tokens=5, seeds=[0, 4, 8], stop_token_ids=[EOS])
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    for group in groups:
        for j, c in enumerate(group):
            if j % 2:
                assert c.finish_reason == "length" and len(c.token_ids) == 5
            else:
                assert c.finish_reason == "stop" and c.token_ids[-1] == EOS
    # One request per prompt, seeded as asked, with the fields vLLM needs.
    sent = [r[3] for r in fake.requests if r[1] == "/v1/completions"]
    assert sorted(s["seed"] for s in sent) == [0, 4, 8]
    for s in sent:
        assert s["model"] == "/models/tiny" and s["n"] == 4 and s["logprobs"] == 0
        assert s["return_token_ids"] is True and s["skip_special_tokens"] is False
        assert s["stop_token_ids"] == [EOS] and len(s["prompt"]) == 1
    client.close()


@pytest.mark.parametrize("fake", ["shuffled"], indirect=True)
def test_choices_mapped_back_by_index(fake):
    (groups,) = [_client(fake.url).complete(PROMPTS, n=2, max_tokens=4)]
    for p, group in enumerate(groups):
        assert group[0].token_ids[0] == 10 + p or group[0].token_ids == (EOS,)


@pytest.mark.parametrize("fake", ["wrong_prompt"], indirect=True)
def test_out_of_order_answer_is_an_error(fake):
    with pytest.raises(ResponseError, match="echoes a different prompt"):
        _client(fake.url).complete(PROMPTS, n=2, max_tokens=4)


@pytest.mark.parametrize(
    ("fake", "match"),
    [
        ("few", r"asked for 6 completions \(3 prompts x n=2\), got 5"),
        ("malformed", "malformed JSON"),
        ("count", "token ids but"),
        ("long", "tokens with finish_reason"),
    ],
    indirect=["fake"],
)
def test_incomplete_answers_are_errors(fake, match):
    client = _client(fake.url)
    with pytest.raises(ResponseError, match=match) as info:
        client.complete(PROMPTS, n=2, max_tokens=4)
    assert fake.url in str(info.value)
    # Never retried: the answer is wrong, not the connection.
    assert fake.counts["/v1/completions"] == 1


@pytest.mark.parametrize("fake", ["500"], indirect=True)
def test_5xx_retried_then_clear_error(fake):
    client = _client(fake.url, retries=3, backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError) as info:
        client.reload_weights("/tmp/w")
    msg = str(info.value)
    assert fake.url in msg and "HTTP 500" in msg and "4 times" in msg and "/tmp/w" in msg
    assert fake.counts["/collective_rpc"] == 4
    assert time.monotonic() - t0 < 5  # backoff 0.05 + 0.1 + 0.2


@pytest.mark.parametrize("fake", ["500x2"], indirect=True)
def test_transient_5xx_recovers(fake):
    client = _client(fake.url, retries=3)
    assert client.complete([[5, 6]], n=2, max_tokens=3)[0][0].finish_reason == "stop"
    assert fake.counts["/v1/completions"] == 3


@pytest.mark.parametrize("fake", ["401"], indirect=True)
def test_4xx_not_retried(fake):
    with pytest.raises(RolloutServerError, match="HTTP 401 .*api_key"):
        _client(fake.url, model="m").complete([[5]], n=1, max_tokens=2)
    assert fake.counts["/v1/completions"] == 1


@pytest.mark.parametrize("fake", ["no_dev"], indirect=True)
def test_missing_dev_routes_explained(fake):
    with pytest.raises(RolloutServerError, match="VLLM_SERVER_DEV_MODE=1"):
        _client(fake.url).reset_prefix_cache()


def test_api_key_sent_as_bearer(fake):
    _client(fake.url, api_key="s3cret").complete([[5]], n=1, max_tokens=2)
    _client(fake.url).reset_prefix_cache()
    headers = [{k.lower(): v for k, v in r[2].items()} for r in fake.requests]
    keyed = [h for h, r in zip(headers, fake.requests) if r[1] != RESET_PREFIX_CACHE]
    assert keyed and all(h.get("authorization") == "Bearer s3cret" for h in keyed)
    assert "authorization" not in headers[-1]


def test_connection_refused_is_fast_and_clear():
    port = _unused_port()
    url = f"http://127.0.0.1:{port}"
    client = _client(url, retries=2, backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError) as info:
        client.complete([[5]], n=1, max_tokens=2)
    msg = str(info.value)
    assert url in msg and "3 times" in msg and "Connection" in msg and "running" in msg
    assert info.value.url == url
    assert time.monotonic() - t0 < 3
    assert not client.health()


def test_server_that_never_answers_times_out():
    """Accepts the connection (the listen backlog does), reads nothing, answers nothing."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        client = _client(url, timeout_s=0.5, retries=3, model="m")
        t0 = time.monotonic()
        with pytest.raises(
            RolloutServerError, match=r"did not answer within the read timeout of 0.5 s"
        ):
            client.complete([[5]], n=1, max_tokens=2)
        assert time.monotonic() - t0 < 3  # a read timeout is not retried


@pytest.mark.parametrize("fake", ["starting"], indirect=True)
def test_the_first_request_waits_for_a_server_still_starting(fake, capsys):
    """`startup_wait_s` (rollout.server_wait_s): the first request waits until /health answers 200,
    then goes through without a retry; later requests do not ask /health again. Without the wait the
    same server fails the request."""
    with pytest.raises(RolloutServerError, match="HTTP 503"):
        _client(fake.url, retries=0, model="m").complete([[5]], n=1, max_tokens=2)
    fake.requests.clear()
    client = _client(fake.url, retries=0, startup_wait_s=30.0)
    client.complete([[5]], n=1, max_tokens=2)
    client.complete([[6]], n=1, max_tokens=2)
    paths = [r[1] for r in fake.requests]
    assert paths == ["/health"] * 3 + ["/v1/models", "/v1/completions", "/v1/completions"], paths
    err = capsys.readouterr().err
    assert f"waiting up to 30 s for the vLLM server at {fake.url}" in err
    assert f"{fake.url} answered after " in err


def test_a_server_that_never_starts_fails_after_the_wait():
    url = f"http://127.0.0.1:{_unused_port()}"
    client = _client(url, startup_wait_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError) as info:
        client.complete([[5]], n=1, max_tokens=2)
    waited = time.monotonic() - t0
    msg = str(info.value)
    assert url in msg and "within 1.5 s" in msg and "rollout.server_wait_s" in msg, msg
    assert info.value.url == url
    # One more poll (1 s) at most after the deadline, then the error: no retries after the wait.
    assert 1.5 <= waited < 1.5 + 5


def test_bad_url_rejected():
    with pytest.raises(ValueError, match="vllm_url"):
        VLLMClient("127.0.0.1:8011")


def test_client_and_server_helper_import_no_jax():
    code = (
        "import sys, cppo_jax.rollout.vllm.client, cppo_jax.rollout.vllm.server; "
        "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules), 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# The adapter (JAX side): Samples layout and the probe check's message.


def _sp(**kw):
    from cppo_jax.rollout.embedded.sampling import SamplingParams

    return SamplingParams(**{"max_new_tokens": 5, "eos_id": EOS, "pad_id": 0, **kw})


def test_samples_layout():
    from cppo_jax.rollout.vllm.backend import samples_from_completions

    groups = [
        [
            Completion((7, 8, EOS), (-0.1, -0.2, -0.3), "stop"),
            Completion((9,) * 5, (-1.0,) * 5, "length"),
        ],
        [Completion((EOS,), (-0.5,), "stop"), Completion((4, 4, 4, 4, EOS), (-0.4,) * 5, "stop")],
    ]
    s = samples_from_completions(groups, 2, _sp())
    tokens, logp, valid, finished = (np.asarray(x) for x in s[:4])
    assert int(s.steps) == 5  # one sequence ran to C
    assert tokens.shape == (4, 5) and tokens.dtype == np.int32 and logp.dtype == np.float32
    np.testing.assert_array_equal(
        tokens, [[7, 8, EOS, 0, 0], [9] * 5, [EOS, 0, 0, 0, 0], [4, 4, 4, 4, EOS]]
    )
    np.testing.assert_array_equal(valid.sum(1), [3, 5, 1, 5])
    np.testing.assert_allclose(logp[0], [-0.1, -0.2, -0.3, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(finished, [True, False, True, True])
    # The rule the embedded sampler uses: valid up to and including the first EOS.
    from cppo_jax.rollout.embedded.sampling import completion_ends

    want = completion_ends(np.asarray(s.tokens_NC), EOS)
    np.testing.assert_array_equal(valid, want[0])
    np.testing.assert_array_equal(finished, want[1])
    short = [[Completion((7, EOS), (-0.1, -0.2), "stop"), Completion((EOS,), (-0.3,), "stop")]]
    assert int(samples_from_completions(short, 2, _sp()).steps) == 2


def test_samples_end_at_any_of_several_stop_ids():
    from cppo_jax.rollout.embedded.sampling import completion_ends
    from cppo_jax.rollout.vllm.backend import samples_from_completions

    other = EOS + 1  # a second end id (e.g. <|endoftext|> beside <|im_end|>)
    sp = _sp(eos_id=(EOS, other))
    groups = [
        [Completion((7, other), (-0.1, -0.2), "stop"), Completion((7, EOS), (-0.3,) * 2, "stop")]
    ]
    s = samples_from_completions(groups, 2, sp)
    np.testing.assert_array_equal(
        np.asarray(s.valid_NC), completion_ends(np.asarray(s.tokens_NC), (EOS, other))[0]
    )
    past = Completion((other, 7), (-0.1, -0.2), "length")
    with pytest.raises(ResponseError, match=rf"after EOS \(ids \[{EOS}, {other}\]\) at token 0"):
        samples_from_completions([[past]], 1, sp)


def test_samples_reject_a_finish_reason_the_end_ids_contradict():
    """finished_N comes from the end ids (as the embedded sampler's), so `cppo.mask_truncated`
    treats both backends alike; a server stopping on another id is refused, not guessed at."""
    from cppo_jax.rollout.vllm.backend import samples_from_completions

    stopped = Completion((7, 8), (-0.1, -0.2), "stop")  # 8 is not an end id here
    with pytest.raises(ResponseError, match="finish_reason 'stop', but its end ids .* truncated"):
        samples_from_completions([[stopped]], 1, _sp())
    ended = Completion((7, 7, 7, 7, EOS), (-0.1,) * 5, "length")
    with pytest.raises(ResponseError, match="finish_reason 'length', but its end ids .* finished"):
        samples_from_completions([[ended]], 1, _sp())


def test_samples_reject_incomplete_groups():
    from cppo_jax.rollout.vllm.backend import samples_from_completions

    one = Completion((7, EOS), (-0.1, -0.2), "stop")
    with pytest.raises(ResponseError, match="question 1 came back with 1 completions, expected 2"):
        samples_from_completions([[one, one], [one]], 2, _sp())
    past = Completion((EOS, 7), (-0.1, -0.2), "length")
    with pytest.raises(ResponseError, match="after EOS"):
        samples_from_completions([[past]], 1, _sp())


def _tiny_backend(url, tmp_path, sp=None, **kw):
    from flax import nnx

    from cppo_jax.config.schema import RolloutConfig
    from cppo_jax.models import init_model
    from cppo_jax.rollout.vllm.backend import VLLMBackend
    from tests.helpers import tiny_config

    graphdef, params = nnx.split(init_model(tiny_config(), seed=0))
    cfg = RolloutConfig(backend="vllm", vllm_url=url, timeout_s=5.0)
    client = _client(url)
    backend = VLLMBackend(cfg, graphdef, sp or _sp(), tmp_path, client=client, **kw)
    return backend, params


def test_backend_generate_through_fake_server(fake, tmp_path):
    # Two end ids (the fake server ends on the first): both go to vLLM as stop_token_ids.
    backend, params = _tiny_backend(fake.url, tmp_path, sp=_sp(eos_id=(EOS, 3)))
    backend.synced_step = 0  # the fake server cannot pass the probe check
    prompt_QP = np.array([[0, 0, 5, 6, 7], [0, 0, 0, 8, 9]], np.int32)
    s = backend.generate(params, prompt_QP, prompt_QP > 0, np.array([3, 4], np.uint32), 4)
    assert np.asarray(s.tokens_NC).shape == (8, 5)
    sent = sorted(
        (r[3] for r in fake.requests if r[1] == "/v1/completions"), key=lambda p: p["seed"]
    )
    assert [p["prompt"] for p in sent] == [[[5, 6, 7]], [[8, 9]]]  # left padding stripped
    assert [p["seed"] for p in sent] == [12, 16]  # seeds spaced n = 4 apart
    assert all(p["stop_token_ids"] == [EOS, 3] for p in sent)
    np.testing.assert_array_equal(np.asarray(s.finished_N), [True, False] * 4)
    g = backend.greedy(params, prompt_QP, prompt_QP > 0, max_new_tokens=3)
    assert np.asarray(g.tokens_NC).shape == (2, 3)
    last = [r[3] for r in fake.requests if r[1] == "/v1/completions"][-1]
    assert last["stop_token_ids"] == [EOS, 3] and last["temperature"] == 0.0
    backend.close()


def test_probe_mismatch_names_the_check(fake, tmp_path):
    backend, params = _tiny_backend(fake.url, tmp_path, probe_tol=1e-4)
    with pytest.raises(WeightSyncError) as info:
        backend.sync_weights(params, 7)
    msg = str(info.value)
    assert (
        "step 7" in msg
        and "prompt log-probs" in msg
        and "expected" in msg
        and "got -1.000000" in msg
    )
    assert "max |diff|" in msg and "tolerance 0.0001" in msg and fake.url in msg
    # The push itself happened: written atomically into slot0, reloaded, prefix cache reset.
    rpc = [r[3] for r in fake.requests if r[1] == "/collective_rpc"]
    assert rpc == [
        {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(tmp_path / "weights" / "slot0")},
        }
    ]
    assert fake.counts[RESET_PREFIX_CACHE] == 1
    assert (tmp_path / "weights" / "slot0" / "model.safetensors").is_file()
    assert backend.synced_step is None  # not confirmed
