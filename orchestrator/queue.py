"""The job queue and its driver: admits queued jobs to a Ray cluster when they fit.

State lives in SQLite (`--db`, default $RAYFT_QUEUE_DB or ~/.rayft/queue.db). Every state change
is one transaction, and every transition is conditional on the state it leaves, so a driver
killed at any moment (SIGKILL included) and restarted on the same file resumes exactly where the
file says it was:

    QUEUED --(admitted)--> SUBMITTING --(cluster accepted)--> RUNNING --> SUCCEEDED | FAILED | STOPPED
       ^                                                          |
       +------------- retry (backoff) / out-of-memory retry ------+          (CANCELED by hand)

* SUBMITTING is written, with the attempt's deterministic submission id, *before* the cluster is
  asked. A driver that died between "submitted" and "recorded" finds the row SUBMITTING on
  restart and asks the cluster for that id: there -> RUNNING (tracked, not resubmitted); not
  there -> back to QUEUED (the same id is used again, and the cluster refuses duplicates).
* RUNNING -> final is recorded once (`WHERE state='RUNNING' AND submission_id=?`), together with
  the `ended` event; a driver killed before recording it sees the same final status on restart.
* One driver per file (an flock on `<db>.lock`, released by the kernel when the driver dies).

Admission: jobs go by priority (higher first), then queue order. A job is admitted when the
concurrency limit allows and the cluster has free resources for it: CPUs (the driver's share plus
`cpus_per_worker` per worker) and, for GPU jobs, one free GPU per worker on nodes whose GPU memory
(by Ray `accelerator_type`, `GPU_MEMORY_GIB`, overridable) holds the job's memory estimate
(`jobs.memory`). The head of the queue waits for resources (lower priorities do not overtake it)
unless it can never fit this cluster, which is reported and skipped.

Failures: out of memory (torch OutOfMemoryError / "CUDA out of memory" in the job's status message
or logs) is retried once with half the micro-batch and twice the accumulation steps (same global
batch); the change is recorded and shown by `rayft queue status`. Other failures are retried up to
`max_retries` times with exponential backoff. A second out-of-memory is final.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import signal
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from jobs.spec import JobSpec, SpecError

from .submit import (DRIVER_NUM_CPUS, FINAL, ClusterError, build_submission, find_project, looks_like_oom,
                     resolve_spec)

ACTIVE = ("SUBMITTING", "RUNNING")
DONE = ("SUCCEEDED", "FAILED", "STOPPED", "CANCELED")

# GiB of memory per GPU by Ray `accelerator_type` (ray.util.accelerators). Where one name covers
# two sizes (V100 16/32 GB, A100 40/80 GB) the smaller is used; `--gpu-memory TYPE=GiB` overrides.
GPU_MEMORY_GIB: dict[str, float] = {
    "K80": 12, "P4": 8, "P100": 16, "V100": 16, "T4": 16, "A10G": 24, "L4": 24, "L40S": 48,
    "A100": 40, "A100-40G": 40, "A100-80G": 80, "H100": 80, "H200": 141, "H20": 96,
    "B200": 180, "B300": 288, "GB200": 186, "GB300": 288, "RTX-PRO-6000": 96,
    "AMD-Instinct-MI210": 64, "AMD-Instinct-MI250X": 64, "AMD-Instinct-MI250X-MI250": 64,
    "AMD-Instinct-MI300X-OAM": 192, "AMD-Instinct-MI300X-HF": 192, "AMD-Instinct-MI325X-OAM": 256,
    "AMD-Instinct-MI350X-OAM": 288, "AMD-Instinct-MI355X-OAM": 288,
    "Intel-GPU-Max-1550": 128, "Intel-GPU-Max-1100": 48,
}


def default_db() -> Path:
    return Path(os.environ.get("RAYFT_QUEUE_DB") or Path.home() / ".rayft" / "queue.db")


# ---- resources -------------------------------------------------------------------------------

@dataclass
class Node:
    node_id: str
    cpu_total: float
    cpu_free: float
    gpu_total: float = 0.0
    gpu_free: float = 0.0
    accelerator_type: Optional[str] = None


@dataclass
class ClusterView:
    nodes: list[Node]
    usage_known: bool = True

    @classmethod
    def from_api(cls, nodes_json: dict, status_json: dict) -> "ClusterView":
        """From the dashboard's `/api/v0/nodes` (totals, accelerator types) and `/api/cluster_status`
        (per-node usage, refreshed by the autoscaler monitor every few seconds)."""
        data = (status_json or {}).get("data") or {}
        report = ((data.get("clusterStatus") or {}).get("loadMetricsReport") or {})
        usage = report.get("usageByNode") or {}
        out = []
        for n in ((nodes_json.get("data") or {}).get("result") or {}).get("result") or []:
            if n.get("state") != "ALIVE":
                continue
            res = n.get("resources_total") or {}
            used = usage.get(n["node_id"]) or {}
            accel = next((k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")), None)
            accel = accel or (n.get("labels") or {}).get("ray.io/accelerator-type")
            cpu, gpu = float(res.get("CPU", 0)), float(res.get("GPU", 0))
            out.append(Node(n["node_id"], cpu, cpu - float((used.get("CPU") or [0])[0]),
                            gpu, gpu - float((used.get("GPU") or [0])[0]), accel))
        return cls(out, usage_known=bool(usage))

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


@dataclass
class Demand:
    """What one job holds while it runs."""

    num_workers: int
    cpus_per_worker: float
    use_gpu: bool = False
    accelerator_type: Optional[str] = None
    driver_cpus: float = DRIVER_NUM_CPUS
    est_gib_off: Optional[float] = None   # memory estimate per GPU, gradient checkpointing off
    est_gib_on: Optional[float] = None    # ... and on
    gc_mode: str = "auto"                 # "true", "false", "auto" (memory.gradient_checkpointing)
    budget_gib: Optional[float] = None

    @property
    def cpus(self) -> float:
        return self.driver_cpus + self.num_workers * self.cpus_per_worker

    @property
    def gpus(self) -> float:
        return float(self.num_workers) if self.use_gpu else 0.0

    def gpu_need_gib(self, gpu_mem: float) -> float:
        """The estimate the job will run with on a GPU of `gpu_mem` GiB (as `jobs.loop` decides
        `auto` checkpointing: on when the estimate without it exceeds the budget, else the GPU)."""
        off = self.est_gib_off if self.est_gib_off is not None else 0.0
        on = self.est_gib_on if self.est_gib_on is not None else off
        if self.gc_mode == "true":
            return on
        if self.gc_mode == "false":
            return off
        budget = self.budget_gib if self.budget_gib is not None else gpu_mem
        return off if off <= budget else on

    @classmethod
    def from_spec(cls, spec: JobSpec, driver_cpus: float = DRIVER_NUM_CPUS) -> "Demand":
        r = spec.resources
        d = cls(r.num_workers, r.cpus_per_worker, r.use_gpu, r.accelerator_type, driver_cpus,
                gc_mode=str(spec.memory.gradient_checkpointing).lower(), budget_gib=spec.memory.budget_gib)
        if r.use_gpu:
            from jobs.memory import estimate_for_spec

            d.est_gib_off = estimate_for_spec(spec, gradient_checkpointing=False, device="cuda").total_gib
            d.est_gib_on = estimate_for_spec(spec, gradient_checkpointing=True, device="cuda").total_gib
        return d

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "Demand":
        return cls(**json.loads(text))


def gpu_memory_of(accel: Optional[str], overrides: dict[str, float]) -> Optional[float]:
    lower = {k.lower(): v for k, v in overrides.items()}
    if accel:
        if accel.lower() in lower:
            return lower[accel.lower()]
        table = {k.lower(): v for k, v in GPU_MEMORY_GIB.items()}
        if accel.lower() in table:
            return table[accel.lower()]
    return lower.get("default")


def fit(demand: Demand, view: ClusterView, gpu_memory: Optional[dict[str, float]] = None,
        held: Optional[tuple[float, float]] = None) -> tuple[bool, bool, str]:
    """(fits now, could ever fit this cluster, why not).

    Workers are placed first-fit on nodes' free CPUs/GPUs (a GPU node only when its GPU memory
    holds the job's estimate and its type matches `resources.accelerator_type`); the driver's CPU
    share goes anywhere. `held` = (CPUs, GPUs) of this queue's active jobs: a job submitted
    moments ago holds resources the cluster's usage report may not show yet, so free is at most
    total - held. When the job fits, its placement is taken off `view`'s free resources, so the
    next job of the same admission pass sees what is left.
    """
    gpu_memory = gpu_memory or {}

    def node_ok(n: Node) -> tuple[bool, str]:
        if not demand.use_gpu:
            return True, ""
        if n.gpu_total < 1:
            return False, ""
        if demand.accelerator_type and (n.accelerator_type or "").lower() != demand.accelerator_type.lower():
            return False, f"accelerator_type {n.accelerator_type or 'unknown'} is not {demand.accelerator_type}"
        mem = gpu_memory_of(n.accelerator_type, gpu_memory)
        if mem is None:
            return False, (f"GPU memory of accelerator_type {n.accelerator_type or '(none)'} is unknown: pass "
                           f"--gpu-memory {n.accelerator_type or 'default'}=GiB")
        need = demand.gpu_need_gib(mem)
        if need > mem:
            return False, f"needs {need:.1f} GiB per GPU, {n.accelerator_type} has {mem:g} GiB"
        return True, ""

    def place(free: dict[str, tuple[float, float]]) -> Optional[dict[str, tuple[float, float]]]:
        free = dict(free)
        for _ in range(demand.num_workers):
            for n in view.nodes:
                ok, _ = node_ok(n)
                c, g = free[n.node_id]
                if ok and c >= demand.cpus_per_worker - 1e-9 and (not demand.use_gpu or g >= 1 - 1e-9):
                    free[n.node_id] = (c - demand.cpus_per_worker, g - (1 if demand.use_gpu else 0))
                    break
            else:
                return None
        rest = demand.driver_cpus
        for n in view.nodes:             # the driver's share, wherever CPUs are left
            c, g = free[n.node_id]
            take = min(max(c, 0.0), rest)
            free[n.node_id] = (c - take, g)
            rest -= take
        return free if rest <= 1e-9 else None

    ever = place({n.node_id: (n.cpu_total, n.gpu_total) for n in view.nodes}) is not None
    if not ever:
        reasons = sorted({r for n in view.nodes for ok, r in [node_ok(n)] if not ok and r})
        if demand.use_gpu and view.gpu_total < 1:
            why = "the cluster has no GPUs"
        elif reasons and demand.use_gpu:
            why = "; ".join(reasons)
        else:
            why = f"needs {demand.cpus:g} CPUs{f' and {demand.gpus:g} GPUs' if demand.gpus else ''} in total"
        return False, False, f"can never fit this cluster ({view.cpu_total:g} CPUs, {view.gpu_total:g} GPUs): {why}"
    placed = place({n.node_id: (n.cpu_free, n.gpu_free) for n in view.nodes})
    now = placed is not None
    cpu_free, gpu_free = view.cpu_free, view.gpu_free
    if held is not None:
        cpu_free = min(cpu_free, view.cpu_total - held[0])
        gpu_free = min(gpu_free, view.gpu_total - held[1])
        now = now and demand.cpus <= cpu_free + 1e-9 and demand.gpus <= gpu_free + 1e-9
    if not now:
        what = f"{demand.cpus:g} CPUs" + (f" and {demand.gpus:g} GPUs" if demand.gpus else "")
        have = f"{max(cpu_free, 0):g} CPUs" + (f" and {max(gpu_free, 0):g} GPUs" if demand.gpus else "") + " free"
        return False, True, f"waiting for resources: needs {what}, {have}"
    for n in view.nodes:                 # so that the next job of the same pass sees what is left
        n.cpu_free, n.gpu_free = placed[n.node_id]
    return True, True, ""


# ---- the database ----------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    working_dir TEXT NOT NULL,
    spec_path TEXT NOT NULL,              -- relative to working_dir
    overrides TEXT NOT NULL,              -- JSON list, as given to `queue add`
    spec_hash TEXT NOT NULL,              -- of spec file + overrides at `queue add`
    priority INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,   -- attempts submitted (the current one while active)
    submission_id TEXT,                   -- the current / last attempt's
    changes TEXT NOT NULL DEFAULT '[]',   -- JSON list of overrides the driver added (OOM retry)
    change_note TEXT NOT NULL DEFAULT '',
    micro_batch_size INTEGER NOT NULL,
    grad_accum_steps INTEGER NOT NULL,
    demand TEXT NOT NULL,                 -- JSON Demand
    max_retries INTEGER NOT NULL,
    retries INTEGER NOT NULL DEFAULT 0,
    oom_retried INTEGER NOT NULL DEFAULT 0,
    not_before REAL NOT NULL DEFAULT 0,
    status_detail TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    added_at REAL NOT NULL,
    ended_at REAL
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    submission_id TEXT NOT NULL,
    micro_batch_size INTEGER NOT NULL,
    grad_accum_steps INTEGER NOT NULL,
    submitted_at REAL,
    status TEXT NOT NULL DEFAULT 'SUBMITTING',
    message TEXT NOT NULL DEFAULT '',
    ended_at REAL,
    PRIMARY KEY (job_id, attempt)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
"""


class Queue:
    """The SQLite file. Safe to use from several processes (`queue add` while a driver runs)."""

    def __init__(self, path: Optional[os.PathLike] = None):
        self.path = Path(path) if path is not None else default_db()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    @contextlib.contextmanager
    def txn(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def event(self, c: sqlite3.Connection, job_id: int, kind: str, detail: str = "") -> None:
        c.execute("INSERT INTO events (job_id, at, kind, detail) VALUES (?, ?, ?, ?)",
                  (job_id, time.time(), kind, detail))

    # -- reading --
    def jobs(self, states: Optional[tuple[str, ...]] = None) -> list[sqlite3.Row]:
        if states:
            q = f"SELECT * FROM jobs WHERE state IN ({','.join('?' * len(states))}) ORDER BY id"
            return list(self.db.execute(q, states))
        return list(self.db.execute("SELECT * FROM jobs ORDER BY id"))

    def job(self, job_id: int) -> sqlite3.Row:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise SpecError(f"no job #{job_id} in the queue {self.path}")
        return row

    def attempts(self, job_id: int) -> list[sqlite3.Row]:
        return list(self.db.execute("SELECT * FROM attempts WHERE job_id = ? ORDER BY attempt", (job_id,)))

    def events(self, job_id: Optional[int] = None) -> list[sqlite3.Row]:
        if job_id is None:
            return list(self.db.execute("SELECT * FROM events ORDER BY id"))
        return list(self.db.execute("SELECT * FROM events WHERE job_id = ? ORDER BY id", (job_id,)))

    # -- adding --
    def add(self, spec_path: str, overrides: list[str], *, priority: int = 0, max_retries: int = 2,
            working_dir: Optional[str] = None) -> tuple[int, bool]:
        """Validate and queue one spec. The same spec (name + hash + working dir) is one job:
        adding it again returns the existing entry. Returns (id, created)."""
        wd = find_project(working_dir)
        spec, rel, _, _ = resolve_spec(spec_path, overrides, wd)
        h = spec.spec_hash()
        demand = Demand.from_spec(spec)
        with self.txn() as c:
            row = c.execute("SELECT id FROM jobs WHERE name = ? AND spec_hash = ? AND working_dir = ?",
                            (spec.name, h, str(wd))).fetchone()
            if row is not None:
                return int(row["id"]), False
            cur = c.execute(
                "INSERT INTO jobs (name, working_dir, spec_path, overrides, spec_hash, priority, state, "
                "micro_batch_size, grad_accum_steps, demand, max_retries, added_at) "
                "VALUES (?, ?, ?, ?, ?, ?, 'QUEUED', ?, ?, ?, ?, ?)",
                (spec.name, str(wd), rel, json.dumps(list(overrides)), h, priority, spec.batch.micro_batch_size,
                 spec.grad_accum_steps, demand.to_json(), max_retries, time.time()))
            self.event(c, cur.lastrowid, "queued", f"priority {priority}, spec {rel}, hash {h}")
            return int(cur.lastrowid), True

    def retry(self, job_id: int) -> str:
        """Queue a job that ended without success again; its next attempt gets the next id."""
        row = self.job(job_id)
        if row["state"] not in ("FAILED", "STOPPED", "CANCELED"):
            raise SpecError(f"job #{job_id} is {row['state']}: only a FAILED, STOPPED or CANCELED job can be retried")
        with self.txn() as c:
            n = c.execute("UPDATE jobs SET state='QUEUED', retries=0, not_before=0, status_detail='', message='', "
                          "ended_at=NULL WHERE id=? AND state=?", (job_id, row["state"])).rowcount
            if n:
                self.event(c, job_id, "requeued", f"by hand after {row['state']}")
        return self.job(job_id)["state"]

    def cancel(self, job_id: int, stop: Optional[Callable[[str], Any]] = None) -> str:
        """QUEUED -> CANCELED; an active job is stopped on the cluster first (`stop(submission_id)`)."""
        row = self.job(job_id)
        if row["state"] in DONE:
            return row["state"]
        if row["state"] in ACTIVE:
            if stop is None:
                raise SpecError(f"job #{job_id} is {row['state']} on the cluster: pass --address to stop it")
            stop(row["submission_id"])
        with self.txn() as c:
            n = c.execute("UPDATE jobs SET state='CANCELED', ended_at=?, message='canceled by hand' "
                          "WHERE id=? AND state=?", (time.time(), job_id, row["state"])).rowcount
            if n:
                if row["state"] in ACTIVE:
                    c.execute("UPDATE attempts SET status='STOPPED', ended_at=? WHERE job_id=? AND attempt=?",
                              (time.time(), job_id, row["attempt"]))
                self.event(c, job_id, "ended", "CANCELED")
        return "CANCELED" if n else self.job(job_id)["state"]


# ---- the driver ------------------------------------------------------------------------------

@dataclass
class DriverConfig:
    max_concurrency: Optional[int] = None
    poll_s: float = 2.0
    backoff_s: float = 30.0
    gpu_memory: dict[str, float] = field(default_factory=dict)
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)


class Driver:
    """One pass (`step`) = reconcile SUBMITTING rows, poll RUNNING ones, admit QUEUED ones."""

    def __init__(self, queue: Queue, backend, config: Optional[DriverConfig] = None):
        self.q = queue
        self.backend = backend
        self.cfg = config or DriverConfig()
        self._lock_file = None

    def log(self, job: sqlite3.Row, msg: str) -> None:
        self.cfg.log(f"{time.strftime('%H:%M:%S')} #{job['id']} {job['name']}: {msg}")

    # -- one driver per file --
    def lock(self) -> None:
        path = self.q.path.with_name(self.q.path.name + ".lock")
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            raise SpecError(f"another `rayft queue run` holds {path} ({f.read().strip() or 'pid unknown'})") from None
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
        for job in self.q.jobs(("SUBMITTING",)):
            info = self.backend.info(job["submission_id"])
            with self.q.txn() as c:
                if info is not None:
                    n = c.execute("UPDATE jobs SET state='RUNNING' WHERE id=? AND state='SUBMITTING' AND "
                                  "submission_id=?", (job["id"], job["submission_id"])).rowcount
                    if n:
                        self.q.event(c, job["id"], "running", f"{job['submission_id']} (found on the cluster "
                                     "after a driver restart)")
                else:  # never reached the cluster: admit it again, with the same id
                    n = c.execute("UPDATE jobs SET state='QUEUED', attempt=attempt-1 WHERE id=? AND "
                                  "state='SUBMITTING' AND submission_id=?",
                                  (job["id"], job["submission_id"])).rowcount
                    if n:
                        c.execute("DELETE FROM attempts WHERE job_id=? AND attempt=?", (job["id"], job["attempt"]))
                        self.q.event(c, job["id"], "requeued", f"{job['submission_id']} never reached the cluster")
            if n:
                self.log(job, f"{job['submission_id']}: {'tracking' if info is not None else 'not on the cluster; requeued'}")

    def poll(self) -> None:
        for job in self.q.jobs(("RUNNING",)):
            info = self.backend.info(job["submission_id"])
            if info is None:
                self.ended(job, "FAILED", "the job disappeared from the cluster (was the cluster restarted?)", "")
                continue
            status = str(info.status.value if hasattr(info.status, "value") else info.status)
            if status in FINAL:
                logs = ""
                if status == "FAILED":
                    try:
                        logs = self.backend.logs(job["submission_id"])[-200_000:]
                    except (SpecError, ClusterError):
                        logs = ""
                self.ended(job, status, info.message or "", logs)
            elif status != job["status_detail"]:
                with self.q.txn() as c:
                    c.execute("UPDATE jobs SET status_detail=? WHERE id=? AND state='RUNNING'", (status, job["id"]))

    def ended(self, job: sqlite3.Row, status: str, message: str, logs: str, from_state: str = "RUNNING") -> None:
        """Record the end of the current attempt exactly once; decide on a retry."""
        now = time.time()
        first = (message or "").strip().splitlines()[-1][:300] if (message or "").strip() else ""
        oom = looks_like_oom(message, logs) if status == "FAILED" else None
        micro, accum = job["micro_batch_size"], job["grad_accum_steps"]
        new_state, note, not_before, changes, detail = status, job["change_note"], 0.0, None, status
        retries, oom_retried, demand = job["retries"], job["oom_retried"], job["demand"]
        if status == "FAILED" and oom:
            if job["oom_retried"]:
                first = f"out of memory again at micro_batch_size={micro} after halving it: {oom}"
            elif micro < 2 or micro % 2:
                first = f"out of memory at micro_batch_size={micro}, which cannot be halved: {oom}"
            else:
                m2, a2 = micro // 2, accum * 2
                changes = json.loads(job["changes"]) + [f"batch.micro_batch_size={m2}", f"batch.grad_accum_steps={a2}"]
                note = (f"out of memory at attempt {job['attempt']}: micro_batch_size {micro} -> {m2}, "
                        f"grad_accum_steps {accum} -> {a2} (global batch unchanged)")
                new_state, oom_retried, micro, accum = "QUEUED", 1, m2, a2
                d = Demand.from_json(job["demand"])
                if d.use_gpu:
                    d = self._demand_for(job, changes) or d
                demand = d.to_json()
                detail = f"FAILED (out of memory) -> retry with {note.split(': ', 1)[1]}"
        elif status == "FAILED" and job["retries"] < job["max_retries"]:
            retries = job["retries"] + 1
            delay = self.cfg.backoff_s * 2 ** (retries - 1)
            new_state, not_before = "QUEUED", now + delay
            detail = f"FAILED -> retry {retries}/{job['max_retries']} in {delay:g} s"
        with self.q.txn() as c:
            n = c.execute(
                "UPDATE jobs SET state=?, message=?, change_note=?, changes=COALESCE(?, changes), "
                "micro_batch_size=?, grad_accum_steps=?, retries=?, oom_retried=?, not_before=?, demand=?, "
                "status_detail=?, ended_at=? WHERE id=? AND state=? AND submission_id=?",
                (new_state, first, note, json.dumps(changes) if changes is not None else None, micro, accum,
                 retries, oom_retried, not_before, demand, status, now if new_state in DONE else None,
                 job["id"], from_state, job["submission_id"])).rowcount
            if not n:
                return
            c.execute("UPDATE attempts SET status=?, message=?, ended_at=? WHERE job_id=? AND attempt=?",
                      (status, first, now, job["id"], job["attempt"]))
            self.q.event(c, job["id"], "attempt_ended", f"{job['submission_id']}: {detail}")
            if new_state in DONE:
                self.q.event(c, job["id"], "ended", new_state)
            elif changes is not None:
                self.q.event(c, job["id"], "oom_retry", note)
            else:
                self.q.event(c, job["id"], "retry", detail)
        self.log(job, f"{job['submission_id']} {detail}" + (f": {first}" if first and new_state in DONE
                                                           and status != "SUCCEEDED" else ""))

    def _demand_for(self, job: sqlite3.Row, changes: list[str]) -> Optional[Demand]:
        try:
            spec, _, _, _ = resolve_spec(job["spec_path"], json.loads(job["overrides"]) + changes,
                                         Path(job["working_dir"]))
            return Demand.from_spec(spec)
        except SpecError:
            return None

    def _fail(self, job: sqlite3.Row, message: str) -> None:
        with self.q.txn() as c:
            n = c.execute("UPDATE jobs SET state='FAILED', message=?, ended_at=? WHERE id=? AND state='QUEUED'",
                          (message[:300], time.time(), job["id"])).rowcount
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
        view = self.backend.cluster_view()
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
            ok, ever, why = fit(demand, view, self.cfg.gpu_memory, held_res)
            if not ever:
                self._reason(job, why)
                continue                  # skip it: it would block the queue forever
            if not ok:
                self._reason(job, why)
                break                     # strict priority: lower ones do not overtake it
            if self.submit(job):
                admitted += 1
                held_res = (held_res[0] + demand.cpus, held_res[1] + demand.gpus)
        return admitted

    def submit(self, job: sqlite3.Row) -> bool:
        overrides = json.loads(job["overrides"])
        changes = json.loads(job["changes"])
        wd = job["working_dir"]
        attempt = job["attempt"] + 1
        try:
            spec, _, _, _ = resolve_spec(job["spec_path"], overrides, Path(wd))
            if spec.spec_hash() != job["spec_hash"]:
                self._fail(job, f"{job['spec_path']} changed since it was queued (spec hash {job['spec_hash']} -> "
                                f"{spec.spec_hash()}); add it again")
                return False
            sub = build_submission(str(Path(wd) / job["spec_path"]), overrides + changes,
                                   address=self.backend.address, working_dir=wd, attempt=attempt,
                                   extra_metadata={"queue_job": job["id"], "queue_spec_hash": job["spec_hash"]})
        except SpecError as e:
            self._fail(job, str(e))
            return False
        with self.q.txn() as c:
            n = c.execute("UPDATE jobs SET state='SUBMITTING', attempt=?, submission_id=?, status_detail='', "
                          "not_before=0 WHERE id=? AND state='QUEUED'", (attempt, sub.submission_id, job["id"])).rowcount
            if not n:
                return False
            c.execute("INSERT OR REPLACE INTO attempts (job_id, attempt, submission_id, micro_batch_size, "
                      "grad_accum_steps, submitted_at) VALUES (?, ?, ?, ?, ?, ?)",
                      (job["id"], attempt, sub.submission_id, sub.spec.batch.micro_batch_size,
                       sub.spec.grad_accum_steps, time.time()))
            self.q.event(c, job["id"], "submitting", sub.submission_id)
        try:
            _, created = self.backend.submit(sub)
        except ClusterError as e:      # the cluster refused this submission: a failed attempt
            if self.backend.info(sub.submission_id) is None:
                self.ended(self.q.job(job["id"]), "FAILED", f"submission refused: {e}", "", from_state="SUBMITTING")
                return False
            created = False
        if os.environ.get("RAYFT_QUEUE_FAULT") == "kill_after_submit":
            os.kill(os.getpid(), signal.SIGKILL)   # test hook: die between "submitted" and "recorded"
        with self.q.txn() as c:
            n = c.execute("UPDATE jobs SET state='RUNNING' WHERE id=? AND state='SUBMITTING' AND submission_id=?",
                          (job["id"], sub.submission_id)).rowcount
            if n:
                self.q.event(c, job["id"], "running", sub.submission_id if created else
                             f"{sub.submission_id} (already on the cluster)")
        if not n and self.q.job(job["id"])["state"] == "CANCELED":
            self.backend.stop(sub.submission_id)      # canceled while it was being submitted
            return False
        self.log(job, f"submitted {sub.submission_id} (attempt {attempt}, micro_batch_size "
                      f"{sub.spec.batch.micro_batch_size} x grad_accum_steps {sub.spec.grad_accum_steps})"
                      + ("" if created else ": already on the cluster, tracking it"))
        return True

    def unschedulable_only(self) -> bool:
        """Nothing active and every queued job can never fit: waiting would be forever."""
        if self.q.jobs(ACTIVE):
            return False
        queued = self.q.jobs(("QUEUED",))
        return bool(queued) and all(j["status_detail"].startswith("can never fit") for j in queued)

    def run(self, *, once: bool = False, forever: bool = False,
            should_stop: Callable[[], bool] = lambda: False) -> int:
        """Drive the queue: one pass (`once`), until every job has ended (default), or `forever`."""
        self.lock()
        first = True
        while True:
            try:
                self.step()
            except (SpecError, ClusterError) as e:
                if first or once:
                    raise          # a wrong address or token: say so and stop
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


def parse_gpu_memory(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep:
            key, val = "default", item
        try:
            gib = float(val)
        except ValueError:
            raise SpecError(f"--gpu-memory {item!r}: expected TYPE=GiB (e.g. H100=80) or GiB") from None
        if gib <= 0 or not math.isfinite(gib):
            raise SpecError(f"--gpu-memory {item!r}: GiB must be positive")
        out[key.strip()] = gib
    return out
