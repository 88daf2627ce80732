"""Who owns a run's output directory, and the one order in which it is taken.

Invariant: a process writes into `run.output_dir` only after it was, in this order, *checked*
(rayft may write there: new, empty or rayft's own; `jobs.run.outputs.output_dir_problem`),
*locked* (one run per directory: `jobs.run.runlock`; for a run whose `run.output_dir` is an
object-store URI, also the bucket prefix's lease, `jobs.run.run_hold`), and *claimed* (`RUN_MARKER` written), all in
`hold_output_dir`. What must happen under the lock but before the claim (a resume's checks, --fresh
setting old checkpoints aside) is its `before_claim`.

Who calls it: the driver of a run it starts (`jobs.finetune.prepare`), once; rank 0 of that run
only verifies, by the run's token, that its driver holds the lock (`hold_on_rank0`). Rank 0 of a
run no driver of its own prepared (a Tune trial, a loop a script starts) holds it itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from jobs.run import run_hold, runlock
from jobs.run.outputs import check_output_dir, claim_output_dir


def hold_output_dir(
    path: Path,
    *,
    name: str,
    beside_others: bool = False,
    before_claim: Callable[[], None] | None = None,
    location: str | None = None,
) -> bool:
    """Check, lock, then claim `path` (see the module's invariant), running `before_claim` under
    the lock first. `location` is the run's `run.output_dir` where `path` stages an object-store
    URI: the lease on its prefix is taken right after the lock. Returns whether this call holds the
    lock (pair it with `run_hold.let_go_at(path, location)`); on any failure the lock (and lease)
    are given back and nothing is claimed."""
    check_output_dir(path, beside_others=beside_others)
    locked = run_hold.hold_at(path, location)
    try:
        if before_claim is not None:
            before_claim()
        claim_output_dir(path, beside_others=beside_others, name=name)
    except BaseException:
        if locked:
            run_hold.let_go_at(path, location)
        raise
    return locked


def hold_on_rank0(path: Path, *, name: str, run_token: str | None) -> bool:
    """Rank 0's part: nothing more than a check where the driver whose token is `run_token` holds
    the directory (it checked, locked and claimed it); else the whole `hold_output_dir` (beside a
    caller's own files: a Tune trial's directory holds Tune's). Returns whether it took the lock."""
    if run_token is not None and runlock.held_by(path, run_token):
        return False
    return hold_output_dir(path, name=name, beside_others=True)
