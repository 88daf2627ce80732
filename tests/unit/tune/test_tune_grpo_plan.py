"""`rayft tune` over GRPO: `search.beta` (0 included: no KL, no reference forward) and
`search.num_generations` as grid dimensions, compared on the held-out mean reward `eval_reward`
(highest wins, the default metric of a GRPO search); a num_generations that does not divide a
point's global batch skips that point with why; a metric the objective does not report, and
num_generations for an objective that samples nothing, are refused in one line. Pure: no Ray."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from gradtools import ROOT

from jobs import memory
from jobs.errors import SpecError
from jobs.spec import JobSpec, load_spec
from orchestrator.cli import main
from tune.plan import describe, plan_search, trial_job_dict
from tune.spec import load_search_spec

EXAMPLE = ROOT / "examples" / "tune-grpo.yaml"
REWARD = "eval_reward"


def grpo_search(**search) -> dict:
    """examples/tune-grpo.yaml as data, its `search` section updated."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["search"].update(search)
    return data


def plan_of(data: dict):
    return plan_search(load_search_spec(EXAMPLE, data=data, files=False))


def refusal(data: dict) -> str:
    with pytest.raises(SpecError) as e:
        load_search_spec(EXAMPLE, data=data, files=False)
    return str(e.value)


# ---- the plan -------------------------------------------------------------------------------------


def test_betas_cross_num_generations_and_a_value_that_does_not_divide_is_skipped():
    plan = plan_of(grpo_search())
    assert (plan.metric, plan.mode) == (REWARD, "max")
    got = sorted((p.beta, p.num_generations) for p in plan.planned)
    assert got == [(0.0, 2), (0.0, 4), (0.04, 2), (0.04, 4)]
    skipped = [p for p in plan.points if p.status == "skipped"]
    assert sorted(p.beta for p in skipped) == [0.0, 0.04] and {p.num_generations for p in skipped} == {3}
    assert all("not a multiple of num_generations=3" in p.reason for p in skipped)
    assert len({p.key for p in plan.points}) == len(plan.points)


def test_each_trial_trains_with_its_beta_and_num_generations_judged_by_its_own_memory_plan(tmp_path):
    data = grpo_search()
    plan = plan_of(data)
    base = {k: v for k, v in data.items() if k != "search"}
    for p in plan.planned:
        job = JobSpec.model_validate(trial_job_dict(plan.job, p.trial_config(), 0.01, str(tmp_path), "t", 0.05))
        assert job.objective.value("beta") == p.beta and job.rollout.num_generations == p.num_generations
        assert job.objective.has_reference == (p.beta > 0)  # beta 0: no reference forward
        budget_job = load_spec(data=base | {"objective": {**base["objective"], "beta": p.beta}}, files=False)
        budget_job = JobSpec.model_validate(budget_job.to_dict() | {"memory": {"budget_gib": 0.05}})
        mp = memory.plan_for_spec(budget_job, device="cpu", micro_batch_size=p.micro_batch_size)
        assert p.estimate_gib == pytest.approx(mp.total_gib)
        assert f"beta {p.beta:g}, num_generations {p.num_generations}, " in describe(p.trial_config(), 0.01)


def test_the_metric_of_a_grpo_search_defaults_to_the_held_out_reward():
    data = grpo_search()
    del data["search"]["metric"]
    assert (plan_of(data).metric, plan_of(data).mode) == (REWARD, "max")
    assert load_search_spec(EXAMPLE, data=data, files=False).search.metric == REWARD  # the fingerprint sees it


def test_without_search_keys_trials_keep_the_base_jobs_beta_and_num_generations():
    data = grpo_search()
    del data["search"]["beta"], data["search"]["num_generations"]
    plan = plan_of(data)
    (p,) = plan.planned
    assert p.beta is None and p.num_generations is None
    assert (plan.beta_of(p.trial_config()), plan.generations_of(p.trial_config())) == (0.0, 4)


def test_reward_files_are_beside_the_spec_file():
    spec = load_search_spec(EXAMPLE, data=grpo_search(), files=True)
    assert Path(spec.reward.functions[0].fn.split(":")[0]).resolve() == ROOT / "examples/rewards/tiny.py"


# ---- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "search,fragment",
    [
        ({"metric": "eval_loss"}, "search.metric=eval_loss: objective.name=grpo reports eval_reward on held-out data"),
        ({"metric": "eval_rewards/accuracies"}, "search.metric=eval_rewards/accuracies: objective.name=grpo reports"),
        ({"num_generations": [4, 1]}, "search.num_generations.1: must be at least 2"),
        ({"num_generations": [2, 2]}, "search.num_generations: values must be unique"),
        ({"beta": [0.0, -0.1]}, "search.beta.1: Input should be greater than or equal to 0"),
    ],
    ids=["eval-loss", "accuracy", "one-generation", "duplicate", "negative-beta"],
)
def test_grpo_search_refusals(search, fragment):
    assert fragment in refusal(grpo_search(**search))


def test_sft_refuses_the_reward_metric_and_num_generations():
    sft = yaml.safe_load((ROOT / "examples/tune-accum.yaml").read_text())
    sft["search"]["metric"] = REWARD
    line = refusal(sft)
    assert "search.metric=eval_reward: objective.name=sft reports eval_loss on held-out data" in line, line
    del sft["search"]["metric"]
    sft["search"]["num_generations"] = [2]
    assert "search.num_generations: objective.name=sft samples no completions" in refusal(sft)


def test_a_preference_beta_of_zero_is_still_refused():
    dpo = yaml.safe_load((ROOT / "examples/tune-dpo.yaml").read_text())
    dpo["search"]["beta"] = [0.0, 0.1]
    assert "search.beta.0: Input should be greater than 0" in refusal(dpo)


def test_the_cli_refuses_in_one_line_exit_2(tmp_path, capsys):
    data = grpo_search(metric="eval_loss")
    data["run"]["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "tiny.py").write_text((ROOT / "examples/rewards/tiny.py").read_text())
    assert main(["tune", str(path), "--plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "search.metric=eval_loss: objective.name=grpo" in err[0], err
    assert not (tmp_path / "out").exists()


# ---- reports, rows and the best -------------------------------------------------------------------


def test_reports_carry_the_held_out_reward():
    from tune.run import forward_metrics

    got = forward_metrics({"step": 2, "eval_loss": None, REWARD: 0.3, "loss": 0.1}, 8, 4, REWARD)
    assert got[REWARD] == 0.3 and got["samples_seen"] == 16 and got["eval_loss"] is None
    assert forward_metrics({"step": 2, "eval_loss": 0.5}, 8, 4, REWARD) is None  # no reward: held back


def test_rows_show_beta_and_num_generations_and_the_best_is_the_highest_reward(tmp_path):
    from tune.report import best_job_dict, columns, pick_best, results_table, value_str
    from tune.run import collect_rows

    raw = load_search_spec(EXAMPLE, data=grpo_search(), files=False)
    plan = plan_search(raw)
    points = {(p.beta, p.num_generations): p.trial_config() for p in plan.planned}
    out = tmp_path / "out"

    def trial(tid, beta, gens, reward, tps):
        (out / "trials" / tid).mkdir(parents=True)
        m = {"samples_seen": 32, REWARD: reward, "eval_loss": None, "finished": True, "tokens_per_s": tps}
        cfg = {"point": points[beta, gens], "lr": 0.01}
        return SimpleNamespace(path=str(out / "tune" / tid), config=cfg, metrics=m, error=None)

    grid = [trial("t0", 0.0, 2, 0.1, 100.0), trial("t1", 0.0, 4, 0.3, 50.0), trial("t2", 0.04, 2, 0.2, 90.0)]
    rows = collect_rows(plan, grid, out)
    assert [r["trial_id"] for r in rows[:3]] == ["t1", "t2", "t0"]  # best first: the highest reward
    assert {r["trial_id"]: (r["beta"], r["num_generations"]) for r in rows[:3]} == {
        "t0": (0.0, 2),
        "t1": (0.0, 4),
        "t2": (0.04, 2),
    }
    best = pick_best(rows, 32, REWARD, "max")
    assert best["trial_id"] == "t1"  # neither the lowest reward (t0) nor the fastest
    assert value_str(plan, best) == "eval_reward 0.3000 (highest)"
    cols = columns(plan)
    assert cols.index("beta") < cols.index("num_generations") < cols.index("base_lr") and REWARD in cols
    d = best_job_dict(raw, best)
    assert d["objective"]["beta"] == 0.0 and d["rollout"]["num_generations"] == 4 and "search" not in d
    assert Path(d["reward"]["functions"][0]["fn"].split(":")[0]).is_absolute()  # best.yaml lives elsewhere
    job = JobSpec.model_validate(d)
    assert job.rollout.num_generations == 4 and job.objective.value("beta") == 0.0
    headers = [c.header for c in results_table(rows, "g", plan).columns]
    assert "gens" in headers and "eval reward" in headers and "beta" in headers
