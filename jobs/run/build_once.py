"""Caches that several processes may build at the same time (two Ray workers on one machine
loading the same GGUF, say): one builder at a time, everyone else uses its result.

`build_once(final_dir, build, what)` keeps these invariants:

- **One builder.** An exclusive `fcntl.flock` on `<final_dir>.lock` (a sibling file) is held
  while building. A process that finds the lock taken waits for it, and says so once (logger
  "rayft", WARNING, naming the builder's pid, which the builder writes into the lock file).
  After acquiring the lock the process looks again: if the cache was published meanwhile it
  uses it and builds nothing.
- **Atomic publication.** `build` writes into a fresh temporary sibling directory
  (`<final_dir name>.tmp*`, same filesystem), which is then `os.rename`d to `final_dir`. A
  reader sees no cache or a complete one, never a half-written one, so "`final_dir` exists"
  means "complete".
- **Losers use the winner's copy.** If the rename finds `final_dir` already there (a builder
  that does not take the lock, e.g. a filesystem where flock is not shared between machines),
  that is success: the temporary copy is dropped and the existing one is returned.
- **No temporary directories left.** The temporary directory is removed in `finally`, also
  when `build` raises; temporary siblings of a builder that was killed (no `finally` ran) are
  removed by the next builder, which holds the lock, so they cannot belong to a live build.
  Only the lock file stays (removing it would let two processes lock two different files).

`set_aside(final_dir, seen, suffix)` takes a published cache out of the way (a reader found it
damaged) under the same lock, and only if `final_dir` is still the one that reader judged (same
device and inode, by `lstat`: a link is renamed, never followed): a slower reader of the old copy
never sets aside the copy another process has just rebuilt. Nothing is deleted.

The lock is advisory and local: processes on one machine (or on a filesystem whose flock is
shared) serialize; the atomic rename keeps everything else correct.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("rayft")

TMP_INFIX = ".tmp"
PID_WAIT_S = 5.0  # how long a waiter looks for the lock holder's pid before naming it "unknown"


def build_once(final_dir: Path, build: Callable[[Path], None], what: str) -> Path:
    """Return `final_dir`, calling `build(tmp_dir)` to fill it if no process has yet.

    `build` writes the cache's files into the (existing, empty) directory it is given; `what`
    names the cache in log messages. Exceptions from `build` propagate, leaving nothing behind."""
    final_dir = Path(final_dir)
    if final_dir.is_dir():  # the common case: published earlier, no lock needed
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final_dir.with_name(final_dir.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(fd, lock_path, final_dir, what)
        _write_pid(fd)  # first thing under the lock: a process that now waits reads who holds it
        if final_dir.is_dir():  # built by the process we waited for
            log.info("using %s at %s, built by another process", what, final_dir)
            return final_dir
        _remove_stale_tmp(final_dir)
        tmp = Path(tempfile.mkdtemp(prefix=final_dir.name + TMP_INFIX, dir=final_dir.parent))
        try:
            build(tmp)
            try:
                os.rename(tmp, final_dir)
            except OSError as e:
                # Lost a race to a builder outside the lock: its copy is complete (it was
                # published by rename too), so use it; ours is removed below.
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final_dir.is_dir():
                    raise
                log.info("%s at %s was published by another process; using that copy", what, final_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final_dir
    finally:
        os.ftruncate(fd, 0)  # still under the lock: no pid lingers for a later waiter to misname
        os.close(fd)  # releases the flock


def _lock(fd: int, lock_path: Path, final_dir: Path, what: str) -> None:
    """Take the lock; if another process holds it, say once which pid we wait for. The holder
    writes its pid right after locking, so the pid is read again (briefly) until it is there."""
    deadline = time.monotonic() + PID_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        pid = _read_pid(lock_path)
        if pid != "unknown" or time.monotonic() > deadline:
            break
        time.sleep(0.01)  # the holder is between its flock and its pid write
    log.warning("waiting for another process (pid %s) building %s at %s", pid, what, final_dir)
    fcntl.flock(fd, fcntl.LOCK_EX)


def _write_pid(fd: int) -> None:
    # Overwrite in place, then cut: a reader sees the new pid on the first line at every moment
    # (an older, longer pid's tail may linger on a second line until the truncate).
    data = f"{os.getpid()}\n".encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _read_pid(lock_path: Path) -> str:
    try:
        first = lock_path.read_text().split("\n", 1)[0].strip()
    except OSError:
        first = ""
    # Empty while no process holds the lock, and between the holder's flock and its pid write.
    return first if first.isdigit() else "unknown"


def _remove_stale_tmp(final_dir: Path) -> None:
    """Called with the lock held: any temporary sibling belongs to a builder that died."""
    prefix = final_dir.name + TMP_INFIX
    for p in final_dir.parent.iterdir():
        if p.name.startswith(prefix) and p.is_dir():
            log.info("removing %s, left by an interrupted build", p)
            shutil.rmtree(p, ignore_errors=True)


def set_aside(final_dir: Path, seen: os.stat_result, suffix: str) -> Path | None:
    """Rename `final_dir` to `<final_dir><suffix>` under the build lock if it is still the entry
    `seen` (its `os.lstat` when it was judged); None when another process replaced or moved it
    meanwhile. An OSError (a read-only cache directory) propagates."""
    final_dir = Path(final_dir)
    lock_path = final_dir.with_name(final_dir.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            now = os.lstat(final_dir)
        except FileNotFoundError:
            return None
        if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
            return None
        aside = final_dir.with_name(final_dir.name + suffix)
        os.rename(final_dir, aside)
        return aside
    finally:
        os.close(fd)  # releases the flock
