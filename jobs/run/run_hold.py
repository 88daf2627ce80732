"""A driver's hold on its run's output directory: the local lock (`jobs.run.runlock`) on the
directory it writes into and, when `run.output_dir` is an object-store URI, the lease on the
bucket's prefix (`jobs.run.lease`) under the same token.

Invariants: `hold` takes the local lock first (two runs on one machine never race for the lease),
then the lease, before anything is written under the prefix; `let_go` undoes both, the lease
first. A refused lease leaves the local lock as it was before `hold`."""

from __future__ import annotations

from pathlib import Path

from jobs.run import lease, runlock
from jobs.run.storage import is_uri, open_store
from jobs.spec import JobSpec


def hold(spec: JobSpec) -> None:
    """Lock `spec.output_path` for this process, and take the bucket's lease for a URI run."""
    hold_at(spec.output_path, spec.output_location)


def let_go(spec: JobSpec) -> None:
    """Undo one `hold`."""
    let_go_at(spec.output_path, spec.output_location)


def hold_at(path: Path, location: str | None) -> bool:
    """Lock `path` for this process and, when `location` (the run's `run.output_dir`, which `path`
    stages) is an object-store URI, take its prefix's lease under the lock's token. Returns
    `runlock.acquire`'s answer."""
    locked = runlock.acquire(path)
    if location is None or not is_uri(location):
        return locked
    try:
        token = runlock.held_token(path)
        assert token is not None
        lease.take(open_store(location), token)
    except BaseException:
        runlock.release(path)
        raise
    return locked


def let_go_at(path: Path, location: str | None) -> None:
    """Undo one `hold_at`: the lease first, then the lock."""
    try:
        if location is not None and is_uri(location):
            lease.give_back(open_store(location))
    finally:
        runlock.release(path)
