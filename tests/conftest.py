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


@pytest.fixture(scope="session")
def ray_head():
    env = cluster_env()
    # `ray start` with token auth needs ~/.ray/auth_token; a fresh machine has none yet.
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    gcs, dash, client = free_port(), free_port(), free_port()
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           "--num-cpus=4", "--disable-usage-stats"]
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
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + timeout_s
    while True:
        if info.process.poll() is not None:
            raise RuntimeError(f"ray start exited with {info.process.returncode}")
        try:
            JobSubmissionClient(info.dashboard).list_jobs()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
