"""The Ray Jobs backend: `rayft submit` (and the queue driver) through `JobSubmissionClient`.

A submission is the same thing as

    ray job submit --address URL --working-dir . -- python -m jobs.finetune SPEC [k=v ...]

plus what `ray job submit` does not do:

* the spec is loaded and validated once (`load_spec` + `preflight`, relative paths resolved in
  the working dir exactly as the job will see them) before anything reaches the cluster;
* the working dir is checked before upload: it must be the rayft project (it holds
  `jobs/finetune.py`), nothing uploaded may point outside it (a symlink, a `../` data path, a
  spec file elsewhere), and what would be uploaded -- honoring `.gitignore`, `.rayignore` and
  rayft's excludes, the way Ray walks it -- must stay under Ray's package size limit;
* the submission id is deterministic, ``<name>-<spec hash>`` (``-a<N>`` for the queue's N-th
  attempt), so submitting the same thing twice finds the first job instead of starting another;
* the metadata carries the spec hash; the entrypoint reserves a little CPU for the driver (Ray
  Train schedules the workers itself);
* auth: token-authenticated clusters work the way `ray.init` finds its token (RAY_AUTH_TOKEN,
  then RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token). The token only ever travels in the HTTP
  Authorization header -- never in the runtime_env, the metadata or the entrypoint.

The address is the Jobs API (the dashboard's HTTP URL, http://HOST:8265), not the GCS address
HOST:6379 that `ray.init` and `rayft run --address` take. Its syntax is checked before anything
else (`resolve_address`); every HTTP request has a timeout (`http_timeout_s`: `--timeout-s`, else
$RAYFT_HTTP_TIMEOUT_S, else 30 s) and a cluster that does not answer within it is one
`ClusterUnreachable` line naming the address.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse

from jobs.errors import (
    ClusterAuthError,
    ClusterError,
    ClusterUnreachable,
    JobNotFound,
    RayftError,
    SpecError,
    UserError,
)
from jobs.run.storage import is_uri
from jobs.spec import JobSpec, apply_overrides, load_spec, validate
from jobs.spec.loading import reward_files

from .base import FINAL, ClusterView, JobStatus, Node, first_line, job_state, sorted_by_start, wait_for_end
from .working_dir import DEFAULT_EXCLUDES, UploadPlan, _cwd, _inside, check_upload, find_project, plan_upload

ENTRYPOINT = ("python", "-m", "jobs.finetune")
# The job driver only starts a TorchTrainer and relays progress; the workers' CPUs/GPUs are
# requested by Ray Train itself. A fraction keeps it off nodes that have no CPU for jobs.
DRIVER_NUM_CPUS = 0.5
META_PREFIX = "rayft."
ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # `ray job submit` reads them in this order
HTTP_TIMEOUT_ENV = "RAYFT_HTTP_TIMEOUT_S"
# Per request, and per socket operation (connect; then each read, so a long upload or log is not
# cut off while bytes flow). A live Jobs API answers in well under a second; 30 s leaves room for
# a busy head node without letting a dead one hang a command.
DEFAULT_HTTP_TIMEOUT_S = 30.0


# ---- auth ------------------------------------------------------------------------------------


def default_token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def token_source() -> str | None:
    """Where Ray's token loader will take the token from, in its order; None when nowhere.

    Ray 2.60 (`ray._raylet.AuthenticationTokenLoader`): RAY_AUTH_TOKEN, else the file named by
    RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token; used only when RAY_AUTH_MODE=token.
    """
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    if default_token_path().is_file():
        return str(default_token_path()).replace(str(Path.home()), "~", 1)
    return None


def configure_auth() -> str | None:
    """Turn on token auth for this client when a token is available and RAY_AUTH_MODE is unset.

    This is what `ray.init` does when it connects to an existing cluster; `JobSubmissionClient`
    alone only sends a token when RAY_AUTH_MODE=token. RAY_AUTH_MODE=disabled is respected.
    Returns a description of the token's source (never the token), or None.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    src = token_source()
    if mode is None and src is not None:
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray caches its config; refresh it if Ray already read it in this process.
            # Config is a Cython class of ray._raylet that Ray's own stub (_raylet.pyi) leaves out.
            from ray._raylet import Config  # type: ignore[attr-defined]

            Config.initialize("")
        except Exception:
            pass
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN_PATH") and not os.environ.get("RAY_AUTH_TOKEN", "").strip():
        p = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        if not p.is_file() or not p.read_text().strip():
            raise ClusterAuthError(f"RAY_AUTH_TOKEN_PATH={p}: no token in that file")
    return src


def auth_hint() -> str:
    return (
        "set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH, or put the cluster's token in ~/.ray/auth_token "
        "(with RAY_AUTH_MODE=token or unset)"
    )


# ---- submissions -----------------------------------------------------------------------------


def submission_id(name: str, spec_hash: str, attempt: int = 1) -> str:
    """Deterministic Ray submission id: the same spec (and attempt) always gets the same id."""
    return f"{name}-{spec_hash}" if attempt <= 1 else f"{name}-{spec_hash}-a{attempt}"


def is_loopback(address: str | None) -> bool:
    if not address:
        return False
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class RaySubmission:
    """Everything `JobSubmissionClient.submit_job` gets, computed and checked locally."""

    spec: JobSpec
    spec_hash: str
    submission_id: str
    entrypoint: str
    runtime_env: dict
    metadata: dict
    entrypoint_num_cpus: float
    overrides: list[str]
    spec_rel: str
    upload: UploadPlan
    warnings: list[str] = field(default_factory=list)

    def submit_kwargs(self) -> dict:
        return dict(
            entrypoint=self.entrypoint,
            submission_id=self.submission_id,
            runtime_env=self.runtime_env,
            metadata=self.metadata,
            entrypoint_num_cpus=self.entrypoint_num_cpus,
            entrypoint_num_gpus=0,
        )

    def summary(self) -> str:
        return f"{self.upload.files} files, {self.upload.size_bytes / 2**20:.2f} MiB"

    def describe(self) -> dict:
        return {
            "submission_id": self.submission_id,
            "entrypoint": self.entrypoint,
            "runtime_env": self.runtime_env,
            "metadata": self.metadata,
            "entrypoint_num_cpus": self.entrypoint_num_cpus,
            "upload_mib": round(self.upload.size_bytes / 2**20, 3),
            "upload_files": self.upload.files,
        }


def resolve_spec(
    spec_path: str, overrides: list[str], working_dir: Path, *, address: str | None = None
) -> tuple[JobSpec, str, list[str], list[str]]:
    """Load and validate the spec, once, as the job will see it; returns (spec, spec path
    relative to the working dir, overrides for the entrypoint, warnings). Relative paths
    resolve in the working dir; `preflight` reads the data files."""
    from jobs.data.remote_data import localize
    from jobs.finetune import preflight

    p = Path(spec_path).resolve()
    if not p.is_file():
        raise SpecError(f"{spec_path}: spec file not found")
    if not _inside(p, working_dir):
        raise SpecError(
            f"{spec_path}: the spec is outside the working dir {working_dir}, so the job could not "
            "read it; move it into the project"
        )
    rel = str(p.relative_to(working_dir))
    overrides = list(overrides)
    warnings: list[str] = []
    with _cwd(working_dir):
        spec = load_spec(rel, overrides)
        preflight(localize(spec))  # data in a bucket: checked from a copy here; the job copies it where it runs
        for key, d in [*spec.data.source_files(), *reward_files(spec)]:  # a reward file: beside the spec
            if not is_uri(d) and not Path(d).is_absolute() and not _inside(Path(d).resolve(), working_dir):
                raise SpecError(
                    f"{spec_path}: {key}: {d} is outside the working dir {working_dir}; it would not be "
                    "uploaded (use a path inside the project or an absolute path on shared storage)"
                )
        if not Path(spec.run.output_dir).is_absolute() and not is_uri(spec.output_location):
            if is_loopback(address):
                # A local cluster: write where `rayft run` would, not into Ray's copy of the project.
                # The override travels on the entrypoint; the typed spec takes it without a re-read.
                out = f"run.output_dir={spec.output_path.resolve()}"
                overrides.append(out)
                spec = validate(apply_overrides(spec.to_dict(), [out]), rel)
            elif address is not None:
                warnings.append(
                    f"run.output_dir={spec.run.output_dir} is relative: the job writes it inside Ray's "
                    "temporary copy of the working dir on the cluster; set an absolute path on shared "
                    "storage to keep the adapter"
                )
    return spec, rel, overrides, warnings


def build_submission(
    spec_path: str,
    overrides: list[str],
    *,
    address: str | None = None,
    working_dir: str | None = None,
    attempt: int = 1,
    extra_metadata: dict | None = None,
    excludes: list[str] | None = None,
    driver_num_cpus: float = DRIVER_NUM_CPUS,
) -> RaySubmission:
    """Validate and prepare one submission; raises a `UserError` (nothing sent) on any mistake."""
    wd = find_project(working_dir)
    spec, rel, overrides, warnings = resolve_spec(spec_path, overrides, wd, address=address)
    excludes = list(DEFAULT_EXCLUDES if excludes is None else excludes)
    plan = plan_upload(wd, excludes)
    check_upload(plan)
    h = spec.spec_hash()
    sid = submission_id(spec.name, h, attempt)
    metadata = {
        f"{META_PREFIX}name": spec.name,
        f"{META_PREFIX}spec_hash": h,
        f"{META_PREFIX}spec": rel,
        f"{META_PREFIX}attempt": str(attempt),
        f"{META_PREFIX}micro_batch_size": str(spec.batch.micro_batch_size),
        f"{META_PREFIX}grad_accum_steps": str(spec.grad_accum_steps),
    }
    metadata.update({f"{META_PREFIX}{k}": str(v) for k, v in (extra_metadata or {}).items()})
    return RaySubmission(
        spec=spec,
        spec_hash=h,
        submission_id=sid,
        entrypoint=shlex.join([*ENTRYPOINT, rel, *overrides]),
        runtime_env={"working_dir": str(wd), "excludes": excludes},
        metadata=metadata,
        entrypoint_num_cpus=driver_num_cpus,
        overrides=overrides,
        spec_rel=rel,
        upload=plan,
        warnings=warnings,
    )


# ---- the client ------------------------------------------------------------------------------


def http_timeout_s(timeout_s: float | None = None, flag: str = "--timeout-s") -> float:
    """The network timeout in seconds: `timeout_s` (the CLI flag), else $RAYFT_HTTP_TIMEOUT_S,
    else `DEFAULT_HTTP_TIMEOUT_S`. Always finite and > 0 (a bad value is a `UserError` naming
    where it came from). Both backends use it: the Jobs API and the Kubernetes API."""
    where = flag
    value: float | str | None = timeout_s  # the flag's number, or the environment's text
    if value is None and os.environ.get(HTTP_TIMEOUT_ENV, "").strip():
        where, value = f"${HTTP_TIMEOUT_ENV}", os.environ[HTTP_TIMEOUT_ENV].strip()
    if value is None:
        return DEFAULT_HTTP_TIMEOUT_S
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}={value!r}: expected a number of seconds, e.g. 30") from None
    if not (0 < seconds < float("inf")):
        raise UserError(f"{where}={value!r}: the timeout must be a positive, finite number of seconds")
    return seconds


def check_address(url: str, where: str = "--address") -> None:
    """Refuse a Jobs API URL that cannot be one -- no http(s) scheme, no host, a port outside
    1..65535, characters requests cannot send -- before anything is contacted (one line)."""
    import requests

    p = urlparse(url)
    if p.scheme not in ("http", "https"):
        raise UserError(
            f"{where} {url}: the Ray Jobs API address is an http:// or https:// URL (e.g. http://127.0.0.1:8265)"
        )
    try:
        port = p.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise UserError(f"{where} {url}: the port must be a number from 1 to 65535")
    if not p.hostname or any(c.isspace() for c in url):
        raise UserError(f"{where} {url}: no valid host name in the address (e.g. http://127.0.0.1:8265)")
    try:
        requests.models.PreparedRequest().prepare_url(url, None)
    except requests.exceptions.RequestException as e:
        raise UserError(f"{where} {url}: not a valid URL ({first_line(e, 160)})") from None


def resolve_address(address: str | None) -> str | None:
    """The Jobs API URL: `address`, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS (as `ray job
    submit` does); "HOST:PORT" gets http://. None when none is given anywhere. The syntax is
    checked here (`check_address`), so a bad address never reaches the HTTP client."""
    where = "--address"
    if not address:
        env = next((k for k in ADDRESS_ENV if os.environ.get(k)), None)
        address, where = (os.environ[env], f"${env}") if env else (None, where)
    if not address:
        return None
    addr = address.strip()
    if "://" not in addr:
        addr = f"http://{addr}"
    addr = addr.rstrip("/")
    check_address(addr, where)
    return addr


def _seconds(ms: int | None) -> float | None:
    return None if not ms else ms / 1000.0  # Ray reports milliseconds since the epoch


def to_status(info) -> JobStatus:
    """A Ray `JobDetails` as a `JobStatus` (rayft's metadata unpacked into it)."""
    md = info.metadata or {}
    return JobStatus(
        id=info.submission_id or info.job_id,
        state=job_state(info.status),
        message=info.message or "",
        name=md.get(f"{META_PREFIX}name", ""),
        spec_hash=md.get(f"{META_PREFIX}spec_hash", ""),
        start_time_s=_seconds(info.start_time),
        end_time_s=_seconds(info.end_time),
        backend="ray",
        details={
            "attempt": md.get(f"{META_PREFIX}attempt", ""),
            "micro_batch_size": md.get(f"{META_PREFIX}micro_batch_size", ""),
            "grad_accum_steps": md.get(f"{META_PREFIX}grad_accum_steps", ""),
            "entrypoint": info.entrypoint,
            "driver_exit_code": getattr(info, "driver_exit_code", None),
            "metadata": dict(md),
            "runtime_env": dict(info.runtime_env or {}),
        },
    )


def is_rayft_job(info) -> bool:
    return bool((info.metadata or {}).get(f"{META_PREFIX}spec_hash"))


class RayJobsBackend:
    """Submit, inspect, stop and list jobs of one Ray cluster through its Jobs API.

    Nothing is contacted (and auth is not configured) until a request is made, so `prepare`
    works without a cluster (`rayft submit --dry-run`).
    """

    name = "ray"

    def __init__(self, address: str | None = None, timeout_s: float | None = None):
        self.address = resolve_address(address)
        self.timeout_s = http_timeout_s(timeout_s)
        self.token_source: str | None = None
        self._client = None

    @property
    def where(self) -> str:
        return self.address or "the Ray cluster"

    @property
    def cli_flags(self) -> str:
        return f"--address {self.address}" if self.address else ""

    # -- errors: one line each, the token never printed --
    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        import requests
        from ray.exceptions import AuthenticationError

        try:
            yield
        except RayftError:
            raise
        except AuthenticationError as e:
            text = str(e)
            if text.startswith("Authentication failed"):  # HTTP 403
                raise ClusterAuthError(
                    f"the Ray cluster at {self.address} rejected the auth token"
                    f"{f' (from {self.token_source})' if self.token_source else ''}: it is not this cluster's "
                    f"token; {auth_hint()}"
                ) from None
            if text.startswith("Authentication required"):  # HTTP 401
                raise ClusterAuthError(
                    f"the Ray cluster at {self.address} requires an auth token and none was sent "
                    f"(RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE', '(unset)')}); {auth_hint()}"
                ) from None
            raise ClusterAuthError(f"auth token: {first_line(text).split('. ')[0]}") from None  # the token loader
        except requests.exceptions.Timeout as e:  # ConnectTimeout included: no answer in time
            raise ClusterUnreachable(
                f"no answer from the Ray Jobs API at {self.address} within {self.timeout_s:g} s "
                f"({type(e).__name__}); is the cluster up and is this its dashboard address? "
                f"(--timeout-s or ${HTTP_TIMEOUT_ENV} sets the limit)"
            ) from None
        except requests.exceptions.InvalidURL as e:  # check_address lets none through; kept as a guard
            raise UserError(f"--address {self.address}: not a valid URL ({first_line(e, 160)})") from None
        except (ConnectionError, requests.exceptions.ConnectionError) as e:
            raise ClusterUnreachable(
                f"cannot reach the Ray Jobs API at {self.address} ({first_line(e, 160)}); "
                "is the cluster up and is this its dashboard address?"
            ) from None
        except requests.exceptions.HTTPError as e:  # raise_for_status inside Ray's client
            code = getattr(e.response, "status_code", None)
            if code in (401, 403):
                raise ClusterAuthError(
                    f"{what}: the server at {self.address} answered HTTP {code} (a proxy's or the cluster's "
                    f"authentication); {auth_hint()}"
                ) from None
            raise ClusterError(
                f"{what}: the server at {self.address} answered HTTP {code}: {first_line(e, 160)}"
            ) from None
        except RuntimeError as e:
            raise ClusterError(f"{what}: {first_line(e)}") from None
        except (ValueError, TypeError, KeyError, requests.exceptions.RequestException) as e:  # not an API answer
            raise ClusterError(
                f"{what}: the server at {self.address} did not answer as a Ray Jobs API does "
                f"({type(e).__name__}: {first_line(e, 160)}); is this the cluster's dashboard address?"
            ) from None

    @property
    def client(self):
        if self._client is None:
            import logging

            if self.address is None:
                raise UserError(
                    "no cluster: pass --address http://HOST:8265 (the Ray dashboard / Jobs API URL), "
                    "or set RAY_API_SERVER_ADDRESS"
                )
            self.token_source = configure_auth()
            # Ray's packaging logs every .gitignore it honors at INFO and its own default excludes
            # at WARNING; rayft reports what it uploads itself. (Set after `import ray`, which
            # configures the "ray" logger.)
            for name in ("ray", "ray.dashboard.modules.dashboard_sdk"):
                logging.getLogger(name).setLevel(logging.ERROR)
            with self._errors(f"connect to {self.address}"):
                self._client = _timed_client_class()(self.address, timeout_s=self.timeout_s)
        return self._client

    def _get(self, endpoint: str) -> Any:
        with self._errors(f"GET {endpoint}"):
            r = self.client._do_request("GET", endpoint)
            if r.status_code != 200:
                raise ClusterError(f"GET {endpoint}: HTTP {r.status_code}: {first_line(r.text, 200)}")
            return r.json()

    # -- jobs --
    def details(self, sid: str):
        """Ray's `JobDetails` of a job, or None when the cluster has no job with that submission id."""
        from ray.job_submission import JobDetails

        with self._errors(f"get job {sid}"):
            r = self.client._do_request("GET", f"/api/jobs/{sid}")
            if r.status_code == 404:
                return None
            if r.status_code != 200:
                raise ClusterError(f"get job {sid}: HTTP {r.status_code}: {first_line(r.text, 200)}")
            return JobDetails(**r.json())

    def require(self, sid: str):
        """Ray's `JobDetails` of a job; `JobNotFound` when there is none."""
        info = self.details(sid)
        if info is None:
            raise JobNotFound(f"no job {sid!r} on the Ray cluster at {self.address} (`rayft list` shows its jobs)")
        return info

    def prepare(
        self,
        spec_path: str,
        overrides: list[str],
        *,
        working_dir: str | None = None,
        attempt: int = 1,
        extra_metadata: dict | None = None,
    ) -> RaySubmission:
        return build_submission(
            spec_path,
            overrides,
            address=self.address,
            working_dir=working_dir,
            attempt=attempt,
            extra_metadata=extra_metadata,
        )

    def submit(self, sub: RaySubmission) -> tuple[JobStatus, bool]:
        """Submit unless a job with that submission id exists: (its status, created)."""
        if self.details(sub.submission_id) is not None:
            return self.status(sub.submission_id), False
        created = True
        with self._errors(f"submit {sub.submission_id}"):
            try:
                self.client.submit_job(**sub.submit_kwargs())
            except RuntimeError as e:
                # Two submitters raced with the same deterministic id: the other one won.
                if "already exists" not in str(e) or self.details(sub.submission_id) is None:
                    raise
                created = False
        return self.status(sub.submission_id), created

    def info(self, sid: str) -> JobStatus | None:
        details = self.details(sid)
        return None if details is None else to_status(details)

    def status(self, sid: str) -> JobStatus:
        return to_status(self.require(sid))

    def logs(self, sid: str) -> str:
        self.require(sid)
        with self._errors(f"logs of {sid}"):
            return self.client.get_job_logs(sid)

    def follow(self, sid: str, out: TextIO | None = None) -> JobStatus:
        """Stream the logs until the job ends; returns its final status."""
        import asyncio

        out = out or sys.stdout
        self.require(sid)

        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(sid):
                out.write(chunk)
                out.flush()

        with self._errors(f"logs of {sid}"):
            asyncio.run(tail())
        # The stream closes as the job ends; its status follows within a few seconds.
        return self.wait(sid, timeout_s=30.0, poll_s=0.5)

    def wait(self, sid: str, timeout_s: float | None = None, poll_s: float = 1.0) -> JobStatus:
        return wait_for_end(lambda: self.status(sid), timeout_s, poll_s)

    def stop(self, sid: str) -> bool:
        """True when a stop was sent; False when the job had already ended."""
        if self.status(sid).state in FINAL:
            return False
        with self._errors(f"stop {sid}"):
            return bool(self.client.stop_job(sid))

    def list(self, all_jobs: bool = False) -> list[JobStatus]:
        with self._errors("list jobs"):
            jobs = self.client.list_jobs()
        return sorted_by_start(to_status(j) for j in jobs if all_jobs or is_rayft_job(j))

    # -- resources, for the queue's admission --
    def cluster_view(self):
        nodes = self._get("/api/v0/nodes?limit=10000&detail=true")
        status = self._get("/api/cluster_status")
        return cluster_view_from_api(nodes, status)


def _timed_client_class():
    """`JobSubmissionClient` with a timeout on every HTTP request it makes (the version check in
    its constructor, submit, status, logs, stop, list, the package upload): Ray's client passes
    none, so a server that accepts and never answers would hang it forever. The timeout is
    per socket operation (requests' semantics), so a large upload is not cut off while it moves.
    The log stream of `follow` (a websocket) stays unbounded -- a job may print nothing for a
    long time -- and starts only after a timed request has found the job."""
    from ray.job_submission import JobSubmissionClient

    class TimedJobSubmissionClient(JobSubmissionClient):
        def __init__(self, address: str, *, timeout_s: float, **kw: Any):
            self._rayft_timeout_s = timeout_s  # set before the constructor's version check
            super().__init__(address, **kw)

        def _do_request(self, method: str, endpoint: str, **kwargs: Any):
            kwargs.setdefault("timeout", self._rayft_timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    return TimedJobSubmissionClient


def cluster_view_from_api(nodes_json: dict, status_json: dict) -> ClusterView:
    """From the dashboard's `/api/v0/nodes` (totals, accelerator types) and `/api/cluster_status`
    (per-node usage, refreshed by the autoscaler monitor every few seconds)."""
    data = (status_json or {}).get("data") or {}
    report = (data.get("clusterStatus") or {}).get("loadMetricsReport") or {}
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
        out.append(
            Node(
                n["node_id"],
                cpu,
                cpu - float((used.get("CPU") or [0])[0]),
                gpu,
                gpu - float((used.get("GPU") or [0])[0]),
                accel,
            )
        )
    return ClusterView(out, usage_known=bool(usage))
