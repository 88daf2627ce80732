"""A store that stops answering mid-run (not the user's mistake): the run ends in one line naming
the bucket, exit 1, and nothing in the bucket is lost: the checkpoint uploaded before the outage is
still whole, the one being uploaded is never published half, and once the server is back the same
command resumes from the bucket's newest whole checkpoint and finishes as an uninterrupted run does.

The test has an S3 server of its own (SeaweedFS's `weed`, as the `s3_server` fixture's), stopped
while the run stalls before its third step (`RAYFT_FAULT` sleep) and started again on the same
ports and data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gradtools import DEMO, ROOT
from s3_server import S3Server
from test_object_storage import STEPS, _env, _expire_lease, _rayft_run, _read, _whole_checkpoints

from jobs.run import lease

URI, PREFIX = "s3://outage/runs/{name}", "outage/runs/tiny-lora"


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout_s, "the run never reached its stall"
        time.sleep(0.2)


@pytest.fixture
def server(tmp_path):
    s = S3Server(tmp_path / "s3").start()
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
def test_a_store_that_stops_mid_run_is_one_line_exit_1_and_the_bucket_loses_nothing(server, tmp_path):
    server.make_bucket("outage")
    cache = tmp_path / "cache"
    env = {**_env(server, cache), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    env["RAYFT_FAULT"] = f"sleep:step=2,seconds=8,once={tmp_path / 'stalled'}"  # after checkpoint 2's upload
    cmd = [sys.executable, "-m", "jobs.finetune", DEMO, "--local", f"run.output_dir={URI}", *STEPS]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "stalled", proc)
    server.stop()  # the store goes away while the run stalls; its next upload (checkpoint 4) fails
    _, err = proc.communicate(timeout=600)

    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("job tiny-lora: ")]
    assert proc.returncode == 1, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]  # after the start line, the verdict alone
    assert "s3://outage/runs/tiny-lora" in lines[0] and "the store failed" in lines[0], lines[0]
    assert "Traceback" not in err, err[-3000:]

    server.start()  # the same ports and data: what the bucket held survives
    assert _whole_checkpoints(server, PREFIX, tmp_path / "after") == {"step-00000002": None}
    assert "summary.json" not in server.objects(PREFIX)  # the run is not published as finished
    if lease.LEASE in server.objects(PREFIX):  # not given back: the store was gone when the run ended
        _expire_lease(server, PREFIX)
    shutil.rmtree(cache / "staging")  # another machine: only the bucket has the run
    p = _rayft_run(server, cache, URI)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads("\n".join(_read(server, f"{PREFIX}/summary.json")))
    assert summary["resumed_from_step"] == 2
    assert [json.loads(line)["step"] for line in _read(server, f"{PREFIX}/metrics.jsonl")] == [1, 2, 3, 4]
