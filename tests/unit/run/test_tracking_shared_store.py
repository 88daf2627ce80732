"""Runs that share one new MLflow SQLite store (`run.mlflow_tracking_uri=sqlite:///...`) and open it
at the same moment each keep their tracker: MLflow makes a new store's schema on first use, and
two runs racing through those migrations lost one tracker (`jobs.run.tracking.store_lock`)."""

from __future__ import annotations

import subprocess
import sys
import time

from gradtools import DATA, ROOT

_OPEN = """
import sys, time
from jobs.spec import load_spec
from jobs.run.tracking import open_trackers
uri, out, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
spec = load_spec(data={"name": "shared", "data": {"path": [sys.argv[4]]}, "run": {"max_steps": 1,
    "output_dir": out, "trackers": ["mlflow"], "mlflow_tracking_uri": uri}}, files=False)
while time.time() < start:
    time.sleep(0.005)
t = open_trackers(spec, 0, True)
assert t.ml is not None, "tracker lost"
t.log_step({"step": 1, "loss": 1.0, "evaluated": False})
t.finish({"final_loss": 1.0}, [])
print("ok")
"""


def test_runs_opening_one_new_sqlite_store_at_once_all_keep_their_tracker(tmp_path):
    uri = f"sqlite:///{tmp_path / 'shared' / 'mlflow.db'}"
    start = time.time() + 12  # after every child has imported what it needs
    for i in range(3):
        (tmp_path / f"run{i}").mkdir()  # the loop makes the output dir before the trackers open
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN, uri, str(tmp_path / f"run{i}"), str(start), str(DATA)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0 and "ok" in out and "failed" not in err, err[-2000:]
    from mlflow.tracking import MlflowClient

    runs = MlflowClient(tracking_uri=uri).search_runs(experiment_ids=["0", "1"], max_results=10)
    assert len([r for r in runs if r.info.run_name == "shared"]) == 3
