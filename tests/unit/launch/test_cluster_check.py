"""`--address` where no Ray cluster answers: one line, exit 2, before anything is created, and in
bounded time. `rayft run --address 127.0.0.1:1` used to wait for minutes after claiming its
output directory, and an HTTP server on the port (or `auto` finding a frozen cluster) hung
`rayft data prepare` too."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from gradtools import DATA, ROOT

from orchestrator.cli import main

SPEC = ["examples/tiny-lora.yaml", f"data.path={DATA}", "data.eval_path=null", "run.max_steps=1"]


@pytest.fixture
def http_port():
    """An HTTP server on 127.0.0.1: it accepts connections, but is no Ray GCS."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def _refused(capsys, args: list[str], fragment: str, out) -> float:
    t0 = time.monotonic()
    rc = main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert fragment in lines[0], lines[0]
    assert not out.exists(), "nothing may be created before the cluster answers"
    return time.monotonic() - t0


def test_a_closed_port_is_refused_before_the_output_dir_is_made(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = ["run", *SPEC, f"run.output_dir={out}", "--address", "127.0.0.1:1"]
    assert _refused(capsys, args, "--address 127.0.0.1:1: no Ray cluster answers", out) < 30


@pytest.mark.parametrize("command", ["run", "data prepare"])
def test_something_that_is_not_ray_on_the_port_is_refused_in_bounded_time(
    tmp_path, capsys, monkeypatch, http_port, command
):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("RAYFT_PROBE_TIMEOUT_S", "8")
    out = tmp_path / "out"
    args = [*command.split(), *SPEC, f"run.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}"]
    args += ["--address", f"127.0.0.1:{http_port}"]
    elapsed = _refused(capsys, args, f"--address 127.0.0.1:{http_port}: no Ray cluster answer", out)
    assert elapsed < 60
    assert not (tmp_path / "cache").exists()


def test_an_address_that_is_not_host_port_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    _refused(capsys, ["run", *SPEC, f"run.output_dir={out}", "--address", "http://x"], "not HOST:PORT", out)
