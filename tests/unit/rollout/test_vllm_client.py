"""`VLLMEngine`, the client side of `rollout.engine: vllm`, against stand-in HTTP servers (no vLLM
here: tests/integration/test_vllm_engine.py runs the real one): what one completion's request
carries (the prompt's ids, its own seed, `rollout.*`, the version of the step), the ids and the
engine's log-probs taken from the answer and cut at the first EOS, and each failure -- a refusal,
no answer within the timeout, nothing listening -- as one line naming the engine."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jobs.errors import RunError
from jobs.rollout.engine import Request, Sampling
from jobs.rollout.vllm_engine import VLLMEngine, shown_url

EOS = 258


def serve(answer):
    """A loopback HTTP server whose POSTs get `answer(path, body) -> (status, reply)`; the bodies it got."""
    got: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append(body)
            status, reply = answer(self.path, body)
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", got


def choice(ids: list[int]) -> dict:
    return {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5 * (i + 1) for i in range(len(ids))]}}]}


def test_each_completion_asks_with_its_prompt_ids_and_seed_and_keeps_the_engines_ids_up_to_eos():
    answers = {11: [5, 6, EOS, 7], 12: [1, 2, 3]}
    server, url, got = serve(lambda path, body: (200, choice(answers[body["seed"]])))
    engine = VLLMEngine(url, 10, [EOS])
    engine.version = "step-3"
    done = engine.generate([Request(0, 0, (1, 2), 11), Request(4, 1, (9,), 12)], Sampling(3, 0.9, 0.8, 5))
    server.shutdown()
    assert [(c.prompt_index, c.sample_index, c.ids, c.truncated) for c in done] == [
        (0, 0, (5, 6, EOS), False),
        (4, 1, (1, 2, 3), True),
    ]
    assert done[0].logprobs == (-0.5, -1.0, -1.5)
    first = sorted(got, key=lambda b: b["seed"])[0]
    assert first == {
        "model": "step-3",
        "prompt": [1, 2],
        "max_tokens": 3,
        "temperature": 0.9,
        "top_p": 0.8,
        "top_k": 5,
        "seed": 11,
        "stop_token_ids": [EOS],
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


def test_a_refused_adapter_is_one_line_with_what_the_engine_said():
    said = {"error": {"message": "Loading lora step-2 failed:\n No adapter found", "code": 404}}
    server, url, _ = serve(lambda path, body: (404, said))
    with pytest.raises(RunError) as e:
        VLLMEngine(url, 10, [EOS]).load("step-2", "/tmp/x")
    server.shutdown()
    assert str(e.value) == (
        f"vLLM engine at {url} refused loading adapter step-2 (HTTP 404): Loading lora step-2 failed: No adapter found"
    )


def test_an_engine_that_hangs_is_one_line_naming_the_timeout():
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        engine = VLLMEngine(f"http://127.0.0.1:{silent.getsockname()[1]}", 0.3, [EOS])
        engine.version = "step-0"
        with pytest.raises(RunError, match=r"did not answer /v1/completions within rollout.vllm_timeout_s=0.3 s$"):
            engine.generate([Request(0, 0, (1,), 1)], Sampling(2))


def test_nothing_listening_is_one_line_naming_the_engine():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RunError, match=rf"^vLLM engine at http://127\.0\.0\.1:{port}: /health failed: .*refused"):
        VLLMEngine(f"http://127.0.0.1:{port}", 5, [EOS]).check()


def test_an_error_line_never_shows_credentials_in_the_url():
    assert shown_url("http://user:secret@host:8000/v1/?key=k") == "http://host:8000/v1"


def test_an_answer_without_the_sampled_tokens_log_probs_is_one_line():
    server, url, _ = serve(lambda path, body: (200, {"choices": [{"token_ids": [5, 6, EOS]}]}))
    engine = VLLMEngine(url, 10, [EOS])
    engine.version = "step-0"
    with pytest.raises(RunError, match=r"^vLLM engine at http://127\.0\.0\.1:\d+ returned 0 log-probs for 3 sampled"):
        engine.generate([Request(0, 0, (1, 2), 11)], Sampling(4))
    server.shutdown()
