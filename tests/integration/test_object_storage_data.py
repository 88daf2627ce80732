"""`data.path` (and `data.eval_path`) in a bucket, against the real S3 server: JSONL, Parquet and a
`save_to_disk` prefix are copied to local disk through the storage layer of runs
(`jobs.data.remote_data`), the content hash that keys the token cache is the copy's bytes (equal
to the same data's given locally, and changed when the object changes), a run trains on them as
on the local file, and a missing object, bucket or wrong keys are one line, exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gradtools import DEMO, ROOT
from inproc import rayft_in_process

from jobs.data import content_hash
from jobs.data.remote_data import copy_path, localize
from jobs.data.sources import read_jsonl
from jobs.errors import SpecError
from jobs.spec import load_spec
from tests.integration.test_object_storage import STEPS, _env, _one_line_exit_2

TRAIN = ROOT / "examples/data/tiny.jsonl"


def _put(server, key: str, local: Path) -> None:
    with server.filesystem().open_output_stream(key) as f:
        f.write(local.read_bytes())


@pytest.fixture(scope="module")
def bucket(s3_server):
    s3_server.make_bucket("data")
    _put(s3_server, "data/sets/tiny.jsonl", TRAIN)
    return s3_server


@pytest.fixture
def env(bucket, tmp_path, monkeypatch):
    """This process pointed at the server, with a rayft cache of the test's."""
    for name, value in _env(bucket, tmp_path / "cache").items():
        monkeypatch.setenv(name, value)
    return bucket


def _spec(*overrides: str):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return load_spec(DEMO, list(overrides))
    finally:
        os.chdir(cwd)


def test_a_jsonl_object_is_copied_here_and_hashed_as_the_same_local_file(env, tmp_path):
    spec = localize(_spec("data.path=s3://data/sets/tiny.jsonl"))
    (copy,) = spec.data.path
    assert copy == str(copy_path("s3://data/sets/tiny.jsonl")) and copy.startswith(str(tmp_path / "cache"))
    assert Path(copy).read_bytes() == TRAIN.read_bytes()
    assert content_hash(spec) == content_hash(_spec(f"data.path={TRAIN}"))
    assert not [p for p in Path(copy).parent.iterdir() if p.name != "tiny.jsonl"]  # no temporary left


def test_a_changed_object_is_copied_again_and_changes_the_hash(env, tmp_path):
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(TRAIN.read_text().splitlines(keepends=True)[:200]))
    _put(env, "data/sets/moving.jsonl", TRAIN)
    first = content_hash(localize(_spec("data.path=s3://data/sets/moving.jsonl")))
    _put(env, "data/sets/moving.jsonl", changed)
    second = content_hash(localize(_spec("data.path=s3://data/sets/moving.jsonl")))
    assert first != second and second == content_hash(_spec(f"data.path={changed}"))


def test_parquet_and_a_save_to_disk_prefix_read_as_their_local_copies(env, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in TRAIN.read_text().splitlines()]
    parquet = tmp_path / "tiny.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    _put(env, "data/sets/tiny.parquet", parquet)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    for f in saved.iterdir():
        _put(env, f"data/sets/saved/{f.name}", f)
    for uri, local in (("s3://data/sets/tiny.parquet", parquet), ("s3://data/sets/saved", saved)):
        spec = localize(_spec(f"data.path={uri}"))
        assert content_hash(spec) == content_hash(_spec(f"data.path={local}")), uri
        assert read_jsonl(spec.data.path[0]) == read_jsonl(str(local)) == rows, uri


def test_a_run_on_bucket_data_trains_as_on_the_local_file(bucket, tmp_path):
    steps = [*STEPS, "run.checkpoint_every=0"]
    before, losses = bucket.objects("data"), []
    for name, path in (("local", str(TRAIN)), ("bucket", "s3://data/sets/tiny.jsonl")):
        out = tmp_path / name
        args = ("run", DEMO, "--local", f"run.output_dir={out}", f"data.path={path}", *steps)
        p = rayft_in_process(*args, env=_env(bucket, tmp_path / f"cache-{name}"))
        assert p.returncode == 0, p.stderr[-3000:]
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert losses[0] == losses[1] and len(losses[0]) == 4
    assert [p.name for p in (tmp_path / "cache-bucket" / "sources").rglob("*.jsonl")] == ["tiny.jsonl"]  # read here
    # one token cache entry, on local disk beside the output dirs: the bucket copy's key is the local file's
    assert len([e for e in (tmp_path / ".rayft-data").iterdir() if e.is_dir()]) == 1
    assert bucket.objects("data") == before  # read only


@pytest.mark.parametrize(
    ("uri", "changes", "fragment"),
    [
        ("s3://data/sets/nothing.jsonl", {}, "data.path=s3://data/sets/nothing.jsonl: no such object"),
        (
            "s3://no-such-data-bucket/x.jsonl",
            {},
            "data.path=s3://no-such-data-bucket/x.jsonl: reading it: the bucket does not exist",
        ),
        (
            "s3://data/sets/tiny.jsonl",
            {"AWS_SECRET_ACCESS_KEY": "not-the-key-0123456789"},
            "the store refused the credentials",
        ),
    ],
)
def test_a_missing_object_or_bucket_or_wrong_keys_are_one_line_exit_2(bucket, tmp_path, uri, changes, fragment):
    out = tmp_path / "run"
    args = ("run", DEMO, "--local", f"run.output_dir={out}", f"data.path={uri}", *STEPS)
    p = rayft_in_process(*args, env=_env(bucket, tmp_path / "cache", **changes))
    _one_line_exit_2(p, fragment)
    assert not out.exists()
    assert "not-the-key" not in p.stderr + p.stdout


def test_submit_checks_bucket_data_from_a_copy_and_leaves_the_uri_to_the_job(env):
    from orchestrator.backends.ray_jobs import resolve_spec

    spec, _, overrides, _ = resolve_spec(DEMO, ["data.path=s3://data/sets/tiny.jsonl"], ROOT)
    assert spec.data.path == ["s3://data/sets/tiny.jsonl"]  # the job copies it on the machine it runs on
    assert "data.path=s3://data/sets/tiny.jsonl" in overrides
    with pytest.raises(SpecError, match=r"^data.path=s3://data/sets/gone.jsonl: no such object"):
        resolve_spec(DEMO, ["data.path=s3://data/sets/gone.jsonl"], ROOT)


@pytest.mark.parametrize("uri", ["s3://Not_A_Bucket/x.jsonl", "hdfs://nn:8020/x.jsonl", "https://example.com/x.jsonl"])
def test_another_uri_as_data_is_refused_in_one_line_before_anything_is_read(uri):
    with pytest.raises(SpecError, match=r"data.path: .* is not a URI rayft reads data from"):
        _spec(f"data.path={uri}")
