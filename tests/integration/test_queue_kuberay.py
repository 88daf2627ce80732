"""The queue's driver on KubeRay (`rayft queue run --backend kuberay`), through the real
`kubernetes` client against the fake API server of tests/helpers/k8s_fake_api.py, which also plays Kueue
(RayJobs created suspended until the test admits them) and KubeRay (status transitions; a failure
with its submitter pod's log).

- a queued job becomes one RayJob, labelled for the LocalQueue; suspended it is queued, not failed;
  admitted it runs and its success is recorded once;
- out of memory (read from the failed RayJob's log) -> a second RayJob at half the micro-batch and
  twice the accumulation, visible in its spec ConfigMap and annotations; other failures -> retried
  under `-a<N>` names up to the job's limit;
- a driver SIGKILLed between creating the RayJob and recording it, restarted, creates no second one;
- a job that cannot fit the node type's GPU (memory plan, GPUs per node) is never created, and
  `rayft queue status` says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from k8s_fake_api import FakeKubeAPI, crds_available, strict_crd_validator

from jobs.errors import UserError
from jobs.memory import plan_for_spec
from jobs.spec import load_spec
from orchestrator.backends import kuberay as k8s
from orchestrator.backends.kuberay.client import attempt_name
from orchestrator.queue.admission import Demand, fit_node_type
from orchestrator.queue.driver import Driver, DriverConfig, enqueue
from orchestrator.queue.store import Queue
from tests.integration.test_submit import BIN, ROOT, SPEC, TINY, rayft

NS = "rayft"
GPU = [*TINY, "resources.use_gpu=true"]
OOM_LOG = (
    "step 0\nTraceback (most recent call last):\n"
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.19 GiB total)\n"
)


@pytest.fixture
def api():
    validate = strict_crd_validator("RayJob") if crds_available() else None
    with FakeKubeAPI(validate_rayjob=validate, kueue=True) as fake:
        yield fake


def driver(q: Queue, api: FakeKubeAPI, overlay="gpu", max_retries_backoff_s: float = 0.0) -> Driver:
    be = k8s.KubeRayBackend(NS, api_client=api.api_client(), overlay=overlay)
    return Driver(q, be, DriverConfig(poll_s=0.01, backoff_s=max_retries_backoff_s, log=lambda m: None))


def add(q: Queue, *overrides: str, max_retries: int = 2) -> int:
    return enqueue(q, SPEC, [*GPU, *overrides], max_retries=max_retries, working_dir=str(ROOT))[0]


def rayjob_posts(api: FakeKubeAPI) -> list[int]:
    return [code for method, path, code in api.requests if method == "POST" and path.endswith("/rayjobs")]


def spec_in_configmap(api: FakeKubeAPI, name: str):
    return load_spec(data=yaml.safe_load(api.configmaps[(NS, f"{name}-spec")]["data"]["spec.yaml"]), files=False)


def status_table(db: Path, capsys) -> str:
    """`rayft queue status` in this process (a CLI start costs seconds)."""
    from argparse import Namespace

    from orchestrator.cli.queue import cmd_queue_status

    capsys.readouterr()
    assert cmd_queue_status(Namespace(db=str(db), json=False)) == 0
    return " ".join(capsys.readouterr().out.split())


def test_a_queued_job_is_one_rayjob_that_kueue_admits(api, tmp_path, capsys):
    q = Queue(tmp_path / "q.db")
    jid = add(q, "name=kr-life")
    d = driver(q, api)
    d.step()
    row = q.job(jid)
    name = row["submission_id"]
    assert row["state"] == "RUNNING" and api.created() == [name]
    rj = api.rayjobs[(NS, name)]
    assert rj["metadata"]["labels"][k8s.QUEUE_LABEL] == "rayft" and rj["spec"]["suspend"] is True
    ann = rj["metadata"]["annotations"]
    assert (ann["rayft.io/queue-job"], ann["rayft.io/attempt"], ann["rayft.io/micro-batch-size"]) == (
        str(jid),
        "1",
        "4",
    )
    # its disruption budget and spec go with it (owner reference to the RayJob)
    for obj in (api.pdbs[(NS, name)], api.configmaps[(NS, f"{name}-spec")]):
        assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [rj["metadata"]["uid"]]

    for _ in range(3):  # Kueue holds it: queued, not failed, not created again
        d.step()
    row = q.job(jid)
    assert (row["state"], row["attempt"], row["retries"]) == ("RUNNING", 1, 0)
    assert row["status_detail"].startswith("QUEUED: suspended: waiting for Kueue")
    assert "QUEUED (cluster)" in status_table(tmp_path / "q.db", capsys)

    api.admit(NS, name)
    seen = []
    for _ in range(4):
        d.step()
        seen.append(q.job(jid)["status_detail"])
    assert seen[:3] == ["PENDING", "RUNNING", "SUCCEEDED"]
    row = q.job(jid)
    assert row["state"] == "SUCCEEDED" and row["attempt"] == 1
    assert "QUEUED (cluster)" not in status_table(tmp_path / "q.db", capsys)
    assert api.created() == [name] and rayjob_posts(api) == [201]
    kinds = [e["kind"] for e in q.events(jid)]
    assert (kinds.count("submitting"), kinds.count("running"), kinds.count("ended")) == (1, 1, 1)


def test_out_of_memory_retries_with_half_the_micro_batch_and_failures_retry_to_the_limit(api, tmp_path, capsys):
    q = Queue(tmp_path / "q.db")
    d = driver(q, api)
    oom = add(q, "name=kr-oom", max_retries=0)
    d.step()
    first = q.job(oom)["submission_id"]
    api.admit(NS, first)
    d.step()
    api.finish(NS, first, message="Job entrypoint command failed with exit code 1", log=OOM_LOG)
    d.step()  # the failure is read, the job queued again and resubmitted
    row = q.job(oom)
    second = row["submission_id"]
    assert (row["state"], row["attempt"], row["oom_retried"], row["retries"]) == ("RUNNING", 2, 1, 0)
    assert (row["micro_batch_size"], row["grad_accum_steps"]) == (2, 4)
    assert api.created() == [first, second] and second.endswith("-a2")
    # the second RayJob runs the changed spec: half the micro-batch, twice the accumulation, same global batch
    s1, s2 = spec_in_configmap(api, first), spec_in_configmap(api, second)
    assert (s1.batch.micro_batch_size, s1.grad_accum_steps) == (4, 2)
    assert (s2.batch.micro_batch_size, s2.grad_accum_steps, s2.batch.global_batch_size) == (2, 4, 8)
    rj2 = api.rayjobs[(NS, second)]
    ann = rj2["metadata"]["annotations"]
    assert (ann["rayft.io/micro-batch-size"], ann["rayft.io/grad-accum-steps"], ann["rayft.io/attempt"]) == (
        "2",
        "4",
        "2",
    )
    assert rj2["spec"]["jobId"] == second
    mounts = [
        v["configMap"]["name"]
        for v in rj2["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["volumes"]
        if "configMap" in v
    ]
    assert mounts == [f"{second}-spec"]
    assert first not in json.dumps(rj2) and second in json.dumps(api.pdbs[(NS, second)]["spec"]["selector"])
    api.admit(NS, second)
    for _ in range(3):
        d.step()
    row = q.job(oom)
    assert row["state"] == "SUCCEEDED" and len(api.created()) == 2
    assert [a["status"] for a in q.attempts(oom)] == ["FAILED", "SUCCEEDED"]
    table = status_table(tmp_path / "q.db", capsys)
    assert "micro_batch_size 4 -> 2, grad_accum_steps 2 -> 4" in table and "2 x 4" in table

    # another failure: retried under the next attempt's name, same spec, until max_retries is spent
    flaky = add(q, "name=kr-flaky", max_retries=1)
    d.step()
    f1 = q.job(flaky)["submission_id"]
    for name in (f1, attempt_name(f1, 2)):
        api.admit(NS, name)
        d.step()
        api.finish(
            NS, name, message="Job entrypoint command failed with exit code 1", log="ValueError: the data went away\n"
        )
        d.step()
    row = q.job(flaky)
    assert (row["state"], row["attempt"], row["retries"]) == ("FAILED", 2, 1)
    assert api.created()[2:] == [f1, attempt_name(f1, 2)]
    assert spec_in_configmap(api, attempt_name(f1, 2)).spec_hash() == spec_in_configmap(api, f1).spec_hash()


def test_attempt_names_stay_valid_rayjob_names():
    long = "a" * 36 + "-0123456789"  # 47 characters, as render.job_name makes them
    assert attempt_name(long, 1) == long
    for n in (2, 10, 123):
        got = attempt_name(long, n)
        assert len(got) <= 47 and got.endswith(f"-0123456789-a{n}") and got[0].isalpha()
    assert attempt_name("kr-x-0123456789", 3) == "kr-x-0123456789-a3"


def _kubeconfig(api: FakeKubeAPI, tmp_path: Path) -> dict:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": NS}}],
                "users": [{"name": "u", "user": {}}],
            }
        )
    )
    env = dict(os.environ, KUBECONFIG=str(path), RAYFT_HTTP_TIMEOUT_S="20")
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env.pop("RAYFT_QUEUE_FAULT", None)
    return env


@pytest.mark.slow  # three CLI starts: 22-37 s on 2 cores
def test_a_driver_killed_after_creating_the_rayjob_does_not_create_a_second(api, tmp_path):
    env = _kubeconfig(api, tmp_path)
    db = tmp_path / "q.db"
    # data on the cluster's volume: `queue add --backend kuberay` does not look for it here
    on_volume = "data.path=/mnt/rayft/data/kr-kill.jsonl"
    with pytest.raises(UserError, match="kr-kill.jsonl"):  # the Ray Jobs backend would upload it
        enqueue(Queue(db), SPEC, [*GPU, "name=kr-kill", on_volume], working_dir=str(ROOT))
    assert not db.exists()
    r = rayft("queue", "add", SPEC, *GPU, "name=kr-kill", on_volume, "--backend", "kuberay", "--db", str(db), env=env)
    assert r.returncode == 0, r.stderr
    run = [
        str(BIN / "rayft"),
        "queue",
        "run",
        "--backend",
        "kuberay",
        "--namespace",
        NS,
        "--overlay",
        "gpu",
        "--db",
        str(db),
        "--poll",
        "0.05",
    ]
    # killed between "the API created the RayJob" and "the queue file says so"
    crash = subprocess.run(
        run, cwd=ROOT, env=dict(env, RAYFT_QUEUE_FAULT="kill_after_submit"), capture_output=True, text=True, timeout=120
    )
    assert crash.returncode == -signal.SIGKILL, crash.stderr
    q = Queue(db)
    row = q.jobs()[0]
    assert row["state"] == "SUBMITTING" and api.created() == [row["submission_id"]]
    name = row["submission_id"]
    api.admit(NS, name)
    # restarted: it finds the RayJob by its name, tracks it to the end, creates nothing
    done = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{name}: tracking" in done.stderr
    row = Queue(db).job(row["id"])
    assert (row["state"], row["attempt"], row["submission_id"]) == ("SUCCEEDED", 1, name)
    assert api.created() == [name] and rayjob_posts(api) == [201]  # not even a second create call
    kinds = [e["kind"] for e in Queue(db).events(row["id"])]
    assert kinds.count("submitting") == 1 and kinds.count("ended") == 1
    assert spec_in_configmap(api, name).data.path == ["/mnt/rayft/data/kr-kill.jsonl"]


def _small_gpu_overlay(tmp_path: Path, gpu_memory_gib: float, gpus_per_node: int) -> Path:
    src = yaml.safe_load((k8s.k8s_dir() / "overlays" / "gpu" / "node-type" / "node-type.yaml").read_text())
    src["data"].update(
        nodeType="small-gpu-x1",
        gpuMemoryGiB=str(gpu_memory_gib),
        gpusPerNode=str(gpus_per_node),
        clusterGpus=str(gpus_per_node),
    )
    d = tmp_path / "small-gpu" / "node-type"
    d.mkdir(parents=True)
    (d / "node-type.yaml").write_text(yaml.safe_dump(src))
    return d.parent


def test_a_job_that_cannot_fit_the_gpu_is_never_created(api, tmp_path, capsys):
    # A GPU between the job's estimate with checkpointing and without: checkpointing off cannot fit,
    # `auto` fits by checkpointing (the one memory plan decides both).
    long = "data.max_seq_len=8192"
    spec_off = load_spec(ROOT / SPEC, [*GPU, long, "memory.gradient_checkpointing=false"], files=False)
    on = plan_for_spec(
        load_spec(ROOT / SPEC, [*GPU, long, "memory.gradient_checkpointing=true"], files=False), device="cuda"
    ).total_gib
    gpu_gib = round((on + plan_for_spec(spec_off, device="cuda").total_gib) / 2, 3)
    need = plan_for_spec(spec_off, device="cuda", gpu_memory_gib=gpu_gib).total_gib
    assert on < gpu_gib < need
    overlay = _small_gpu_overlay(tmp_path, gpu_gib, 1)
    q = Queue(tmp_path / "q.db")
    big = add(q, "name=kr-big", long, "memory.gradient_checkpointing=false", max_retries=0)
    pair = add(q, "name=kr-pair", "resources.num_workers=2", "resources.gpus_per_worker=2")
    fits = add(q, "name=kr-fits", long, "memory.gradient_checkpointing=auto")
    d = driver(q, api, overlay=str(overlay))
    d.step()
    d.step()
    assert api.created() == [q.job(fits)["submission_id"]]  # the others never reached the API
    assert q.job(big)["state"] == q.job(pair)["state"] == "QUEUED"
    why_big = [f"needs {need:.1f} GiB per GPU", "gradient checkpointing off", f"its GPU has {gpu_gib:g} GiB"]
    why_pair = "resources.gpus_per_worker=2 needs 2 GPUs on one node, it has 1"
    for row, whys in ((q.job(big), why_big), (q.job(pair), [why_pair])):
        assert row["status_detail"].startswith("can never fit node type small-gpu/small-gpu-x1 (1 x NVIDIA-H100")
        assert all(w in row["status_detail"] for w in whys), row["status_detail"]
    table = status_table(tmp_path / "q.db", capsys)
    assert all(w in table for w in [*why_big, why_pair]), table
    # alone with jobs that can never fit, `queue run` stops (exit 1) instead of waiting forever
    name = q.job(fits)["submission_id"]
    assert d.q.cancel(fits, stop=d.backend.stop) == "CANCELED"
    assert not api.rayjobs and not api.configmaps and not api.pdbs and (NS, name) not in api.pdbs
    assert d.unschedulable_only()


def _demand(workers: int, per_pod: int) -> Demand:
    return Demand(workers, 1.0, True, gib_by_every={0: 10.0, 1: 5.0}, gc_mode="false", gpus_per_worker=per_pod)


def test_gpus_per_worker_against_the_node_type():
    """On KubeRay a worker pod's gpus_per_worker GPUs must be on one node of the node type, and the
    job's GPUs within what Kueue hands out to RayJobs (jobQuotaGpus) and the cluster (clusterGpus);
    waiting for free quota is Kueue's business."""
    gpu = k8s.load_node_type("gpu")  # 8 x H100 per node, 8 in the cluster
    assert (gpu.gpus_per_node, gpu.cluster_gpus, gpu.job_quota_gpus) == (8, 8, 6)
    demand = _demand
    assert fit_node_type(demand(6, 2), gpu) == (True, True, "")
    assert fit_node_type(demand(4, 4), gpu)[0]
    ok, ever, why = fit_node_type(demand(16, 16), gpu)
    assert (ok, ever) == (False, False) and "resources.gpus_per_worker=16 needs 16 GPUs on one node, it has 8" in why
    cpu = k8s.load_node_type("dev-cpu")
    ok, ever, why = fit_node_type(demand(2, 2), cpu)
    assert not ever and "it has no GPUs" in why
    assert fit_node_type(Demand(2, 1.0), cpu)[0]  # CPU jobs: render sizes them


def test_a_job_over_the_kueue_quota_is_never_created(api, tmp_path, capsys):
    """8 GPUs on an overlay whose ClusterQueue hands out 6: Kueue would keep the RayJob suspended
    forever, so the queue marks it never-fits, naming its GPUs, the quota and where it is set."""
    gpu = k8s.load_node_type("gpu")
    ok, ever, why = fit_node_type(_demand(8, 1), gpu)
    assert (ok, ever) == (False, False)
    assert why.startswith(
        "can never fit node type gpu/h100-80gb-x8 (8 x NVIDIA-H100-80GB-HBM3): "
        "resources.num_workers=8: 8 GPUs exceed the 6 GPUs the Kueue ClusterQueue of overlay gpu"
    )
    assert "jobQuotaGpus in k8s/overlays/gpu/node-type/node-type.yaml" in why
    assert fit_node_type(_demand(8, 2), gpu)[1] is False  # however the GPUs are packed
    no_quota = dataclasses.replace(gpu, job_quota_gpus=0)  # not known: clusterGpus only
    assert fit_node_type(_demand(8, 1), no_quota) == (True, True, "")
    ok, ever, why = fit_node_type(_demand(16, 2), no_quota)
    assert not ever and "16 GPUs exceed the 8 GPUs of overlay gpu's cluster (clusterGpus" in why
    q = Queue(tmp_path / "q.db")
    big = add(q, "name=kr-eight", "resources.num_workers=8", "batch.micro_batch_size=1", max_retries=0)
    fits = add(q, "name=kr-six", "resources.num_workers=6", "batch.global_batch_size=48", "batch.micro_batch_size=1")
    d = driver(q, api)
    d.step()
    assert api.created() == [q.job(fits)["submission_id"]]  # the big one never reached the API
    row = q.job(big)
    assert row["state"] == "QUEUED" and "8 GPUs exceed the 6 GPUs" in row["status_detail"]
    assert "jobQuotaGpus" in status_table(tmp_path / "q.db", capsys)
