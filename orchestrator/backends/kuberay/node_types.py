"""Node types: what one node of the cluster an overlay targets looks like.

Each overlay under ``k8s/overlays/<name>/`` carries a ConfigMap ``rayft-node-type``
(``node-type/node-type.yaml``): GPU product and count, GPU memory, CPUs, pod memory, image, and
the cluster flavour: the node label that selects the GPU nodes (GFD, GKE, EKS/Karpenter or a
custom pair), their taints, the storage class and access mode of the data volume, and the GPUs
of the cluster (`clusterGpus`) and of Kueue's quota for RayJobs (`jobQuotaGpus`).
Kustomize copies its image and GPU product into the manifests (k8s/components); `render`
sizes a job's pods from it and refuses specs that cannot fit one node of it (the node-fit rule,
`orchestrator.backends.node_fit`, on `NodeType.offer`), or whose GPUs in total exceed what Kueue
hands out (`NodeType.gpus_refusal`); queue admission asks both the same questions.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jobs.errors import UserError

from ..node_fit import NodeOffer

DEFAULT_OVERLAY = "gpu"

# The node label a GPU node of each cluster flavour carries, and what its value names:
#   gfd:  NVIDIA GPU Feature Discovery / GPU Operator (on-prem, any cloud with the operator),
#         value the product name (NVIDIA-H100-80GB-HBM3);
#   gke:  GKE sets it on GPU node pools, and its autoscaler knows it before a node exists
#         (scale-up from zero), value e.g. nvidia-h100-80gb;
#   eks:  Karpenter's well-known label, known before launch too, value e.g. h100.
# A label that appears only after boot (GFD's, on an autoscaled pool) blocks scale-up from zero.
GPU_LABEL_KEYS = {
    "gfd": "nvidia.com/gpu.product",
    "gke": "cloud.google.com/gke-accelerator",
    "eks": "karpenter.k8s.aws/instance-gpu-name",
}
DEFAULT_GPU_TOLERATIONS = ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)

Obj = dict[str, Any]


def k8s_dir() -> Path:
    """The repository's k8s/ folder (or $RAYFT_K8S_DIR)."""
    env = os.environ.get("RAYFT_K8S_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "k8s"


def overlays() -> list[str]:
    """The overlays under k8s/overlays/ that carry a node type."""
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
    worker_memory_gib: float  # host memory per GPU worker: a pod of N GPUs gets N times it
    head_cpu: float
    head_memory_gib: float
    image: str
    head_ephemeral_gib: float = 20.0  # ephemeral-storage of the head pod (Ray's /tmp/ray)
    worker_ephemeral_gib: float = 50.0  # ... per GPU worker (logs, spilled objects), N times in a pod of N
    # With run.output_dir on object storage (no shared volume): the head pod's local emptyDir for
    # the hub's downloads, the token cache and the run's staging copy, and a GPU worker's (N times
    # in a pod of N); added to the pod's ephemeral-storage, which the emptyDir counts against.
    head_cache_gib: float = 20.0
    worker_cache_gib: float = 100.0
    flavour: str = "gfd"  # gfd, gke, eks or custom: which GPU label the nodes carry
    gpu_label_key: str = GPU_LABEL_KEYS["gfd"]
    gpu_label_value: str = ""  # "" with GPUs: gpu_product (GFD's value)
    gpu_tolerations: tuple = DEFAULT_GPU_TOLERATIONS  # taints of the GPU nodes, tolerated by GPU pods
    storage_class: str = ""  # of the rayft-data PVC ("" = the cluster's default)
    access_mode: str = "ReadWriteMany"  # of the rayft-data PVC
    cluster_gpus: int = 0  # GPUs of all nodes of this type (0: one node's)
    # GPUs the Kueue ClusterQueue hands out to RayJobs (nominalQuota of nvidia.com/gpu; 0: not
    # known, not checked). A job asking more is never admitted: its RayJob would wait suspended.
    job_quota_gpus: int = 0
    source: str = ""  # the file this node type was read from (for messages)

    def gpus_refusal(self, gpus: float) -> str:
        """Why a job holding `gpus` GPUs in total can never be admitted on this node type's
        cluster ("" when it can): more than Kueue's quota for RayJobs (`jobQuotaGpus`), or than
        the cluster has (`clusterGpus`). Kueue only ever compares a job to its quota, so such a
        RayJob is not refused there: it stays suspended forever."""
        where = f" in {self.source}" if self.source else ""
        if self.job_quota_gpus and gpus > self.job_quota_gpus:
            return (
                f"{gpus:g} GPUs exceed the {self.job_quota_gpus} GPUs the Kueue ClusterQueue of overlay "
                f"{self.overlay} hands out to RayJobs (jobQuotaGpus{where}); Kueue would keep it suspended forever"
            )
        if self.cluster_gpus and gpus > self.cluster_gpus:
            return (
                f"{gpus:g} GPUs exceed the {self.cluster_gpus} GPUs of overlay {self.overlay}'s cluster "
                f"(clusterGpus{where})"
            )
        return ""

    def offer(self, gpu_memory_gib: float | None) -> NodeOffer:
        """One node of this type as the node-fit rule sees it, its GPU holding `gpu_memory_gib`
        (render: gpuMemoryGiB as written; admission: after `--gpu-memory`, None when unknown)."""
        return NodeOffer(
            gpus=self.gpus_per_node,
            cpus=self.cpus_per_node,
            gpu_names=(self.ray_accelerator_type, self.gpu_product),
            gpu_memory_gib=gpu_memory_gib,
        )

    def gpu_selector(self) -> dict:
        """The nodeSelector of a GPU pod on this node type ({} when there is nothing to select)."""
        value = self.gpu_label_value or self.gpu_product
        return {self.gpu_label_key: value} if value else {}

    @classmethod
    def from_configmap(cls, obj: Obj, overlay: str, source: str = "") -> NodeType:
        d = obj.get("data") or {}
        where = f"overlay {overlay}: node-type ConfigMap"
        if not isinstance(d, dict):
            raise UserError(f"{where}: data is not a mapping")
        _check_numbers(d, where)
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
                head_ephemeral_gib=float(d.get("headEphemeralGiB", 20)),
                worker_ephemeral_gib=float(d.get("workerEphemeralGiB", 50)),
                head_cache_gib=float(d.get("headCacheGiB", 20)),
                worker_cache_gib=float(d.get("workerCacheGiB", 100)),
                source=source,
                **_flavour_fields(d, where),
            )
        except KeyError as e:
            raise UserError(f"{where}: data.{e.args[0]} is missing") from None
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None


# The node type's sizes: each, when given, a finite number >= 0 ("nan" and "inf" parse as floats).
_SIZES = (
    "gpuMemoryGiB",
    "cpusPerNode",
    "workerMemoryGiB",
    "headCpu",
    "headMemoryGiB",
    "headEphemeralGiB",
    "workerEphemeralGiB",
    "headCacheGiB",
    "workerCacheGiB",
    "gpusPerNode",
)


def _check_numbers(d: Obj, where: str) -> None:
    for key in _SIZES:
        if key not in d:
            continue
        raw = d[key]
        try:
            v = float(str(raw).strip())
        except ValueError:
            v = math.nan
        if isinstance(raw, bool) or not (math.isfinite(v) and v >= 0):
            raise UserError(f"{where}: data.{key} {str(raw)[:40]!r}: expected a finite number, 0 or more")


def _flavour_fields(d: Obj, where: str) -> Obj:
    """flavour, GPU label, tolerations, storage of a node-type ConfigMap's data."""
    flavour = str(d.get("flavour") or "gfd")
    if flavour not in (*GPU_LABEL_KEYS, "custom"):
        raise UserError(f"{where}: data.flavour {flavour!r}: expected one of {', '.join(GPU_LABEL_KEYS)}, custom")
    key = str(d.get("gpuLabelKey") or GPU_LABEL_KEYS.get(flavour, ""))
    if not key:
        raise UserError(f"{where}: data.gpuLabelKey is missing (flavour custom names its own GPU node label)")
    tolerations = DEFAULT_GPU_TOLERATIONS
    if d.get("gpuTolerations"):
        try:
            tolerations = yaml.safe_load(str(d["gpuTolerations"]))
        except yaml.YAMLError as e:
            raise UserError(f"{where}: data.gpuTolerations is not YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
            raise UserError(f"{where}: data.gpuTolerations must be a YAML list of tolerations")
        tolerations = tuple(tolerations)
    mode = str(d.get("accessMode") or "ReadWriteMany")
    if mode not in ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"):
        raise UserError(f"{where}: data.accessMode {mode!r}: expected ReadWriteMany or ReadWriteOnce")
    return {
        "flavour": flavour,
        "gpu_label_key": key,
        "gpu_label_value": str(d.get("gpuLabelValue") or ""),
        "gpu_tolerations": tolerations,
        "storage_class": str(d.get("storageClassName") or ""),
        "access_mode": mode,
        "cluster_gpus": _count(d, "clusterGpus", where),
        "job_quota_gpus": _count(d, "jobQuotaGpus", where),
    }


def _count(d: Obj, key: str, where: str) -> int:
    """A whole number >= 0 of the ConfigMap's data (absent or "": 0)."""
    raw = d.get(key)
    if raw is None or str(raw).strip() == "":
        return 0
    try:
        n = int(str(raw).strip())
    except ValueError:
        n = -1
    if n < 0:
        raise UserError(f"{where}: data.{key} {raw!r}: expected a whole number of GPUs (0: not known)")
    return n


def _shown(f: Path) -> str:
    """A path as a user finds it: relative to the current directory when it is under it."""
    try:
        return str(f.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(f)


def _yaml_documents(f: Path) -> list:
    """The YAML documents of a node-type file, or a one-line UserError naming the file and line."""
    try:
        return list(yaml.safe_load_all(f.read_text()))
    except UnicodeDecodeError:
        raise UserError(f"{_shown(f)}: is not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(
            f"{_shown(f)}: is not YAML{at}: {getattr(e, 'problem', None) or str(e).splitlines()[0]}"
        ) from None


def load_node_type(overlay: str | Path = DEFAULT_OVERLAY) -> NodeType:
    """The node type of an overlay: a name under k8s/overlays/, or a path to an overlay folder."""
    p = Path(overlay)
    if p.is_dir():
        base = p
    else:
        if "/" in str(overlay) or not re.fullmatch(r"[A-Za-z0-9._-]+", str(overlay)):
            raise UserError(f"--overlay {overlay}: not an overlay folder")
        base = k8s_dir() / "overlays" / str(overlay)
    for f in (base / "node-type" / "node-type.yaml", base / "node-type.yaml"):
        if f.is_file():
            for doc in _yaml_documents(f):
                if (
                    isinstance(doc, dict)
                    and doc.get("kind") == "ConfigMap"
                    and (doc.get("metadata") or {}).get("name") == "rayft-node-type"
                ):
                    return NodeType.from_configmap(doc, base.name, source=_shown(f))
            raise UserError(f"{f}: no ConfigMap rayft-node-type in it")
    known = ", ".join(overlays()) or "none found"
    raise UserError(f"--overlay {overlay}: no node type (node-type/node-type.yaml) there; overlays: {known}")
