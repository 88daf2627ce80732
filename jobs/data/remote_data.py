"""Data sources in a bucket (`data.path: s3://bucket/train.jsonl`, a Parquet or other file, a
`save_to_disk` prefix; `data.eval_path`, a mixture's sources; `gs://` alike), copied to this
machine's disk through the storage layer of runs (`jobs.run.storage`, `pyarrow.fs`) before
anything reads them.

Invariants:

* `localize(spec)` returns the spec with every URI source replaced by its local copy: everything
  after it (the checks, the content hash that keys the token cache, the cache itself) sees a
  local file or directory, as for data given locally. The token cache stays on local disk.
* A copy is `copy_path(uri)`: `$RAYFT_CACHE/sources/<sha256 of the URI>/<its last part>`, the
  same place for one URI every time (its suffix kept: the reader goes by it), downloaded into a
  temporary sibling and swapped in, so it is whole or absent. It is downloaded again by every
  command that reads it: the bucket is the truth.
* The content hash is the copy's bytes (sha256, as for a local file), not the object's ETag:
  an S3 ETag is the MD5 of the bytes only for a single-part upload (not for a multipart or an
  encrypted one) and GCS's differ, so it is not a content hash in general. The cost: one
  download and one sha256 pass over the data per command.
* A URI that names nothing is one SpecError line naming the field; a failure of the store is
  `storage.store_error`'s line under the field's name (wrong keys, a missing bucket: exit 2).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from jobs.errors import SpecError
from jobs.run.remote_run import swap_in
from jobs.run.storage import Store, cache_root, download, is_uri, list_files, open_store, reported
from jobs.spec import JobSpec, one_line


def copy_path(uri: str) -> Path:
    """Where the local copy of `uri` lives."""
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return cache_root() / "sources" / digest / uri.rstrip("/").rsplit("/", 1)[-1]


def localize(spec: JobSpec) -> JobSpec:
    """`spec` with each object-store data source replaced by its local copy (downloaded now)."""
    if not any(is_uri(p) for _, p in spec.data.source_files()):
        return spec
    d = spec.to_dict()
    data = d["data"]
    many = len(data["path"]) > 1
    data["path"] = [_local(p, f"data.path.{i}" if many else "data.path") for i, p in enumerate(data["path"])]
    if data.get("eval_path"):
        data["eval_path"] = _local(data["eval_path"], "data.eval_path")
    for i, src in enumerate(data.get("mix") or []):
        for key in ("path", "eval_path"):
            if src.get(key):
                src[key] = _local(src[key], f"data.mix.{i}.{key}")
    return JobSpec.model_validate(d)


def _local(location: str, field: str) -> str:
    """`location` itself when local, else the path of its fresh local copy."""
    if not is_uri(location):
        return location
    store = open_store(location)
    if "/" not in store.path:
        raise SpecError(f"{field}={one_line(location)}: names a whole bucket; name a file or a dataset's prefix in it")
    dest = copy_path(location)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    _remove(tmp)
    with reported(store, "reading it", during_run=False, field=field):
        _download_source(store, field, tmp)
    return str(swap_in(tmp, dest))


def _download_source(store: Store, field: str, tmp: Path) -> None:
    """The object (or every object below the prefix) `store` names, into `tmp`."""
    from pyarrow import fs

    kind = store.fs.get_file_info(store.path).type
    if kind == fs.FileType.File:
        download(store, "", tmp)
        return
    names = list_files(store, "") if kind == fs.FileType.Directory else []
    if not names:
        store.fs.get_file_info(fs.FileSelector(store.path.split("/", 1)[0]))  # a missing bucket says so
        raise SpecError(f"{field}={one_line(store.uri)}: no such object (nothing there); check the URI")
    for rel in names:
        download(store, rel, tmp / rel)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
