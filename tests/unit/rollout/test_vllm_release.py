"""The engine's lifetime (`Objective.release`, called from the loop's `finally`), without vLLM: a
server rayft started -- here a real process standing in for it, its HTTP side a loopback stand-in --
is stopped when `train()` raises; a user's `rollout.vllm_url` engine is asked to unload the run's
last adapter version when `train()` returns (a later run or a resume loads its own names there).
tests/integration/test_vllm_engine.py checks the same with a real vLLM server, and the resume."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from gradtools import ROOT
from grpo_rollouts import save_tiny_base

from jobs.errors import RunError
from jobs.model.loading import byte_tokenizer
from jobs.rollout.vllm_server import VLLMServer
from jobs.spec import load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train

SPEC = ROOT / "examples" / "tiny-grpo.yaml"
EOS = byte_tokenizer().eos_token_id


def stand_in(refuse_loads: bool):
    """A loopback vLLM stand-in: adapter loads answered (or refused), completions [5, 6, EOS] with
    log-probs; returns (server, url, the (path, body) pairs it got)."""
    got: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # /health
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, body))
            status, reply = answer(self.path)
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    def answer(path: str) -> tuple[int, dict]:
        if path == "/v1/completions":
            return 200, {"choices": [{"token_ids": [5, 6, EOS], "logprobs": {"token_logprobs": [-1.0, -2.0, -0.5]}}]}
        if refuse_loads and path == "/v1/load_lora_adapter":
            return 400, {"error": {"message": "no adapter there"}}
        return 200, {}

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", got


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny_base(tmp_path_factory.mktemp("tiny-base"))


def spec_for(base: Path, out: Path, *more: str):
    return load_spec(
        SPEC,
        [
            f"model.name={base}",
            "resources.num_workers=1",
            "data.max_seq_len=96",
            "rollout.max_completion_length=8",
            "batch.global_batch_size=8",
            "batch.micro_batch_size=8",
            "lora.r=4",
            "run.max_steps=1",
            "run.checkpoint_every=0",
            f"reward.functions=[{{fn: '{ROOT / 'tests' / 'helpers' / 'rewards_tiny.py'}:ids_mod_5'}}]",
            "rollout.engine=vllm",
            f"run.output_dir={out}",
            *more,
        ],
    )


def test_the_server_rayft_started_is_stopped_when_train_raises(base, tmp_path, monkeypatch):
    env = tmp_path / "vllm-env"  # what the spec checks of vLLM's environment (the start is stood in for)
    for f in ("bin/python", "lib/libiomp5.so"):
        (env / f).parent.mkdir(parents=True, exist_ok=True)
        (env / f).write_text("")
    monkeypatch.setenv("RAYFT_VLLM_ENV", str(env))
    http, url, _ = stand_in(refuse_loads=True)
    started: list[VLLMServer] = []

    def start(cls, settings):
        process = subprocess.Popen(["sleep", "300"], start_new_session=True)
        started.append(cls(process, url, tmp_path / "logs" / "server.log"))
        return started[0]

    monkeypatch.setattr(VLLMServer, "start", classmethod(start))
    with pytest.raises(RunError, match=r"^vLLM engine at .* refused loading adapter step-0 \(HTTP 400\): no adapter"):
        train(spec_for(base, tmp_path / "out"), LocalContext(on_progress=lambda r: None), resume=False)
    http.shutdown()
    assert started and started[0].process.poll() is not None  # stopped by the release, not left running


def test_a_users_engine_is_asked_to_unload_the_runs_last_version_when_train_returns(base, tmp_path):
    http, url, got = stand_in(refuse_loads=False)
    spec = spec_for(base, tmp_path / "out", f"rollout.vllm_url={url}")
    train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    http.shutdown()
    adapters = [(path, body["lora_name"]) for path, body in got if "lora_adapter" in path]
    assert adapters == [("/v1/load_lora_adapter", "step-0"), ("/v1/unload_lora_adapter", "step-0")]
    lines = (spec.output_path / "rollouts" / "step-000001.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["engine_logprobs"] == [-1.0, -2.0, -0.5]
    metrics = json.loads((spec.output_path / "metrics.jsonl").read_text())
    assert metrics["engine_logprob_gap/max"] >= metrics["engine_logprob_gap/mean"] > 0
