"""One real GRPO search on Ray (`rayft tune`): two trials, one per `rollout.num_generations`, both
with `objective.beta` 0 (no reference forward), compared on the held-out mean reward `eval_reward`
the trials' own runs write (summary.json, metrics.jsonl); the best is the highest, and best.yaml
is a job spec with its num_generations and beta. The plan, the refusals and the best's choice
on scripted rows are in tests/unit/tune/test_tune_grpo_plan.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from gradtools import ROOT

from jobs.spec import load_spec

EXAMPLE = ROOT / "examples" / "tune-grpo.yaml"
BIN = Path(sys.executable).parent
REWARD = "eval_reward"


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def grpo_search_run(tmp_path_factory):
    """examples/tune-grpo.yaml cut to two trials (beta 0 x num_generations 2 and 4), fifo, 16
    completions per trial, reported every 8."""
    tmp = tmp_path_factory.mktemp("grpo-search")
    data = yaml.safe_load(EXAMPLE.read_text())
    data["data"] = {**data["data"], "path": str(ROOT / data["data"]["path"])}
    data["data"]["eval_path"] = str(ROOT / data["data"]["eval_path"])
    data["run"]["output_dir"] = str(tmp / "out")
    search = {"beta": [0.0], "num_generations": [2, 4], "scheduler": "fifo", "max_concurrent_trials": 2}
    data["search"].update(search, samples_per_trial=16, eval_every_samples=8)
    (tmp / "rewards").mkdir()
    (tmp / "rewards" / "tiny.py").write_text((ROOT / "examples/rewards/tiny.py").read_text())
    path = tmp / "search.yaml"
    path.write_text(yaml.safe_dump(data))
    done = subprocess.run(
        [str(BIN / "rayft"), "tune", str(path), "--num-cpus", "4"],
        cwd=tmp,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = tmp / "out"
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return SimpleNamespace(tmp=tmp, out=out, run=done, results=results)


@pytest.mark.ray
@pytest.mark.slow
def test_two_grpo_trials_finish_and_the_best_has_the_highest_held_out_reward(grpo_search_run):
    run, res = grpo_search_run.run, grpo_search_run.results
    assert run.returncode == 0, run.stderr[-3000:]
    assert res["metric"] == REWARD and res["metric_mode"] == "max" and res["interrupted"] is False
    finished = [r for r in res["trials"] if r["status"] == "finished"]
    assert sorted(r["num_generations"] for r in finished) == [2, 4] and {r["beta"] for r in finished} == {0.0}
    for r in finished:
        assert r["samples_seen"] == 16 and r["steps"] == 2 and 0 <= r[REWARD] <= 1
        tdir = Path(r["output_dir"])
        trial = json.loads((tdir / "trial.json").read_text())
        assert trial["spec"]["rollout"]["num_generations"] == r["num_generations"]
        assert trial["spec"]["objective"]["beta"] == 0.0
        # the value compared is the one the trial's run wrote, at its last step and in its summary
        summary = json.loads((tdir / "summary.json").read_text())
        assert summary[REWARD] == pytest.approx(r[REWARD]) and summary["eval_loss"] is None
        last = [json.loads(x) for x in (tdir / "metrics.jsonl").read_text().splitlines()][-1]
        assert last["step"] == 2 and last[REWARD] == pytest.approx(r[REWARD])
        # each step sampled groups of its num_generations: 8 completions, 8 / n prompts
        lines = [json.loads(x) for x in (tdir / "rollouts" / "step-000001.jsonl").read_text().splitlines()]
        assert len(lines) == 8 and len({x["prompt_index"] for x in lines}) == 8 // r["num_generations"]
        reports = [json.loads(x) for x in (grpo_search_run.out / "tune" / r["trial_id"] / "result.json").open()]
        assert [x["samples_seen"] for x in reports] == [8, 16] and all(x[REWARD] is not None for x in reports)
    best = res["best"]
    assert best[REWARD] == max(r[REWARD] for r in finished)
    if len({round(r[REWARD], 6) for r in finished}) > 1:  # two different rewards: the lower one lost
        assert best[REWARD] > min(r[REWARD] for r in finished)
    table = (grpo_search_run.out / "results.txt").read_text()
    assert "eval_reward (max)" in table and "gens" in table and "beta" in table
    line = f"num_generations {best['num_generations']}, eval_reward {best[REWARD]:.4f} (highest)"
    assert line in run.stdout, run.stdout[-2000:]


@pytest.mark.ray
@pytest.mark.slow
def test_best_yaml_carries_the_winning_num_generations_and_beta(grpo_search_run):
    best = grpo_search_run.results["best"]
    best_path = grpo_search_run.out / "best.yaml"
    raw = yaml.safe_load(best_path.read_text())
    assert "search" not in raw and raw["rollout"]["num_generations"] == best["num_generations"]
    assert raw["objective"]["beta"] == 0.0
    spec = load_spec(best_path)  # the job spec validator, reward files found from where best.yaml is
    assert spec.rollout.num_generations == best["num_generations"] and spec.run.max_steps == 2
