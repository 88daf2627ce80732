"""Seconds from `rayft submit` to the job's first optimizer step on a local Ray cluster, by phase.

    .venv/bin/python bench/submit_latency.py [--address http://127.0.0.1:8265] [--runs 3] [k=v ...]

Without --address it starts its own local cluster (token auth, 4 logical CPUs, 127.0.0.1) and
stops it at the end. Each run submits the tiny job (one worker, `examples/tiny-lora.yaml` made
small; extra `section.field=value` words override it) under a fresh name, so nothing is reused
but Ray's content-addressed working-dir package (run 1 uploads it, later runs find it: run 1 is
the cold start, the others warm).

Phases and where their timestamps come from (one machine, one clock):

    submit        `rayft submit` process start -> the job server accepted the job (the job's
                  `start_time`): CLI start-up, validation, packaging, upload, POST
    runtime_env   -> the job's status turned RUNNING (polled every 50 ms: the working dir is
                  downloaded and unpacked on the node, the entrypoint started)
    driver        -> Ray Train's TrainController actor was created (task events, state API): the
                  driver's imports, spec validation, ray.init
    worker_start  -> RayTrainWorker.run_train_fn started (task events): controller start-up,
                  placement group, worker processes, torch.distributed init (the JSON splits it
                  at the worker process's start)
    model_load    -> the loop's `start` event (`<output_dir>/events.jsonl`): the loop's imports
                  (transformers, peft), model, LoRA, data
    first_step    -> the `first_step` event: the first optimizer step has finished

Without events.jsonl (an older loop), model_load + first_step are merged into one phase, ended by
the first line of metrics.jsonl appearing (polled every 50 ms).

Writes bench/results/submit-latency-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SPEC = "examples/tiny-lora.yaml"
TINY = [
    "resources.num_workers=1",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.max_steps=2",
    "data.max_seq_len=64",
    "lora.r=4",
    "lora.alpha=8",
]
PHASES = ["submit", "runtime_env", "driver", "worker_start", "model_load", "first_step"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_AUTH_MODE"] = "token"
    env.pop("RAY_ADDRESS", None)
    return env


def start_cluster() -> tuple[subprocess.Popen, str]:
    gcs, dash, client = _free_port(), _free_port(), _free_port()
    proc = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}",
            "--num-cpus=4",
            "--disable-usage-stats",
        ],
        env=_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"http://127.0.0.1:{dash}"
    from orchestrator.backends.ray_jobs import RayJobsBackend

    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"ray start exited with {proc.returncode}")
        try:
            RayJobsBackend(address).list()
            return proc, address
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def stop_cluster(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _task_times(backend, job_id: str) -> dict:
    q = f"/api/v0/tasks?detail=1&limit=10000&filter_keys=job_id&filter_predicates=%3D&filter_values={job_id}"
    tasks = ((backend._get(q).get("data") or {}).get("result") or {}).get("result") or []
    out = {}
    for t in tasks:
        name = t.get("name") or ""
        if name == "TrainController.__init__":
            out["controller_created"] = t["creation_time_ms"] / 1000
        elif name == "RayTrainWorker.__init__" and t.get("start_time_ms"):
            out["worker_process_started"] = t["start_time_ms"] / 1000
        elif name == "RayTrainWorker.run_train_fn" and t.get("start_time_ms"):
            out["train_fn_started"] = t["start_time_ms"] / 1000
    return out


def one_run(address: str, overrides: list[str], workdir: Path, env: dict) -> dict:
    from orchestrator.backends.ray_jobs import RayJobsBackend

    backend = RayJobsBackend(address)
    name = f"bench-{uuid.uuid4().hex[:6]}"
    out = workdir / name
    t0 = time.time()
    r = subprocess.run(
        [
            str(BIN / "rayft"),
            "submit",
            SPEC,
            *TINY,
            *overrides,
            f"name={name}",
            f"run.output_dir={out}",
            "--address",
            address,
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    t_submitted = time.time()
    if r.returncode != 0:
        raise SystemExit(f"rayft submit failed: {r.stderr.strip()}")
    sid = json.loads(r.stdout)["submission_id"]
    t_running = t_metrics = None
    while True:
        info = backend.require(sid)
        status = str(info.status.value if hasattr(info.status, "value") else info.status)
        now = time.time()
        if t_running is None and status != "PENDING":
            t_running = now
        if t_metrics is None and (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size:
            t_metrics = now
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(0.05)
    if status != "SUCCEEDED":
        raise SystemExit(f"{sid} {status}: {info.message}")
    events = {}
    ev_path = out / "events.jsonl"
    if ev_path.exists():
        for line in ev_path.read_text().splitlines():
            e = json.loads(line)
            events.setdefault(e["event"], e["time"])
    tasks = _task_times(backend, info.job_id)
    stamps = {
        "rayft_submit_started": t0,
        "rayft_submit_returned": t_submitted,
        "job_accepted (start_time)": info.start_time / 1000,
        "job_running": t_running,
        **tasks,
        "loop_started (events.jsonl start)": events.get("start"),
        "first_step (events.jsonl first_step)": events.get("first_step"),
        "metrics_seen": t_metrics,
    }
    accepted = info.start_time / 1000
    marks = [t0, accepted, t_running, tasks.get("controller_created"), tasks.get("train_fn_started")]
    if "start" in events and "first_step" in events:
        marks += [events["start"], events["first_step"]]
        phases = dict(zip(PHASES, (b - a for a, b in zip(marks, marks[1:], strict=False)), strict=True))
    else:
        marks += [t_metrics]
        gaps = (b - a for a, b in zip(marks, marks[1:], strict=False))
        phases = dict(zip(PHASES[:4] + ["model_load+first_step"], gaps, strict=True))
    phases["total"] = marks[-1] - t0
    detail = {}
    if "worker_process_started" in tasks and "controller_created" in tasks:
        detail["worker_start.controller_and_placement"] = tasks["worker_process_started"] - tasks["controller_created"]
        detail["worker_start.worker_init"] = tasks["train_fn_started"] - tasks["worker_process_started"]
    detail["submit.cli_returned_after"] = t_submitted - t0
    return {
        "detail_s": {k: round(v, 3) for k, v in detail.items()},
        "submission_id": sid,
        "phases_s": {k: round(v, 3) for k, v in phases.items()},
        "timestamps": {k: v for k, v in stamps.items() if v is not None},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="section.field=value, on top of the tiny job")
    ap.add_argument("--address", help="an existing cluster's Jobs API (default: start a local one)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", help="result file (default bench/results/submit-latency-<date>.json)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    env = _env()
    os.environ.update({"RAY_AUTH_MODE": "token", "PATH": env["PATH"]})
    proc = None
    address = args.address
    t_cluster = time.time()
    if address is None:
        proc, address = start_cluster()
    cluster_start_s = time.time() - t_cluster if proc else None
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="rayft-bench-") as tmp:
            for i in range(args.runs):
                load = os.getloadavg()[0]
                run = one_run(address, args.overrides, Path(tmp), env)
                run["loadavg_1m_before"] = round(load, 2)
                runs.append(run)
                print(f"run {i + 1}: total {run['phases_s']['total']:.1f} s", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            stop_cluster(proc)

    import ray
    import torch

    keys = list(runs[0]["phases_s"])
    warm = runs[1:] or runs
    summary = {
        k: {"cold": runs[0]["phases_s"][k], "warm_median": round(statistics.median(r["phases_s"][k] for r in warm), 3)}
        for k in keys
    }
    result = {
        "benchmark": "submit_latency",
        "what": "seconds from `rayft submit` to the first optimizer step, by phase (see bench/submit_latency.py)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "job": {"spec": SPEC, "overrides": TINY + list(args.overrides)},
        "cluster": {
            "address": "local (started by the benchmark)" if proc else address,
            "num_cpus": 4,
            "start_s": round(cluster_start_s, 1) if cluster_start_s else None,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "ray": ray.__version__,
            "torch": torch.__version__,
        },
        "summary_s": summary,
        "runs": runs,
    }
    default_out = ROOT / "bench" / "results" / f"submit-latency-{time.strftime('%Y-%m-%d')}.json"
    out = Path(args.out) if args.out else default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    width = max(len(k) for k in keys)
    lines = [f"{'phase':<{width}}  {'cold (run 1)':>12}  {'warm (median)':>13}"]
    lines += [f"{k:<{width}}  {summary[k]['cold']:>12.2f}  {summary[k]['warm_median']:>13.2f}" for k in keys]
    print("\n".join(lines))
    print(f"\nwritten to {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
