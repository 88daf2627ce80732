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
the node removed is one that holds a training worker. One cluster serves the module: each test
starts from two live worker nodes (`LocalCluster.ensure_nodes`). The pieces (reading the lost
worker's node from Ray Train's error, asking Ray whether that node is dead, cutting forwarded
tracebacks) are also checked without a cluster, at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import _wait_for_jobs_api, cluster_env, free_port
from gradtools import ROOT, final_adapter, rel_err
from jobs.outputs import read_events, read_metrics
from test_resume import DEMO, RAY_STEPS, ray_reference  # noqa: F401  (the module's reference fixture)

BIN = Path(sys.executable).parent
# Node death noticed within ~10 s instead of Ray's default ~30 s (with room for a busy machine).
FAST_HEALTH = json.dumps({"health_check_period_ms": 2000, "health_check_failure_threshold": 5,
                          "health_check_timeout_ms": 2000})


class LocalCluster:
    """`ray start --head` (0 CPUs) plus worker nodes of 1 CPU each, every node its own process
    group, so removing a node kills exactly that node's raylet and its workers."""

    def __init__(self, tmp: Path, head_cpus: int = 0):
        self.env = cluster_env()
        subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=self.env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        gcs, dash = free_port(), free_port()
        self.address, self.dashboard = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}"
        # Every process of this cluster (Ray Train's placement group cleaner included) talks to
        # this cluster, not to the newest other `ray start` cluster on the machine.
        self.env["RAY_ADDRESS"] = self.address
        self.tmp = tmp
        self.nodes: list[subprocess.Popen] = []
        self.node_ids: dict[int, str] = {}          # node process id -> Ray node id
        self.head = self._start(["--head", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                                 f"--ray-client-server-port={free_port()}", f"--num-cpus={head_cpus}",
                                 f"--system-config={FAST_HEALTH}"], "head")
        self.process = self.head                     # for conftest._wait_for_jobs_api
        _wait_for_jobs_api(self)
        self.head_id = self._nodes()[0]["node_id"]   # the only node so far

    def _nodes(self) -> list[dict]:
        """Ray's state API view of the nodes: node_id, node_ip, state, resources_total."""
        from orchestrator.backends.ray_jobs import RayJobsBackend

        got = RayJobsBackend(self.dashboard, timeout_s=10)._get("/api/v0/nodes?limit=1000&detail=true")
        return ((got.get("data") or {}).get("result") or {}).get("result") or []

    def node_ip(self, node_id: str) -> str:
        """The IP Ray reports for the node (its raylet's address, not always the --node-ip-address)."""
        return next(n["node_ip"] for n in self._nodes() if n["node_id"] == node_id)

    def ensure_nodes(self, n: int) -> None:
        """Add worker nodes until `n` are alive (one at a time: nodes joining on one IP race)."""
        while len(self.wait_nodes(sum(q.poll() is None for q in self.nodes))) < n:
            self.add_node()

    def _start(self, args: list[str], name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        return subprocess.Popen([str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1",
                                 "--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}", *args], env=self.env, start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)

    def alive_cpu_nodes(self) -> list[str]:
        from orchestrator.backends.ray_jobs import RayJobsBackend

        return [n.node_id for n in RayJobsBackend(self.dashboard, timeout_s=10).cluster_view().nodes
                if n.cpu_total >= 1 and n.node_id != getattr(self, "head_id", None)]

    def add_node(self) -> subprocess.Popen:
        """Start one more worker node and wait until it is alive; records its Ray node id."""
        before = set(self.wait_nodes(sum(q.poll() is None for q in self.nodes)))
        p = self._start([f"--address={self.address}", "--num-cpus=1"], f"node{len(self.nodes)}")
        self.nodes.append(p)
        (new,) = set(self.wait_nodes(len(before) + 1)) - before
        self.node_ids[p.pid] = new
        return p

    def actors_by_node(self) -> dict[str, set[str]]:
        """{node id: class names of the alive actors on it}, from the dashboard's state API."""
        from orchestrator.backends.ray_jobs import RayJobsBackend

        got = RayJobsBackend(self.dashboard, timeout_s=10)._get("/api/v0/actors?limit=10000&detail=true")
        out: dict[str, set[str]] = {}
        for a in ((got.get("data") or {}).get("result") or {}).get("result") or []:
            if a.get("state") == "ALIVE":
                out.setdefault(a.get("node_id"), set()).add(a.get("class_name"))
        return out

    def wait_nodes(self, n: int, timeout_s: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ids = self.alive_cpu_nodes()
            except Exception:
                ids = []
            if len(ids) == n:
                return ids
            assert time.monotonic() < deadline, f"{len(ids)} worker nodes alive, expected {n}"
            time.sleep(0.5)

    @staticmethod
    def wait_until(proc: subprocess.Popen, ready, what: str, timeout_s: float = 300) -> None:
        """Poll `ready()` until it holds; `proc` (the rayft process under test) must stay alive."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert proc.poll() is None, "".join(x or "" for x in proc.communicate())[-3000:]
            assert time.monotonic() < deadline, f"never reached: {what}"
            time.sleep(0.5)

    def remove_worker_node(self, not_with: set[str]) -> str:
        """SIGKILL a live node that holds a Ray Train worker and none of the actors named in
        `not_with` (the test's premise: the driver side survives), wait until Ray has marked it
        dead; returns its Ray node id."""
        for _ in range(60):                           # the state API may answer before it lists every actor
            on = self.actors_by_node()
            victims = [p for p in self.nodes if p.poll() is None
                       and "RayTrainWorker" in on.get(self.node_ids[p.pid], set())
                       and not not_with & on.get(self.node_ids[p.pid], set())]
            if victims:
                break
            time.sleep(0.5)
        assert victims, on
        alive = len(self.alive_cpu_nodes())
        self.kill(victims[0])                         # a whole node: its raylet and its workers
        self.wait_nodes(alive - 1)
        return self.node_ids[victims[0].pid]

    @staticmethod
    def kill(p: subprocess.Popen) -> None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=60)

    def stop(self) -> None:
        for p in self.nodes + [self.head]:
            self.kill(p)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.stop()


def _run(cluster: LocalCluster, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "rayft"), "run", DEMO, f"run.output_dir={out}", *RAY_STEPS,
                             "resources.cpus_per_worker=1", *extra, "--address", cluster.address],
                            cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stall_then_remove_a_node(cluster: LocalCluster, p: subprocess.Popen, out: Path, marker: Path,
                              steps: int = 5) -> str:
    """Wait until the run stalls at step `steps` (its RAYFT_FAULT marker), remove the node of one of
    its training workers (never the one of rayft's progress actor, pinned to the driver's node, the
    head here: this only guards the test's premise); returns the removed node's id."""
    cluster.wait_until(p, lambda: marker.exists() and len(read_metrics(out)) >= steps, f"step {steps}")
    return cluster.remove_worker_node({"ProgressActor"})


@pytest.mark.ray
@pytest.mark.slow
def test_losing_a_node_resumes_from_the_last_checkpoint_once_capacity_is_back(cluster, tmp_path, ray_reference):
    cluster.ensure_nodes(2)
    out, marker = tmp_path / "run", tmp_path / "stalled"
    p = _run(cluster, out, "run.max_failures=1", f"run.env.RAYFT_FAULT=sleep:step=5,seconds=120,once={marker}")
    _stall_then_remove_a_node(cluster, p, out, marker)
    cluster.add_node()                                # capacity back: a new node
    _, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-3000:]
    resumes = [e for e in read_events(out) if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 4, resumes
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    assert rel_err(final_adapter(out), ray_reference) <= 1e-6



@pytest.mark.ray
@pytest.mark.slow
def test_without_max_failures_losing_a_node_ends_the_run_with_one_line_naming_it(cluster, tmp_path):
    cluster.ensure_nodes(2)
    out, marker = tmp_path / "run", tmp_path / "stalled"
    p = _run(cluster, out, f"run.env.RAYFT_FAULT=sleep:step=5,seconds=120,once={marker}")   # max_failures 0
    victim = _stall_then_remove_a_node(cluster, p, out, marker)
    o, err = p.communicate(timeout=300)
    assert p.returncode == 1, err[-3000:]                  # the cluster's fault, not a usage error (2)
    assert "Traceback" not in o + err, (o + err)[-5000:]
    last = err.strip().splitlines()[-1]
    ip = cluster.node_ip(victim)                            # dead nodes stay in Ray's node table
    assert last.startswith("rayft: error: lost node ") and victim in last and f"({ip})" in last, last
    assert "resumes from step 4" in last and str(out) in last, last
    # Nothing written so far is thrown away: the checkpoint of step 4 is still there, complete.
    from jobs import checkpoint as ckpt

    newest = ckpt.newest_complete(out / "checkpoints", warn=False)
    assert newest is not None and newest.name == ckpt.step_dir_name(4), newest
    assert not (out / "summary.json").exists()


# ---- the pieces, without a cluster -----------------------------------------------------------

def _health_check_failure(node_id: str, ip: str, cause: Exception):
    """Ray Train's own error for a worker that stopped answering, with its worker info as Ray
    formats it (ActorMetadata lists node_id then node_ip)."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    info = (f"A worker health check failed.\nWorker info: Worker(\n  actor=Actor(RayTrainWorker, ab12),\n"
            f"  metadata=ActorMetadata(\n    hostname='vm',\n    node_id='{node_id}',\n    node_ip='{ip}',\n"
            f"    pid=1,\n  ),\n)")
    return WorkerHealthCheckFailedError(info, failure=cause)


def test_unreachable_workers_are_read_from_ray_trains_health_check_failures():
    from ray.train import WorkerGroupError

    from jobs.errors import unreachable_workers

    a, b = "ab" * 28, "cd" * 28
    err = WorkerGroupError("2 workers failed", {
        0: _health_check_failure(a, "10.0.0.7", RuntimeError("actor unavailable")),
        1: RuntimeError(f"gloo: connection closed; node_id='{b}', node_ip='10.0.0.8'"),  # a peer, not a lost worker
        2: _health_check_failure(a, "10.0.0.7", RuntimeError("actor died")),
    })
    assert unreachable_workers(err) == {a: ("10.0.0.7", [0, 2])}
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = err
    assert unreachable_workers(wrapped) == {a: ("10.0.0.7", [0, 2])}
    assert unreachable_workers(WorkerGroupError("x", {0: RuntimeError("boom")})) == {}
    assert unreachable_workers(None) == {}


def test_forwarded_worker_tracebacks_are_cut_to_their_exception_line():
    from jobs.launch import _TracebackFilter

    printed: list[list[str]] = []
    f = _TracebackFilter(lambda data: printed.append(data["lines"]))
    f({"pid": 1, "is_err": True, "lines": ["Error in training function:", "Traceback (most recent call last):",
                                           '  File "x.py", line 1, in f', "    g()"]})
    f({"pid": 2, "is_err": True, "lines": ["  indented output of another process stays"]})
    f({"pid": 1, "is_err": True, "lines": ['  File "y.py", line 2, in g', "    ^^^^", "RuntimeError: peer closed",
                                           "  indented again after it, kept"]})
    assert printed == [["Error in training function:"], ["  indented output of another process stays"],
                       ["RuntimeError: peer closed", "  indented again after it, kept"]]


def test_a_worker_that_stopped_answering_is_a_lost_node_only_when_ray_marks_the_node_dead(monkeypatch):
    from ray.train import WorkerGroupError

    import jobs.launch as launch

    a = "ab" * 28
    err = WorkerGroupError("1 worker failed", {1: _health_check_failure(a, "10.0.0.7", RuntimeError("unavailable"))})
    table = [{"NodeID": a, "Alive": True, "NodeManagerAddress": "10.0.0.7"}]
    monkeypatch.setattr(launch.ray, "nodes", lambda: table)
    assert launch.node_lost(err, wait_s=0) is None           # node up: a crashed worker process, Ray's error stays
    table[0].update(Alive=False, DeathReasonMessage="health check failed due to missing too many heartbeats")
    lost = launch.node_lost(err, wait_s=0)
    assert (lost.node_id, lost.node_ip, lost.exit_code) == (a, "10.0.0.7", 1)
    assert str(lost) == (f"lost node {a} (10.0.0.7), which held training worker rank 1 "
                         "(health check failed due to missing too many heartbeats)")
