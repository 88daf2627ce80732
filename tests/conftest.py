"""Shared fixtures. `ray_head` starts a real Ray cluster on 127.0.0.1 (token auth, as Ray 2.60
does by default) once per test session and stops it at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

BIN = Path(sys.executable).parent
# `import ray` reads RAY_AUTH_MODE once per process: set it before any test imports ray, so this
# process is a token-auth client of the clusters the tests start (Ray 2.60's default mode).
os.environ.setdefault("RAY_AUTH_MODE", "token")


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


def ensure_auth_token() -> None:
    """~/.ray/auth_token, created when missing (kept when present): `ray start` with token auth and
    every token-auth client of this process need it, and a fresh machine (CI's empty HOME) has none.
    Ray caches the token a process first loads, so tests never swap in another one."""
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=cluster_env(), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)


@pytest.fixture(scope="session")
def ray_head():
    env = cluster_env()
    ensure_auth_token()
    gcs, dash, client = free_port(), free_port(), free_port()
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           "--num-cpus=4", "--disable-usage-stats",
           # Its own job-agent port: Ray's default (52365) is taken by any other cluster on this
           # machine, and a head without its agent accepts no job ("No available agent").
           f"--dashboard-agent-listen-port={free_port()}"]
    # --block in its own process group: stopping it stops exactly this cluster (`ray stop`
    # would kill every Ray process of the user, including unrelated local clusters).
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = SimpleNamespace(address=f"127.0.0.1:{gcs}", dashboard=f"http://127.0.0.1:{dash}", env=env,
                           token_path=Path.home() / ".ray" / "auth_token", process=proc)
    try:
        _wait_for_jobs_api(info)
        yield info
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_for_jobs_api(info, timeout_s: float = 120.0) -> None:
    """Return once the cluster accepts jobs. The Jobs API answers `list_jobs` before the head's
    job agent has registered, and a submission then fails with "No available agent to submit
    job": so a no-op probe job is submitted (retried until accepted) and waited for."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    deadline = time.monotonic() + timeout_s
    probe = f"cluster-ready-probe-{info.dashboard.rsplit(':', 1)[1]}"
    submitted = False
    while True:
        if info.process.poll() is not None:
            raise RuntimeError(f"ray start exited with {info.process.returncode}")
        try:
            client = JobSubmissionClient(info.dashboard)
            if not submitted:
                client.submit_job(entrypoint="true", submission_id=probe)
                submitted = True
            if client.get_job_status(probe) in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster at {info.dashboard} did not run a no-op job within {timeout_s:g} s")
        time.sleep(0.5)  # polling the conditions above
