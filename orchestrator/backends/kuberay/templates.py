"""k8s/jobs/rayjob-*.yaml, generated from `render`: the RayJob's shape is written once.

    python -m orchestrator.backends.kuberay.templates            # rewrite the files
    python -m orchestrator.backends.kuberay.templates --check    # exit 1 when they are stale

Each template is `render` of an example spec from ``k8s/jobs/spec-configmaps.yaml`` (GPU on, for
the gpu overlay's node type; the dev-cpu overlay patches it down), with what is per job replaced
by fixed names: the RayJob is ``rayft-<kind>-example``, it mounts the shared example ConfigMap,
its pods carry ``rayft.io/ray-cluster: rayft-<kind>-example`` and its PodDisruptionBudget (the
second document of the file, same name) selects them; the per-job annotations (spec hash, memory
estimate) are left out so that the files change
only when the shape does. Kustomize (k8s/overlays/*/jobs) sets the namespace, image and GPU
product from the overlay's node type. The comments below are written into the files.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from .node_types import k8s_dir
from .policy import CLUSTER_LABEL, QUEUE_LABEL
from .render import ANN_SPEC_HASH, Obj, render

KeyPath = tuple[Any, ...]  # a key path into a manifest: ("spec", "rayClusterSpec", "workerGroupSpecs", 0)

# kind -> (template file, RayJob name, example spec ConfigMap in spec-configmaps.yaml)
TEMPLATES = {
    "finetune": ("rayjob-finetune.yaml", "rayft-finetune-example", "rayft-spec-example"),
    "tune": ("rayjob-tune.yaml", "rayft-tune-example", "rayft-search-example"),
}
SPEC_CONFIGMAPS = "spec-configmaps.yaml"
GPU_ON = "resources.use_gpu=true"  # the examples are CPU specs; the gpu overlay runs them on GPUs

HEADERS = {
    "finetune": (
        "A fine-tuning job as a KubeRay RayJob: KubeRay creates a Ray cluster sized for the job, a\n"
        "submitter pod runs `ray job submit -- <entrypoint>` against it, and the cluster is deleted when\n"
        "the job ends. Under Kueue the RayJob waits, suspended, until its whole cluster fits the quota.\n"
    ),
    "tune": (
        "A hyperparameter search (`rayft tune`) as a KubeRay RayJob. Ray Tune runs trials concurrently on\n"
        "this job's cluster, each trial a Ray Train run with resources.num_workers workers; configurations\n"
        "whose memory estimate exceeds search.budget_gib are never launched. The best configuration is\n"
        "written as a job spec under run.output_dir on the shared volume.\n"
    ),
}
GENERATED = (
    "\n"
    "Generated from `render` (what `rayft k8s render SPEC --overlay gpu` writes for any spec) by\n"
    "`python -m orchestrator.backends.kuberay.templates`; edit the code or spec-configmaps.yaml, not\n"
    "this file. tests/integration/test_k8s.py checks that regenerating gives this file exactly.\n"
)

RC = ("spec", "rayClusterSpec")
HEAD = RC + ("headGroupSpec",)
HEAD_POD = HEAD + ("template", "spec")
WORKERS = RC + ("workerGroupSpecs",)
WORKER_POD = WORKERS + (0, "template", "spec")
SUBMITTER = ("spec", "submitterPodTemplate")

COMMENTS: dict[KeyPath, str] = {
    ("metadata", "name"): "At most 47 characters and a DNS-1035 label (KubeRay appends a suffix for the cluster name).",
    ("metadata", "labels", QUEUE_LABEL): (
        "The Kueue LocalQueue (k8s/base/kueue.yaml) that admits this job. Without Kueue the label is\n"
        "inert and the job starts at once."
    ),
    ("spec", "entrypoint"): (
        "The Ray job's driver command, run on the head pod in the runtime env's working_dir. One plain\n"
        "command: KubeRay pastes it into the submitter's bash line, so no `cd`, `&&`, `;` or quotes.\n"
        "Outputs and checkpoints go to the shared volume."
    ),
    ("spec", "jobId"): "The Ray submission id, fixed: applying the RayJob again never starts a second copy.",
    ("spec", "submissionMode"): (
        "K8sJobMode (default): a Kubernetes Job (the submitter) runs `ray job submit` and tails the\n"
        "logs, so `kubectl logs job/<name>` shows the driver output."
    ),
    ("spec", "shutdownAfterJobFinishes"): (
        "Delete the Ray cluster when the job finishes (default false). Kueue requires true."
    ),
    ("spec", "ttlSecondsAfterFinished"): (
        "Seconds to keep the finished cluster before deleting it (default 0). 0: Kueue releases the\n"
        "quota when the job is Complete/Failed, so the GPUs must go then too. Outputs, metrics.jsonl and\n"
        "summary.json are on the shared volume; `kubectl logs job/<name>` (the submitter) keeps the\n"
        "driver's log until the RayJob is deleted."
    ),
    ("spec", "preRunningDeadlineSeconds"): (
        "Seconds from start to Running (cluster up, nodes scaled, image pulled) before KubeRay fails\n"
        "the job and deletes its cluster, releasing the quota (default: no limit)."
    ),
    ("spec", "activeDeadlineSeconds"): (
        "Wall-clock limit for the whole RayJob (cluster start + training), in seconds; past it KubeRay\n"
        "marks the job Failed and tears the cluster down. Default: no limit."
    ),
    ("spec", "submitterConfig", "backoffLimit"): "Retries of the submitter pod itself (default 2).",
    ("spec", "runtimeEnvYAML"): (
        "Ray runtime env: the driver and every worker start in a copy of /home/ray/rayft (the repository\n"
        "in the image, uploaded by the submitter, which runs the same image), so relative data paths such\n"
        "as examples/data/tiny.jsonl resolve on every node. Default: the image's working directory."
    ),
    RC: "The Ray cluster this job runs on: fixed size (no autoscaling: Kueue admits a fixed shape).",
    RC + ("authOptions", "mode"): "KubeRay generates the token and gives it to the submitter too.",
    HEAD + ("serviceType",): "Never exposed outside the cluster.",
    HEAD + ("rayStartParams", "num-cpus"): "The driver runs here; Ray Train workers go to worker pods.",
    HEAD_POD + ("automountServiceAccountToken",): "No autoscaler: nothing here calls the Kubernetes API.",
    HEAD_POD + ("securityContext", "runAsUser"): "The `ray` user of the rayproject/ray images.",
    HEAD_POD + ("containers", 0, "resources"): "From the overlay's node type (headCpu, headMemoryGiB).",
    HEAD_POD + ("volumes", 2): "Ray's object store lives in /dev/shm: 30% of the pod's memory.",
    WORKER_POD + ("nodeSelector", "nvidia.com/gpu.product"): "From the overlay's node type (gpuProduct).",
    WORKER_POD + ("containers", 0, "resources"): (
        "resources.gpus_per_worker GPUs (default 1); CPUs resources.cpus_per_worker x gpus_per_worker\n"
        "+ 1 (Ray Train's coordinator); memory and ephemeral-storage the node type's workerMemoryGiB\n"
        "and workerEphemeralGiB x gpus_per_worker."
    ),
    WORKERS + (0, "rayStartParams", "num-gpus"): "The Ray node's GPUs: the pod's (gpus_per_worker).",
    HEAD_POD[:-1] + ("metadata", "labels", CLUSTER_LABEL): (
        "This job's Ray pods (KubeRay keeps template labels on its pods): the PodDisruptionBudget\n"
        "below selects them by it."
    ),
    SUBMITTER: (
        "The submitter: a Kubernetes Job pod that runs `ray job submit` (KubeRay supplies the command,\n"
        "the dashboard address and the Ray token) and follows the logs. Small and restricted."
    ),
    SUBMITTER + ("metadata", "labels", "rayft.io/submitter"): "NetworkPolicy: may reach the head's 8265.",
    SUBMITTER + ("spec", "restartPolicy"): "Required by KubeRay for the submitter Job.",
    SUBMITTER + ("spec", "containers", 0, "image"): "Needs only the `ray` CLI.",
}
KIND_COMMENTS: dict[str, dict[KeyPath, str]] = {
    "finetune": {
        ("spec", "backoffLimit"): (
            "Retries of the whole RayJob on a new cluster after a failure (default 0). A retry resumes from\n"
            "the last checkpoint on the shared volume."
        ),
        WORKERS: (
            "resources.num_workers / resources.gpus_per_worker pods; each runs gpus_per_worker Ray\n"
            "Train workers, one per GPU."
        ),
    },
    "tune": {
        ("spec", "backoffLimit"): (
            "Retries of the whole RayJob on a new cluster after a failure (default 0). A search is not\n"
            "retried as a whole: failed trials are recorded (out-of-memory ones as infeasible) instead."
        ),
        WORKERS: (
            "The worker pods of every trial that runs at once: resources.num_workers /\n"
            "resources.gpus_per_worker x search.max_concurrent_trials pods, one Ray Train worker per GPU."
        ),
    },
}


PDB_COMMENTS: dict[KeyPath, str] = {
    ("spec", "maxUnavailable"): (
        "No eviction through the Eviction API (kubectl drain, cluster-autoscaler and Karpenter\n"
        "consolidation) of a running Ray pod of this job: losing one rank stops every rank. The RayJob's\n"
        "cluster is deleted when the job ends, and a drain proceeds then."
    ),
    ("spec", "unhealthyPodEvictionPolicy"): (
        "A pod that is not Ready (crash-looping, never started) may still be evicted: a broken job\n"
        "does not block node maintenance."
    ),
    ("spec", "selector"): "Exactly this RayJob's head and worker pods (not its submitter).",
}
PDB_HEADER = "The RayJob's PodDisruptionBudget (render writes it beside every RayJob).\n"


# ---- the templates -------------------------------------------------------------------------------


def example_spec_text(configmap: str, jobs_dir: Path) -> str:
    """The `spec.yaml` of one ConfigMap in k8s/jobs/spec-configmaps.yaml."""
    for doc in yaml.safe_load_all((jobs_dir / SPEC_CONFIGMAPS).read_text()):
        if isinstance(doc, dict) and (doc.get("metadata") or {}).get("name") == configmap:
            return doc["data"]["spec.yaml"]
    raise FileNotFoundError(f"{jobs_dir / SPEC_CONFIGMAPS}: no ConfigMap {configmap}")


def template(kind: str, jobs_dir: Path | None = None) -> Obj:
    """The RayJob of k8s/jobs for `kind`: `render` of its example spec on the gpu overlay, with the
    per-job identity replaced by the template's fixed names (see the module docstring)."""
    from jobs.spec import load_spec

    jobs_dir = jobs_dir or k8s_dir() / "jobs"
    _, name, configmap = TEMPLATES[kind]
    text = example_spec_text(configmap, jobs_dir)
    where = f"{SPEC_CONFIGMAPS} {configmap}"
    if kind == "tune":
        from tune.spec import load_search_spec

        search = load_search_spec(where, [GPU_ON], data=yaml.safe_load(text), files=False)
        spec, trials = search.job(), search.search.max_concurrent_trials or 1
    else:
        spec, trials = load_spec(where, [GPU_ON], data=yaml.safe_load(text), files=False), 1
    rj = copy.deepcopy(
        render(spec, overlay="gpu", kind=kind, spec_text=text, entrypoint_overrides=[GPU_ON], concurrent_trials=trials)[
            1
        ]
    )
    labels = {k: v for k, v in rj["metadata"]["labels"].items() if k != ANN_SPEC_HASH}
    rj["metadata"] = {"name": name, "labels": labels}
    rj["spec"]["jobId"] = name
    rc = rj["spec"]["rayClusterSpec"]
    for group in [rc["headGroupSpec"], *rc["workerGroupSpecs"]]:
        group["template"]["metadata"]["labels"][CLUSTER_LABEL] = name
        for v in group["template"]["spec"]["volumes"]:
            if "configMap" in v:
                v["configMap"]["name"] = configmap
    return rj


def template_pdb(kind: str, rayjob: Obj) -> Obj:
    """The PodDisruptionBudget of the template `rayjob` (`template(kind)`): what render writes
    beside a RayJob (`policy.pod_disruption_budget`), with the template's fixed name."""
    from .policy import RAY_NODE_LABEL, pod_disruption_budget

    _, name, _ = TEMPLATES[kind]
    pdb = pod_disruption_budget(name, {RAY_NODE_LABEL: "true", CLUSTER_LABEL: name})
    pdb["metadata"]["labels"] = {k: v for k, v in rayjob["metadata"]["labels"].items() if k != QUEUE_LABEL}
    return pdb


def to_commented_yaml(obj: Any, comments: dict[KeyPath, str], header: str = "") -> str:
    """Block-style YAML of plain data, with `comments[path]` written above the key at `path`
    (a header above everything). `yaml.safe_load` of the result gives `obj` back."""
    lines = [f"# {ln}".rstrip() for ln in header.splitlines()]
    _emit(obj, (), 0, comments, lines)
    return "\n".join(lines) + "\n"


def _scalar(v: Any) -> str:
    text = yaml.safe_dump(v, default_flow_style=True, width=10**6, allow_unicode=True)
    return text[: -len("\n...\n")] if text.endswith("\n...\n") else text.rstrip("\n")


def _comment(path: KeyPath, indent: int, comments: dict[KeyPath, str], out: list[str]) -> None:
    for ln in comments.get(path, "").splitlines():
        out.append(f"{' ' * indent}# {ln}".rstrip())


def _value(v: Any, path: KeyPath, indent: int, comments: dict[KeyPath, str], out: list[str], lead: str) -> None:
    """`lead` ("key:" or "-") followed by `v`: inline when it is a scalar or empty, else below."""
    pad = " " * indent
    if isinstance(v, str) and "\n" in v:
        out.append(f"{pad}{lead} |" + ("" if v.endswith("\n") else "-"))
        out.extend(f"{pad}  {ln}" if ln else "" for ln in v.rstrip("\n").split("\n"))
    elif isinstance(v, (dict, list)) and v:
        if lead == "-" and isinstance(v, dict):  # "- key: value", the mapping's keys aligned under it
            sub: list[str] = []
            _emit(v, path, indent + 2, comments, sub)
            first = next(i for i, ln in enumerate(sub) if not ln.lstrip().startswith("#"))
            sub[first] = f"{pad}- {sub[first][indent + 2 :]}"
            out.extend(sub)
            return
        out.append(f"{pad}{lead}")
        _emit(v, path, indent + 2, comments, out)
    else:
        out.append(f"{pad}{lead} {_scalar(v)}")


def _emit(node: Any, path: KeyPath, indent: int, comments: dict[KeyPath, str], out: list[str]) -> None:
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, v in items:
        p = path + (key,)
        _comment(p, indent, comments, out)
        _value(v, p, indent, comments, out, f"{_scalar(key)}:" if isinstance(node, dict) else "-")


def generate(jobs_dir: Path | None = None) -> dict[str, str]:
    """{file name under k8s/jobs: its text} for every template."""
    out = {}
    for kind, (fname, _, _) in TEMPLATES.items():
        comments = {**COMMENTS, **KIND_COMMENTS[kind]}
        rj = template(kind, jobs_dir)
        out[fname] = (
            to_commented_yaml(rj, comments, header=HEADERS[kind] + GENERATED)
            + "---\n"
            + to_commented_yaml(template_pdb(kind, rj), PDB_COMMENTS, header=PDB_HEADER)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m orchestrator.backends.kuberay.templates",
        description="Write k8s/jobs/rayjob-*.yaml from `render`.",
    )
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")
    args = ap.parse_args(argv)
    jobs_dir = k8s_dir() / "jobs"
    stale = []
    for fname, text in generate(jobs_dir).items():
        f = jobs_dir / fname
        if f.is_file() and f.read_text() == text:
            continue
        stale.append(fname)
        if not args.check:
            tmp = f.with_name(f".{f.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, f)  # a reader never sees half a file
    verb = "stale" if args.check else "written"
    print(f"{verb}: {', '.join(stale)}" if stale else "up to date", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
