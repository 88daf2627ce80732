"""The KubeRay backend: one RayJob per job, through the Kubernetes API (`kubernetes` client).

`submit` creates the spec ConfigMap and the RayJob `render` made; `status` / `logs` / `stop` /
`list` read and delete them. RayJob names are deterministic (`render.job_name`, and `-a<N>` for
attempt N > 1: `attempt_name`), so submitting the same spec (and attempt) twice finds the first
RayJob -- which is what lets the queue's driver, killed after creating one, find it on restart.
Every failure is one line: `JobNotFound` for a RayJob that is not there, `ClusterAuthError` for
401/403, `ClusterUnreachable` for no configuration or no answer, `KubeRayError` (a `ClusterError`)
for any other refusal. Every API call carries
`_request_timeout` (`ray_jobs.http_timeout_s`: `--timeout-s`, else $RAYFT_HTTP_TIMEOUT_S, else
30 s, per connect and per read); an API server that does not answer is `ClusterUnreachable`
naming its address.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from jobs.errors import ClusterAuthError, ClusterError, ClusterUnreachable, JobNotFound, UserError
from jobs.spec import JobSpec

from ..base import (
    FAILED,
    FINAL,
    PENDING,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    JobStatus,
    first_line,
    sorted_by_start,
    wait_for_end,
    write_new_text,
)
from ..base import job_state as ray_job_state
from ..ray_jobs import http_timeout_s
from .node_types import DEFAULT_OVERLAY, NodeType
from .object_storage import AccessFlags
from .render import (
    ANN_CHECKPOINTING,
    ANN_ESTIMATE,
    ANN_NODE_TYPE,
    ANN_SPEC_HASH,
    DEFAULT_NAMESPACE,
    MAX_RAYJOB_NAME,
    RAY_GROUP,
    RAY_VERSION_API,
    RAYJOB_PLURAL,
    Obj,
    load_spec_for_k8s,
    render,
    spec_configmap_name,
)

MANAGED_BY = "app.kubernetes.io/managed-by=rayft"
ANN_ATTEMPT = "rayft.io/attempt"
ANN_MICRO_BATCH = "rayft.io/micro-batch-size"
ANN_GRAD_ACCUM = "rayft.io/grad-accum-steps"
ANN_EXTRA = "rayft.io/"  # + key, for `prepare(extra_metadata=...)` (the queue's job id)


def attempt_name(name: str, attempt: int) -> str:
    """The RayJob name of attempt N of the job `render.job_name` calls `name` (`<job>-<hash>`):
    `name` itself for the first, `<job>-<hash>-a<N>` after, the job part shortened so the whole
    stays a DNS-1035 label of <= 47 characters (KubeRay's limit). Deterministic, like Ray's
    submission ids (`ray_jobs.submission_id`): a retry is a new RayJob, a repeated create of the
    same attempt is the same one."""
    if attempt <= 1:
        return name
    base, _, h = name.rpartition("-")
    suffix = f"-{h}-a{attempt}"
    return base[: MAX_RAYJOB_NAME - len(suffix)].rstrip("-") + suffix


def _renamed(objs: list[Obj], old: str, new: str) -> list[Obj]:
    """`render`'s objects for RayJob `old` as those of RayJob `new`: every string that is the
    RayJob's name (its metadata, `spec.jobId` -- the Ray submission id --, labels and selectors
    that name it) or its ConfigMap's name (the volumes that mount it) is replaced, nothing else."""
    swap = {old: new, spec_configmap_name(old): spec_configmap_name(new)}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return swap.get(node, node) if isinstance(node, str) else node

    return [walk(o) for o in objs]


class KubeRayError(ClusterError):
    """The Kubernetes API refused or failed a well-formed request (one line)."""


def job_state(obj: Obj) -> str:
    """A RayJob's state in rayft's vocabulary (`base.STATES`).

    KubeRay reports two fields: `jobDeploymentStatus` (the RayJob: New, Initializing, Running,
    Complete, Failed, Suspended, ...) and `jobStatus` (the Ray job inside, normalised by
    `base.job_state`). A suspended RayJob waits for Kueue: QUEUED.
    """
    st = obj.get("status") or {}
    ds = st.get("jobDeploymentStatus") or ""
    js = ray_job_state(st["jobStatus"]) if st.get("jobStatus") else ""
    if ds == "Complete":
        return js if js in FINAL else SUCCEEDED
    if ds in ("Failed", "ValidationFailed"):
        return FAILED
    if ds in ("Suspended", "Suspending") or ((obj.get("spec") or {}).get("suspend") and ds in ("", "New")):
        return QUEUED
    if ds in ("Running", "Retrying"):
        return js if js in (PENDING, *FINAL) else RUNNING
    return PENDING  # New, Initializing, Waiting, and whatever a newer KubeRay adds


def _epoch_s(stamp: str | None) -> float | None:
    """An RFC 3339 time of the Kubernetes API ("2026-01-02T03:04:05Z") as seconds since the epoch."""
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def to_status(obj: Obj, namespace: str) -> JobStatus:
    st = obj.get("status") or {}
    meta = obj.get("metadata") or {}
    ann = meta.get("annotations") or {}
    state = job_state(obj)
    message = st.get("message") or st.get("reason") or ""
    if state == QUEUED and not message:
        message = "suspended: waiting for Kueue to admit it (quota)"
    return JobStatus(
        id=meta["name"],
        state=state,
        message=message,
        name=meta["name"],
        spec_hash=ann.get(ANN_SPEC_HASH, ""),
        start_time_s=_epoch_s(st.get("startTime")),
        end_time_s=_epoch_s(st.get("endTime")),
        backend="kuberay",
        details={
            "namespace": namespace,
            "job": (meta.get("labels") or {}).get("rayft.io/job", ""),
            "deployment_status": st.get("jobDeploymentStatus") or "",
            "job_status": st.get("jobStatus") or "",
            "ray_cluster": st.get("rayClusterName") or "",
            "dashboard_url": st.get("dashboardURL") or "",
            "failed": st.get("failed") or 0,
            "memory_estimate_gib": ann.get(ANN_ESTIMATE, ""),
            "attempt": ann.get(ANN_ATTEMPT, "1"),
            "micro_batch_size": ann.get(ANN_MICRO_BATCH, ""),
            "grad_accum_steps": ann.get(ANN_GRAD_ACCUM, ""),
            "gradient_checkpointing": ann.get(ANN_CHECKPOINTING, ""),
        },
    )


@dataclass
class KubeRaySubmission:
    """The rendered [ConfigMap, RayJob] of one job, ready to create."""

    spec: JobSpec
    objects: list[Obj]
    warnings: list[str] = field(default_factory=list)

    @property
    def rayjob(self) -> Obj:
        return self.objects[1]

    @property
    def submission_id(self) -> str:
        return self.rayjob["metadata"]["name"]

    @property
    def spec_hash(self) -> str:
        return self.rayjob["metadata"]["annotations"][ANN_SPEC_HASH]

    def summary(self) -> str:
        ann = self.rayjob["metadata"]["annotations"]
        return f"node type {ann[ANN_NODE_TYPE]}, memory estimate {ann[ANN_ESTIMATE]} GiB per worker"

    def describe(self) -> dict:
        return {"submission_id": self.submission_id, "objects": self.objects}


class KubeRayBackend:
    """Runs jobs as KubeRay RayJobs through the `kubernetes` client.

    Configuration: an injected `kubernetes.client.ApiClient`, else in-cluster config (inside a
    pod), else ~/.kube/config (`context` picks one). Namespace: the argument, else
    $RAYFT_K8S_NAMESPACE, else `rayft` (where the overlays install the queue, PVC and policies).
    """

    name = "kuberay"
    # Kueue admits RayJobs by quota: the queue's driver creates them at once (they wait suspended)
    # and checks only that a job fits one node of `node_type` (orchestrator.queue.admission).
    admits_by_quota = True

    def __init__(
        self,
        namespace: str | None = None,
        *,
        api_client: Any = None,
        overlay: str | Path = DEFAULT_OVERLAY,
        queue: str | None = None,
        image: str | None = None,
        context: str | None = None,
        timeout_s: float | None = None,
        access: AccessFlags | None = None,
    ):
        self.timeout_s = http_timeout_s(timeout_s)
        self.namespace = namespace or os.environ.get("RAYFT_K8S_NAMESPACE") or DEFAULT_NAMESPACE
        self.overlay, self.queue, self.image, self.context = overlay, queue, image, context
        self.access = access  # run.output_dir on object storage: credentials by reference (render)
        self._api_client = api_client

    @property
    def where(self) -> str:
        return f"namespace {self.namespace}"

    @property
    def node_type(self) -> NodeType:
        """The overlay's node type: what one node of the cluster the RayJobs land on has."""
        from .node_types import load_node_type

        return load_node_type(self.overlay)

    @property
    def cli_flags(self) -> str:
        return f"--backend kuberay --namespace {self.namespace}"

    # -- plumbing --
    @property
    def api_client(self):
        if self._api_client is None:
            from kubernetes import client, config

            try:
                if os.environ.get("KUBERNETES_SERVICE_HOST"):
                    config.load_incluster_config()
                else:
                    config.load_kube_config(context=self.context)
            except Exception as e:  # ConfigException, missing file, bad context
                raise ClusterUnreachable(f"kuberay: no usable Kubernetes configuration ({first_line(e)})") from None
            cfg = client.Configuration.get_default_copy()
            # One try per request: the timeout is the whole wait, not once per urllib3 retry.
            cfg.retries = False
            self._api_client = client.ApiClient(cfg)
        return self._api_client

    @property
    def _timeout(self) -> tuple[float, float]:
        """`_request_timeout` for every call: (connect, read) -- per socket operation, so a long
        log is not cut off while it arrives."""
        return (self.timeout_s, self.timeout_s)

    @property
    def api_host(self) -> str:
        try:
            return str(self.api_client.configuration.host)
        except Exception:
            return "the Kubernetes API"

    def _core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    def _custom(self):
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client)

    @contextlib.contextmanager
    def _api(self, what: str, missing: str | None = None) -> Iterator[None]:
        """Kubernetes API failures as rayft errors; `missing`: the message for a 404 (JobNotFound)."""
        import logging

        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError, NewConnectionError
        from urllib3.exceptions import TimeoutError as Urllib3Timeout

        # urllib3 logs each retry of an unreachable API server; rayft reports the failure once.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        try:
            yield
        except ApiException as e:
            if e.status == 404 and missing:
                raise JobNotFound(missing) from None
            msg = getattr(e, "reason", "") or ""
            if e.body:
                try:
                    msg = json.loads(e.body).get("message") or msg
                except (ValueError, AttributeError):
                    pass
            text = first_line(f"kuberay: {what}: HTTP {e.status}: {msg}")
            raise (ClusterAuthError if e.status in (401, 403) else KubeRayError)(text) from None
        except HTTPError as e:  # no answer: connection refused, DNS, TLS, a timeout
            reason = getattr(e, "reason", None)
            # (urllib3's NewConnectionError -- refused, no route -- subclasses its timeout class)
            if any(isinstance(x, Urllib3Timeout) and not isinstance(x, NewConnectionError) for x in (e, reason)):
                raise ClusterUnreachable(
                    f"kuberay: {what}: no answer from the Kubernetes API at {self.api_host} within "
                    f"{self.timeout_s:g} s (--timeout-s or $RAYFT_HTTP_TIMEOUT_S sets the limit)"
                ) from None
            why = first_line(reason or e, 200)
            raise ClusterUnreachable(
                f"kuberay: {what}: cannot reach the Kubernetes API at {self.api_host} ({why})"
            ) from None

    def _not_found(self, name: str) -> str:
        return f"kuberay: no RayJob {name} in namespace {self.namespace}"

    def _get_rayjob(self, name: str) -> Obj:
        with self._api(f"get RayJob {name}", missing=self._not_found(name)):
            return self._custom().get_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION_API, self.namespace, RAYJOB_PLURAL, name, _request_timeout=self._timeout
            )

    # -- the interface --
    def render(self, spec: JobSpec, **kw: Any) -> list[Obj]:
        kw.setdefault("queue", self.queue)
        kw.setdefault("image", self.image)
        kw.setdefault("overlay", self.overlay)
        kw.setdefault("access", self.access)
        return render(spec, namespace=self.namespace, **kw)

    def prepare_spec(self, spec: JobSpec, *, spec_path: str | None = None) -> KubeRaySubmission:
        """Render a typed spec (refused when it does not fit the overlay's node type)."""
        return KubeRaySubmission(spec, self.render(spec, spec_path=spec_path))

    def prepare(
        self,
        spec_path: str,
        overrides: list[str],
        *,
        working_dir: str | None = None,
        attempt: int = 1,
        extra_metadata: dict | None = None,
    ) -> KubeRaySubmission:
        """Render the spec as attempt `attempt` (a RayJob of its own, `attempt_name`), annotated
        with the attempt, the batch split it runs (what an out-of-memory retry changes) and
        `extra_metadata` as `rayft.io/<key>` (the queue's job id)."""
        if attempt < 1:
            raise UserError(f"--attempt {attempt}: attempts count from 1")
        spec = load_spec_for_k8s(spec_path, overrides).spec
        sub = self.prepare_spec(spec, spec_path=spec_path)
        if attempt > 1:
            sub.objects = _renamed(sub.objects, sub.submission_id, attempt_name(sub.submission_id, attempt))
        extra = {
            ANN_ATTEMPT: str(attempt),
            ANN_MICRO_BATCH: str(spec.batch.micro_batch_size),
            ANN_GRAD_ACCUM: str(spec.grad_accum_steps),
            **{f"{ANN_EXTRA}{k.replace('_', '-')}": str(v) for k, v in (extra_metadata or {}).items()},
        }
        for obj in sub.objects:
            obj["metadata"]["annotations"].update(extra)
        if working_dir:
            sub.warnings.append(
                f"--working-dir {working_dir} is not uploaded: a RayJob runs the project inside "
                "its image (k8s/image/Dockerfile)"
            )
        return sub

    def _create_or_match(
        self,
        kind: str,
        name: str,
        create: Callable[[], Any],
        read: Callable[[], Any],
        differs: Callable[[Any], str | None],
    ) -> tuple[Any, Any]:
        """Create one object: (what the create returned, None). When one of that name exists
        already (409 AlreadyExists: the same job's, from a submission killed half-way or repeated),
        `read` it and return (None, it) if it is the same -- `differs(it)` says nothing -- and refuse
        (KubeRayError, `differs`' one line) if it is another's. Nothing is ever overwritten."""
        from kubernetes.client.exceptions import ApiException

        with self._api(f"create {kind} {name}"):
            try:
                return create(), None
            except ApiException as e:
                if e.status != 409:
                    raise
            have = read()
        why = differs(have)
        if why:
            raise KubeRayError(why)
        return None, have

    def _as_dict(self, obj: Any) -> Obj:
        """A `kubernetes` model (or a plain dict) as the API's JSON, camelCase keys, no nulls."""
        return obj if isinstance(obj, dict) else self.api_client.sanitize_for_serialization(obj)

    def submit(self, sub: KubeRaySubmission) -> tuple[JobStatus, bool]:
        """Create the spec ConfigMap, the PodDisruptionBudget and the RayJob, in that order: (its
        status, created).

        Idempotent: each object that exists already is compared with the one rendered
        (`_create_or_match`): the ConfigMap and the RayJob by spec hash, the budget by its spec.
        The same is the same job (already submitted), and is not created again; another is an
        error. The RayJob comes last, so that whatever exists of it was created whole: its pods are
        never without their spec or their disruption budget, also when a submitter was killed
        half-way and runs again.
        """
        from kubernetes import client

        cm, rj, *rest = sub.objects
        name, h, cm_name = sub.submission_id, sub.spec_hash, cm["metadata"]["name"]
        core, custom = self._core(), self._custom()
        unknown = [o.get("kind") for o in rest if o.get("kind") != "PodDisruptionBudget"]
        if unknown:
            raise KubeRayError(f"kuberay: render made a {unknown[0]}, which the backend does not know how to create")
        policy = client.PolicyV1Api(self.api_client) if rest else None
        t = self._timeout

        def hash_of(obj: Any) -> str | None:
            return ((self._as_dict(obj).get("metadata") or {}).get("annotations") or {}).get(ANN_SPEC_HASH)

        body = client.V1ConfigMap.from_dict(cm) if hasattr(client.V1ConfigMap, "from_dict") else cm
        self._create_or_match(
            "ConfigMap",
            cm_name,
            lambda: core.create_namespaced_config_map(self.namespace, body, _request_timeout=t),
            lambda: core.read_namespaced_config_map(cm_name, self.namespace, _request_timeout=t),
            lambda have: (
                None
                if hash_of(have) == h
                else f"kuberay: ConfigMap {cm_name} exists with spec hash {hash_of(have)}, not {h}"
            ),
        )
        for pdb in rest:
            self._create_budget(policy, pdb)
        created, have = self._create_or_match(
            "RayJob",
            name,
            lambda: custom.create_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION_API, self.namespace, RAYJOB_PLURAL, rj, _request_timeout=t
            ),
            lambda: self._get_rayjob(name),
            lambda have: (
                None
                if hash_of(have) == h
                else f"kuberay: RayJob {name} exists with spec hash {hash_of(have)}, not {h}; "
                f"`rayft stop {name} {self.cli_flags}` first"
            ),
        )
        if created is None:  # AlreadyExists: the same job
            return to_status(have, self.namespace), False
        self._owned_by(created, name, cm_name, [p["metadata"]["name"] for p in rest])
        return to_status(created if isinstance(created, dict) else rj, self.namespace), True

    def _create_budget(self, policy: Any, pdb: Obj) -> None:
        name, t = pdb["metadata"]["name"], self._timeout
        self._create_or_match(
            "PodDisruptionBudget",
            name,
            lambda: policy.create_namespaced_pod_disruption_budget(self.namespace, pdb, _request_timeout=t),
            lambda: policy.read_namespaced_pod_disruption_budget(name, self.namespace, _request_timeout=t),
            lambda have: self._budget_differs(pdb, have),
        )

    def _budget_differs(self, want: Obj, have: Any) -> str | None:
        """Why an existing PodDisruptionBudget is not the one rendered: every field of the rendered
        spec must be there with the same value (fields the API server adds are not compared)."""
        want_spec = want.get("spec") or {}
        have_spec = self._as_dict(have).get("spec") or {}
        got = {k: have_spec.get(k) for k in want_spec}
        if got == want_spec:
            return None
        return (
            f"kuberay: PodDisruptionBudget {want['metadata']['name']} exists with spec "
            f"{json.dumps(got, sort_keys=True)}, not {json.dumps(want_spec, sort_keys=True)}"
        )

    def _owned_by(self, created: Any, name: str, cm_name: str, pdb_names: list[str]) -> None:
        """Let the ConfigMap and the budgets go with the RayJob (garbage collection by owner
        reference). Best effort: `stop` deletes them explicitly anyway."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        uid = (created.get("metadata") or {}).get("uid") if isinstance(created, dict) else None
        if not uid:
            return
        owner = [
            {
                "apiVersion": f"{RAY_GROUP}/{RAY_VERSION_API}",
                "kind": "RayJob",
                "name": name,
                "uid": uid,
                "blockOwnerDeletion": False,
            }
        ]
        patch = [{"op": "add", "path": "/metadata/ownerReferences", "value": owner}]
        try:
            self._core().patch_namespaced_config_map(cm_name, self.namespace, patch, _request_timeout=self._timeout)
            for pdb_name in pdb_names:
                client.PolicyV1Api(self.api_client).patch_namespaced_pod_disruption_budget(
                    pdb_name, self.namespace, patch, _request_timeout=self._timeout
                )
        except ApiException:
            pass

    def submit_spec(self, spec: JobSpec, **render_kw: Any) -> str:
        """Render and create a typed spec; returns the RayJob name."""
        sub = KubeRaySubmission(spec, self.render(spec, **render_kw))
        return self.submit(sub)[0].id

    def info(self, name: str) -> JobStatus | None:
        try:
            return self.status(name)
        except JobNotFound:
            return None

    def status(self, name: str) -> JobStatus:
        return to_status(self._get_rayjob(name), self.namespace)

    def logs(self, name: str, tail_lines: int | None = None) -> str:
        """Best effort: the submitter pod's log (it follows the driver), else the head pod's."""
        from kubernetes.client.exceptions import ApiException

        obj = self._get_rayjob(name)
        core = self._core()

        def newest(selector: str):
            with self._api(f"list pods ({selector})"):
                pods = (
                    core.list_namespaced_pod(
                        self.namespace, label_selector=selector, _request_timeout=self._timeout
                    ).items
                    or []
                )
            pods = [p for p in pods if p.metadata is not None]
            return max(pods, key=lambda p: str(p.metadata.creation_timestamp or "")) if pods else None

        pod = newest(f"batch.kubernetes.io/job-name={name}") or newest(f"job-name={name}")
        container = None
        if pod is None:
            cluster = (obj.get("status") or {}).get("rayClusterName")
            if cluster:
                pod = newest(f"ray.io/cluster={cluster},ray.io/node-type=head")
                container = "ray-head"
        if pod is None:
            return f"(no submitter or head pod for RayJob {name} yet: {job_state(obj)})\n"
        kw: dict = {"tail_lines": tail_lines} if tail_lines else {}
        if container:
            kw["container"] = container
        with self._api(f"log of pod {pod.metadata.name}"):
            try:
                return (
                    core.read_namespaced_pod_log(
                        pod.metadata.name, self.namespace, **kw, _request_timeout=self._timeout
                    )
                    or ""
                )
            except ApiException as e:
                if e.status not in (400, 404):  # 400: container not started yet; 404: pod gone
                    raise
        return f"(no log from pod {pod.metadata.name} yet: {job_state(obj)})\n"

    def follow(self, name: str, out: TextIO | None = None, poll_s: float = 2.0) -> JobStatus:
        """Write the log as it grows (polled: the API has no log stream across pods) until the end."""
        seen = ""
        while True:
            seen = write_new_text(out or sys.stdout, seen, self.logs(name))
            st = self.status(name)
            if st.ended:
                return st
            time.sleep(poll_s)

    def wait(self, name: str, timeout_s: float | None = None, poll_s: float = 2.0) -> JobStatus:
        return wait_for_end(lambda: self.status(name), timeout_s, poll_s)

    def stop(self, name: str) -> bool:
        """Delete the RayJob (KubeRay deletes its cluster and submitter), its spec ConfigMap and
        its PodDisruptionBudget. Always True: deleting is the stop, whether the job still ran or not."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        opts = client.V1DeleteOptions(propagation_policy="Background")
        with self._api(f"delete RayJob {name}", missing=self._not_found(name)):
            self._custom().delete_namespaced_custom_object(
                RAY_GROUP,
                RAY_VERSION_API,
                self.namespace,
                RAYJOB_PLURAL,
                name,
                body=opts,
                _request_timeout=self._timeout,
            )
        cm_name = spec_configmap_name(name)
        with self._api(f"delete ConfigMap {cm_name}"):
            try:
                self._core().delete_namespaced_config_map(cm_name, self.namespace, _request_timeout=self._timeout)
            except ApiException as e:
                if e.status != 404:
                    raise
        with self._api(f"delete PodDisruptionBudget {name}"):  # render names it after the RayJob
            try:
                client.PolicyV1Api(self.api_client).delete_namespaced_pod_disruption_budget(
                    name, self.namespace, _request_timeout=self._timeout
                )
            except ApiException as e:
                if e.status != 404:  # none: a job rendered before budgets existed
                    raise
        return True

    def list(self, all_jobs: bool = False) -> list[JobStatus]:
        """rayft's RayJobs in the namespace (`all_jobs`: every RayJob there), oldest first."""
        with self._api("list RayJobs"):
            got = self._custom().list_namespaced_custom_object(
                RAY_GROUP,
                RAY_VERSION_API,
                self.namespace,
                RAYJOB_PLURAL,
                **({} if all_jobs else {"label_selector": MANAGED_BY}),
                _request_timeout=self._timeout,
            )
        return sorted_by_start(to_status(o, self.namespace) for o in got.get("items") or [])
