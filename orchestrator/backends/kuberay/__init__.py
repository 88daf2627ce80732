"""Kubernetes: a job spec as a KubeRay RayJob, and a backend that runs it there.

    node_types  what one node of an overlay's cluster looks like (k8s/overlays/*/node-type)
    render      spec -> [ConfigMap, RayJob]: the one place the RayJob's shape is written
    policy      the deployment policy, as a checker over any manifests
    object_storage  run.output_dir in a bucket: no claim, credentials by reference (render's flags)
    client      KubeRayBackend: create / status / logs / stop / list through the Kubernetes API
    templates   k8s/jobs/rayjob-*.yaml, generated from `render`

The names below are the package's interface; `kubernetes` is imported only by the client's
methods, so rendering and checking need no cluster library.
"""

from .client import KubeRayBackend, KubeRayError, KubeRaySubmission, job_state
from .node_types import DEFAULT_OVERLAY, NodeType, k8s_dir, load_node_type, overlays
from .object_storage import DEFAULT_S3_SECRET, AccessFlags
from .policy import QUEUE_LABEL, SHELL_OPERATORS, SHELL_SAFE, pod_specs, policy_violations
from .render import (
    ANN_CHECKPOINTING,
    ANN_ESTIMATE,
    ANN_ESTIMATE_BYTES,
    ANN_ESTIMATE_ERROR,
    ANN_GPU_MEMORY,
    ANN_NODE_TYPE,
    ANN_SPEC_HASH,
    ANN_SPEC_SOURCE,
    ANN_STRATEGY,
    DEFAULT_NAMESPACE,
    DEFAULT_QUEUE,
    HF_SECRET,
    HF_SECRET_KEY,
    WORKDIR,
    K8sSpec,
    job_name,
    load_spec_for_k8s,
    render,
    render_rayjob,
    render_yaml,
    spec_configmap_name,
    to_yaml,
)

__all__ = [
    "KubeRayBackend",
    "KubeRayError",
    "KubeRaySubmission",
    "job_state",
    "DEFAULT_OVERLAY",
    "DEFAULT_S3_SECRET",
    "AccessFlags",
    "NodeType",
    "k8s_dir",
    "load_node_type",
    "overlays",
    "QUEUE_LABEL",
    "SHELL_OPERATORS",
    "SHELL_SAFE",
    "pod_specs",
    "policy_violations",
    "ANN_CHECKPOINTING",
    "ANN_STRATEGY",
    "ANN_ESTIMATE",
    "ANN_ESTIMATE_BYTES",
    "ANN_ESTIMATE_ERROR",
    "ANN_GPU_MEMORY",
    "ANN_NODE_TYPE",
    "ANN_SPEC_HASH",
    "ANN_SPEC_SOURCE",
    "DEFAULT_NAMESPACE",
    "DEFAULT_QUEUE",
    "HF_SECRET",
    "HF_SECRET_KEY",
    "WORKDIR",
    "K8sSpec",
    "job_name",
    "load_spec_for_k8s",
    "render",
    "render_rayjob",
    "render_yaml",
    "spec_configmap_name",
    "to_yaml",
]
