"""The Ray clusters the tests start on 127.0.0.1 (token auth, as Ray 2.60 does by default): the
single-node `RayHead` and the multi-node `LocalCluster` for node-loss tests. conftest starts one of
each per test session (the first test that needs it) and stops it after the last one that does."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from polling import wait_until

BIN = Path(sys.executable).parent
# Node death noticed within ~10 s instead of Ray's default ~30 s (with room for a busy machine).
FAST_HEALTH = json.dumps(
    {"health_check_period_ms": 2000, "health_check_failure_threshold": 5, "health_check_timeout_ms": 2000}
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env() -> dict:
    """Environment for clients and for the cluster's own processes: the venv's `python` first
    on PATH (the job entrypoint `python -m jobs.finetune` must find torch), token auth on."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_AUTH_MODE"] = "token"
    env.pop("RAY_ADDRESS", None)
    return env


def own_temp_dir() -> str:
    """A fresh `--temp-dir` for one cluster's nodes (short: Ray's socket paths must stay under 107
    characters). Ray's job supervisor resolves the GCS address a job's entrypoint connects to as
    "auto": with more than one Ray instance on the machine, that is `<temp dir>/ray_current_cluster`,
    the newest `ray start` cluster sharing the temp dir. With the default /tmp/ray for every
    cluster, a job submitted to the Ray head ran on the node-loss cluster (or hung once that was
    stopped) whenever another test process had a Ray instance up."""
    import tempfile

    return tempfile.mkdtemp(prefix="ray-", dir="/tmp")


_token_ensured: set[str] = set()


def ensure_auth_token() -> None:
    """~/.ray/auth_token, created when missing (kept when present): `ray start` with token auth and
    every token-auth client of this process need it, and a fresh machine (CI's empty HOME) has none.
    Ray caches the token a process first loads, so tests never swap in another one; so once this
    has run for a HOME, the file is there for the rest of the session and is not asked for again."""
    home = str(Path.home())
    if home in _token_ensured and (Path(home) / ".ray" / "auth_token").is_file():
        return
    subprocess.run(
        [str(BIN / "ray"), "get-auth-token", "--generate"],
        env=cluster_env(),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=60,
    )
    _token_ensured.add(home)


def kill_group(p: subprocess.Popen, sig: int = signal.SIGKILL, timeout_s: float = 60) -> None:
    """Signal a `ray start --block` process group (one node: its raylet and everything under it)."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)


def wait_for_jobs_api(info, timeout_s: float = 120.0) -> None:
    """Return once the cluster accepts jobs. The Jobs API answers `list_jobs` before the head's
    job agent has registered, and a submission then fails with "No available agent to submit
    job": so a no-op probe job is submitted (retried until accepted) and waited for."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    probe = f"cluster-ready-probe-{info.dashboard.rsplit(':', 1)[1]}"
    submitted = [False]
    last_error: list[Exception | None] = [None]

    def ran() -> bool:
        if info.process.poll() is not None:
            raise RuntimeError(f"ray start exited with {info.process.returncode}")
        try:
            client = JobSubmissionClient(info.dashboard)
            if not submitted[0]:
                client.submit_job(entrypoint="true", submission_id=probe)
                submitted[0] = True
            return client.get_job_status(probe) in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)
        except Exception as e:  # not up yet
            last_error[0] = e
            return False

    try:
        wait_until(ran, timeout_s, f"the cluster at {info.dashboard} ran a no-op job")
    except AssertionError as e:
        said = agent_errors(info.temp_dir)
        raise TimeoutError(f"{e} (last error: {last_error[0]!r}; the head's job agent said: {said})") from None


def agent_errors(temp_dir: str) -> list[str]:
    """The ERROR lines of the head's dashboard_agent.log (its newest session): a job agent whose HTTP
    server failed to start stays alive, never registers, and says why only there."""
    logs = sorted(Path(temp_dir).glob("session_2*/logs/dashboard_agent.log"))
    text = logs[-1].read_text(errors="replace") if logs else ""
    return [line for line in text.splitlines() if "\tERROR " in line][-3:]  # Ray: time, TAB, level


# Starts of one cluster (its head) before the test fails: a head whose job agent never registers
# (seen once in CI, 120 s without an agent on a loaded machine) gets a second start from scratch.
CLUSTER_START_TRIES = 2


def start_accepting_jobs(cluster) -> None:
    """`cluster._start_head()` until its head accepts jobs, `CLUSTER_START_TRIES` times at most."""
    for attempt in range(1, CLUSTER_START_TRIES + 1):
        cluster._start_head()
        try:
            wait_for_jobs_api(cluster)
            return
        except BaseException as e:
            cluster.stop()  # nothing of a failed start is left running
            if attempt == CLUSTER_START_TRIES or not isinstance(e, (TimeoutError, RuntimeError)):
                raise


class RayHead:
    """`ray start --head` with 4 CPUs, in its own process group: stopping it stops exactly this
    cluster (`ray stop` would kill every Ray process of the user, including unrelated local
    clusters)."""

    def __init__(self, env: dict | None = None):
        """`env`: variables of the head's own (its workers inherit them, as from a machine's
        environment or role), e.g. an object store's endpoint and keys."""
        self.env = {**cluster_env(), **(env or {})}
        ensure_auth_token()
        self.token_path = Path.home() / ".ray" / "auth_token"
        start_accepting_jobs(self)

    def _start_head(self) -> None:
        gcs, dash, client = free_port(), free_port(), free_port()
        self.temp_dir = own_temp_dir()
        cmd = [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}",
            "--num-cpus=4",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            # The job agent binds a port of the system's choosing: a fixed one (Ray's default 52365)
            # is taken by any other cluster on this machine, and one picked here is free only until
            # someone else binds it. A job agent that cannot bind its port stays alive without
            # registering, and the head then accepts no job ("No available agent").
            "--dashboard-agent-listen-port=0",
        ]
        self.process = subprocess.Popen(
            cmd, env=self.env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.address, self.dashboard = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}"

    def stop(self) -> None:
        # SIGKILL, as LocalCluster does: a graceful `ray start --block` exit takes ~30 s on a busy
        # machine, and nothing of the cluster is kept.
        kill_group(self.process)


NODE_START_TRIES = 3  # starts of one worker node (`LocalCluster.add_node`) before the test fails


class LocalCluster:
    """`ray start --head` (0 CPUs) plus worker nodes of 1 CPU each, every node its own process
    group, so removing a node kills exactly that node's raylet and its workers.

    Shared by every node-loss test: each one first asks for the worker nodes it needs
    (`ensure_nodes`), which adds nodes or stops idle ones until exactly that many are alive."""

    def __init__(self, tmp: Path):
        self.env = cluster_env()
        ensure_auth_token()
        # conftest's 0.25 s controller poll, as everywhere: with it, the surviving rank's gloo error
        # is often polled before the lost node's worker fails its health check, the failure
        # `jobs.launch.on_ray.node_lost` matches to the lost node through where the workers started.
        self.tmp = tmp
        self.nodes: list[subprocess.Popen] = []
        self.node_ids: dict[int, str] = {}  # node process id -> Ray node id
        start_accepting_jobs(self)
        try:
            self.head_id = self._nodes()[0]["node_id"]  # the only node so far
        except BaseException:
            self.stop()
            raise

    def _start_head(self) -> None:
        gcs, dash = free_port(), free_port()
        self.address, self.dashboard = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}"
        # Every process of this cluster (Ray Train's placement group cleaner included) talks to
        # this cluster, not to the newest other `ray start` cluster on the machine.
        self.env["RAY_ADDRESS"] = self.address
        self.temp_dir = own_temp_dir()  # every node's
        self.head = self._start(
            [
                "--head",
                f"--port={gcs}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dash}",
                f"--ray-client-server-port={free_port()}",
                "--num-cpus=0",
                f"--system-config={FAST_HEALTH}",
            ],
            "head",
        )
        self.process = self.head  # for wait_for_jobs_api

    def _get(self, path: str) -> dict:
        from orchestrator.backends.ray_jobs import RayJobsBackend

        return RayJobsBackend(self.dashboard, timeout_s=10)._get(path)

    def _nodes(self) -> list[dict]:
        """Ray's state API view of the nodes: node_id, node_ip, state, resources_total."""
        got = self._get("/api/v0/nodes?limit=1000&detail=true")
        return ((got.get("data") or {}).get("result") or {}).get("result") or []

    def node_ip(self, node_id: str) -> str:
        """The IP Ray reports for the node (its raylet's address, not always the --node-ip-address)."""
        return next(n["node_ip"] for n in self._nodes() if n["node_id"] == node_id)

    def _live(self) -> list[subprocess.Popen]:
        return [q for q in self.nodes if q.poll() is None]

    def ensure_nodes(self, n: int) -> None:
        """Exactly `n` worker nodes alive: add nodes (one at a time: nodes joining on one IP race),
        or stop surplus ones, those holding no actor first (a test's leftovers are gone by then).
        A node process Ray has marked dead (its health checks missed on a loaded machine) is
        stopped first: it would never be counted again."""
        self._stop_dead_nodes()
        while len(self.wait_nodes(len(self._live()))) < n:
            self.add_node()
        surplus = len(self._live()) - n
        if surplus > 0:
            busy = {node for node, actors in self.actors_by_node().items() if actors}
            idle_first = sorted(self._live(), key=lambda q: self.node_ids.get(q.pid) in busy)
            for q in idle_first[:surplus]:
                kill_group(q, signal.SIGTERM, timeout_s=15)  # the node stops its workers and leaves
            self.wait_nodes(n)

    def _stop_dead_nodes(self) -> None:
        """Stop the node processes that still run but whose Ray node is no longer alive."""
        alive = set(wait_until(self._alive_or_none, 60, "the dashboard lists the nodes")[0])
        for q in self._live():
            if q.pid in self.node_ids and self.node_ids[q.pid] not in alive:
                kill_group(q)

    def _alive_or_none(self) -> tuple:
        try:
            return (self.alive_cpu_nodes(),)
        except Exception:  # the dashboard is busy or restarting
            return ()

    def _start(self, args: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        return subprocess.Popen(
            [
                str(BIN / "ray"),
                "start",
                "--block",
                "--node-ip-address=127.0.0.1",
                "--disable-usage-stats",
                "--dashboard-agent-listen-port=0",  # as RayHead does, for the same reason
                f"--temp-dir={self.temp_dir}",
                *args,
            ],
            env={**self.env, **(env or {})},
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def alive_cpu_nodes(self) -> list[str]:
        from orchestrator.backends.ray_jobs import RayJobsBackend

        return [
            n.node_id
            for n in RayJobsBackend(self.dashboard, timeout_s=10).cluster_view().nodes
            if n.cpu_total >= 1 and n.node_id != getattr(self, "head_id", None)
        ]

    def add_node(self, cpus: int = 1, gpus: int = 0, env: dict | None = None) -> subprocess.Popen:
        """Start one more worker node (`gpus`: logical GPUs Ray hands out, none behind them; `env`:
        variables of its own, e.g. a RAYFT_CACHE no other node shares, as on another machine) and
        wait until it is alive; records its Ray node id."""
        self._stop_dead_nodes()
        before = set(self.wait_nodes(len(self._live())))
        args = [f"--address={self.address}", f"--num-cpus={cpus}", f"--num-gpus={gpus}"]
        for _ in range(NODE_START_TRIES):
            name = f"node{len(self.nodes)}"
            p = self._start(args, name, env)
            self.nodes.append(p)
            new = self._joined(p, before)
            if new is not None:
                self.node_ids[p.pid] = new
                return p
            kill_group(p)  # its raylet may outlive it, and join later: gone, and marked dead, first
            self.wait_nodes(len(before))
        last = (self.tmp / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:]
        raise AssertionError(f"a worker node did not start in {NODE_START_TRIES} tries; the last said: {last}")

    def _joined(self, p: subprocess.Popen, before: set[str]) -> str | None:
        """The Ray node id of the node process `p` once it is alive beside `before`, or None when
        `p` exited first: `ray start` gives a raylet 30 s (fixed, ray/_private/node.py) to register
        with the GCS, which a machine loaded by the other tests can miss."""

        def joined() -> tuple:
            if p.poll() is not None:
                return (None,)
            try:
                alive = set(self.alive_cpu_nodes())
            except Exception:  # the dashboard is busy or restarting
                return ()
            return (next(iter(alive - before)),) if len(alive) == len(before) + 1 and before <= alive else ()

        return wait_until(joined, 120, "the new worker node is alive")[0]

    def _alive_actors(self) -> list[dict]:
        """The dashboard's state API view of the alive actors: node_id, class_name, pid, ..."""
        got = self._get("/api/v0/actors?limit=10000&detail=true")
        actors = ((got.get("data") or {}).get("result") or {}).get("result") or []
        return [a for a in actors if a.get("state") == "ALIVE"]

    def actors_by_node(self) -> dict[str, set[str]]:
        """{node id: class names of the alive actors on it}."""
        out: dict[str, set[str]] = {}
        for a in self._alive_actors():
            out.setdefault(a.get("node_id"), set()).add(a.get("class_name"))
        return out

    def wait_nodes(self, n: int, timeout_s: float = 120) -> list[str]:
        """The ids of the alive worker nodes, once there are exactly `n`."""
        seen: list[list[str]] = [[]]

        def exactly_n() -> tuple:
            try:
                seen[0] = self.alive_cpu_nodes()
            except Exception:  # the dashboard is busy or restarting
                return ()
            return (seen[0],) if len(seen[0]) == n else ()

        try:
            return wait_until(exactly_n, timeout_s, f"{n} worker nodes are alive")[0]
        except AssertionError:
            raise AssertionError(f"{len(seen[0])} worker nodes alive, expected {n}") from None

    def remove_worker_node(self, not_with: set[str]) -> str:
        """SIGKILL a live node that holds a Ray Train worker and none of the actors named in
        `not_with` (the test's premise: the driver side survives), wait until Ray has marked it
        dead; returns its Ray node id."""
        on: dict[str, set[str]] = {}

        def victims() -> list[subprocess.Popen]:
            on.clear()
            on.update(self.actors_by_node())
            return [
                p
                for p in self._live()
                if "RayTrainWorker" in on.get(self.node_ids[p.pid], set())
                and not not_with & on.get(self.node_ids[p.pid], set())
            ]

        try:  # the state API may answer before it lists every actor
            found = wait_until(victims, 30, "a node holds a training worker and no driver-side actor")
        except AssertionError:
            raise AssertionError(on) from None
        return self._remove(found[0])

    def remove_node_of_pid(self, pid: int) -> str:
        """SIGKILL the node whose actor runs in process `pid` (a training worker), wait until Ray has
        marked it dead; returns its Ray node id."""

        def node_of_pid() -> str | None:
            return next((a["node_id"] for a in self._alive_actors() if a.get("pid") == pid), None)

        node_id = wait_until(node_of_pid, 30, f"the state API lists the actor in process {pid}")
        (node,) = [q for q in self._live() if self.node_ids.get(q.pid) == node_id]
        return self._remove(node)

    def _remove(self, node: subprocess.Popen) -> str:
        alive = len(self.alive_cpu_nodes())
        kill_group(node)  # a whole node: its raylet and its workers
        self.wait_nodes(alive - 1)
        return self.node_ids[node.pid]

    def stop(self) -> None:
        for p in self.nodes + [self.head]:
            kill_group(p)
