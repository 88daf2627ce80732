"""The output directory is checked, locked and claimed in one place, in that order
(`jobs.run.ownership.hold_output_dir`); rank 0 of a run its driver holds only verifies the
driver's lock by the run's token (`hold_on_rank0`, `runlock.held_by`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.errors import SpecError, UserError
from jobs.run import runlock
from jobs.run.outputs import RUN_MARKER
from jobs.run.ownership import hold_on_rank0, hold_output_dir

ROOT = Path(__file__).resolve().parents[3]
HOLD = """
import sys, time
from jobs.run import runlock
runlock.acquire(sys.argv[1], token=sys.argv[2])
print("held", flush=True)
time.sleep(60)
"""


def test_check_lock_then_claim_and_a_failure_under_the_lock_claims_nothing(tmp_path):
    out = tmp_path / "run"
    seen = []

    def before_claim():
        seen.append((runlock.held_token(out) is not None, (out / RUN_MARKER).exists()))
        raise SpecError("refused under the lock")

    with pytest.raises(SpecError):
        hold_output_dir(out, name="r", before_claim=before_claim)
    assert seen == [(True, False)]  # locked, not yet claimed
    assert runlock.held_token(out) is None and not (out / RUN_MARKER).exists()
    assert hold_output_dir(out, name="r") is True
    assert (out / RUN_MARKER).exists()
    runlock.release(out)


def test_a_directory_rayft_may_not_write_is_refused_before_it_is_locked(tmp_path):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("someone's")
    with pytest.raises(SpecError, match="run.output_dir="):
        hold_output_dir(out, name="r")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # no lock file, no marker


def test_rank0_verifies_its_drivers_lock_by_the_runs_token_in_another_process(tmp_path):
    out = tmp_path / "run"
    assert hold_output_dir(out, name="r")  # claimed, as a driver would
    runlock.release(out)
    env = {"PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen([sys.executable, "-c", HOLD, str(out), "tok-1"], stdout=subprocess.PIPE, env=env)
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == b"held"
        assert runlock.held_by(out, "tok-1") and not runlock.held_by(out, "tok-2")
        assert hold_on_rank0(out, name="r", run_token="tok-1") is False  # verified; no second lock
        with pytest.raises(UserError, match="another run is using it"):
            hold_on_rank0(out, name="r", run_token="tok-2")  # another run's token: refused
    finally:
        driver.kill()
        driver.wait()
    time.sleep(0.1)
    assert not runlock.held_by(out, "tok-1")  # the holder is gone: its line no longer counts


def test_rank0_in_the_drivers_own_process_goes_on_without_counting_the_lock(tmp_path):
    out = tmp_path / "run"
    assert hold_output_dir(out, name="r")
    token = runlock.held_token(out)
    assert token is not None and hold_on_rank0(out, name="r", run_token=token) is False
    runlock.release(out)
    assert runlock.held_token(out) is None  # one release: the lock was never counted twice
