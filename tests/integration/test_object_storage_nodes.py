"""A run into object storage over two Ray nodes that share no disk, against a real S3 server
(SeaweedFS's `weed`, the `s3_server` fixture) and a real local Ray cluster: each node has a rayft
cache of its own (`RAYFT_CACHE`, so a staging directory of its own, as on two machines), one CPU
(so the run's two workers land on different nodes), and the S3 variables in its environment (as an
instance role would give them), never in the job's.

Each rank uploads its own part of every checkpoint (the files its manifest names, then the
manifest), rank 0 the history and the outputs, summary.json last; the driver, on neither node,
reads the summary from the bucket. A run whose rank 0 is killed after its first checkpoint is
restarted by Ray Train (`run.max_failures=1`): every node brings the bucket's checkpoint onto its
disk, and the run ends with the uninterrupted run's adapter bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gradtools import DEMO, ROOT

from jobs.run import checkpoint as ckpt
from tests.integration.test_object_storage import STEPS, _bucket_adapter, _whole_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.ray]
BIN = Path(sys.executable).parent
ON_TWO_NODES = [*(s for s in STEPS if not s.startswith("resources.num_workers")), "resources.num_workers=2"]
ON_TWO_NODES += ["resources.cpus_per_worker=1"]


@pytest.fixture(scope="module")
def two_nodes(s3_server, tmp_path_factory):
    """A head with no CPU and two worker nodes of 1 CPU, each with its own rayft cache."""
    from clusters import LocalCluster

    tmp = tmp_path_factory.mktemp("two-nodes")
    cluster = LocalCluster(tmp)
    try:
        for i in range(2):
            cluster.add_node(cpus=1, env={**s3_server.env(), "RAYFT_CACHE": str(tmp / f"node{i}-cache")})
        yield cluster, [tmp / f"node{i}-cache" for i in range(2)]
    finally:
        cluster.stop()


def _run(cluster, server, cache: Path, uri: str, *more: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "rayft"), "run", DEMO, f"run.output_dir={uri}", *ON_TWO_NODES, *more, "--address", cluster.address]
    env = {**cluster.env, **server.env(), "RAYFT_CACHE": str(cache)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_run_over_two_nodes_writes_whole_checkpoints_and_resumes_after_a_restart_bit_for_bit(
    two_nodes, s3_server, tmp_path
):
    cluster, node_caches = two_nodes
    server = s3_server
    server.make_bucket("nodes")
    p = _run(cluster, server, tmp_path / "driver", "s3://nodes/straight/{name}")
    assert p.returncode == 0, p.stderr[-3000:]
    prefix = "nodes/straight/tiny-lora"
    # every checkpoint whole (both ranks' manifests and files), the history and the outputs there
    assert _whole_checkpoints(server, prefix, tmp_path / "straight") == {"step-00000002": None, "step-00000004": None}
    for step in ("step-00000002", "step-00000004"):  # each rank uploaded its own part
        names = set(server.objects(f"{prefix}/checkpoints/{step}"))
        assert {ckpt.manifest_file(0), ckpt.manifest_file(1)} <= names, names
    objects = set(server.objects(prefix))
    assert {"summary.json", "metrics.jsonl", "adapter/adapter_model.safetensors"} <= objects, objects
    (summary,) = (tmp_path / "driver" / "staging").glob("*/summary.json")  # read from the bucket by the driver
    assert json.loads(summary.read_text())["steps"] == 4
    # rank 0 staged the run on its own node, not on the driver's disk
    assert any(any(c.glob("staging/*/metrics.jsonl")) for c in node_caches)
    assert not list((tmp_path / "driver" / "staging").glob("*/metrics.jsonl"))

    # rank 0 killed after checkpoint 2: Ray Train restarts the workers (run.max_failures=1), each node
    # brings the bucket's newest checkpoint onto its disk (what it had is replaced: the bucket decides)
    uri, prefix = "s3://nodes/resumed/{name}", "nodes/resumed/tiny-lora"
    killed = tmp_path / "killed"
    fault = f"run.env.RAYFT_FAULT=kill:step=2,rank=0,once={killed}"
    p = _run(cluster, server, tmp_path / "driver2", uri, fault, "run.max_failures=1")
    assert p.returncode == 0 and killed.exists(), p.stderr[-3000:]
    with server.filesystem().open_input_stream(f"{prefix}/summary.json") as f:
        assert json.loads(f.read())["resumed_from_step"] == 2
    with server.filesystem().open_input_stream(f"{prefix}/metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f.read().decode().splitlines()] == [1, 2, 3, 4]
    resumed, straight = _bucket_adapter(server, prefix), _bucket_adapter(server, "nodes/straight/tiny-lora")
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_a_node_keeps_one_fetched_checkpoint_not_one_per_restart(s3_server, tmp_path, monkeypatch):
    """`mirror.fetch_checkpoint` on a node that is not rank 0's: each restart takes the checkpoint
    rank 0 chose into a copy named by its manifests' digest, and the copies of earlier attempts
    (with their locks and a dead builder's temporary directory) are removed once it is there; the
    same checkpoint again is the same copy, not downloaded anew."""
    from gradtools import tiny_spec

    from jobs.run import mirror

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RAYFT_CACHE", str(tmp_path / "cache"))
    s3_server.make_bucket("fetched")
    spec = tiny_spec("run.output_dir=s3://fetched/run")
    for step in (1, 2):  # each rank's part, uploaded as push_rank_checkpoint does on its own node
        for rank in (0, 1):
            part = tmp_path / f"rank{rank}-step{step}"
            files: dict = {f"rank{rank}.pt": torch.full((3,), float(step))}
            if rank == 0:
                files[ckpt.STATE_FILE] = {"world_size": 2, "step": step}
            ckpt.write_rank_files(part, rank, files)
            mirror.push_rank_checkpoint(spec, part, rank, step)
    first = mirror.fetch_checkpoint(spec, ckpt.step_dir_name(1))
    root = first.parent
    (root / f"{first.name}.tmpdeadbuilder").mkdir()  # a builder of that copy killed mid-download
    second = mirror.fetch_checkpoint(spec, ckpt.step_dir_name(2))
    assert ckpt.why_incomplete(second) is None
    assert torch.load(second / "rank1.pt").tolist() == [2.0] * 3
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(mirror.FETCHED)) == [
        second.name,
        f"{second.name}.lock",
    ]
    (second / "marker").write_text("this copy")  # fetching the same checkpoint must not replace it
    assert mirror.fetch_checkpoint(spec, ckpt.step_dir_name(2)) == second
    assert (second / "marker").read_text() == "this copy"
