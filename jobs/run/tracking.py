"""Experiment trackers (`run.trackers`): TensorBoard event files and MLflow runs, fed by rank 0.

Invariants:

* The trackers see exactly the records `metrics.jsonl` gets, one per optimizer step, on the
  step axis of `metrics.jsonl` (`step`, 1-based). A tracker never fails the training: the first
  error of a tracker is one warning, after which that tracker is off and training goes on.
* A resumed run continues the same step axis without duplicated or missing steps:
  - TensorBoard gets each step at once; on resume the writer opens with `purge_step` = the
    checkpoint's step + 1, so readers drop what the killed run wrote past the checkpoint.
  - MLflow has no way to take back a logged value, so it is sent the steps a checkpoint holds:
    the records are buffered and flushed when a checkpoint is written (and at the end). The
    steps a kill loses are the ones the resumed run trains again, and only then are they sent.
  - The MLflow run id is kept in `<output_dir>/mlflow_run.json`; a resume continues that run.
* MLflow's store is, by default, what MLflow 3 itself defaults to: a SQLite database,
  `sqlite:///<output_dir>/mlflow.db`, with the run's artifacts beside it in
  `<output_dir>/mlartifacts/` (MLflow 3 refuses `mlruns/` file stores unless an opt-out variable is
  set; rayft sets none, so what it writes opens with stock MLflow:
  `mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`).
* Nothing here runs on ranks other than 0 (`open_trackers(..., is_main=False)` is inert).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from jobs import secrets
from jobs.run.outputs import write_json_atomic
from jobs.spec import JobSpec

log = logging.getLogger("rayft")

TENSORBOARD_DIR = "tensorboard"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"
MLFLOW_RUN_FILE = "mlflow_run.json"
# Fields of a metrics record that are not metrics (the step is the axis; the kind is a word).
NOT_METRICS = ("step", "peak_mem_kind", "evaluated")


def tracking_uri(spec: JobSpec) -> str:
    """`run.mlflow_tracking_uri`, default the SQLite store `<output_dir>/mlflow.db` (a job spec or
    a search spec: both have `run` and `output_path`)."""
    return spec.run.mlflow_tracking_uri or f"sqlite:///{spec.output_path.resolve() / MLFLOW_DB}"


def experiment_id(client, spec: JobSpec) -> str:
    """The id of the MLflow experiment named `spec.name`, created when missing. In rayft's default
    store its artifacts go beside the database (`<output_dir>/mlartifacts`): without a location
    MLflow would put them under `./mlruns` of whatever directory the process runs in. Any other
    store (a server, a database of the user's) keeps its own artifact root."""
    exp = client.get_experiment_by_name(spec.name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if not spec.run.mlflow_tracking_uri:
        location = (spec.output_path.resolve() / MLFLOW_ARTIFACTS).as_uri()
    return client.create_experiment(spec.name, artifact_location=location)


@contextlib.contextmanager
def store_lock(uri: str | None) -> Iterator[None]:
    """Hold an exclusive lock on `<db>.lock` beside a local SQLite store named by
    `run.mlflow_tracking_uri` while it is opened: MLflow creates a new store's schema on first
    use, and two runs that opened one new store at once raced through its migrations (one lost
    its tracker). The default store is the run's own (`<output_dir>/mlflow.db`, under the run's
    lock) and other stores are servers: no lock."""
    from urllib.parse import unquote, urlparse

    if uri is None or urlparse(uri).scheme != "sqlite":
        yield
        return
    path = unquote(urlparse(uri).path)[1:]  # sqlite:///rel/x.db is rel/x.db, sqlite:////abs/x.db /abs/x.db
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shown_uri(uri: str) -> str:
    """The URI without user info (a password in `http://user:pw@host` is never logged)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable uri>"
    if not (parts.username or parts.password):
        return uri  # as given: urlunsplit would turn sqlite:////data/x.db into sqlite://data/x.db
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def metrics_of(record: dict, evaluated: bool) -> dict[str, float]:
    """The numeric metrics of one `metrics.jsonl` record (booleans as 0/1; the `eval_*` values only
    at steps where the eval ran, since the record carries the last ones forward)."""
    out = {}
    for key, value in record.items():
        if key in NOT_METRICS or value is None or (key.startswith("eval_") and not evaluated):
            continue
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def flat_params(spec: JobSpec) -> dict[str, str]:
    """The resolved spec as `section.field` -> text (MLflow parameters are strings, <= 6000 chars)."""
    out: dict[str, str] = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = (json.dumps(node) if not isinstance(node, str) else node)[:6000]

    walk(spec.to_dict(), "")
    return out


class Trackers:
    """The trackers of one run on rank 0. `log_step(record)` per optimizer step,
    `checkpointed(step)` after a checkpoint is written, `finish(summary, files)` at the end."""

    def __init__(self, spec: JobSpec | None = None, resume_step: int = 0):
        self.spec = spec
        self.tb: Any = None  # tensorboard SummaryWriter (an untyped library)
        self.ml: Any = None  # mlflow MlflowClient (an untyped library)
        self.run_id: str | None = None
        self.pending: list[dict] = []  # records not yet sent to MLflow (see module doc)
        if spec is None:
            return
        if "tensorboard" in spec.run.trackers:
            self._guard("tensorboard", lambda: self._open_tensorboard(resume_step))
        if "mlflow" in spec.run.trackers:
            self._guard("mlflow", lambda: self._open_mlflow(resume_step))

    @property
    def _spec(self) -> JobSpec:
        """The spec, for what runs once a tracker is open: only a run with a spec opens one."""
        assert self.spec is not None
        return self.spec

    # ---- opening ----------------------------------------------------------------------------

    def _open_tensorboard(self, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        logdir = self._spec.output_path / TENSORBOARD_DIR
        # purge_step: readers drop events at steps >= it written before: a killed run's tail on
        # resume, a whole earlier run on a fresh start (`--fresh`) in the same directory.
        self.tb = SummaryWriter(str(logdir), purge_step=resume_step + 1)

    def _open_mlflow(self, resume_step: int) -> None:
        uri = tracking_uri(self._spec)
        # MLflow retries an unreachable server for minutes by default; one short try here, since a
        # failure only turns the tracker off (the user's own setting wins).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        with store_lock(self._spec.run.mlflow_tracking_uri):  # a shared store's schema: made by one run
            client = MlflowClient(tracking_uri=uri)
            client.search_experiments(max_results=1)  # the store (and its schema) exists now
        saved = self._spec.output_path / MLFLOW_RUN_FILE
        if resume_step and saved.exists():
            info = json.loads(saved.read_text())
            if info.get("tracking_uri") == uri:
                client.update_run(info["run_id"], status="RUNNING")
                self.ml, self.run_id = client, info["run_id"]
                return
        exp_id = experiment_id(client, self._spec)
        run = client.create_run(exp_id, run_name=self._spec.name)
        params = [Param(k, v) for k, v in flat_params(self._spec).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            client.log_batch(run.info.run_id, params=params[i : i + 100])
        write_json_atomic(saved, {"run_id": run.info.run_id, "experiment_id": exp_id, "tracking_uri": uri})
        self.ml, self.run_id = client, run.info.run_id

    # ---- per step ---------------------------------------------------------------------------

    def log_step(self, record: dict) -> None:
        if self.spec is None:
            return
        if self.tb is not None:
            self._guard("tensorboard", lambda: self._tb_step(record))
        if self.ml is not None:
            self.pending.append(record)

    def _tb_step(self, record: dict) -> None:
        step = record["step"]
        for key, value in metrics_of(record, bool(record.get("evaluated"))).items():
            self.tb.add_scalar(key, value, step)
        self.tb.flush()

    def checkpointed(self, step: float) -> None:
        """A checkpoint of `step` is on disk: MLflow may now have every step up to it (inf: all)."""
        if self.ml is None:
            return
        sent = [r for r in self.pending if r["step"] <= step]
        self.pending = [r for r in self.pending if r["step"] > step]
        self._guard("mlflow", lambda: self._ml_send(sent))

    def _ml_send(self, records: list[dict]) -> None:
        import time

        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [
            Metric(k, v, now_ms, r["step"]) for r in records for k, v in metrics_of(r, bool(r.get("evaluated"))).items()
        ]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.ml.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    # ---- the end ----------------------------------------------------------------------------

    def finish(self, summary: dict, files: Iterable[Path]) -> None:
        """Send what is left, the summary and `files` (paths; directories go whole), and close."""
        if self.spec is None:
            return
        if self.tb is not None:
            self._guard("tensorboard", lambda: self._tb_finish(summary))
        if self.ml is not None:
            self.checkpointed(float("inf"))
        if self.ml is not None:
            self._guard("mlflow", lambda: self._ml_finish(summary, [Path(f) for f in files]))

    def _tb_finish(self, summary: dict) -> None:
        self.tb.add_text("summary", "```\n" + json.dumps(summary, indent=2, default=str) + "\n```")
        self.tb.close()
        self.tb = None

    def _ml_finish(self, summary: dict, files: list[Path]) -> None:
        for path in files:
            if path.is_dir():
                self.ml.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            elif path.exists():
                self.ml.log_artifact(self.run_id, str(path))
        self.ml.set_terminated(self.run_id, status="FINISHED")
        self.ml = None

    # ---- failures ---------------------------------------------------------------------------

    def _guard(self, which: str, action) -> None:
        """Run `action`; on any error, warn once and turn `which` off (training goes on)."""
        try:
            action()
        except Exception as e:  # noqa: BLE001 - a tracker never fails the training
            where = (
                shown_uri(tracking_uri(self._spec))
                if which == "mlflow"
                else str(self._spec.output_path / TENSORBOARD_DIR)
            )
            reason = " ".join(str(e).split())
            if which == "mlflow":
                uri = tracking_uri(self._spec)
                reason = reason.replace(uri, shown_uri(uri))
            reason = secrets.redact(reason)[:300]
            log.warning(
                "tracker %s (%s) failed: %s: %s; training goes on without it (metrics.jsonl stays complete)",
                which,
                where,
                type(e).__name__,
                reason,
            )
            if which == "tensorboard":
                self.tb = None
            else:
                self.ml, self.pending = None, []


def open_trackers(spec: JobSpec, resume_step: int, is_main: bool) -> Trackers:
    """The run's trackers on rank 0; an inert object elsewhere or when `run.trackers` is empty."""
    if not is_main or not spec.run.trackers:
        return Trackers()
    return Trackers(spec, resume_step)
