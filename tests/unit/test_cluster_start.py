"""How the test clusters (tests/helpers/clusters.py) start: a head that accepts no job is started
again from scratch, `CLUSTER_START_TRIES` times at most, every failed start stopped; and a start
that times out says what the head's job agent logged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import clusters
import pytest


class _Heads:
    """A cluster whose head is a plain process: `outcomes[i]` is the i-th start's command line."""

    def __init__(self, outcomes: list[list[str]], tmp: Path):
        self.outcomes, self.tmp = outcomes, tmp
        self.started: list[subprocess.Popen] = []
        self.stopped: list[subprocess.Popen] = []

    def _start_head(self) -> None:
        self.process = subprocess.Popen(self.outcomes[len(self.started)])
        self.started.append(self.process)
        self.dashboard, self.temp_dir = "http://127.0.0.1:9", str(self.tmp)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.stopped.append(self.process)


def test_a_head_that_exits_is_started_again_and_the_last_failure_is_raised(tmp_path):
    exits = [sys.executable, "-c", "raise SystemExit(3)"]
    heads = _Heads([exits] * clusters.CLUSTER_START_TRIES, tmp_path)
    with pytest.raises(RuntimeError, match="ray start exited with 3"):
        clusters.start_accepting_jobs(heads)
    assert len(heads.started) == clusters.CLUSTER_START_TRIES == 2
    assert heads.stopped == heads.started  # nothing of a failed start is left running


def test_a_second_start_that_accepts_jobs_is_kept(tmp_path, monkeypatch):
    real_wait = clusters.wait_for_jobs_api

    def accepts_while_alive(info):  # the real check for a head that exits; one alive after 2 s accepts jobs
        try:
            info.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return None
        return real_wait(info)

    monkeypatch.setattr(clusters, "wait_for_jobs_api", accepts_while_alive)
    lives = [sys.executable, "-c", "import time; time.sleep(60)"]
    heads = _Heads([[sys.executable, "-c", "raise SystemExit(3)"], lives], tmp_path)
    clusters.start_accepting_jobs(heads)
    assert len(heads.started) == 2 and heads.stopped == heads.started[:1]
    assert heads.process.poll() is None
    heads.stop()


def test_a_start_that_times_out_names_the_job_agents_errors(tmp_path):
    logs = tmp_path / "session_2026-12-07_15-00-00_000000_1" / "logs"
    logs.mkdir(parents=True)
    (logs / "dashboard_agent.log").write_text(
        "2026-12-07 15:00:01,000\tINFO agent.py:1 -- Loading modules\n"
        "2026-12-07 15:00:02,000\tERROR agent.py:233 -- Failed to start HTTP server with exception: "
        "[Errno 98] address already in use\n"
    )
    heads = _Heads([[sys.executable, "-c", "import time; time.sleep(60)"]], tmp_path)
    heads._start_head()
    try:
        with pytest.raises(TimeoutError) as got:
            clusters.wait_for_jobs_api(heads, timeout_s=1)
    finally:
        heads.stop()
    assert "Failed to start HTTP server" in str(got.value) and "Errno 98" in str(got.value)
    assert "Loading modules" not in str(got.value)
