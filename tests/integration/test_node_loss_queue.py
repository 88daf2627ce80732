"""Losing a node under the queue: `rayft queue run` drives a job on a cluster of `ray start` nodes
on 127.0.0.1 (test_node_loss.LocalCluster), the node of one of its two training workers is removed
mid-run (its raylet SIGKILLed). The job (run.max_failures=0) fails with the lost node named, the
driver retries it once the cluster has room again, and that second submission resumes from the
first one's checkpoint and ends with the uninterrupted run's adapter: exactly two submissions.

Placement: the session's node-loss cluster (conftest's `cluster`: a head without CPUs, worker
nodes of one CPU each), here with three worker nodes. The job's entrypoint (`python -m
jobs.finetune`) takes half a CPU of one; each training worker asks for one whole CPU, which leaves
only the other two for the two workers, so the node removed holds a worker and nothing of the
job's driver."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clusters import LocalCluster
from gradtools import DEMO, RAY_STEPS, ROOT, final_adapter, rel_err
from polling import wait_until
from runs import metric_lines

from jobs.run.outputs import read_events
from tests.integration.test_queue import db_events, db_rows, view
from tests.integration.test_submit import SPEC, TINY, uniq

BIN = Path(sys.executable).parent
DRIVER_SIDE = {"JobSupervisor", "TrainController", "ProgressActor"}


def _project_copy(dst: Path) -> Path:
    """The project's files (tracked and not ignored) copied once, as the job's working dir. Ray's
    job SDK hashes a working dir twice (the URI the job names, then the package it uploads): a
    tree that other processes write to in between makes the two differ, and the job names a
    package that was never uploaded."""
    names = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    return dst


def _cluster_jobs(cluster: LocalCluster, name: str) -> list:
    from ray.job_submission import JobSubmissionClient

    jobs = [
        j for j in JobSubmissionClient(cluster.dashboard).list_jobs() if (j.metadata or {}).get("rayft.name") == name
    ]
    return sorted(jobs, key=lambda j: j.start_time)


@pytest.mark.ray
@pytest.mark.slow
def test_a_queued_job_whose_node_is_lost_is_retried_once_and_resumes(cluster, tmp_path, ray_reference):
    cluster.ensure_nodes(3)
    db, out, marker, name = tmp_path / "q.db", tmp_path / "run", tmp_path / "stalled", uniq("nodeloss")
    project = _project_copy(tmp_path / "project")
    add = subprocess.run(
        [
            str(BIN / "rayft"),
            "queue",
            "add",
            DEMO,
            *RAY_STEPS,
            "resources.cpus_per_worker=1",
            f"name={name}",
            f"run.output_dir={out}",
            f"run.env.RAYFT_FAULT=sleep:step=5,seconds=120,once={marker}",
            "--db",
            str(db),
        ],
        cwd=project,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert add.returncode == 0, add.stderr
    d = subprocess.Popen(
        [
            str(BIN / "rayft"),
            "queue",
            "run",
            "--db",
            str(db),
            "--address",
            cluster.dashboard,
            "--poll",
            "0.5",
            "--backoff",
            "1",
        ],
        cwd=project,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: marker.exists() and len(metric_lines(out)) >= 4, 300, "the job's step 5", proc=d)
        victim = cluster.remove_worker_node(DRIVER_SIDE)
        cluster.add_node()  # room again for the retry
        log, _ = d.communicate(timeout=400)
    finally:
        if d.poll() is None:
            d.kill()
    assert d.returncode == 0, log[-3000:]

    row = db_rows(db)[name]
    assert (row["state"], row["attempt"], row["retries"]) == ("SUCCEEDED", 2, 1), row
    jobs = _cluster_jobs(cluster, name)
    assert [str(j.status) for j in jobs] == ["FAILED", "SUCCEEDED"], [j.submission_id for j in jobs]
    assert victim in (jobs[0].message or "") + log, log[-3000:]  # the failed attempt names the lost node
    assert [e["kind"] for e in db_events(db) if e["job_id"] == row["id"]].count("submitting") == 2
    # the second submission resumed from the first one's checkpoint and finished the same run
    resumes = [e for e in read_events(out) if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 4, resumes
    assert [r["step"] for r in metric_lines(out)] == list(range(1, 9))
    assert rel_err(final_adapter(out), ray_reference) <= 1e-6
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


class _SmallCluster:
    """A backend whose cluster is one 1-CPU node: smaller than a 1-worker job needs (1.5 CPUs)."""

    def cluster_view(self):
        return view({"cpu": 1.0})


def test_a_retried_job_waits_for_a_shrunken_cluster_a_new_one_is_skipped(tmp_path):
    from orchestrator.queue.driver import Driver, DriverConfig, enqueue
    from orchestrator.queue.store import Queue

    q = Queue(tmp_path / "q.db")
    new, _ = enqueue(q, SPEC, [*TINY, "name=new"], working_dir=str(ROOT))
    retried, _ = enqueue(q, SPEC, [*TINY, "name=retried"], working_dir=str(ROOT))
    with q.txn() as c:  # it ran once (then lost a node, say)
        c.execute("UPDATE jobs SET attempt=1 WHERE id=?", (retried,))
    drv = Driver(q, _SmallCluster(), DriverConfig(log=lambda m: None))
    assert drv.admit() == 0
    detail = {r["id"]: r["status_detail"] for r in q.jobs()}
    assert detail[new].startswith("can never fit this cluster"), detail
    assert detail[retried].startswith("waiting for resources: the cluster is smaller than when it ran"), detail
    assert not drv.unschedulable_only()  # so `rayft queue run` keeps waiting for it
    with q.txn() as c:
        c.execute("UPDATE jobs SET state='CANCELED' WHERE id=?", (retried,))
    assert drv.unschedulable_only()  # a job that never ran here still stops the driver
