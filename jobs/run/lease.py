"""The run lock on object storage: a lease object `<prefix>/.rayft-lease` with a stated expiry.

A run whose `run.output_dir` is an `s3://` / `gs://` URI writes into a local staging directory
(locked by `jobs.run.runlock`, which only this machine sees) and uploads it. Two machines running
the same URI would interleave their uploads, so the driver also holds this lease, taken where the
local lock is taken (`jobs.finetune.prepare`, `jobs.after.evaluate`'s write of eval.json) and
before anything else is written under the prefix (the run marker, a checkpoint).

Why a lease, not a conditional put: `pyarrow.fs` (rayft's one storage layer, Ray Train's) has no
conditional write (no `If-None-Match`, no GCS generation precondition), and a lock must be given
back when its holder dies however it dies: a lease does so by expiring.

Protocol (`take`):

* Read the lease. One that is live (its `expires` is in the future) and names another holder
  refuses the run in one line (UserError, exit 2) naming the holder and when the lease expires.
* Otherwise (none, expired, or this run's own) write ours, wait `SETTLE_S`, read it back: a
  second starter that read "free" at the same moment writes within that window (its read and its
  write are one request apart), the last writer wins, and the other is refused.
* The holder's thread rewrites the lease every `REFRESH_S` (expiry `TTL_S` ahead), after reading
  that it is still its own; `give_back` stops the thread and deletes the object if still ours.

Limits (why it is not a lock in the strict sense): expiry is judged on wall clocks, so hosts must
agree to within a few seconds (NTP does); a holder stalled longer than `TTL_S` (a suspended VM)
loses the lease and a new run may take the prefix over: the stalled holder finds it lost at its
next refresh (and logs it) or before its next upload (`check`, which `jobs.run.mirror` calls with
the run's token), and uploads nothing more. A holder killed outright keeps the prefix for at most
`TTL_S`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from jobs.errors import RunError, UserError
from jobs.run import runlock
from jobs.run.storage import Store, reported
from jobs.spec.yaml_file import one_line

log = logging.getLogger("rayft")

LEASE = ".rayft-lease"
TTL_S = 60.0  # a lease not refreshed for this long is free for another run to take
REFRESH_S = 20.0  # the holder rewrites it this often: two refreshes may fail before it expires
SETTLE_S = 1.0  # from our write to the read-back that tells whether a racing starter wrote after us


@dataclass
class _Holding:
    """This process's hold on one store's lease: the refresher thread and its stop signal."""

    store: Store
    token: str
    stop: threading.Event = field(default_factory=threading.Event)
    lost: str | None = None  # why the lease is no longer ours (set by the refresher)
    count: int = 1
    thread: threading.Thread | None = None


# store uri -> this process's hold on its lease.
_HELD: dict[str, _Holding] = {}


def record(token: str, now: float) -> dict:
    """The lease's content: who holds it (pid, host, token) and until when (epoch seconds)."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "token": token}
    return {"holder": holder, "taken": now, "expires": now + TTL_S, "ttl_s": TTL_S}


def read(store: Store) -> dict | None:
    """The lease under `store`'s prefix, or None when there is none (or it is not a lease rayft wrote)."""
    from pyarrow import fs

    key = store.key(LEASE)
    if store.fs.get_file_info(key).type != fs.FileType.File:
        return None
    with store.fs.open_input_stream(key) as f:
        text = f.read(1 << 16)
    try:
        rec = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("expires"), (int, float)) else None


def _write(store: Store, rec: dict) -> None:
    with store.fs.open_output_stream(store.key(LEASE)) as f:
        f.write((json.dumps(rec) + "\n").encode())


def is_live(rec: dict | None, now: float) -> bool:
    return rec is not None and rec["expires"] > now


def token_of(rec: dict | None) -> str | None:
    holder = (rec or {}).get("holder")
    return holder.get("token") if isinstance(holder, dict) else None


def describe(rec: dict, now: float) -> str:
    """`pid 12 on host h; its lease expires at 2026-12-05 19:40:12 UTC (in 42 s)`."""
    holder = rec.get("holder")
    holder = holder if isinstance(holder, dict) else {}
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rec["expires"]))
    who = f"pid {holder.get('pid', '?')} on host {one_line(str(holder.get('host', '?')))[:64]}"
    return f"{who}; its lease expires at {when} (in {max(0, round(rec['expires'] - now))} s)"


def _refused(store: Store, rec: dict) -> UserError:
    return UserError(
        f"run.output_dir={one_line(store.uri)}: another run is using it ({describe(rec, time.time())}); "
        f"wait for it to end (a run that died leaves it free once its lease expires) or name another run.output_dir"
    )


def take(store: Store, token: str) -> None:
    """Hold `store`'s lease for the run `token` names, refreshed by a thread until `give_back`.
    Raises UserError (one line, naming the holder) when another run holds it."""
    held = _HELD.get(store.uri)
    if held is not None:
        held.count += 1
        return
    with reported(store, "taking its lease", during_run=False):
        current = read(store)
        if current is not None and is_live(current, time.time()) and token_of(current) != token:
            raise _refused(store, current)
        _write(store, record(token, time.time()))
        time.sleep(SETTLE_S)
        current = read(store)
    if token_of(current) != token:  # a racing starter wrote after us: it holds the prefix
        raise _refused(store, current or {"expires": time.time() + TTL_S})
    held = _HELD[store.uri] = _Holding(store, token)
    held.thread = threading.Thread(target=_refresh, args=(held,), name="rayft-lease", daemon=True)
    held.thread.start()


def _refresh(held: _Holding) -> None:
    """The holder's thread: every REFRESH_S, rewrite the lease if it is still ours."""
    while not held.stop.wait(REFRESH_S):
        try:
            current = read(held.store)
            if token_of(current) != held.token:
                held.lost = f"taken over by {describe(current, time.time())}" if current else "deleted"
                log.error("run.output_dir=%s: this run's lease was %s", held.store.uri, held.lost)
                return
            _write(held.store, record(held.token, time.time()))
        except OSError as e:  # the store failing: the next refresh tries again before the lease expires
            log.warning("run.output_dir=%s: could not refresh the lease (%s)", held.store.uri, one_line(str(e))[:160])


def check(store: Store, token: str | None) -> None:
    """RunError when the run `token` names no longer holds `store`'s lease (before an upload): its
    refresher found it taken over, or the bucket's lease names another run. A run no driver took
    a lease for (no lease there) goes on. One read of the lease."""
    held = _HELD.get(store.uri)
    why = held.lost if held is not None else None
    if why is None and token is not None:
        current = read(store)
        if current is not None and token_of(current) != token:
            why = f"taken over by {describe(current, time.time())}"
    if why:
        raise RunError(
            f"run.output_dir={one_line(store.uri)}: this run's lease was {why}; stopped, nothing more uploaded"
        )


def check_staged(store: Store, staging: Path, token: str | None = None) -> None:
    """`check` for the run or search staged in `staging`: under `token` (the driver's, handed to
    rank 0 on Ray), else that of the driver that holds the staging directory's lock (it took the
    lease under the same token). A failed read of the lease is one line (`reported`)."""
    with reported(store, "reading its lease", during_run=True):
        check(store, token or runlock.holder_of(staging).get("token"))


def give_back(store: Store) -> None:
    """Undo one `take`: the last stops the refresher and deletes the lease if it is still ours."""
    held = _HELD.get(store.uri)
    if held is None:
        return
    held.count -= 1
    if held.count > 0:
        return
    del _HELD[store.uri]
    held.stop.set()
    if held.thread is not None:
        held.thread.join()
    try:
        if token_of(read(store)) == held.token:
            store.fs.delete_file(store.key(LEASE))
    except OSError as e:
        # It expires on its own within TTL_S, so nothing is lost; the store failing is what the
        # run's own verdict says (its error line, or the next upload's), not this.
        log.info("run.output_dir=%s: could not give the lease back (%s)", store.uri, one_line(str(e))[:160])
