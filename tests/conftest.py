"""Shared fixtures. `ray_head` starts a real Ray cluster on 127.0.0.1 (token auth, as Ray 2.60
does by default) once per test session and stops it at the end."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

BIN = Path(sys.executable).parent


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
    gcs, dash, client = free_port(), free_port(), free_port()
    cmd = [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           "--num-cpus=4", "--disable-usage-stats"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=180)
    info = SimpleNamespace(address=f"127.0.0.1:{gcs}", dashboard=f"http://127.0.0.1:{dash}", env=env,
                           token_path=Path.home() / ".ray" / "auth_token")
    _wait_for_jobs_api(info)
    try:
        yield info
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def _wait_for_jobs_api(info, timeout_s: float = 60.0) -> None:
    os.environ["RAY_AUTH_MODE"] = "token"  # this process is a client too
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            JobSubmissionClient(info.dashboard).list_jobs()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
