"""Experiment tracking (`run.trackers`), read back through the real libraries: TensorBoard's
event reader and the MLflow client. A resumed run continues the same step axis (and the same
MLflow run) with every step exactly once; a tracking server that is down costs one warning."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port
from gradtools import ROOT
from jobs.context import LocalContext
from jobs.loop import train
from jobs.outputs import read_metrics
from jobs.spec import absolutize, load_spec
from jobs.tracking import MLFLOW_RUN_FILE, TENSORBOARD_DIR

pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

DEMO = "examples/tiny-lora.yaml"
BIN = Path(sys.executable).parent
SMALL = ["resources.num_workers=1", "batch.global_batch_size=8", "batch.micro_batch_size=4",
         "memory.gradient_checkpointing=false", "run.checkpoint_every=2", "run.eval_every=2",
         "run.keep_checkpoints=3"]


@pytest.fixture(autouse=True)
def _file_store_allowed(monkeypatch):
    # MLflow 3 reads its file store only with this set (jobs.tracking sets it for its own client).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def tb_scalars(out: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def ml_run(out: Path):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"file:{out.resolve() / 'mlruns'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    runs = mlflow.search_runs(search_all_experiments=True)
    return client, runs


def _train(out: Path, *extra: str) -> dict:
    spec = absolutize(load_spec(DEMO, SMALL + [f"run.output_dir={out}", *extra]))
    return train(spec, LocalContext(on_progress=lambda r: None), resume=True)


def test_every_step_metric_spec_and_artifacts_reach_tensorboard_and_mlflow(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    summary = _train(out, "run.max_steps=4", "run.trackers=[tensorboard,mlflow]")
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]

    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib"):
        assert tb_scalars(out, tag) == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in records], tag
    # eval loss only where it was measured (every 2 steps)
    assert [s for s, _ in tb_scalars(out, "eval_loss")] == [2, 4]

    client, runs = ml_run(out)
    assert len(runs) == 1
    run_id = runs.iloc[0]["run_id"]
    assert json.loads((out / MLFLOW_RUN_FILE).read_text())["run_id"] == run_id
    hist = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in hist) == [(r["step"], pytest.approx(r["loss"], rel=1e-9))
                                                       for r in records]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["lora.r"] == "16" and run.data.params["batch.global_batch_size"] == "8"
    arts = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.json", "loss_curve.png", "adapter"} <= arts
    assert "adapter_config.json" in {Path(a.path).name for a in client.list_artifacts(run_id, "adapter")}
    assert summary["steps"] == 4


def _finetune_local(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "python"), "-m", "jobs.finetune", DEMO, "--local", f"run.output_dir={out}", *SMALL,
           "run.max_steps=6", "run.trackers=[tensorboard,mlflow]", *extra]
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
    records = read_metrics(out)
    steps = [r["step"] for r in records]
    assert steps == [1, 2, 3, 4, 5, 6]

    # TensorBoard: the killed run's step 3 is purged; the resumed run's step 3 is the one read
    loss = tb_scalars(out, "loss")
    assert [s for s, _ in loss] == steps
    assert [v for _, v in loss] == [pytest.approx(r["loss"], rel=1e-6) for r in records]

    client, runs = ml_run(out)
    assert list(runs["run_id"]) == [first_id]  # the same MLflow run, continued
    hist = client.get_metric_history(first_id, "loss")
    assert sorted(m.step for m in hist) == steps  # no step twice, none missing
    assert sorted((m.step, m.value) for m in hist) == [(r["step"], pytest.approx(r["loss"], rel=1e-9))
                                                       for r in records]
    assert client.get_run(first_id).info.status == "FINISHED"


def test_a_tracking_server_that_is_down_costs_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="rayft"):
        _train(out, "run.max_steps=3", "run.trackers=[mlflow]", f"run.mlflow_tracking_uri={uri}")
    warnings = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "mlflow" in warnings[0] and "training goes on" in warnings[0] and uri in warnings[0]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert (out / "adapter" / "adapter_config.json").exists()


def test_a_fresh_start_in_the_same_directory_replaces_the_earlier_curves(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    _train(out, "run.max_steps=2", "run.trackers=[tensorboard]", "optim.lr=0.01")
    spec = absolutize(load_spec(DEMO, SMALL + [f"run.output_dir={out}", "run.max_steps=2",
                                               "run.trackers=[tensorboard]", "optim.lr=0.02"]))
    train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    records = read_metrics(out)
    assert tb_scalars(out, "lr") == [(r["step"], pytest.approx(r["lr"], rel=1e-6)) for r in records]


@pytest.mark.ray
@pytest.mark.slow
def test_a_search_logs_every_trial_as_a_run_of_one_experiment(tmp_path, ray_head):
    """`rayft tune` with run.trackers=[mlflow] on a Ray cluster (the session's head): one MLflow run
    per launched trial, in the experiment named after the search, with the trial's split and lr
    rule as parameters and its eval losses."""
    import os

    import mlflow

    from test_tune import search_spec, write

    data = search_spec(tmp_path, grad_accum_steps=[2, 4], lr_scaling=["linear"], samples_per_trial=16,
                       eval_every_samples=8)
    data["run"]["trackers"] = ["mlflow"]
    path = write(tmp_path, data)
    p = subprocess.run([str(BIN / "rayft"), "tune", str(path), "--address", ray_head.address], cwd=tmp_path,
                       env=ray_head.env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    launched = [r for r in results["trials"] if r["status"] not in ("infeasible", "skipped", "not run")]
    assert launched, results["trials"]
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    mlflow.set_tracking_uri(f"file:{tmp_path / 'out' / 'mlruns'}")
    runs = mlflow.search_runs(experiment_names=["ts"])
    assert len(runs) == len(launched)
    params = " ".join(str(v) for c in runs.columns if c.startswith("params.") for v in runs[c])
    assert "linear" in params  # the lr rule
    assert runs["metrics.eval_loss"].notna().all()
