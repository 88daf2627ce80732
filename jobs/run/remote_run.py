"""A finished run (or an adapter directory, or a merged export) in a bucket, fetched to this
machine for `rayft export`, `rayft eval` and `rayft generate`, through the storage layer of the
run itself (`jobs.run.storage`, `pyarrow.fs`).

Invariants:

* Only what the commands read is downloaded: a run's `adapter/`, `base/` (tiny-llama's saved
  base, when the run has one) and `summary.json`; an adapter directory or a merged export (a
  prefix holding `adapter_config.json` or `config.json` at its top) whole.
* A run is finished when its summary is in the bucket (`jobs.run.mirror` uploads it last); a
  prefix with nothing under it, or a run without its summary or adapter, is one UserError line
  (exit 2), with nothing downloaded. The store's own failures are `storage.store_error`'s lines.
* The copy lives in `fetched_dir(uri)` (`$RAYFT_CACHE/fetched/...`, one per URI), built in a
  temporary sibling and swapped in whole: never the run's staging directory, which a run of the
  same URI on this machine may be writing.
* A fetched run's adapter names its fetched `base/` when the run saved one (the adapter's own
  config named the staging directory of the machine that ran it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from jobs.errors import UserError
from jobs.run.outputs import SUMMARY
from jobs.run.storage import Store, cache_root, download, is_uri, list_files, open_store, reported, staging_dir
from jobs.spec.yaml_file import one_line

ADAPTER, BASE = "adapter", "base"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# Top-level files that make a prefix an adapter directory or a model directory, fetched whole.
WHOLE_DIR_MARKERS = ("adapter_config.json", "config.json")


def local_run(location: str | Path) -> Path:
    """`location` as a local directory: a local path as it is, a URI fetched (`fetch`)."""
    return fetch(str(location)) if is_uri(location) else Path(location)


def fetched_dir(uri: str) -> Path:
    """Where `fetch` puts the copy of `uri`: named as its staging directory, under `fetched/`."""
    return cache_root() / "fetched" / staging_dir(uri).name


def fetch(uri: str) -> Path:
    """Download what the commands need of the run (or directory) at `uri`; returns the local copy."""
    store = open_store(uri)
    with reported(store, "reading the run", during_run=False):
        _check_bucket(store)
        names = list_files(store, "")
        wanted = _wanted(uri, names)
        dest = fetched_dir(uri)
        tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for rel in wanted:
            download(store, rel, tmp / rel)
    if f"{BASE}/config.json" in wanted:
        _point_at_base(tmp / ADAPTER, dest / BASE)
    return swap_in(tmp, dest)


def _check_bucket(store: Store) -> None:
    """Raises the store's error (wrong keys, no bucket) before a listing could read as empty."""
    from pyarrow import fs

    store.fs.get_file_info(fs.FileSelector(store.path.split("/", 1)[0]))


def _wanted(uri: str, names: list[str]) -> list[str]:
    """The files of `names` (all under the prefix) to download, or a UserError saying what is missing."""
    where = one_line(uri)
    if not names:
        raise UserError(f"{where}: no run there (nothing under this prefix); check the URI")
    top = {n for n in names if "/" not in n}
    if top & set(WHOLE_DIR_MARKERS):
        return names  # an adapter directory or a merged export
    missing = [f"{ADAPTER}/{f}" for f in ADAPTER_FILES if f"{ADAPTER}/{f}" not in names]
    if SUMMARY not in top or missing:
        what = missing[0] if missing else SUMMARY
        raise UserError(
            f"{where}: no finished run ({what} is missing); a run uploads it when it ends: finish (or rerun to "
            "resume) the run first"
        )
    return [n for n in names if n == SUMMARY or n.split("/", 1)[0] in (ADAPTER, BASE)]


def _point_at_base(adapter: Path, base: Path) -> None:
    """Make the fetched adapter name the fetched base (where it will be once swapped in)."""
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(base)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def swap_in(tmp: Path, dest: Path) -> Path:
    """Replace `dest` by `tmp` (a finished copy, a directory or a file): the old copy is moved
    aside, then removed."""
    if tmp.is_file():
        return tmp.replace(dest)  # one rename: atomic
    old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def export_target(uri: str, merge: bool) -> Path:
    """The default target of `rayft export URI`: `./<last part of the prefix>-merged` (or
    `-adapter-export`) in the current directory, since the run's own directory is in the bucket."""
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    return Path.cwd() / f"{name}-{'merged' if merge else 'adapter-export'}"
