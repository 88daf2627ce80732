"""Losing a node under a search: `rayft tune` on a cluster of `ray start` nodes on 127.0.0.1
(conftest's session-wide `cluster`: a head without CPUs, two worker nodes of one CPU each), so a
trial's function and its one training worker hold two different nodes; the worker's node is
removed mid-trial (its raylet SIGKILLed).

- With `run.max_failures=1` in the search spec, the trial trains again from its checkpoint once
  a node is back and finishes with the result of an uninterrupted run of the same trial job.
- Without it, the trial is an error whose reason names the lost node (not infeasible, not out of
  memory), and the search goes on: its next trial runs and the report and best.yaml are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from clusters import LocalCluster
from gradtools import DATA, ROOT, final_adapter, rel_err
from polling import wait_until
from runs import metric_lines

BIN = Path(sys.executable).parent
EVAL = ROOT / "examples" / "data" / "tiny-eval.jsonl"
TRIAL_SIDE = {"ImplicitFunc", "TrainController"}  # the trial function and its Train controller


def _search(tmp_path: Path, marker: Path, accum: list[int], **run) -> Path:
    """One worker, global batch 8, 8 steps (64 samples), a checkpoint and an eval every 2 steps;
    every rank stalls before step 5 once (the checkpoint of step 4 is on disk by then)."""
    spec = {
        "name": "nl",
        "data": {"path": str(DATA), "eval_path": str(EVAL), "max_seq_len": 64},
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"lr": 0.01, "schedule": "constant"},
        "resources": {"num_workers": 1, "cpus_per_worker": 1},
        "run": {
            "output_dir": str(tmp_path / "out"),
            **run,
            "env": {"RAYFT_FAULT": f"sleep:step=5,seconds=120,once={marker}"},
        },
        # One ASHA rung, at the end: no early stops. The two trials compute the same global batches
        # (same math, other splits): at an earlier rung the next trial's eval loss ties the lost
        # one's up to rounding, and rounding decides whether ASHA stops it.
        "search": {
            "grad_accum_steps": accum,
            "lr_scaling": ["none"],
            "budget_gib": 8.0,
            "samples_per_trial": 64,
            "eval_every_samples": 16,
            "asha": {"grace_samples": 64},
        },
    }
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _tune(cluster: LocalCluster, spec: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "rayft"), "tune", str(spec), "--address", cluster.address],
        cwd=ROOT,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stall_then_remove_the_workers_node(
    cluster: LocalCluster, p: subprocess.Popen, out: Path, marker: Path
) -> tuple[Path, str]:
    """Wait until the first trial stalls before step 5, remove the node of its training worker
    (not the node of the trial function or Ray Train's controller); returns (trial dir, node id)."""

    def first_trial() -> list[Path]:
        return sorted(t.parent for t in (out / "trials").glob("*/metrics.jsonl"))

    wait_until(
        lambda: marker.exists() and bool(first_trial()) and len(metric_lines(first_trial()[0])) >= 4,
        300,
        "the trial's step 5",
        proc=p,
    )
    return first_trial()[0], cluster.remove_worker_node(TRIAL_SIDE)


def _uninterrupted(trial_dir: Path, out: Path) -> dict:
    """The trial's own job (trial.json), trained without Ray in one process, uninterrupted."""
    from jobs.spec import JobSpec
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    d = json.loads((trial_dir / "trial.json").read_text())["spec"]
    d["run"].update(output_dir=str(out), env={})
    return train(JobSpec.model_validate(d), LocalContext(on_progress=lambda r: None), resume=False)


@pytest.mark.ray
@pytest.mark.slow
def test_a_trial_whose_node_is_lost_resumes_from_its_checkpoint_with_max_failures(cluster, tmp_path):
    cluster.ensure_nodes(2)
    marker = tmp_path / "stalled"
    p = _tune(cluster, _search(tmp_path, marker, [2], max_failures=1))
    trial_dir, _ = _stall_then_remove_the_workers_node(cluster, p, tmp_path / "out", marker)
    cluster.add_node()  # capacity back
    o, err = p.communicate(timeout=400)
    assert p.returncode == 0, (o + err)[-3000:]
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["trials"]
    assert (row["status"], row["samples_seen"], row["trainings_started"]) == ("finished", 64, 2), row
    assert [m["step"] for m in metric_lines(trial_dir)] == list(range(1, 9))  # steps 5-8 once, after the resume
    ref = _uninterrupted(trial_dir, tmp_path / "ref")
    assert rel_err(final_adapter(trial_dir), final_adapter(tmp_path / "ref")) <= 1e-6
    assert abs(row["eval_loss"] - ref["eval_loss"]) <= 1e-6 * abs(ref["eval_loss"]), (
        row["eval_loss"],
        ref["eval_loss"],
    )


@pytest.mark.ray
@pytest.mark.slow
def test_without_max_failures_the_trial_is_an_error_naming_the_node_and_the_search_goes_on(cluster, tmp_path):
    cluster.ensure_nodes(2)
    marker = tmp_path / "stalled"
    p = _tune(cluster, _search(tmp_path, marker, [2, 4]))
    trial_dir, victim = _stall_then_remove_the_workers_node(cluster, p, tmp_path / "out", marker)
    cluster.add_node()  # the second trial needs the capacity back
    o, err = p.communicate(timeout=400)
    assert p.returncode == 0, (o + err)[-3000:]  # a best trial exists: the search ended normally
    assert "Traceback" not in o + err, (o + err)[-3000:]
    rows = {r["trial_id"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["trials"]}
    lost = rows.pop(trial_dir.name)
    assert lost["status"] == "error", lost
    assert lost["reason"].startswith(f"lost node {victim} ({cluster.node_ip(victim)})"), lost["reason"]
    assert "out of memory" not in lost["reason"]
    (other,) = rows.values()
    assert other["status"] == "finished" and other["samples_seen"] == 64, other
    assert (tmp_path / "out" / "best.yaml").exists()
