"""The queue's driver: admits queued jobs to a Ray cluster when they fit, tracks them, retries.

One pass (`Driver.step`) reconciles SUBMITTING rows (a driver died mid-submission), polls RUNNING
ones, and admits QUEUED ones; `rayft queue run` repeats it. One driver per queue file (an flock on
`<db>.lock`). The store's docstring (orchestrator.queue.store) gives the states and why a driver
killed at any moment resumes exactly.

Admission: jobs go by priority (higher first), then queue order. A job is admitted when the
concurrency limit allows and the cluster has free resources for it (orchestrator.queue.admission:
CPUs, and GPUs whose memory holds the job's memory plan). The head of the queue waits for
resources (lower priorities do not overtake it) unless it can never fit this cluster, which is
reported and skipped. A job that already ran here and is to run again (a retry after it lost a
node, say) waits for the cluster to grow back instead.

On KubeRay (`rayft queue run --backend kuberay`) Kueue admits by quota: the driver creates one
RayJob per admitted job at once (labelled for the LocalQueue; Kueue keeps it suspended until its
GPUs are free) and checks only what quota cannot see, that a worker pod fits one node of the
overlay's node type (admission.fit_node_type: GPUs per node, GPU model, the memory plan on its
GPU). A suspended RayJob is queued, not failed: its row stays active with the reason as detail.
Each attempt is its own RayJob with a deterministic name (`<job>-<hash>`, then `-a2`, ...), so
the SUBMITTING -> RUNNING reconciliation finds a RayJob a killed driver created.

Failures: out of memory (torch OutOfMemoryError / "CUDA out of memory" in the job's status message
or logs) is retried once with half the micro-batch and twice the accumulation steps (same global
batch); the change is recorded and shown by `rayft queue status`. Other failures are retried up to
`max_retries` times with exponential backoff. A second out-of-memory is final.

`enqueue` is `rayft queue add`: the spec is validated as the Ray Jobs backend will submit it and
its `Demand` estimated, once, before the store sees it.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TextIO, cast

from jobs.errors import ClusterAuthError, ClusterError, ClusterUnreachable, RayftError, UserError, oom_line
from orchestrator.backends.base import (
    FAILED,
    QUEUED,
    SUCCEEDED,
    Backend,
    QuotaBackend,
    ResourceBackend,
    Submission,
    first_line,
)
from orchestrator.backends.ray_jobs import resolve_spec
from orchestrator.backends.working_dir import find_project

from .admission import Demand, fit_node_type, reserve
from .store import ACTIVE, DONE, NewJob, Queue


def load_queued_spec(spec_path: str, overrides: list[str], working_dir: Path, backend: str = "ray"):
    """(spec, spec path relative to the working dir), validated as `backend` will submit it.

    ray: as the Ray Jobs backend uploads it (`resolve_spec`: the data files are read here, they
    travel with the working dir). kuberay: as `rayft submit --backend kuberay` renders it: the
    data paths resolve inside the image or on the data volume, so they are not checked here. Both
    read the spec from the working dir, where the driver reads it again at submission; `spec_path`
    is relative to the current directory (or absolute)."""
    if backend != "kuberay":
        spec, rel, _, _ = resolve_spec(spec_path, overrides, working_dir)
        return spec, rel
    from jobs.errors import SpecError
    from orchestrator.backends.kuberay import load_spec_for_k8s

    p = Path(spec_path).resolve()
    if not p.is_file():
        raise SpecError(f"{spec_path}: spec file not found")
    if not p.is_relative_to(Path(working_dir).resolve()):
        raise SpecError(
            f"{spec_path}: the spec is outside the working dir {working_dir}, where the queue's "
            "driver reads it; move it into the project"
        )
    return load_spec_for_k8s(str(p), list(overrides)).spec, str(p.relative_to(Path(working_dir).resolve()))


def enqueue(
    queue: Queue,
    spec_path: str,
    overrides: list[str],
    *,
    priority: int = 0,
    max_retries: int = 2,
    working_dir: str | None = None,
    backend: str = "ray",
) -> tuple[int, bool]:
    """`rayft queue add` of one spec: validate it (as `backend` will submit it, relative paths in
    the working dir), estimate its demand, store it. Returns (id, created); the same spec twice is
    one job."""
    wd = find_project(working_dir)
    spec, rel = load_queued_spec(spec_path, overrides, wd, backend)
    return queue.add(
        NewJob(
            name=spec.name,
            working_dir=str(wd),
            spec_path=rel,
            overrides=tuple(overrides),
            spec_hash=spec.spec_hash(),
            micro_batch_size=spec.batch.micro_batch_size,
            grad_accum_steps=spec.grad_accum_steps,
            demand_json=Demand.from_spec(spec).to_json(),
            priority=priority,
            max_retries=max_retries,
        )
    )


@dataclass
class DriverConfig:
    """How the driver admits: concurrency limit, seconds between passes, first retry delay
    (doubling), GPU memory overrides by Ray accelerator type, and where it logs."""

    max_concurrency: int | None = None
    poll_s: float = 2.0
    backoff_s: float = 30.0
    gpu_memory: dict[str, float] = field(default_factory=dict)
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)


class _Next(NamedTuple):
    """What follows an ended attempt (`Driver._next`): the job row's new values."""

    first: str  # the message recorded: the attempt's last line, or why it is not retried
    state: str  # the job's new state: QUEUED again, or the attempt's status
    note: str  # change_note: the batch change of an out-of-memory retry
    changes: list[str] | None  # the driver's overrides, when they change
    detail: str  # the attempt's end and what follows, for the event log
    micro: int
    accum: int
    retries: int
    oom_retried: int
    not_before: float  # no submission before this time (the backoff)
    demand: str  # the job's resource demand (JSON), re-planned for a halved micro-batch


class Driver:
    """One pass (`step`) = reconcile SUBMITTING rows, poll RUNNING ones, admit QUEUED ones.

    `backend` is a `Backend` that either describes its free resources (`cluster_view()`, a
    `ClusterView`: the Ray Jobs backend, admitted here by free resources) or admits by quota
    itself (`admits_by_quota`, with a `node_type`: KubeRay with Kueue, checked here for fit only).
    """

    def __init__(self, queue: Queue, backend: Backend[Any] | None, config: DriverConfig | None = None):
        self.q = queue
        self._backend = backend
        self.cfg = config or DriverConfig()
        self._lock_file: TextIO | None = None

    @property
    def backend(self) -> Backend[Any]:
        """The backend jobs go to. A driver made without one (None) only locks its file and
        records the ends of attempts; nothing it does then reaches here."""
        if self._backend is None:
            raise AttributeError("this queue driver has no backend")
        return self._backend

    @property
    def backend_name(self) -> str:
        return getattr(self._backend, "name", "ray")

    def log(self, job: sqlite3.Row, msg: str) -> None:
        self.cfg.log(f"{time.strftime('%H:%M:%S')} #{job['id']} {job['name']}: {msg}")

    # -- one driver per file --
    def lock(self) -> None:
        """An flock on `<db>.lock`, released by the kernel when the driver dies (SIGKILL included)."""
        path = self.q.path.with_name(self.q.path.name + ".lock")
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            raise UserError(f"another `rayft queue run` holds {path} ({f.read().strip() or 'pid unknown'})") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        self._lock_file = f

    # -- the pass --
    def step(self) -> dict:
        self.reconcile()
        self.poll()
        admitted = self.admit()
        counts: dict[str, int] = {}
        for row in self.q.jobs():
            counts[row["state"]] = counts.get(row["state"], 0) + 1
        return {"admitted": admitted, "counts": counts}

    def reconcile(self) -> None:
        """The SUBMITTING rows a killed driver left: RUNNING when the cluster has the submission,
        else QUEUED again (the attempt taken back), to be submitted with the same id."""
        for job in self.q.jobs(("SUBMITTING",)):
            info = self.backend.info(job["submission_id"])
            with self.q.txn() as c:
                if info is not None:
                    n = c.execute(
                        "UPDATE jobs SET state='RUNNING' WHERE id=? AND state='SUBMITTING' AND submission_id=?",
                        (job["id"], job["submission_id"]),
                    ).rowcount
                    if n:
                        self.q.event(
                            c,
                            job["id"],
                            "running",
                            f"{job['submission_id']} (found on the cluster after a driver restart)",
                        )
                else:  # never reached the cluster: admit it again, with the same id
                    n = c.execute(
                        "UPDATE jobs SET state='QUEUED', attempt=attempt-1 WHERE id=? AND "
                        "state='SUBMITTING' AND submission_id=?",
                        (job["id"], job["submission_id"]),
                    ).rowcount
                    if n:
                        c.execute("DELETE FROM attempts WHERE job_id=? AND attempt=?", (job["id"], job["attempt"]))
                        self.q.event(c, job["id"], "requeued", f"{job['submission_id']} never reached the cluster")
            if n:
                found = "tracking" if info is not None else "not on the cluster; requeued"
                self.log(job, f"{job['submission_id']}: {found}")

    def poll(self) -> None:
        for job in self.q.jobs(("RUNNING",)):
            st = self.backend.info(job["submission_id"])
            if st is None:
                self.ended(job, FAILED, "the job disappeared from the cluster (was the cluster restarted?)", "")
                continue
            if st.ended:
                logs = ""
                if st.state == FAILED:
                    try:
                        logs = self.backend.logs(job["submission_id"])[-200_000:]
                    except RayftError:  # the logs only sharpen the verdict (out of memory?)
                        logs = ""
                self.ended(job, st.state, st.message, logs)
            else:
                # Not ended. QUEUED (a RayJob Kueue has not admitted, suspended) is waiting, not failed.
                detail = f"{st.state}: {first_line(st.message)}" if st.state == QUEUED and st.message else st.state
                if detail != job["status_detail"]:
                    with self.q.txn() as c:
                        c.execute("UPDATE jobs SET status_detail=? WHERE id=? AND state='RUNNING'", (detail, job["id"]))

    def ended(self, job: sqlite3.Row, status: str, message: str, logs: str, from_state: str = "RUNNING") -> None:
        """Record the end of the current attempt exactly once; decide on a retry (`_next`)."""
        now = time.time()
        first = (message or "").strip().splitlines()[-1][:300] if (message or "").strip() else ""
        nxt = self._next(job, status, first, oom_line(message, logs) if status == FAILED else None, now)
        with self.q.txn() as c:
            n = c.execute(
                "UPDATE jobs SET state=?, message=?, change_note=?, changes=COALESCE(?, changes), "
                "micro_batch_size=?, grad_accum_steps=?, retries=?, oom_retried=?, not_before=?, demand=?, "
                "status_detail=?, ended_at=? WHERE id=? AND state=? AND submission_id=?",
                (
                    nxt.state,
                    nxt.first,
                    nxt.note,
                    json.dumps(nxt.changes) if nxt.changes is not None else None,
                    nxt.micro,
                    nxt.accum,
                    nxt.retries,
                    nxt.oom_retried,
                    nxt.not_before,
                    nxt.demand,
                    status,
                    now if nxt.state in DONE else None,
                    job["id"],
                    from_state,
                    job["submission_id"],
                ),
            ).rowcount
            if not n:
                return
            c.execute(
                "UPDATE attempts SET status=?, message=?, ended_at=? WHERE job_id=? AND attempt=?",
                (status, nxt.first, now, job["id"], job["attempt"]),
            )
            self.q.event(c, job["id"], "attempt_ended", f"{job['submission_id']}: {nxt.detail}")
            if nxt.state in DONE:
                self.q.event(c, job["id"], "ended", nxt.state)
            elif nxt.changes is not None:
                self.q.event(c, job["id"], "oom_retry", nxt.note)
            else:
                self.q.event(c, job["id"], "retry", nxt.detail)
        self.log(
            job,
            f"{job['submission_id']} {nxt.detail}"
            + (f": {nxt.first}" if nxt.first and nxt.state in DONE and status != SUCCEEDED else ""),
        )

    def _demand_for(self, job: sqlite3.Row, changes: list[str]) -> Demand | None:
        try:
            wd = Path(job["working_dir"])
            spec, _ = load_queued_spec(
                str(wd / job["spec_path"]), json.loads(job["overrides"]) + changes, wd, self.backend_name
            )
            return Demand.from_spec(spec)
        except UserError:
            return None

    def _next(self, job: sqlite3.Row, status: str, first: str, oom: str | None, now: float) -> _Next:
        """What follows an attempt that ended with `status` (`first`: its message's last line,
        `oom`: the out-of-memory line found in its message or logs). Out of memory: once, queued
        again with the micro-batch halved and the accumulation doubled (the global batch
        unchanged); another failure: queued again after an exponential backoff while retries are
        left; else the job ends with the attempt's status."""
        micro, accum = job["micro_batch_size"], job["grad_accum_steps"]
        nxt = _Next(
            first=first,
            state=status,
            note=job["change_note"],
            changes=None,
            detail=status,
            micro=micro,
            accum=accum,
            retries=job["retries"],
            oom_retried=job["oom_retried"],
            not_before=0.0,
            demand=job["demand"],
        )
        if status == FAILED and oom:
            if job["oom_retried"]:
                return nxt._replace(first=f"out of memory again at micro_batch_size={micro} after halving it: {oom}")
            if micro < 2 or micro % 2:
                return nxt._replace(first=f"out of memory at micro_batch_size={micro}, which cannot be halved: {oom}")
            m2, a2 = micro // 2, accum * 2
            changes = json.loads(job["changes"]) + [f"batch.micro_batch_size={m2}", f"batch.grad_accum_steps={a2}"]
            note = (
                f"out of memory at attempt {job['attempt']}: micro_batch_size {micro} -> {m2}, "
                f"grad_accum_steps {accum} -> {a2} (global batch unchanged)"
            )
            d = Demand.from_json(job["demand"])
            if d.use_gpu:
                d = self._demand_for(job, changes) or d
            return nxt._replace(
                state="QUEUED",
                note=note,
                changes=changes,
                micro=m2,
                accum=a2,
                oom_retried=1,
                demand=d.to_json(),
                detail=f"FAILED (out of memory) -> retry with {note.split(': ', 1)[1]}",
            )
        if status == FAILED and job["retries"] < job["max_retries"]:
            retries = job["retries"] + 1
            delay = self.cfg.backoff_s * 2 ** (retries - 1)
            return nxt._replace(
                state="QUEUED",
                retries=retries,
                not_before=now + delay,
                detail=f"FAILED -> retry {retries}/{job['max_retries']} in {delay:g} s",
            )
        return nxt

    def _fail(self, job: sqlite3.Row, message: str) -> None:
        with self.q.txn() as c:
            n = c.execute(
                "UPDATE jobs SET state='FAILED', message=?, ended_at=? WHERE id=? AND state='QUEUED'",
                (message[:300], time.time(), job["id"]),
            ).rowcount
            if n:
                self.q.event(c, job["id"], "ended", f"FAILED: {message[:300]}")
        self.log(job, f"FAILED before submission: {message}")

    def _reason(self, job: sqlite3.Row, reason: str) -> None:
        if job["status_detail"] != reason:
            with self.q.txn() as c:
                c.execute("UPDATE jobs SET status_detail=? WHERE id=? AND state='QUEUED'", (reason, job["id"]))
            self.log(job, reason)

    def admit(self) -> int:
        active = self.q.jobs(ACTIVE)
        limit = self.cfg.max_concurrency
        now = time.time()
        queued = sorted((j for j in self.q.jobs(("QUEUED",))), key=lambda j: (-j["priority"], j["id"]))
        if not queued:
            return 0
        quota = getattr(self.backend, "admits_by_quota", False)
        if quota:
            node = cast(QuotaBackend, self.backend).node_type
        else:
            view = cast(ResourceBackend, self.backend).cluster_view()
        held = [Demand.from_json(j["demand"]) for j in active]
        held_res = (sum(d.cpus for d in held), sum(d.gpus for d in held))
        admitted = 0
        for job in queued:
            if limit is not None and len(active) + admitted >= limit:
                break
            if job["not_before"] > now:
                self._reason(job, f"retry backoff until {time.strftime('%H:%M:%S', time.localtime(job['not_before']))}")
                continue
            demand = Demand.from_json(job["demand"])
            if quota:
                ok, ever, why = fit_node_type(demand, node, self.cfg.gpu_memory)
            else:
                ok, ever, why = reserve(demand, view, self.cfg.gpu_memory, held_res)
            if not ever and not quota and job["attempt"] > 0:
                # It ran on this cluster before: the cluster shrank (a node was lost) and may grow back.
                self._reason(job, f"waiting for resources: the cluster is smaller than when it ran ({why})")
                break
            if not ever:
                self._reason(job, why)
                continue  # skip it: it would block the queue forever
            if not ok:
                self._reason(job, why)
                break  # strict priority: lower ones do not overtake it
            if self.submit(job):
                admitted += 1
                held_res = (held_res[0] + demand.cpus, held_res[1] + demand.gpus)
        return admitted

    def submit(self, job: sqlite3.Row) -> bool:
        """Submit one QUEUED job: prepare it (refusing a spec changed since `queue add`), record
        SUBMITTING with the attempt before the cluster sees it, submit, then record RUNNING. A
        driver killed between submitting and recording finds the submission by its id on restart
        (`reconcile`); a refused submission is a failed attempt. True when the job now runs."""
        attempt = job["attempt"] + 1
        sub = self._prepare(job, attempt)
        if sub is None or not self._record_submitting(job, attempt, sub):
            return False
        try:
            _, created = self.backend.submit(sub)
        except (ClusterUnreachable, ClusterAuthError):
            raise  # not this job's fault: the pass fails, the row stays SUBMITTING
        except ClusterError as e:  # the cluster refused this submission: a failed attempt
            if self.backend.info(sub.submission_id) is None:
                self.ended(self.q.job(job["id"]), FAILED, f"submission refused: {e}", "", from_state="SUBMITTING")
                return False
            created = False
        if os.environ.get("RAYFT_QUEUE_FAULT") == "kill_after_submit":
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: die between "submitted" and "recorded"
        with self.q.txn() as c:
            n = c.execute(
                "UPDATE jobs SET state='RUNNING' WHERE id=? AND state='SUBMITTING' AND submission_id=?",
                (job["id"], sub.submission_id),
            ).rowcount
            if n:
                self.q.event(
                    c,
                    job["id"],
                    "running",
                    sub.submission_id if created else f"{sub.submission_id} (already on the cluster)",
                )
        if not n and self.q.job(job["id"])["state"] == "CANCELED":
            self.backend.stop(sub.submission_id)  # canceled while it was being submitted
            return False
        self.log(
            job,
            f"submitted {sub.submission_id} (attempt {attempt}, micro_batch_size "
            f"{sub.spec.batch.micro_batch_size} x grad_accum_steps {sub.spec.grad_accum_steps})"
            + ("" if created else ": already on the cluster, tracking it"),
        )
        return True

    def _prepare(self, job: sqlite3.Row, attempt: int) -> Submission | None:
        """The backend's submission of `job` (its spec as queued, with the driver's changes), or
        None after failing the job in one line: a spec file changed since it was queued, or one
        the backend refuses."""
        overrides = json.loads(job["overrides"])
        changes = json.loads(job["changes"])
        wd = job["working_dir"]
        try:
            # The spec as queued (the submission adds the driver's changes and, on a local cluster,
            # an absolute run.output_dir): has the file changed since `queue add`?
            spec, _ = load_queued_spec(str(Path(wd) / job["spec_path"]), overrides, Path(wd), self.backend_name)
            if spec.spec_hash() != job["spec_hash"]:
                self._fail(
                    job,
                    f"{job['spec_path']} changed since it was queued (spec hash {job['spec_hash']} -> "
                    f"{spec.spec_hash()}); add it again",
                )
                return None
            return self.backend.prepare(
                str(Path(wd) / job["spec_path"]),
                overrides + changes,
                working_dir=wd,
                attempt=attempt,
                extra_metadata={"queue_job": job["id"], "queue_spec_hash": job["spec_hash"]},
            )
        except UserError as e:
            self._fail(job, str(e))
            return None

    def _record_submitting(self, job: sqlite3.Row, attempt: int, sub: Submission) -> bool:
        """QUEUED -> SUBMITTING with the attempt's submission id and batch split, in one
        transaction; False when the job left QUEUED meanwhile (canceled)."""
        with self.q.txn() as c:
            n = c.execute(
                "UPDATE jobs SET state='SUBMITTING', attempt=?, submission_id=?, status_detail='', "
                "not_before=0 WHERE id=? AND state='QUEUED'",
                (attempt, sub.submission_id, job["id"]),
            ).rowcount
            if not n:
                return False
            c.execute(
                "INSERT OR REPLACE INTO attempts (job_id, attempt, submission_id, micro_batch_size, "
                "grad_accum_steps, submitted_at) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    job["id"],
                    attempt,
                    sub.submission_id,
                    sub.spec.batch.micro_batch_size,
                    sub.spec.grad_accum_steps,
                    time.time(),
                ),
            )
            self.q.event(c, job["id"], "submitting", sub.submission_id)
        return True

    def unschedulable_only(self) -> bool:
        """Nothing active and every queued job can never fit: waiting would be forever."""
        if self.q.jobs(ACTIVE):
            return False
        queued = self.q.jobs(("QUEUED",))
        return bool(queued) and all(j["status_detail"].startswith("can never fit") for j in queued)

    def run(self, *, once: bool = False, forever: bool = False, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Drive the queue: one pass (`once`), until every job has ended (default), or `forever`."""
        self.lock()
        first = True
        while True:
            try:
                self.step()
            except RayftError as e:
                if first or once:
                    raise  # a wrong address or token: say so and stop
                self.cfg.log(f"{time.strftime('%H:%M:%S')} pass failed, retrying in {self.cfg.poll_s:g} s: {e}")
            first = False
            if once or should_stop():
                return 0
            if not forever:
                if not self.q.jobs(("QUEUED",) + ACTIVE):
                    bad = [j for j in self.q.jobs() if j["state"] != "SUCCEEDED"]
                    return 1 if bad else 0
                if self.unschedulable_only():
                    self.cfg.log("every queued job can never fit this cluster; stopping (see `rayft queue status`)")
                    return 1
            time.sleep(self.cfg.poll_s)
