"""The queue with a run in a bucket, against a real S3 server (SeaweedFS's `weed`, the `s3_server`
fixture) and a real Ray cluster started for it, whose environment holds the S3 endpoint and keys
(as a machine's environment or role would: never the job's runtime_env). `rayft queue add` of a
spec whose `run.output_dir` is `s3://...` keeps the URI; the queue's driver submits the job, which
writes the run into the bucket: every checkpoint whole, the outputs and summary.json; the queue
records it SUCCEEDED."""

from __future__ import annotations

import json

import pytest
from inproc import rayft_in_process

from tests.integration.test_object_storage import _whole_checkpoints
from tests.integration.test_queue import db_rows, driver
from tests.integration.test_submit import SPEC, TINY, uniq

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def bucket_head(s3_server):
    from clusters import RayHead

    head = RayHead(env=s3_server.env())
    try:
        yield head
    finally:
        head.stop()


def test_a_queued_job_into_a_bucket_writes_its_run_there_and_succeeds(bucket_head, s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    s3_server.make_bucket("queued")
    db, name = tmp_path / "q.db", uniq("inbucket")
    uri, prefix = "s3://queued/runs/{name}", f"queued/runs/{name}"
    env = {**bucket_head.env, "RAYFT_CACHE": str(tmp_path / "cache")}
    more = [f"name={name}", f"run.output_dir={uri}", "run.checkpoint_every=1", "run.keep_checkpoints=2"]
    r = rayft_in_process("queue", "add", SPEC, *TINY, *more, "--db", str(db), env=env)
    assert r.returncode == 0, r.stderr
    d = driver(db, bucket_head, "--max-concurrency", "1", env=env)
    out, _ = d.communicate(timeout=400)
    assert d.returncode == 0, out
    row = db_rows(db)[name]
    assert row["state"] == "SUCCEEDED" and row["attempt"] == 1, out
    assert _whole_checkpoints(s3_server, prefix, tmp_path / "bucket") == {"step-00000001": None, "step-00000002": None}
    objects = set(s3_server.objects(prefix))
    assert {"summary.json", "metrics.jsonl", "adapter/adapter_model.safetensors"} <= objects, objects
    with s3_server.filesystem().open_input_stream(f"{prefix}/summary.json") as f:
        assert json.loads(f.read())["steps"] == 2
