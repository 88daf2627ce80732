"""`rayft tune`: the search spec, the plan (modes, divisibility, memory budget), the refusal of
an impossible budget, and one real search on Ray (infeasible configurations never launched, an
injected out-of-memory trial recorded as infeasible and not retried, best.yaml that runs, and
an interrupted search that resumes without rerunning finished trials)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from gradtools import DATA, ROOT
from polling import wait_group_gone, wait_until

from jobs import memory
from jobs.spec import JobSpec, load_spec
from orchestrator.cli import main

EVAL = ROOT / "examples" / "data" / "tiny-eval.jsonl"
BIN = Path(sys.executable).parent


def job_of(data: dict) -> JobSpec:
    d = {k: v for k, v in data.items() if k != "search"}
    return load_spec(data=d)


def est(job: JobSpec, micro: int, gc: bool) -> float:
    return memory.estimate_for_spec(job, micro_batch_size=micro, gradient_checkpointing=gc, device="cpu").total_gib


def _budget() -> float:
    """Between micro-batch 4 and micro-batch 8 (each at its cheaper checkpointing setting), from
    jobs.memory itself, so the tests follow the memory model as it evolves."""
    job = job_of(
        {
            "name": "b",
            "data": {"path": str(DATA), "max_seq_len": 64},
            "lora": {"r": 4, "alpha": 8},
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        }
    )
    fits = max(min(est(job, m, False), est(job, m, True)) for m in (1, 2, 4))
    over = min(est(job, 8, False), est(job, 8, True))
    assert fits < over
    return round((fits + over) / 2, 6)


BUDGET = _budget()


def search_spec(tmp_path: Path, **search) -> dict:
    """fixed_global_batch over global batch 8 on one worker, seq 64: micro 8 (over BUDGET), 4, 2, 1,
    and accumulation 3 (skipped: 8 is not divisible by 3)."""
    return {
        "name": "ts",
        "data": {"path": str(DATA), "eval_path": str(EVAL), "max_seq_len": 64},
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "optim": {"lr": 0.01, "schedule": "constant"},
        "memory": {"gradient_checkpointing": "auto"},
        "run": {"output_dir": str(tmp_path / "out")},
        "search": {
            "grad_accum_steps": [1, 2, 4, 8, 3],
            "lr_scaling": ["none", "linear"],
            "lr": {"low": 1e-3, "high": 3e-2},
            "budget_gib": BUDGET,
            "samples_per_trial": 32,
            "eval_every_samples": 16,
            **search,
        },
    }


def write(tmp_path: Path, data: dict, name: str = "search.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


# ---- the search spec: validated like a job spec ---------------------------------------------

SPEC_CASES = [
    ("unknown-search-key", {"search.foo": 1}, "search.foo: unknown key"),
    ("missing-samples", {"search.samples_per_trial": None}, "search.samples_per_trial: required key is missing"),
    ("missing-accum", {"search.grad_accum_steps": None}, "search.grad_accum_steps: required key is missing"),
    ("accum-empty", {"search.grad_accum_steps": []}, "search.grad_accum_steps: must list at least one value"),
    ("accum-zero", {"search.grad_accum_steps": [0, 2]}, "search.grad_accum_steps: values must be >= 1"),
    ("accum-dup", {"search.grad_accum_steps": [2, 2]}, "search.grad_accum_steps: values must be unique"),
    ("rule", {"search.lr_scaling": ["cubic"]}, "search.lr_scaling.0: Input should be 'none', 'linear' or 'sqrt'"),
    ("mode", {"search.mode": "both"}, "search.mode: Input should be 'fixed_global_batch' or 'fixed_micro_batch'"),
    (
        "lr-order",
        {"search.lr": {"low": 0.1, "high": 0.01}},
        "search.lr: search.lr.high=0.01 is below search.lr.low=0.1",
    ),
    ("lr-zero", {"search.lr": {"low": 0, "high": 0.01}}, "search.lr.low: Input should be greater than 0"),
    ("no-budget", {"search.budget_gib": None}, "search.budget_gib: required (or set memory.budget_gib)"),
    ("budget-negative", {"search.budget_gib": -1}, "search.budget_gib: Input should be greater than 0"),
    ("micro-in-global-mode", {"search.micro_batch_size": [1, 2]}, "search.micro_batch_size: only for search.mode"),
    ("no-eval-data", {"data.eval_path": None}, "data.eval_path: the search compares trials on held-out data"),
    ("max-steps", {"run.max_steps": 5}, "run.max_steps: not used by a search"),
    (
        "eval-every",
        {"search.eval_every_samples": 24},
        "search.samples_per_trial=32 is not a multiple of search.eval_every_samples=24",
    ),
    ("reduction", {"search.asha.reduction_factor": 1}, "search.asha.reduction_factor: Input should be greater than"),
    ("num-samples", {"search.num_samples": 0}, "search.num_samples: Input should be greater than 0"),
    ("base-job-still-checked", {"batch.micro_batch_size": 3}, "batch.global_batch_size=8 is not divisible by"),
]


def _set(d: dict, dotted: str, value) -> None:
    *head, last = dotted.split(".")
    for k in head:
        d = d.setdefault(k, {})
    if value is None:
        d.pop(last, None)
    else:
        d[last] = value


@pytest.mark.parametrize("change,fragment", [c[1:] for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES])
def test_bad_search_spec_is_one_line_exit_2_and_starts_nothing(tmp_path, capsys, change, fragment):
    data = search_spec(tmp_path)
    for k, v in change.items():
        _set(data, k, v)
    path = write(tmp_path, data)
    rc = main(["tune", str(path)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rayft: error: {path}: ") and fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_a_job_spec_is_not_a_search_spec(tmp_path, capsys):
    data = search_spec(tmp_path)
    del data["search"]
    assert main(["tune", str(write(tmp_path, data))]) == 2
    assert "search: required key is missing" in capsys.readouterr().err


def test_search_section_fields_are_documented():
    from tune.spec import SearchSpec

    schema = SearchSpec.model_json_schema()
    missing = [
        f"{name}.{f}"
        for name, d in schema["$defs"].items()
        for f, p in d.get("properties", {}).items()
        if not p.get("description")
    ]
    assert not missing, missing
    assert schema["properties"]["search"].get("description")


# ---- the plan --------------------------------------------------------------------------------


def test_plan_fixed_global_batch(tmp_path):
    from tune.plan import plan_search
    from tune.spec import load_search_spec

    data = search_spec(tmp_path)
    spec = load_search_spec(data=data)
    plan = plan_search(spec)
    job = job_of(data)
    budget_job = job_of(dict(data, memory=dict(data["memory"], budget_gib=BUDGET)))  # as a trial runs it
    by_accum = {p.grad_accum_steps: p for p in plan.points}
    # one rule: in this mode every trial's global batch is the reference batch, so linear == none
    assert {p.lr_scaling for p in plan.points} == {"none"} and any("searched once" in n for n in plan.notes)
    # micro = global / (accum x workers); 3 does not divide 8: skipped, saying why
    assert {a: p.micro_batch_size for a, p in by_accum.items() if p.status != "skipped"} == {1: 8, 2: 4, 4: 2, 8: 1}
    assert by_accum[3].status == "skipped" and "not divisible by grad_accum_steps=3" in by_accum[3].reason
    for _a, p in by_accum.items():
        assert p.global_batch_size == 8
        if p.status == "skipped":
            continue
        # auto checkpointing: on exactly when off does not fit, then the sparsest every-k that
        # fits; the estimate is jobs.memory's for that choice
        off, on = est(job, p.micro_batch_size, False), est(job, p.micro_batch_size, True)
        assert p.gradient_checkpointing == (off > BUDGET)
        mp = memory.plan_for_spec(budget_job, device="cpu", micro_batch_size=p.micro_batch_size)
        every = mp.checkpoint_every_n_layers
        assert p.checkpoint_every_n_layers == every and p.estimate_gib == pytest.approx(mp.total_gib)
        assert p.estimate_gib == pytest.approx(off) if not every else on <= p.estimate_gib < off
        assert (p.status == "infeasible") == (p.estimate_gib > BUDGET)
    assert by_accum[1].status == "infeasible" and "> budget" in by_accum[1].reason  # micro 8 does not fit
    assert [p.micro_batch_size for p in plan.planned] == [4, 2, 1]
    assert any(p.gradient_checkpointing for p in plan.planned) and not all(
        p.gradient_checkpointing for p in plan.planned
    )
    for p in plan.planned:  # same samples, same report points, whatever the split
        assert p.max_steps * p.global_batch_size == 32 and p.every_steps * p.global_batch_size == 16


def test_trials_run_the_checkpointing_their_plan_estimated(tmp_path):
    """A budget between selective (every 2nd layer) and no checkpointing: the plan picks the
    selective choice, and the trial's own `auto` (jobs.train.loop.memory_plan) picks it too."""
    import torch

    from jobs.train.loop import memory_plan
    from tune.plan import plan_search, trial_job_dict
    from tune.spec import load_search_spec

    job = job_of(search_spec(tmp_path))
    m = 4
    off = est(job, m, False)
    every2 = memory.estimate_for_spec(
        job, micro_batch_size=m, gradient_checkpointing=True, device="cpu", checkpoint_every_n_layers=2
    ).total_gib
    assert est(job, m, True) < every2 < off
    budget = round((every2 + off) / 2, 6)
    data = search_spec(tmp_path, grad_accum_steps=[2], budget_gib=budget)
    plan = plan_search(load_search_spec(data=data))
    (p,) = plan.planned
    assert p.micro_batch_size == m and p.gradient_checkpointing and p.checkpoint_every_n_layers == 2
    assert p.estimate_gib == pytest.approx(every2)
    trial = load_spec(
        data=trial_job_dict(job_of(data).to_dict(), p.trial_config(), 0.01, str(tmp_path / "t"), "ts-t", budget)
    )
    assert trial.memory.gradient_checkpointing == "auto" and trial.memory.budget_gib == budget
    run = memory_plan(trial, torch.device("cpu"))
    assert (run.checkpoint_every_n_layers, run.total_gib) == (2, pytest.approx(every2))


def test_plan_fixed_micro_batch_grows_the_global_batch_and_pins_the_reference(tmp_path):
    from tune.plan import plan_search, trial_job_dict
    from tune.spec import load_search_spec

    data = search_spec(
        tmp_path,
        mode="fixed_micro_batch",
        micro_batch_size=[2, 8],
        grad_accum_steps=[1, 2, 4],
        lr_scaling=["none", "linear", "sqrt"],
        samples_per_trial=64,
        eval_every_samples=None,
    )
    data["search"].pop("eval_every_samples")
    plan = plan_search(load_search_spec(data=data))
    assert plan.eval_every_samples == 8  # lcm of the feasible global batches 2, 4, 8
    planned = plan.planned
    assert {(p.micro_batch_size, p.grad_accum_steps, p.lr_scaling) for p in planned} == {
        (2, a, r) for a in (1, 2, 4) for r in ("none", "linear", "sqrt")
    } - {(2, 4, "linear"), (2, 4, "sqrt")}
    # at the reference batch every rule gives the base lr: searched once, the others say why
    same = [p for p in plan.points if p.global_batch_size == 8 and p.micro_batch_size == 2 and p.status == "skipped"]
    assert sorted(p.lr_scaling for p in same) == ["linear", "sqrt"] and "same run as lr_scaling=none" in same[0].reason
    eight = [p for p in plan.points if p.micro_batch_size == 8]
    assert all(p.status == "infeasible" for p in eight if p.status != "skipped")
    assert {p.grad_accum_steps for p in eight if p.status == "infeasible"} == {1, 2, 4}
    base = job_of(data).to_dict()
    for p in planned:
        assert p.global_batch_size == 2 * p.grad_accum_steps  # micro x accum x workers
        assert p.reference_batch_size == 8  # the base job's global batch
        job = JobSpec.model_validate(trial_job_dict(base, p.trial_config(), 0.01, str(tmp_path / "t"), "t-1", BUDGET))
        x = p.global_batch_size / 8
        want = 0.01 * {"none": 1, "linear": x, "sqrt": math.sqrt(x)}[p.lr_scaling]
        assert job.effective_lr == pytest.approx(want)
        assert job.run.max_steps * p.global_batch_size == 64
        assert job.run.eval_every * p.global_batch_size == 8 == job.run.checkpoint_every * p.global_batch_size
        # `auto` stays `auto`: the trial decides as its plan did (the test above), under the budget
        assert job.memory.gradient_checkpointing == "auto" and job.memory.budget_gib == BUDGET


def test_plan_skips_global_batches_that_do_not_divide_the_sample_budget(tmp_path):
    from tune.plan import plan_search
    from tune.spec import load_search_spec

    data = search_spec(
        tmp_path,
        mode="fixed_micro_batch",
        micro_batch_size=[1],
        grad_accum_steps=[2, 3],
        lr_scaling=["none"],
        samples_per_trial=32,
        eval_every_samples=16,
    )
    plan = plan_search(load_search_spec(data=data))
    skipped = [p for p in plan.points if p.status == "skipped"]
    assert [p.grad_accum_steps for p in skipped] == [3]
    assert "samples_per_trial=32 is not a multiple of the global batch 3" in skipped[0].reason


def test_forwarded_reports_count_samples_not_steps():
    from tune.run import forward_metrics

    # global batch 4, 8 steps: steps 2 and 4 become 8 and 16 samples; the last step is the trial's own report
    assert forward_metrics({"step": 2, "eval_loss": 3.0, "loss": 3.1}, 4, 8)["samples_seen"] == 8
    assert forward_metrics({"step": 4, "eval_loss": 2.0}, 4, 8) == {
        "samples_seen": 16,
        "eval_loss": 2.0,
        "step": 4,
        "loss": None,
        "tokens_per_s": None,
    }
    assert forward_metrics({"step": 8, "eval_loss": 1.0}, 4, 8) is None
    assert forward_metrics({"step": 3, "eval_loss": None}, 4, 8) is None


def test_results_classify_trials_by_tunes_verdict_and_the_trials_own_record(tmp_path):
    """finished / stopped early by ASHA / out of memory (infeasible) / error / never launched. A trial
    ASHA stopped may have written an "error" status while it was being killed: Tune's verdict wins."""
    from types import SimpleNamespace

    from tune.plan import plan_search
    from tune.run import collect_rows
    from tune.spec import load_search_spec

    plan = plan_search(load_search_spec(data=search_spec(tmp_path)))
    points = {p.micro_batch_size: p.trial_config() for p in plan.planned}  # 4, 2, 1
    out = tmp_path / "out"

    def trial(tid, micro, metrics, error=None, status=None):
        d = out / "trials" / tid
        d.mkdir(parents=True)
        if status:
            (d / "status.json").write_text(json.dumps(status))
        (d / "starts.log").write_text("2026-01-01T00:00:00 train\n")
        return SimpleNamespace(
            path=str(out / "tune" / tid), config={"point": points[micro], "lr": 0.01}, metrics=metrics, error=error
        )

    grid = [
        trial(
            "t0",
            4,
            {},
            RuntimeError("TrialOutOfMemory: out of memory"),
            {"status": "oom", "error": "torch.OutOfMemoryError: CUDA out of memory"},
        ),
        trial(
            "t1",
            2,
            {"samples_seen": 32, "eval_loss": 2.5, "finished": True, "tokens_per_s": 10.0},
            status={"status": "finished", "result": {"samples_seen": 32, "eval_loss": 2.5, "finished": True}},
        ),
        trial(
            "t2",
            1,
            {"samples_seen": 16, "eval_loss": 3.0},
            None,
            {"status": "error", "error": "ActorDiedError: The actor died unexpectedly"},
        ),
        trial("t3", 2, {}, RuntimeError("ValueError: bad data line 3")),
    ]
    rows = {r["trial_id"] or r["key"]: r for r in collect_rows(plan, grid, out)}
    assert rows["t0"]["status"] == "infeasible" and "out of memory when run (not retried)" in rows["t0"]["reason"]
    assert rows["t1"]["status"] == "finished" and rows["t1"]["eval_loss"] == 2.5 and rows["t1"]["steps"] == 4
    assert rows["t2"]["status"] == "stopped" and rows["t2"]["eval_loss"] == 3.0 and rows["t2"]["samples_seen"] == 16
    assert rows["t3"]["status"] == "error" and "bad data line 3" in rows["t3"]["reason"]
    never = [r for r in rows.values() if r["trial_id"] is None]
    assert {(r["status"], r["micro_batch_size"]) for r in never} == {("infeasible", 8), ("skipped", None)}
    assert all(r["trainings_started"] == 0 for r in never)


def test_oom_is_recognised_through_ray_wrapping():
    import torch

    from jobs.errors import oom_line

    try:
        raise RuntimeError("worker group failed") from torch.OutOfMemoryError("CUDA out of memory (injected)")
    except RuntimeError as e:
        assert oom_line(e) == "OutOfMemoryError: CUDA out of memory (injected)"
    flat = RuntimeError("Traceback:\n  raise torch.OutOfMemoryError(\ntorch.OutOfMemoryError: CUDA out of memory x\n")
    assert oom_line(flat) == "torch.OutOfMemoryError: CUDA out of memory x"
    assert oom_line(ValueError("bad data line 3")) is None


def test_budget_too_small_for_micro_batch_1_is_refused_before_anything_starts(tmp_path, capsys):
    import ray

    from tune.plan import plan_search, smallest_budget_str
    from tune.spec import load_search_spec

    data = search_spec(tmp_path)
    smallest = memory.smallest_budget_gib(job_of(data), device="cpu")  # micro-batch 1, checkpointing on
    assert smallest == pytest.approx(est(job_of(data), 1, True))
    path = write(tmp_path, data)
    rc = main(["tune", str(path), f"search.budget_gib={smallest * 0.9}"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    named = smallest_budget_str(smallest)
    assert f"the smallest budget that fits is {named} GiB" in err and "micro_batch_size=1" in err
    assert "search.budget_gib" in err
    assert not (tmp_path / "out").exists() and not ray.is_initialized()
    # the named budget is not below the estimate, and with it the plan is accepted
    assert smallest <= float(named) <= smallest * 1.001
    assert plan_search(load_search_spec(data=data, overrides=[f"search.budget_gib={named}"])).planned


def test_plan_flag_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    import ray

    assert main(["tune", str(write(tmp_path, search_spec(tmp_path))), "--plan"]) == 0
    err = capsys.readouterr().err
    assert "infeasible micro   8" in err and "skipped" in err and "planned    micro   4" in err
    assert not (tmp_path / "out").exists() and not ray.is_initialized()


def test_resume_without_a_search_to_resume_is_refused(tmp_path, capsys):
    import ray

    assert main(["tune", str(write(tmp_path, search_spec(tmp_path))), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"rayft: error: {tmp_path / 'search.yaml'}: --resume: "
        f"no interrupted search to resume in {tmp_path / 'out' / 'tune'}"
    ]
    assert not (tmp_path / "out").exists() and not ray.is_initialized()


# ---- one real search on Ray, interrupted and resumed -------------------------------------------


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    return env


def _statuses(trials: Path) -> dict[str, str]:
    out = {}
    for d in trials.glob("*"):
        try:
            out[d.name] = json.loads((d / "status.json").read_text())["status"]
        except (OSError, ValueError, KeyError):
            out[d.name] = "running"
    return out


def _saved_states(experiment: Path) -> dict[str, str]:
    """Trial id -> Tune status in the newest saved experiment state (what Tuner.restore resumes from)."""
    files = sorted(experiment.glob("experiment_state-*.json"), key=lambda f: f.stat().st_mtime)
    try:
        data = json.loads(files[-1].read_text())
        return {t["trial_id"]: t["status"] for t in (json.loads(state) for state, _ in data["trial_data"])}
    except (IndexError, OSError, ValueError, KeyError):
        return {}  # none yet, or one being replaced


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """fixed_global_batch, global batch 8: micro 8 infeasible by estimate; micro 4, 2, 1 launched, and
    micro 4 runs out of memory (injected). The search is SIGKILLed once a trial has finished and the
    micro 4 one has run out of memory (killed with that one still starting, the resume rightly starts
    it again: what test_out_of_memory_trial_is_infeasible_and_not_retried checks would not hold), then
    the same command resumes it."""
    tmp = tmp_path_factory.mktemp("search")
    data = search_spec(tmp, asha={"grace_samples": 32})  # one rung, at the end: no early stops here
    data["run"]["env"] = {"RAYFT_FAULT": "oom:micro_batch_gt=2"}
    path = write(tmp, data)
    trials = tmp / "out" / "trials"
    cmd = [str(BIN / "rayft"), "tune", str(path)]
    log1 = open(tmp / "first.log", "w")
    p = subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=log1, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def a_trial_finished_and_one_ran_out_of_memory() -> bool:
            if {"finished", "oom"} <= set(_statuses(trials).values()):
                return True
            assert p.poll() is None, (tmp / "first.log").read_text()[-3000:]
            return False

        wait_until(a_trial_finished_and_one_ran_out_of_memory, 400, "a trial finished and one ran out of memory")
        before = _statuses(trials)
        # Kill only once the saved experiment state (every 2 s) has every trial that ended as ended:
        # finished as TERMINATED, out of memory as ERROR. The resume then must not start them again.
        ended = {
            t: {"finished": "TERMINATED", "oom": "ERROR"}[s] for t, s in before.items() if s in ("finished", "oom")
        }
        wait_until(
            lambda: all(_saved_states(tmp / "out" / "tune").get(t) == s for t, s in ended.items()),
            60,
            f"the saved experiment state records {ended}",
            every_s=0.2,
        )
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the driver and everything in its session: no goodbye
        p.wait()
    wait_group_gone(p.pid)  # the killed search's processes
    second = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=500)
    out = tmp / "out"
    return {
        "tmp": tmp,
        "out": out,
        "data": data,
        "before": before,
        "second": second,
        "results": json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None,
    }


def _rows(search, **match) -> list[dict]:
    return [r for r in search["results"]["trials"] if all(r[k] == v for k, v in match.items())]


@pytest.mark.ray
@pytest.mark.slow
def test_small_search_completes(search):
    second = search["second"]
    assert second.returncode == 0, second.stderr[-3000:]
    res = search["results"]
    assert res["interrupted"] is False and res["time_attr"] == "samples_seen"
    finished = _rows(search, status="finished")
    assert sorted(r["micro_batch_size"] for r in finished) == [1, 2]
    for r in finished:
        assert r["samples_seen"] == 32 and r["steps"] == 4 and r["eval_loss"] > 0 and r["tokens_seen"] > 0
    out = search["out"]
    for f in ("results.csv", "results.json", "results.txt", "search.png", "best.yaml"):
        assert (out / f).stat().st_size > 100, f
    assert "finished" in (out / "results.txt").read_text()
    # trials report at the same sample counts (samples, not steps: 16 then 32). A trial restarted by the
    # resume after it had finished re-reports only its final result, so look at all of them together.
    seen = {
        r["trial_id"]: [
            json.loads(x)["samples_seen"]
            for x in (out / "tune" / r["trial_id"] / "result.json").read_text().splitlines()
        ]
        for r in finished
    }
    assert all(set(v) <= {16, 32} and 32 in v for v in seen.values()), seen
    assert any(16 in v for v in seen.values()), seen


@pytest.mark.ray
@pytest.mark.slow
def test_infeasible_configurations_were_never_started(search):
    out = search["out"]
    infeasible = _rows(search, status="infeasible", trial_id=None)
    assert [r["micro_batch_size"] for r in infeasible] == [8]
    assert infeasible[0]["estimate_gib"] > BUDGET and "> budget" in infeasible[0]["reason"]
    # what Tune ran and what the trials wrote: micro 4, 2, 1 only
    params = [json.loads((d / "params.json").read_text()) for d in (out / "tune").iterdir() if d.is_dir()]
    assert sorted(p["point"]["micro_batch_size"] for p in params) == [1, 2, 4]
    ran = [json.loads((d / "trial.json").read_text()) for d in (out / "trials").iterdir()]
    assert sorted(t["point"]["micro_batch_size"] for t in ran) == [1, 2, 4]
    assert all(t["point"]["estimate_gib"] <= BUDGET for t in ran)


@pytest.mark.ray
@pytest.mark.slow
def test_out_of_memory_trial_is_infeasible_and_not_retried(search):
    rows = _rows(search, micro_batch_size=4)
    assert len(rows) == 1 and rows[0]["status"] == "infeasible", rows
    assert "out of memory" in rows[0]["reason"] and "injected" in rows[0]["reason"]
    tdir = Path(rows[0]["output_dir"])
    assert json.loads((tdir / "status.json").read_text())["status"] == "oom"
    # started once, across both runs of the search: Train max_failures=0, Tune max_failures=0,
    # and Tuner.restore(restart_errored=False) (a restart would add a line, even a refused one)
    assert [x.split(" ", 1)[1] for x in (tdir / "starts.log").read_text().splitlines()] == ["train"]
    assert rows[0]["trainings_started"] == 1
    assert not (tdir / "summary.json").exists()
    assert len(_rows(search, status="finished")) == 2  # the others finished


@pytest.mark.ray
@pytest.mark.slow
def test_interrupted_search_resumes_without_rerunning_finished_trials(search):
    assert "resuming the search" in search["second"].stderr
    before, out = search["before"], search["out"]
    finished_before = [t for t, s in before.items() if s == "finished"]
    assert finished_before
    rows = {r["trial_id"]: r for r in search["results"]["trials"] if r["trial_id"]}
    assert set(before) <= set(rows) and len(rows) == 3  # the same Tune trials, none sampled anew
    for t in finished_before:
        starts = (out / "trials" / t / "starts.log").read_text().splitlines()
        # trained once; Tuner.restore knew it had finished (had the saved state been older than the
        # finish, the trial function would have re-reported it: "already finished: not rerun")
        assert [x.split(" ", 1)[1] for x in starts] == ["train"], starts
        assert rows[t]["status"] == "finished"
    for t, s in before.items():  # a trial cut off mid-run was resumed and finished
        if s == "running":
            assert rows[t]["status"] in ("finished", "infeasible")


@pytest.mark.ray
@pytest.mark.slow
def test_best_yaml_is_a_job_spec_that_runs(search, tmp_path, capsys):
    best_path = search["out"] / "best.yaml"
    raw = yaml.safe_load(best_path.read_text())
    assert "search" not in raw and "RAYFT_FAULT" not in raw["run"]["env"]
    spec = load_spec(best_path)  # the job spec validator, files checked
    best = search["results"]["best"]
    assert best["status"] == "finished"
    assert best["eval_loss"] == min(r["eval_loss"] for r in _rows(search, status="finished"))
    assert (spec.batch.micro_batch_size, spec.grad_accum_steps) == (best["micro_batch_size"], best["grad_accum_steps"])
    assert spec.optim.lr == pytest.approx(best["base_lr"]) and spec.effective_lr == pytest.approx(best["effective_lr"])
    assert spec.run.max_steps == 4 and spec.memory.budget_gib == BUDGET
    # `rayft run` takes it unchanged (in this process, without Ray: 4 tiny steps)
    assert main(["run", str(best_path), "--local"]) == 0
    summary = json.loads((spec.output_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["micro_batch_size"] == best["micro_batch_size"]


@pytest.mark.ray
@pytest.mark.slow
def test_a_changed_spec_does_not_resume_the_old_search(search, capsys):
    before = (search["out"] / "results.json").read_text()
    rc = main(["tune", str(search["tmp"] / "search.yaml"), "search.lr.low=0.002"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "the search spec changed" in err and "--fresh" in err
    assert "search.lr.low: 0.001 -> 0.002" in err
    assert (search["out"] / "results.json").read_text() == before
