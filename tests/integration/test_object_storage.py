"""Runs on object storage, against a real S3 server (SeaweedFS's `weed`, the `s3_server` fixture):
`run.output_dir: s3://bucket/prefix` writes the run into its staging directory and uploads it
(checkpoints manifests last, summary.json last), a killed run resumes from the bucket's newest
whole checkpoint bit for bit, and the user's mistakes (wrong keys, a missing bucket, another's
prefix) are one line, exit 2, with nothing written to the bucket.

Every run is `rayft run SPEC --local` in this process (one worker, 4 steps of 4 sequences, a
checkpoint every 2) but the killed one, a `python -m jobs.finetune` process SIGKILLed by
`RAYFT_FAULT` after its first checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gradtools import DEMO, ROOT
from inproc import rayft_in_process
from safetensors.torch import load as load_safetensors

from jobs.run import checkpoint as ckpt
from jobs.run import lease, mirror

STEPS = [
    "resources.num_workers=1",
    "run.max_steps=4",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=2",
    "run.eval_every=0",
    "data.max_seq_len=64",
    "lora.r=4",
    "batch.global_batch_size=4",
    "batch.micro_batch_size=2",
]
ADAPTER = "adapter/adapter_model.safetensors"


def _env(server, cache: Path, **changes: str) -> dict:
    """This process's environment with the server's AWS variables and a rayft cache of the test's."""
    return {**os.environ, **server.env(**changes), "RAYFT_CACHE": str(cache)}


def _rayft_run(server, cache: Path, uri: str, **changes: str) -> subprocess.CompletedProcess:
    return rayft_in_process("run", DEMO, "--local", f"run.output_dir={uri}", *STEPS, env=_env(server, cache, **changes))


def _bucket_adapter(server, prefix: str) -> dict[str, torch.Tensor]:
    with server.filesystem().open_input_stream(f"{prefix}/{ADAPTER}") as f:
        return load_safetensors(f.read())


def _whole_checkpoints(server, prefix: str, tmp: Path) -> dict[str, str | None]:
    """{checkpoint in the bucket: why it is incomplete, None when whole} (downloaded, then judged
    by the rule every local checkpoint passes)."""
    found = {}
    for rel in sorted({k.split("/")[1] for k in server.objects(prefix) if k.startswith("checkpoints/")}):
        local = tmp / rel
        for key in server.objects(f"{prefix}/checkpoints/{rel}"):
            local.mkdir(parents=True, exist_ok=True)
            with server.filesystem().open_input_stream(f"{prefix}/checkpoints/{rel}/{key}") as f:
                (local / key).write_bytes(f.read())
        found[rel] = ckpt.why_incomplete(local)
    return found


def _one_line_exit_2(p: subprocess.CompletedProcess, fragment: str) -> None:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("rayft: error: "), p.stderr[-2000:]
    assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def straight(s3_server, tmp_path_factory):
    """An uninterrupted 4-step run into s3://straight/runs/tiny-lora, every upload recorded in order."""
    server, cache = s3_server, tmp_path_factory.mktemp("cache")
    server.make_bucket("straight")
    uploads: list[str] = []
    real = mirror.upload
    mirror.upload = lambda store, local, rel: (uploads.append(rel), real(store, local, rel))[1]
    try:
        p = _rayft_run(server, cache, "s3://straight/runs/{name}")
    finally:
        mirror.upload = real
    assert p.returncode == 0, p.stderr[-3000:]
    return server, cache, uploads


def test_a_run_writes_its_files_to_the_bucket(straight, tmp_path):
    server, cache, uploads = straight
    objects = server.objects("straight/runs/tiny-lora")
    for name in (".rayft-run", "summary.json", "metrics.jsonl", "events.jsonl", "loss_curve.png", ADAPTER):
        assert name in objects, sorted(objects)
    assert not [k for k in objects if k.endswith(".tmp") or ".rayft-lock" in k or "/.tmp-" in k]
    assert [json.loads(line)["step"] for line in _read(server, "straight/runs/tiny-lora/metrics.jsonl")] == [1, 2, 3, 4]
    # keep_checkpoints=2 of 2 and 4: both whole in the bucket, and nothing else there
    assert _whole_checkpoints(server, "straight/runs/tiny-lora", tmp_path) == {
        "step-00000002": None,
        "step-00000004": None,
    }
    # the bucket's adapter is the staging directory's, bit for bit
    (staging,) = [d for d in (cache / "staging").iterdir() if d.name.startswith("s3-")]  # beside: the data cache
    local = load_safetensors((staging / ADAPTER).read_bytes())
    remote = _bucket_adapter(server, "straight/runs/tiny-lora")
    assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)


def test_uploads_claim_the_prefix_first_put_manifests_after_their_files_and_the_summary_last(straight):
    _, _, uploads = straight
    assert uploads[0] == ".rayft-run" and uploads[-1] == "summary.json"
    for step in ("step-00000002", "step-00000004"):
        mine = [u.rsplit("/", 1)[1] for u in uploads if u.startswith(f"checkpoints/{step}/")]
        manifests = [i for i, name in enumerate(mine) if ckpt.is_manifest(name)]
        assert manifests and min(manifests) == len(mine) - len(manifests), mine  # manifests last


def _read(server, key: str) -> list[str]:
    with server.filesystem().open_input_stream(key) as f:
        return f.read().decode().splitlines()


@pytest.mark.slow  # a `python -m jobs.finetune` process killed after step 2, then the resumed run: 50-90 s
def test_a_killed_run_resumes_from_the_buckets_newest_whole_checkpoint_bit_for_bit(straight, tmp_path):
    server, _, _ = straight
    server.make_bucket("resume")
    uri, prefix, cache = "s3://resume/runs/{name}", "resume/runs/tiny-lora", tmp_path / "cache"
    env = {**_env(server, cache), "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same float sums
    env["RAYFT_FAULT"] = f"kill:step=2,rank=0,once={tmp_path / 'killed'}"  # before step 3: after checkpoint 2
    cmd = [sys.executable, "-m", "jobs.finetune", DEMO, "--local", f"run.output_dir={uri}", *STEPS]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert _whole_checkpoints(server, prefix, tmp_path / "after-kill") == {"step-00000002": None}
    assert "summary.json" not in server.objects(prefix)
    # An upload of step 4 cut off before its manifests (the files only): never taken.
    step2 = server.objects(f"{prefix}/checkpoints/step-00000002")
    fs = server.filesystem()
    for name in (n for n in step2 if not ckpt.is_manifest(n)):
        fs.copy_file(f"{prefix}/checkpoints/step-00000002/{name}", f"{prefix}/checkpoints/step-00000004/{name}")
    shutil.rmtree(cache / "staging")  # another machine: only the bucket has the run
    _expire_lease(server, prefix)  # the killed run's lease, as it is once it has not been refreshed for TTL_S

    p = _rayft_run(server, cache, uri)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "skipping checkpoint s3://resume/runs/tiny-lora/checkpoints/step-00000004" in p.stderr
    summary = json.loads("\n".join(_read(server, f"{prefix}/summary.json")))
    assert summary["resumed_from_step"] == 2
    assert [json.loads(line)["step"] for line in _read(server, f"{prefix}/metrics.jsonl")] == [1, 2, 3, 4]
    resumed, ref = _bucket_adapter(server, prefix), _bucket_adapter(server, "straight/runs/tiny-lora")
    assert resumed.keys() == ref.keys() and all(torch.equal(resumed[k], ref[k]) for k in ref)
    assert _whole_checkpoints(server, prefix, tmp_path / "end") == {"step-00000002": None, "step-00000004": None}


def _expire_lease(server, prefix: str) -> None:
    """The lease a killed run left (live: it expires TTL_S after its last refresh), moved to its expiry."""
    key = f"{prefix}/{lease.LEASE}"
    with server.filesystem().open_input_stream(key) as f:
        rec = json.loads(f.read())
    assert rec["expires"] > time.time()  # a rerun now would be refused (tests/integration/test_object_storage_lease.py)
    rec["expires"] = time.time() - 1
    with server.filesystem().open_output_stream(key) as f:
        f.write(json.dumps(rec).encode())


def test_wrong_credentials_are_one_line_exit_2_with_nothing_written(s3_server, tmp_path):
    s3_server.make_bucket("creds")
    p = _rayft_run(s3_server, tmp_path / "cache", "s3://creds/run", AWS_SECRET_ACCESS_KEY="not-the-key-0123456789")
    _one_line_exit_2(p, "the store refused the credentials")
    assert "not-the-key" not in p.stderr + p.stdout
    assert s3_server.objects("creds") == {}
    assert not (tmp_path / "cache" / "staging").exists()


def test_a_missing_bucket_is_one_line_exit_2_and_never_created(s3_server, tmp_path):
    p = _rayft_run(s3_server, tmp_path / "cache", "s3://no-such-bucket/run")
    _one_line_exit_2(p, "the bucket does not exist")
    assert s3_server.filesystem().get_file_info("no-such-bucket").type.name == "NotFound"
    assert not (tmp_path / "cache" / "staging").exists()


def test_a_prefix_holding_other_files_is_refused_and_left_as_it_is(s3_server, tmp_path):
    s3_server.make_bucket("shared")
    with s3_server.filesystem().open_output_stream("shared/theirs/table.csv") as f:
        f.write(b"a,b\n")
    p = _rayft_run(s3_server, tmp_path / "cache", "s3://shared/theirs")
    _one_line_exit_2(p, "was not made by rayft")
    assert s3_server.objects("shared") == {"theirs/table.csv": 4}
