"""`rayft tune` into object storage, against a real S3 server (SeaweedFS's `weed`, the `s3_server`
fixture): the search runs in its staging directory and, when it ends, its files go under the
prefix (results.json last), under the prefix's lease for the whole search; the user's mistakes (a
missing bucket, wrong keys, another's prefix, another live search, --fresh over a search) are one
line, exit 2, with nothing written; a machine without the staging directory brings the bucket's
search in and resumes it without training again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from gradtools import DATA, ROOT
from inproc import rayft_in_process
from polling import wait_until

from jobs.run import lease
from jobs.run.outputs import RUN_MARKER
from jobs.run.storage import open_store
from tests.integration.test_object_storage import _one_line_exit_2
from tests.integration.test_object_storage_lease import _put_lease
from tune import storage
from tune.spec import load_search_spec

EVAL = ROOT / "examples" / "data" / "tiny-eval.jsonl"
BIN = Path(sys.executable).parent
ADAPTER = "adapter/adapter_model.safetensors"


def search_data(uri: str) -> dict:
    """SFT on the tiny data, global batch 8 on one worker: accumulation 1 and 2 (two trials), fifo,
    16 samples per trial, eval every 8."""
    return {
        "name": "bs",
        "data": {"path": str(DATA), "eval_path": str(EVAL), "max_seq_len": 64},
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 8, "micro_batch_size": 8},
        "optim": {"lr": 0.01, "schedule": "constant"},
        "run": {"output_dir": uri},
        "search": {
            "grad_accum_steps": [1, 2],
            "lr_scaling": ["none"],
            "budget_gib": 1.0,
            "samples_per_trial": 16,
            "eval_every_samples": 8,
            "scheduler": "fifo",
            "max_concurrent_trials": 2,
            "upload_every_s": 1,  # the trials reach the bucket while the search runs
        },
    }


def _write(tmp: Path, uri: str) -> Path:
    path = tmp / "search.yaml"
    path.write_text(yaml.safe_dump(search_data(uri)))
    return path


def _env(server, cache: Path, **changes: str) -> dict:
    env = {**os.environ, **server.env(**changes), "RAYFT_CACHE": str(cache)}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    return env


def _tune(server, tmp: Path, uri: str, *args: str, cache: str = "cache", **changes: str):
    return rayft_in_process("tune", str(_write(tmp, uri)), *args, env=_env(server, tmp / cache, **changes), cwd=tmp)


def _refused_with_nothing_made(p, fragment: str, tmp: Path) -> None:
    import ray

    _one_line_exit_2(p, fragment)
    assert not (tmp / "cache" / "staging").exists() and not ray.is_initialized()


def _json(server, key: str) -> dict:
    with server.filesystem().open_input_stream(key) as f:
        return json.loads(f.read())


# ---- refusals: one line, exit 2, nothing written ------------------------------------------------


def test_a_missing_bucket_is_one_line_exit_2_and_never_created(s3_server, tmp_path):
    p = _tune(s3_server, tmp_path, "s3://no-such-tune-bucket/search")
    _refused_with_nothing_made(p, "the bucket does not exist", tmp_path)
    assert s3_server.filesystem().get_file_info("no-such-tune-bucket").type.name == "NotFound"


def test_wrong_keys_are_one_line_exit_2_with_nothing_written(s3_server, tmp_path):
    s3_server.make_bucket("tune-creds")
    p = _tune(s3_server, tmp_path, "s3://tune-creds/search", AWS_SECRET_ACCESS_KEY="not-the-key-0123456789")
    _refused_with_nothing_made(p, "the store refused the credentials", tmp_path)
    assert s3_server.objects("tune-creds") == {}


def test_a_prefix_of_other_files_is_refused_and_left_as_it_was(s3_server, tmp_path):
    s3_server.make_bucket("tune-theirs")
    with s3_server.filesystem().open_output_stream("tune-theirs/search/notes.txt") as f:
        f.write(b"theirs")
    p = _tune(s3_server, tmp_path, "s3://tune-theirs/search")
    _refused_with_nothing_made(p, "was not made by rayft", tmp_path)
    assert s3_server.objects("tune-theirs/search") == {"notes.txt": 6}


def test_a_live_lease_of_another_refuses_the_search_with_nothing_written(s3_server, tmp_path):
    import ray

    s3_server.make_bucket("tune-leased")
    body = _put_lease(s3_server, "tune-leased/search", expires=time.time() + 600)
    p = _tune(s3_server, tmp_path, "s3://tune-leased/search")
    _one_line_exit_2(p, "another run is using it (pid 4242 on host elsewhere")
    assert s3_server.objects("tune-leased/search") == {lease.LEASE: len(body)} and not ray.is_initialized()


def test_fresh_over_a_search_in_the_bucket_is_refused_and_removes_nothing(s3_server, tmp_path):
    s3_server.make_bucket("tune-fresh")
    fs = s3_server.filesystem()
    for key in (RUN_MARKER, "search_plan.json", "results.json"):
        with fs.open_output_stream(f"tune-fresh/search/{key}") as f:
            f.write(b"{}")
    p = _tune(s3_server, tmp_path, "s3://tune-fresh/search", "--fresh")
    _one_line_exit_2(p, "--fresh: the prefix holds a search and rayft never removes anything from a bucket")
    assert s3_server.objects("tune-fresh/search") == {RUN_MARKER: 2, "search_plan.json": 2, "results.json": 2}


# ---- the parts: what is uploaded, in which order, what is brought in -------------------------


def test_upload_order_puts_manifests_after_their_files_and_results_json_last(tmp_path):
    for rel in ("results.json", "best.yaml", ".rayft-run", ".rayft-lock", "trials/t1/.rayft-lock", "x.tmp"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    ck = tmp_path / "trials/t1/checkpoints/step-00000002"
    ck.mkdir(parents=True)
    for name in ("manifest.json", "adapter_model.safetensors"):
        (ck / name).write_text("x")
    order = storage.upload_order(tmp_path)
    assert order[-1] == "results.json"
    assert ".rayft-lock" not in order and "trials/t1/.rayft-lock" not in order and "x.tmp" not in order
    manifest = "trials/t1/checkpoints/step-00000002/manifest.json"
    assert order.index(manifest) > order.index("trials/t1/checkpoints/step-00000002/adapter_model.safetensors")
    assert len(order) == 5 and {".rayft-run", "best.yaml"} <= set(order)


def test_pull_brings_the_search_into_an_empty_staging_directory_only(s3_server, tmp_path, monkeypatch):
    s3_server.make_bucket("tune-pull")
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RAYFT_CACHE", str(tmp_path / "cache"))
    keys = ["search_plan.json", "results.json", "tune/experiment_state-x.json", "trials/t1/summary.json"]
    others = [lease.LEASE, "best-run/summary.json"]  # the lease and a run beside the search stay in the bucket
    fs = s3_server.filesystem()
    for key in keys + others:
        with fs.open_output_stream(f"tune-pull/s/{key}") as f:
            f.write(key.encode())
    spec = load_search_spec(str(_write(tmp_path, "s3://tune-pull/s")), files=False)
    out = spec.output_path
    assert storage.pull(spec, open_store(spec.output_location)) is True
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted(keys) and (out / "trials/t1/summary.json").read_text() == "trials/t1/summary.json"
    (out / "results.json").write_text("mine")
    assert storage.pull(spec, open_store(spec.output_location)) is False  # this machine's search is kept
    assert (out / "results.json").read_text() == "mine"


def test_push_deletes_the_old_results_first_and_writes_them_last(s3_server, tmp_path, monkeypatch):
    s3_server.make_bucket("tune-push")
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RAYFT_CACHE", str(tmp_path / "cache"))
    with s3_server.filesystem().open_output_stream("tune-push/s/results.json") as f:
        f.write(b"old")
    spec = load_search_spec(str(_write(tmp_path, "s3://tune-push/s")), files=False)
    for rel in ("results.json", "best.yaml", "trials/t1/summary.json"):
        (spec.output_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (spec.output_path / rel).write_text(rel)
    seen = []  # (what is uploaded, whether the bucket holds results.json at that moment)
    real = storage.upload
    monkeypatch.setattr(
        storage,
        "upload",
        lambda st, local, rel: (
            seen.append((rel, "results.json" in s3_server.objects("tune-push/s"))),
            real(st, local, rel),
        ),
    )
    storage.push(spec)
    assert [rel for rel, _ in seen][-1] == "results.json" and len(seen) == 3
    assert not any(had for _, had in seen)  # the old results were gone before the first upload
    assert _read(s3_server, "tune-push/s/results.json") == "results.json"


def test_while_it_runs_what_changed_is_uploaded_results_json_never(s3_server, tmp_path, monkeypatch):
    """`upload_changed`: new or changed files go (a trial's manifest after its files), unchanged ones
    do not go again, and results.json waits for `push`."""
    s3_server.make_bucket("tune-sync")
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RAYFT_CACHE", str(tmp_path / "cache"))
    spec = load_search_spec(str(_write(tmp_path, "s3://tune-sync/s")), files=False)
    out, store = spec.output_path, storage.store_of(spec)
    files = (
        "trials/t1/metrics.jsonl",
        "trials/t1/checkpoints/step-1/manifest-rank0.json",
        "trials/t1/checkpoints/step-1/adapter.safetensors",
        "results.json",
    )
    for rel in files:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(rel)
    seen: dict = {}
    first = storage.upload_changed(spec, store, seen)
    assert first == [
        "trials/t1/checkpoints/step-1/adapter.safetensors",
        "trials/t1/metrics.jsonl",
        "trials/t1/checkpoints/step-1/manifest-rank0.json",
    ]
    assert "results.json" not in s3_server.objects("tune-sync/s")
    assert storage.upload_changed(spec, store, seen) == []  # nothing changed
    (out / "trials/t1/metrics.jsonl").write_text("two lines\nnow\n")
    assert storage.upload_changed(spec, store, seen) == ["trials/t1/metrics.jsonl"]
    assert _read(s3_server, "tune-sync/s/trials/t1/metrics.jsonl") == "two lines\nnow\n"


# ---- one real search into the bucket ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bucket_search(s3_server, tmp_path_factory):
    """The search into s3://tune-real/search as its own process; while it holds the lease, a second
    search into the prefix (another machine: another cache) is refused. Then, on a third machine,
    the same command brings the finished search in from the bucket and resumes it."""
    tmp = tmp_path_factory.mktemp("tune-bucket")
    s3_server.make_bucket("tune-real")
    uri = "s3://tune-real/search"
    path = _write(tmp, uri)
    log = open(tmp / "first.log", "w")
    cmd = [str(BIN / "rayft"), "tune", str(path), "--num-cpus", "4"]
    first = subprocess.Popen(cmd, cwd=tmp, env=_env(s3_server, tmp / "cache"), stdout=log, stderr=subprocess.STDOUT)
    try:
        leased = lambda: lease.LEASE in s3_server.objects("tune-real/search") or first.poll() is not None  # noqa: E731
        wait_until(leased, 120, "the first search's lease")
        second = _tune(s3_server, tmp, uri, cache="cache-2")
        # What the bucket held while the first search ran: a trial's metrics before the report files
        # exist. The final copy uploads best.yaml before trials/ (its order is by name), so only an
        # upload during the search (search.upload_every_s) shows trials without best.yaml.
        during = []
        while first.poll() is None and not during:
            now = s3_server.objects("tune-real/search")
            trials = any(k.startswith("trials/") and k.endswith("metrics.jsonl") for k in now)
            if trials and "best.yaml" not in now and "results.json" not in now:
                during.append(now)
            time.sleep(0.5)
        first.wait(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    after_first = s3_server.objects("tune-real/search")
    results = _json(s3_server, "tune-real/search/results.json") if "results.json" in after_first else None
    third = subprocess.run(
        cmd, cwd=tmp, env=_env(s3_server, tmp / "cache-3"), capture_output=True, text=True, timeout=900
    )
    return {
        "tmp": tmp,
        "first": first.returncode,
        "second": second,
        "after_first": after_first,
        "during": during,
        "results": results,
        "third": third,
    }


@pytest.mark.ray
@pytest.mark.slow
def test_the_search_writes_its_results_and_trials_under_the_prefix(bucket_search, s3_server):
    log = (bucket_search["tmp"] / "first.log").read_text()
    assert bucket_search["first"] == 0, log[-3000:]
    objects = bucket_search["after_first"]
    assert lease.LEASE not in objects  # given back at the end
    res = bucket_search["results"]
    finished = [r for r in res["trials"] if r["status"] == "finished"]
    assert sorted(r["grad_accum_steps"] for r in finished) == [1, 2] and res["interrupted"] is False
    for r in finished:
        trial = f"trials/{r['trial_id']}"
        assert r["output_dir"] == f"s3://tune-real/search/{trial}"
        summary = _json(s3_server, f"tune-real/search/{trial}/summary.json")
        assert summary["eval_loss"] == pytest.approx(r["eval_loss"]) and summary["steps"] == r["steps"] == 2
        assert _json(s3_server, f"tune-real/search/{trial}/trial.json")["trial_id"] == r["trial_id"]
        assert objects[f"{trial}/{ADAPTER}"] > 0 and objects[f"{trial}/metrics.jsonl"] > 0
    assert {"best.yaml", "results.csv", "results.txt", "search_plan.json", RUN_MARKER} <= set(objects)
    assert yaml.safe_load(_read(s3_server, "tune-real/search/best.yaml"))["run"]["output_dir"] == (
        "s3://tune-real/search/best-run"
    )
    assert "uploaded: s3://tune-real/search (results.json last)" in log
    # search.upload_every_s: a trial's metrics were in the bucket while the search ran, before results.json
    assert bucket_search["during"], "nothing of the trials reached the bucket before the search ended"


def _read(server, key: str) -> str:
    with server.filesystem().open_input_stream(key) as f:
        return f.read().decode()


@pytest.mark.ray
@pytest.mark.slow
def test_a_second_search_into_the_prefix_is_refused_while_the_first_holds_it(bucket_search):
    _one_line_exit_2(bucket_search["second"], "s3://tune-real/search: another run is using it (pid")


@pytest.mark.ray
@pytest.mark.slow
def test_another_machine_brings_the_search_in_and_resumes_it_without_training(bucket_search, s3_server):
    third = bucket_search["third"]
    assert third.returncode == 0, third.stderr[-3000:]
    assert "brought the search in s3://tune-real/search" in third.stderr
    res = _json(s3_server, "tune-real/search/results.json")
    finished = [r for r in res["trials"] if r["status"] == "finished"]
    assert len(finished) == 2 and all(r["trainings_started"] == 1 for r in finished), res["trials"]
    first = {r["trial_id"]: r["eval_loss"] for r in bucket_search["results"]["trials"]}
    assert {r["trial_id"]: r["eval_loss"] for r in res["trials"]} == first  # the same trials, not a new search
