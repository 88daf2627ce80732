"""Kubernetes: render a job spec as a KubeRay RayJob, and a backend that runs it there.

`render(spec, ...)` returns the objects for one job, in apply order:

1. a ConfigMap ``<job>-spec`` carrying the validated spec (``spec.yaml``), mounted read-only at
   ``/home/ray/rayft-spec`` in every Ray pod, and
2. a RayJob ``<job>`` (KubeRay ``ray.io/v1``) whose entrypoint is
   ``python -m jobs.finetune /home/ray/rayft-spec/spec.yaml run.output_dir=/mnt/rayft/...``
   (or ``rayft tune ...`` for a search), with one worker pod per Ray Train worker.

They are plain dicts, no kustomize needed; `to_yaml` writes them as one multi-document YAML that
`kubectl apply -f -` takes. The shape, security settings and labels are those of the templates in
``k8s/jobs``; the sizes come from the spec and from the overlay's *node type*
(``k8s/overlays/<overlay>/node-type/node-type.yaml``, a ConfigMap ``rayft-node-type``): a spec that
asks for more GPUs per worker, a bigger per-GPU memory budget or estimate, or more CPUs per
worker than one node of that type has is refused with a `SpecError` naming both numbers.

Job names are deterministic: ``<spec.name>-<spec hash>``, so submitting the same spec twice finds
the first RayJob instead of starting a second one (`KubeRayBackend.submit` is idempotent).

`policy_violations(objects)` checks any list of manifests against rayft's deployment policy
(restricted securityContext on every pod, no inline secrets, no exposed Ray ports, RayJob limits);
render checks its own output with it, the tests check k8s/ with it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import yaml

from jobs.spec import JobSpec, SpecError

RAY_VERSION = "2.60.0"
DEFAULT_OVERLAY = "gpu"
DEFAULT_QUEUE = "rayft"                  # the LocalQueue in k8s/base/kueue.yaml
DEFAULT_NAMESPACE = "rayft"              # the namespace the overlays install into
PVC_NAME = "rayft-data"                  # k8s/base/pvc.yaml
DATA_MOUNT = "/mnt/rayft"                # where every Ray pod mounts the PVC
SPEC_MOUNT = "/home/ray/rayft-spec"      # where every Ray pod mounts the job's spec ConfigMap
WORKDIR = "/home/ray/rayft"              # the repository inside the rayft image (k8s/image/Dockerfile)
HF_SECRET = "rayft-hf-token"             # Secret holding the hub token (created by hand), key `token`
HF_SECRET_KEY = "token"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MAX_RAYJOB_NAME = 47                     # KubeRay: RayJob names are DNS-1035 labels of <= 47 chars
RAY_GROUP, RAY_VERSION_API, RAYJOB_PLURAL = "ray.io", "v1", "rayjobs"

# The driver and every Ray worker start in a copy of the repository inside the image (uploaded by
# the submitter, which runs the same image), so the examples' relative data paths resolve.
RUNTIME_ENV_YAML = (f"working_dir: {WORKDIR}\n"
                    "excludes: [\"outputs/\", \".git/\", \"*.egg-info/\", \"__pycache__/\"]\n")
SHELL_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./{}-]+")
SHELL_OPERATORS = re.compile(r"&&|\|\||[;|&`<>\n]|\$\(")

ANN_SPEC_HASH = "rayft.io/spec-hash"
ANN_SPEC_SOURCE = "rayft.io/spec-source"
ANN_ESTIMATE = "rayft.io/memory-estimate-gib"
ANN_ESTIMATE_ERROR = "rayft.io/memory-estimate-error"
ANN_NODE_TYPE = "rayft.io/node-type"
ANN_GPU_MEMORY = "rayft.io/gpu-memory-gib"

Obj = dict[str, Any]


# ---- node types --------------------------------------------------------------------------------

def k8s_dir() -> Path:
    """The repository's k8s/ folder (or $RAYFT_K8S_DIR)."""
    env = os.environ.get("RAYFT_K8S_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "k8s"


def overlays() -> list[str]:
    root = k8s_dir() / "overlays"
    return sorted(p.parent.parent.name for p in root.glob("*/node-type/node-type.yaml"))


@dataclass(frozen=True)
class NodeType:
    """One node of the cluster an overlay targets (its `rayft-node-type` ConfigMap)."""

    overlay: str
    name: str
    gpu_product: str
    ray_accelerator_type: str
    gpus_per_node: int
    gpu_memory_gib: float
    cpus_per_node: float
    worker_memory_gib: float
    head_cpu: float
    head_memory_gib: float
    image: str

    @classmethod
    def from_configmap(cls, obj: Obj, overlay: str) -> "NodeType":
        d = obj.get("data") or {}
        where = f"overlay {overlay}: node-type ConfigMap"
        try:
            return cls(
                overlay=overlay,
                name=str(d.get("nodeType") or overlay),
                gpu_product=str(d.get("gpuProduct") or ""),
                ray_accelerator_type=str(d.get("rayAcceleratorType") or ""),
                gpus_per_node=int(d.get("gpusPerNode", 0)),
                gpu_memory_gib=float(d.get("gpuMemoryGiB", 0)),
                cpus_per_node=float(d["cpusPerNode"]),
                worker_memory_gib=float(d["workerMemoryGiB"]),
                head_cpu=float(d["headCpu"]),
                head_memory_gib=float(d["headMemoryGiB"]),
                image=str(d["image"]),
            )
        except KeyError as e:
            raise SpecError(f"{where}: data.{e.args[0]} is missing") from None
        except ValueError as e:
            raise SpecError(f"{where}: {e}") from None


def load_node_type(overlay: Union[str, Path] = DEFAULT_OVERLAY) -> NodeType:
    """The node type of an overlay: a name under k8s/overlays/, or a path to an overlay folder."""
    p = Path(overlay)
    if p.is_dir():
        base = p
    else:
        if "/" in str(overlay) or not re.fullmatch(r"[A-Za-z0-9._-]+", str(overlay)):
            raise SpecError(f"--overlay {overlay}: not an overlay folder")
        base = k8s_dir() / "overlays" / str(overlay)
    for f in (base / "node-type" / "node-type.yaml", base / "node-type.yaml"):
        if f.is_file():
            for doc in yaml.safe_load_all(f.read_text()):
                if isinstance(doc, dict) and doc.get("kind") == "ConfigMap" and \
                        (doc.get("metadata") or {}).get("name") == "rayft-node-type":
                    return NodeType.from_configmap(doc, base.name)
            raise SpecError(f"{f}: no ConfigMap rayft-node-type in it")
    known = ", ".join(overlays()) or "none found"
    raise SpecError(f"--overlay {overlay}: no node type (node-type/node-type.yaml) there; overlays: {known}")


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
        "runAsUser": 1000,       # `ray` in the rayproject/ray images
        "runAsGroup": 100,       # `users`
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


def _cpu(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{int(math.ceil(x * 1000))}m"


def _env(spec: JobSpec) -> list[Obj]:
    if not spec.model.hf_token_env:
        return []
    return [{
        "name": spec.model.hf_token_env,
        "valueFrom": {"secretKeyRef": {"name": HF_SECRET, "key": HF_SECRET_KEY, "optional": True}},
    }]


def _volumes(cm_name: str, shm_gib: float) -> list[Obj]:
    return [
        {"name": "rayft-data", "persistentVolumeClaim": {"claimName": PVC_NAME}},
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
    # Ray's object store defaults to 30% of the pod's memory and lives in /dev/shm.
    return max(0.5, math.ceil(memory_gib * 0.3 * 2) / 2)


# ---- the memory estimate -------------------------------------------------------------------------

def _estimate(spec: JobSpec, device: str) -> tuple[Optional[float], Optional[str]]:
    """(total GiB, None) from jobs.memory, or (None, why not)."""
    try:
        from jobs.memory import estimate_for_spec
    except ImportError as e:
        return None, f"jobs.memory unavailable: {e}"
    try:
        return float(estimate_for_spec(spec, device=device).total_gib), None
    except SpecError:
        raise
    except Exception as e:  # e.g. a hub model whose config cannot be read here
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:200]


# ---- render --------------------------------------------------------------------------------------

def _check_fits(spec: JobSpec, node: NodeType, where: str, worker_cpu: float,
                estimate: Optional[float]) -> None:
    res = spec.resources
    gpus = int(getattr(res, "gpus_per_worker", None) or (1 if res.use_gpu else 0))
    desc = f"overlay {node.overlay}'s node type {node.name}"
    if gpus > node.gpus_per_node:
        raise SpecError(
            f"{where}: resources asks for {gpus} GPU(s) per worker but {desc} has "
            f"{node.gpus_per_node} GPU(s) per node")
    if worker_cpu > node.cpus_per_node:
        raise SpecError(
            f"{where}: resources.cpus_per_worker={res.cpus_per_worker} needs {_cpu(worker_cpu)} CPUs per "
            f"worker pod but {desc} has {_cpu(node.cpus_per_node)} CPUs per node")
    if not gpus:
        return
    if res.accelerator_type:
        want = res.accelerator_type.lower()
        if want not in {node.ray_accelerator_type.lower(), node.gpu_product.lower()}:
            raise SpecError(
                f"{where}: resources.accelerator_type={res.accelerator_type} but {desc} has "
                f"{node.ray_accelerator_type or 'unknown'} GPUs ({node.gpu_product}); pick an overlay for that GPU")
    cap = node.gpu_memory_gib
    if spec.memory.budget_gib is not None and spec.memory.budget_gib > cap:
        raise SpecError(
            f"{where}: memory.budget_gib={spec.memory.budget_gib:g} GiB per GPU exceeds the "
            f"{cap:g} GiB of one {node.gpu_product} GPU ({desc})")
    if estimate is not None and estimate > cap:
        raise SpecError(
            f"{where}: the memory estimate is {estimate:.1f} GiB per GPU, more than the {cap:g} GiB of one "
            f"{node.gpu_product} GPU ({desc}); lower batch.micro_batch_size or data.max_seq_len, "
            f"or turn on memory.gradient_checkpointing")


def render(spec: JobSpec, *, queue: Optional[str] = None, image: Optional[str] = None,
           overlay: Union[str, Path] = DEFAULT_OVERLAY, spec_path: Optional[str] = None,
           kind: str = "finetune", spec_text: Optional[str] = None,
           namespace: Optional[str] = None) -> list[Obj]:
    """[ConfigMap, RayJob] for one job spec; raises SpecError when it cannot fit the node type.

    queue:     Kueue LocalQueue for the `kueue.x-k8s.io/queue-name` label (default `rayft`).
    image:     container image (default: the overlay node type's `image`); it must contain rayft
               at /home/ray/rayft (k8s/image/Dockerfile).
    overlay:   overlay name under k8s/overlays/ (or a folder) whose node type sizes the pods.
    spec_path: where the spec came from; recorded in an annotation only.
    kind:      `finetune` (python -m jobs.finetune) or `tune` (rayft tune: a search spec).
    spec_text: the YAML the ConfigMap carries (default: the validated spec, defaults filled in;
               a search spec passes its own text, `search` section included).
    """
    if kind not in ("finetune", "tune"):
        raise SpecError(f"kind {kind!r}: expected finetune or tune")
    where = spec_path or spec.name
    node = load_node_type(overlay)
    res = spec.resources
    gpus = int(getattr(res, "gpus_per_worker", None) or (1 if res.use_gpu else 0))
    worker_cpu = math.ceil(res.cpus_per_worker) + 1       # + Ray Train's coordinator / trial
    estimate, estimate_error = _estimate(spec, "cuda" if gpus else "cpu")
    _check_fits(spec, node, where, worker_cpu, estimate)

    name = job_name(spec)
    cm_name = spec_configmap_name(name)
    image = image or node.image
    queue = queue or DEFAULT_QUEUE
    h = spec.spec_hash(10)

    labels = {
        "app.kubernetes.io/part-of": "rayft",
        "app.kubernetes.io/managed-by": "rayft",
        "rayft.io/job": spec.name,
        "rayft.io/kind": kind,
        ANN_SPEC_HASH: h,
    }
    annotations = {
        ANN_SPEC_HASH: h,
        ANN_NODE_TYPE: f"{node.overlay}/{node.name}",
        ANN_ESTIMATE: "unknown" if estimate is None else f"{estimate:.2f}",
    }
    if estimate_error:
        annotations[ANN_ESTIMATE_ERROR] = estimate_error
    if gpus:
        annotations[ANN_GPU_MEMORY] = f"{node.gpu_memory_gib:g}"
    if spec_path:
        annotations[ANN_SPEC_SOURCE] = str(spec_path)

    def meta(obj_name: str, extra_labels: Optional[dict] = None) -> Obj:
        m: Obj = {"name": obj_name, "labels": {**labels, **(extra_labels or {})},
                  "annotations": dict(annotations)}
        if namespace:
            m["namespace"] = namespace
        return m

    configmap: Obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(cm_name),
        "data": {"spec.yaml": spec_text if spec_text is not None else spec.to_yaml()},
    }

    out_dir = spec.run.output_dir
    if not out_dir.startswith("/"):
        out_dir = f"{DATA_MOUNT}/{out_dir}"            # outputs/{name} -> /mnt/rayft/outputs/{name}
    if not SHELL_SAFE.fullmatch(out_dir):
        raise SpecError(f"{where}: run.output_dir={spec.run.output_dir!r}: on Kubernetes it must be a plain "
                        "path (letters, digits, / . _ - {name})")
    # KubeRay pastes the entrypoint into the submitter's bash command line and Ray runs it through
    # a shell again: plain words only (no quotes, &&, ;). The working directory comes from the
    # runtime env instead of a `cd`.
    cmd = ["python", "-m", "jobs.finetune"] if kind == "finetune" else ["rayft", "tune"]
    entrypoint = " ".join([*cmd, f"{SPEC_MOUNT}/spec.yaml", f"run.output_dir={out_dir}"])

    env = _env(spec)
    head_mem = node.head_memory_gib
    head = {
        "serviceType": "ClusterIP",
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {
            "metadata": {"labels": {"rayft.io/ray-node": "true"}},
            "spec": {
                "automountServiceAccountToken": False,
                "securityContext": _pod_security(),
                "containers": [{
                    "name": "ray-head",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "ports": [
                        {"containerPort": 6379, "name": "gcs-server"},
                        {"containerPort": 8265, "name": "dashboard"},
                        {"containerPort": 10001, "name": "client"},
                    ],
                    **({"env": env} if env else {}),
                    "resources": {
                        "requests": {"cpu": _cpu(node.head_cpu), "memory": _gib(head_mem)},
                        "limits": {"cpu": _cpu(node.head_cpu), "memory": _gib(head_mem)},
                    },
                    "securityContext": _container_security(),
                    "volumeMounts": _mounts(),
                }],
                "volumes": _volumes(cm_name, _shm(head_mem)),
            },
        },
    }
    worker_mem = node.worker_memory_gib
    worker_res: Obj = {"cpu": _cpu(worker_cpu), "memory": _gib(worker_mem)}
    if gpus:
        worker_res["nvidia.com/gpu"] = str(gpus)
    worker_spec: Obj = {
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
    }
    if gpus:
        worker_spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        if node.gpu_product:
            worker_spec["nodeSelector"] = {"nvidia.com/gpu.product": node.gpu_product}
    worker_spec["containers"] = [{
        "name": "ray-worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        **({"env": env} if env else {}),
        "resources": {"requests": dict(worker_res), "limits": dict(worker_res)},
        "securityContext": _container_security(),
        "volumeMounts": _mounts(),
    }]
    worker_spec["volumes"] = _volumes(cm_name, _shm(worker_mem))
    workers = [{
        "groupName": "gpu" if gpus else "cpu",
        "replicas": res.num_workers,
        "minReplicas": res.num_workers,
        "maxReplicas": res.num_workers,
        "rayStartParams": {},
        "template": {"metadata": {"labels": {"rayft.io/ray-node": "true"}}, "spec": worker_spec},
    }]
    submitter = {
        "metadata": {"labels": {"rayft.io/submitter": "true"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {k: v for k, v in _pod_security().items() if k != "fsGroup"},
            "containers": [{
                "name": "ray-job-submitter",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "resources": {"requests": {"cpu": "200m", "memory": "512Mi"},
                              "limits": {"cpu": "1", "memory": "1Gi"}},
                "securityContext": _container_security(),
            }],
        },
    }
    rayjob: Obj = {
        "apiVersion": f"{RAY_GROUP}/{RAY_VERSION_API}",
        "kind": "RayJob",
        "metadata": meta(name, {QUEUE_LABEL: queue}),
        "spec": {
            "entrypoint": entrypoint,
            "jobId": name,                                  # the Ray submission id: deterministic
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,               # Kueue needs it; frees the GPUs
            "ttlSecondsAfterFinished": 600,
            "activeDeadlineSeconds": 86400 if kind == "finetune" else 172800,
            "backoffLimit": 1 if kind == "finetune" else 0,  # a retry resumes from the checkpoint
            "submitterConfig": {"backoffLimit": 2},
            "runtimeEnvYAML": RUNTIME_ENV_YAML,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": False,
                "headGroupSpec": head,
                "workerGroupSpecs": workers,
            },
            "submitterPodTemplate": submitter,
        },
    }
    objs = [configmap, rayjob]
    bad = policy_violations(objs)
    if bad:  # a bug here, not a user mistake
        raise RuntimeError("rendered RayJob breaks rayft's policy: " + "; ".join(bad))
    return objs


def render_rayjob(spec: JobSpec, **kw: Any) -> Obj:
    """Only the RayJob of `render` (the ConfigMap it mounts is `render(...)[0]`)."""
    return render(spec, **kw)[1]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the spec in the ConfigMap) as literal blocks."""


def _str_representer(dumper: yaml.SafeDumper, s: str):
    if "\n" in s:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", s)


_Dumper.add_representer(str, _str_representer)


def to_yaml(objs: Iterable[Obj], header: Optional[str] = None) -> str:
    """Multi-document YAML, in order (the ConfigMap before the RayJob that mounts it)."""
    docs = [yaml.dump(o, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
            for o in objs]
    text = "---\n".join(docs)
    if header:
        text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + "---\n" + text
    return text


def render_yaml(spec: JobSpec, **kw: Any) -> str:
    """What `rayft k8s render` prints."""
    objs = render(spec, **kw)
    rj = objs[1]
    ann = rj["metadata"]["annotations"]
    head = (f"rayft k8s render: job {spec.name} as RayJob {rj['metadata']['name']} "
            f"(node type {ann[ANN_NODE_TYPE]}, memory estimate {ann[ANN_ESTIMATE]} GiB"
            + (f" of {ann[ANN_GPU_MEMORY]} GiB per GPU" if ANN_GPU_MEMORY in ann else "") + ")\n"
            "apply with: kubectl apply -n rayft -f -")
    return to_yaml(objs, header=head)


# ---- policy --------------------------------------------------------------------------------------

SENSITIVE_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)
TOKEN_SHAPES = re.compile(r"\b(hf_[A-Za-z0-9]{30,}|ghp_[A-Za-z0-9]{36}|AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9]{32,})\b")
RAY_PORTS = {8265, 10001}
RESTRICTED_CAPS_ADD = {"NET_BIND_SERVICE"}


def _oid(o: Obj) -> str:
    return f"{o.get('kind', '?')}/{(o.get('metadata') or {}).get('name', '?')}"


def _ray_cluster_pods(rc_spec: Obj, where: str) -> Iterator[tuple[str, Obj]]:
    head = (rc_spec.get("headGroupSpec") or {}).get("template") or {}
    yield f"{where} head", head.get("spec") or {}
    for g in rc_spec.get("workerGroupSpecs") or []:
        yield f"{where} worker group {g.get('groupName', '?')}", (g.get("template") or {}).get("spec") or {}


def pod_specs(o: Obj) -> Iterator[tuple[str, Obj]]:
    """(description, pod spec) for every pod template an object carries."""
    kind, spec, oid = o.get("kind"), o.get("spec") or {}, _oid(o)
    if kind == "Pod":
        yield oid, spec
    elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController"):
        yield oid, (spec.get("template") or {}).get("spec") or {}
    elif kind == "CronJob":
        yield oid, ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template", {}).get("spec") or {}
    elif kind == "RayCluster":
        yield from _ray_cluster_pods(spec, oid)
    elif kind == "RayJob":
        yield from _ray_cluster_pods(spec.get("rayClusterSpec") or {}, oid)
        if spec.get("submitterPodTemplate"):
            yield f"{oid} submitter", spec["submitterPodTemplate"].get("spec") or {}
    elif kind == "RayService":
        yield from _ray_cluster_pods(spec.get("rayClusterConfig") or {}, oid)


def _restricted(where: str, pod: Obj, extra_containers: Iterable[tuple[str, Obj]] = ()) -> list[str]:
    """Pod Security Standards "restricted" (the parts a manifest can show)."""
    bad = []
    psc = pod.get("securityContext") or {}
    for f in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(f):
            bad.append(f"{where}: {f} must not be true")
    for v in pod.get("volumes") or []:
        if "hostPath" in v:
            bad.append(f"{where}: volume {v.get('name')} is a hostPath")
    if psc.get("runAsUser") == 0:
        bad.append(f"{where}: securityContext.runAsUser must not be 0")
    containers = [(f"container {c.get('name', '?')}", c) for c in pod.get("containers") or []]
    containers += [(f"init container {c.get('name', '?')}", c) for c in pod.get("initContainers") or []]
    containers += [(f"ephemeral container {c.get('name', '?')}", c) for c in pod.get("ephemeralContainers") or []]
    containers += list(extra_containers)
    if not pod.get("containers"):
        bad.append(f"{where}: no containers")
    pod_nonroot = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    for cname, c in containers:
        sc = c.get("securityContext") or {}
        w = f"{where}: {cname}"
        if sc.get("privileged"):
            bad.append(f"{w}: privileged must not be true")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{w}: securityContext.allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{w}: securityContext.capabilities.drop must include ALL")
        extra = set(caps.get("add") or []) - RESTRICTED_CAPS_ADD
        if extra:
            bad.append(f"{w}: securityContext.capabilities.add {sorted(extra)} is not allowed")
        nonroot = sc.get("runAsNonRoot")
        if nonroot is False or (nonroot is None and not pod_nonroot):
            bad.append(f"{w}: runAsNonRoot must be true (pod or container securityContext)")
        if sc.get("runAsUser") == 0:
            bad.append(f"{w}: securityContext.runAsUser must not be 0")
        stype = (sc.get("seccompProfile") or {}).get("type")
        if stype == "Unconfined" or (stype is None and not pod_seccomp):
            bad.append(f"{w}: seccompProfile.type must be RuntimeDefault or Localhost (pod or container)")
    return bad


def _env_violations(where: str, pod: Obj) -> list[str]:
    bad = []
    for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
        for e in c.get("env") or []:
            if SENSITIVE_NAME.search(e.get("name", "")) and e.get("value"):
                bad.append(f"{where}: container {c.get('name')}: env {e['name']} has an inline value "
                           "(use valueFrom.secretKeyRef)")
    return bad


def _strings(x: Any) -> Iterator[str]:
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def _exposes_ray_ports(ports: list[Obj]) -> bool:
    for p in ports or []:
        if p.get("port") in RAY_PORTS or p.get("targetPort") in RAY_PORTS or \
                p.get("targetPort") in ("dashboard", "client"):
            return True
    return False


def _head_exposure(where: str, rc_spec: Obj) -> list[str]:
    bad = []
    head = rc_spec.get("headGroupSpec") or {}
    if head.get("serviceType") in ("NodePort", "LoadBalancer"):
        bad.append(f"{where}: headGroupSpec.serviceType {head['serviceType']} exposes 8265/10001 (use ClusterIP)")
    hs_type = ((head.get("headService") or {}).get("spec") or {}).get("type")
    if hs_type in ("NodePort", "LoadBalancer"):
        bad.append(f"{where}: headGroupSpec.headService type {hs_type} exposes 8265/10001 (use ClusterIP)")
    if head.get("enableIngress"):
        bad.append(f"{where}: headGroupSpec.enableIngress exposes the dashboard")
    return bad


def policy_violations(objs: Iterable[Obj]) -> list[str]:
    """Everything in these manifests that breaks rayft's deployment policy (empty: all good)."""
    bad: list[str] = []
    for o in objs:
        if not isinstance(o, dict):
            continue
        kind, spec, oid = o.get("kind"), o.get("spec") or {}, _oid(o)
        for where, pod in pod_specs(o):
            extra = []
            if kind == "RayCluster" and where.endswith(" head") and spec.get("enableInTreeAutoscaling"):
                # KubeRay adds the autoscaler sidecar to the head pod with this securityContext.
                extra.append(("autoscaler sidecar",
                              {"securityContext": (spec.get("autoscalerOptions") or {}).get("securityContext")}))
            bad += _restricted(where, pod, extra)
            bad += _env_violations(where, pod)
        # Secrets by reference only.
        if kind == "Secret":
            for field in ("data", "stringData"):
                for k, v in (o.get(field) or {}).items():
                    if v:
                        bad.append(f"{oid}: {field}.{k} carries a value (create Secrets out of band)")
        if kind == "ConfigMap":
            for k, v in (o.get("data") or {}).items():
                if SENSITIVE_NAME.search(k) and v and not k.endswith((".yaml", ".yml", ".json")):
                    bad.append(f"{oid}: data.{k} looks like a secret in a ConfigMap")
        for s in _strings(o):
            if TOKEN_SHAPES.search(s):
                bad.append(f"{oid}: contains what looks like a credential ({TOKEN_SHAPES.search(s).group(0)[:6]}...)")
                break
        # Ray ports stay inside the cluster.
        if kind == "Service":
            if spec.get("type") in ("NodePort", "LoadBalancer") and _exposes_ray_ports(spec.get("ports")):
                bad.append(f"{oid}: type {spec['type']} exposes Ray port 8265/10001")
            if spec.get("externalIPs") and _exposes_ray_ports(spec.get("ports")):
                bad.append(f"{oid}: externalIPs expose Ray port 8265/10001")
        if kind == "Ingress":
            for rule in spec.get("rules") or []:
                for p in ((rule.get("http") or {}).get("paths") or []):
                    port = (((p.get("backend") or {}).get("service") or {}).get("port") or {}).get("number")
                    if port in RAY_PORTS:
                        bad.append(f"{oid}: routes outside traffic to Ray port {port}")
        if kind == "RayCluster":
            bad += _head_exposure(oid, spec)
        if kind == "RayJob":
            bad += _head_exposure(oid, spec.get("rayClusterSpec") or {})
            for f in ("backoffLimit", "activeDeadlineSeconds"):
                if not isinstance(spec.get(f), int) or isinstance(spec.get(f), bool):
                    bad.append(f"{oid}: spec.{f} must be set")
            if isinstance(spec.get("activeDeadlineSeconds"), int) and spec["activeDeadlineSeconds"] <= 0:
                bad.append(f"{oid}: spec.activeDeadlineSeconds must be positive")
            if SHELL_OPERATORS.search(spec.get("entrypoint") or ""):
                bad.append(f"{oid}: spec.entrypoint must be one plain command (KubeRay pastes it into the "
                           "submitter's bash line: &&, ;, | and redirections would run in the submitter)")
            if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode" and not spec.get("submitterPodTemplate"):
                bad.append(f"{oid}: spec.submitterPodTemplate must be set (the default submitter is not restricted)")
            if not ((o.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL):
                bad.append(f"{oid}: metadata.labels[{QUEUE_LABEL}] must name a Kueue LocalQueue")
            elif spec.get("shutdownAfterJobFinishes") is not True:
                bad.append(f"{oid}: Kueue-managed RayJobs need spec.shutdownAfterJobFinishes: true")
            if spec.get("clusterSelector"):
                bad.append(f"{oid}: spec.clusterSelector (an existing cluster) is not admitted by Kueue")
            rt = spec.get("runtimeEnvYAML")
            if rt:
                try:
                    env_vars = (yaml.safe_load(rt) or {}).get("env_vars") or {}
                except yaml.YAMLError:
                    env_vars = {}
                for k, v in env_vars.items():
                    if SENSITIVE_NAME.search(k) and v:
                        bad.append(f"{oid}: runtimeEnvYAML env_vars.{k} has an inline value")
    return bad


# ---- the backend ---------------------------------------------------------------------------------

class KubeRayError(RuntimeError):
    """The Kubernetes API refused or failed a request (one line)."""


TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def job_state(obj: Obj) -> str:
    """One word for a RayJob: QUEUED, PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED (or KubeRay's own)."""
    st = obj.get("status") or {}
    ds = st.get("jobDeploymentStatus") or ""
    js = (st.get("jobStatus") or "").upper()
    if ds == "Complete":
        return js if js in TERMINAL else "SUCCEEDED"
    if ds in ("Failed", "ValidationFailed"):
        return "FAILED"
    if ds in ("Suspended", "Suspending") or ((obj.get("spec") or {}).get("suspend") and ds in ("", "New")):
        return "QUEUED"                     # waiting for Kueue to admit it
    if ds in ("Running", "Retrying"):
        return "RUNNING" if js in ("", "RUNNING") else ("PENDING" if js == "PENDING" else js)
    if ds in ("", "New", "Initializing", "Waiting"):
        return "PENDING"
    return ds.upper()


class KubeRayBackend:
    """Runs jobs as KubeRay RayJobs through the `kubernetes` client.

    Configuration: an injected `kubernetes.client.ApiClient`, else in-cluster config (inside a
    pod), else ~/.kube/config (`context` picks one). Namespace: the argument, else
    $RAYFT_K8S_NAMESPACE, else `rayft` (where the overlays install the queue, PVC and policies).
    """

    name = "kuberay"

    def __init__(self, namespace: Optional[str] = None, *, api_client: Any = None,
                 overlay: Union[str, Path] = DEFAULT_OVERLAY, queue: Optional[str] = None,
                 image: Optional[str] = None, context: Optional[str] = None):
        self.namespace = namespace or os.environ.get("RAYFT_K8S_NAMESPACE") or DEFAULT_NAMESPACE
        self.overlay, self.queue, self.image, self.context = overlay, queue, image, context
        self._api_client = api_client

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
                raise SpecError(f"kuberay: no usable Kubernetes configuration ({str(e).splitlines()[0]})") from None
            self._api_client = client.ApiClient()
        return self._api_client

    def _core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    def _custom(self):
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client)

    @staticmethod
    def _api_error(e: Exception, what: str) -> KubeRayError:
        import json

        msg = getattr(e, "reason", "") or ""
        body = getattr(e, "body", None)
        if body:
            try:
                msg = json.loads(body).get("message") or msg
            except (ValueError, AttributeError):
                pass
        return KubeRayError(f"kuberay: {what}: HTTP {getattr(e, 'status', '?')}: {msg}".splitlines()[0])

    def _get_rayjob(self, name: str) -> Obj:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._custom().get_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION_API, self.namespace, RAYJOB_PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                raise SpecError(f"kuberay: no RayJob {name} in namespace {self.namespace}") from None
            raise self._api_error(e, f"get RayJob {name}") from None

    # -- the interface --
    def render(self, spec: JobSpec, **kw: Any) -> list[Obj]:
        kw.setdefault("queue", self.queue)
        kw.setdefault("image", self.image)
        kw.setdefault("overlay", self.overlay)
        return render(spec, namespace=self.namespace, **kw)

    def submit(self, spec: JobSpec, **kw: Any) -> str:
        """Create the spec ConfigMap and the RayJob; returns the RayJob name.

        Idempotent: a RayJob of that name with the same spec hash is the same job (already
        submitted), and is not created again. One with another hash is an error.
        """
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        cm, rj = self.render(spec, **kw)
        name, h = rj["metadata"]["name"], rj["metadata"]["annotations"][ANN_SPEC_HASH]
        core, custom = self._core(), self._custom()

        body = client.V1ConfigMap.from_dict(cm) if hasattr(client.V1ConfigMap, "from_dict") else cm
        try:
            core.create_namespaced_config_map(self.namespace, body)
        except ApiException as e:
            if e.status != 409:
                raise self._api_error(e, f"create ConfigMap {cm['metadata']['name']}") from None
            have = core.read_namespaced_config_map(cm["metadata"]["name"], self.namespace)
            have_hash = ((have.metadata.annotations or {}) if have.metadata else {}).get(ANN_SPEC_HASH)
            if have_hash != h:
                raise KubeRayError(f"kuberay: ConfigMap {cm['metadata']['name']} exists with spec hash "
                                   f"{have_hash}, not {h}") from None
        try:
            created = custom.create_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION_API, self.namespace, RAYJOB_PLURAL, rj)
        except ApiException as e:
            if e.status != 409:
                raise self._api_error(e, f"create RayJob {name}") from None
            have = self._get_rayjob(name)
            have_hash = ((have.get("metadata") or {}).get("annotations") or {}).get(ANN_SPEC_HASH)
            if have_hash != h:
                raise KubeRayError(f"kuberay: RayJob {name} exists with spec hash {have_hash}, not {h}; "
                                   f"`rayft stop {name}` first") from None
            return name                                   # already submitted: same job
        # Let the ConfigMap go with the RayJob (garbage collection by owner reference).
        uid = (created.get("metadata") or {}).get("uid") if isinstance(created, dict) else None
        if uid:
            owner = [{"apiVersion": f"{RAY_GROUP}/{RAY_VERSION_API}", "kind": "RayJob", "name": name,
                      "uid": uid, "blockOwnerDeletion": False}]
            try:
                core.patch_namespaced_config_map(
                    cm["metadata"]["name"], self.namespace,
                    [{"op": "add", "path": "/metadata/ownerReferences", "value": owner}])
            except ApiException:
                pass                                      # stop() deletes it explicitly anyway
        return name

    def status(self, name: str) -> dict:
        obj = self._get_rayjob(name)
        st = obj.get("status") or {}
        meta = obj.get("metadata") or {}
        return {
            "name": name,
            "namespace": self.namespace,
            "state": job_state(obj),
            "deployment_status": st.get("jobDeploymentStatus") or "",
            "job_status": st.get("jobStatus") or "",
            "message": st.get("message") or st.get("reason") or "",
            "ray_cluster": st.get("rayClusterName") or "",
            "dashboard_url": st.get("dashboardURL") or "",
            "start_time": st.get("startTime") or "",
            "end_time": st.get("endTime") or "",
            "failed": st.get("failed") or 0,
            "spec_hash": (meta.get("annotations") or {}).get(ANN_SPEC_HASH, ""),
            "memory_estimate_gib": (meta.get("annotations") or {}).get(ANN_ESTIMATE, ""),
        }

    def logs(self, name: str, tail_lines: Optional[int] = None) -> str:
        """Best effort: the submitter pod's log (it follows the driver), else the head pod's."""
        from kubernetes.client.exceptions import ApiException

        obj = self._get_rayjob(name)
        core = self._core()

        def newest(selector: str):
            try:
                pods = core.list_namespaced_pod(self.namespace, label_selector=selector).items or []
            except ApiException as e:
                raise self._api_error(e, f"list pods ({selector})") from None
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
        try:
            return core.read_namespaced_pod_log(pod.metadata.name, self.namespace, **kw) or ""
        except ApiException as e:
            if e.status in (400, 404):   # container not started yet / pod gone
                return f"(no log from pod {pod.metadata.name} yet: {job_state(obj)})\n"
            raise self._api_error(e, f"log of pod {pod.metadata.name}") from None

    def stop(self, name: str) -> bool:
        """Delete the RayJob (KubeRay deletes its cluster and submitter) and its spec ConfigMap."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        opts = client.V1DeleteOptions(propagation_policy="Background")
        try:
            self._custom().delete_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION_API, self.namespace, RAYJOB_PLURAL, name, body=opts)
        except ApiException as e:
            if e.status == 404:
                raise SpecError(f"kuberay: no RayJob {name} in namespace {self.namespace}") from None
            raise self._api_error(e, f"delete RayJob {name}") from None
        try:
            self._core().delete_namespaced_config_map(spec_configmap_name(name), self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise self._api_error(e, f"delete ConfigMap {spec_configmap_name(name)}") from None
        return True

    def list(self) -> list[dict]:
        """rayft's RayJobs in the namespace, with their state."""
        from kubernetes.client.exceptions import ApiException

        try:
            got = self._custom().list_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION_API, self.namespace, RAYJOB_PLURAL,
                label_selector="app.kubernetes.io/managed-by=rayft")
        except ApiException as e:
            raise self._api_error(e, "list RayJobs") from None
        return [{"name": o["metadata"]["name"], "state": job_state(o),
                 "job": (o["metadata"].get("labels") or {}).get("rayft.io/job", "")}
                for o in got.get("items") or []]
