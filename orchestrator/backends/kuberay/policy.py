"""rayft's deployment policy for Kubernetes manifests, as a checker.

`policy_violations(objects)` lists everything in a set of manifests that breaks it (empty: all
good): a restricted securityContext on every pod (Pod Security Standards "restricted", the
parts a manifest shows), secrets by reference only (no inline env values under secret-like
names, no Secret data, nothing shaped like a credential anywhere -- `jobs.secrets` decides, as
it does for specs), Ray's dashboard and client ports never exposed outside the cluster, and
every RayJob bounded and admitted by Kueue (backoffLimit, activeDeadlineSeconds,
preRunningDeadlineSeconds, a queue label, its cluster deleted when it finishes -- ttl 0 --, a
restricted submitter, one plain entrypoint command), and every Ray pod (head and workers of a
RayCluster, RayJob or RayService) sized by one rule: `/dev/shm` a memory emptyDir of at least
`SHM_FRACTION` of the pod's memory limit (`shm_gib` is the size rayft writes), ephemeral-storage
requested and limited, the data volume at `DATA_MOUNT` and the caches on it (`CACHE_ENV`): the
shared claim, or, for a Ray object annotated `OUTPUTS_ANNOTATION: object-storage` (outputs in a
bucket), a sized disk emptyDir the container's ephemeral-storage covers and no claim at all, with a
RayJob's `run.output_dir` then an s3:// or gs:// URI; every
Ray pod set (head, each worker group) covered by a PodDisruptionBudget of the same manifests with
`maxUnavailable: 0` that selects that object's Ray pods and nothing else of them (not the
submitter, not another cluster's pods); and images by tag pulled Always (by digest: anything). `render` checks its
own output with it; the tests check all of k8s/ with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import yaml

from jobs import secrets
from jobs.secrets import SECRET_NAME

Obj = dict[str, Any]

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# KubeRay pastes a RayJob's entrypoint into the submitter's bash command line and Ray runs it
# through a shell again: one plain command of plain words.
SHELL_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./{}-]+")
SHELL_OPERATORS = re.compile(r"&&|\|\||[;|&`<>\n]|\$\(")
RAY_PORTS = {8265, 10001}
RESTRICTED_CAPS_ADD = {"NET_BIND_SERVICE"}
# Ray's object store defaults to 30% of the pod's memory and lives in /dev/shm; a smaller /dev/shm
# makes Ray fall back to /tmp (slow, on the container's disk) with a warning.
SHM_FRACTION = 0.3
# An image reference: [registry[:port]/]path[:tag][@sha256:digest]. A digest names one image for
# ever; a tag may be pushed again, so a node that has it cached would keep running the old one.
IMAGE_REF = re.compile(
    r"(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+|/)[a-z0-9]+)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?"
)


def pull_policy(image: str) -> str:
    """imagePullPolicy for an image: IfNotPresent by digest (immutable), Always by tag."""
    return "IfNotPresent" if "@sha256:" in image else "Always"


# Training pods must not be moved mid-run by node consolidation: the annotation each autoscaler
# honours (Karpenter, cluster-autoscaler), and a priority class above batch work (k8s/base).
NO_DISRUPT = {"karpenter.sh/do-not-disrupt": "true", "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
PRIORITY_CLASS = "rayft-training"
# The labels rayft puts in every Ray pod template (KubeRay keeps a template's labels on the pods it
# creates): all of rayft's Ray pods (NetworkPolicy), and the pods of one Ray cluster (its
# PodDisruptionBudget; a RayJob's RayCluster is named <job>-<random>, so KubeRay's own
# ray.io/cluster label is not known when the manifests are written).
RAY_NODE_LABEL = "rayft.io/ray-node"
CLUSTER_LABEL = "rayft.io/ray-cluster"


def pod_disruption_budget(name: str, match_labels: dict[str, str]) -> Obj:
    """The PodDisruptionBudget of one Ray cluster's pods: no voluntary eviction (node drain,
    consolidation) of a running training pod: losing one rank stops every rank of the job.
    `unhealthyPodEvictionPolicy: AlwaysAllow`: a pod that is not Ready (crash-looping, never
    started) may still be evicted, so a broken job does not block node maintenance."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name},
        "spec": {
            "maxUnavailable": 0,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": dict(match_labels)},
        },
    }


DATA_MOUNT = "/mnt/rayft"  # every Ray pod mounts the data volume (PVC rayft-data) here
# On a Ray object: its pods keep outputs in a bucket (run.output_dir s3:// or gs://), so DATA_MOUNT
# is each pod's own emptyDir (caches, staging) and no claim is mounted: clusters without RWX volumes.
OUTPUTS_ANNOTATION = "rayft.io/outputs"
OBJECT_STORAGE = "object-storage"
_BUCKET_OUTPUT = re.compile(r"(?:^|\s)run\.output_dir=(?:s3|gs)://")
# The hub's downloads and rayft's cache (jobs.model.loading) on the data volume, in every Ray container:
# in the container layer a large model fills the node's disk and the pod is evicted.
CACHE_ENV = {"HF_HOME": f"{DATA_MOUNT}/cache/huggingface", "RAYFT_CACHE": f"{DATA_MOUNT}/cache/rayft"}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)")
_QUANTITY_UNITS = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def shm_gib(memory_gib: float) -> float:
    """The /dev/shm size rayft gives a Ray pod with `memory_gib` of memory: `SHM_FRACTION` of it,
    rounded up to half a GiB, at least 0.5 GiB. Invariant: >= SHM_FRACTION * memory_gib."""
    return max(0.5, math.ceil(memory_gib * SHM_FRACTION * 2) / 2)


def quantity_bytes(q: Any) -> float | None:
    """A Kubernetes memory/storage quantity ("16Gi", "512Mi", "1e9" as an int) in bytes; None
    when it is not one."""
    if isinstance(q, (int, float)) and not isinstance(q, bool):
        return float(q)
    m = _QUANTITY.fullmatch(str(q or "").strip())
    if not m or m.group(2) not in _QUANTITY_UNITS:
        return None
    return float(m.group(1)) * _QUANTITY_UNITS[m.group(2)]


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


def ray_pod_specs(o: Obj) -> Iterator[tuple[str, Obj]]:
    """(description, pod spec) for every Ray node pod (head, worker groups) an object carries:
    `pod_specs` without a RayJob's submitter."""
    if o.get("kind") in ("RayCluster", "RayJob", "RayService"):
        for where, pod in pod_specs(o):
            if not where.endswith(" submitter"):
                yield where, pod


def _shm_violations(where: str, pod: Obj) -> list[str]:
    """/dev/shm of the Ray container: a memory emptyDir >= SHM_FRACTION of its memory limit."""
    containers = pod.get("containers") or []
    if not containers:
        return []  # `_restricted` reports the missing container
    c = containers[0]  # KubeRay: the Ray container is the first one
    w = f"{where}: container {c.get('name', '?')}"
    mem = quantity_bytes(((c.get("resources") or {}).get("limits") or {}).get("memory"))
    if mem is None:
        return [f"{w}: resources.limits.memory must be set (Ray sizes its object store from it)"]
    vol_name = next((m.get("name") for m in c.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"), None)
    vol = next((v for v in pod.get("volumes") or [] if v.get("name") == vol_name), None) if vol_name else None
    ed = (vol or {}).get("emptyDir")
    if not isinstance(ed, dict) or ed.get("medium") != "Memory":
        return [f"{w}: /dev/shm must be a memory emptyDir (Ray's object store lives there; the default is 64 MiB)"]
    size = quantity_bytes(ed.get("sizeLimit"))
    if size is None or size < SHM_FRACTION * mem:
        return [
            f"{w}: /dev/shm sizeLimit {ed.get('sizeLimit')} is below {SHM_FRACTION:.0%} of the memory limit "
            f"{c['resources']['limits']['memory']} (Ray's object store would fall back to /tmp)"
        ]
    return []


def _storage_violations(where: str, pod: Obj, ray: bool, on_bucket: bool = False) -> list[str]:
    """ephemeral-storage requested and limited on every container; a Ray container (`ray`) also
    has the data volume at DATA_MOUNT (`on_bucket`: a local emptyDir, else the claim) and CACHE_ENV
    pointing into it."""
    bad = []
    for c in pod.get("containers") or []:
        bad += _ephemeral_violations(f"{where}: container {c.get('name', '?')}", c)
    if ray and pod.get("containers"):
        c = pod["containers"][0]
        w = f"{where}: container {c.get('name', '?')}"
        bad += _bucket_volume_violations(w, pod, c) if on_bucket else _claim_violations(w, pod, c)
        env = {e.get("name"): e.get("value") for e in c.get("env") or []}
        for k in CACHE_ENV:
            if not str(env.get(k) or "").startswith(f"{DATA_MOUNT}/cache/"):
                bad.append(
                    f"{w}: env {k} must point under {DATA_MOUNT}/cache/ (downloads on the data volume, "
                    "not the container layer)"
                )
    return bad


def _ephemeral_violations(w: str, c: Obj) -> list[str]:
    res = c.get("resources") or {}
    req = quantity_bytes((res.get("requests") or {}).get("ephemeral-storage"))
    lim = quantity_bytes((res.get("limits") or {}).get("ephemeral-storage"))
    if req is None or lim is None:
        return [
            f"{w}: resources.requests and limits of ephemeral-storage must be set "
            "(unbounded writes to the container layer get pods evicted for disk pressure)"
        ]
    return [f"{w}: ephemeral-storage request is above its limit"] if req > lim else []


def _data_volume(pod: Obj, c: Obj) -> Obj | None:
    """The volume the container mounts at DATA_MOUNT (None: nothing there)."""
    name = next((m.get("name") for m in c.get("volumeMounts") or [] if m.get("mountPath") == DATA_MOUNT), None)
    return next((v for v in pod.get("volumes") or [] if name is not None and v.get("name") == name), None)


def _claim_violations(w: str, pod: Obj, c: Obj) -> list[str]:
    """Outputs on the shared volume: a PVC at DATA_MOUNT."""
    if "persistentVolumeClaim" in (_data_volume(pod, c) or {}):
        return []
    return [f"{w}: the data volume (a PVC) must be mounted at {DATA_MOUNT}"]


def _bucket_volume_violations(w: str, pod: Obj, c: Obj) -> list[str]:
    """Outputs in a bucket: DATA_MOUNT is a disk emptyDir with a sizeLimit that the container's
    ephemeral-storage request covers (the scheduler reserves that disk), and no claim is mounted."""
    bad = [f"{w}: volume {v.get('name')} is a claim (outputs are in a bucket: no claim)" for v in _claims(pod)]
    ed = (_data_volume(pod, c) or {}).get("emptyDir")
    if not isinstance(ed, dict) or ed.get("medium"):
        return [*bad, f"{w}: the data volume at {DATA_MOUNT} must be a disk emptyDir (outputs are in a bucket)"]
    size = quantity_bytes(ed.get("sizeLimit"))
    req = quantity_bytes(((c.get("resources") or {}).get("requests") or {}).get("ephemeral-storage"))
    if size is None:
        bad.append(f"{w}: the emptyDir at {DATA_MOUNT} must have a sizeLimit (downloads would fill the node's disk)")
    elif req is not None and req < size:
        bad.append(
            f"{w}: ephemeral-storage request {c['resources']['requests']['ephemeral-storage']} is below the "
            f"emptyDir at {DATA_MOUNT} ({ed['sizeLimit']}): the scheduler would not reserve that disk"
        )
    return bad


def _claims(pod: Obj) -> list[Obj]:
    return [v for v in pod.get("volumes") or [] if "persistentVolumeClaim" in v]


def _outputs_violations(o: Obj) -> list[str]:
    """A Ray object's OUTPUTS_ANNOTATION names a known home; a RayJob with it writes to a bucket."""
    value = ((o.get("metadata") or {}).get("annotations") or {}).get(OUTPUTS_ANNOTATION)
    if value is None:
        return []
    if value != OBJECT_STORAGE:
        return [f"{_oid(o)}: annotation {OUTPUTS_ANNOTATION}: {value!r} (expected {OBJECT_STORAGE!r} or none)"]
    if o.get("kind") != "RayJob":
        return []
    spec = o.get("spec") or {}
    bad = []
    if not _BUCKET_OUTPUT.search(str(spec.get("entrypoint") or "")):
        bad.append(
            f"{_oid(o)}: {OUTPUTS_ANNOTATION}: {OBJECT_STORAGE} but the entrypoint's run.output_dir is not "
            "s3:// or gs:// (outputs on a pod's emptyDir are lost with the cluster)"
        )
    return bad


def on_object_storage(o: Obj) -> bool:
    """Whether a Ray object keeps its outputs in a bucket (its pods mount no claim)."""
    return ((o.get("metadata") or {}).get("annotations") or {}).get(OUTPUTS_ANNOTATION) == OBJECT_STORAGE


def _image_violations(where: str, pod: Obj) -> list[str]:
    """A tagged image is pulled Always (a rebuilt tag must not leave stale copies on nodes)."""
    bad = []
    for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
        image = str(c.get("image") or "")
        if "@sha256:" not in image and c.get("imagePullPolicy") in ("IfNotPresent", "Never"):
            bad.append(
                f"{where}: container {c.get('name', '?')}: image {image} by tag with imagePullPolicy "
                f"{c['imagePullPolicy']} (use Always, or the image by digest: REPO@sha256:...)"
            )
    return bad


def _disruption_violations(where: str, template: Obj) -> list[str]:
    """A Ray pod template: NO_DISRUPT annotations and a priorityClassName."""
    bad = []
    ann = (template.get("metadata") or {}).get("annotations") or {}
    for k, v in NO_DISRUPT.items():
        if ann.get(k) != v:
            bad.append(
                f'{where}: pod annotation {k}: "{v}" is missing (node consolidation would evict a training pod mid-run)'
            )
    if not (template.get("spec") or {}).get("priorityClassName"):
        bad.append(f"{where}: spec.priorityClassName must be set (e.g. {PRIORITY_CLASS})")
    return bad


def _ray_pod_templates(o: Obj) -> Iterator[tuple[str, Obj]]:
    kind, spec, oid = o.get("kind", ""), o.get("spec") or {}, _oid(o)
    rc = {"RayCluster": spec, "RayJob": spec.get("rayClusterSpec"), "RayService": spec.get("rayClusterConfig")}.get(
        kind
    )
    if not rc:
        return
    yield f"{oid} head", (rc.get("headGroupSpec") or {}).get("template") or {}
    for g in rc.get("workerGroupSpecs") or []:
        yield f"{oid} worker group {g.get('groupName', '?')}", g.get("template") or {}


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
            if SECRET_NAME.search(e.get("name", "")) and e.get("value"):
                bad.append(
                    f"{where}: container {c.get('name')}: env {e['name']} has an inline value "
                    "(use valueFrom.secretKeyRef)"
                )
    return bad


def _exposes_ray_ports(ports: list[Obj] | None) -> bool:
    for p in ports or []:
        if (
            p.get("port") in RAY_PORTS
            or p.get("targetPort") in RAY_PORTS
            or p.get("targetPort") in ("dashboard", "client")
        ):
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


def selector_matches(selector: Any, labels: dict) -> bool:
    """Whether a LabelSelector (matchLabels + matchExpressions) selects a pod with `labels`;
    an empty selector selects every pod (policy/v1), a missing one none."""
    if not isinstance(selector, dict):
        return False
    labels = labels or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


def _ns(o: Obj) -> str | None:
    return (o.get("metadata") or {}).get("namespace")


def _pod_labels(template: Obj) -> dict:
    return (template.get("metadata") or {}).get("labels") or {}


def _zero_unavailable(pdb: Obj) -> bool:
    spec = pdb.get("spec") or {}
    return spec.get("maxUnavailable") in (0, "0", "0%") or spec.get("minAvailable") == "100%"


def _pdb_violations(objs: list[Obj]) -> list[str]:
    """Every Ray pod set (head, each worker group of a RayCluster/RayJob/RayService) is selected
    by a PodDisruptionBudget of these manifests (same namespace) with maxUnavailable 0, and a PDB
    that selects a Ray object's pods selects none of another's, nor a RayJob's submitter."""
    pdbs = [o for o in objs if o.get("kind") == "PodDisruptionBudget"]
    ray = [o for o in objs if o.get("kind") in ("RayCluster", "RayJob", "RayService")]
    bad = []
    for o in ray:
        for where, template in _ray_pod_templates(o):
            labels = _pod_labels(template)
            cover = [
                p for p in pdbs if _ns(p) == _ns(o) and selector_matches((p.get("spec") or {}).get("selector"), labels)
            ]
            if not any(_zero_unavailable(p) for p in cover):
                names = ", ".join(_oid(p) for p in cover)
                bad.append(
                    f"{where}: no PodDisruptionBudget with maxUnavailable: 0 selects these pods (labels "
                    f"{labels or '{}'}){f'; {names} allows evictions' if names else ''} (a node drain would "
                    "evict a training pod mid-run)"
                )
    for p in pdbs:
        sel = (p.get("spec") or {}).get("selector")
        owners = [
            o
            for o in ray
            if _ns(o) == _ns(p) and any(selector_matches(sel, _pod_labels(t)) for _, t in _ray_pod_templates(o))
        ]
        if len(owners) > 1:
            bad.append(
                f"{_oid(p)}: selects the pods of {len(owners)} Ray objects "
                f"({', '.join(_oid(o) for o in owners)}): one budget per Ray cluster"
            )
        for o in owners:
            sub = (o.get("spec") or {}).get("submitterPodTemplate") if o.get("kind") == "RayJob" else None
            if sub and selector_matches(sel, _pod_labels(sub)):
                bad.append(f"{_oid(p)}: selects {_oid(o)}'s submitter pod too (only its Ray pods)")
    return bad


def policy_violations(objs: Iterable[Obj]) -> list[str]:
    """Everything in these manifests that breaks rayft's deployment policy (empty: all good)."""
    objs = [o for o in objs if isinstance(o, dict)]
    bad: list[str] = []
    for o in objs:
        kind, spec, oid = o.get("kind"), o.get("spec") or {}, _oid(o)
        bad += _pod_violations(o)
        bad += _secret_violations(o)
        if kind == "Service":
            bad += _service_violations(oid, spec)
        if kind == "Ingress":
            bad += _ingress_violations(oid, spec)
        if kind == "RayCluster":
            bad += _head_exposure(oid, spec)
        if kind == "RayJob":
            bad += _head_exposure(oid, spec.get("rayClusterSpec") or {})
            bad += _rayjob_violations(o)
    return bad + _pdb_violations(objs)


def _pod_violations(o: Obj) -> list[str]:
    """Every pod of `o`: restricted, images pulled right, no inline secrets in env; every Ray pod
    also covered against disruption, with its /dev/shm and storage sized by rule."""
    kind, spec = o.get("kind"), o.get("spec") or {}
    bad: list[str] = []
    for where, pod in pod_specs(o):
        extra = []
        if kind == "RayCluster" and where.endswith(" head") and spec.get("enableInTreeAutoscaling"):
            # KubeRay adds the autoscaler sidecar to the head pod with this securityContext.
            extra.append(
                (
                    "autoscaler sidecar",
                    {"securityContext": (spec.get("autoscalerOptions") or {}).get("securityContext")},
                )
            )
        bad += _restricted(where, pod, extra)
        bad += _image_violations(where, pod)
        bad += _env_violations(where, pod)
    ray_pods = dict(ray_pod_specs(o))
    for where, template in _ray_pod_templates(o):
        bad += _disruption_violations(where, template)
    for where, pod in ray_pod_specs(o):
        bad += _shm_violations(where, pod)
    if kind in ("RayCluster", "RayJob", "RayService"):
        bucket = on_object_storage(o)
        for where, pod in pod_specs(o):
            bad += _storage_violations(where, pod, ray=where in ray_pods, on_bucket=bucket)
        bad += _outputs_violations(o)
    return bad


def _secret_violations(o: Obj) -> list[str]:
    """Secrets by reference only: no Secret data, no secret-like ConfigMap key, nothing anywhere
    shaped like a credential."""
    kind, oid = o.get("kind"), _oid(o)
    bad: list[str] = []
    if kind == "Secret":
        for field in ("data", "stringData"):
            for k, v in (o.get(field) or {}).items():
                if v:
                    bad.append(f"{oid}: {field}.{k} carries a value (create Secrets out of band)")
    if kind == "ConfigMap":
        for k, v in (o.get("data") or {}).items():
            if SECRET_NAME.search(k) and v and not k.endswith((".yaml", ".yml", ".json")):
                bad.append(f"{oid}: data.{k} looks like a secret in a ConfigMap")
    for _, s in secrets.walk_strings(o):  # jobs.secrets: the one scanner (the spec uses it too)
        found = secrets.describe(s)
        if found:
            bad.append(f"{oid}: contains what looks like a credential: {found}")
            break
    return bad


def _service_violations(oid: str, spec: dict) -> list[str]:
    """Ray ports stay inside the cluster: no NodePort, LoadBalancer or external IP on them."""
    bad: list[str] = []
    if spec.get("type") in ("NodePort", "LoadBalancer") and _exposes_ray_ports(spec.get("ports")):
        bad.append(f"{oid}: type {spec['type']} exposes Ray port 8265/10001")
    if spec.get("externalIPs") and _exposes_ray_ports(spec.get("ports")):
        bad.append(f"{oid}: externalIPs expose Ray port 8265/10001")
    return bad


def _ingress_violations(oid: str, spec: dict) -> list[str]:
    """No Ingress routes outside traffic to a Ray port."""
    bad: list[str] = []
    for rule in spec.get("rules") or []:
        for p in (rule.get("http") or {}).get("paths") or []:
            port = (((p.get("backend") or {}).get("service") or {}).get("port") or {}).get("number")
            if port in RAY_PORTS:
                bad.append(f"{oid}: routes outside traffic to Ray port {port}")
    return bad


def _rayjob_violations(o: Obj) -> list[str]:
    """A RayJob is bounded (backoffLimit, activeDeadlineSeconds, preRunningDeadlineSeconds),
    admitted by Kueue (a queue label, its cluster deleted when it finishes, no existing cluster),
    submitted by a restricted submitter with one plain command, and has no inline secret in its
    runtime env."""
    spec, oid = o.get("spec") or {}, _oid(o)
    bad: list[str] = []
    for f in ("backoffLimit", "activeDeadlineSeconds"):
        if not isinstance(spec.get(f), int) or isinstance(spec.get(f), bool):
            bad.append(f"{oid}: spec.{f} must be set")
    if isinstance(spec.get("activeDeadlineSeconds"), int) and spec["activeDeadlineSeconds"] <= 0:
        bad.append(f"{oid}: spec.activeDeadlineSeconds must be positive")
    if SHELL_OPERATORS.search(spec.get("entrypoint") or ""):
        bad.append(
            f"{oid}: spec.entrypoint must be one plain command (KubeRay pastes it into the "
            "submitter's bash line: &&, ;, | and redirections would run in the submitter)"
        )
    if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode" and not spec.get("submitterPodTemplate"):
        bad.append(f"{oid}: spec.submitterPodTemplate must be set (the default submitter is not restricted)")
    if not ((o.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL):
        bad.append(f"{oid}: metadata.labels[{QUEUE_LABEL}] must name a Kueue LocalQueue")
    elif spec.get("shutdownAfterJobFinishes") is not True:
        bad.append(f"{oid}: Kueue-managed RayJobs need spec.shutdownAfterJobFinishes: true")
    if spec.get("shutdownAfterJobFinishes") is True and spec.get("ttlSecondsAfterFinished", 0) != 0:
        bad.append(
            f"{oid}: spec.ttlSecondsAfterFinished must be 0 (Kueue releases the quota when the job "
            f"finishes; a cluster kept {spec['ttlSecondsAfterFinished']}s holds GPUs the quota counts "
            "as free)"
        )
    pre = spec.get("preRunningDeadlineSeconds")
    if not isinstance(pre, int) or isinstance(pre, bool) or pre <= 0:
        bad.append(
            f"{oid}: spec.preRunningDeadlineSeconds must be set (a job whose pods cannot start "
            "would hold its quota until activeDeadlineSeconds)"
        )
    elif isinstance(spec.get("activeDeadlineSeconds"), int) and pre >= spec["activeDeadlineSeconds"]:
        bad.append(f"{oid}: spec.preRunningDeadlineSeconds {pre} must be below activeDeadlineSeconds")
    if spec.get("clusterSelector"):
        bad.append(f"{oid}: spec.clusterSelector (an existing cluster) is not admitted by Kueue")
    rt = spec.get("runtimeEnvYAML")
    if rt:
        try:
            env_vars = (yaml.safe_load(rt) or {}).get("env_vars") or {}
        except yaml.YAMLError:
            env_vars = {}
        for k, v in env_vars.items():
            if SECRET_NAME.search(k) and v:
                bad.append(f"{oid}: runtimeEnvYAML env_vars.{k} has an inline value")
    return bad
