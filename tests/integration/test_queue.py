"""The queue and its driver: priorities, a concurrency limit, admission on free resources (CPUs
on the real local cluster; GPUs by memory against synthetic node lists, since no GPU is here),
a driver SIGKILLed mid-queue and restarted, and the out-of-memory retry."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from inproc import rayft_in_process
from polling import wait_until

from jobs.errors import UserError
from jobs.spec import load_spec
from orchestrator.backends.base import ClusterView
from orchestrator.backends.ray_jobs import cluster_view_from_api
from orchestrator.queue.admission import GPU_MEMORY_GIB, Demand, parse_gpu_memory, place, reserve
from orchestrator.queue.driver import Driver, enqueue
from orchestrator.queue.store import Queue
from tests.integration.test_submit import BIN, ROOT, SPEC, TINY, _token_mode, jobs_on, metrics_steps, rayft, uniq  # noqa: F401

# ---- admission (pure) ------------------------------------------------------------------------


def view(*nodes: dict) -> ClusterView:
    """A ClusterView parsed from the dashboard's JSON shapes (as `/api/v0/nodes` and
    `/api/cluster_status` return them), with per-node used resources."""
    result, usage = [], {}
    for i, n in enumerate(nodes):
        res = {"CPU": n.get("cpu", 8.0), "memory": 1e11}
        if n.get("gpu"):
            res["GPU"] = float(n["gpu"])
        if n.get("type"):
            res[f"accelerator_type:{n['type']}"] = 1.0
        result.append({"node_id": f"n{i}", "state": "ALIVE", "resources_total": res, "labels": {}})
        usage[f"n{i}"] = {
            "CPU": [n.get("cpu_used", 0.0), res["CPU"]],
            "GPU": [n.get("gpu_used", 0.0), res.get("GPU", 0.0)],
        }
    return cluster_view_from_api(
        {"data": {"result": {"result": result}}},
        {"data": {"clusterStatus": {"loadMetricsReport": {"usageByNode": usage}}}},
    )


def gpu_job(workers: int = 1, off: float = 30.0, on: float = 12.0, gc: str = "false", accel=None) -> Demand:
    return Demand(workers, 1.0, True, accel, gib_by_every={0: off, 1: on}, gc_mode=gc)


def test_gpu_admission_by_memory_type_and_free_gpus():
    t4, a100, h100 = dict(gpu=4, type="T4"), dict(gpu=1, type="A100-80G"), dict(gpu=2, type="H100")
    assert GPU_MEMORY_GIB["H200"] == 141 and GPU_MEMORY_GIB["L4"] == 24 and GPU_MEMORY_GIB["A100-40G"] == 40
    # 30 GiB per GPU: not on T4s (16 GiB), yes on the A100-80G
    ok, ever, why = reserve(gpu_job(), view(t4))
    assert (ok, ever) == (False, False) and "needs 30.0 GiB per GPU, T4 has 16 GiB" in why
    assert reserve(gpu_job(), view(t4, a100))[0]
    # two workers of 30 GiB: one fits on the A100, the second has nowhere to go
    ok, ever, why = reserve(gpu_job(workers=2), view(t4, a100))
    assert (ok, ever) == (False, False)
    # ... but H100s have room, unless they are busy
    assert reserve(gpu_job(workers=2), view(t4, h100))[0]
    ok, ever, why = reserve(gpu_job(workers=2), view(t4, dict(h100, gpu_used=1)))
    assert (ok, ever) == (False, True) and why.startswith("waiting for resources: needs")
    # resources already held by this queue's jobs count even when the usage report lags
    ok, ever, _ = reserve(gpu_job(workers=2), view(t4, h100), held=(3.0, 5.0))
    assert (ok, ever) == (False, True)
    # gradient_checkpointing auto: 30 GiB without it does not fit a T4, 12 GiB with it does
    assert reserve(gpu_job(gc="auto"), view(t4))[0]
    assert not reserve(gpu_job(gc="auto", on=20.0), view(t4))[1]
    # resources.accelerator_type restricts the nodes
    ok, ever, why = reserve(gpu_job(off=10, accel="H100"), view(t4))
    assert not ever and "is not H100" in why
    assert reserve(gpu_job(off=10, accel="H100"), view(t4, h100))[0]
    # an unknown GPU type is not guessed; --gpu-memory overrides the table
    ok, ever, why = reserve(gpu_job(off=10), view(dict(gpu=1, type="Mystery-9000")))
    assert not ever and "--gpu-memory Mystery-9000=GiB" in why
    assert reserve(gpu_job(off=10), view(dict(gpu=1, type="Mystery-9000")), parse_gpu_memory(["Mystery-9000=24"]))[0]
    assert reserve(gpu_job(off=10), view(dict(gpu=1)), parse_gpu_memory(["16"]))[0]
    assert not reserve(gpu_job(), view(t4), parse_gpu_memory(["T4=24"]))[1]
    assert reserve(gpu_job(), view(t4), parse_gpu_memory(["t4=32"]))[0]
    # CPUs: the driver's share plus cpus_per_worker per worker
    cpu = Demand(2, 1.5, driver_cpus=0.5)
    assert reserve(cpu, view(dict(cpu=4)))[0]
    ok, ever, why = reserve(cpu, view(dict(cpu=4, cpu_used=1)))
    assert (ok, ever) == (False, True) and "needs 3.5 CPUs, 3 CPUs free" in why
    assert not reserve(Demand(1, 8.0), view(dict(cpu=4), dict(cpu=4)))[1]  # 8 CPUs on no single node
    assert not reserve(gpu_job(off=1), view(dict(cpu=64)))[1]
    with pytest.raises(UserError):
        parse_gpu_memory(["H100=lots"])


def test_gpus_per_worker_needs_whole_pods_on_one_node():
    """resources.gpus_per_worker=2: every two workers are one pod whose two GPUs share a node."""

    def pods_of_two(workers: int = 4) -> Demand:
        return Demand(workers, 1.0, True, gib_by_every={0: 10.0, 1: 5.0}, gc_mode="false", gpus_per_worker=2)

    h100 = dict(type="H100", cpu=16)
    # four GPUs in all, but one per node: no pod of two can be placed, ever
    ok, ever, why = reserve(pods_of_two(), view(*[dict(h100, gpu=1)] * 4))
    assert (ok, ever) == (False, False)
    assert "resources.gpus_per_worker=2 needs 2 GPUs on one node, the largest node has 1" in why
    # the same four workers one GPU to a pod fit there
    assert reserve(
        Demand(4, 1.0, True, gib_by_every={0: 10.0, 1: 5.0}, gc_mode="false"), view(*[dict(h100, gpu=1)] * 4)
    )[0]
    # two nodes of two GPUs: one pod on each
    v = view(dict(h100, gpu=2), dict(h100, gpu=2))
    assert reserve(pods_of_two(), v)[0]
    assert [(n.gpu_free, n.cpu_free) for n in v.nodes] == [(0.0, 13.5), (0.0, 14.0)]  # + the driver's 0.5 CPU
    # four free GPUs split 3 + 1: only one pod fits now; it could once the busy GPU is free
    ok, ever, why = reserve(pods_of_two(), view(dict(h100, gpu=4, gpu_used=1), dict(h100, gpu=1)))
    assert (ok, ever) == (False, True) and "2 GPUs on one node per worker pod" in why
    # a pod's CPUs are on its node too: 2 x 1.0 CPUs beside its two GPUs
    assert not reserve(pods_of_two(workers=2), view(dict(type="H100", gpu=2, cpu=1.5), dict(cpu=8)))[1]
    # what `queue add` stores: gpus_per_worker from the spec, 1 for rows queued before it existed
    spec = load_spec(ROOT / SPEC, ["resources.use_gpu=true", "resources.num_workers=4", "resources.gpus_per_worker=2"])
    d = Demand.from_json(Demand.from_spec(spec).to_json())
    assert (d.gpus_per_worker, d.pods, d.gpus) == (2, 2, 4.0)
    old = json.loads(d.to_json())
    del old["gpus_per_worker"]
    assert Demand.from_json(json.dumps(old)).pods == 4


def test_a_separate_vllm_engine_is_admitted_with_its_own_resources(tmp_path):
    """`rollout.vllm_placement: separate`: the job holds the engine's GPUs and CPUs too, on one node
    (a Ray actor cannot span nodes); a colocated engine or a user's URL adds nothing."""
    from grpo_rollouts import save_tiny_base

    engine = Demand(1, 1.0, True, gib_by_every={0: 10.0, 1: 5.0}, gc_mode="false", engine_cpus=2.0, engine_gpus=1)
    assert (engine.cpus, engine.gpus) == (0.5 + 1.0 + 2.0, 2.0)  # the driver's, the worker's, the engine's
    h100 = dict(gpu=1, type="H100", cpu=4)
    ok, ever, why = reserve(engine, view(h100))  # the trainer's GPU, none for the engine
    assert (ok, ever) == (False, False), why
    assert reserve(engine, view(h100, dict(gpu=1, type="H100", cpu=4)))[0]
    ok, ever, why = reserve(engine, view(h100, dict(gpu=1, type="H100", cpu=4, gpu_used=1)))
    assert (ok, ever) == (False, True) and "needs 3.5 CPUs and 2 GPUs" in why, why
    # the engine's CPUs and GPUs on one node: 1 GPU on each of two other nodes is no place for 2
    two = Demand(1, 1.0, engine_cpus=1.0, engine_gpus=2, driver_cpus=0.0)
    assert not reserve(two, view(dict(cpu=2), dict(cpu=1, gpu=1), dict(cpu=1, gpu=1)))[1]
    assert reserve(two, view(dict(cpu=2), dict(cpu=1, gpu=2)))[0]
    base = save_tiny_base(tmp_path / "base")
    common = [f"model.name={base}", "rollout.engine=vllm", "data.max_seq_len=96", f"run.output_dir={tmp_path}/o"]
    spec = ROOT / "examples" / "tiny-grpo.yaml"
    apart = load_spec(spec, [*common, "rollout.vllm_placement=separate", "rollout.vllm_num_cpus=3"], files=False)
    assert (Demand.from_spec(apart).engine_cpus, Demand.from_spec(apart).engine_gpus) == (3.0, 0)  # CPU training
    colocated = Demand.from_spec(load_spec(spec, common, files=False))
    assert (colocated.engine_cpus, colocated.engine_gpus) == (0.0, 0)


def test_a_successful_fit_is_taken_off_the_view():
    v = view(dict(cpu=4))
    assert reserve(Demand(1, 1.0), v)[0]  # 1.5 CPUs
    assert reserve(Demand(1, 1.0), v)[0]  # 3.0
    ok, ever, _ = reserve(Demand(1, 1.0), v)  # a third would need 4.5
    assert (ok, ever) == (False, True)


def test_place_is_pure_and_reserve_takes_the_placement_off():
    v = view(dict(cpu=4), dict(cpu=2))
    p = place(Demand(2, 1.5), v)  # first fit: two pods of 1.5 CPUs and the driver's 0.5 on n0
    assert (p.now, p.ever, p.why) == (True, True, "") and p.free_after == {"n0": (0.5, 0.0), "n1": (2.0, 0.0)}
    assert [n.cpu_free for n in v.nodes] == [4.0, 2.0]  # place: nothing taken
    assert place(Demand(2, 1.5), v) == p
    assert reserve(Demand(2, 1.5), v) == (True, True, "")
    assert [n.cpu_free for n in v.nodes] == [0.5, 2.0]  # reserve: taken off the view


def test_gpu_demand_uses_the_memory_model():
    from jobs.memory import estimate_for_spec

    spec = load_spec(
        ROOT / SPEC,
        ["resources.use_gpu=true", "resources.num_workers=1", "batch.micro_batch_size=4", "batch.global_batch_size=8"],
    )
    d = Demand.from_spec(spec)
    assert d.gpus == 1 and d.cpus == 1.5
    assert d.est_gib_off == pytest.approx(
        estimate_for_spec(spec, gradient_checkpointing=False, device="cuda").total_gib
    )
    assert d.est_gib_on == pytest.approx(estimate_for_spec(spec, gradient_checkpointing=True, device="cuda").total_gib)
    assert d.gc_mode == "true"  # tiny-lora.yaml turns checkpointing on


def test_one_driver_per_queue_file(tmp_path):
    q = Queue(tmp_path / "q.db")
    holder = Driver(q, backend=None)
    holder.lock()
    with pytest.raises(UserError, match="another `rayft queue run` holds"):
        Driver(Queue(tmp_path / "q.db"), backend=None).lock()


def test_queue_add_is_idempotent_and_survives_reopening(tmp_path):
    db = tmp_path / "q.db"
    a = rayft_in_process("queue", "add", SPEC, *TINY, "name=same-job", "--priority", "3", "--db", str(db))
    b = rayft_in_process("queue", "add", SPEC, *TINY, "name=same-job", "--db", str(db))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout.strip() == b.stdout.strip() == "1" and "already queued" in b.stderr
    c = rayft_in_process("queue", "add", SPEC, *TINY, "name=same-job", "optim.lr=0.02", "--db", str(db))
    assert c.stdout.strip() == "2"
    rows = json.loads(rayft_in_process("queue", "status", "--db", str(db), "--json").stdout)
    assert [(r["id"], r["state"], r["priority"]) for r in rows] == [(1, "QUEUED", 3), (2, "QUEUED", 0)]
    assert rows[0]["overrides"][-1] == "name=same-job" and rows[0]["micro_batch_size"] == 4
    table = rayft_in_process("queue", "status", "--db", str(db))
    assert table.returncode == 0 and "same-job" in table.stdout and "QUEUED" in table.stdout


def _running(q: Queue, job_id: int, sid: str) -> dict:
    with q.txn() as c:
        c.execute("UPDATE jobs SET state='RUNNING', attempt=attempt+1, submission_id=? WHERE id=?", (sid, job_id))
        c.execute(
            "INSERT INTO attempts (job_id, attempt, submission_id, micro_batch_size, grad_accum_steps) "
            "SELECT id, attempt, submission_id, micro_batch_size, grad_accum_steps FROM jobs WHERE id=?",
            (job_id,),
        )
    return q.job(job_id)


def test_end_of_attempt_decisions(tmp_path):
    """What the driver records when an attempt ends (the cluster side is in the tests below):
    out of memory -> one retry at half the micro-batch, a second one is final; other failures ->
    bounded retries with doubling backoff; an end is recorded once."""
    from orchestrator.queue.driver import DriverConfig

    q = Queue(tmp_path / "q.db")
    drv = Driver(q, backend=None, config=DriverConfig(backoff_s=10, log=lambda m: None))
    oom_log = "torch.OutOfMemoryError: CUDA out of memory (injected by RAYFT_FAULT: micro_batch_size=4 > 2)"

    a, _ = enqueue(q, SPEC, [*TINY, "name=oom-unit"], max_retries=2)
    job = _running(q, a, "s1")
    drv.ended(job, "FAILED", "Job entrypoint command failed with exit code 1", "...\n" + oom_log + "\n")
    drv.ended(job, "FAILED", "again", oom_log)  # the same end seen twice: recorded once
    r = q.job(a)
    assert (r["state"], r["micro_batch_size"], r["grad_accum_steps"], r["oom_retried"], r["retries"]) == (
        "QUEUED",
        2,
        4,
        1,
        0,
    )
    assert json.loads(r["changes"]) == ["batch.micro_batch_size=2", "batch.grad_accum_steps=4"]
    job = _running(q, a, "s2")
    drv.ended(job, "FAILED", "", oom_log)  # out of memory again: final, retries unused
    r = q.job(a)
    assert r["state"] == "FAILED" and "out of memory again at micro_batch_size=2" in r["message"]
    kinds = [e["kind"] for e in q.events(a)]
    assert kinds.count("ended") == 1 and kinds.count("oom_retry") == 1 and kinds.count("attempt_ended") == 2

    b, _ = enqueue(q, SPEC, [*TINY, "name=flaky-unit"], max_retries=2)
    t0 = time.time()
    for n, sid in enumerate(("f1", "f2"), start=1):
        drv.ended(_running(q, b, sid), "FAILED", "Job entrypoint command failed with exit code 1", "boom")
        r = q.job(b)
        assert r["state"] == "QUEUED" and r["retries"] == n and r["micro_batch_size"] == 4
        assert t0 + 10 * 2 ** (n - 1) - 1 <= r["not_before"] <= time.time() + 10 * 2 ** (n - 1)
    drv.ended(_running(q, b, "f3"), "FAILED", "exit code 1", "boom")
    assert q.job(b)["state"] == "FAILED" and len(q.attempts(b)) == 3
    # `rayft queue retry`: queued again, its next attempt is the 4th (a new submission id)
    assert q.retry(b) == "QUEUED" and q.job(b)["attempt"] == 3 and q.job(b)["retries"] == 0
    with pytest.raises(UserError, match="only a FAILED, STOPPED or CANCELED job"):
        q.retry(b)

    c, _ = enqueue(q, SPEC, [*TINY, "name=odd-unit", "batch.micro_batch_size=1"])
    drv.ended(_running(q, c, "o1"), "FAILED", "", oom_log)
    assert q.job(c)["state"] == "FAILED" and "cannot be halved" in q.job(c)["message"]

    d, _ = enqueue(q, SPEC, [*TINY, "name=stopped-unit"])
    drv.ended(_running(q, d, "x1"), "STOPPED", "Job was intentionally stopped.", "")
    assert q.job(d)["state"] == "STOPPED"  # stopped by hand: never retried


# ---- against the cluster ---------------------------------------------------------------------


def db_rows(db: Path) -> dict[str, dict]:
    c = sqlite3.connect(str(db), timeout=30)
    c.row_factory = sqlite3.Row
    try:
        return {r["name"]: dict(r) for r in c.execute("SELECT * FROM jobs")}
    finally:
        c.close()


def db_events(db: Path) -> list[dict]:
    c = sqlite3.connect(str(db), timeout=30)
    c.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in c.execute("SELECT * FROM events ORDER BY id")]
    finally:
        c.close()


def driver(db: Path, ray_head, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "rayft"), "queue", "run", "--db", str(db), "--address", ray_head.dashboard, "--poll", "0.5", *extra],
        cwd=ROOT,
        env=env or ray_head.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def cluster_jobs_of(ray_head, names: set[str]) -> dict[str, list]:
    out: dict[str, list] = {n: [] for n in names}
    for j in jobs_on(ray_head):
        n = (j.metadata or {}).get("rayft.name")
        if n in out:
            out[n].append(j)
    for n in out:
        out[n].sort(key=lambda j: j.start_time)
    return out


@pytest.mark.ray
@pytest.mark.slow
def test_priority_order_and_sigkilled_driver(ray_head, tmp_path):
    """Two jobs (a third would add a Ray job's start-up and prove nothing more): the driver is
    SIGKILLed after the cluster accepted the first but before the file says so, restarted (it must
    track that job, not submit it again, then submit the second), SIGKILLed again while the second
    runs, and restarted once more (it must track the running one to its end)."""
    db = tmp_path / "q.db"
    names = {p: uniq(f"prio{p}") for p in (1, 9)}
    for p in (1, 9):  # queue order is not priority order
        r = rayft_in_process(
            "queue",
            "add",
            SPEC,
            *TINY,
            f"name={names[p]}",
            f"run.output_dir={tmp_path / names[p]}",
            "--priority",
            str(p),
            "--db",
            str(db),
            env=ray_head.env,
        )
        assert r.returncode == 0, r.stderr

    # 1) the driver dies between "the cluster accepted the job" and "the file says so"
    crash = driver(
        db, ray_head, "--max-concurrency", "1", env=dict(ray_head.env, RAYFT_QUEUE_FAULT="kill_after_submit")
    )
    out, _ = crash.communicate(timeout=120)
    assert crash.returncode == -signal.SIGKILL, out
    rows = db_rows(db)
    assert rows[names[9]]["state"] == "SUBMITTING"
    assert rows[names[1]]["state"] == "QUEUED"
    first_id = rows[names[9]]["submission_id"]
    assert [j.submission_id for j in cluster_jobs_of(ray_head, {names[9]})[names[9]]] == [first_id]

    # 2) restarted, it finds that job on the cluster and tracks it; SIGKILL it again while the
    #    second job runs on the cluster
    d = driver(db, ray_head, "--max-concurrency", "1")
    try:

        def second_running():
            r = db_rows(db)[names[1]]
            if r["state"] != "RUNNING":
                return None
            info = jobs_on(ray_head)
            return any(j.submission_id == r["submission_id"] and str(j.status) == "RUNNING" for j in info)

        wait_until(second_running, 240, "the second job runs", every_s=0.3)
    finally:
        d.send_signal(signal.SIGKILL)
        out2, _ = d.communicate(timeout=30)
    assert d.returncode == -signal.SIGKILL
    assert "tracking" in out2 and first_id in out2
    assert db_rows(db)[names[9]]["state"] == "SUCCEEDED", out2

    # 3) restarted again, it tracks the running job to the end
    d = driver(db, ray_head, "--max-concurrency", "1")
    out3, _ = d.communicate(timeout=300)
    assert d.returncode == 0, out3

    rows = db_rows(db)
    assert {n: r["state"] for n, r in rows.items()} == {n: "SUCCEEDED" for n in names.values()}
    assert all(r["attempt"] == 1 for r in rows.values())
    on_cluster = cluster_jobs_of(ray_head, set(names.values()))
    for _priority, n in names.items():
        assert len(on_cluster[n]) == 1, (n, [j.submission_id for j in on_cluster[n]])  # ran exactly once
        assert str(on_cluster[n][0].status) == "SUCCEEDED"
        assert on_cluster[n][0].submission_id == rows[n]["submission_id"]
        assert metrics_steps(tmp_path / n) == [1, 2]
        runs = [json.loads(line)["event"] for line in (tmp_path / n / "events.jsonl").read_text().splitlines()]
        assert runs == ["start", "first_step", "end"]  # trained once
        evs = [e for e in db_events(db) if e["job_id"] == rows[n]["id"]]
        assert [e["kind"] for e in evs].count("ended") == 1  # ended exactly once
        assert [e["kind"] for e in evs].count("submitting") == 1
    # priority order, one at a time
    order = sorted((j for js in on_cluster.values() for j in js), key=lambda j: j.start_time)
    assert [j.metadata["rayft.name"] for j in order] == [names[9], names[1]]
    for a, b in itertools.pairwise(order):
        assert b.start_time >= a.end_time, "max-concurrency 1 was exceeded"


@pytest.mark.ray
@pytest.mark.slow
def test_out_of_memory_is_retried_once_with_half_the_micro_batch(ray_head, tmp_path):
    db = tmp_path / "q.db"
    name = uniq("oom")
    # RAYFT_FAULT makes the first step raise torch.OutOfMemoryError while micro_batch_size > 2
    r = rayft_in_process(
        "queue",
        "add",
        SPEC,
        *TINY,
        f"name={name}",
        f"run.output_dir={tmp_path / name}",
        "run.env.RAYFT_FAULT=oom:micro_batch_gt=2",
        "--max-retries",
        "0",
        "--db",
        str(db),
        env=ray_head.env,
    )
    assert r.returncode == 0, r.stderr
    d = driver(db, ray_head, "--max-concurrency", "1")
    out, _ = d.communicate(timeout=400)
    assert d.returncode == 0, out

    f = db_rows(db)[name]
    assert f["state"] == "SUCCEEDED" and f["attempt"] == 2 and f["oom_retried"] == 1 and f["retries"] == 0
    assert (f["micro_batch_size"], f["grad_accum_steps"]) == (2, 4)
    assert "micro_batch_size 4 -> 2, grad_accum_steps 2 -> 4" in f["change_note"]
    jobs = cluster_jobs_of(ray_head, {name})[name]
    assert [str(j.status) for j in jobs] == ["FAILED", "SUCCEEDED"]  # retried exactly once
    assert [(j.metadata["rayft.micro_batch_size"], j.metadata["rayft.grad_accum_steps"]) for j in jobs] == [
        ("4", "2"),
        ("2", "4"),
    ]
    assert jobs[1].submission_id == f["submission_id"] and jobs[1].submission_id.endswith("-a2")
    assert "batch.micro_batch_size=2 batch.grad_accum_steps=4" in jobs[1].entrypoint
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert (summary["micro_batch_size"], summary["grad_accum_steps"], summary["global_batch_size"]) == (2, 4, 8)
    assert metrics_steps(tmp_path / name) == [1, 2]
    kinds = [e["kind"] for e in db_events(db) if e["job_id"] == f["id"]]
    assert kinds.count("oom_retry") == 1 and kinds.count("ended") == 1
    # the change is visible in `rayft queue status`
    table = rayft_in_process("queue", "status", "--db", str(db), env=ray_head.env)
    assert "micro_batch_size 4 -> 2, grad_accum_steps 2 -> 4" in table.stdout and "2 x 4" in table.stdout


@pytest.mark.ray
def test_admission_waits_for_free_cpus(ray_head, tmp_path):
    from ray.job_submission import JobSubmissionClient

    from orchestrator.backends.ray_jobs import RayJobsBackend

    os.environ["RAY_AUTH_MODE"] = "token"
    backend = RayJobsBackend(ray_head.dashboard)
    client = JobSubmissionClient(ray_head.dashboard)
    db = tmp_path / "q.db"
    fits, never = uniq("fits"), uniq("never")
    for name, extra, prio in ((fits, [], 0), (never, ["resources.cpus_per_worker=8"], 9)):
        r = rayft_in_process(
            "queue",
            "add",
            SPEC,
            *TINY,
            f"name={name}",
            f"run.output_dir={tmp_path / name}",
            *extra,
            "--priority",
            str(prio),
            "--db",
            str(db),
            env=ray_head.env,
        )
        assert r.returncode == 0, r.stderr
    # Something else holds 3 of the cluster's 4 CPUs. Wait for exactly 1 free: a job of an
    # earlier test on this head may still be giving its CPUs back.
    hog = client.submit_job(entrypoint="sleep 600", entrypoint_num_cpus=3, submission_id=uniq("hog"))
    try:
        wait_until(
            lambda: str(client.get_job_status(hog)) == "RUNNING" and backend.cluster_view().cpu_free == 1.0,
            90,
            "the hog holds its CPUs",
            every_s=1,
        )
        r = rayft("queue", "run", "--once", "--db", str(db), "--address", ray_head.dashboard, env=ray_head.env)
        assert r.returncode == 0, r.stderr
        rows = db_rows(db)
        assert rows[fits]["state"] == "QUEUED"
        assert rows[fits]["status_detail"] == "waiting for resources: needs 1.5 CPUs, 1 CPUs free"
        assert rows[never]["state"] == "QUEUED" and rows[never]["status_detail"].startswith("can never fit")
        assert not any(cluster_jobs_of(ray_head, {fits, never}).values())
    finally:
        client.stop_job(hog)
    wait_until(lambda: backend.cluster_view().cpu_free >= 4.0, 90, "the CPUs are free", every_s=1)
    r = rayft("queue", "run", "--once", "--db", str(db), "--address", ray_head.dashboard, env=ray_head.env)
    assert r.returncode == 0, r.stderr
    rows = db_rows(db)
    assert rows[fits]["state"] == "RUNNING", rows[fits]  # the never-fitting head did not block it
    assert rows[never]["state"] == "QUEUED"
    assert [j.submission_id for j in cluster_jobs_of(ray_head, {fits})[fits]] == [rows[fits]["submission_id"]]
    c = rayft(
        "queue", "cancel", str(rows[fits]["id"]), "--db", str(db), "--address", ray_head.dashboard, env=ray_head.env
    )
    assert c.returncode == 0 and "CANCELED" in c.stderr, c.stderr
    wait_until(
        lambda: str(client.get_job_status(rows[fits]["submission_id"])) == "STOPPED", 60, "the job stopped", every_s=0.3
    )
    r = rayft("queue", "run", "--once", "--db", str(db), "--address", ray_head.dashboard, env=ray_head.env)
    assert db_rows(db)[fits]["state"] == "CANCELED"
    assert len(cluster_jobs_of(ray_head, {fits})[fits]) == 1
