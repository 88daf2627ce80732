"""Whether a tokenized cache entry's files are the ones its build wrote.

The cache lives on storage that every job of a cluster shares, so an entry may meet a partial
write, another job's mistake or a tampering hand. An entry is used only after these checks
(`jobs.data.cache.load_entry` calls them; a failure is a `BadEntry` naming the file):

- **Always, on every open** (cheap: a `lstat` per file and the small per-sample arrays): the
  entry directory and each file it must hold (`jobs.data.cache.entry_files`) exist, are a
  directory / regular files and no symbolic link (never followed), each file has the size
  `meta.json` records (`check_files`); then the layout's own checks (dtypes, shapes, offsets,
  counts: `jobs.data.cache`).
- **Once per node, and again whenever a file's size, mtime, ctime or inode changed since**
  (`check_contents`): every file's sha256 against `meta.json`'s, and in the same pass the id
  range of the token files (0 <= id < the tokenizer's vocabulary; targets may also be IGNORE).
  Both read every token byte, so they share the one pass; what was verified is remembered in
  a per-node marker in the node's own temporary storage (`marker_path`, written atomically;
  never in the shared cache, whose files stay exactly what the builds wrote), holding each file's
  (size, mtime_ns, ctime_ns, inode) and the vocabulary size checked. A write to a file changes
  its ctime even when its size and mtime are put back, so a file that matches its marker is the
  file that was verified.

sha256, not BLAKE2: hashlib's sha256 uses the CPU's SHA extensions and measured 0.96-1.19 GB/s
against blake2b's 0.63-0.66 GB/s on a shared 2-core x86-64 host (`bench/cache_verify.py`,
bench/results/cache-verify-2026-12-02.json); xxhash would be a new dependency. The id range
alone costs a read of every token (0.79 s at 250M tokens, measured): hence it shares the
digest's pass and is not paid on every open.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from jobs.data.tokenizing import IGNORE
from jobs.spec.yaml_file import one_line

DIGEST = "sha256"  # the key of each file's digest in meta.json's "files"
BLOCK_BYTES = 1 << 22  # read in blocks of whole int32 tokens
MARKER_DIR = "{tmp}/rayft-verified-{uid}"  # per node and user: where `marker_path` keeps the markers


class BadEntry(Exception):
    """An entry file that is not what its build wrote: `path` and what is wrong with it (`problem`)."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


def file_records(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """What `meta.json` records of each file `names` under `directory`: its size and sha256
    (deterministic: the same bytes give the same record)."""
    return {n: {"size": (directory / n).stat().st_size, DIGEST: digest(directory / n, None)} for n in names}


def digest(path: Path, vocab_size: int | None) -> str:
    """sha256 of the file at `path`; with `vocab_size`, a token file (`*.bin`) is also checked to
    hold only ids in 0..vocab_size-1 (a targets file: or IGNORE), in the same pass."""
    h = hashlib.new(DIGEST)
    rule = _id_rule(path.name)
    with open(path, "rb") as f:  # a token file's size is 4 bytes a token (checked before): whole ids a block
        while block := f.read(BLOCK_BYTES):
            h.update(block)
            if vocab_size is not None and rule is not None and not _ids_in_range(block, vocab_size, rule):
                raise BadEntry(path, f"holds token ids outside the vocabulary (0..{vocab_size - 1})")
    return h.hexdigest()


def _id_rule(name: str) -> str | None:
    if name.endswith(".targets.bin"):
        return "targets"
    return "ids" if name.endswith(".bin") else None


def _ids_in_range(block: bytes, vocab_size: int, rule: str) -> bool:
    """Every int32 of `block` in 0..vocab_size-1 (`rule` "targets": or IGNORE). Viewed unsigned,
    a negative id is huge, so one max covers both ends."""
    ids = np.frombuffer(block[: len(block) // 4 * 4], dtype=np.int32)
    if rule == "targets":
        ids = np.where(ids == IGNORE, 0, ids)
    return not len(ids) or int(ids.view(np.uint32).max()) < vocab_size


def read_meta(final: Path) -> Any:
    """The parsed meta.json of the entry `final`, once it and the entry are a real directory and a
    regular file (`check_files`); a BadEntry where it is not the JSON its build wrote."""
    path = final / "meta.json"
    check_files(final, {}, ["meta.json"])
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadEntry(path, f"is not the JSON its build wrote ({one_line(str(e))[:200]})") from None


def check_files(final: Path, files: dict[str, Any], names: list[str]) -> dict[str, list[int]]:
    """The entry directory and its files `names` (meta.json first) are a real directory and
    regular files, none a symbolic link, each of the size `files` (meta.json's record) says;
    returns each one's (size, mtime_ns, ctime_ns, inode), what the marker compares."""
    entry = _lstat(final, final)
    if not stat.S_ISDIR(entry.st_mode):
        raise BadEntry(
            final, "is a symbolic link (never followed)" if stat.S_ISLNK(entry.st_mode) else "is no directory"
        )
    stats = {}
    for name in names:
        path = final / name
        st = _lstat(path, path)
        if stat.S_ISLNK(st.st_mode):
            raise BadEntry(path, "is a symbolic link (never followed)")
        if not stat.S_ISREG(st.st_mode):
            raise BadEntry(path, "is not a regular file")
        want = _recorded(final, files, name, "size") if name in files else st.st_size
        if st.st_size != want:
            raise BadEntry(path, f"holds {st.st_size} bytes, meta.json records {want}")
        stats[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return stats


def _recorded(final: Path, files: dict[str, Any], name: str, key: str) -> Any:
    """meta.json's record `key` ("size" or DIGEST) of the entry's file `name`; a BadEntry naming
    meta.json where that record is missing (a damaged meta.json: every build writes both)."""
    record = files.get(name)
    if not isinstance(record, dict) or key not in record:
        raise BadEntry(final / "meta.json", f"does not record the {key} of {name}")
    return record[key]


def _lstat(path: Path, shown: Path) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise BadEntry(shown, "is missing") from None
    except OSError as e:
        raise BadEntry(shown, f"cannot be read ({e.strerror or e})") from None


def check_contents(final: Path, files: dict[str, Any], stats: dict[str, list[int]], vocab_size: int) -> None:
    """Each file's sha256 equals `files`' (meta.json's) and its token ids are in range, unless
    this node's marker says these very files (`stats`) were verified for `vocab_size` already."""
    done = {"vocab_size": vocab_size, "files": stats}
    marker = marker_path(final)
    if marker is not None and _read_marker(marker) == done:
        return
    for name in files:
        path = final / name
        if digest(path, vocab_size) != _recorded(final, files, name, DIGEST):
            raise BadEntry(path, f"content differs from the {DIGEST} meta.json records")
    if marker is not None:
        _write_marker(marker, done)


def marker_path(final: Path) -> Path | None:
    """This node's marker of the entry `final`: in a directory of the node's own temporary
    storage that only this user owns (`MARKER_DIR`; a per-node fact stays on the node, and the
    shared cache holds only what builds wrote), named by the entry's path. None where that
    directory is not ours (then every open digests)."""
    root = Path(MARKER_DIR.format(tmp=tempfile.gettempdir(), uid=os.getuid()))
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(root)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "host"
    return root / f"{hashlib.sha256(str(final).encode()).hexdigest()[:32]}-{host}.json"


def _read_marker(marker: Path) -> Any:
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return None
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def _write_marker(marker: Path, done: dict) -> None:
    """Atomically; a cache that cannot be written costs the next open one more digest pass."""
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(done, sort_keys=True))
        os.replace(tmp, marker)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
