"""k8s/ on real clusters: one /dev/shm rule for every Ray pod, RayJobs that hand their GPUs back
when Kueue hands back the quota, ephemeral storage and caches on the data volume, and node types
that name the cluster flavour (GFD, GKE, EKS/Karpenter). Every check runs over every kustomize
build and every `render` variant of tests/integration/test_k8s.py, and each policy rule has a negative case.
"""

from __future__ import annotations

import copy

import pytest
from k8s_fake_api import CRD_DIR, OBJECT_META, strictify

from orchestrator.backends.kuberay import policy
from orchestrator.backends.kuberay.render import render
from tests.integration.test_k8s import RENDERED, spec_of

GIB = 2**30


def _ray_pods(objs):
    for o in objs:
        yield from policy.ray_pod_specs(o)


def _everything(built) -> list[tuple[str, list[dict]]]:
    return [(d, objs) for d, objs in built.items()] + list(RENDERED)


def _shm_volume(pod):
    c = pod["containers"][0]
    name = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    return next(v for v in pod["volumes"] if v["name"] == name)


# ---- one /dev/shm rule -----------------------------------------------------------------------------


def test_shm_rule():
    assert policy.shm_gib(16) == 5 and policy.shm_gib(96) == 29 and policy.shm_gib(2) == 1
    assert policy.shm_gib(1) == 0.5
    for mem in (0.5, 1, 3, 7.5, 16, 80, 96, 1000):
        assert policy.shm_gib(mem) >= policy.SHM_FRACTION * mem
    assert policy.quantity_bytes("16Gi") == 16 * GIB and policy.quantity_bytes("512Mi") == GIB / 2
    assert policy.quantity_bytes("1G") == 1e9 and policy.quantity_bytes("lots") is None


def test_every_ray_pod_follows_the_one_shm_rule(built):
    """Built overlays, jobs builds and rendered RayJobs: /dev/shm is exactly shm_gib(memory)."""
    seen = 0
    for sid, objs in _everything(built):
        for where, pod in _ray_pods(objs):
            mem_gib = policy.quantity_bytes(pod["containers"][0]["resources"]["limits"]["memory"]) / GIB
            size = policy.quantity_bytes(_shm_volume(pod)["emptyDir"]["sizeLimit"]) / GIB
            assert size == policy.shm_gib(mem_gib), (sid, where, size, mem_gib)
            seen += 1
    assert seen >= 2 * len(RENDERED) + 8


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda pod: _shm_volume(pod)["emptyDir"].update(sizeLimit="4Gi"), "below 30%"),
        (lambda pod: _shm_volume(pod)["emptyDir"].pop("medium"), "memory emptyDir"),
        (lambda pod: pod["containers"][0]["volumeMounts"].pop(), "memory emptyDir"),
        (lambda pod: pod["containers"][0]["resources"]["limits"].pop("memory"), "limits.memory"),
    ],
    ids=["small", "disk", "unmounted", "no-limit"],
)
def test_policy_flags_a_ray_pod_with_too_little_shm(mutate, expect):
    good = render(spec_of(use_gpu=True), overlay="gpu")
    assert policy.policy_violations(good) == []
    rj = copy.deepcopy(good[1])
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    head["containers"][0]["volumeMounts"] = [
        m for m in head["containers"][0]["volumeMounts"] if m["mountPath"] != "/dev/shm"
    ] + [next(m for m in head["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm")]
    mutate(head)
    bad = policy.policy_violations([rj])
    assert any("head" in b and expect in b for b in bad), bad


def test_policy_flags_the_old_head_shm_of_the_standing_cluster(built):
    rc = copy.deepcopy(next(o for o in built["overlays/gpu"] if o["kind"] == "RayCluster"))
    pdb = next(o for o in built["overlays/gpu"] if o["kind"] == "PodDisruptionBudget")
    assert policy.policy_violations([rc, pdb]) == []
    _shm_volume(rc["spec"]["headGroupSpec"]["template"]["spec"])["emptyDir"]["sizeLimit"] = "4Gi"  # < 4.8Gi
    assert any(
        "head" in b and "4Gi is below 30% of the memory limit 16Gi" in b for b in policy.policy_violations([rc, pdb])
    )


# ---- RayJobs hand the GPUs back when Kueue hands back the quota -------------------------------------


def _rayjobs(built):
    return [(sid, o) for sid, objs in _everything(built) for o in objs if o.get("kind") == "RayJob"]


def test_every_rayjob_deletes_its_cluster_at_once_and_bounds_its_start(built):
    rayjobs = _rayjobs(built)
    assert len(rayjobs) >= len(RENDERED) + 4  # rendered + both templates in each jobs build
    for sid, rj in rayjobs:
        s = rj["spec"]
        assert s["shutdownAfterJobFinishes"] is True and s["ttlSecondsAfterFinished"] == 0, sid
        assert 0 < s["preRunningDeadlineSeconds"] < s["activeDeadlineSeconds"], sid


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda s: s.update(ttlSecondsAfterFinished=600), "ttlSecondsAfterFinished must be 0"),
        (lambda s: s.pop("preRunningDeadlineSeconds"), "preRunningDeadlineSeconds must be set"),
        (lambda s: s.update(preRunningDeadlineSeconds=0), "preRunningDeadlineSeconds must be set"),
        (lambda s: s.update(preRunningDeadlineSeconds=s["activeDeadlineSeconds"]), "below activeDeadlineSeconds"),
    ],
    ids=["ttl-600", "no-pre-running", "zero", "past-active"],
)
def test_policy_flags_a_rayjob_that_holds_gpus(mutate, expect):
    objs = copy.deepcopy(render(spec_of(use_gpu=True), overlay="gpu"))
    assert policy.policy_violations(objs) == []
    mutate(objs[1]["spec"])
    assert any(expect in b for b in policy.policy_violations(objs)), policy.policy_violations(objs)


def test_ttl_absent_is_kuberays_default_zero():
    objs = copy.deepcopy(render(spec_of(use_gpu=True), overlay="gpu"))
    objs[1]["spec"].pop("ttlSecondsAfterFinished")
    assert policy.policy_violations(objs) == []


# ---- ephemeral storage; downloads and caches on the data volume -------------------------------------


def test_every_ray_container_bounds_its_disk_and_caches_on_the_data_volume(built):
    seen = 0
    for sid, objs in _everything(built):
        for o in objs:
            if o.get("kind") not in ("RayCluster", "RayJob"):
                continue
            ray = dict(policy.ray_pod_specs(o))
            for where, pod in policy.pod_specs(o):
                for c in pod["containers"]:
                    res = c["resources"]
                    assert policy.quantity_bytes(res["requests"]["ephemeral-storage"]) > 0, (sid, where)
                    assert res["requests"]["ephemeral-storage"] == res["limits"]["ephemeral-storage"], (sid, where)
                if where in ray:
                    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
                    assert env["HF_HOME"] == "/mnt/rayft/cache/huggingface", (sid, where)
                    assert env["RAYFT_CACHE"] == "/mnt/rayft/cache/rayft", (sid, where)
                    seen += 1
    assert seen >= 2 * len(RENDERED) + 8


def _mut_env(name):
    def f(pod):
        pod["containers"][0]["env"] = [e for e in pod["containers"][0]["env"] if e["name"] != name]

    return f


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda pod: pod["containers"][0]["resources"]["limits"].pop("ephemeral-storage"), "ephemeral-storage"),
        (
            lambda pod: pod["containers"][0]["resources"]["requests"].update({"ephemeral-storage": "900Gi"}),
            "request is above its limit",
        ),
        (_mut_env("HF_HOME"), "env HF_HOME"),
        (_mut_env("RAYFT_CACHE"), "env RAYFT_CACHE"),
        (
            lambda pod: pod["containers"][0]["env"].__setitem__(0, {"name": "HF_HOME", "value": "/tmp/hf"}),
            "env HF_HOME",
        ),
        (
            lambda pod: [
                m.update(mountPath="/data")
                for m in pod["containers"][0]["volumeMounts"]
                if m["mountPath"] == "/mnt/rayft"
            ],
            "data volume",
        ),
    ],
    ids=["no-limit", "request-above", "no-hf-home", "no-cache", "hf-home-in-tmp", "no-data-volume"],
)
def test_policy_flags_a_worker_that_would_fill_the_node_disk(mutate, expect):
    rj = copy.deepcopy(render(spec_of(use_gpu=True), overlay="gpu")[1])
    mutate(rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"])
    bad = policy.policy_violations([rj])
    assert any("worker group gpu" in b and expect in b for b in bad), bad


def test_policy_flags_a_submitter_without_an_ephemeral_storage_limit():
    rj = copy.deepcopy(render(spec_of(use_gpu=True), overlay="gpu")[1])
    rj["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["resources"]["requests"].pop("ephemeral-storage")
    assert any("submitter" in b and "ephemeral-storage" in b for b in policy.policy_violations([rj]))


# ---- node types name the cluster flavour ------------------------------------------------------------

from jobs.errors import SpecError, UserError  # noqa: E402
from orchestrator.backends.kuberay import node_types  # noqa: E402

FLAVOURS = {
    "gke": "cloud.google.com/gke-accelerator",
    "eks": "karpenter.k8s.aws/instance-gpu-name",
    "onprem": "nvidia.com/gpu.product",
    "gpu": "nvidia.com/gpu.product",
}


def test_the_flavour_overlays_exist():
    assert set(FLAVOURS) <= set(node_types.overlays())


@pytest.mark.parametrize("ov", sorted(FLAVOURS))
def test_built_and_rendered_gpu_pods_select_the_flavours_label(built, ov):
    node = node_types.load_node_type(ov)
    want = node.gpu_selector()
    assert list(want) == [FLAVOURS[ov]] and all(want.values())
    objs = built[f"overlays/{ov}"] + built[f"overlays/{ov}/jobs"]
    rendered = render(spec_of(use_gpu=True), overlay=ov)
    assert policy.policy_violations(rendered) == []
    groups = [
        g
        for o in objs + rendered
        for g in (
            (o.get("spec") or {}).get("workerGroupSpecs")
            or ((o.get("spec") or {}).get("rayClusterSpec") or {}).get("workerGroupSpecs")
            or []
        )
    ]
    assert len(groups) == 4  # standing cluster, 2 templates, rendered
    for g in groups:
        pod = g["template"]["spec"]
        assert pod["nodeSelector"] == want, (ov, g["groupName"])
        assert pod["tolerations"] == [dict(t) for t in node.gpu_tolerations], (ov, g["groupName"])
    flavor = next(
        o for o in built[f"overlays/{ov}"] if o["kind"] == "ResourceFlavor" and o["metadata"]["name"] == "rayft-gpu"
    )
    assert flavor["spec"]["nodeLabels"] == want


@pytest.mark.parametrize("ov", ["gke", "eks", "onprem"])
def test_the_data_volume_uses_the_flavours_rwx_class(built, ov):
    node = node_types.load_node_type(ov)
    assert node.storage_class and node.access_mode == "ReadWriteMany"
    pvc = next(o for o in built[f"overlays/{ov}"] if o["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == node.storage_class
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_eks_efs_class_gives_the_ray_user_its_directory(built):
    sc = next(o for o in built["overlays/eks"] if o["kind"] == "StorageClass")
    assert sc["metadata"]["name"] == node_types.load_node_type("eks").storage_class
    assert sc["provisioner"] == "efs.csi.aws.com"
    p = sc["parameters"]
    assert (p["provisioningMode"], p["uid"], p["gid"]) == ("efs-ap", "1000", "100")
    head = next(o for o in built["overlays/eks"] if o["kind"] == "RayCluster")["spec"]["headGroupSpec"]
    sctx = head["template"]["spec"]["securityContext"]
    assert (str(sctx["runAsUser"]), str(sctx["runAsGroup"])) == (p["uid"], p["gid"])


def _gpu_quota(objs) -> int:
    cq = next(o for o in objs if o["kind"] == "ClusterQueue")
    return sum(
        r["nominalQuota"]
        for rg in cq["spec"]["resourceGroups"]
        for fl in rg["flavors"]
        for r in fl["resources"]
        if r["name"] == "nvidia.com/gpu"
    )


def _standing_max_gpus(objs) -> int:
    rc = next(o for o in objs if o["kind"] == "RayCluster")
    return sum(
        g["maxReplicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0))
        for g in rc["spec"]["workerGroupSpecs"]
    )


@pytest.mark.parametrize("ov", sorted(FLAVOURS) + ["dev-cpu"])
def test_quota_plus_standing_cluster_fits_the_gpus_of_the_overlay(built, ov):
    node = node_types.load_node_type(ov)
    gpus = node.cluster_gpus or node.gpus_per_node
    objs = built[f"overlays/{ov}"]
    assert _gpu_quota(objs) + _standing_max_gpus(objs) <= gpus, ov
    assert ov == "dev-cpu" or _gpu_quota(objs) > 0


def test_quota_check_catches_the_old_gpu_overlay(built):
    objs = copy.deepcopy(built["overlays/gpu"])
    next(o for o in objs if o["kind"] == "RayCluster")["spec"]["workerGroupSpecs"][0]["maxReplicas"] = 8
    cq = next(o for o in objs if o["kind"] == "ClusterQueue")
    cq["spec"]["resourceGroups"][0]["flavors"][1]["resources"][2]["nominalQuota"] = 8
    assert _gpu_quota(objs) + _standing_max_gpus(objs) == 16 > node_types.load_node_type("gpu").cluster_gpus


GPU_OVERLAYS = sorted(FLAVOURS)


@pytest.mark.parametrize("ov", GPU_OVERLAYS + ["dev-cpu"])
def test_node_type_records_the_gpu_quota_of_its_cluster_queue(built, ov):
    """jobQuotaGpus is what render and queue admission check against: it must be the quota Kueue
    really has, so the two cannot drift apart."""
    node = node_types.load_node_type(ov)
    assert node.job_quota_gpus == _gpu_quota(built[f"overlays/{ov}"]), ov
    assert ov == "dev-cpu" or 0 < node.job_quota_gpus < node.cluster_gpus


def _spec_with_workers(workers: int):
    from jobs.spec import load_spec
    from tests.integration.test_k8s import _inline_spec

    d = _inline_spec(use_gpu=True, num_workers=workers)
    d["batch"] = {"global_batch_size": 48, "micro_batch_size": 1}  # divides by 6 and by 8 workers
    return load_spec(data=d, files=False)


@pytest.mark.parametrize("ov", GPU_OVERLAYS)
def test_render_refuses_more_gpus_than_kueue_hands_out(ov):
    quota = node_types.load_node_type(ov).job_quota_gpus
    objs = render(_spec_with_workers(quota), overlay=ov)  # exactly the quota: admitted
    assert objs[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == quota
    with pytest.raises(SpecError) as e:
        render(_spec_with_workers(quota + 2), overlay=ov, spec_path="big.yaml")
    msg = str(e.value)
    assert msg.startswith(f"big.yaml: resources.num_workers={quota + 2}: {quota + 2} GPUs exceed the {quota} GPUs"), msg
    assert f"jobQuotaGpus in k8s/overlays/{ov}/node-type/node-type.yaml" in msg and "\n" not in msg


def test_render_counts_every_concurrent_trial_of_a_search_against_the_quota():
    spec = _spec_with_workers(2)
    rj = render(spec, overlay="gpu", kind="tune", spec_text="name: s\n", concurrent_trials=3)[1]
    assert rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 6
    with pytest.raises(
        SpecError,
        match=r"resources.num_workers=2 x search.max_concurrent_trials=4: 8 GPUs exceed "
        r"the 6 GPUs .*jobQuotaGpus",
    ):
        render(spec, overlay="gpu", kind="tune", spec_text="name: s\n", concurrent_trials=4)
    render(spec, overlay="gpu", concurrent_trials=4)  # a fine-tune has no trials


def test_no_quota_in_the_node_type_is_not_checked(tmp_path):
    """jobQuotaGpus 0 or absent: the Kueue quota is not known, only clusterGpus is checked."""
    spec = _spec_with_workers(8)
    for data in ({}, {"jobQuotaGpus": "0"}, {"jobQuotaGpus": "", "clusterGpus": "8"}):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        render(spec, overlay=_node_type_dir(d, gpusPerNode="8", **data))
    ov = _node_type_dir(tmp_path / "q4", gpusPerNode="8", jobQuotaGpus="4", clusterGpus="8")
    with pytest.raises(SpecError, match=f"8 GPUs exceed the 4 GPUs .*jobQuotaGpus in {ov}/node-type/node-type.yaml"):
        render(spec, overlay=ov)
    with pytest.raises(SpecError, match=r"8 GPUs exceed the 4 GPUs of overlay ov's cluster \(clusterGpus"):
        render(spec, overlay=_node_type_dir(tmp_path / "c4", gpusPerNode="8", clusterGpus="4"))


def test_render_and_submit_cli_refuse_a_job_over_the_quota_before_creating_it(monkeypatch, capsys):
    from k8s_fake_api import FakeKubeAPI

    import orchestrator.backends.kuberay as kuberay
    from orchestrator.cli import main

    job = ["examples/tiny-lora.yaml", "resources.use_gpu=true", "batch.micro_batch_size=1"]
    assert main(["k8s", "render", *job, "resources.num_workers=8", "--overlay", "gke"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "8 GPUs exceed the 6 GPUs" in err and "Traceback" not in err
    assert "k8s/overlays/gke/node-type/node-type.yaml" in err
    real = kuberay.KubeRayBackend
    with FakeKubeAPI() as api:
        monkeypatch.setattr(kuberay, "KubeRayBackend", lambda **kw: real(api_client=api.api_client(), **kw))
        assert main(["submit", "--backend", "kuberay", *job, "resources.num_workers=8", "--overlay", "gpu"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "8 GPUs exceed the 6 GPUs" in err and "jobQuotaGpus" in err
        assert not api.rayjobs and not api.configmaps and not api.pdbs
        assert main(["submit", "--backend", "kuberay", *job, "resources.num_workers=4", "--overlay", "gpu"]) == 0
        assert len(api.rayjobs) == 1  # the same path does create


def test_shipped_examples_fit_the_quota_of_the_gpu_overlays():
    """Every example runs on every GPU overlay (as a GPU job) except the 70B sizing example, whose
    8 GPUs are more than the 6 the overlays' Kueue hands out: refused, never left suspended."""
    for ov in GPU_OVERLAYS:
        fits = {sid.split("+")[0].split("@")[0] for sid, _ in RENDERED if sid.endswith(f"@{ov}")}
        assert {"tiny-lora.yaml", "tiny-chat.yaml", "smollm2-lora.yaml", "tune-accum.yaml"} <= fits, (ov, fits)
        assert "llama70b-lora.yaml" not in fits


def _node_type_dir(tmp_path, **data):
    d = tmp_path / "ov" / "node-type"
    d.mkdir(parents=True)
    base = {
        "cpusPerNode": "8",
        "workerMemoryGiB": "8",
        "headCpu": "1",
        "headMemoryGiB": "2",
        "image": "x:1",
        "gpusPerNode": "1",
        "gpuMemoryGiB": "24",
        "gpuProduct": "NVIDIA-L4",
        **data,
    }
    import yaml

    (d / "node-type.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "rayft-node-type"}, "data": base})
    )
    return tmp_path / "ov"


def test_custom_label_and_tolerations_reach_the_rendered_job(tmp_path):
    ov = _node_type_dir(
        tmp_path,
        flavour="custom",
        gpuLabelKey="example.com/gpu",
        gpuLabelValue="l4",
        gpuTolerations="[{key: dedicated, operator: Equal, value: gpu, effect: NoSchedule}]",
    )
    pod = render(spec_of(use_gpu=True), overlay=ov)[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"][
        "spec"
    ]
    assert pod["nodeSelector"] == {"example.com/gpu": "l4"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]


@pytest.mark.parametrize(
    "data,expect",
    [
        ({"flavour": "aks"}, "data.flavour 'aks'"),
        ({"flavour": "custom"}, "data.gpuLabelKey is missing"),
        ({"gpuTolerations": "{key: x}"}, "gpuTolerations must be a YAML list"),
        ({"gpuTolerations": "[unclosed"}, "gpuTolerations is not YAML"),
        ({"accessMode": "ReadMany"}, "data.accessMode 'ReadMany'"),
        ({"jobQuotaGpus": "six"}, "data.jobQuotaGpus 'six': expected a whole number of GPUs"),
        ({"jobQuotaGpus": "-2"}, "data.jobQuotaGpus '-2'"),
    ],
    ids=[
        "flavour",
        "custom-no-key",
        "tolerations-map",
        "tolerations-yaml",
        "access-mode",
        "quota-word",
        "quota-negative",
    ],
)
def test_a_bad_node_type_is_one_clear_error(tmp_path, data, expect):
    with pytest.raises(UserError, match=expect.replace("[", r"\[").replace("{", r"\{")):
        node_types.load_node_type(_node_type_dir(tmp_path, **data))


def test_render_cli_follows_the_overlays_node_type(capsys):
    from orchestrator.cli import main

    assert main(["k8s", "render", "examples/tiny-lora.yaml", "resources.use_gpu=true", "--overlay", "eks"]) == 0
    out = capsys.readouterr().out
    assert "karpenter.k8s.aws/instance-gpu-name: h100" in out and "nvidia.com/gpu.product" not in out


# ---- images: by digest, or by tag pulled Always ---------------------------------------------------

DIGEST = "sha256:" + "0123456789abcdef" * 4


def _pull_policies(objs):
    return {c["imagePullPolicy"] for o in objs for _, pod in policy.pod_specs(o) for c in pod["containers"]}


def test_image_by_digest_is_pulled_if_not_present_and_by_tag_always():
    spec = spec_of(use_gpu=True)
    by_digest = render(spec, overlay="gpu", image=f"registry.example:5000/team/rayft@{DIGEST}")
    assert _pull_policies(by_digest) == {"IfNotPresent"}
    by_tag = render(spec, overlay="gpu", image="registry.example/rayft:0.1.0")
    assert _pull_policies(by_tag) == {"Always"}
    assert _pull_policies(render(spec, overlay="gpu", image=f"reg.example/rayft:0.1.0@{DIGEST}")) == {"IfNotPresent"}


@pytest.mark.parametrize("image", ["bad image!", "reg.example/rayft@sha256:abc", "Rayft:1", "reg/rayft:1;rm"])
def test_a_bad_image_reference_is_one_clear_error(image):
    from jobs.errors import UserError

    with pytest.raises(UserError, match="not an image reference"):
        render(spec_of(use_gpu=True), overlay="gpu", image=image)


def test_every_built_and_rendered_tagged_image_is_pulled_always(built):
    for sid, objs in _everything(built):
        for o in objs:
            for where, pod in policy.pod_specs(o):
                for c in pod["containers"]:
                    assert "@sha256:" in c["image"] or c["imagePullPolicy"] == "Always", (sid, where)


def test_policy_flags_a_tag_pulled_if_not_present():
    rj = copy.deepcopy(render(spec_of(use_gpu=True), overlay="gpu", image="registry.example/rayft:0.1.0")[1])
    rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["imagePullPolicy"] = (
        "IfNotPresent"
    )
    assert any(
        "worker group gpu" in b and "by tag with imagePullPolicy IfNotPresent" in b
        for b in policy.policy_violations([rj])
    )


# ---- disruption: annotations each autoscaler honours, a priority class -----------------------------


def test_every_ray_pod_is_kept_from_consolidation_and_has_the_priority_class(built):
    seen = 0
    for sid, objs in _everything(built):
        for o in objs:
            for where, template in policy._ray_pod_templates(o):
                ann = template["metadata"]["annotations"]
                assert ann["karpenter.sh/do-not-disrupt"] == "true", (sid, where)
                assert ann["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false", (sid, where)
                assert template["spec"]["priorityClassName"] == policy.PRIORITY_CLASS, (sid, where)
                seen += 1
    assert seen >= 2 * len(RENDERED) + 8
    for ov in node_types.overlays():
        pcs = [o for o in built[f"overlays/{ov}"] if o["kind"] == "PriorityClass"]
        assert [p["metadata"]["name"] for p in pcs] == [policy.PRIORITY_CLASS], ov
        assert 0 < pcs[0]["value"] < 1_000_000_000 and not pcs[0].get("globalDefault"), ov


def _worker_template(rj):
    return rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda t: t["metadata"]["annotations"].pop("karpenter.sh/do-not-disrupt"), "karpenter.sh/do-not-disrupt"),
        (
            lambda t: t["metadata"]["annotations"].update({"cluster-autoscaler.kubernetes.io/safe-to-evict": "true"}),
            "safe-to-evict",
        ),
        (lambda t: t["spec"].pop("priorityClassName"), "priorityClassName"),
    ],
    ids=["karpenter", "cluster-autoscaler", "priority"],
)
def test_policy_flags_an_evictable_training_pod(mutate, expect):
    rj = copy.deepcopy(render(spec_of(use_gpu=True), overlay="gpu")[1])
    mutate(_worker_template(rj))
    assert any("worker group gpu" in b and expect in b for b in policy.policy_violations([rj]))


# ---- the operator's NetworkPolicy selector comes from the node type ---------------------------------


def _operator_rule(objs):
    np = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "rayft-ray-nodes")
    rule = np["spec"]["ingress"][2]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8265}]
    return rule["from"][0]["podSelector"]["matchLabels"]


def test_the_operator_selector_follows_the_node_type(built, tmp_path):
    import shutil

    from tests.integration.test_k8s import K8S, build

    for ov in node_types.overlays():
        assert _operator_rule(built[f"overlays/{ov}"]) == {"app.kubernetes.io/name": "kuberay-operator"}, ov
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    f = root / "overlays/gke/node-type/node-type.yaml"
    f.write_text(f.read_text().replace("kuberayOperatorName: kuberay-operator", "kuberayOperatorName: my-kuberay"))
    assert _operator_rule(build(root / "overlays/gke")) == {"app.kubernetes.io/name": "my-kuberay"}


# ---- Kueue objects of every overlay, strictly against the Kueue CRDs ------------------------------

KUEUE_CRD_DIR = CRD_DIR.parent / "kueue-crds"
KUEUE_CRDS = {
    "ResourceFlavor": "resourceflavors.yaml",
    "ClusterQueue": "clusterqueues.yaml",
    "LocalQueue": "localqueues.yaml",
}


def _kueue_validator(kind: str):
    import jsonschema
    import yaml

    crd = yaml.load(
        (KUEUE_CRD_DIR / KUEUE_CRDS[kind]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    )
    v = next(v for v in crd["spec"]["versions"] if v["name"] == "v1beta2")
    schema = strictify(v["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META
    schema["properties"]["apiVersion"] = {"const": "kueue.x-k8s.io/v1beta2"}
    schema["properties"]["kind"] = {"const": kind}
    val = jsonschema.Draft7Validator(schema)
    return lambda obj: [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in val.iter_errors(obj)]


NEEDS_KUEUE_CRDS = pytest.mark.skipif(
    not all((KUEUE_CRD_DIR / f).is_file() for f in KUEUE_CRDS.values()),
    reason=f"Kueue CRDs not found in {KUEUE_CRD_DIR}",
)


@NEEDS_KUEUE_CRDS
def test_kueue_objects_of_every_overlay_validate_strictly_against_the_kueue_crds(built):
    validators = {k: _kueue_validator(k) for k in KUEUE_CRDS}
    n = 0
    for sid, objs in built.items():
        for o in objs:
            if o["kind"] in validators:
                assert validators[o["kind"]](o) == [], (sid, o["kind"], o["metadata"]["name"])
                n += 1
    assert n >= 4 * len(node_types.overlays())
    bad = copy.deepcopy(
        next(o for o in built["overlays/eks"] if o["kind"] == "ResourceFlavor" and o["metadata"]["name"] == "rayft-gpu")
    )
    bad["spec"]["nodeLabel"] = bad["spec"].pop("nodeLabels")  # a misspelt field
    assert any("nodeLabel" in e for e in validators["ResourceFlavor"](bad))
    cq = copy.deepcopy(next(o for o in built["overlays/gke"] if o["kind"] == "ClusterQueue"))
    cq["spec"]["resourceGroups"][0]["flavors"][1]["resources"][2]["quota"] = 6  # not a ResourceQuota field
    assert validators["ClusterQueue"](cq)


# ---- every Ray pod set under a PodDisruptionBudget ---------------------------------------------------

from k8s_fake_api import k8s_validate_errors  # noqa: E402


def _pdbs(objs):
    return [o for o in objs if o.get("kind") == "PodDisruptionBudget"]


def _ray_templates(o):
    rc = o["spec"] if o["kind"] == "RayCluster" else o["spec"]["rayClusterSpec"]
    return [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]


def test_every_ray_object_comes_with_a_pdb_selecting_exactly_its_ray_pods(built):
    """Each RayCluster/RayJob of every build and render has one PDB, maxUnavailable 0, that selects
    its head and worker pods (by the labels in their templates, which KubeRay keeps on the pods)
    and not its submitter; kubernetes-validate --strict accepts it (here once per distinct budget;
    test_k8s validates every rendered and built object)."""
    seen, validated = 0, set()
    for sid, objs in _everything(built):
        pdbs = _pdbs(objs)
        for o in objs:
            if o.get("kind") not in ("RayCluster", "RayJob"):
                continue
            (pdb,) = [p for p in pdbs if p["metadata"]["name"] == o["metadata"]["name"]]
            assert pdb["spec"]["maxUnavailable"] == 0, sid
            sel = pdb["spec"]["selector"]
            assert all(policy.selector_matches(sel, t["metadata"]["labels"]) for t in _ray_templates(o)), sid
            if o["kind"] == "RayJob":
                assert not policy.selector_matches(sel, o["spec"]["submitterPodTemplate"]["metadata"]["labels"])
            assert sel["matchLabels"][policy.CLUSTER_LABEL] == o["metadata"]["name"], sid
            assert pdb["metadata"].get("namespace") == o["metadata"].get("namespace"), sid
            shape = repr({k: v for k, v in pdb["spec"].items() if k != "selector"})
            if shape not in validated:
                assert k8s_validate_errors(pdb) == [], sid
                validated.add(shape)
            seen += 1
    assert seen >= len(RENDERED) + 3 * len(node_types.overlays())


def test_selector_matching():
    labels = {"a": "1", "b": "2"}
    assert policy.selector_matches({"matchLabels": {"a": "1"}}, labels)
    assert not policy.selector_matches({"matchLabels": {"a": "2"}}, labels)
    assert policy.selector_matches({}, labels)  # policy/v1: empty selects all
    assert not policy.selector_matches(None, labels)
    assert policy.selector_matches({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "3"]}]}, labels)
    assert not policy.selector_matches(
        {"matchExpressions": [{"key": "b", "operator": "NotIn", "values": ["2"]}]}, labels
    )
    assert not policy.selector_matches({"matchExpressions": [{"key": "c", "operator": "Exists"}]}, labels)
    assert policy.selector_matches({"matchExpressions": [{"key": "c", "operator": "DoesNotExist"}]}, labels)


def _pdb_of(objs):
    return next(o for o in objs if o["kind"] == "PodDisruptionBudget")


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda objs: objs.remove(_pdb_of(objs)), "no PodDisruptionBudget"),
        (lambda objs: _pdb_of(objs)["spec"].update(maxUnavailable=1), "allows evictions"),
        (
            lambda objs: _pdb_of(objs)["spec"]["selector"]["matchLabels"].update({policy.CLUSTER_LABEL: "other"}),
            "no PodDisruptionBudget",
        ),
        (lambda objs: _pdb_of(objs)["metadata"].update(namespace="elsewhere"), "no PodDisruptionBudget"),
        (lambda objs: _pdb_of(objs)["spec"].update(selector={}), "submitter pod too"),
        (
            lambda objs: objs[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"].pop(
                policy.CLUSTER_LABEL
            ),
            "worker group gpu: no PodDisruptionBudget",
        ),
    ],
    ids=["missing", "max-unavailable-1", "other-cluster", "other-namespace", "selects-all", "unlabelled-workers"],
)
def test_policy_flags_ray_pods_a_drain_could_evict(mutate, expect):
    objs = copy.deepcopy(render(spec_of(use_gpu=True), overlay="gpu", namespace="rayft"))
    assert policy.policy_violations(objs) == []
    mutate(objs)
    bad = policy.policy_violations(objs)
    assert any(expect in b for b in bad), bad


def test_policy_flags_one_pdb_over_two_clusters(built):
    a = render(spec_of(use_gpu=True), overlay="gpu")
    b = render(spec_of(use_gpu=True, num_workers=4), overlay="gpu")
    assert policy.policy_violations(a + b) == []  # one budget each: fine together
    wide = copy.deepcopy(_pdb_of(a))
    wide["spec"]["selector"] = {"matchLabels": {policy.RAY_NODE_LABEL: "true"}}
    bad = policy.policy_violations([a[1], b[1], wide])
    assert any("selects the pods of 2 Ray objects" in x for x in bad), bad
    rc = next(o for o in built["overlays/gpu"] if o["kind"] == "RayCluster")
    assert any("RayCluster/rayft head: no PodDisruptionBudget" in x for x in policy.policy_violations([rc]))


# ---- resources.gpus_per_worker: Ray Train workers packed into GPU pods ----------------------------


def _cpu(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


@pytest.mark.parametrize("gpus_per_worker", [1, 2, 8])
def test_gpus_per_worker_packs_workers_into_pods(gpus_per_worker, tmp_path):
    """8 Ray Train workers (one per GPU) on the gpu overlay's 8-GPU node type (with Kueue handing
    all 8 to RayJobs): 8/n pods of n GPUs, CPU = cpus_per_worker x n + 1, memory, ephemeral storage
    and /dev/shm n times one worker's, and Ray started with num-gpus n."""
    ov = tmp_path / "gpu-whole-node"
    (ov / "node-type").mkdir(parents=True)
    src = node_types.k8s_dir() / "overlays/gpu/node-type/node-type.yaml"
    (ov / "node-type/node-type.yaml").write_text(src.read_text().replace('jobQuotaGpus: "6"', 'jobQuotaGpus: "8"'))
    node = node_types.load_node_type(ov)
    assert node.gpus_per_node == node.job_quota_gpus == 8
    n = gpus_per_worker
    spec = spec_of(use_gpu=True, num_workers=8, gpus_per_worker=n, cpus_per_worker=3)
    objs = render(spec, overlay=ov)
    assert policy.policy_violations(objs) == []
    (g,) = objs[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 8 // n
    assert g["rayStartParams"] == {"num-gpus": str(n)}
    pod = g["template"]["spec"]
    lim = pod["containers"][0]["resources"]["limits"]
    assert pod["containers"][0]["resources"]["requests"] == lim
    assert int(lim["nvidia.com/gpu"]) == n
    assert g["replicas"] * int(lim["nvidia.com/gpu"]) == spec.resources.num_workers  # one worker per GPU
    assert _cpu(lim["cpu"]) == 3 * n + 1
    assert policy.quantity_bytes(lim["memory"]) == n * node.worker_memory_gib * GIB
    assert policy.quantity_bytes(lim["ephemeral-storage"]) == n * node.worker_ephemeral_gib * GIB
    assert (
        policy.quantity_bytes(_shm_volume(pod)["emptyDir"]["sizeLimit"])
        == policy.shm_gib(n * node.worker_memory_gib) * GIB
    )


def test_gpus_per_worker_multiplies_the_trials_of_a_search():
    spec = spec_of(use_gpu=True, num_workers=2, gpus_per_worker=2)
    rj = render(spec, overlay="gpu", kind="tune", spec_text="name: s\n", concurrent_trials=3)[1]
    assert rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 2 // 2 * 3


def test_gpus_per_worker_beyond_the_node_is_refused_naming_both(tmp_path):
    from jobs.errors import SpecError

    src = node_types.k8s_dir() / "overlays/gpu/node-type/node-type.yaml"
    ov = tmp_path / "four-gpus"
    (ov / "node-type").mkdir(parents=True)
    (ov / "node-type/node-type.yaml").write_text(src.read_text().replace('gpusPerNode: "8"', 'gpusPerNode: "4"'))
    assert node_types.load_node_type(ov).gpus_per_node == 4
    render(spec_of(use_gpu=True, num_workers=4, gpus_per_worker=4), overlay=ov)  # 4 fits 4
    with pytest.raises(SpecError) as e:
        render(spec_of(use_gpu=True, num_workers=8, gpus_per_worker=8), overlay=ov)
    msg = str(e.value)
    assert "\n" not in msg and "resources.gpus_per_worker=8" in msg and "has 4 GPU(s) per node" in msg
    with pytest.raises(SpecError) as e:  # 12 x 8 + 1 = 97 CPUs > 96
        render(spec_of(use_gpu=True, num_workers=8, gpus_per_worker=8, cpus_per_worker=12), overlay="gpu")
    assert "97" in str(e.value) and "96" in str(e.value) and "gpus_per_worker=8" in str(e.value)
