"""What a finished job leaves in `run.output_dir` (written by rank 0 only), and which
directories rayft may write into at all.

Invariants:

* rayft writes only into a directory that is new, empty, or its own: one it created or claimed
  before, which holds the marker file `RUN_MARKER`. Anything else (a non-empty directory of
  someone else's files, an empty path, `/`, a system directory, `$HOME` itself) is refused
  before anything runs (`check_output_dir`); `claim_output_dir` then creates it and writes
  the marker.
* Every JSON file and line written here is strict JSON: a non-finite float (NaN, infinity),
  which JSON cannot express and strict readers reject, is written as null (`strict_json`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from jobs.errors import RunError, SpecError
from jobs.run.lease import LEASE
from jobs.run.runlock import LOCK_FILE
from jobs.run.step_record import StepRecord
from jobs.run.storage import is_uri, open_store, reported
from jobs.spec import JobSpec, one_line

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLOT = "loss_curve.png"
EVENTS = "events.jsonl"
# Written into run.output_dir when rayft creates or claims it: "this directory is rayft's".
RUN_MARKER = ".rayft-run"
# What the training loop writes at the top of run.output_dir; a directory made by a rayft
# from before the marker holds only these (plus `checkpoints.set-aside-*`, `*.tmp`).
RUN_FILES = (METRICS, SUMMARY, PLOT, EVENTS, "adapter", "base", "checkpoints")
# Never an output directory: the root, system directories, and (below) $HOME itself.
SYSTEM_DIRS = (
    "/",
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/srv",
    "/sys",
    "/tmp",
    "/usr",
    "/var",
)
# ... and nothing anywhere below these: configuration, kernel and device trees, installed programs.
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/proc",
    "/sbin",
    "/sys",
    "/usr/bin",
    "/usr/include",
    "/usr/lib",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/sbin",
    "/usr/share",
)


class MetricsLog:
    """`metrics.jsonl`, one line per optimizer step. On resume, lines past the checkpoint go."""

    def __init__(self, output_dir: Path, resume_step: int):
        self.path = output_dir / METRICS
        output_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut off by a crash
                if rec.get("step", 0) <= resume_step:
                    kept.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)
        self._f = open(self.path, "a")

    def write(self, record: StepRecord) -> None:
        self._f.write(strict_json(record.line()) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def append_event(output_dir: Path, event: str, **fields) -> None:
    """`events.jsonl`: run starts, resumes (with the step), ends. Never truncated."""
    rec = {"event": event, "time": time.time(), **fields}
    with open(Path(output_dir) / EVENTS, "a") as f:
        f.write(strict_json(rec) + "\n")


def read_events(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / EVENTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(output_dir: Path) -> list[StepRecord]:
    """metrics.jsonl's records, each checked (`StepRecord.from_line`): a line that is not JSON or
    not a step record is one `RunError` naming the file and line."""
    path = Path(output_dir) / METRICS
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise RunError(f"{path}:{n}: not a JSON line (cut short?)") from None
        out.append(StepRecord.from_line(rec, f"{path}:{n}"))
    return out


def format_step(rec: StepRecord) -> str:
    """One optimizer step as the plain progress line `rayft run` and `python -m jobs.finetune` print."""
    pref = ""
    if (accuracies := rec.value("rewards/accuracies")) is not None:
        pref = f" rewards/accuracies {accuracies:.2f} rewards/margins {rec.value('rewards/margins'):.3g}"
    if (reward := rec.value("reward")) is not None:  # online RL: the step's mean reward (TRL's `reward`)
        pref += f" reward {reward:.3g}"
    return (
        f"step {rec.step}/{rec.total_steps} loss {rec.loss:.4f}{pref} lr {rec.lr:.3g} "
        f"grad_norm {rec.grad_norm:.3g} tokens/s {rec.tokens_per_s:.0f}"
    )


def write_text_atomic(path: Path, text: str) -> None:
    """Write beside `path`, then rename over it: a reader sees the old file or the new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: dict) -> None:
    write_text_atomic(path, strict_json(obj, indent=2) + "\n")


def finite_or_none(obj: Any) -> Any:
    """`obj` with every NaN or infinite float inside dicts, lists and tuples replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def strict_json(obj: Any, indent: int | None = None) -> str:
    """JSON that any strict reader parses: non-finite floats become null (JSON has no NaN or
    Infinity; Python's default would write those bare words)."""
    return json.dumps(finite_or_none(obj), indent=indent, allow_nan=False)


def output_dir_problem(path: str | Path, *, beside_others: bool = False) -> str | None:
    """Why rayft may not write into `path` (as the user wrote it, `{name}` filled in), or None.

    Refused: an empty path; `/`, a system directory or anything inside a system tree (after
    following symbolic links); `$HOME` itself; something that is not a directory; a non-empty
    directory rayft did not make (no `RUN_MARKER`, and not the layout of a rayft run made
    before the marker existed). `beside_others` (the training loop, on a directory its caller
    made, e.g. a Tune trial's) also accepts a directory of other files as long as none of them
    is one the loop writes: nothing there is overwritten. Only reads; never creates anything."""
    text = str(path)
    if not text.strip():
        return "is empty: name a directory for the run's files (e.g. outputs/{name})"
    problem = place_problem(text)
    if problem:
        return problem
    resolved = _resolved(text)
    if not os.path.lexists(resolved) and not os.path.lexists(text):
        return None
    if not resolved.is_dir():
        return f"exists and is not a directory ({resolved})"
    try:
        names = [p.name for p in resolved.iterdir()]
    except OSError as e:
        return f"cannot be listed ({e.strerror or e})"
    return names_problem(names, beside_others=beside_others)


def names_problem(names: list[str], *, beside_others: bool = False) -> str | None:
    """Why rayft may not write into a directory (or bucket prefix) whose top level holds `names`,
    or None: it is empty, rayft's own (`RUN_MARKER`, or an old rayft run's layout), or with
    `beside_others` holds nothing the loop writes. The one ownership rule, local or in a bucket."""
    names = [n for n in names if n not in (LOCK_FILE, LEASE)]  # the run lock or lease alone: a claim cut short
    if not names or RUN_MARKER in names or _made_by_old_rayft(names):
        return None
    if beside_others and not any(n in RUN_FILES and n != "checkpoints" for n in names):
        return None
    return (
        f"is not empty and was not made by rayft (no {RUN_MARKER} in it): rayft writes only into a new "
        "or empty directory or one of its own runs; name another run.output_dir"
    )


# The longest file name most file systems take (ext4, XFS, NFS: 255 bytes).
MAX_NAME_BYTES = 255


def _resolved(text: str) -> Path:
    try:
        return Path(text).resolve()
    except (OSError, RuntimeError):  # a symlink loop: judged by its own name
        return Path(os.path.abspath(text))


def place_problem(path: str | Path) -> str | None:
    """Why rayft may never write at or below `path`, or None: a name component longer than the
    file system takes; `/`, a system directory or anything inside a system tree (after following
    symbolic links); `$HOME` itself. The rule for every place rayft writes (the output dir, the
    data cache, an MLflow file store). Only reads."""
    text = str(path)
    long = next((c for c in Path(text).parts if len(os.fsencode(c)) > MAX_NAME_BYTES), None)
    if long is not None:
        return (
            f"has a name component of {len(os.fsencode(long))} bytes ({long[:40]}...); file systems take at most "
            f"{MAX_NAME_BYTES}"
        )
    resolved = _resolved(text)
    home = Path(os.path.expanduser("~")).resolve()
    if str(resolved) in SYSTEM_DIRS or resolved == home or any(resolved.is_relative_to(t) for t in SYSTEM_TREES):
        where = "your home directory" if resolved == home else "a system directory or inside one"
        return f"is {where} ({resolved}); rayft writes only into a directory of its own: name a new one"
    return None


def writable_problem(path: str | Path) -> str | None:
    """Why this user cannot create files in directory `path` (made when missing), or None: the
    directory, or its nearest existing parent, is not a writable directory."""
    p = _resolved(str(path))
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable by this user"
    return None


def check_write_places(spec: JobSpec) -> None:
    """Every place a run writes besides its output dir, refused in one line before anything is
    written: the data cache (`check_cache_place`) and an MLflow `file:` or `sqlite:` store
    (`run.mlflow_tracking_uri`, default `<output_dir>/mlflow.db`). The output dir itself has
    `check_output_dir`."""
    check_cache_place(spec)
    if "mlflow" in spec.run.trackers:
        _check_mlflow_store(spec)


def check_cache_place(spec: JobSpec) -> None:
    """The data cache (`data.cache_dir`, default beside the output dir): a place rayft may write
    (`place_problem`), a directory or none yet (not a file or FIFO), writable. Every command that
    writes the cache asks it (`rayft run`, `rayft data prepare`)."""
    out = spec.output_path  # a URI's staging directory: the cache stays on this machine's disk
    cache = spec.data.cache_dir or str(out.parent / ".rayft-data")
    field = "data.cache_dir" if spec.data.cache_dir else "data.cache_dir (default, beside run.output_dir)"
    # a default cache beside an output dir that is refused itself: `check_output_dir` says why
    problem = (
        None if not spec.data.cache_dir and output_dir_problem(out) else place_problem(cache) or writable_problem(cache)
    )
    if problem:
        raise SpecError(f"{field}={one_line(cache)}: {one_line(problem)}")


def _check_mlflow_store(spec: JobSpec) -> None:
    """An MLflow `file:` or `sqlite:` store is a place rayft writes: judged on the path the store's
    own reader uses (percent-decoded, as SQLAlchemy and MLflow decode it), never through a link."""
    from urllib.parse import unquote, urlparse

    uri = spec.run.mlflow_tracking_uri
    if uri is None:  # the default: sqlite:///<output_dir>/mlflow.db
        uri = "sqlite:///" + str(spec.output_path.absolute() / "mlflow.db")
    scheme = urlparse(uri).scheme
    if scheme not in ("file", "sqlite"):
        return
    where = unquote(urlparse(uri).path) or uri
    if scheme == "sqlite" and where.startswith("/"):  # sqlite:///rel/x.db is rel/x.db, sqlite:////abs/x.db /abs/x.db
        where = where[1:]
    problem = place_problem(where)
    if problem is None and os.path.islink(where):
        problem = f"{where} is a symbolic link: rayft does not write through links"
    if problem is None:
        problem = writable_problem(where if scheme == "file" else Path(where).parent)
    if problem:
        raise SpecError(f"run.mlflow_tracking_uri={one_line(uri)}: {one_line(problem)}")


def _made_by_old_rayft(names: list[str]) -> bool:
    """The top-level layout of a run made by a rayft without `RUN_MARKER`: its events file,
    and nothing but what the loop writes."""
    return EVENTS in names and all(
        n in RUN_FILES or n.startswith("checkpoints.set-aside-") or n.endswith(".tmp") for n in names
    )


def check_output_dir(path: str | Path, *, beside_others: bool = False) -> None:
    """Raise a one-line SpecError (`run.output_dir=...: why`) when `output_dir_problem` finds one;
    an object-store URI is asked of the store (`check_output_store`)."""
    if is_uri(path):
        check_output_store(str(path))
        return
    problem = output_dir_problem(path, beside_others=beside_others)
    if problem:
        raise SpecError(f"run.output_dir={one_line(str(path))}: {one_line(problem)}")


def check_output_store(uri: str) -> None:
    """An object-store `run.output_dir`, asked before anything is written: the store answers with
    the environment's credentials, the bucket exists, and the prefix is new, empty or rayft's own
    (`names_problem`, the rule of a local directory). Reads only; one typed line on failure."""
    from pyarrow import fs

    store = open_store(uri)
    bucket = store.path.split("/", 1)[0]
    with reported(store, "asking the store", during_run=False):
        found = store.fs.get_file_info(fs.FileSelector(bucket))  # raises on wrong keys, no bucket
        if store.path != bucket:
            found = store.fs.get_file_info(fs.FileSelector(store.path, allow_not_found=True))
    problem = names_problem([Path(i.path).name for i in found])
    if problem:
        raise SpecError(f"run.output_dir={one_line(uri)}: {one_line(problem)}")


def claim_output_dir(path: str | Path, *, beside_others: bool = False, name: str = "") -> Path:
    """Check `path` (see `output_dir_problem`), then create it and write `RUN_MARKER` into it
    when it is not there yet. Returns the path. Idempotent."""
    check_output_dir(path, beside_others=beside_others)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / RUN_MARKER
    if not marker.exists():
        write_text_atomic(marker, strict_json({"created_by": "rayft", "name": name, "time": time.time()}) + "\n")
    return out


def set_aside(path: Path) -> Path | None:
    """`--fresh`: rename `path` (old checkpoints, a previous search) to `<name>.set-aside-<time>`
    beside it, never deleting anything. None when there is nothing there."""
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    dest = path.with_name(f"{path.name}.set-aside-{time.strftime('%Y%m%dT%H%M%S')}")
    path.rename(dest)
    return dest


def loss_points(records: list[StepRecord]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train, eval) (step, loss) points of a run's metrics: the train loss of every step, the eval
    loss only at the steps where it was measured (a record carries the last eval loss forward;
    `evaluated` says where it is new)."""
    train = [(r.step, r.loss) for r in records]
    evals = [(r.step, r.eval_loss) for r in records if r.evaluated and r.eval_loss is not None]
    return train, evals


def plot_loss(
    output_dir: Path,
    records: list[StepRecord],
    title: str,
    ylabel: str = "loss (nats / label token)",
    train_label: str = "train loss (token-weighted)",
) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        return None
    train, evals = loss_points(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train, strict=True), label=train_label)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(output_dir) / PLOT
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
