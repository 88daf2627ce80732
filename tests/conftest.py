"""Shared fixtures and settings.

Each costly thing is made once per test session, by the first test that needs it:
- `ray_head`: a real single-node Ray cluster on 127.0.0.1 (token auth, as Ray 2.60 does by default);
- `cluster`: the multi-node `LocalCluster` of the node-loss tests (tests/helpers/clusters.py);
- `ray_reference`: the uninterrupted 2-worker run that resumed Ray runs must end with;
- `built`: `kubectl kustomize` of every kustomization under k8s/ (the k8s test modules);
- the gloo ranks of the distributed oracles (tests/helpers/gloo_pool.py, through `gradtools.spawn`);
- `s3_server`: a real S3 server (SeaweedFS's `weed`, tests/helpers/s3_server.py) on 127.0.0.1.
The two clusters stop right after the last test that uses them (an idle Ray cluster still
takes CPU from the tests after it), the rest when the session ends. Under `make test`'s two
processes, every test of the clusters runs in one of them (the groups below).

Layout: unit/ (no Ray; by the jobs/ subpackage it tests, plus tune/), integration/ (real Ray
clusters, node loss, the queue, submit, tune, Kubernetes manifests, the benchmark scripts),
hostile/ (hostile and careless input, fuzzers), gpu/ (needs CUDA), helpers/ (shared code).

Hypothesis runs the "ci" profile unless RAYFT_HYPOTHESIS_PROFILE names another: 150 examples per
fuzz test, derandomized (the same cases every run). `make test-all` picks "long"."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The tests live in folders by role (unit/, integration/, hostile/, gpu/) and share tests/helpers/:
# the helpers import by their own names (`from gradtools import ...`) and one test module another by
# its package path (`from tests.integration.test_submit import ...`), from anywhere pytest starts.
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_TESTS / "helpers"), str(_TESTS.parent)) if p not in sys.path]

# `import ray` reads RAY_AUTH_MODE once per process: set it before any test imports ray, so this
# process is a token-auth client of the clusters the tests start (Ray 2.60's default mode).
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Ray settings for a 2-core test machine, inherited by every cluster and `rayft` process the tests
# start (documented Ray knobs; nothing rayft decides depends on them):
# - Ray Train's controller polls its workers every 2 s by default, and a run waits for a poll at
#   each state change (workers started, run finished, worker failed): ~5-10 s of idle wall time
#   per run. A 0.25 s poll ends each wait sooner. It changes which failure of a lost node is
#   often seen first (a surviving rank's, before the lost worker's health check): the node-loss
#   tests run with it too, and rayft names the lost node either way (`jobs.launch.on_ray.node_lost`).
# - Ray's and Ray Train's metrics export and the Train state reconciliation feed dashboards no
#   test reads; prestarted idle workers (one per CPU when the first driver connects) are CPU the
#   tests need for the workers they do start.
# - Ray Train's PreemptionWatcher (an actor per run that polls for nodes a cloud is draining; no
#   test drains a node) costs a worker process per run: 2-3 core-seconds of a ~55 (cgroup cpuacct,
#   2 pairs of runs of the command below: 57.3 / 57.2 with it, 55.5 / 54.6 without). The one test
#   that runs as a user does (`test_train.py`, whose first screen must not show the watcher's
#   noise line) turns it back on.
# Measured on `rayft run examples/tiny-lora.yaml run.max_steps=8` (2 workers, embedded Ray):
# 33-38 s wall and 44-49 busy core-seconds before, 26-28 s and 38-41 after.
for _name, _value in {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}.items():
    os.environ.setdefault(_name, _value)

from clusters import BIN, LocalCluster, RayHead, cluster_env, ensure_auth_token, free_port  # noqa: E402,F401

_FUZZ_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=_FUZZ_HEALTH
)
# Long fuzzing (`make test-all`): new random cases every run, 20x CI's count.
settings.register_profile(
    "long", max_examples=3000, derandomize=False, database=None, deadline=None, suppress_health_check=_FUZZ_HEALTH
)
settings.load_profile(os.environ.get("RAYFT_HYPOTHESIS_PROFILE", "ci"))

# `make test` runs the suite in two processes (pytest-xdist, `--dist loadgroup`). Each test is put
# in one group, and a group runs in one process, in collection order:
# - the tests that use a session-wide cluster or the reference the node-loss and resume tests end
#   with are one group: each is made once, and the two clusters never run at the same time (the
#   node-loss tests time health checks; two clusters on 2 cores would slow each other);
# - any other test goes with its module, so a module-scoped fixture is set up once.
# The groups with the most `ray` and `slow` tests come first: the long ones start at once and the
# many short ones fill the gaps at the end. The same order holds without xdist.

# The two session-wide clusters, each stopped right after the last test that uses it.
_STOPPED_AFTER = ("ray_head", "cluster")
_SHARED = (*_STOPPED_AFTER, "ray_reference")


def xdist_group_of(item) -> str:
    """The xdist group of `item`: "clusters" if it uses one of `_SHARED`, else its module's file name."""
    names = getattr(item, "fixturenames", ())
    return "clusters" if any(f in names for f in _SHARED) else item.path.name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Mark each test with its `xdist_group` (before xdist reads the marks) and put the heavy groups first."""
    groups: dict[str, list] = {}
    for item in items:
        group = xdist_group_of(item)
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)

    def heavy(group: str) -> int:
        return sum(1 for it in groups[group] if it.get_closest_marker("ray") or it.get_closest_marker("slow"))

    # In the "clusters" group the node-loss cluster's tests come first (a stable sort: each keeps its
    # place otherwise), so that cluster is stopped before the first test that starts the Ray head;
    # collected in file order, the head stood idle beside it for ~10 minutes of CI (test_fsdp first).
    groups.get("clusters", []).sort(key=lambda it: "cluster" not in getattr(it, "fixturenames", ()))
    items[:] = [it for group in sorted(groups, key=heavy, reverse=True) for it in groups[group]]


def pytest_configure(config):
    """In each of `make test`'s processes, torch's intra-op pool gets that process's share of the
    cores: two processes of 2 threads each on 2 cores only contend (the gloo ranks already run one)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# Session-wide clusters, stopped early: fixture name -> id of the last selected test that uses it.
_last_user: dict[str, str] = {}
_running: dict[str, object] = {}


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """After selection (-m, -k), the reordering above and xdist's renaming by group: which test
    is the last to use each cluster (in a process that runs them: a group runs in one)."""
    _last_user.clear()
    for item in session.items:
        for name in _STOPPED_AFTER:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid and name in _running:
            _running.pop(name).stop()


def pytest_sessionfinish(session, exitstatus):
    from gloo_pool import shutdown

    shutdown()


def _shared(name: str, start):
    """Start a cluster, note it for the early stop, stop it at the end of the session at the latest."""
    c = start()
    _running[name] = c
    try:
        yield c
    finally:
        if _running.pop(name, None) is not None:
            c.stop()


@pytest.fixture(scope="session")
def ray_head():
    """A 4-CPU single-node cluster: .address, .dashboard, .env, .token_path, .process."""
    yield from _shared("ray_head", RayHead)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The node-loss cluster: a head without CPUs, worker nodes of one CPU each (ensure_nodes)."""
    yield from _shared("cluster", lambda: LocalCluster(tmp_path_factory.mktemp("cluster")))


@pytest.fixture(scope="session")
def ray_reference(tmp_path_factory):
    """The LoRA weights of an uninterrupted 2-worker run of the demo split with RAY_STEPS (gloo, one
    process per rank, no Ray): what a Ray run that lost a worker, a node or its driver ends with."""
    from gradtools import DEMO, RAY_STEPS, ROOT, final_adapter, reference_run, spawn

    out = tmp_path_factory.mktemp("ref") / "out"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        spawn(reference_run, 2, out.parent / "spawn", DEMO, RAY_STEPS, str(out))
    finally:
        os.chdir(cwd)
    return final_adapter(out)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One S3 server for the session (its own temporary directory, stopped at the end): .endpoint,
    .env(), .filesystem(), .make_bucket(name), .objects(prefix), .start_s."""
    from s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _kustomize_builds() -> dict[str, list[dict]]:
    from tests.integration.test_k8s import K8S, KUBECTL, build, kustomizations

    if KUBECTL is None:
        pytest.skip("kubectl not on PATH: kustomize builds not checked")
    return {d: build(K8S / d) for d in kustomizations()}


@pytest.fixture(scope="module")
def built(_kustomize_builds) -> dict[str, list[dict]]:
    """{kustomization dir under k8s/: the objects `kubectl kustomize` builds from it}: built once,
    each module gets its own copy (as when each built them)."""
    import copy

    return copy.deepcopy(_kustomize_builds)
