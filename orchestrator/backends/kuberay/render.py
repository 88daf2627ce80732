"""Render a job spec as a KubeRay RayJob: the one place the RayJob's shape is written.

`render(spec, ...)` returns the objects for one job, in apply order:

1. a ConfigMap ``<job>-spec`` carrying the validated spec (``spec.yaml``), mounted read-only at
   ``/home/ray/rayft-spec`` in every Ray pod, and
2. a RayJob ``<job>`` (KubeRay ``ray.io/v1``) whose entrypoint is
   ``python -m jobs.finetune /home/ray/rayft-spec/spec.yaml run.output_dir=/mnt/rayft/...``
   (or ``rayft tune ...`` for a search), with one worker pod per `resources.gpus_per_worker` Ray
   Train workers (one GPU each: a pod of N GPUs hosts N workers), and
3. a PodDisruptionBudget ``<job>`` (``maxUnavailable: 0``) selecting exactly the RayJob's Ray
   pods (head and workers, by the ``rayft.io/ray-cluster: <job>`` label in their templates, which
   KubeRay copies onto the pods), so a node drain waits for the job instead of evicting a rank
   mid-run. KubeRay names the RayJob's RayCluster ``<job>-<random>``, so KubeRay's own
   ``ray.io/cluster`` label cannot be selected before the job exists.

They are plain dicts, no kustomize needed; `to_yaml` writes them as one multi-document YAML that
`kubectl apply -f -` takes. The committed templates in ``k8s/jobs`` are generated from `render`
(`orchestrator.backends.kuberay.templates`), so the shape exists once. The sizes come from the spec
and from the overlay's *node type* (`node_types`): a spec that asks for more GPUs per worker or more
CPUs per worker than one node of that type has, a per-GPU budget above its GPU memory, or whose
memory plan (`jobs.memory.plan_for_spec` on that GPU) does not fit it, is refused with a
`SpecError` naming both numbers (the node-fit rule, `orchestrator.backends.node_fit`, which queue
admission applies too); so is a job whose GPUs in total (num_workers, times the concurrent
trials of a search) exceed the Kueue quota for RayJobs the node type records (`jobQuotaGpus`).
The RayJob is annotated with the plan's estimate and its
gradient checkpointing: the numbers queue admission and the training loop use.

`render` is built from named pieces, in the order it checks and writes: the job's kind, its worker
pods and the refusals (`job_fit`: `JobKind`, `WorkerPods`, `refuse_*`), the metadata (`_labels`,
`_annotations`, `_Meta`), the entrypoint, the head and worker groups (`_head_group`,
`_worker_groups`, with the ray start params and volumes), the submitter pod, the RayJob and its
PodDisruptionBudget.

Job names are deterministic: ``<spec.name>-<spec hash>``, so submitting the same spec twice finds
the first RayJob instead of starting a second one (`KubeRayBackend.submit` is idempotent).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.errors import SpecError, UserError
from jobs.rollout.vllm_host import ENGINE_RESOURCE, ENGINE_RESOURCE_ENV
from jobs.run.storage import is_uri
from jobs.spec import JobSpec

from .job_fit import (
    EnginePod,
    JobKind,
    WorkerPods,
    cpu_quantity,
    fits_one_pod,
    kind_of,
    refuse_bucket_search,
    refuse_engine_unfit,
    refuse_over_quota,
    refuse_unfit,
    refuse_words,
)
from .manifest_yaml import to_yaml
from .node_types import DEFAULT_OVERLAY, NodeType, load_node_type
from .object_storage import (
    AccessFlags,
    StorageAccess,
    credential_env,
    data_volume,
    identity,
    outputs_annotation,
    storage_access,
)
from .policy import (
    CACHE_ENV,
    CLUSTER_LABEL,
    IMAGE_REF,
    NO_DISRUPT,
    PRIORITY_CLASS,
    QUEUE_LABEL,
    RAY_NODE_LABEL,
    SHELL_SAFE,
    pod_disruption_budget,
    policy_violations,
    pull_policy,
    shm_gib,
)

RAY_VERSION = "2.60.0"
DEFAULT_QUEUE = "rayft"  # the LocalQueue in k8s/base/kueue.yaml
DEFAULT_NAMESPACE = "rayft"  # the namespace the overlays install into
DATA_MOUNT = "/mnt/rayft"  # where every Ray pod mounts the PVC (object storage: a local emptyDir)
SPEC_MOUNT = "/home/ray/rayft-spec"  # where every Ray pod mounts the job's spec ConfigMap
WORKDIR = "/home/ray/rayft"  # the repository inside the rayft image (k8s/image/Dockerfile)
HF_SECRET = "rayft-hf-token"  # Secret holding the hub token (created by hand), key `token`
HF_SECRET_KEY = "token"
MAX_RAYJOB_NAME = 47  # KubeRay: RayJob names are DNS-1035 labels of <= 47 chars
RAY_GROUP, RAY_VERSION_API, RAYJOB_PLURAL = "ray.io", "v1", "rayjobs"
# Past this without reaching Running (nodes scaled up, image pulled, pods ready), KubeRay fails
# the RayJob and deletes its cluster, so a job whose workers cannot be placed does not hold
# Kueue's quota until activeDeadlineSeconds (a day).
PRE_RUNNING_DEADLINE_S = 1800

# The driver and every Ray worker start in a copy of the repository inside the image (uploaded by
# the submitter, which runs the same image), so the examples' relative data paths resolve.
RUNTIME_ENV_YAML = f'working_dir: {WORKDIR}\nexcludes: ["outputs/", ".git/", "*.egg-info/", "__pycache__/"]\n'

ANN_SPEC_HASH = "rayft.io/spec-hash"
ANN_SPEC_SOURCE = "rayft.io/spec-source"
ANN_ESTIMATE = "rayft.io/memory-estimate-gib"  # the plan's estimate, 2 decimals, for people
ANN_ESTIMATE_BYTES = "rayft.io/memory-estimate-bytes"  # ... exactly, for programs
ANN_CHECKPOINTING = "rayft.io/gradient-checkpointing"  # the plan's: off, on, every 2nd layer, ...
ANN_STRATEGY = "rayft.io/strategy"  # the plan's: ddp, fsdp, fsdp-keep (layers kept gathered)
ANN_ESTIMATE_ERROR = "rayft.io/memory-estimate-error"
ANN_NODE_TYPE = "rayft.io/node-type"
ANN_GPU_MEMORY = "rayft.io/gpu-memory-gib"

Obj = dict[str, Any]

if TYPE_CHECKING:
    from jobs.memory import MemoryPlan


# ---- the spec, as Kubernetes jobs read it ----------------------------------------------------


@dataclass
class K8sSpec:
    """A spec loaded for Kubernetes: data paths are not checked here (they resolve inside the
    image / on the PVC), and a search spec keeps its own text for the ConfigMap."""

    spec: JobSpec  # the job (for a search: its base job)
    kind: str  # "finetune" or "tune"
    spec_text: str | None = None  # a search's YAML as written (None: render writes the spec)
    entrypoint_overrides: tuple[str, ...] = ()  # a search's overrides travel on the command line
    concurrent_trials: int = 1  # a search's `search.max_concurrent_trials`


def load_spec_for_k8s(spec_path: str, overrides: Sequence[str], kind: str = "finetune") -> K8sSpec:
    """Load and validate a job spec (or, `kind="tune"`, a search spec) once, for `render`."""
    from jobs.spec import load_spec

    if kind_of(kind).searches:
        from tune.spec import load_search_spec

        search = load_search_spec(spec_path, list(overrides), files=False)
        # render sets run.output_dir on the command line itself (from the spec, overrides applied).
        words = tuple(o for o in overrides if not o.startswith("run.output_dir="))
        return K8sSpec(
            search.job(),
            kind,
            spec_text=Path(spec_path).read_text(),
            entrypoint_overrides=words,
            concurrent_trials=search.search.max_concurrent_trials or 1,
        )
    return K8sSpec(load_spec(spec_path, list(overrides), files=False), kind)


# ---- names -------------------------------------------------------------------------------------


def job_name(spec: JobSpec) -> str:
    """Deterministic RayJob name: <spec.name>-<spec hash>, a DNS-1035 label of <= 47 characters."""
    h = spec.spec_hash(10)
    base = spec.name if spec.name[0].isalpha() else f"job-{spec.name}"
    base = base[: MAX_RAYJOB_NAME - len(h) - 1].rstrip("-")
    return f"{base}-{h}"


def spec_configmap_name(name: str) -> str:
    return f"{name}-spec"


# ---- pieces of pod templates ---------------------------------------------------------------------


def _pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,  # `ray` in the rayproject/ray images
        "runAsGroup": 100,  # `users`
        "fsGroup": 100,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _gib(x: float) -> str:
    """A memory quantity: whole GiB when it is one, else MiB."""
    return f"{int(x)}Gi" if float(x).is_integer() else f"{int(math.ceil(x * 1024))}Mi"


def _env(spec: JobSpec) -> list[Obj]:
    # Model downloads and rayft's cache on the data volume, not the container layer: a large model
    # would fill the node's disk and get the pod evicted; on the volume it is downloaded once.
    env: list[Obj] = [{"name": k, "value": v} for k, v in CACHE_ENV.items()]
    if spec.model.hf_token_env:
        env.append(
            {
                "name": spec.model.hf_token_env,
                "valueFrom": {"secretKeyRef": {"name": HF_SECRET, "key": HF_SECRET_KEY, "optional": True}},
            }
        )
    return env


def _engine_env(engine: EnginePod | None) -> list[Obj]:
    """Tells rank 0 the Ray resource the engine's pod offers (its actor asks for it)."""
    return [] if engine is None else [{"name": ENGINE_RESOURCE_ENV, "value": ENGINE_RESOURCE}]


def _storage(gib: float) -> Obj:
    """ephemeral-storage request == limit: what the pod may write outside its volumes (Ray's
    /tmp/ray: logs, spilled objects); past the limit the kubelet evicts it."""
    return {"ephemeral-storage": _gib(gib)}


def _volumes(cm_name: str, shm_gib: float, cache_gib: float | None) -> list[Obj]:
    """The data volume (the shared claim; with object storage a local emptyDir of `cache_gib`), the
    spec, /dev/shm."""
    return [
        data_volume(None if cache_gib is None else _gib(cache_gib)),
        {"name": "spec", "configMap": {"name": cm_name}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _gib(shm_gib)}},
    ]


def _mounts() -> list[Obj]:
    return [
        {"name": "rayft-data", "mountPath": DATA_MOUNT},
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]


def _shm(memory_gib: float) -> float:
    # Ray's object store lives in /dev/shm: the one rule (policy.shm_gib) for every Ray pod.
    return shm_gib(memory_gib)


# ---- the memory plan -----------------------------------------------------------------------------


def memory_plan_or_why(spec: JobSpec, node: NodeType, use_gpu: bool) -> tuple[MemoryPlan | None, str | None]:
    """(plan, None): `jobs.memory.plan_for_spec` for one worker on this node type's GPU (its CPU
    when the job has no GPU); or (None, why not) when the model's shape cannot be read here (e.g. a
    hub model without network access). A spec mistake is raised."""
    from jobs.memory import plan_for_spec  # here, not at the top: `rayft --help` stays light

    device = "cuda" if use_gpu else "cpu"
    try:
        return plan_for_spec(spec, device=device, gpu_memory_gib=node.gpu_memory_gib or None), None
    except SpecError:
        raise
    except Exception as e:  # e.g. a hub model whose config cannot be read here
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:200]


def _entrypoint(spec: JobSpec, kind: JobKind, where: str, entrypoint_overrides: Sequence[str]) -> str:
    """The RayJob's command. KubeRay pastes the entrypoint into the submitter's bash command line
    and Ray runs it through a shell again: plain words only (no quotes, &&, ;). The working
    directory comes from the runtime env instead of a `cd`."""
    out_dir = spec.run.output_dir
    if not out_dir.startswith("/") and not is_uri(spec.output_location):
        out_dir = f"{DATA_MOUNT}/{out_dir}"  # outputs/{name} -> /mnt/rayft/outputs/{name}
    if not SHELL_SAFE.fullmatch(out_dir):
        raise SpecError(
            f"{where}: run.output_dir={spec.run.output_dir!r}: on Kubernetes it must be a plain "
            "path or URI (letters, digits, / . _ - : {name})"
        )
    return " ".join([*kind.command, f"{SPEC_MOUNT}/spec.yaml", f"run.output_dir={out_dir}", *entrypoint_overrides])


# ---- metadata --------------------------------------------------------------------------------------


def _labels(spec: JobSpec, kind: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/part-of": "rayft",
        "app.kubernetes.io/managed-by": "rayft",
        "rayft.io/job": spec.name,
        "rayft.io/kind": kind,
        ANN_SPEC_HASH: spec.spec_hash(10),
    }


def _annotations(
    spec: JobSpec,
    node: NodeType,
    pods: WorkerPods,
    plan: MemoryPlan | None,
    plan_error: str | None,
    spec_path: str | None,
) -> dict[str, str]:
    """The spec hash, the node type, and the plan's numbers that queue admission and the training
    loop use (estimate, checkpointing, strategy), or why there is no plan."""
    ann = {
        ANN_SPEC_HASH: spec.spec_hash(10),
        ANN_NODE_TYPE: f"{node.overlay}/{node.name}",
        ANN_ESTIMATE: "unknown" if plan is None else f"{plan.total_gib:.2f}",
    }
    if plan is not None:
        ann[ANN_ESTIMATE_BYTES] = str(int(plan.estimate.total_bytes))
        ann[ANN_CHECKPOINTING] = plan.checkpointing
        ann[ANN_STRATEGY] = plan.choice
    if plan_error:
        ann[ANN_ESTIMATE_ERROR] = plan_error
    if pods.gpus:
        ann[ANN_GPU_MEMORY] = f"{node.gpu_memory_gib:g}"
    if spec_path:
        ann[ANN_SPEC_SOURCE] = str(spec_path)
    return ann


@dataclass(frozen=True)
class _Meta:
    """The labels and annotations every object of the job carries, and its namespace."""

    labels: dict[str, str]
    annotations: dict[str, str]
    namespace: str | None

    def of(self, obj_name: str, extra_labels: dict | None = None) -> Obj:
        m: Obj = {
            "name": obj_name,
            "labels": {**self.labels, **(extra_labels or {})},
            "annotations": dict(self.annotations),
        }
        if self.namespace:
            m["namespace"] = self.namespace
        return m


# ---- the Ray pods ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Container:
    """What every Ray pod of the job shares: image, pull policy, env, the spec ConfigMap it mounts,
    and its own labels (KubeRay keeps a template's labels on the pods it creates, adding its ray.io/*
    ones, so the PodDisruptionBudget and the NetworkPolicy select them by these)."""

    image: str
    pull: str
    env: list[Obj]
    cm_name: str
    pod_labels: dict[str, str]
    storage: StorageAccess

    def pod_metadata(self) -> Obj:
        return {"labels": dict(self.pod_labels), "annotations": dict(NO_DISRUPT)}

    def cache_gib(self, gib: float) -> float | None:
        """The local emptyDir's size with object storage (`gib`); None: the shared claim."""
        return gib if self.storage.on_object_storage else None

    def pod_spec_head(self) -> Obj:
        """What every Ray pod spec starts with: priority, identity, no API token, restricted."""
        return {
            "priorityClassName": PRIORITY_CLASS,
            **identity(self.storage),
            "automountServiceAccountToken": False,
            "securityContext": _pod_security(),
        }


def _head_group(node: NodeType, c: _Container) -> Obj:
    """The head pod: no CPUs for Ray tasks (`num-cpus: 0`), so workers land on worker pods only."""
    head_mem = node.head_memory_gib
    cache = c.cache_gib(node.head_cache_gib)
    sized = {
        "cpu": cpu_quantity(node.head_cpu),
        "memory": _gib(head_mem),
        **_storage(node.head_ephemeral_gib + (cache or 0)),
    }
    return {
        "serviceType": "ClusterIP",
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {
            "metadata": c.pod_metadata(),
            "spec": {
                **c.pod_spec_head(),
                "containers": [
                    {
                        "name": "ray-head",
                        "image": c.image,
                        "imagePullPolicy": c.pull,
                        "ports": [
                            {"containerPort": 6379, "name": "gcs-server"},
                            {"containerPort": 8265, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                        ],
                        "env": c.env,
                        "resources": {"requests": dict(sized), "limits": dict(sized)},
                        "securityContext": _container_security(),
                        "volumeMounts": _mounts(),
                    }
                ],
                "volumes": _volumes(c.cm_name, _shm(head_mem), cache),
            },
        },
    }


def _worker_pod_spec(node: NodeType, c: _Container, pods: WorkerPods) -> Obj:
    """A worker pod: the node type's worker memory and ephemeral storage are per GPU worker, so a
    pod of N GPUs gets N times both (and /dev/shm follows its memory)."""
    worker_mem = node.worker_memory_gib * pods.per_pod
    cache = c.cache_gib(node.worker_cache_gib * pods.per_pod)
    worker_res: Obj = {
        "cpu": cpu_quantity(pods.cpus),
        "memory": _gib(worker_mem),
        **_storage(node.worker_ephemeral_gib * pods.per_pod + (cache or 0)),
    }
    spec: Obj = c.pod_spec_head()
    if pods.gpus:
        worker_res["nvidia.com/gpu"] = str(pods.gpus)
        # The node type's flavour: its GPU label (GFD, GKE, Karpenter) and its GPU nodes' taints.
        spec["tolerations"] = [dict(t) for t in node.gpu_tolerations]
        if node.gpu_selector():
            spec["nodeSelector"] = node.gpu_selector()
    spec["containers"] = [
        {
            "name": "ray-worker",
            "image": c.image,
            "imagePullPolicy": c.pull,
            "env": c.env,
            "resources": {"requests": dict(worker_res), "limits": dict(worker_res)},
            "securityContext": _container_security(),
            "volumeMounts": _mounts(),
        }
    ]
    spec["volumes"] = _volumes(c.cm_name, _shm(worker_mem), cache)
    return spec


def _worker_groups(node: NodeType, c: _Container, pods: WorkerPods, engine: EnginePod | None) -> list[Obj]:
    return [
        *_engine_group(node, c, pods, engine),
        {
            "groupName": "gpu" if pods.gpus else "cpu",
            "replicas": pods.count,
            "minReplicas": pods.count,
            "maxReplicas": pods.count,
            # KubeRay would derive num-gpus from the limit too; written out, the Ray node's GPU count
            # is visible in the manifest and cannot drift from the pod's.
            "rayStartParams": {"num-gpus": str(pods.gpus)} if pods.gpus else {},
            "template": {"metadata": c.pod_metadata(), "spec": _worker_pod_spec(node, c, pods)},
        },
    ]


def _engine_group(node: NodeType, c: _Container, pods: WorkerPods, engine: EnginePod | None) -> list[Obj]:
    """One pod for a separate vLLM engine: a worker pod of its own size, whose Ray node alone
    offers `ENGINE_RESOURCE` (the engine's actor asks for it: `jobs.rollout.vllm_host`)."""
    if engine is None:
        return []
    shape = replace(pods, per_pod=max(1, engine.gpus), gpus=engine.gpus, cpus=engine.cpus, driver_cpus=0)
    params = {"resources": json.dumps(json.dumps({ENGINE_RESOURCE: 1}))}
    params |= {"num-gpus": str(engine.gpus)} if engine.gpus else {}
    return [
        {
            "groupName": "vllm",
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 1,
            "rayStartParams": params,
            "template": {"metadata": c.pod_metadata(), "spec": _worker_pod_spec(node, c, shape)},
        }
    ]


def _submitter(c: _Container) -> Obj:
    """KubeRay's submitter Job pod: it only submits the job and follows its log."""
    return {
        "metadata": {"labels": {"rayft.io/submitter": "true"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {k: v for k, v in _pod_security().items() if k != "fsGroup"},
            "containers": [
                {
                    "name": "ray-job-submitter",
                    "image": c.image,
                    "imagePullPolicy": c.pull,
                    "resources": {
                        "requests": {"cpu": "200m", "memory": "512Mi", **_storage(1)},
                        "limits": {"cpu": "1", "memory": "1Gi", **_storage(1)},
                    },
                    "securityContext": _container_security(),
                }
            ],
        },
    }


# ---- the objects -----------------------------------------------------------------------------------


def _rayjob(
    name: str,
    kind: JobKind,
    entrypoint: str,
    node: NodeType,
    c: _Container,
    pods: WorkerPods,
    metadata: Obj,
    engine: EnginePod | None = None,
) -> Obj:
    return {
        "apiVersion": f"{RAY_GROUP}/{RAY_VERSION_API}",
        "kind": "RayJob",
        "metadata": metadata,
        "spec": {
            "entrypoint": entrypoint,
            "jobId": name,  # the Ray submission id: deterministic
            "submissionMode": "K8sJobMode",
            **({"entrypointNumCpus": pods.driver_cpus} if pods.driver_cpus else {}),
            "shutdownAfterJobFinishes": True,  # Kueue needs it; frees the GPUs
            # 0: the cluster goes when the job ends, the moment Kueue hands the quota back (Kueue
            # counts a Complete/Failed RayJob as finished). Outputs and metrics.jsonl are on the
            # data volume; the submitter Job (driver log) stays until the RayJob is deleted.
            "ttlSecondsAfterFinished": 0,
            "activeDeadlineSeconds": kind.active_deadline_s,
            "preRunningDeadlineSeconds": PRE_RUNNING_DEADLINE_S,
            "backoffLimit": kind.backoff_limit,
            "submitterConfig": {"backoffLimit": 2},
            "runtimeEnvYAML": RUNTIME_ENV_YAML,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": False,
                "headGroupSpec": _head_group(node, c),
                "workerGroupSpecs": _worker_groups(node, c, pods, engine),
            },
            "submitterPodTemplate": _submitter(c),
        },
    }


def render(
    spec: JobSpec,
    *,
    queue: str | None = None,
    image: str | None = None,
    overlay: str | Path = DEFAULT_OVERLAY,
    spec_path: str | None = None,
    kind: str = "finetune",
    spec_text: str | None = None,
    namespace: str | None = None,
    entrypoint_overrides: Sequence[str] = (),
    concurrent_trials: int = 1,
    access: AccessFlags | None = None,
) -> list[Obj]:
    """[ConfigMap, RayJob, PodDisruptionBudget] for one job spec; raises SpecError when it cannot
    fit the node type.

    queue:     Kueue LocalQueue for the `kueue.x-k8s.io/queue-name` label (default `rayft`).
    image:     container image (default: the overlay node type's `image`); it must contain rayft
               at /home/ray/rayft (k8s/image/Dockerfile).
    overlay:   overlay name under k8s/overlays/ (or a folder) whose node type sizes the pods.
    spec_path: where the spec came from; recorded in an annotation only.
    kind:      `finetune` (python -m jobs.finetune) or `tune` (rayft tune: a search spec).
    spec_text: the YAML the ConfigMap carries (default: the validated spec, defaults filled in;
               a search spec passes its own text, `search` section included).
    entrypoint_overrides: `section.field=value` words appended to the entrypoint (plain words only).
    concurrent_trials: for a search, trials at once: the cluster gets that many times the job's workers.
    access:    with run.output_dir on s3:// or gs://: the Secret holding the S3 keys and the
               ServiceAccount carrying a workload identity, by name, and the S3 region and endpoint
               (`object_storage`); there the pods get a local emptyDir instead of the shared claim.
    """
    job_kind = kind_of(kind)
    where = spec_path or spec.name
    node = load_node_type(overlay)
    storage = storage_access(spec.output_location, where, access)
    refuse_bucket_search(spec, where, job_kind, storage)
    one_pod = storage.on_object_storage and fits_one_pod(spec, node)  # else spread: each node stages its own
    pods = WorkerPods.of(spec, job_kind, concurrent_trials, one_pod=one_pod)
    plan, plan_error = memory_plan_or_why(spec, node, bool(pods.gpus))  # the plan is per GPU
    refuse_unfit(spec, node, where, pods, plan)
    refuse_words(where, entrypoint_overrides)
    engine = EnginePod.of(spec)
    refuse_engine_unfit(spec, node, where, engine)
    refuse_over_quota(spec, node, where, pods, job_kind, engine)

    name = job_name(spec)
    image = image or node.image
    if not IMAGE_REF.fullmatch(image):
        raise UserError(f"--image {image}: not an image reference (REPO[:TAG] or REPO@sha256:DIGEST)")
    meta = _Meta(_labels(spec, kind), _annotations(spec, node, pods, plan, plan_error, spec_path), namespace)
    configmap: Obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta.of(spec_configmap_name(name)),
        "data": {"spec.yaml": spec_text if spec_text is not None else spec.to_yaml()},
    }
    entrypoint = _entrypoint(spec, job_kind, where, entrypoint_overrides)
    c = _Container(
        image,
        pull_policy(image),
        _env(spec) + credential_env(storage) + _engine_env(engine),
        spec_configmap_name(name),
        {RAY_NODE_LABEL: "true", CLUSTER_LABEL: name},
        storage,
    )
    rayjob_meta = meta.of(name, {QUEUE_LABEL: queue or DEFAULT_QUEUE})
    rayjob_meta["annotations"].update(outputs_annotation(storage))  # the policy: no claim, by intent
    rayjob = _rayjob(name, job_kind, entrypoint, node, c, pods, rayjob_meta, engine)
    pdb = pod_disruption_budget(name, {RAY_NODE_LABEL: "true", CLUSTER_LABEL: name})
    pdb["metadata"] = {**meta.of(name), **{k: v for k, v in pdb["metadata"].items() if k != "name"}}
    objs = [configmap, rayjob, pdb]
    bad = policy_violations(objs)
    if bad:
        # What the user passes reaches the manifests outside the spec too (--image, --queue, the
        # overlay's node type, the spec's path): refused as input, one line, nothing rendered.
        raise SpecError(
            f"{where}: the rendered manifests would break rayft's policy: " + "; ".join(bad).replace("\n", " ")
        )
    return objs


def render_rayjob(spec: JobSpec, **kw: Any) -> Obj:
    """Only the RayJob of `render` (the ConfigMap it mounts is `render(...)[0]`)."""
    return render(spec, **kw)[1]


def render_yaml(spec: JobSpec, **kw: Any) -> str:
    """What `rayft k8s render` prints."""
    objs = render(spec, **kw)
    rj = objs[1]
    ann = rj["metadata"]["annotations"]
    head = (
        f"rayft k8s render: job {spec.name} as RayJob {rj['metadata']['name']} "
        f"(node type {ann[ANN_NODE_TYPE]}, memory estimate {ann[ANN_ESTIMATE]} GiB"
        + (f" of {ann[ANN_GPU_MEMORY]} GiB per GPU" if ANN_GPU_MEMORY in ann else "")
        + (f", strategy {ann[ANN_STRATEGY]}" if ANN_STRATEGY in ann else "")
        + (f", gradient checkpointing {ann[ANN_CHECKPOINTING]}" if ANN_CHECKPOINTING in ann else "")
        + ")\n"
        "apply with: kubectl apply -n rayft -f -"
    )
    return to_yaml(objs, header=head)
