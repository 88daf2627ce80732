"""`rayft submit | status | logs | stop | list` and `rayft queue add | run | status | cancel`.

Backends: `--backend ray` (default) talks to a Ray cluster's Jobs API (`--address
http://HOST:8265`, or $RAY_API_SERVER_ADDRESS); `--backend kuberay` creates KubeRay RayJobs through
the Kubernetes API (orchestrator.k8s, imported only when chosen).

Output: what a script wants (a submission id, JSON with `--json`) goes to stdout; messages to
stderr. Exit codes: 0 ok, 1 the job failed or the cluster refused, 2 a user mistake (bad spec,
override, token, address), each a single line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable


def _err(msg: str) -> None:
    print(f"rayft: {msg}", file=sys.stderr, flush=True)


def _cluster_errors(fn: Callable[[Any], int]) -> Callable[[Any], int]:
    """ClusterError (the cluster refused a well-formed request): one line, exit 1."""

    def wrapped(args) -> int:
        from .submit import ClusterError

        try:
            return fn(args)
        except ClusterError as e:
            _err(f"error: {e}")
            return 1

    wrapped.__name__ = fn.__name__
    return wrapped


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    # Not a terminal: as wide as the content (no folding), so the output greps.
    Console(width=None if sys.stdout.isatty() else 1000).print(t)


# ---- backends --------------------------------------------------------------------------------

class _KubeRay:
    """Adapts orchestrator.k8s.KubeRayBackend to the commands below."""

    name = "kuberay"

    def __init__(self, args):
        from .k8s import KubeRayBackend

        kw = {k: getattr(args, k) for k in ("queue", "image", "overlay") if getattr(args, k, None)}
        self.b = KubeRayBackend(namespace=getattr(args, "namespace", None), **kw)

    def submit(self, args) -> tuple[str, dict]:
        try:
            from .k8s_cli import load_for_k8s

            spec, _ = load_for_k8s(args.spec, args.overrides, "finetune")
        except ImportError:
            from jobs.spec import load_spec

            spec = load_spec(args.spec, args.overrides, files=False)
        name = self.b.submit(spec, spec_path=args.spec)
        return name, self.b.status(name)

    def status(self, name: str) -> dict:
        return self.b.status(name)

    def logs(self, name: str) -> str:
        return self.b.logs(name)

    def follow(self, name: str, out=None) -> str:
        out = out or sys.stdout
        seen = ""
        while True:
            text = self.b.logs(name)
            out.write(text[len(seen):] if text.startswith(seen) else text)
            out.flush()
            seen = text
            state = self.b.status(name)["state"]
            if state in ("SUCCEEDED", "FAILED", "STOPPED"):
                return state
            time.sleep(2)

    def stop(self, name: str) -> bool:
        return self.b.stop(name)

    def list(self, all_jobs: bool = False) -> list[dict]:
        return self.b.list()


def _backend(args):
    if getattr(args, "backend", "ray") == "kuberay":
        return _KubeRay(args)
    from .submit import RayJobsBackend

    return RayJobsBackend(args.address)


# ---- submit / status / logs / stop / list ----------------------------------------------------

@_cluster_errors
def cmd_submit(args) -> int:
    if args.backend == "kuberay":
        b = _KubeRay(args)
        name, st = b.submit(args)
        _out(args, {"submission_id": name, "backend": "kuberay", **st},
             lambda: print(name))
        _err(f"submitted RayJob {name} ({st.get('state', '')}); `rayft logs {name} --backend kuberay --follow`")
        if args.wait:
            state = b.follow(name)
            _err(f"{name}: {state}")
            return 0 if state == "SUCCEEDED" else 1
        return 0

    from .submit import RayJobsBackend, build_submission, describe

    backend = RayJobsBackend(args.address) if not args.dry_run else None
    sub = build_submission(args.spec, args.overrides, address=backend.address if backend else args.address,
                           working_dir=args.working_dir, attempt=args.attempt)
    for w in sub.warnings:
        _err(f"warning: {w}")
    if args.dry_run:
        print(describe(sub))
        return 0
    sid, created = backend.submit(sub)
    info = backend.status(sid)
    _out(args, {"submission_id": sid, "created": created, "status": info["status"],
                "spec_hash": sub.spec_hash, "address": backend.address}, lambda: print(sid))
    a = f" --address {backend.address}"
    if created:
        _err(f"submitted {sid} to {backend.address} ({sub.upload.files} files, "
             f"{sub.upload.size_bytes / 2**20:.2f} MiB); follow it with `rayft logs {sid} --follow{a}`")
    else:
        _err(f"already submitted: {sid} is {info['status']} on {backend.address}; not started again "
             f"(same name and spec hash {sub.spec_hash})")
    if args.wait:
        state = backend.follow(sid) if not args.quiet else backend.wait(sid)
        _err(f"{sid}: {state}")
        return 0 if state == "SUCCEEDED" else 1
    return 0


def _out(args, obj: dict, plain: Callable[[], None]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, indent=2, default=str))
    else:
        plain()


@_cluster_errors
def cmd_status(args) -> int:
    from .submit import fmt_time

    row = _backend(args).status(args.id)
    if args.json:
        print(json.dumps(row, indent=2, default=str))
        return 0
    if args.backend == "kuberay":
        for k, v in row.items():
            print(f"{k:22} {v}")
        return 0
    batch = (f"micro_batch_size {row['micro_batch_size']} x grad_accum_steps {row['grad_accum_steps']}"
             if row["micro_batch_size"] else "")
    for k, v in [("submission id", row["submission_id"]), ("status", row["status"]),
                 ("message", row["message"]), ("name", row["name"]), ("spec hash", row["spec_hash"]),
                 ("batch", batch), ("started", fmt_time(row["start_time"])), ("ended", fmt_time(row["end_time"])),
                 ("entrypoint", row["entrypoint"])]:
        if v:
            print(f"{k:14} {v}")
    return 0


@_cluster_errors
def cmd_logs(args) -> int:
    b = _backend(args)
    if args.follow:
        state = b.follow(args.id)
        _err(f"{args.id}: {state}")
        return 0
    sys.stdout.write(b.logs(args.id))
    return 0


@_cluster_errors
def cmd_stop(args) -> int:
    b = _backend(args)
    if b.stop(args.id):
        _err(f"stop requested for {args.id}")
    else:
        st = b.status(args.id)
        _err(f"{args.id} had already ended ({st.get('status') or st.get('state')})")
    return 0


@_cluster_errors
def cmd_list(args) -> int:
    from .submit import fmt_time

    rows = _backend(args).list(all_jobs=args.all)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if args.backend == "kuberay":
        _table("RayJobs", ["name", "job", "state"], [[r["name"], r.get("job", ""), r["state"]] for r in rows])
        return 0
    _table(f"jobs on {args.address or 'the cluster'}", ["submission id", "status", "name", "attempt", "started",
                                                      "ended", "message"],
           [[r["submission_id"], r["status"], r["name"], r["attempt"], fmt_time(r["start_time"]),
             fmt_time(r["end_time"]), (r["message"] or "")[:80]] for r in rows])
    return 0


# ---- queue -----------------------------------------------------------------------------------

def _queue(args):
    from .queue import Queue

    return Queue(args.db)


def cmd_queue_add(args) -> int:
    from jobs.spec import SpecError

    # `section.field=value` words may sit among the specs; they apply to every spec.
    specs = [s for s in args.specs if "=" not in s]
    overrides = list(args.overrides or []) + [s for s in args.specs if "=" in s]
    if not specs:
        raise SpecError("queue add: name at least one spec file")
    q = _queue(args)
    ids = []
    for spec in specs:
        job_id, created = q.add(spec, overrides, priority=args.priority, max_retries=args.max_retries,
                                working_dir=args.working_dir)
        row = q.job(job_id)
        ids.append(job_id)
        if created:
            _err(f"queued #{job_id} {row['name']} (spec hash {row['spec_hash']}, priority {row['priority']}) in {q.path}")
        else:
            hint = (f"; `rayft queue retry {job_id}` runs it again"
                    if row["state"] in ("FAILED", "STOPPED", "CANCELED") else "")
            _err(f"already queued: #{job_id} {row['name']} is {row['state']} (same spec hash {row['spec_hash']}){hint}")
    for i in ids:
        print(i)
    return 0


@_cluster_errors
def cmd_queue_run(args) -> int:
    from .queue import Driver, DriverConfig, parse_gpu_memory
    from .submit import RayJobsBackend

    if args.max_concurrency is not None and args.max_concurrency < 1:
        from jobs.spec import SpecError

        raise SpecError("--max-concurrency must be at least 1")
    cfg = DriverConfig(max_concurrency=args.max_concurrency, poll_s=args.poll, backoff_s=args.backoff,
                       gpu_memory=parse_gpu_memory(args.gpu_memory))
    driver = Driver(_queue(args), RayJobsBackend(args.address), cfg)
    return driver.run(once=args.once, forever=args.forever)


def cmd_queue_status(args) -> int:
    q = _queue(args)
    rows = q.jobs()
    if args.json:
        out = []
        for r in rows:
            d = dict(r)
            d["overrides"], d["changes"] = json.loads(d["overrides"]), json.loads(d["changes"])
            d["demand"] = json.loads(d["demand"])
            d["attempts"] = [dict(a) for a in q.attempts(r["id"])]
            d["events"] = [dict(e) for e in q.events(r["id"])]
            out.append(d)
        print(json.dumps(out, indent=2))
        return 0
    _table(f"rayft queue {q.path}",
           ["#", "name", "prio", "state", "attempt", "submission id", "micro x accum", "change", "detail / message"],
           [[r["id"], r["name"], r["priority"], r["state"], r["attempt"], r["submission_id"] or "-",
             f"{r['micro_batch_size']} x {r['grad_accum_steps']}", r["change_note"] or "-",
             (r["message"] if r["state"] in ("FAILED", "STOPPED", "CANCELED") and r["message"]
              else r["status_detail"]) or "-"] for r in rows])
    return 0


@_cluster_errors
def cmd_queue_cancel(args) -> int:
    q = _queue(args)
    stop = None
    if args.address or q.job(args.id)["state"] in ("SUBMITTING", "RUNNING"):
        from .submit import RayJobsBackend

        b = RayJobsBackend(args.address)
        stop = lambda sid: b.info(sid) is not None and b.stop(sid)  # noqa: E731
    state = q.cancel(args.id, stop)
    _err(f"#{args.id}: {state}")
    return 0


def cmd_queue_retry(args) -> int:
    _err(f"#{args.id}: {_queue(args).retry(args.id)}")
    return 0


# ---- wiring ----------------------------------------------------------------------------------

def _add_backend_args(p, *, address_required: bool = False) -> None:
    p.add_argument("--address", help="Ray Jobs API, e.g. http://127.0.0.1:8265 (default $RAY_API_SERVER_ADDRESS)")
    p.add_argument("--backend", choices=("ray", "kuberay"), default="ray",
                   help="ray: the Ray Jobs API at --address; kuberay: a RayJob through the Kubernetes API")
    p.add_argument("--namespace", help="kuberay: namespace (default $RAYFT_K8S_NAMESPACE or rayft)")


def _add_k8s_args(p) -> None:
    try:
        from .k8s_cli import add_k8s_target_args

        add_k8s_target_args(p)
    except ImportError:
        p.add_argument("--queue", help="kuberay: Kueue LocalQueue")
        p.add_argument("--image", help="kuberay: container image")
        p.add_argument("--overlay", default="gpu", help="kuberay: k8s/overlays/NAME")


def _add_db(p) -> None:
    p.add_argument("--db", help="queue database (default $RAYFT_QUEUE_DB or ~/.rayft/queue.db)")


def register(sub) -> None:
    s = sub.add_parser("submit", help="submit a job to a Ray cluster (idempotent: same spec -> same job)")
    s.add_argument("spec")
    s.add_argument("overrides", nargs="*", metavar="section.field=value")
    _add_backend_args(s)
    _add_k8s_args(s)
    s.add_argument("--wait", action="store_true", help="follow the logs until the job ends; exit 1 unless it succeeded")
    s.add_argument("--quiet", action="store_true", help="with --wait: do not print the logs")
    s.add_argument("--working-dir", help="the project directory to upload (default: the current directory)")
    s.add_argument("--attempt", type=int, default=1, help="start attempt N of the same spec (a new submission id)")
    s.add_argument("--dry-run", action="store_true", help="validate and print what would be submitted")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(fn=cmd_submit)

    for name, fn, help_ in (("status", cmd_status, "a submitted job's status"),
                            ("logs", cmd_logs, "a submitted job's driver logs"),
                            ("stop", cmd_stop, "stop a submitted job")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("id", help="submission id (RayJob name with --backend kuberay)")
        _add_backend_args(p)
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
        if name == "status":
            p.add_argument("--json", action="store_true")
        p.set_defaults(fn=fn)

    ls = sub.add_parser("list", help="jobs submitted by rayft on the cluster")
    _add_backend_args(ls)
    ls.add_argument("--all", action="store_true", help="include jobs not submitted by rayft")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)

    q = sub.add_parser("queue", help="a persistent job queue and the driver that admits its jobs")
    qs = q.add_subparsers(dest="queue_cmd", required=True, parser_class=sub._parser_class)
    add = qs.add_parser("add", help="queue job specs (validated now)")
    add.add_argument("specs", nargs="+", metavar="SPEC")
    add.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    add.add_argument("--max-retries", type=int, default=2, help="retries of a failed job, with backoff (default 2)")
    add.add_argument("--working-dir", help="the project directory (default: the current directory)")
    _add_db(add)
    add.set_defaults(fn=cmd_queue_add, overrides=[])

    run = qs.add_parser("run", help="the driver: admit queued jobs when the cluster has room, track them")
    run.add_argument("--address", help="Ray Jobs API, e.g. http://127.0.0.1:8265")
    _add_db(run)
    run.add_argument("--once", action="store_true", help="one pass (reconcile, poll, admit) and exit")
    run.add_argument("--forever", action="store_true", help="keep running when the queue is empty")
    run.add_argument("--max-concurrency", type=int, help="at most N jobs on the cluster at once")
    run.add_argument("--poll", type=float, default=2.0, help="seconds between passes (default 2)")
    run.add_argument("--backoff", type=float, default=30.0, help="first retry delay in seconds, doubling (default 30)")
    run.add_argument("--gpu-memory", action="append", default=[], metavar="TYPE=GiB",
                     help="GPU memory by Ray accelerator_type, overriding the built-in table; "
                          "`default=GiB` for GPUs without a type (repeatable)")
    run.set_defaults(fn=cmd_queue_run)

    st = qs.add_parser("status", help="the queue as a table")
    _add_db(st)
    st.add_argument("--json", action="store_true", help="everything, with attempts and events")
    st.set_defaults(fn=cmd_queue_status)

    retry = qs.add_parser("retry", help="queue a failed, stopped or canceled job again (next attempt)")
    retry.add_argument("id", type=int)
    _add_db(retry)
    retry.set_defaults(fn=cmd_queue_retry)

    cancel = qs.add_parser("cancel", help="cancel a queued job (stopping it if it runs)")
    cancel.add_argument("id", type=int)
    cancel.add_argument("--address", help="Ray Jobs API (needed when the job is running)")
    _add_db(cancel)
    cancel.set_defaults(fn=cmd_queue_cancel)
