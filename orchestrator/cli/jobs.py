"""`rayft submit | status | logs | stop | list`: one code path for every backend.

`--backend ray` (default) talks to a Ray cluster's Jobs API (`--jobs-api`/`--address
http://HOST:8265`, or $RAY_API_SERVER_ADDRESS); `--backend kuberay` creates KubeRay RayJobs
through the Kubernetes API. `backend_from_args` is the only place that reads `--backend`: the
commands below ask the backend object and print the `JobStatus` it returns.

Output: what a script wants (an id, JSON with `--json`) goes to stdout; messages to stderr.
Exit codes: 0 ok; 1 the job failed (`--wait`) or the cluster refused; 2 a user mistake, an
unreachable cluster or rejected credentials (`orchestrator.cli.main` maps the errors).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from orchestrator.backends.base import SUCCEEDED, Backend, JobStatus, first_line

from .output import fmt_time, print_json, say, table

# ---- backends --------------------------------------------------------------------------------


def _ray_jobs(args) -> Backend[Any]:
    from orchestrator.backends.ray_jobs import RayJobsBackend

    return RayJobsBackend(args.address, timeout_s=getattr(args, "timeout_s", None))


def _kuberay(args) -> Backend[Any]:
    from orchestrator.backends.kuberay import KubeRayBackend

    from .k8s import access_flags

    target = {k: getattr(args, k) for k in ("queue", "image", "overlay") if getattr(args, k, None)}
    target["access"] = access_flags(args)
    return KubeRayBackend(namespace=args.namespace, timeout_s=getattr(args, "timeout_s", None), **target)


BACKENDS: dict[str, Callable[..., Backend[Any]]] = {"ray": _ray_jobs, "kuberay": _kuberay}


def backend_from_args(args) -> Backend[Any]:
    return BACKENDS[args.backend](args)


# ---- the commands ----------------------------------------------------------------------------


def cmd_submit(args) -> int:
    backend = backend_from_args(args)
    sub = backend.prepare(args.spec, args.overrides, working_dir=args.working_dir, attempt=args.attempt)
    for w in sub.warnings:
        say(f"warning: {w}")
    if args.dry_run:
        print_json(sub.describe())
        return 0
    st, created = backend.submit(sub)
    if args.json:
        print_json(
            {
                "submission_id": st.id,
                "created": created,
                "status": st.state,
                "spec_hash": sub.spec_hash,
                "backend": backend.name,
                "where": backend.where,
            }
        )
    else:
        print(st.id)
    flags = f" {backend.cli_flags}" if backend.cli_flags else ""
    if created:
        say(
            f"submitted {st.id} to {backend.where} ({sub.summary()}); follow it with "
            f"`rayft logs {st.id} --follow{flags}`"
        )
    else:
        say(
            f"already submitted: {st.id} is {st.state} on {backend.where}; not started again "
            f"(same name and spec hash {sub.spec_hash})"
        )
    if args.wait:
        final = backend.wait(st.id) if args.quiet else backend.follow(st.id)
        say(f"{st.id}: {final.state}")
        return 0 if final.state == SUCCEEDED else 1
    return 0


def cmd_status(args) -> int:
    st = backend_from_args(args).status(args.id)
    if args.json:
        print_json(st.to_dict())
        return 0
    rows = [
        ("id", st.id),
        ("state", st.state),
        ("message", first_line(st.message, 300)),
        ("name", st.name),
        ("spec hash", st.spec_hash),
        ("started", fmt_time(st.start_time_s) if st.start_time_s else ""),
        ("ended", fmt_time(st.end_time_s) if st.end_time_s else ""),
    ]
    rows += [
        (k.replace("_", " "), v)
        for k, v in st.details.items()
        if v not in (None, "", 0, {}, []) and not isinstance(v, (dict, list))
    ]
    for k, v in rows:
        if v:
            print(f"{k:22} {v}")
    return 0


def cmd_logs(args) -> int:
    backend = backend_from_args(args)
    if args.follow:
        say(f"{args.id}: {backend.follow(args.id).state}")
        return 0
    sys.stdout.write(backend.logs(args.id))
    return 0


def cmd_stop(args) -> int:
    backend = backend_from_args(args)
    if backend.stop(args.id):
        say(f"stop requested for {args.id}")
    else:
        say(f"{args.id} had already ended ({backend.status(args.id).state})")
    return 0


def cmd_list(args) -> int:
    backend = backend_from_args(args)
    rows: list[JobStatus] = backend.list(all_jobs=args.all)
    if args.json:
        print_json([r.to_dict() for r in rows])
        return 0
    table(
        f"jobs on {backend.where}",
        ["id", "state", "name", "started", "ended", "message"],
        [
            [r.id, r.state, r.name, fmt_time(r.start_time_s), fmt_time(r.end_time_s), first_line(r.message, 80)]
            for r in rows
        ],
    )
    return 0


# ---- wiring ----------------------------------------------------------------------------------

JOBS_API_HELP = (
    "the Ray Jobs API (dashboard) URL, e.g. http://127.0.0.1:8265 (default "
    "$RAY_API_SERVER_ADDRESS, then $RAY_ADDRESS, as `ray job submit`). Not the GCS address "
    "HOST:6379 that `rayft run --address` takes"
)


def add_jobs_api_arg(p, help_: str = JOBS_API_HELP) -> None:
    """`--jobs-api URL`, also spelled `--address URL` (the name `ray job submit` uses)."""
    p.add_argument("--jobs-api", "--address", dest="address", metavar="URL", help=help_)


def _add_backend_args(p) -> None:
    add_jobs_api_arg(p, f"--backend ray: {JOBS_API_HELP}")
    p.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        default="ray",
        help="ray: the Ray Jobs API at --jobs-api; kuberay: a RayJob through the Kubernetes API "
        "(~/.kube/config or in-cluster)",
    )
    p.add_argument("--namespace", help="--backend kuberay: namespace (default $RAYFT_K8S_NAMESPACE or rayft)")
    p.add_argument(
        "--timeout-s",
        type=float,
        metavar="SECONDS",
        help="give up on a cluster that does not answer a request within this many seconds "
        "(default $RAYFT_HTTP_TIMEOUT_S, else 30); exit 2",
    )


def register(sub) -> None:
    from .k8s import add_k8s_target_args

    s = sub.add_parser("submit", help="submit a job to a Ray cluster (idempotent: same spec -> same job)")
    s.add_argument("spec")
    s.add_argument("overrides", nargs="*", metavar="section.field=value")
    _add_backend_args(s)
    add_k8s_target_args(s)
    s.add_argument("--wait", action="store_true", help="follow the logs until the job ends; exit 1 unless it succeeded")
    s.add_argument("--quiet", action="store_true", help="with --wait: do not print the logs")
    s.add_argument(
        "--working-dir", help="--backend ray: the project directory to upload (default: the current directory)"
    )
    s.add_argument("--attempt", type=int, default=1, help="start attempt N of the same spec (a new submission id)")
    s.add_argument("--dry-run", action="store_true", help="validate and print what would be submitted")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(fn=cmd_submit)

    for name, fn, help_ in (
        ("status", cmd_status, "a submitted job's status"),
        ("logs", cmd_logs, "a submitted job's driver logs"),
        ("stop", cmd_stop, "stop a submitted job"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("id", help="submission id (the RayJob name with --backend kuberay)")
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
