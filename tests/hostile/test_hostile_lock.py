"""One run per output directory (jobs.run.runlock), tried with real processes: a second run into a
directory another process is running in is refused in one line naming the holder's pid and
host, before anything is set aside or written; once the holder is killed, the next run takes the
stale lock over; rank 0 recognises its own driver's hold by the run's token."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inproc import rayft_in_process

from jobs.errors import UserError
from jobs.finetune import prepare
from jobs.run import runlock
from tests.hostile.test_hostile import DEMO, ROOT, SMALL, _assert_one_line, _cli

HOLD = (
    "import sys, time; from jobs.run import runlock; runlock.acquire(sys.argv[1], token=sys.argv[2]); "
    "print('held', flush=True); time.sleep(600)"
)


def _holder(out: Path, token: str = "other-run") -> subprocess.Popen:
    """Another process holding `out`'s lock (as a running `rayft run` does) until killed."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out), token], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)


def _tree(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in sorted(root.rglob("*"))}


@pytest.mark.slow
def test_a_second_run_is_refused_naming_the_holder_and_a_killed_runs_lock_is_taken_over(tmp_path, monkeypatch):
    """The holder is a real `python -m jobs.finetune --local` stalled mid-run (RAYFT_FAULT sleep)."""
    monkeypatch.chdir(ROOT)
    out, stalled = tmp_path / "run", tmp_path / "stalled"
    args = [DEMO, f"run.output_dir={out}", *SMALL, "run.max_steps=3", "run.checkpoint_every=1"]
    fault = f"sleep:step=1,seconds=600,once={stalled}"
    first = subprocess.Popen(
        [sys.executable, "-m", "jobs.finetune", *args, "--local"],
        cwd=ROOT,
        env={**os.environ, "RAYFT_FAULT": fault},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not stalled.exists():  # the first run has written step 1's checkpoint and sleeps
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.5)
        before = _tree(out)
        rc, err = _cli([*args, "--fresh"])  # --fresh would set the running run's checkpoints aside
        _assert_one_line(
            rc, err, "run.output_dir=", "another run is using it", f"pid {first.pid}", socket.gethostname()
        )
        assert _tree(out) == before  # nothing set aside, nothing written, events not interleaved
    finally:
        _kill(first)
    rc, err = _cli(args)  # the holder died: its lock went with it; this run resumes and finishes
    assert rc == 0, err
    events = [json.loads(line)["event"] for line in (out / "events.jsonl").read_text().splitlines()]
    assert events[0] == "start" and events[-1] == "end" and "resume" in events, events
    assert json.loads((out / runlock.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_locked_directory_refuses_prepare_and_the_loop(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        rc, err = _cli([DEMO, f"run.output_dir={out}", *SMALL, "--fresh"])
        _assert_one_line(rc, err, "another run is using it", f"pid {holder.pid} on host {socket.gethostname()}")
        assert sorted(p.name for p in out.iterdir()) == [runlock.LOCK_FILE]
        # rank 0 of a run whose driver is another run (another token) is refused too
        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            runlock.acquire(out, ours="this-run")
        # ... and goes on when the holder is its own driver (the token it was given)
        assert runlock.acquire(out, ours="other-run") is False
    finally:
        _kill(holder)
    spec = prepare(DEMO, [f"run.output_dir={out}", *SMALL], fresh=False, local=True)  # the stale lock
    try:
        assert runlock.held_token(out) is not None
        assert json.loads((out / runlock.LOCK_FILE).read_text())["pid"] == os.getpid()
        assert runlock.acquire(spec.output_path) is True  # counted within one process (--local: driver = rank 0)
        runlock.release(spec.output_path)
        assert runlock.held_token(out) is not None
    finally:
        runlock.release(spec.output_path)
    assert runlock.held_token(out) is None
    _kill(_holder(out))  # released: another process can take it now


def test_a_symlinked_lock_file_is_not_followed(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out, target = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    (out / ".rayft-run").write_text("{}\n")
    target.write_text("keep\n")
    (out / runlock.LOCK_FILE).symlink_to(target)
    rc, err = _cli([DEMO, f"run.output_dir={out}", *SMALL])
    _assert_one_line(rc, err, runlock.LOCK_FILE, "symbolic link")
    assert target.read_text() == "keep\n" and sorted(p.name for p in out.iterdir()) == sorted(
        [".rayft-run", runlock.LOCK_FILE]
    )


def test_eval_into_a_directory_a_run_holds_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    """`rayft eval` writes eval.json under the run's lock: while a run holds the directory, the
    write is refused in one line naming the holder, and the directory is as it was."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    holder = _holder(out)
    args = [DEMO, f"run.output_dir={out}", "data.eval_path=examples/data/tiny-eval.jsonl", "--max-new-tokens", "2"]
    try:
        before = _tree(out)
        r = rayft_in_process("eval", *args)
        _assert_one_line(r.returncode, r.stderr, "another run is using it", f"pid {holder.pid}")
        assert _tree(out) == before and not (out / "eval.json").exists()
    finally:
        _kill(holder)
    r = rayft_in_process("eval", *args)  # the holder gone: the same command writes it
    assert r.returncode == 0 and (out / "eval.json").exists(), r.stderr
    assert runlock.held_token(out) is None  # released on return
