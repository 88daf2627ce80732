"""Experiment tracking (`run.trackers`), read back through the real libraries: TensorBoard's
event reader and the MLflow client. A resumed run continues the same step axis (and the same
MLflow run) with every step exactly once; a tracking server that is down costs one warning."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port
from gradtools import ROOT
from runs import metric_lines

from jobs.run.tracking import MLFLOW_RUN_FILE, TENSORBOARD_DIR
from jobs.spec import absolutize, load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train

pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

DEMO = "examples/tiny-lora.yaml"
BIN = Path(sys.executable).parent
SMALL = [
    "resources.num_workers=1",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "memory.gradient_checkpointing=false",
    "run.checkpoint_every=2",
    "run.eval_every=2",
    "run.keep_checkpoints=3",
]


def tb_scalars(out: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


# Read back as a user would, with MLflow as it ships: a fresh interpreter that imports no rayft
# code and has no MLFLOW_* variable set (MLflow 3 refuses a file store there), only the store URI.
READ_BACK = r"""
import json, sys
from mlflow.tracking import MlflowClient

uri, keys = sys.argv[1], sys.argv[2].split(",")
client = MlflowClient(tracking_uri=uri)
experiments = {e.experiment_id: e.name for e in client.search_experiments()}
runs = []
for r in client.search_runs(list(experiments)):
    rid = r.info.run_id
    runs.append({"run_id": rid, "status": r.info.status, "experiment": experiments[r.info.experiment_id],
                 "params": r.data.params, "latest": r.data.metrics,
                 "history": {k: sorted([m.step, m.value] for m in client.get_metric_history(rid, k)) for k in keys},
                 "artifacts": sorted(a.path for a in client.list_artifacts(rid)),
                 "adapter_artifacts": sorted(a.path for a in client.list_artifacts(rid, "adapter"))})
print(json.dumps(runs))
"""


def ml_runs(out: Path, keys: str = "loss") -> list[dict]:
    """Every run of the default store under `out` (`sqlite:///<out>/mlflow.db`), read by stock MLflow."""
    db = out.resolve() / "mlflow.db"
    assert db.is_file(), f"no MLflow database at {db}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    p = subprocess.run(
        [sys.executable, "-c", READ_BACK, f"sqlite:///{db}", keys],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _train(out: Path, *extra: str) -> dict:
    spec = absolutize(load_spec(DEMO, SMALL + [f"run.output_dir={out}", *extra]))
    return train(spec, LocalContext(on_progress=lambda r: None), resume=True)


def test_every_step_metric_spec_and_artifacts_reach_tensorboard_and_mlflow(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    summary = _train(out, "run.max_steps=4", "run.trackers=[tensorboard,mlflow]")
    records = metric_lines(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]

    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib"):
        assert tb_scalars(out, tag) == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in records], tag
    # eval loss only where it was measured (every 2 steps)
    assert [s for s, _ in tb_scalars(out, "eval_loss")] == [2, 4]

    runs = ml_runs(out)
    assert len(runs) == 1
    run = runs[0]
    assert json.loads((out / MLFLOW_RUN_FILE).read_text())["run_id"] == run["run_id"]
    assert run["history"]["loss"] == [[r["step"], pytest.approx(r["loss"], rel=1e-9)] for r in records]
    assert run["status"] == "FINISHED"
    assert run["params"]["lora.r"] == "16" and run["params"]["batch.global_batch_size"] == "8"
    assert {"summary.json", "loss_curve.png", "adapter"} <= set(run["artifacts"])
    assert "adapter_config.json" in {Path(a).name for a in run["adapter_artifacts"]}
    # The artifacts lie beside the database, not under the working directory's ./mlruns.
    assert (out / "mlartifacts").is_dir() and not (ROOT / "mlruns").exists() and not (out / "mlruns").exists()
    assert summary["steps"] == 4


def _finetune_local(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        str(BIN / "python"),
        "-m",
        "jobs.finetune",
        DEMO,
        "--local",
        f"run.output_dir={out}",
        *SMALL,
        "run.max_steps=6",
        "run.trackers=[tensorboard,mlflow]",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two fresh `python -m jobs.finetune` processes with both trackers: over 30 s on 2 cores
def test_kill_and_resume_continue_the_same_run_with_every_step_once(tmp_path):
    out = tmp_path / "run"
    fault = f"run.env.RAYFT_FAULT=kill:step=3,rank=0,once={tmp_path / 'killed'}"
    p = _finetune_local(out, fault)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    # steps 1..3 were written to TensorBoard; step 3 is past the checkpoint (step 2)
    assert [s for s, _ in tb_scalars(out, "loss")] == [1, 2, 3]
    first_id = json.loads((out / MLFLOW_RUN_FILE).read_text())["run_id"]

    p = _finetune_local(out, fault)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stderr and "step-00000002" in p.stderr
    records = metric_lines(out)
    steps = [r["step"] for r in records]
    assert steps == [1, 2, 3, 4, 5, 6]

    # TensorBoard: the killed run's step 3 is purged; the resumed run's step 3 is the one read
    loss = tb_scalars(out, "loss")
    assert [s for s, _ in loss] == steps
    assert [v for _, v in loss] == [pytest.approx(r["loss"], rel=1e-6) for r in records]

    runs = ml_runs(out)
    assert [r["run_id"] for r in runs] == [first_id]  # the same MLflow run, continued
    hist = runs[0]["history"]["loss"]
    assert [s for s, _ in hist] == steps  # no step twice, none missing
    assert hist == [[r["step"], pytest.approx(r["loss"], rel=1e-9)] for r in records]
    assert runs[0]["status"] == "FINISHED"


def test_a_tracking_server_that_is_down_costs_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="rayft"):
        _train(out, "run.max_steps=3", "run.trackers=[mlflow]", f"run.mlflow_tracking_uri={uri}")
    warnings = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "mlflow" in warnings[0] and "training goes on" in warnings[0] and uri in warnings[0]
    assert [r["step"] for r in metric_lines(out)] == [1, 2, 3]
    assert (out / "adapter" / "adapter_config.json").exists()


def test_a_fresh_start_in_the_same_directory_replaces_the_earlier_curves(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    _train(out, "run.max_steps=2", "run.trackers=[tensorboard]", "optim.lr=0.01")
    spec = absolutize(
        load_spec(
            DEMO, SMALL + [f"run.output_dir={out}", "run.max_steps=2", "run.trackers=[tensorboard]", "optim.lr=0.02"]
        )
    )
    train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    records = metric_lines(out)
    assert tb_scalars(out, "lr") == [(r["step"], pytest.approx(r["lr"], rel=1e-6)) for r in records]


@pytest.mark.ray
@pytest.mark.slow
def test_a_search_logs_every_trial_as_a_run_of_one_experiment(tmp_path, ray_head):
    """`rayft tune` with run.trackers=[mlflow] on a Ray cluster (the session's head): one MLflow run
    per launched trial, in the experiment named after the search, with the trial's split and lr
    rule as parameters and its eval losses."""
    from tests.integration.test_tune import search_spec, write

    data = search_spec(
        tmp_path, grad_accum_steps=[2, 4], lr_scaling=["linear"], samples_per_trial=16, eval_every_samples=8
    )
    data["run"]["trackers"] = ["mlflow"]
    path = write(tmp_path, data)
    p = subprocess.run(
        [str(BIN / "rayft"), "tune", str(path), "--address", ray_head.address],
        cwd=tmp_path,
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    launched = [r for r in results["trials"] if r["status"] not in ("infeasible", "skipped", "not run")]
    assert launched, results["trials"]
    runs = [r for r in ml_runs(tmp_path / "out", "eval_loss") if r["experiment"] == "ts"]
    assert len(runs) == len(launched)
    params = " ".join(str(v) for r in runs for v in r["params"].values())
    assert "linear" in params  # the lr rule
    assert all(r["history"]["eval_loss"] for r in runs)


def test_the_loss_curve_has_eval_points_only_where_the_eval_ran(tmp_path, monkeypatch):
    """metrics.jsonl carries the last eval loss forward on every step; the plot (and the trackers)
    take it only at the steps marked `evaluated` (every run.eval_every=2 steps, and the last)."""
    from jobs.run.outputs import loss_points, read_metrics

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    _train(out, "run.max_steps=5")
    records = metric_lines(out)
    assert [r["evaluated"] for r in records] == [False, True, False, True, True]
    assert records[2]["eval_loss"] == records[1]["eval_loss"]  # carried forward, not measured
    train, evals = loss_points(read_metrics(out))
    assert [s for s, _ in train] == [1, 2, 3, 4, 5]
    assert [s for s, _ in evals] == [2, 4, 5]
    assert (out / "loss_curve.png").stat().st_size > 0
