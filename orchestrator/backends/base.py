"""What every backend is: the `Backend` protocol, the one `JobStatus`, and the one state vocabulary.

A backend runs job specs somewhere and answers for them by id:

    ray_jobs.RayJobsBackend    a Ray cluster's Jobs API (`ray job submit`); id = Ray submission id
    kuberay.KubeRayBackend     one KubeRay RayJob per job; id = RayJob name (also its Ray submission id)

The CLI (`orchestrator.cli.jobs`) has one code path for all of them: it asks the backend to
`prepare` a spec (validate it, once, and compute everything that will be sent), then to `submit`
it, and prints the `JobStatus` it gets back. Nothing outside a backend looks at backend-native
status objects.

States, one vocabulary (`STATES`):

    QUEUED     accepted, waiting for admission (Kueue has the RayJob suspended)
    PENDING    admitted, starting (cluster coming up, runtime env, driver starting)
    RUNNING    the entrypoint runs
    SUCCEEDED | FAILED | STOPPED   ended (`FINAL`); STOPPED = stopped by hand
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TextIO, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from .kuberay.node_types import NodeType

QUEUED, PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED = "QUEUED", "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"
STATES = (QUEUED, PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED)
FINAL = (SUCCEEDED, FAILED, STOPPED)


def job_state(status: Any) -> str:
    """A Ray job status (the `ray.job_submission.JobStatus` enum, or its string) as one of `STATES`.

    The one normalisation of Ray's job status: the Ray Jobs backend reads it from `JobDetails`,
    the KubeRay backend from a RayJob's `status.jobStatus`. Ray's statuses are PENDING, RUNNING,
    STOPPED, SUCCEEDED, FAILED; anything else (an empty field, a newer Ray's word) is PENDING:
    not ended, not known to run.
    """
    word = str(getattr(status, "value", status) or "").strip().upper()
    return word if word in STATES else PENDING


def first_line(text: Any, limit: int = 300) -> str:
    """The first non-blank line of an error text, at most `limit` characters.

    Ray's client exceptions and the Kubernetes API's error bodies carry multi-line texts (remote
    tracebacks, JSON); rayft reports one line of them. Every backend error message goes through here.
    """
    s = str(text)
    for line in s.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return s.strip()[:limit]


@dataclass
class JobStatus:
    """One job as a backend reports it.

    id:         what `rayft status|logs|stop ID` takes (Ray submission id / RayJob name)
    state:      one of `STATES`
    message:    the backend's last word on it (why it failed, what it waits for); may span lines
    name:       the job's name: the spec's `name` for a Ray job; the RayJob's object name for KubeRay
    spec_hash:  the hash of the validated spec it runs (empty when rayft did not submit it)
    start_time_s / end_time_s: seconds since the epoch, None while unknown / not ended
    backend:    "ray" or "kuberay"
    details:    backend-specific facts (entrypoint, batch split, RayJob deployment status, ...)
    """

    id: str
    state: str
    message: str = ""
    name: str = ""
    spec_hash: str = ""
    start_time_s: float | None = None
    end_time_s: float | None = None
    backend: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"job state {self.state!r} is not one of {STATES}")

    @property
    def ended(self) -> bool:
        return self.state in FINAL

    def to_dict(self) -> dict[str, Any]:
        """What `--json` prints. The id and state keep the names rayft's JSON has always used
        (`submission_id`, `status`), so scripts reading them keep working."""
        return {
            "submission_id": self.id,
            "status": self.state,
            "message": self.message,
            "name": self.name,
            "spec_hash": self.spec_hash,
            "start_time_s": self.start_time_s,
            "end_time_s": self.end_time_s,
            "backend": self.backend,
            "details": dict(self.details),
        }


@runtime_checkable
class Submission(Protocol):
    """A validated job, ready to send: made by `Backend.prepare`, taken by `Backend.submit`."""

    spec: Any  # the typed JobSpec, loaded once
    spec_hash: str
    submission_id: str  # deterministic: the same spec (and attempt) gets the same id
    warnings: list[str]

    def summary(self) -> str:
        """A few words on what will be sent (files and MiB; node type and estimate)."""

    def describe(self) -> dict:
        """Everything that would be sent, for `rayft submit --dry-run`."""


# What one backend's `prepare` makes and its `submit` takes (a RaySubmission, a KubeRaySubmission).
SubmissionT = TypeVar("SubmissionT", bound=Submission)


@runtime_checkable
class Backend(Protocol[SubmissionT]):
    """Runs job specs and answers for them by id. Errors are `jobs.errors` classes: `UserError`
    for the input, `ClusterUnreachable` / `ClusterAuthError` / `JobNotFound` / `ClusterError`
    for the cluster, each with a one-line message. Generic in its submission type: `submit`
    takes only what the same backend's `prepare` made (`Backend[Any]`: any backend)."""

    name: str

    @property
    def where(self) -> str:
        """Where jobs go, in words: "http://HOST:8265", "namespace rayft"."""

    @property
    def cli_flags(self) -> str:
        """The flags that name this backend again on the command line (for hints)."""

    def prepare(
        self,
        spec_path: str,
        overrides: list[str],
        *,
        working_dir: str | None = None,
        attempt: int = 1,
        extra_metadata: dict | None = None,
    ) -> SubmissionT:
        """Load and validate the spec once; compute what `submit` sends. Sends nothing."""

    def submit(self, sub: SubmissionT) -> tuple[JobStatus, bool]:
        """Submit unless a job with that id exists: (its status, whether this call created it)."""

    def info(self, job_id: str) -> JobStatus | None:
        """The job's status, or None when the backend has no job of that id."""

    def status(self, job_id: str) -> JobStatus:
        """The job's status; `JobNotFound` when there is none."""

    def logs(self, job_id: str) -> str:
        """The driver's output so far."""

    def follow(self, job_id: str, out: TextIO | None = None) -> JobStatus:
        """Write the logs to `out` (stdout) as they come until the job ends; its final status."""

    def wait(self, job_id: str, timeout_s: float | None = None) -> JobStatus:
        """Wait, silently, until the job ends (or `timeout_s`); its last status."""

    def stop(self, job_id: str) -> bool:
        """Stop the job: True when a stop was sent, False when it had already ended."""

    def list(self, all_jobs: bool = False) -> list[JobStatus]:
        """The jobs rayft submitted (`all_jobs`: every job the backend has), oldest first."""


def write_new_text(out: TextIO | None, seen: str, text: str) -> str:
    """Write what `text` adds to `seen` (all of it when the log was rotated); returns `text`."""
    out = out or sys.stdout
    out.write(text[len(seen) :] if text.startswith(seen) else text)
    out.flush()
    return text


def wait_for_end(status: Callable[[], JobStatus], timeout_s: float | None, poll_s: float) -> JobStatus:
    """Poll `status()` every `poll_s` seconds until the job has ended, or `timeout_s` has passed
    (None: no limit); returns the last status seen. Every backend's `wait` is this."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        st = status()
        if st.ended or (deadline is not None and time.monotonic() > deadline):
            return st
        time.sleep(poll_s)


def sorted_by_start(rows: Iterable[JobStatus]) -> list[JobStatus]:
    return sorted(rows, key=lambda r: (r.start_time_s is None, r.start_time_s or 0.0, r.id))


# ---- a cluster's resources, as a backend reports them for queue admission --------------------------------------
#
# The queue's driver (orchestrator.queue.driver) admits in one of two ways, by what the backend offers:
#   cluster_view() -> ClusterView   rayft is the scheduler: a job is submitted when its pods fit the
#                                   free resources now (Ray Jobs);
#   admits_by_quota = True, with    the cluster's own queue admits (Kueue): jobs are created at once
#   node_type -> a NodeType         and wait there; rayft only refuses what can never fit one node (KubeRay).
# `ResourceBackend` and `QuotaBackend` name the two.


@dataclass
class Node:
    """One alive Ray node: totals, what is free now, and its GPUs' Ray accelerator type."""

    node_id: str
    cpu_total: float
    cpu_free: float
    gpu_total: float = 0.0
    gpu_free: float = 0.0
    accelerator_type: str | None = None


@dataclass
class ClusterView:
    """The cluster as admission sees it in one pass; `admission.reserve` takes placed jobs off it."""

    nodes: list[Node]
    usage_known: bool = True

    @property
    def cpu_total(self) -> float:
        return sum(n.cpu_total for n in self.nodes)

    @property
    def cpu_free(self) -> float:
        return sum(n.cpu_free for n in self.nodes)

    @property
    def gpu_total(self) -> float:
        return sum(n.gpu_total for n in self.nodes)

    @property
    def gpu_free(self) -> float:
        return sum(n.gpu_free for n in self.nodes)


class ResourceBackend(Backend[Any], Protocol):
    """A backend the queue admits to by its free resources (Ray Jobs)."""

    def cluster_view(self) -> ClusterView:
        """The alive nodes with their total and free resources, now."""


class QuotaBackend(Backend[Any], Protocol):
    """A backend whose cluster admits by quota (KubeRay with Kueue); `admits_by_quota` is True."""

    admits_by_quota: bool

    @property
    def node_type(self) -> NodeType:
        """What one node of the cluster has."""
