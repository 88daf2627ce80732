"""A search whose `run.output_dir` is an object-store URI (`s3://bucket/prefix`, `gs://...`): it runs
in its staging directory (the spec's `output_path`, `jobs.run.storage.staging_dir`), as a run does,
and its files are copied under the prefix when it ends, in the staging directory's layout
(results.json, results.csv, results.txt, best.yaml, search.png, search_plan.json, the Tune
experiment `tune/`, each trial's directory `trials/<trial>/`).

Invariants:

* Before anything is written the store is asked as a run's is (`outputs.check_output_store`: the
  credentials, the bucket, a prefix new, empty or rayft's own); a refusal is one line, exit 2.
* The search holds its staging directory's lock and the prefix's lease (`jobs.run.lease`, the
  run's lease) from before its first write under the prefix (`RUN_MARKER`) to its end
  (`held`): a second search (or run) into the prefix is refused in one line while it lives.
* While it runs (`syncing`), what changed in the staging directory is uploaded every
  `search.upload_every_s` (never results.json), so a search killed outright has the bucket at most
  that far behind.
* `push` (when the search returns, finished or interrupted) first deletes the prefix's
  results.json, then uploads every other file (checkpoint manifests after their files), results.json
  last: a reader that finds results.json finds the whole search beside it.
* A staging directory without the search's state (another machine, a cleared cache) is filled
  from the prefix first (`pull`), so a resume goes on where the bucket's copy stopped; a staging
  directory that holds the search is taken as it is (it is at least as new as what it uploaded).
* `--fresh` never removes anything from the bucket: it is refused while the prefix holds a search.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jobs.errors import RayftError, SpecError
from jobs.run import checkpoint as ckpt
from jobs.run import lease, run_hold
from jobs.run.outputs import RUN_MARKER, check_output_store, set_aside
from jobs.run.ownership import hold_output_dir
from jobs.run.runlock import LOCK_FILE
from jobs.run.storage import Store, download, is_uri, list_files, open_store, reported, upload
from jobs.spec import one_line

from .plan import PLAN_FILE, TRIALS_DIR, TUNE_DIR
from .report import RESULTS_JSON
from .spec import SearchSpec

# What `pull` brings back besides the top-level files: the Tune experiment and the trials.
SEARCH_DIRS = (TUNE_DIR, TRIALS_DIR)


def store_of(spec: SearchSpec) -> Store | None:
    """The store a search is copied to, or None for a local `run.output_dir`."""
    where = spec.output_location
    return open_store(where) if is_uri(where) else None


def check(spec: SearchSpec) -> None:
    """An object-store `run.output_dir` asked before anything is written (one line, exit 2)."""
    if is_uri(spec.output_location):
        check_output_store(spec.output_location)


@contextmanager
def held(spec: SearchSpec, *, fresh: bool) -> Iterator[None]:
    """For a search into a store: its staging directory locked, claimed and the prefix's lease taken
    (the run marker uploaded), the bucket's search brought in when the staging directory lacks one;
    all given back at the end. A local search: nothing."""
    store = store_of(spec)
    if store is None:
        yield
        return
    _start_over(spec, store, fresh)
    hold_output_dir(spec.output_path, name=spec.name, location=spec.output_location)
    try:
        with reported(store, "writing its run marker", during_run=False):
            upload(store, spec.output_path / RUN_MARKER, RUN_MARKER)
        pull(spec, store)
        yield
    finally:
        run_hold.let_go_at(spec.output_path, spec.output_location)


def _start_over(spec: SearchSpec, store: Store, fresh: bool) -> None:
    """`--fresh`: refused while the prefix holds a search (nothing is removed from a bucket);
    else the staging directory's old search is moved aside."""
    if not fresh:
        return
    with reported(store, "asking the store", during_run=False):
        found = PLAN_FILE in list_files(store, "", recursive=False)
    if found:
        raise SpecError(
            f"run.output_dir={one_line(store.uri)}: --fresh: the prefix holds a search and rayft never removes "
            "anything from a bucket; resume it (drop --fresh) or name another run.output_dir"
        )
    moved = set_aside(spec.output_path)
    if moved:
        print(f"--fresh: the previous staging directory was moved to {moved}", file=sys.stderr)


def pull(spec: SearchSpec, store: Store) -> bool:
    """The prefix's search (its top-level files, `tune/`, `trials/`) into a staging directory that
    holds none (no search_plan.json). Returns whether anything was brought in."""
    out = spec.output_path
    if (out / PLAN_FILE).is_file():
        return False
    with reported(store, "reading its search", during_run=False):
        names = [n for n in list_files(store, "", recursive=False) if n not in (lease.LEASE, LOCK_FILE)]
        if PLAN_FILE not in names:
            return False
        names += [f"{d}/{rel}" for d in SEARCH_DIRS for rel in list_files(store, d)]
        for rel in names:
            download(store, rel, out / rel)
    print(f"brought the search in {store.uri} into {out}", file=sys.stderr)
    return True


def push(spec: SearchSpec) -> None:
    """The staging directory's search under the prefix, results.json deleted first and written last
    (see the module's invariant); nothing when the search's lease is no longer its own."""
    store = store_of(spec)
    if store is None:
        return
    out = spec.output_path
    lease.check_staged(store, out)
    with reported(store, "uploading the search", during_run=True):
        if RESULTS_JSON in list_files(store, "", recursive=False):
            store.fs.delete_file(store.key(RESULTS_JSON))
        for rel in upload_order(out):
            upload(store, out / rel, rel)


@contextmanager
def syncing(spec: SearchSpec) -> Iterator[None]:
    """While a search into a store runs: what changed in its staging directory uploaded every
    `search.upload_every_s` (`upload_changed`), on a thread that stops before `push`. An upload
    that fails is said in one line and tried again at the next turn: `push` at the end decides."""
    store = store_of(spec)
    if store is None:
        yield
        return
    stop, seen = threading.Event(), dict[str, tuple[int, int]]()

    def turn() -> None:
        while not stop.wait(spec.search.upload_every_s):
            try:
                lease.check_staged(store, spec.output_path)
            except RayftError as e:  # the prefix is another's now: nothing more goes there
                print(f"rayft: {e}", file=sys.stderr, flush=True)
                return
            try:
                upload_changed(spec, store, seen)
            except RayftError as e:
                print(f"rayft: {e} (tried again in {spec.search.upload_every_s:g} s)", file=sys.stderr, flush=True)

    thread = threading.Thread(target=turn, name="rayft-search-upload", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def upload_changed(spec: SearchSpec, store: Store, seen: dict[str, tuple[int, int]]) -> list[str]:
    """The staging directory's files new or changed (size, mtime) since `seen`, in `upload_order`
    (checkpoint manifests after their files), results.json never (it is written last, by `push`).
    The caller has found the prefix's lease still the search's. Returns what was uploaded."""
    out, done = spec.output_path, []
    with reported(store, "uploading the search", during_run=True):
        for rel in upload_order(out):
            try:
                st = (out / rel).stat()
            except FileNotFoundError:  # a file the search removed meanwhile (a trial's old checkpoint)
                continue
            if rel == RESULTS_JSON or seen.get(rel) == (st.st_size, st.st_mtime_ns):
                continue
            upload(store, out / rel, rel)
            seen[rel] = (st.st_size, st.st_mtime_ns)
            done.append(rel)
    return done


def upload_order(out: Path) -> list[str]:
    """The staging directory's files to upload (not the locks, not temporary files), relative to
    `out`: checkpoint manifests after every other file, results.json last."""
    names = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and _is_output(p)]
    return sorted(names, key=lambda n: (n == RESULTS_JSON, ckpt.is_manifest(Path(n).name), n))


def _is_output(path: Path) -> bool:
    return path.name != LOCK_FILE and path.suffix != ".tmp" and not path.name.startswith(".tmp")


def in_store(spec: SearchSpec, rows: list[dict]) -> list[dict]:
    """The results' rows with each trial's `output_dir` named where a reader finds it: under the
    prefix for a search into a store (the staging directory is this machine's cache)."""
    if not is_uri(spec.output_location):
        return rows
    local, uri = str(spec.output_path), spec.output_location.rstrip("/")
    return [r | {"output_dir": _moved(r.get("output_dir"), local, uri)} for r in rows]


def _moved(path: str | None, local: str, uri: str) -> str | None:
    return uri + path[len(local) :] if path and path.startswith(local) else path
