"""The rest of the surface, tried as a careless or hostile user: booleans where numbers belong, a
huge value quoted in an error, writes aimed at system directories (data cache, MLflow file store),
an unwritable cache, a 300-character path component, an overlay whose node type does not parse or
says `gpuMemoryGiB: "nan"`, a `--queue` that is no label value, a huge `--priority`, queue rows
edited by hand, a Jobs API that answers with an HTTP error. Each is one line with the right exit
code (2: the user's input, 1: not the user's), no traceback, and nothing written."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest
from inproc import rayft_in_process

from jobs.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = "examples/tiny-lora.yaml"
SMALL = ["resources.num_workers=1", "run.max_steps=1", "data.max_seq_len=64", "lora.r=4"]


def _one_line(r, *fragments: str, code: int = 2) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- booleans are not numbers; a huge value is cut in the error line --------------------------


@pytest.mark.parametrize(
    "override",
    ["lora.r=true", "batch.global_batch_size=true", "run.seed=false", "optim.lr=true", "data.max_seq_len=true"],
)
def test_a_boolean_where_a_number_belongs_is_refused(override):
    field = override.split("=")[0]
    _one_line(rayft_in_process("spec", "check", SPEC, override), f"{field}: ", "not a boolean")


def test_booleans_still_go_where_booleans_belong():
    spec = load_spec(ROOT / SPEC, ["data.packing=true", "memory.gradient_checkpointing=false", "lora.use_dora=true"])
    assert spec.data.packing is True and spec.memory.gradient_checkpointing is False and spec.lora.use_dora


def test_an_error_quoting_a_huge_value_is_cut():
    huge = "/nonexistent/" + "a" * 100_000 + ".jsonl"
    line = _one_line(rayft_in_process("spec", "check", SPEC, f"data.path={huge}"), "data.path", "characters)")
    assert len(line) < 1000, len(line)
    assert line.endswith(".jsonl") or "a.jsonl" in line  # head and tail kept, the reason too


# ---- where a run writes: not a system directory, writable, names that fit ----------------------


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["data.cache_dir=/etc/rayft-cache"], "data.cache_dir=/etc/rayft-cache"),
        (["data.cache_dir=/usr/lib/rayft"], "data.cache_dir=/usr/lib/rayft"),
        (["run.trackers=[mlflow]", "run.mlflow_tracking_uri=file:///etc/mlruns"], "run.mlflow_tracking_uri="),
        (["run.trackers=[mlflow]", "run.mlflow_tracking_uri=sqlite:////usr/share/m.db"], "run.mlflow_tracking_uri="),
    ],
    ids=["cache-etc", "cache-usr-lib", "mlflow-file-etc", "mlflow-sqlite-usr-share"],
)
def test_a_cache_or_mlflow_store_in_a_system_directory_is_refused(tmp_path, overrides, fragment):
    out = tmp_path / "run"
    r = rayft_in_process("run", SPEC, *SMALL, f"run.output_dir={out}", *overrides, "--local")
    _one_line(r, fragment, "system directory")
    assert not out.exists() and not Path("/etc/rayft-cache").exists() and not Path("/etc/mlruns").exists()


def test_an_unwritable_cache_dir_is_one_line(tmp_path, monkeypatch):
    cache, out = tmp_path / "ro-cache", tmp_path / "run"
    cache.mkdir()
    cache.chmod(0o500)
    real_access = os.access

    def access(path, mode, *a, **k):  # as for a user other than root, whom no mode stops
        if Path(path) == cache and mode & os.W_OK:
            return False
        return real_access(path, mode, *a, **k)

    monkeypatch.setattr(os, "access", access)
    r = rayft_in_process("run", SPEC, *SMALL, f"run.output_dir={out}", f"data.cache_dir={cache}", "--local")
    _one_line(r, "data.cache_dir=", "not writable")
    assert not out.exists() and _files(cache) == []


def test_a_cache_dir_below_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "run"
    r = rayft_in_process(
        "run", SPEC, *SMALL, f"run.output_dir={out}", f"data.cache_dir={tmp_path / 'file' / 'c'}", "--local"
    )
    _one_line(r, "data.cache_dir=", "not a directory")
    assert not out.exists()


@pytest.mark.parametrize("field", ["run.output_dir", "data.cache_dir", "model.name", "data.path", "model.adapter"])
def test_a_300_character_path_component_is_one_line(tmp_path, field):
    long = tmp_path / ("x" * 300)
    r = rayft_in_process("run", SPEC, *SMALL, f"run.output_dir={tmp_path / 'run'}", f"{field}={long}", "--local")
    _one_line(r, field)
    assert _files(tmp_path) == []


# ---- the Kubernetes target: overlays, queue names --------------------------------------------


def _overlay(tmp_path: Path, edit) -> Path:
    o = tmp_path / "myoverlay"
    shutil.copytree(ROOT / "k8s" / "overlays" / "gpu", o)
    f = o / "node-type" / "node-type.yaml"
    f.write_text(edit(f.read_text()))
    return o


def test_an_overlay_node_type_that_is_not_yaml_is_one_line(tmp_path):
    o = _overlay(tmp_path, lambda t: t + "\n  broken: [unclosed\n")
    r = rayft_in_process("k8s", "render", SPEC, "--overlay", str(o))
    _one_line(r, "node-type.yaml", "is not YAML", "line")
    assert r.stdout == ""


@pytest.mark.parametrize("value", ['"nan"', '"inf"', '"-8"', '"lots"'])
def test_a_node_type_size_that_is_no_number_is_one_line(tmp_path, value):
    import re

    o = _overlay(tmp_path, lambda t: re.sub(r"gpuMemoryGiB: .*", f"gpuMemoryGiB: {value}", t))
    assert "gpuMemoryGiB: " + value in (o / "node-type" / "node-type.yaml").read_text()
    r = rayft_in_process("k8s", "render", SPEC, "--overlay", str(o))
    _one_line(r, "gpuMemoryGiB")
    assert r.stdout == ""


@pytest.mark.parametrize("queue", ["not a label", "-lead", "x" * 64, "a/b", ""])
def test_a_queue_name_that_is_no_label_value_is_one_line(queue):
    r = rayft_in_process("k8s", "render", SPEC, f"--queue={queue}")
    _one_line(r, "--queue", "label value")
    assert r.stdout == ""


# ---- the queue: a huge --priority, rows edited by hand ---------------------------------------


@pytest.mark.parametrize("prio", [str(10**30), "-" + str(10**30), "1e3"])
def test_a_huge_priority_is_one_line_and_creates_nothing(tmp_path, prio):
    db = tmp_path / "q.db"
    _one_line(rayft_in_process("queue", "add", SPEC, f"--priority={prio}", "--db", str(db)), "--priority")
    assert not db.exists()


def test_queue_rows_edited_by_hand_are_reported_by_id_and_skipped(tmp_path):
    db = tmp_path / "q.db"
    for name in ("one", "two", "three", "four", "fine"):
        assert rayft_in_process("queue", "add", SPEC, f"name={name}", "--db", str(db)).returncode == 0
    with sqlite3.connect(db) as c:
        c.execute("UPDATE jobs SET priority='high' WHERE id=1")
        c.execute("UPDATE jobs SET overrides='[broken' WHERE id=2")
        c.execute("UPDATE jobs SET state='EXPLODED' WHERE id=3")
        c.execute('UPDATE jobs SET demand=\'{"num_workers": "many"}\' WHERE id=4')
    for args in (["status"], ["status", "--json"]):
        r = rayft_in_process("queue", *args, "--db", str(db))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        warned = [ln for ln in r.stderr.splitlines() if "skipped" in ln]
        assert [w.split("job #")[1].split(" ")[0] for w in warned] == ["1", "2", "3", "4"], r.stderr
        assert "'high'" in warned[0] and "overrides" in warned[1] and "EXPLODED" in warned[2] and "demand" in warned[3]
    shown = json.loads(r.stdout)
    assert [j["name"] for j in shown] == ["fine"]
    r = rayft_in_process("queue", "retry", "2", "--db", str(db))
    _one_line(r, "job #2", "damaged")
    # the driver skips them too (and finds the cluster unreachable for the sound one: exit 2)
    r = rayft_in_process("queue", "run", "--once", "--address", "http://127.0.0.1:1", "--db", str(db))
    assert "Traceback" not in r.stderr and r.returncode in (0, 2), r.stderr
    ids = [ln.split("job #")[1].split(" ")[0] for ln in r.stderr.splitlines() if "skipped" in ln]
    # each reported once; #3 (state EXPLODED) is in none of the states the driver asks for
    assert sorted(ids) == ["1", "2", "4"], r.stderr


# ---- a Jobs API answering with an HTTP error --------------------------------------------------


class _Answer(http.server.BaseHTTPRequestHandler):
    status, body = 500, b"Internal Server Error"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(self.body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    def start(status: int, body: bytes) -> str:
        handler = type("H", (_Answer,), {"status": status, "body": body})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    started: list = []
    yield start
    for s in started:
        s.shutdown()


@pytest.mark.parametrize(
    "status,body,code,fragment",
    [
        (500, b"Internal Server Error", 1, "HTTP 500"),
        (502, b"<html>Bad Gateway</html>", 1, "HTTP 502"),
        (403, b"Forbidden", 2, "rejected the auth token"),
        (200, b"this is not json", 1, "did not answer as a Ray Jobs API does"),
    ],
)
def test_a_jobs_api_answering_an_http_error_is_one_line(server, status, body, code, fragment):
    url = server(status, body)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    for argv in (["status", "x"], ["list"]):
        r = rayft_in_process(*argv, "--address", url, env=env)
        _one_line(r, fragment, code=code)
