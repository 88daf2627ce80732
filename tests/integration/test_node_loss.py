"""Losing a node, not just a process: a Ray cluster of several nodes on 127.0.0.1 (token auth),
the two training workers on two different nodes, one node removed mid-run (its raylet and
everything under it SIGKILLed).

- With `run.max_failures=1` the run resumes from the last checkpoint once a node is added back
  and ends with the uninterrupted run's adapter.
- Without it, `rayft run` ends with one line naming the lost node (its id and IP as Ray reports
  them) and the step a rerun resumes from, exit code 1 (the cluster's fault), no traceback, and
  the checkpoints written so far kept.

Placement without any test-only spec field: the head node has no CPU (the driver, Ray Train's
controller and rayft's progress actor need none) and each worker node has exactly one, which
is what one worker asks for (`resources.cpus_per_worker=1`), so the two workers can only run on
two different worker nodes. rayft pins its progress actor to the driver's node (the head here);
the node removed is one that holds a training worker. One cluster (conftest's `cluster`, started
once per session) serves every node-loss test: each one starts from the worker nodes it needs,
here two (`LocalCluster.ensure_nodes`). The pieces (reading the lost worker's node from Ray
Train's error, matching a surviving rank's lost peer to the nodes the workers reported, asking
Ray whether that node is dead, cutting forwarded tracebacks) are also checked without a cluster,
at the end."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from clusters import LocalCluster
from gradtools import DEMO, RAY_STEPS, ROOT, final_adapter, rel_err
from polling import wait_until
from runs import metric_lines

from jobs.run.outputs import read_events

BIN = Path(sys.executable).parent


def _run(cluster: LocalCluster, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(BIN / "rayft"),
            "run",
            DEMO,
            f"run.output_dir={out}",
            *RAY_STEPS,
            "resources.cpus_per_worker=1",
            *extra,
            "--address",
            cluster.address,
        ],
        cwd=ROOT,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stall_then_remove_a_node(
    cluster: LocalCluster, p: subprocess.Popen, out: Path, marker: Path, steps: int = 5
) -> str:
    """Wait until the run stalls at step `steps` (its RAYFT_FAULT marker), remove the node of one of
    its training workers (never the one of rayft's progress actor, pinned to the driver's node, the
    head here: this only guards the test's premise); returns the removed node's id."""
    wait_until(lambda: marker.exists() and len(metric_lines(out)) >= steps, 300, f"step {steps}", proc=p)
    return cluster.remove_worker_node({"ProgressActor"})


@pytest.mark.ray
@pytest.mark.slow
def test_losing_a_node_resumes_from_the_last_checkpoint_once_capacity_is_back(cluster, tmp_path, ray_reference):
    cluster.ensure_nodes(2)
    out, marker = tmp_path / "run", tmp_path / "stalled"
    p = _run(cluster, out, "run.max_failures=1", f"run.env.RAYFT_FAULT=sleep:step=5,seconds=120,once={marker}")
    _stall_then_remove_a_node(cluster, p, out, marker)
    cluster.add_node()  # capacity back: a new node
    _, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-3000:]
    resumes = [e for e in read_events(out) if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 4, resumes
    assert [r["step"] for r in metric_lines(out)] == list(range(1, 9))
    assert rel_err(final_adapter(out), ray_reference) <= 1e-6


@pytest.mark.ray
@pytest.mark.slow
def test_without_max_failures_losing_a_node_ends_the_run_with_one_line_naming_it(cluster, tmp_path):
    """Rank 1 stalls before step 5 while rank 0 waits for it in the step's all-reduce; rank 1's
    node is removed. Rank 0's collective then fails at once ("Connection closed by peer"), often
    before Ray Train's health check fails rank 1: the line names the node either way."""
    cluster.ensure_nodes(2)
    out, marker = tmp_path / "run", tmp_path / "stalled"
    p = _run(cluster, out, f"run.env.RAYFT_FAULT=sleep:step=5,seconds=120,rank=1,once={marker}")  # max_failures 0
    wait_until(lambda: marker.exists() and len(metric_lines(out)) >= 5, 300, "step 5", proc=p)
    pid = int(marker.read_text().rsplit("pid ", 1)[1])
    victim = cluster.remove_node_of_pid(pid)
    o, err = p.communicate(timeout=300)
    assert p.returncode == 1, err[-3000:]  # the cluster's fault, not a usage error (2)
    assert "Traceback" not in o + err, (o + err)[-5000:]
    last = err.strip().splitlines()[-1]
    ip = cluster.node_ip(victim)  # dead nodes stay in Ray's node table
    assert last.startswith("rayft: error: lost node ") and victim in last and f"({ip})" in last, last
    assert "which held training worker rank 1" in last and "ranks" not in last, last
    assert "resumes from step 4" in last and str(out) in last, last
    # Nothing written so far is thrown away: the checkpoint of step 4 is still there, complete.
    from jobs.run import checkpoint as ckpt

    newest = ckpt.newest_complete(out / "checkpoints", warn=False)
    assert newest is not None and newest.name == ckpt.step_dir_name(4), newest
    assert not (out / "summary.json").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_a_crashed_worker_without_max_failures_ends_the_run_with_one_line_naming_its_rank(cluster, tmp_path):
    """Not a lost node: rank 0's process is SIGKILLed before step 3 and its node stays up. The run
    ends with exit 1 and one line naming the rank, what Ray says of its exit and the step a rerun
    resumes from (it ended in the driver's traceback of Ray's WorkerGroupError), without waiting
    for a verdict on the node that never comes (`node_lost` asks each candidate node to run a
    task: 99 s from start to exit before, 31 s after, on this machine)."""
    from jobs.launch.on_ray import NODE_DEATH_WAIT_S
    from jobs.run import checkpoint as ckpt

    cluster.ensure_nodes(2)
    out, marker = tmp_path / "run", tmp_path / "killed"
    p = _run(cluster, out, f"run.env.RAYFT_FAULT=kill:step=3,rank=0,once={marker}")  # max_failures 0
    o, err = p.communicate(timeout=300)
    assert p.returncode == 1 and marker.read_text().strip() == "killed rank 0 at step 3", err[-3000:]
    assert time.time() - marker.stat().st_mtime < NODE_DEATH_WAIT_S  # no wait for the node's death
    assert "Traceback" not in o + err, (o + err)[-5000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("rayft: error: training worker rank 0 died ("), last
    assert "run.max_failures=0" in last and "resumes from step 2" in last and str(out) in last, last
    assert ckpt.newest_complete(out / "checkpoints", warn=False).name == ckpt.step_dir_name(2)


# ---- the pieces, without a cluster -----------------------------------------------------------


def _worker_info(node_id: str, ip: str) -> str:
    """A worker as Ray Train's health check prints it (ActorMetadata lists node_id then node_ip)."""
    return (
        f"Worker(\n  actor=Actor(RayTrainWorker, ab12),\n  metadata=ActorMetadata(\n    hostname='vm',\n"
        f"    node_id='{node_id}',\n    node_ip='{ip}',\n    pid=1,\n  ),\n)"
    )


def _health_check_failure(node_id: str, ip: str, cause: Exception):
    """Ray Train's own error for a worker whose health-check poll failed."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    return WorkerHealthCheckFailedError(
        f"A worker health check failed.\nWorker info: {_worker_info(node_id, ip)}", failure=cause
    )


def _health_check_timeout(node_id: str, ip: str):
    """Ray Train's own error for a worker whose health-check poll hung past its timeout."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError

    return WorkerHealthCheckTimeoutError(
        "A worker health check has been hanging for 600.01 seconds. Marking the worker as dead.\n"
        f"Worker info: {_worker_info(node_id, ip)}"
    )


def test_unreachable_workers_are_read_from_ray_trains_health_check_failures():
    from ray.train import WorkerGroupError

    from jobs.errors import unreachable_workers

    a, b = "ab" * 28, "cd" * 28
    err = WorkerGroupError(
        "2 workers failed",
        {
            0: _health_check_failure(a, "10.0.0.7", RuntimeError("actor unavailable")),
            1: RuntimeError(f"gloo: connection closed; node_id='{b}', node_ip='10.0.0.8'"),  # a peer, not a lost worker
            2: _health_check_failure(a, "10.0.0.7", RuntimeError("actor died")),
        },
    )
    assert unreachable_workers(err) == {a: ("10.0.0.7", [0, 2])}
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = err
    assert unreachable_workers(wrapped) == {a: ("10.0.0.7", [0, 2])}
    # A node that froze or was cut off: its workers' polls hang until Ray Train gives up on them.
    hung = WorkerGroupError("1 worker failed", {1: _health_check_timeout(b, "10.0.0.8")})
    assert unreachable_workers(hung) == {b: ("10.0.0.8", [1])}
    assert unreachable_workers(WorkerGroupError("x", {0: RuntimeError("boom")})) == {}
    assert unreachable_workers(None) == {}


def test_forwarded_worker_tracebacks_are_cut_to_their_exception_line():
    from jobs.launch.on_ray import _TracebackFilter

    printed: list[list[str]] = []
    f = _TracebackFilter(lambda data: printed.append(data["lines"]))
    f(
        {
            "pid": 1,
            "is_err": True,
            "lines": [
                "Error in training function:",
                "Traceback (most recent call last):",
                '  File "x.py", line 1, in f',
                "    g()",
            ],
        }
    )
    f({"pid": 2, "is_err": True, "lines": ["  indented output of another process stays"]})
    f(
        {
            "pid": 1,
            "is_err": True,
            "lines": [
                '  File "y.py", line 2, in g',
                "    ^^^^",
                "RuntimeError: peer closed",
                "  indented again after it, kept",
            ],
        }
    )
    assert printed == [
        ["Error in training function:"],
        ["  indented output of another process stays"],
        ["RuntimeError: peer closed", "  indented again after it, kept"],
    ]


def test_a_worker_that_stopped_answering_is_a_lost_node_only_when_ray_marks_the_node_dead(monkeypatch):
    from ray.train import WorkerGroupError

    import jobs.launch.on_ray as launch

    a = "ab" * 28
    err = WorkerGroupError("1 worker failed", {1: _health_check_failure(a, "10.0.0.7", RuntimeError("unavailable"))})
    table = [{"NodeID": a, "Alive": True, "NodeManagerAddress": "10.0.0.7"}]
    monkeypatch.setattr(launch.ray, "nodes", lambda: table)
    assert launch.node_lost(err, wait_s=0) is None  # node up: a crashed worker process, Ray's error stays
    table[0].update(Alive=False, DeathReasonMessage="health check failed due to missing too many heartbeats")
    lost = launch.node_lost(err, wait_s=0)
    assert (lost.node_id, lost.node_ip, lost.exit_code) == (a, "10.0.0.7", 1)
    assert str(lost) == (
        f"lost node {a} (10.0.0.7), which held training worker rank 1 "
        "(health check failed due to missing too many heartbeats)"
    )


def test_a_worker_whose_node_runs_a_task_is_not_waited_for_as_a_lost_node(monkeypatch):
    """A worker process that crashed on a node that is up: Ray never marks that node dead, so the
    wait for the verdict ends as soon as every candidate node has run a task pinned to it (it used
    to last the whole `wait_s`: the crash's line came 70 s late). A candidate that does not run it
    is waited for, and named once Ray marks it dead."""
    from ray.train import WorkerGroupError

    import jobs.launch.on_ray as launch

    a = "ab" * 28
    err = WorkerGroupError("1 worker failed", {1: _health_check_failure(a, "10.0.0.7", RuntimeError("unavailable"))})
    table, polls, asked = [{"NodeID": a, "Alive": True}], [], []

    def nodes():
        polls.append(1)
        return table

    def up(node_ids):  # every node asked runs its task
        asked.append(node_ids)
        return lambda: set(node_ids)

    monkeypatch.setattr(launch.ray, "nodes", nodes)
    assert launch.node_lost(err, wait_s=30, probe=up) is None
    assert asked == [[a]] and len(polls) == 1  # asked once, answered: no second poll of the cluster

    def silent(node_ids):  # the node never runs it; Ray marks it dead after it was asked twice
        calls: list[int] = []
        return lambda: calls.append(1) or table[0].update(Alive=len(calls) < 2) or set()

    lost = launch.node_lost(err, wait_s=30, probe=silent)
    assert lost is not None and lost.node_id == a and len(polls) == 1 + 3
    table[0]["Alive"] = True
    assert launch.node_lost(err, wait_s=0, probe=up) is None and len(polls) == 1 + 3 + 1  # no wait: no task


def test_a_survivors_lost_peer_names_the_lost_node_from_where_the_workers_started(monkeypatch):
    """The rank that survives a lost node can fail first (its collective's connection closed),
    before Ray Train's health check has failed the lost node's worker: the node is then found among
    the ones the workers reported at start-up. Only for that failure and only once Ray marks the
    node dead; any other failure keeps Ray's error."""
    from ray.train import WorkerGroupError

    import jobs.launch.on_ray as launch

    a, b = "ab" * 28, "cd" * 28
    gloo = RuntimeError(  # rank 0's error when the node of rank 1 was removed, in the real test above
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:46802. This is typically caused by a remote worker crashing."
    )
    err = WorkerGroupError("1 worker failed", {0: gloo})
    placement = {0: (a, "10.0.0.7"), 1: (b, "10.0.0.8"), 2: (b, "10.0.0.8")}
    table = [{"NodeID": a, "Alive": True}, {"NodeID": b, "Alive": True}]
    monkeypatch.setattr(launch.ray, "nodes", lambda: table)
    assert launch.node_lost(err, wait_s=0, placement=placement) is None  # every node up
    table[1]["Alive"] = False
    lost = launch.node_lost(err, wait_s=0, placement=placement)
    assert (lost.node_id, lost.node_ip) == (b, "10.0.0.8")
    assert str(lost) == f"lost node {b} (10.0.0.8), which held training worker ranks 1, 2"
    assert launch.node_lost(err, wait_s=0) is None  # nothing reported where the workers ran
    other = WorkerGroupError("1 worker failed", {0: ValueError("labels: 7 is out of range")})
    assert launch.node_lost(other, wait_s=0, placement=placement) is None


def test_a_worker_failure_is_named_by_the_rank_whose_process_died_before_its_survivors():
    """`worker_failure`: a rank Ray Train's health check failed (its process died: Ray's exit
    detail) comes before the ranks that only lost their peer; a rank that raised is named with its
    exception line (a traceback's last line); no worker failures, no name."""
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckTimeoutError

    from jobs.errors import worker_failure, worker_failure_line

    died = RuntimeError(
        "The actor died unexpectedly before finishing this task.\nThe actor is dead because its worker process "
        "has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
        "error code 2. End of file. Some common causes include: (1) the process was killed by the OOM killer"
    )
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:31622: Connection reset by peer.")
    err = WorkerGroupError(
        "2 workers failed", {0: gloo, 2: gloo, 1: _health_check_failure("ab" * 28, "10.0.0.7", died)}
    )
    exited = "died (Worker unexpectedly exits with a connection error code 2)"
    assert worker_failure(err) == (1, exited) and worker_failure_line(err) == f"training worker rank 1 {exited}"
    hung = WorkerHealthCheckTimeoutError("A worker health check has been hanging for 600.01 seconds.")
    assert worker_failure(WorkerGroupError("", {3: hung, 0: gloo}))[0] == 3
    assert worker_failure(WorkerGroupError("", {1: gloo, 0: gloo})) == (0, f"failed: RuntimeError: {gloo}")
    traced = RuntimeError("Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'labels'")
    assert worker_failure(WorkerGroupError("", {0: traced})) == (0, "failed: KeyError: 'labels'")
    assert worker_failure(RuntimeError("the controller failed")) is None


def test_a_lost_peer_is_read_from_the_lines_gloo_torch_and_nccl_print():
    from ray.train import WorkerGroupError

    from jobs.errors import peer_gone

    for line in (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5",
        "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out ...: Connection reset by peer",
        "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed.",
        "DistBackendError: NCCL communicator was aborted on rank 1.",
    ):
        wrapped = RuntimeError("outer")
        wrapped.__cause__ = WorkerGroupError("1 worker failed", {1: RuntimeError(line)})
        assert peer_gone(wrapped), line
    assert not peer_gone(WorkerGroupError("1 worker failed", {0: ValueError("loss is nan at step 3")}))
    download = "ConnectionError: ('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))"
    assert not peer_gone(WorkerGroupError("1 worker failed", {0: RuntimeError(download)}))
    assert not peer_gone(None)


def test_ray_trains_preemption_watcher_line_is_dropped_and_other_core_worker_errors_are_not():
    """The one known-noise line (Ray Train's PreemptionWatcher, ray-project/ray#53727) is dropped
    from the console; a core worker error about any other actor, or the same words elsewhere, stay."""
    from jobs.launch.on_ray import _TracebackFilter

    noise = (
        "[2026-12-02 02:18:20,075 E 20735 20795] core_worker.cc:2465: Actor with class name: "
        "'PreemptionWatcher' and ID: '6846c3' has constructor arguments in the object store and "
        "max_restarts > 0. If the arguments in the object store go out of scope or are lost, the actor "
        "restart will fail."
    )
    other = noise.replace("PreemptionWatcher", "MyActor")
    printed: list[list[str]] = []
    f = _TracebackFilter(lambda data: printed.append(data["lines"]))
    f({"pid": 1, "is_err": True, "lines": [noise, other, "rayft line"]})
    f({"pid": 1, "is_err": True, "lines": [noise]})  # nothing left: nothing printed
    assert printed == [[other, "rayft line"]]
