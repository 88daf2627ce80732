"""Careless and hostile input on the cluster side: a cluster that accepts and never answers, an
address that cannot be one, credentials or policy breaks that reach rendered manifests outside
the spec, and the queue database (permissions, read-only reads, corruption, bad arguments).
Every refusal is one line on stderr with exit code 2, never a traceback. No cluster is needed."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import ensure_auth_token

from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[2]
SPEC = "examples/tiny-lora.yaml"
FAKE_GH = "ghp_" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"  # GitHub-token-shaped, not a real one


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
            except TimeoutError:
                continue
            self.accepted_at.append(time.monotonic())
            self._held.append(conn)  # held open, never read from, never answered
        for c in self._held:
            c.close()
        self.sock.close()

    def __enter__(self) -> SilentServer:
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
    # Token auth is on for this test process (conftest), and a fresh HOME has no token file yet:
    # make the one every later cluster of the session uses (the silent servers check none).
    ensure_auth_token()
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


@pytest.mark.parametrize(
    "address,says",
    [
        ("http://127.0.0.1:99999", "port"),
        ("http://127.0.0.1:0", "port"),
        ("http://127.0.0.1:http", "port"),
        ("ftp://127.0.0.1:8265", "http://"),
        ("http://:8265", "host"),
        ("http://exa mple:8265", "host"),
    ],
)
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
    assert FAKE_GH not in line and FAKE_GH not in out  # the token is not printed back
    assert "kind: RayJob" not in out  # nothing rendered


def test_submit_to_kuberay_refuses_a_policy_violation_in_one_line(capsys, clean_env):
    """`rayft submit --backend kuberay` renders the same manifests; a violation there is refused
    before the Kubernetes API is contacted (--dry-run: none is configured here)."""
    code, err = run_cli(
        capsys, "submit", SPEC, "--backend", "kuberay", "--dry-run", "--image", f"registry.example/rayft:{FAKE_GH}"
    )
    line = one_line(err)
    assert code == 2 and "policy" in line and FAKE_GH not in line, err


# ---- 2. the queue database ------------------------------------------------------------------

FAKE_HF = "hf_" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJK"  # Hugging-Face-token-shaped, not a real one


def db_bytes(db: Path) -> bytes:
    """The database and whatever SQLite keeps beside it (WAL, shared memory)."""
    return b"".join(p.read_bytes() for p in sorted(db.parent.glob(db.name + "*")) if p.is_file())


def test_the_queue_db_is_created_private(capsys, clean_env, tmp_path):
    db = tmp_path / "fresh" / "deeper" / "queue.db"
    code, err = run_cli(capsys, "queue", "add", SPEC, "--db", str(db))
    assert code == 0, err
    assert (db.stat().st_mode & 0o777) == 0o600
    assert (db.parent.stat().st_mode & 0o777) == 0o700 and (db.parent.parent.stat().st_mode & 0o777) == 0o700


def test_queue_add_refuses_a_credential_and_stores_nothing(capsys, clean_env, tmp_path):
    db = tmp_path / "queue.db"
    code, err = run_cli(capsys, "queue", "add", SPEC, "--db", str(db), f"run.env.AUTH=Bearer {FAKE_HF}")
    assert code == 2 and "secret" in one_line(err) and FAKE_HF not in err, err
    assert not db.exists()  # refused before the queue was opened
    assert run_cli(capsys, "queue", "add", SPEC, "--db", str(db))[0] == 0
    spec = tmp_path / "leaky.yaml"  # in a spec file, where a variable name belongs
    spec.write_text((ROOT / SPEC).read_text().replace("model:\n", f"model:\n  hf_token_env: {FAKE_HF}\n", 1))
    code, err = run_cli(capsys, "queue", "add", str(spec), "--db", str(db), "--working-dir", str(ROOT))
    assert code == 2 and FAKE_HF not in err, err
    code, err = run_cli(capsys, "queue", "add", SPEC, "--db", str(db), f"model.hf_token_env={FAKE_HF}")
    assert code == 2 and FAKE_HF not in err, err
    assert FAKE_HF.encode() not in db_bytes(db) and FAKE_HF[3:].encode() not in db_bytes(db)


@pytest.mark.parametrize(
    "argv,says",
    [
        (["add", SPEC, "--max-retries", "-5"], "--max-retries"),
        (["run", "--poll", "-1", "--address", "http://127.0.0.1:1"], "--poll"),
        (["run", "--poll", "nan", "--address", "http://127.0.0.1:1"], "--poll"),
        (["run", "--backoff", "inf", "--address", "http://127.0.0.1:1"], "--backoff"),
    ],
)
def test_queue_arguments_out_of_range_are_refused(capsys, clean_env, tmp_path, argv, says):
    db = tmp_path / "queue.db"
    code, err = run_cli(capsys, "queue", *argv, "--db", str(db))
    assert code == 2 and says in one_line(err), err
    assert not db.exists()


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda good: os.urandom(4096), id="garbage"),
        pytest.param(lambda good: good[:9000], id="truncated"),
        pytest.param(lambda good: good[:4096] + bytes(len(good) - 4096), id="zeroed-pages"),
    ],
)
def test_a_corrupt_queue_db_is_reported_and_never_written(capsys, clean_env, tmp_path, content):
    import sqlite3

    good = tmp_path / "good.db"
    assert run_cli(capsys, "queue", "add", SPEC, "--db", str(good))[0] == 0
    with contextlib.closing(sqlite3.connect(good)) as c:  # everything in the main file, none in the WAL
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert good.stat().st_size > 9000
    db = tmp_path / "queue.db"
    db.write_bytes(content(good.read_bytes()))
    before = db.read_bytes()
    for argv in (["status"], ["status", "--json"], ["add", SPEC], ["retry", "1"], ["cancel", "1"]):
        code, err = run_cli(capsys, "queue", *argv, "--db", str(db))
        line = one_line(err)
        assert code == 2 and str(db) in line and "move it aside" in line, (argv, err)
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.glob("queue.db*")) == ["queue.db"]


def test_another_programs_sqlite_db_is_not_touched(capsys, clean_env, tmp_path):
    import sqlite3

    db = tmp_path / "theirs.db"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE notes (x TEXT)")
    before = db.read_bytes()
    code, err = run_cli(capsys, "queue", "add", SPEC, "--db", str(db))
    assert code == 2 and "not a rayft queue" in one_line(err), err
    assert db.read_bytes() == before


def test_queue_status_reads_a_db_this_user_cannot_write(tmp_path):
    """`rayft queue status` on a read-only file in a read-only directory (as another user when
    the tests run as root, whom permissions do not stop), with nothing written there."""
    import subprocess
    import sys
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="rayft-ro-"))
    try:
        d = top / "q"
        db = d / "queue.db"
        env = {k: v for k, v in os.environ.items() if k != "RAYFT_QUEUE_DB"}
        rayft = str(Path(sys.executable).parent / "rayft")
        r = subprocess.run(
            [rayft, "queue", "add", SPEC, "--db", str(db)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        before = sorted(p.name for p in d.iterdir()), db.read_bytes()
        db.chmod(0o444)
        d.chmod(0o555)
        top.chmod(0o755)
        as_user: list[str] = []
        if os.geteuid() == 0:  # as nobody: the file is not theirs to write
            import shutil

            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv: permissions cannot make a file read-only")
            as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        env["HOME"] = str(top)
        r = subprocess.run(
            [*as_user, rayft, "queue", "status", "--db", str(db), "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        import json

        rows = json.loads(r.stdout)
        assert [row["name"] for row in rows] == ["tiny-lora"] and rows[0]["state"] == "QUEUED"
        r = subprocess.run(
            [*as_user, rayft, "queue", "retry", "1", "--db", str(db)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "read-only" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert (sorted(p.name for p in d.iterdir()), db.read_bytes()) == before
    finally:
        for p in (top, top / "q"):
            if p.exists():
                p.chmod(0o755)
        import shutil

        shutil.rmtree(top, ignore_errors=True)
