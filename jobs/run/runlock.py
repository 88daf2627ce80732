"""One run per output directory: an advisory lock on `<run.output_dir>/.rayft-lock`, held for the run's life.

Two runs writing into one directory interleave `events.jsonl` and race on checkpoints, so the
process that owns a run holds `fcntl.flock(LOCK_EX)` on `LOCK_FILE` from before anything is set
aside (`--fresh`) or claimed until the run ends; a second run is refused in one line naming the
holder (its pid and host, which the holder writes into the lock file).

Who holds it:

* `rayft run` and `python -m jobs.finetune` (also the entrypoint of `ray job submit`, which runs
  it on the head node) take it in `jobs.finetune.prepare`: the driver of a run lives as long as
  the run.
* Rank 0 takes it in the training loop when nothing of its own run holds it (a Tune trial, a
  loop started by a test or a script). When its driver holds it, rank 0 recognises the holder by
  the run's token, which the driver passes to the workers (`jobs.launch.on_ray.make_trainer`), and
  goes on without a second lock; another token is another run and is refused.
* `rayft eval` takes it only to write `eval.json` (the evaluation itself reads): while a run
  holds the directory, that write is refused in one line.
* Within one process the lock is counted, not taken twice (`rayft run --local`: the driver and
  rank 0 are one process; `flock` would refuse a second open file of the same process).

Invariants: a lock never outlives its holder: the kernel drops a `flock` when the process that
holds it dies, however it dies, so a stale lock file from a killed run is taken over by the next
run without any clean-up (its holder line is simply rewritten). The lock file is never followed
through a symbolic link (`O_NOFOLLOW`) and never deleted (deleting it would let a third run lock
a new file while the second holds the old one). On shared storage the lock is as good as the
file system's locks: NFSv4 (and NFSv3 with lockd) carry `flock` to the server (Linux emulates it
as a whole-file POSIX lock), so runs on two hosts exclude each other; a host that dies holding
the lock keeps it until the server's lease expires (NFSv4: 90 s by default). On a mount with
`nolock`, or storage without locks, each host sees only its own locks.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from jobs.errors import RunError, UserError

LOCK_FILE = ".rayft-lock"


@dataclass
class _Held:
    fd: int
    token: str
    count: int = field(default=1)


# realpath of the output dir -> this process's hold on its lock.
_HELD: dict[str, _Held] = {}


def _key(output_dir: str | Path) -> str:
    return os.path.realpath(output_dir)


def held_token(output_dir: str | Path) -> str | None:
    """The token of the run this process holds `output_dir`'s lock for, or None."""
    held = _HELD.get(_key(output_dir))
    return held.token if held else None


def held_by(output_dir: str | Path, token: str) -> bool:
    """Whether the run named `token` holds `output_dir`'s lock now: this process (its driver and
    rank 0 are one process), or another whose flock is held and whose line names `token`."""
    held = _HELD.get(_key(output_dir))
    if held is not None:
        return held.token == token
    return holder_of(output_dir).get("token") == token and _is_locked(Path(output_dir) / LOCK_FILE)


def _is_locked(lock_file: Path) -> bool:
    """Some process holds `lock_file`'s flock (a shared lock cannot be had without blocking)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock, where it was had
    return False


def holder_of(output_dir: str | Path) -> dict:
    """What the lock file says about its holder (pid, host, token, since); {} when unreadable.
    Only meaningful while the lock is held: a free lock's file names its last holder."""
    try:
        fd = os.open(Path(output_dir) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        text = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    try:
        rec = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return rec if isinstance(rec, dict) else {}


def describe_holder(rec: dict) -> str:
    since = rec.get("since")
    when = time.strftime(", since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"pid {rec.get('pid', '?')} on host {str(rec.get('host', '?'))[:64]}{when}"


def acquire(output_dir: str | Path, *, token: str | None = None, ours: str | None = None) -> bool:
    """Hold `output_dir`'s lock for this process (creating the directory when it is not there).

    `token` names the run (a new one is made when None). `ours`: the token of this run's driver;
    when the lock is held by a holder with that token, rank 0 goes on without it (returns False).
    Returns True when this call holds (or counted) the lock; pair it with `release`.
    Raises UserError (one line, naming the holder) when another run holds it."""
    key = _key(output_dir)
    held = _HELD.get(key)
    if held is not None:
        held.count += 1
        return True
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = "is a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise UserError(f"run.output_dir={out}: its lock file {LOCK_FILE} cannot be opened ({why})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        rec = holder_of(out)
        if ours is not None and rec.get("token") == ours:
            return False  # this run's driver holds it
        raise UserError(
            f"run.output_dir={out}: another run is using it ({describe_holder(rec)}); wait for it to end or "
            "stop it, or name another run.output_dir"
        ) from None
    except OSError as e:
        os.close(fd)
        raise RunError(f"run.output_dir={out}: cannot lock {LOCK_FILE} ({e.strerror or e})") from None
    token = token or uuid.uuid4().hex
    rec = {"pid": os.getpid(), "host": socket.gethostname(), "token": token, "since": time.time()}
    line = (json.dumps(rec) + "\n").encode()
    os.pwrite(fd, line, 0)  # then cut: a reader never sees an empty file between two holders
    os.ftruncate(fd, len(line))
    _HELD[key] = _Held(fd, token)
    return True


def release(output_dir: str | Path) -> None:
    """Undo one `acquire` that returned True; the last one drops the lock (the file stays)."""
    key = _key(output_dir)
    held = _HELD.get(key)
    if held is None:
        return
    held.count -= 1
    if held.count <= 0:
        del _HELD[key]
        os.close(held.fd)  # closing the only descriptor drops the flock
