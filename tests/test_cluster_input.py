"""Careless and hostile input on the cluster side: a cluster that accepts and never answers, an
address that cannot be one, credentials or policy breaks that reach rendered manifests outside
the spec, and the queue database (permissions, read-only reads, corruption, bad arguments).
Every refusal is one line on stderr with exit code 2, never a traceback. No cluster is needed."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[1]
SPEC = "examples/tiny-lora.yaml"
FAKE_GH = "ghp_" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"      # GitHub-token-shaped, not a real one


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts connections and never answers a byte. It stops by
    itself after `lifetime_s` (so a test that hangs cannot hang the suite), closing what it holds.
    `accepted_at`: monotonic times of the connections it accepted."""

    def __init__(self, lifetime_s: float = 60.0):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.lifetime_s = lifetime_s
        self.accepted_at: list[float] = []
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        end = time.monotonic() + self.lifetime_s
        while not self._stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.accepted_at.append(time.monotonic())
            self._held.append(conn)                 # held open, never read from, never answered
        for c in self._held:
            c.close()
        self.sock.close()

    def __enter__(self) -> "SilentServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAYFT_HTTP_TIMEOUT_S"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)


# ---- 1. timeouts on every network call, addresses checked up front ---------------------------

def test_submit_to_a_server_that_never_answers_ends_after_the_timeout(capsys, clean_env):
    with SilentServer() as srv:
        code, err = run_cli(capsys, "submit", SPEC, "--address", srv.url, "--timeout-s", "2")
        ended = time.monotonic()
    line = one_line(err)
    assert code == 2, err
    assert srv.accepted_at, "the client never connected"
    # From the first connection to the exit: the timeout, plus a margin; not Ray's unbounded wait.
    assert ended - srv.accepted_at[0] < 2 + 8, ended - srv.accepted_at[0]
    assert srv.url in line and "2 s" in line, line


def test_the_timeout_comes_from_the_environment_and_is_validated(capsys, clean_env, monkeypatch):
    with SilentServer() as srv:
        monkeypatch.setenv("RAYFT_HTTP_TIMEOUT_S", "1")
        t0 = time.monotonic()
        code, err = run_cli(capsys, "status", "some-job", "--address", srv.url)
        took = time.monotonic() - t0
    assert code == 2 and srv.url in one_line(err) and "1 s" in err, err
    assert took < 1 + 8, took
    for bad in ("0", "-3", "inf", "nan", "soon"):
        monkeypatch.setenv("RAYFT_HTTP_TIMEOUT_S", bad)
        code, err = run_cli(capsys, "status", "x", "--address", "http://127.0.0.1:8265")
        assert code == 2 and "RAYFT_HTTP_TIMEOUT_S" in one_line(err), (bad, err)
    monkeypatch.delenv("RAYFT_HTTP_TIMEOUT_S")
    code, err = run_cli(capsys, "status", "x", "--address", "http://127.0.0.1:8265", "--timeout-s", "-1")
    assert code == 2 and "--timeout-s" in one_line(err), err


@pytest.mark.parametrize("address,says", [
    ("http://127.0.0.1:99999", "port"),
    ("http://127.0.0.1:0", "port"),
    ("http://127.0.0.1:http", "port"),
    ("ftp://127.0.0.1:8265", "http://"),
    ("http://:8265", "host"),
    ("http://exa mple:8265", "host"),
])
def test_an_address_that_cannot_be_one_is_refused_before_any_request(capsys, clean_env, address, says):
    code, err = run_cli(capsys, "status", "x", "--address", address)
    line = one_line(err)
    assert code == 2 and says in line and "--address" in line, err


def test_an_address_from_the_environment_is_named_as_such(capsys, clean_env, monkeypatch):
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:70000")
    code, err = run_cli(capsys, "list")
    assert code == 2 and "$RAY_API_SERVER_ADDRESS" in one_line(err), err


def test_kubernetes_api_calls_time_out_and_name_the_server():
    from kubernetes import client

    from jobs.errors import ClusterUnreachable
    from orchestrator.backends import kuberay as k8s

    with SilentServer() as srv:
        cfg = client.Configuration()
        cfg.host = srv.url
        cfg.retries = False
        be = k8s.KubeRayBackend("rayft", api_client=client.ApiClient(cfg), timeout_s=1)
        t0 = time.monotonic()
        with pytest.raises(ClusterUnreachable) as e:
            be.status("x")
        took = time.monotonic() - t0
        with pytest.raises(ClusterUnreachable):
            be.list()
    assert srv.accepted_at, "the client never connected"
    assert took < 1 + 5, took
    assert srv.url in str(e.value) and "1 s" in str(e.value) and "\n" not in str(e.value)
    assert e.value.exit_code == 2


# ---- 3. what reaches rendered manifests outside the spec ------------------------------------

@pytest.mark.parametrize("flag,value", [("--image", f"ghcr.io/x/rayft:{FAKE_GH}"), ("--queue", FAKE_GH)])
def test_a_credential_caught_in_render_is_one_line(capsys, clean_env, flag, value):
    code, err = run_cli(capsys, "k8s", "render", SPEC, flag, value)
    out = capsys.readouterr().out
    line = one_line(err)
    assert code == 2, err
    assert "policy" in line and "credential" in line, line
    assert FAKE_GH not in line and FAKE_GH not in out       # the token is not printed back
    assert "kind: RayJob" not in out                        # nothing rendered


def test_submit_to_kuberay_refuses_a_policy_violation_in_one_line(capsys, clean_env):
    """`rayft submit --backend kuberay` renders the same manifests; a violation there is refused
    before the Kubernetes API is contacted (--dry-run: none is configured here)."""
    code, err = run_cli(capsys, "submit", SPEC, "--backend", "kuberay", "--dry-run", "--image",
                        f"registry.example/{FAKE_GH}/rayft:1")
    assert code == 2 and "policy" in one_line(err), err
