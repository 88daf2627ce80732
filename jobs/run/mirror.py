"""A run whose `run.output_dir` is an object-store URI: its staging directory (the spec's
`output_path`, `jobs.run.storage.staging_dir`) copied to the store, as Ray Train copies a run to
its `storage_path`. The store holds the staging directory's layout under the URI's prefix.

Invariants:

* The store is the truth, the staging directory a cache of it: a run (re)started takes the
  store's newest checkpoint that verifies (`pull_newest`, checked by `checkpoint.why_incomplete`,
  the rule every local checkpoint passes), never one only the staging directory holds.
* `RUN_MARKER` is the first object a run writes under its prefix (`claim`) after its lease
  (`jobs.run.lease`, taken by `jobs.run.run_hold`), so the prefix is rayft's own
  (`outputs.names_problem`) before anything else is there. A holder that has lost its lease
  uploads nothing more (`lease.check`).
* A checkpoint is uploaded once it is complete locally, its files in
  `checkpoint.publication_order` (the manifests last): a copy cut off at any point lacks a
  manifest or a file one names, so a reader never takes it. Checkpoints beyond
  `run.keep_checkpoints` are removed manifests first. metrics.jsonl and events.jsonl follow each
  checkpoint, so a resume on another machine keeps the history up to it.
* On Ray the ranks may share no disk: each rank uploads its own part of a checkpoint
  (`push_rank_checkpoint`: its manifest after the files it names), rank 0 the history
  (`push_history`); a (re)start takes the checkpoint rank 0 pulled on every node
  (`fetch_checkpoint`).
* At the end every other file of the staging directory is uploaded, summary.json last: a summary
  in the store means the run's outputs are there whole.
* Only the main rank calls these, but `push_rank_checkpoint` and `fetch_checkpoint` (every rank).
  Local output directories are left alone (each function returns).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from jobs.errors import RunError
from jobs.run import checkpoint as ckpt
from jobs.run import lease
from jobs.run.outputs import EVENTS, METRICS, RUN_MARKER, SUMMARY
from jobs.run.runlock import LOCK_FILE
from jobs.run.storage import Store, download, is_uri, list_files, open_store, reported, upload
from jobs.spec import JobSpec

log = logging.getLogger("rayft")

CHECKPOINTS = "checkpoints"
# Written with each checkpoint: what a resume elsewhere needs beside it.
HISTORY_FILES = (METRICS, EVENTS)


def store_of(spec: JobSpec) -> Store | None:
    """The store a run is copied to, or None for a local `run.output_dir`."""
    where = spec.output_location
    return open_store(where) if is_uri(where) else None


def claim(spec: JobSpec) -> None:
    """Write `RUN_MARKER` under the prefix (from the claimed staging directory), before the run."""
    store = store_of(spec)
    if store is None:
        return
    with reported(store, "writing its run marker", during_run=False):
        upload(store, spec.output_path / RUN_MARKER, RUN_MARKER)


def push_checkpoint(spec: JobSpec, step: int) -> None:
    """Upload checkpoint `step` (complete in the staging directory), then the history files,
    then remove the store's checkpoints the staging directory no longer keeps."""
    store = store_of(spec)
    if store is None:
        return
    lease.check_staged(store, spec.output_path)  # a holder that lost its lease writes nothing more there
    local = spec.output_path / CHECKPOINTS / ckpt.step_dir_name(step)
    why = ckpt.why_incomplete(local)
    if why is not None:
        raise RunError(f"checkpoint {local}: {why}; not uploaded to {store.uri}")
    where = f"{CHECKPOINTS}/{local.name}"
    with reported(store, f"uploading {where}", during_run=True):
        for name in ckpt.publication_order([p.name for p in local.iterdir()]):
            upload(store, local / name, f"{where}/{name}")
        for name in HISTORY_FILES:
            if (spec.output_path / name).is_file():
                upload(store, spec.output_path / name, name)
        _prune(store, {p.name for p in ckpt.list_checkpoints(spec.output_path / CHECKPOINTS)})


def push_rank_checkpoint(spec: JobSpec, directory: Path, rank: int, step: int) -> None:
    """One rank's files of checkpoint `step` (written in `directory` by `ckpt.write_rank_files`)
    uploaded by that rank: the files its manifest names, then the manifest, which vouches for them
    (a run over several nodes: no node holds every rank's files)."""
    store = store_of(spec)
    assert store is not None
    manifest = ckpt.manifest_file(rank)
    names = sorted(json.loads((directory / manifest).read_text()))
    where = f"{CHECKPOINTS}/{ckpt.step_dir_name(step)}"
    with reported(store, f"uploading {where}", during_run=True):
        for name in [*names, manifest]:
            upload(store, directory / name, f"{where}/{name}")


def push_history(spec: JobSpec, keep: int, token: str | None) -> None:
    """After every rank uploaded its part of a checkpoint (`push_rank_checkpoint`): the history
    files, then the store's checkpoints beyond the newest `keep` removed."""
    store = store_of(spec)
    assert store is not None
    lease.check_staged(store, spec.output_path, token)
    with reported(store, "uploading the run's history", during_run=True):
        for name in HISTORY_FILES:
            if (spec.output_path / name).is_file():
                upload(store, spec.output_path / name, name)
        _prune(store, set(_remote_checkpoints(store)[-keep:]))


def check_lease(spec: JobSpec, token: str | None) -> None:
    """RunError when the run holding `token` no longer holds the store's lease (before an upload)."""
    store = store_of(spec)
    if store is not None:
        lease.check_staged(store, spec.output_path, token)


def pull_file(spec: JobSpec, name: str) -> None:
    """The store's `name` into the staging directory (the driver's summary.json of a run whose
    rank 0 ran on another node)."""
    store = store_of(spec)
    assert store is not None
    with reported(store, f"reading {name}", during_run=True):
        download(store, name, spec.output_path / name)


def push_outputs(spec: JobSpec, token: str | None = None) -> None:
    """Upload every file of the staging directory but the checkpoints (uploaded as they are
    made), the run lock and temporary files; summary.json last. `token`: the driver's, when rank
    0 runs on another node than the driver (`lease.check_staged`)."""
    store = store_of(spec)
    if store is None:
        return
    lease.check_staged(store, spec.output_path, token)
    out = spec.output_path
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and _is_output(p.relative_to(out)))
    with reported(store, "uploading the run's outputs", during_run=True):
        for name in sorted(names, key=lambda n: n == SUMMARY):
            upload(store, out / name, name)


def push_file(spec: JobSpec, name: str) -> None:
    """Upload one file of the staging directory (`rayft eval`'s eval.json), under the run's hold."""
    store = store_of(spec)
    if store is None:
        return
    with reported(store, f"uploading {name}", during_run=True):
        upload(store, spec.output_path / name, name)


def _is_output(rel: Path) -> bool:
    top = rel.parts[0]
    return top not in (CHECKPOINTS, LOCK_FILE) and not top.startswith(f"{CHECKPOINTS}.") and rel.suffix != ".tmp"


def pull_newest(spec: JobSpec) -> Path | None:
    """Replace the staging directory's checkpoints by the store's newest one that verifies (and
    the history files beside it); the newer ones that do not are skipped with a warning naming
    them. Returns the local copy, or None when the store holds no complete checkpoint."""
    store = store_of(spec)
    if store is None:
        return None
    root = spec.output_path / CHECKPOINTS
    shutil.rmtree(root, ignore_errors=True)  # a cache of the store: the store decides
    with reported(store, "reading its checkpoints", during_run=False):
        for name in reversed(_remote_checkpoints(store)):
            got = _download_checkpoint(store, name, root)
            if got is not None:
                _download_history(store, spec.output_path)
                return got
    return None


FETCHED = ".fetched-"  # a node's copy of a checkpoint of the store (`fetch_checkpoint`)


def fetch_checkpoint(spec: JobSpec, name: str) -> Path:
    """The store's checkpoint `name` (the one rank 0 verified and resumes from) in this node's
    staging directory: downloaded by the first rank of the node to get here, the others waiting
    and then taking its copy (`build_once`: a lock beside it, published by one rename). The copy
    is named by the digest of the store's manifests, so one left by an earlier attempt is used
    only when it is the same checkpoint. Copies of other checkpoints (earlier attempts' or
    runs') are removed once this one is there: one copy per node, not one per restart."""
    from jobs.run.build_once import build_once

    store = store_of(spec)
    assert store is not None
    where = f"{CHECKPOINTS}/{name}"
    with reported(store, f"reading checkpoint {name}", during_run=True):
        manifests = sorted(filter(ckpt.is_manifest, list_files(store, where)))
        digest = hashlib.sha256()
        for rel in manifests:  # they name every file with its sha256: the checkpoint's identity
            with store.fs.open_input_stream(store.key(where, rel)) as f:
                digest.update(rel.encode() + b"\0" + f.read())
    # named by its content: a copy an earlier run of this URI left on the node is never taken
    final = spec.output_path / CHECKPOINTS / f"{FETCHED}{name}-{digest.hexdigest()[:16]}"

    def build(tmp: Path) -> None:
        with reported(store, f"reading checkpoint {name}", during_run=True):
            why = _download_files(store, name, tmp)
        if why is not None:
            raise RunError(f"checkpoint {store.uri}/{CHECKPOINTS}/{name} changed while resuming: {why}")

    final.parent.mkdir(parents=True, exist_ok=True)
    got = build_once(final, build, f"checkpoint {name}")
    _remove_other_fetched(final)
    return got


def _remove_other_fetched(keep: Path) -> None:
    """Every `.fetched-*` entry beside `keep` that is not `keep`'s own (the copy, its lock, its
    temporary directories): no rank of this attempt uses them (all take the checkpoint rank 0
    chose), and no earlier attempt's worker is alive (Ray restarts the whole group)."""
    for entry in keep.parent.glob(FETCHED + "*"):
        if entry.name == keep.name or entry.name.startswith(keep.name + "."):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _download_checkpoint(store: Store, name: str, root: Path) -> Path | None:
    """Checkpoint `name` from the store into `root`, or None (nothing kept) when it does not verify."""
    tmp = root / f".tmp-pull-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    why = _download_files(store, name, tmp)
    if why is not None:
        log.warning("skipping checkpoint %s/%s/%s: %s", store.uri, CHECKPOINTS, name, why)
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    return tmp.rename(root / name)


def _download_files(store: Store, name: str, into: Path) -> str | None:
    """Checkpoint `name`'s files from the store into `into`; why the copy is incomplete, or None."""
    for rel in list_files(store, f"{CHECKPOINTS}/{name}"):
        download(store, f"{CHECKPOINTS}/{name}/{rel}", into / rel)
    return ckpt.why_incomplete(into)


def _download_history(store: Store, out: Path) -> None:
    present = set(list_files(store, "", recursive=False))
    for name in HISTORY_FILES:
        if name in present:
            download(store, name, out / name)


def _prune(store: Store, kept: set[str]) -> None:
    """Remove the store's checkpoints not in `kept`: manifests first, so a removal cut short
    leaves a copy no reader takes."""
    for name in _remote_checkpoints(store):
        if name in kept:
            continue
        where = f"{CHECKPOINTS}/{name}"
        for rel in filter(ckpt.is_manifest, list_files(store, where)):
            store.fs.delete_file(store.key(where, rel))
        store.fs.delete_dir(store.key(where))


def _remote_checkpoints(store: Store) -> list[str]:
    """Names of the store's checkpoint directories (`step-NNNNNNNN`), oldest first."""
    from pyarrow import fs

    infos = store.fs.get_file_info(fs.FileSelector(store.key(CHECKPOINTS), allow_not_found=True))
    names = (Path(i.path).name for i in infos if i.type == fs.FileType.Directory)
    return sorted(n for n in names if n.startswith(ckpt.STEP_PREFIX))
