"""`rayft tune` over a preference objective: `search.beta` as a grid dimension beside accumulation
and the lr rule, `search.metric` (eval_loss, lowest wins, or TRL's `eval_rewards/accuracies`, highest
wins) threaded through the plan, the trials' reports, the report and best.yaml; the refusals (beta
for SFT, several betas compared on eval loss) in one line; and one real search on Ray over two betas
whose best.yaml is a job spec `rayft run` takes, with the winning beta."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from gradtools import DATA, ROOT
from runs import step_line

from jobs import memory
from jobs.spec import JobSpec, load_spec
from orchestrator.cli import main

PAIRS = ROOT / "examples" / "data" / "tiny-pairs.jsonl"
PAIRS_EVAL = ROOT / "examples" / "data" / "tiny-pairs-eval.jsonl"
BIN = Path(sys.executable).parent
ACC = "eval_rewards/accuracies"
BUDGET_GIB = 1.0  # tiny-llama on CPU needs a few MiB: every split fits


def dpo_search(tmp_path: Path, objective: dict | None = None, **search) -> dict:
    """DPO on the tiny pairs, global batch 8 pairs on one worker, two betas compared on accuracy."""
    return {
        "name": "tp",
        "data": {"path": str(PAIRS), "eval_path": str(PAIRS_EVAL), "max_seq_len": 96},
        "objective": objective or {"name": "dpo"},
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 8, "micro_batch_size": 8},
        "optim": {"lr": 0.01, "schedule": "constant"},
        "run": {"output_dir": str(tmp_path / "out")},
        "search": {
            "grad_accum_steps": [1, 2],
            "beta": [0.1, 0.5],
            "metric": ACC,
            "budget_gib": BUDGET_GIB,
            "samples_per_trial": 16,
            "eval_every_samples": 8,
            **search,
        },
    }


def write(tmp_path: Path, data: dict, name: str = "search.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def refused(tmp_path: Path, capsys, data: dict) -> str:
    """The one line `rayft tune` refuses `data` with (exit 2, nothing created, no Ray)."""
    import ray

    path = write(tmp_path, data)
    rc = main(["tune", str(path)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rayft: error: {path}: "), lines[0]
    assert not (tmp_path / "out").exists() and not ray.is_initialized()
    return lines[0]


# ---- refusals ------------------------------------------------------------------------------------


def test_beta_is_refused_for_sft(tmp_path, capsys):
    data = dpo_search(tmp_path, objective={"name": "sft"}, metric="eval_loss", beta=[0.1])
    data["data"] = {"path": str(DATA), "eval_path": str(ROOT / "examples/data/tiny-eval.jsonl"), "max_seq_len": 64}
    line = refused(tmp_path, capsys, data)
    assert "search.beta: objective.name=sft has no beta" in line, line


def test_several_betas_compared_on_eval_loss_are_refused_naming_the_alternative(tmp_path, capsys):
    line = refused(tmp_path, capsys, dpo_search(tmp_path, metric="eval_loss"))
    assert "search.beta: eval losses at different beta are not comparable" in line, line
    assert "search.metric=eval_rewards/accuracies" in line, line
    # the default metric is eval_loss: leaving it out is the same refusal
    data = dpo_search(tmp_path)
    del data["search"]["metric"]
    assert "are not comparable" in refused(tmp_path, capsys, data)


def test_accuracy_metric_is_refused_for_sft(tmp_path, capsys):
    data = dpo_search(tmp_path, objective={"name": "sft"})
    del data["search"]["beta"]
    data["data"] = {"path": str(DATA), "eval_path": str(ROOT / "examples/data/tiny-eval.jsonl"), "max_seq_len": 64}
    line = refused(tmp_path, capsys, data)
    assert "search.metric=eval_rewards/accuracies: objective.name=sft reports eval_loss on held-out data" in line, line


@pytest.mark.parametrize(
    "betas,fragment",
    [
        ([0, 0.1], "search.beta.0: Input should be greater than 0"),
        ([0.1, -1], "search.beta.1: Input should be greater than 0"),
        ([0.1, 2000], "search.beta.1: Input should be less than or equal to 1000"),  # objective.beta's own bound
        ([], "search.beta: must list at least one value"),
        ([0.1, 0.1], "search.beta: values must be unique"),
    ],
    ids=["zero", "negative", "above-objective-bound", "empty", "duplicate"],
)
def test_bad_beta_values_are_one_line(tmp_path, capsys, betas, fragment):
    line = refused(tmp_path, capsys, dpo_search(tmp_path, beta=betas))
    assert fragment in line, line


def test_bad_metric_is_one_line(tmp_path, capsys):
    line = refused(tmp_path, capsys, dpo_search(tmp_path, metric="eval_rewards/margins"))
    assert "search.metric: Input should be 'eval_loss', 'eval_rewards/accuracies' or 'eval_reward'" in line, line


def test_one_beta_may_be_compared_on_eval_loss(tmp_path):
    from tune.plan import plan_search
    from tune.spec import load_search_spec

    plan = plan_search(load_search_spec(data=dpo_search(tmp_path, beta=[0.3], metric="eval_loss"), files=False))
    assert (plan.metric, plan.mode) == ("eval_loss", "min")
    assert {p.beta for p in plan.planned} == {0.3}


def test_search_fields_are_documented():
    from tune.spec import SearchSection

    fields = SearchSection.model_json_schema()["properties"]
    assert fields["beta"].get("description") and fields["metric"].get("description")


# ---- the plan: beta is a grid dimension, and changes no memory ------------------------------------


def test_plan_crosses_betas_with_the_splits_and_each_trial_carries_its_beta(tmp_path):
    from tune.plan import describe, plan_search, trial_job_dict
    from tune.spec import load_search_spec

    data = dpo_search(tmp_path)
    plan = plan_search(load_search_spec(data=data, files=False))
    assert (plan.metric, plan.mode, plan.base_beta) == (ACC, "max", 0.1)
    got = sorted((p.micro_batch_size, p.grad_accum_steps, p.beta) for p in plan.planned)
    assert got == [(4, 2, 0.1), (4, 2, 0.5), (8, 1, 0.1), (8, 1, 0.5)]
    assert len({p.key for p in plan.points}) == len(plan.points) and all("-b0." in p.key for p in plan.points)
    # beta changes no memory: the points of one micro-batch share its plan (jobs.memory's, at the budget)
    base = {k: v for k, v in data.items() if k != "search"}
    budget_job = load_spec(data=base | {"memory": {"budget_gib": BUDGET_GIB}}, files=False)
    for p in plan.planned:
        mp = memory.plan_for_spec(budget_job, device="cpu", micro_batch_size=p.micro_batch_size)
        assert p.estimate_gib == pytest.approx(mp.total_gib) and p.strategy == mp.strategy
        job = JobSpec.model_validate(
            trial_job_dict(plan.job, p.trial_config(), 0.01, str(tmp_path / "t"), "tp-t", BUDGET_GIB)
        )
        assert job.objective.name == "dpo" and job.objective.value("beta") == p.beta
        assert (job.batch.micro_batch_size, job.grad_accum_steps) == (p.micro_batch_size, p.grad_accum_steps)
        assert f"beta {p.beta:g}, " in describe(p.trial_config(), 0.01)
    assert plan.to_dict()["metric"] == ACC and plan.to_dict()["mode"] == "max"


def test_without_search_beta_trials_keep_the_base_jobs_beta(tmp_path):
    from tune.plan import plan_search, trial_job_dict
    from tune.spec import load_search_spec

    data = dpo_search(tmp_path, objective={"name": "ipo", "beta": 0.25}, metric="eval_loss")
    del data["search"]["beta"]
    plan = plan_search(load_search_spec(data=data, files=False))
    assert all(p.beta is None for p in plan.points) and plan.base_beta == 0.25
    (p, *_) = plan.planned
    assert plan.beta_of(p.trial_config()) == 0.25 and "-b" not in p.key
    job = JobSpec.model_validate(trial_job_dict(plan.job, p.trial_config(), 0.01, str(tmp_path / "t"), "tp-t", 1.0))
    assert job.objective.value("beta") == 0.25


def test_sft_plan_has_no_beta(tmp_path):
    from tune.plan import plan_search
    from tune.report import COLUMNS, columns
    from tune.spec import load_search_spec

    data = dpo_search(tmp_path, objective={"name": "sft"}, metric="eval_loss")
    del data["search"]["beta"]
    data["data"] = {"path": str(DATA), "eval_path": str(ROOT / "examples/data/tiny-eval.jsonl"), "max_seq_len": 64}
    plan = plan_search(load_search_spec(data=data, files=False))
    assert not plan.has_beta and plan.base_beta is None and (plan.metric, plan.mode) == ("eval_loss", "min")
    assert all(p.beta is None for p in plan.points) and columns(plan) == COLUMNS


def test_plan_flag_shows_each_points_beta_and_the_metric(tmp_path, capsys):
    assert main(["tune", str(write(tmp_path, dpo_search(tmp_path))), "--plan"]) == 0
    err = capsys.readouterr().err
    assert "trials compared on eval_rewards/accuracies (max)" in err.splitlines()[0]
    assert "lr_scaling none  , beta 0.1   , ddp" in err and "beta 0.5" in err, err


# ---- the trials' reports, the rows and the best ---------------------------------------------------


def test_reports_carry_the_searched_metric_beside_the_eval_loss():
    from tune.run import forward_metrics

    m = {"step": 2, "eval_loss": 0.69, ACC: 0.75, "loss": 0.7}
    assert forward_metrics(m, 4, 8, ACC) == {
        "samples_seen": 8,
        ACC: 0.75,
        "eval_loss": 0.69,
        "step": 2,
        "loss": 0.7,
        "tokens_per_s": None,
    }
    assert forward_metrics({"step": 2, "eval_loss": 0.69}, 4, 8, ACC) is None  # no accuracy: held back
    assert forward_metrics(m, 4, 8, "eval_loss") == {
        "samples_seen": 8,
        "eval_loss": 0.69,
        "step": 2,
        "loss": 0.7,
        "tokens_per_s": None,
    }


def test_final_value_falls_back_to_the_last_steps_record(tmp_path):
    from tune.run import final_value

    assert final_value({ACC: 0.5}, tmp_path, ACC, 2) == 0.5
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps(step_line(1, **{ACC: 0.25})) + "\n" + json.dumps(step_line(2, **{ACC: 0.75})) + "\n"
    )
    assert final_value({"eval_loss": 0.6}, tmp_path, ACC, 2) == 0.75
    assert final_value({}, tmp_path, ACC, 3) is None


def test_rows_carry_beta_and_the_metric_and_the_best_is_the_highest_accuracy(tmp_path):
    from tune.plan import plan_search
    from tune.report import best_job_dict, columns, pick_best, value_str
    from tune.run import collect_rows
    from tune.spec import load_search_spec

    raw = load_search_spec(data=dpo_search(tmp_path), files=False)
    plan = plan_search(raw)
    points = {(p.micro_batch_size, p.beta): p.trial_config() for p in plan.planned}
    out = tmp_path / "out"

    def trial(tid, micro, beta, acc, loss, tps):
        (out / "trials" / tid).mkdir(parents=True)
        m = {"samples_seen": 16, ACC: acc, "eval_loss": loss, "finished": True, "tokens_per_s": tps}
        return SimpleNamespace(
            path=str(out / "tune" / tid), config={"point": points[micro, beta], "lr": 0.01}, metrics=m, error=None
        )

    # the lowest eval loss (beta 0.1: its loss is the smaller scale) is not the best accuracy; of the
    # two at 0.75 the faster wins
    grid = [
        trial("t0", 8, 0.1, 0.5, 0.40, 100.0),
        trial("t1", 8, 0.5, 0.75, 0.65, 90.0),
        trial("t2", 4, 0.1, 0.625, 0.45, 80.0),
        trial("t3", 4, 0.5, 0.75, 0.60, 95.0),
    ]
    rows = collect_rows(plan, grid, out)
    assert [r["trial_id"] for r in rows] == ["t3", "t1", "t2", "t0"]  # best first: highest accuracy, then micro
    assert {r["trial_id"]: r["beta"] for r in rows} == {"t0": 0.1, "t1": 0.5, "t2": 0.1, "t3": 0.5}
    best = pick_best(rows, 16, ACC, "max")
    assert best["trial_id"] == "t3" and pick_best(rows, 16)["trial_id"] == "t0"  # eval_loss, min: t0
    assert "beta" in columns(plan) and ACC in columns(plan)
    assert value_str(plan, best) == "eval_rewards/accuracies 0.7500 (highest; eval_loss 0.6000)"
    d = best_job_dict(raw, best)
    assert d["objective"]["beta"] == 0.5 and "search" not in d
    assert JobSpec.model_validate(d).objective.value("beta") == 0.5


# ---- one real search on Ray ------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def dpo_search_run(tmp_path_factory):
    """DPO on the tiny pairs: betas 0.1 and 0.5 x accumulation 1 (micro 8), fifo, compared on
    eval_rewards/accuracies; 16 pairs per trial, reported every 8."""
    tmp = tmp_path_factory.mktemp("dpo-search")
    data = dpo_search(tmp, grad_accum_steps=[1], scheduler="fifo", max_concurrent_trials=2)
    path = write(tmp, data)
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
    return SimpleNamespace(tmp=tmp, out=out, data=data, run=done, results=results)


@pytest.mark.ray
@pytest.mark.slow
def test_search_over_two_betas_lists_both_and_picks_the_highest_accuracy(dpo_search_run):
    run, res = dpo_search_run.run, dpo_search_run.results
    assert run.returncode == 0, run.stderr[-3000:]
    assert res["metric"] == ACC and res["metric_mode"] == "max" and res["interrupted"] is False
    finished = [r for r in res["trials"] if r["status"] == "finished"]
    assert sorted(r["beta"] for r in finished) == [0.1, 0.5]
    for r in finished:
        assert r["samples_seen"] == 16 and r["steps"] == 2 and 0 <= r[ACC] <= 1 and r["eval_loss"] > 0
        # the trial trained with its beta
        trial = json.loads((Path(r["output_dir"]) / "trial.json").read_text())
        assert trial["spec"]["objective"]["beta"] == r["beta"]
        # it reported the metric at 8 and 16 samples
        reports = [
            json.loads(x)
            for x in (dpo_search_run.out / "tune" / r["trial_id"] / "result.json").read_text().splitlines()
        ]
        assert [x["samples_seen"] for x in reports] == [8, 16] and all(x[ACC] is not None for x in reports)
    best = res["best"]
    top = max(r[ACC] for r in finished)
    assert best[ACC] == top
    ties = [r for r in finished if round(r[ACC], 6) == round(top, 6)]
    assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in ties)  # ties go to the faster
    table = (dpo_search_run.out / "results.txt").read_text()
    assert "eval_rewards/accuracies (max)" in table and "beta" in table
    assert f"beta {best['beta']:g}, eval_rewards/accuracies {best[ACC]:.4f} (highest" in run.stdout, run.stdout[-2000:]
    assert "done" in run.stderr and f"{ACC} " in run.stderr
    assert f": {ACC} {best[ACC]:.4f} (highest;" in (dpo_search_run.out / "best.yaml").read_text().splitlines()[0]


@pytest.mark.ray
@pytest.mark.slow
def test_best_yaml_carries_the_winning_beta_and_runs(dpo_search_run, capsys):
    best_path = dpo_search_run.out / "best.yaml"
    raw = yaml.safe_load(best_path.read_text())
    best = dpo_search_run.results["best"]
    assert "search" not in raw and raw["objective"] == {**raw["objective"], "name": "dpo", "beta": best["beta"]}
    spec = load_spec(best_path)  # the job spec validator, files checked
    assert spec.objective.value("beta") == best["beta"] and spec.run.max_steps == 2
    assert main(["run", str(best_path), "--local"]) == 0  # in this process, without Ray: 2 tiny DPO steps
    summary = json.loads((spec.output_path / "summary.json").read_text())
    assert summary["objective"] == "dpo" and summary["steps"] == 2 and summary[ACC] is not None
