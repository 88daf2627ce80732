"""k8s/ and `rayft k8s render` with outputs in a bucket (run.output_dir s3:// or gs://).

- Rendered: no claim anywhere, a disk emptyDir of the node type's cache size at /mnt/rayft in every
  Ray pod (its ephemeral-storage grown by as much), the RayJob annotated rayft.io/outputs, the S3
  keys by secretKeyRef of the named Secret (default rayft-s3) or a workload identity's
  ServiceAccount, region and endpoint as plain values; a secret's value never in the YAML.
- Built: the overlays gke-gcs, eks-s3 and onprem-s3 are their parent overlay without the claim (and
  EKS's EFS class), with the same emptyDirs and sizes as render, the ServiceAccount annotated for
  the flavour's workload identity, or (onprem-s3) the keys from the Secret by reference.
- The schema tests (KubeRay/Kueue CRDs, CEL rules, kubernetes-validate) and the policy tests of
  test_k8s*.py run over these builds and over the bucket renders (test_k8s.BUCKET_RENDERS in
  RENDERED); here: that they are there, and the policy rules of the variant, each with a case it
  must flag.
- Bad flags: one line, exit 2, nothing on stdout, the value not echoed.
"""

from __future__ import annotations

import copy
import math

import pytest
import yaml
from inproc import rayft_in_process

from jobs.errors import SpecError, UserError
from jobs.spec import load_spec
from orchestrator.backends import kuberay as k8s
from orchestrator.backends.kuberay import policy
from orchestrator.backends.kuberay.object_storage import AccessFlags
from tests.integration.test_k8s import K8S, NEEDS_KUBECTL, OVERLAYS, RENDERED, _inline_spec, kustomizations, spec_of

BUCKET_OVERLAYS = {"gke-gcs": "gke", "eks-s3": "eks", "onprem-s3": "onprem"}  # variant: its parent
S3 = "s3://rayft-runs/outputs/{name}"
GS = "gs://rayft-runs/outputs/{name}"
# A value a user might have in their shell: it must never reach a manifest.
PLANTED_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzz3planted"
PLANTED_ID = "AKIAZZZZPLANTED00042"


def _bucket_spec(uri: str = S3, use_gpu: bool = True, workers: int = 2):
    d = _inline_spec(use_gpu=use_gpu, num_workers=workers)
    d["batch"] = {"global_batch_size": 4 * workers, "micro_batch_size": 4}
    d["run"]["output_dir"] = uri
    return load_spec(data=d, files=False)


def _ray_pods(o: dict) -> dict[str, dict]:
    return dict(policy.ray_pod_specs(o))


def _env(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["containers"][0].get("env") or []}


def _data_volume(pod: dict) -> dict:
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/mnt/rayft")
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])


def _gib(q) -> float:
    return policy.quantity_bytes(q) / 2**30


BUCKET_RENDERED = [(sid, objs) for sid, objs in RENDERED if "+s3" in sid or "+gs" in sid]


# ---- what render writes -----------------------------------------------------------------------------


def test_the_bucket_variants_are_in_the_sets_every_schema_and_policy_test_checks():
    """test_k8s (CRDs, kubernetes-validate, policy), test_k8s_cel (CEL) and test_k8s_flavours take
    RENDERED and every build: the variant is checked by them, on every overlay."""
    assert {sid.split("@")[1] for sid, _ in BUCKET_RENDERED} == set(OVERLAYS)
    assert {sid.split("@")[0] for sid, _ in BUCKET_RENDERED} >= {"tiny-lora.yaml+s3", "tiny-chat.yaml+gs-wi"}
    assert set(BUCKET_OVERLAYS) <= {d.removeprefix("overlays/") for d in kustomizations()}


@pytest.mark.parametrize("sid,objs", BUCKET_RENDERED, ids=[r[0] for r in BUCKET_RENDERED])
def test_a_bucket_render_mounts_no_claim_and_sizes_its_local_disk(sid, objs):
    assert "persistentVolumeClaim" not in yaml.safe_dump(objs) and "claimName" not in yaml.safe_dump(objs)
    rj = objs[1]
    assert rj["metadata"]["annotations"]["rayft.io/outputs"] == "object-storage"
    assert "run.output_dir=s3://rayft-runs/outputs/" in rj["spec"]["entrypoint"] or (
        "run.output_dir=gs://rayft-runs/outputs/" in rj["spec"]["entrypoint"]
    )
    node = k8s.load_node_type(sid.split("@")[1])
    workers = yaml.safe_load(objs[0]["data"]["spec.yaml"])["resources"]["num_workers"]
    for where, pod in _ray_pods(rj).items():
        head = where.endswith(" head")
        cache = node.head_cache_gib if head else node.worker_cache_gib * workers  # all workers in one pod
        disk = node.head_ephemeral_gib if head else node.worker_ephemeral_gib * workers
        vol = _data_volume(pod)
        assert vol["emptyDir"] == {"sizeLimit": f"{cache:g}Gi"}, (sid, where)
        res = pod["containers"][0]["resources"]
        assert _gib(res["requests"]["ephemeral-storage"]) == disk + cache == _gib(res["limits"]["ephemeral-storage"])
    assert policy.policy_violations(objs) == []


@pytest.mark.parametrize("sid,objs", BUCKET_RENDERED, ids=[r[0] for r in BUCKET_RENDERED])
def test_a_bucket_render_puts_the_driver_and_every_worker_on_one_pod(sid, objs):
    """A run that fits one node stages its files once: one worker pod with all the workers' GPUs
    and CPUs plus one for the driver, which asks Ray for a CPU that only that pod has (the head's
    num-cpus is 0)."""
    rj = objs[1]
    res = yaml.safe_load(objs[0]["data"]["spec.yaml"])["resources"]
    groups = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert [(g["replicas"], g["minReplicas"], g["maxReplicas"]) for g in groups] == [(1, 1, 1)]
    assert rj["spec"]["entrypointNumCpus"] == 1
    assert rj["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    limits = groups[0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["cpu"]) == math.ceil(res["cpus_per_worker"] * res["num_workers"]) + 1 + 1
    if res["use_gpu"]:
        assert limits["nvidia.com/gpu"] == str(res["num_workers"])
        assert groups[0]["rayStartParams"] == {"num-gpus": str(res["num_workers"])}


def test_a_bucket_run_over_several_nodes_spreads_its_pods_and_a_search_is_refused(tmp_path):
    """More GPUs than one node has (8; a cluster and a Kueue quota of 16 here): one pod per worker (each node
    stages its own part and fetches what it resumes from: tests/integration/test_object_storage_nodes.py),
    the driver on the head, every rule of the policy kept; a run that fits one node keeps the
    one-pod layout."""
    node_type = yaml.safe_load((K8S / "overlays/gpu/node-type/node-type.yaml").read_text())
    node_type["data"].update(jobQuotaGpus="16", clusterGpus="16")
    (tmp_path / "node-type").mkdir()
    (tmp_path / "node-type/node-type.yaml").write_text(yaml.safe_dump(node_type))
    objs = k8s.render(_bucket_spec(S3, workers=10), overlay=tmp_path)
    rj = objs[1]
    (group,) = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == 10 and group["rayStartParams"] == {"num-gpus": "1"}
    assert "entrypointNumCpus" not in rj["spec"]
    assert policy.policy_violations(objs) == []
    for pod in _ray_pods(rj).values():
        assert _data_volume(pod)["emptyDir"]["sizeLimit"]  # each pod its own staging disk, no claim
    rj = k8s.render(_bucket_spec(S3, workers=4), overlay="gpu")[1]
    assert rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 1
    with pytest.raises(SpecError, match="object storage is not supported for a search on Kubernetes yet") as e:
        k8s.render(_bucket_spec(S3), overlay="gpu", kind="tune", spec_text="name: s\nsearch:\n  trials: 3\n")
    assert "\n" not in str(e.value)


def test_the_shared_volume_variant_is_unchanged():
    objs = k8s.render(spec_of(use_gpu=True), overlay="gpu")
    rj = objs[1]
    assert "rayft.io/outputs" not in rj["metadata"]["annotations"]
    for pod in _ray_pods(rj).values():
        assert _data_volume(pod) == {"name": "rayft-data", "persistentVolumeClaim": {"claimName": "rayft-data"}}
        assert "serviceAccountName" not in pod and not any(k.startswith("AWS_") for k in _env(pod))


def _secret_ref(e: dict) -> dict:
    assert "value" not in e, e
    return e["valueFrom"]["secretKeyRef"]


def test_s3_keys_come_from_the_default_secret_by_reference():
    rj = k8s.render(_bucket_spec(S3), overlay="gke")[1]
    for where, pod in _ray_pods(rj).items():
        env = _env(pod)
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert _secret_ref(env[key]) == {"name": k8s.DEFAULT_S3_SECRET, "key": key, "optional": False}, where
        for key in ("AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL"):
            assert _secret_ref(env[key]) == {"name": "rayft-s3", "key": key, "optional": True}, where
        assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
    submitter = rj["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    assert "env" not in submitter  # the submitter only submits: no keys


def test_a_named_secret_and_plain_region_and_endpoint():
    flags = AccessFlags(
        credentials_secret="team-a.s3-keys", s3_region="eu-west-3", s3_endpoint="https://s3.example:9000"
    )
    rj = k8s.render(_bucket_spec(S3), overlay="onprem", access=flags)[1]
    for pod in _ray_pods(rj).values():
        env = _env(pod)
        assert [e["name"] for e in pod["containers"][0]["env"]].count("AWS_REGION") == 1
        assert _secret_ref(env["AWS_SECRET_ACCESS_KEY"])["name"] == "team-a.s3-keys"
        assert env["AWS_REGION"] == {"name": "AWS_REGION", "value": "eu-west-3"}
        assert env["AWS_ENDPOINT_URL"] == {"name": "AWS_ENDPOINT_URL", "value": "https://s3.example:9000"}


@pytest.mark.parametrize("uri", [S3, GS])
def test_a_workload_identity_is_a_service_account_and_no_secret(uri):
    rj = k8s.render(_bucket_spec(uri), overlay="eks", access=AccessFlags(service_account="rayft-storage"))[1]
    for pod in _ray_pods(rj).values():
        assert pod["serviceAccountName"] == "rayft-storage" and pod["automountServiceAccountToken"] is False
        assert not any("valueFrom" in e and e["name"].startswith("AWS_") for e in pod["containers"][0]["env"])
    assert "secretKeyRef" not in yaml.safe_dump(rj).replace("rayft-hf-token", "")


def test_gs_takes_no_keys_and_the_nodes_identity_by_default():
    rj = k8s.render(_bucket_spec(GS), overlay="gke")[1]
    for pod in _ray_pods(rj).values():
        assert not any(k.startswith("AWS_") for k in _env(pod)) and "serviceAccountName" not in pod
    with pytest.raises(SpecError, match="--credentials-secret is for s3://"):
        k8s.render(_bucket_spec(GS), overlay="gke", access=AccessFlags(credentials_secret="rayft-s3"))


@pytest.mark.parametrize(
    "flags,expect",
    [
        (AccessFlags(credentials_secret="rayft-s3"), "--credentials-secret is for run.output_dir on object storage"),
        (AccessFlags(service_account="rayft-storage"), "--service-account is for run.output_dir on object storage"),
    ],
)
def test_a_flag_that_would_do_nothing_is_refused(flags, expect):
    with pytest.raises(SpecError, match=expect):
        k8s.render(spec_of(use_gpu=True), overlay="gpu", access=flags)


@pytest.mark.parametrize(
    "flags,expect",
    [
        (AccessFlags(credentials_secret="Bad_Name"), "--credentials-secret: not a Kubernetes object name"),
        (AccessFlags(service_account="-x"), "--service-account: not a Kubernetes object name"),
        (AccessFlags(credentials_secret="a" * 254), "--credentials-secret: not a Kubernetes object name"),
        (AccessFlags(s3_endpoint="http://key:secret@host:9000"), "--s3-endpoint"),
        (AccessFlags(s3_region="us east"), "--s3-region"),
    ],
)
def test_render_refuses_bad_names_without_echoing_them(flags, expect):
    with pytest.raises(UserError, match=expect) as e:
        k8s.render(_bucket_spec(S3), overlay="gpu", access=flags)
    assert "Bad_Name" not in str(e.value) and "secret@" not in str(e.value)


def test_the_backend_passes_the_flags_to_render():
    backend = k8s.KubeRayBackend(overlay="gke", access=AccessFlags(service_account="rayft-storage"))
    rj = backend.render(_bucket_spec(GS))[1]
    assert {p["serviceAccountName"] for p in _ray_pods(rj).values()} == {"rayft-storage"}


# ---- the CLI: secrets stay out, bad input is one line -------------------------------------------------


def test_submit_takes_the_same_flags():
    import os

    args = ("submit", "--backend", "kuberay", "--dry-run", "examples/tiny-lora.yaml", f"run.output_dir={GS}")
    r = rayft_in_process(*args, "--service-account", "wi-sa", env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count('"serviceAccountName": "wi-sa"') == 2 and "persistentVolumeClaim" not in r.stdout


def _cli(*args: str, env: dict | None = None):
    import os

    return rayft_in_process("k8s", "render", "examples/tiny-lora.yaml", *args, env={**os.environ, **(env or {})})


def test_a_planted_secret_never_reaches_the_rendered_yaml():
    env = {"AWS_ACCESS_KEY_ID": PLANTED_ID, "AWS_SECRET_ACCESS_KEY": PLANTED_KEY, "AWS_SESSION_TOKEN": PLANTED_KEY}
    for flags in ([], ["--service-account", "rayft-storage"], ["--s3-region", "us-east-1"]):
        r = _cli(f"run.output_dir={S3}", "resources.use_gpu=true", *flags, env=env)
        assert r.returncode == 0, r.stderr
        assert "kind: RayJob" in r.stdout and "emptyDir" in r.stdout and "persistentVolumeClaim" not in r.stdout
        for planted in (PLANTED_KEY, PLANTED_ID, "planted"):
            assert planted not in r.stdout and planted not in r.stderr, flags


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--credentials-secret", "Rayft_S3"], "argument --credentials-secret: not a Kubernetes object name"),
        (["--credentials-secret", PLANTED_KEY], "argument --credentials-secret: not a Kubernetes object name"),
        (["--service-account", "a..b"], "argument --service-account: not a Kubernetes object name"),
        (["--s3-endpoint", f"http://{PLANTED_ID}:x@h"], "--s3-endpoint: expected http(s)://HOST[:PORT]"),
        (["--credentials-secret", "rayft-s3", "run.output_dir=outputs/{name}"], "is on the shared volume"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(args, expect):
    r = _cli(f"run.output_dir={S3}", *args)
    assert r.returncode == 2 and r.stdout == "", r
    assert expect in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Rayft_S3" not in r.stderr and PLANTED_KEY not in r.stderr and PLANTED_ID not in r.stderr


# ---- the policy of the variant ----------------------------------------------------------------------


def _bucket_objs() -> list[dict]:
    return copy.deepcopy(k8s.render(_bucket_spec(S3), overlay="gpu"))


def _worker(rj: dict) -> dict:
    return rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]


def _add_claim(rj):
    _worker(rj)["volumes"].append({"name": "extra", "persistentVolumeClaim": {"claimName": "rayft-data"}})


def _claim_at_mount(rj):
    _worker(rj)["volumes"][0] = {"name": "rayft-data", "persistentVolumeClaim": {"claimName": "rayft-data"}}


def _memory_medium(rj):
    _worker(rj)["volumes"][0]["emptyDir"]["medium"] = "Memory"


def _no_size(rj):
    _worker(rj)["volumes"][0]["emptyDir"].pop("sizeLimit")


def _disk_below_cache(rj):
    for part in ("requests", "limits"):
        _worker(rj)["containers"][0]["resources"][part]["ephemeral-storage"] = "50Gi"


def _no_annotation(rj):
    rj["metadata"]["annotations"].pop("rayft.io/outputs")


def _local_output(rj):
    rj["spec"]["entrypoint"] = rj["spec"]["entrypoint"].replace("s3://rayft-runs", "/mnt/rayft")


def _odd_annotation(rj):
    rj["metadata"]["annotations"]["rayft.io/outputs"] = "s3"


def _inline_key(rj):
    env = _worker(rj)["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != "AWS_SECRET_ACCESS_KEY"]
    env.append({"name": "AWS_SECRET_ACCESS_KEY", "value": "not-a-real-one"})


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (_add_claim, "volume extra is a claim"),
        (_claim_at_mount, "must be a disk emptyDir"),
        (_memory_medium, "must be a disk emptyDir"),
        (_no_size, "must have a sizeLimit"),
        (_disk_below_cache, "is below the emptyDir"),
        (_no_annotation, "the data volume (a PVC) must be mounted"),
        (_local_output, "entrypoint's run.output_dir is not s3:// or gs://"),
        (_odd_annotation, "annotation rayft.io/outputs: 's3'"),
        (_inline_key, "env AWS_SECRET_ACCESS_KEY has an inline value"),
    ],
    ids=[
        "claim",
        "claim-at-mount",
        "memory",
        "no-size",
        "disk-below",
        "no-annotation",
        "local-out",
        "odd",
        "inline",
    ],
)
def test_policy_flags_a_broken_bucket_rayjob(mutate, expect):
    objs = _bucket_objs()
    assert policy.policy_violations(objs) == []
    mutate(objs[1])
    bad = policy.policy_violations(objs)
    assert any(expect in b for b in bad), bad


def test_policy_without_the_annotation_still_requires_the_claim():
    """What the policy refused before it refuses still: an emptyDir at /mnt/rayft of a Ray object
    that does not say its outputs are in a bucket."""
    rj = copy.deepcopy(k8s.render(spec_of(use_gpu=True), overlay="gpu")[1])
    _worker(rj)["volumes"][0] = {"name": "rayft-data", "emptyDir": {"sizeLimit": "100Gi"}}
    assert any("worker group gpu" in b and "(a PVC) must be mounted" in b for b in policy.policy_violations([rj]))


# ---- the kustomize variants -------------------------------------------------------------------------


@NEEDS_KUBECTL
@pytest.mark.parametrize("variant", sorted(BUCKET_OVERLAYS))
def test_a_bucket_overlay_is_its_parent_without_the_claim(built, variant):
    parent = BUCKET_OVERLAYS[variant]
    objs, base = built[f"overlays/{variant}"], built[f"overlays/{parent}"]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    gone = {("PersistentVolumeClaim", "rayft-data"), ("StorageClass", "rayft-efs")}
    assert kinds == {(o["kind"], o["metadata"]["name"]) for o in base} - gone | {("ServiceAccount", "rayft-storage")}
    assert "persistentVolumeClaim" not in yaml.safe_dump(objs)
    assert all(o["metadata"].get("namespace") == "rayft" for o in objs if o["kind"] == "ServiceAccount")
    assert policy.policy_violations(objs) == []


@NEEDS_KUBECTL
@pytest.mark.parametrize("variant", sorted(BUCKET_OVERLAYS))
def test_a_bucket_overlay_sizes_its_pods_as_render_does(built, variant):
    node = k8s.load_node_type(BUCKET_OVERLAYS[variant])
    rc = next(o for o in built[f"overlays/{variant}"] if o["kind"] == "RayCluster")
    assert rc["metadata"]["annotations"]["rayft.io/outputs"] == "object-storage"
    for where, pod in _ray_pods(rc).items():
        head = where.endswith(" head")
        cache = node.head_cache_gib if head else node.worker_cache_gib
        disk = node.head_ephemeral_gib if head else node.worker_ephemeral_gib
        assert _data_volume(pod) == {"name": "rayft-data", "emptyDir": {"sizeLimit": f"{cache:g}Gi"}}, where
        assert _gib(pod["containers"][0]["resources"]["limits"]["ephemeral-storage"]) == disk + cache, where
        assert pod["serviceAccountName"] == "rayft-storage", where


@NEEDS_KUBECTL
@pytest.mark.parametrize(
    "variant,annotation",
    [("gke-gcs", "iam.gke.io/gcp-service-account"), ("eks-s3", "eks.amazonaws.com/role-arn"), ("onprem-s3", None)],
)
def test_the_service_account_carries_the_flavours_identity(built, variant, annotation):
    sa = next(o for o in built[f"overlays/{variant}"] if o["kind"] == "ServiceAccount")
    assert list(sa["metadata"].get("annotations") or {}) == ([annotation] if annotation else [])


@NEEDS_KUBECTL
def test_the_s3_compatible_overlay_takes_the_keys_from_the_secret(built):
    rc = next(o for o in built["overlays/onprem-s3"] if o["kind"] == "RayCluster")
    for where, pod in _ray_pods(rc).items():
        env = _env(pod)
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert _secret_ref(env[key]) == {"name": "rayft-s3", "key": key}, where
        assert _secret_ref(env["AWS_ENDPOINT_URL"])["optional"] is True
    for variant in ("gke-gcs", "eks-s3"):  # a workload identity: no keys at all
        rc = next(o for o in built[f"overlays/{variant}"] if o["kind"] == "RayCluster")
        assert "AWS_" not in yaml.safe_dump(rc), variant


@NEEDS_KUBECTL
def test_policy_flags_a_bucket_overlay_that_keeps_a_claim(built):
    objs = copy.deepcopy(built["overlays/gke-gcs"])
    rc = next(o for o in objs if o["kind"] == "RayCluster")
    rc["spec"]["headGroupSpec"]["template"]["spec"]["volumes"][0] = {
        "name": "rayft-data",
        "persistentVolumeClaim": {"claimName": "rayft-data"},
    }
    assert any("RayCluster/rayft head" in b and "disk emptyDir" in b for b in policy.policy_violations(objs))
