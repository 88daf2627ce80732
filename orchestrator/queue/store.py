"""The queue's SQLite store: schema, transactions, rows and events. It validates no spec and
estimates nothing: `queue add` hands it a validated `NewJob` (orchestrator.queue.driver.enqueue).

State lives in SQLite (`--db`, default $RAYFT_QUEUE_DB or ~/.rayft/queue.db). Every state change
is one transaction, and every transition is conditional on the state it leaves, so a driver
killed at any moment (SIGKILL included) and restarted on the same file resumes exactly where the
file says it was:

    QUEUED --(admitted)--> SUBMITTING --(cluster accepted)--> RUNNING --> SUCCEEDED | FAILED | STOPPED
       ^                                                          |
       +------------- retry (backoff) / out-of-memory retry ------+          (CANCELED by hand)

* SUBMITTING is written, with the attempt's deterministic submission id, *before* the cluster is
  asked. A driver that died between "submitted" and "recorded" finds the row SUBMITTING on
  restart and asks the cluster for that id: there -> RUNNING (tracked, not resubmitted); not
  there -> back to QUEUED (the same id is used again, and the cluster refuses duplicates).
* RUNNING -> final is recorded once (`WHERE state='RUNNING' AND submission_id=?`), together with
  the `ended` event; a driver killed before recording it sees the same final status on restart.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jobs.errors import UserError

log = logging.getLogger("rayft")

ACTIVE = ("SUBMITTING", "RUNNING")
DONE = ("SUCCEEDED", "FAILED", "STOPPED", "CANCELED")
RETRYABLE = ("FAILED", "STOPPED", "CANCELED")


def default_db() -> Path:
    return Path(os.environ.get("RAYFT_QUEUE_DB") or Path.home() / ".rayft" / "queue.db")


@dataclass(frozen=True)
class NewJob:
    """One row to queue, everything already validated and estimated."""

    name: str
    working_dir: str
    spec_path: str  # relative to working_dir
    overrides: tuple[str, ...]  # as given to `queue add`
    spec_hash: str  # of spec file + overrides
    micro_batch_size: int
    grad_accum_steps: int
    demand_json: str  # admission.Demand.to_json()
    priority: int = 0
    max_retries: int = 2


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    working_dir TEXT NOT NULL,
    spec_path TEXT NOT NULL,              -- relative to working_dir
    overrides TEXT NOT NULL,              -- JSON list, as given to `queue add`
    spec_hash TEXT NOT NULL,              -- of spec file + overrides at `queue add`
    priority INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,   -- attempts submitted (the current one while active)
    submission_id TEXT,                   -- the current / last attempt's
    changes TEXT NOT NULL DEFAULT '[]',   -- JSON list of overrides the driver added (OOM retry)
    change_note TEXT NOT NULL DEFAULT '',
    micro_batch_size INTEGER NOT NULL,
    grad_accum_steps INTEGER NOT NULL,
    demand TEXT NOT NULL,                 -- JSON Demand
    max_retries INTEGER NOT NULL,
    retries INTEGER NOT NULL DEFAULT 0,
    oom_retried INTEGER NOT NULL DEFAULT 0,
    not_before REAL NOT NULL DEFAULT 0,
    status_detail TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    added_at REAL NOT NULL,
    ended_at REAL
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    submission_id TEXT NOT NULL,
    micro_batch_size INTEGER NOT NULL,
    grad_accum_steps INTEGER NOT NULL,
    submitted_at REAL,
    status TEXT NOT NULL DEFAULT 'SUBMITTING',
    message TEXT NOT NULL DEFAULT '',
    ended_at REAL,
    PRIMARY KEY (job_id, attempt)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
"""


OUR_TABLES = {"jobs", "attempts", "events"}


@functools.cache
def schema_columns() -> dict[str, frozenset[str]]:
    """{table: its columns} as SCHEMA creates them (what every reader may ask a row for)."""
    db = sqlite3.connect(":memory:")
    db.executescript(SCHEMA)
    cols = {t: frozenset(r[1] for r in db.execute(f"PRAGMA table_info({t})")) for t in OUR_TABLES}
    db.close()
    return cols


def _text(raw: bytes) -> str:
    """A TEXT value; bytes that are no UTF-8 (a damaged file) read as U+FFFD, never a crash."""
    return raw.decode("utf-8", "replace")


STATES = ("QUEUED", *ACTIVE, *DONE)
_INT_COLUMNS = ("id", "priority", "attempt", "micro_batch_size", "grad_accum_steps", "max_retries", "retries")
_JSON_LIST_COLUMNS = ("overrides", "changes")


def row_problem(row: sqlite3.Row) -> str | None:
    """What is wrong with a jobs row that rayft would never have written (a hand edit), or None."""
    for col in _INT_COLUMNS:
        v = row[col]
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{col} {str(v)[:40]!r} is not an integer"
    if row["state"] not in STATES:
        return f"state {str(row['state'])[:40]!r} is none of {', '.join(STATES)}"
    if not isinstance(row["not_before"], (int, float)):
        return f"not_before {str(row['not_before'])[:40]!r} is not a number"
    for col in _JSON_LIST_COLUMNS:
        try:
            v = json.loads(row[col])
        except (TypeError, ValueError):
            return f"{col} is not JSON"
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            return f"{col} is not a JSON list of strings"
    from .admission import Demand

    try:
        d = Demand.from_json(row["demand"])
        float(d.cpus), float(d.gpus), int(d.num_layers)  # what admission computes with
    except (TypeError, ValueError, AttributeError, KeyError):
        return "demand is not the JSON of an estimate"
    for col in ("name", "working_dir", "spec_path"):
        if not isinstance(row[col], str):
            return f"{col} is not text"
    return None


class Queue:
    """The SQLite file. Safe to use from several processes (`queue add` while a driver runs).

    Every change is one `txn` (BEGIN IMMEDIATE: writers take turns), and every transition names
    the state it leaves in its WHERE clause, so a change made by another process in between is
    never overwritten: the UPDATE matches nothing instead.

    Opening (on first use, so a command refused before it touches the queue creates nothing):
    a new file is created mode 0600 (it names specs, overrides and paths), in a directory rayft
    creates mode 0700; `readonly=True` (`rayft queue status`) opens it with SQLite's `mode=ro`
    and works on a file or directory the user cannot write. A file that is not a rayft queue --
    garbage, a corrupt database, another program's database -- is refused in one line saying
    how to recover, and is never written to: its schema is checked before rayft creates tables.
    """

    def __init__(self, path: os.PathLike | None = None, *, readonly: bool = False):
        self.path = Path(path) if path is not None else default_db()
        self.readonly = readonly
        self._db: sqlite3.Connection | None = None
        self._has_tables = False
        self._reported: set[tuple[Any, str]] = set()

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = self._open()
        return self._db

    @property
    def exists(self) -> bool:
        """The database file is there; a link to nothing (dangling, or a loop) is refused."""
        if self.path.is_symlink() and not self.path.exists():
            raise UserError(f"--db {self.path}: a symbolic link to nothing that can be opened")
        return self.path.is_file()

    def _refuse_unusable(self, why: str) -> UserError:
        return UserError(
            f"queue database {self.path}: {why}; rayft did not change it -- move it aside "
            f"(mv {self.path} {self.path}.bad) to start a new queue, or pass --db another file"
        )

    def _open(self) -> sqlite3.Connection:
        path = self.path
        if path.is_dir():
            raise UserError(f"--db {path}: is a directory; name the queue database file, e.g. {path / 'queue.db'}")
        if path.exists() and not path.is_file():
            raise UserError(f"--db {path}: not a regular file")
        self.exists  # noqa: B018 - refuses a link to nothing (SQLite cannot open it)
        if self.readonly:
            return self._check(self._connect_readonly())
        if not path.parent.is_dir():
            if path.parent.exists():
                raise UserError(f"--db {path}: {path.parent} is not a directory")
            missing = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
            for d in reversed(missing):  # each directory rayft creates: 0700
                d.mkdir(mode=0o700, exist_ok=True)
                d.chmod(0o700)  # mkdir's mode is masked by the umask
        for p in ([path] if path.exists() else []) + [path.parent]:  # WAL writes files beside it
            if not os.access(p, os.W_OK):
                raise UserError(
                    f"queue database {path}: {p} is read-only for this user; `rayft queue status` "
                    "can read it, changing the queue needs write access to the file and its directory"
                )
        if not path.exists():
            try:  # created 0600 before SQLite writes a byte into it
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:  # another `queue add` created it just now
                pass
        db = self._check(sqlite3.connect(str(path), timeout=30, isolation_level=None))
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            db.close()
            raise self._refuse_unusable(f"cannot be written ({e})") from None
        return db

    def _connect_readonly(self) -> sqlite3.Connection:
        if not self.path.is_file():
            raise UserError(f"no queue database at {self.path} (`rayft queue add` creates it)")
        if not os.access(self.path, os.R_OK):
            raise UserError(f"queue database {self.path}: not readable by this user")
        uri = f"file:{quote(str(self.path.resolve()))}?mode=ro"
        db = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.DatabaseError as e:
            db.close()
            if not isinstance(e, sqlite3.OperationalError) or os.access(self.path.parent, os.W_OK):
                raise self._refuse_unusable(f"corrupt, or not a SQLite database ({e})") from None
        # WAL mode needs a -shm file beside the database; in a directory this user cannot write
        # (and with no driver running, which leaves none behind) SQLite can only read the file as
        # immutable: a snapshot without what a writer still holds in its WAL.
        return sqlite3.connect(uri + "&immutable=1", uri=True, timeout=30, isolation_level=None)

    def _check(self, db: sqlite3.Connection) -> sqlite3.Connection:
        """The file is a readable SQLite database, intact, and rayft's queue (or empty)."""
        db.row_factory = sqlite3.Row
        db.text_factory = _text
        try:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            problems = [r[0] for r in db.execute("PRAGMA quick_check")]
            columns = {t: {r[1] for r in db.execute(f"PRAGMA table_info({t})")} for t in OUR_TABLES & tables}
        except sqlite3.DatabaseError as e:
            db.close()
            raise self._refuse_unusable(f"corrupt, or not a SQLite database ({e})") from None
        if problems != ["ok"]:
            db.close()
            raise self._refuse_unusable(f"the database is corrupt (SQLite quick_check: {problems[0][:120]})")
        tables.discard("sqlite_sequence")
        self._has_tables = bool(tables)
        if tables and not OUR_TABLES <= tables:
            db.close()
            shown = ", ".join(sorted(tables)[:5])
            raise self._refuse_unusable(f"a SQLite database of something else (tables: {shown}), not a rayft queue")
        lacking = sorted(f"{t}.{c}" for t, have in columns.items() for c in schema_columns()[t] - have)
        if lacking:
            db.close()
            raise self._refuse_unusable(f"its tables lack columns rayft reads ({', '.join(lacking[:5])})")
        return db

    @contextlib.contextmanager
    def txn(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def event(self, c: sqlite3.Connection, job_id: int, kind: str, detail: str = "") -> None:
        c.execute(
            "INSERT INTO events (job_id, at, kind, detail) VALUES (?, ?, ?, ?)", (job_id, time.time(), kind, detail)
        )

    # -- reading --
    def jobs(self, states: tuple[str, ...] | None = None) -> list[sqlite3.Row]:
        """The sound rows (in `states`), by id. A row edited by hand into something rayft never
        writes (`row_problem`) is reported once, by job id, and skipped: it never crashes a reader."""
        if self.readonly and (not self.exists or (self.db is not None and not self._has_tables)):
            return []  # no file, or an empty one: an empty queue (nothing created)
        if states:
            q = f"SELECT * FROM jobs WHERE state IN ({','.join('?' * len(states))}) ORDER BY id"
            rows = list(self.db.execute(q, states))
        else:
            rows = list(self.db.execute("SELECT * FROM jobs ORDER BY id"))
        return [r for r in rows if self._sound(r)]

    def job(self, job_id: int) -> sqlite3.Row:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise UserError(f"no job #{job_id} in the queue {self.path}")
        problem = row_problem(row)
        if problem:
            raise UserError(f"job #{job_id} in the queue {self.path} is damaged ({problem}); fix or delete its row")
        return row

    def _sound(self, row: sqlite3.Row) -> bool:
        problem = row_problem(row)
        if problem is None:
            return True
        key = (row["id"], problem)
        if key not in self._reported:
            self._reported.add(key)
            log.warning(
                "queue %s: job #%s skipped: its row is damaged (%s); fix or delete it", self.path, row["id"], problem
            )
        return False

    def attempts(self, job_id: int) -> list[sqlite3.Row]:
        return list(self.db.execute("SELECT * FROM attempts WHERE job_id = ? ORDER BY attempt", (job_id,)))

    def events(self, job_id: int | None = None) -> list[sqlite3.Row]:
        if job_id is None:
            return list(self.db.execute("SELECT * FROM events ORDER BY id"))
        return list(self.db.execute("SELECT * FROM events WHERE job_id = ? ORDER BY id", (job_id,)))

    # -- adding --
    def add(self, job: NewJob) -> tuple[int, bool]:
        """Queue one validated job. The same spec (name + hash + working dir) is one job: adding it
        again returns the existing entry. Returns (id, created)."""
        with self.txn() as c:
            row = c.execute(
                "SELECT id FROM jobs WHERE name = ? AND spec_hash = ? AND working_dir = ?",
                (job.name, job.spec_hash, job.working_dir),
            ).fetchone()
            if row is not None:
                return int(row["id"]), False
            cur = c.execute(
                "INSERT INTO jobs (name, working_dir, spec_path, overrides, spec_hash, priority, state, "
                "micro_batch_size, grad_accum_steps, demand, max_retries, added_at) "
                "VALUES (?, ?, ?, ?, ?, ?, 'QUEUED', ?, ?, ?, ?, ?)",
                (
                    job.name,
                    job.working_dir,
                    job.spec_path,
                    json.dumps(list(job.overrides)),
                    job.spec_hash,
                    job.priority,
                    job.micro_batch_size,
                    job.grad_accum_steps,
                    job.demand_json,
                    job.max_retries,
                    time.time(),
                ),
            )
            job_id = cur.lastrowid
            assert job_id is not None  # set by the INSERT above
            self.event(c, job_id, "queued", f"priority {job.priority}, spec {job.spec_path}, hash {job.spec_hash}")
            return job_id, True

    def retry(self, job_id: int) -> str:
        """Queue a job that ended without success again; its next attempt gets the next id."""
        row = self.job(job_id)
        if row["state"] not in RETRYABLE:
            raise UserError(f"job #{job_id} is {row['state']}: only a FAILED, STOPPED or CANCELED job can be retried")
        with self.txn() as c:
            n = c.execute(
                "UPDATE jobs SET state='QUEUED', retries=0, not_before=0, status_detail='', message='', "
                "ended_at=NULL WHERE id=? AND state=?",
                (job_id, row["state"]),
            ).rowcount
            if n:
                self.event(c, job_id, "requeued", f"by hand after {row['state']}")
        return self.job(job_id)["state"]

    def cancel(self, job_id: int, stop: Callable[[str], Any] | None = None) -> str:
        """QUEUED -> CANCELED; an active job is stopped on the cluster first (`stop(submission_id)`)."""
        row = self.job(job_id)
        if row["state"] in DONE:
            return row["state"]
        if row["state"] in ACTIVE:
            if stop is None:
                raise UserError(f"job #{job_id} is {row['state']} on the cluster: pass --address to stop it")
            stop(row["submission_id"])
        with self.txn() as c:
            n = c.execute(
                "UPDATE jobs SET state='CANCELED', ended_at=?, message='canceled by hand' WHERE id=? AND state=?",
                (time.time(), job_id, row["state"]),
            ).rowcount
            if n:
                if row["state"] in ACTIVE:
                    c.execute(
                        "UPDATE attempts SET status='STOPPED', ended_at=? WHERE job_id=? AND attempt=?",
                        (time.time(), job_id, row["attempt"]),
                    )
                self.event(c, job_id, "ended", "CANCELED")
        return "CANCELED" if n else self.job(job_id)["state"]
