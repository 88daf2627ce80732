"""`rayft queue add | run | status | retry | cancel`: a persistent queue and its driver.

The driver submits through the Ray Jobs API (`--jobs-api`/`--address http://HOST:8265`), or with
`--backend kuberay` as one KubeRay RayJob per job through the Kubernetes API (`--namespace`,
`--queue`, `--image`, `--overlay`, as `rayft submit --backend kuberay` takes them; Kueue admits
them by quota). The queue itself is a SQLite file (`--db`, default $RAYFT_QUEUE_DB or
~/.rayft/queue.db).
"""

from __future__ import annotations

import json
from typing import cast

from jobs.errors import UserError

from . import Parser, int_in
from .jobs import BACKENDS, JOBS_API_HELP, add_jobs_api_arg, backend_from_args
from .output import say, table

MAX_PRIORITY = 10**9
MAX_JOB_ID = 2**63 - 1  # SQLite's INTEGER PRIMARY KEY


def _queue(args, readonly: bool = False):
    from orchestrator.queue.store import Queue

    return Queue(args.db, readonly=readonly)


def cmd_queue_add(args) -> int:
    from orchestrator.queue.driver import enqueue

    # `section.field=value` words may sit among the specs; they apply to every spec.
    specs = [s for s in args.specs if "=" not in s]
    overrides = list(args.overrides or []) + [s for s in args.specs if "=" in s]
    if not specs:
        raise UserError("queue add: name at least one spec file")
    if args.max_retries < 0:
        raise UserError(f"--max-retries {args.max_retries}: must be 0 (no retry) or more")
    q = _queue(args)
    ids = []
    for spec in specs:
        job_id, created = enqueue(
            q,
            spec,
            overrides,
            priority=args.priority,
            max_retries=args.max_retries,
            working_dir=args.working_dir,
            backend=args.backend,
        )
        row = q.job(job_id)
        ids.append(job_id)
        if created:
            say(
                f"queued #{job_id} {row['name']} (spec hash {row['spec_hash']}, priority {row['priority']}) in {q.path}"
            )
        else:
            from orchestrator.queue.store import RETRYABLE

            hint = f"; `rayft queue retry {job_id}` runs it again" if row["state"] in RETRYABLE else ""
            say(f"already queued: #{job_id} {row['name']} is {row['state']} (same spec hash {row['spec_hash']}){hint}")
    for i in ids:
        print(i)
    return 0


def cmd_queue_run(args) -> int:
    from orchestrator.backends.base import QuotaBackend
    from orchestrator.queue.admission import parse_gpu_memory
    from orchestrator.queue.driver import Driver, DriverConfig

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UserError("--max-concurrency must be at least 1")
    if not 0 < args.poll < float("inf"):
        raise UserError(f"--poll {args.poll}: must be a positive, finite number of seconds")
    if not 0 <= args.backoff < float("inf"):
        raise UserError(f"--backoff {args.backoff}: must be a finite number of seconds, 0 or more")
    cfg = DriverConfig(
        max_concurrency=args.max_concurrency,
        poll_s=args.poll,
        backoff_s=args.backoff,
        gpu_memory=parse_gpu_memory(args.gpu_memory),
    )
    backend = backend_from_args(args)
    if args.backend == "kuberay":
        _ = cast(QuotaBackend, backend).node_type  # a wrong --overlay: one line now, before the driver starts
    driver = Driver(_queue(args), backend, cfg)
    return driver.run(once=args.once, forever=args.forever)


def cmd_queue_status(args) -> int:
    q = _queue(args, readonly=True)  # reading needs no write access to the file or its directory
    if not q.exists:
        say(f"no queue at {q.path} yet (`rayft queue add` creates it)")
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
    from orchestrator.queue.store import RETRYABLE

    def state(r) -> str:
        # A job on the cluster that the cluster's own queue has not admitted yet (a RayJob Kueue
        # holds suspended) is waiting, not running: said so here; --json keeps the queue's state.
        if r["state"] == "RUNNING" and r["status_detail"].startswith("QUEUED"):
            return "QUEUED (cluster)"
        return r["state"]

    table(
        f"rayft queue {q.path}",
        ["#", "name", "prio", "state", "attempt", "submission id", "micro x accum", "change", "detail / message"],
        [
            [
                r["id"],
                r["name"],
                r["priority"],
                state(r),
                r["attempt"],
                r["submission_id"] or "-",
                f"{r['micro_batch_size']} x {r['grad_accum_steps']}",
                r["change_note"] or "-",
                (r["message"] if r["state"] in RETRYABLE and r["message"] else r["status_detail"]) or "-",
            ]
            for r in rows
        ],
    )
    return 0


def cmd_queue_cancel(args) -> int:
    from orchestrator.queue.store import ACTIVE

    q = _queue(args)
    stop = None
    if args.address or args.backend != "ray" or q.job(args.id)["state"] in ACTIVE:
        b = backend_from_args(args)
        stop = lambda sid: b.info(sid) is not None and b.stop(sid)  # noqa: E731
    say(f"#{args.id}: {q.cancel(args.id, stop)}")
    return 0


def cmd_queue_retry(args) -> int:
    say(f"#{args.id}: {_queue(args).retry(args.id)}")
    return 0


# ---- wiring ----------------------------------------------------------------------------------


def _add_db(p) -> None:
    p.add_argument("--db", help="queue database (default $RAYFT_QUEUE_DB or ~/.rayft/queue.db)")


def _add_backend(p) -> None:
    """`--backend` and the KubeRay target, as `rayft submit` takes them."""
    from .k8s import add_k8s_target_args

    p.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        default="ray",
        help="ray: the Ray Jobs API at --jobs-api, admitted when the cluster has free resources; "
        "kuberay: one RayJob per job through the Kubernetes API (~/.kube/config or in-cluster), "
        "admitted by Kueue's quota",
    )
    p.add_argument("--namespace", help="--backend kuberay: namespace (default $RAYFT_K8S_NAMESPACE or rayft)")
    add_k8s_target_args(p)


def register(sub) -> None:
    q = sub.add_parser("queue", help="a persistent job queue and the driver that admits its jobs")
    qs = q.add_subparsers(dest="queue_cmd", required=True, parser_class=Parser)
    add = qs.add_parser("add", help="queue job specs (validated now)")
    add.add_argument("specs", nargs="+", metavar="SPEC")
    add.add_argument(
        "--priority", type=int_in(-MAX_PRIORITY, MAX_PRIORITY), default=0, help="higher runs first (default 0)"
    )
    add.add_argument("--max-retries", type=int, default=2, help="retries of a failed job, with backoff (default 2)")
    add.add_argument("--working-dir", help="the project directory (default: the current directory)")
    add.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        default="ray",
        help="validate as this backend submits: ray reads the data files here (they are uploaded); "
        "kuberay does not (they resolve inside the image or on the data volume)",
    )
    _add_db(add)
    add.set_defaults(fn=cmd_queue_add, overrides=[])

    run = qs.add_parser("run", help="the driver: admit queued jobs when the cluster has room, track them")
    add_jobs_api_arg(run)
    _add_backend(run)
    _add_db(run)
    run.add_argument("--once", action="store_true", help="one pass (reconcile, poll, admit) and exit")
    run.add_argument("--forever", action="store_true", help="keep running when the queue is empty")
    run.add_argument("--max-concurrency", type=int, help="at most N jobs on the cluster at once")
    run.add_argument("--poll", type=float, default=2.0, help="seconds between passes (default 2)")
    run.add_argument("--backoff", type=float, default=30.0, help="first retry delay in seconds, doubling (default 30)")
    run.add_argument(
        "--gpu-memory",
        action="append",
        default=[],
        metavar="TYPE=GiB",
        help="GPU memory by Ray accelerator_type, overriding the built-in table (kuberay: the node "
        "type's gpuMemoryGiB); `default=GiB` for GPUs without a type (repeatable)",
    )
    run.set_defaults(fn=cmd_queue_run)

    st = qs.add_parser("status", help="the queue as a table")
    _add_db(st)
    st.add_argument("--json", action="store_true", help="everything, with attempts and events")
    st.set_defaults(fn=cmd_queue_status)

    retry = qs.add_parser("retry", help="queue a failed, stopped or canceled job again (next attempt)")
    retry.add_argument("id", type=int_in(1, MAX_JOB_ID))
    _add_db(retry)
    retry.set_defaults(fn=cmd_queue_retry)

    cancel = qs.add_parser("cancel", help="cancel a queued job (stopping it if it runs)")
    cancel.add_argument("id", type=int_in(1, MAX_JOB_ID))
    add_jobs_api_arg(cancel, f"needed when the job runs: {JOBS_API_HELP}")
    _add_backend(cancel)
    _add_db(cancel)
    cancel.set_defaults(fn=cmd_queue_cancel)
