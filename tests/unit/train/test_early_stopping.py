"""Early stopping (`run.early_stopping`) on the eval loss at `run.eval_every`: the run stops after
`patience` evaluations without an improvement larger than `min_delta`, and ends with the best
step's adapter as `adapter/` (summary.json `best_step`), also across a crash and resume.

The eval losses are scripted (`SFT.held_out`, the objective's held-out evaluation, replaced), so which step is best is
known; the adapter of that step is the one an uninterrupted run of exactly that many steps ends
with (training does not depend on the evaluation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gradtools import ROOT
from runs import metric_lines
from safetensors.torch import load_file

from jobs.errors import SpecError
from jobs.objectives import SFT
from jobs.spec import absolutize, load_spec
from jobs.train import loop as jobs_loop
from jobs.train.context import LocalContext
from jobs.train.early_stopping import EarlyStopping

DEMO = "examples/tiny-lora.yaml"
SMALL = [
    "resources.num_workers=1",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "memory.gradient_checkpointing=false",
    "run.eval_every=1",
    "run.checkpoint_every=1",
    "run.keep_checkpoints=2",
    "optim.lr=0.05",
]


def _spec(out: Path, *extra: str):
    return absolutize(load_spec(DEMO, SMALL + [f"run.output_dir={out}", *extra]))


def _script(monkeypatch, losses: list, crash_at_call: int = 0):
    calls = []

    def fake(*args, **kwargs):
        calls.append(1)
        if crash_at_call and len(calls) == crash_at_call:
            raise RuntimeError("crash (test)")
        return losses.pop(0), {}

    monkeypatch.setattr(SFT, "held_out", fake)


def _adapter(out: Path) -> dict:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def after_2_steps(tmp_path_factory) -> dict:
    import os

    out = tmp_path_factory.mktemp("ref") / "run"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        spec = absolutize(
            load_spec(DEMO, [s for s in SMALL if "eval_every" not in s] + [f"run.output_dir={out}", "run.max_steps=2"])
        )
        jobs_loop.train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    finally:
        os.chdir(cwd)
    return _adapter(out)


def test_stops_after_patience_and_ends_with_the_best_adapter(tmp_path, monkeypatch, after_2_steps):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    _script(monkeypatch, [3.0, 2.0, 2.5, 2.4, 9.9, 9.9])
    summary = jobs_loop.train(
        _spec(out, "run.max_steps=6", "run.early_stopping.patience=2"), LocalContext(on_progress=lambda r: None)
    )
    assert [r["step"] for r in metric_lines(out)] == [1, 2, 3, 4]  # stopped at the 2nd bad evaluation
    assert summary["best_step"] == 2 and summary["stopped_early_at_step"] == 4
    assert summary["best_eval_loss"] == 2.0
    assert json.loads((out / "summary.json").read_text())["best_step"] == 2
    assert _same(_adapter(out), after_2_steps)


def test_min_delta_counts_small_improvements_as_none(tmp_path, monkeypatch, after_2_steps):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    _script(monkeypatch, [3.0, 2.0, 1.95, 1.92, 9.9, 9.9])
    summary = jobs_loop.train(
        _spec(out, "run.max_steps=6", "run.early_stopping.patience=2", "run.early_stopping.min_delta=0.1"),
        LocalContext(on_progress=lambda r: None),
    )
    assert summary["best_step"] == 2 and summary["stopped_early_at_step"] == 4
    assert _same(_adapter(out), after_2_steps)


def test_a_run_that_keeps_improving_runs_to_the_end(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    _script(monkeypatch, [3.0, 2.0, 1.0])
    summary = jobs_loop.train(
        _spec(out, "run.max_steps=3", "run.early_stopping.patience=1"), LocalContext(on_progress=lambda r: None)
    )
    assert summary["best_step"] == 3 and summary["stopped_early_at_step"] is None
    assert [r["step"] for r in metric_lines(out)] == [1, 2, 3]


def test_a_crash_after_the_best_step_resumes_and_still_ends_with_it(tmp_path, monkeypatch, after_2_steps):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    spec = _spec(out, "run.max_steps=8", "run.early_stopping.patience=2")
    _script(monkeypatch, [3.0, 2.0, 2.5], crash_at_call=4)  # dies in step 4's evaluation
    with pytest.raises(RuntimeError):
        jobs_loop.train(spec, LocalContext(on_progress=lambda r: None))
    _script(monkeypatch, [2.6, 9.9])  # the resumed run re-evaluates step 4: the 2nd bad evaluation
    summary = jobs_loop.train(spec, LocalContext(on_progress=lambda r: None))
    assert summary["resumed_from_step"] == 3
    assert summary["best_step"] == 2 and summary["stopped_early_at_step"] == 4
    assert _same(_adapter(out), after_2_steps)
    # a rerun of the stopped job trains nothing more and reports the same result
    _script(monkeypatch, [])
    again = jobs_loop.train(spec, LocalContext(on_progress=lambda r: None))
    assert again["best_step"] == 2 and [r["step"] for r in metric_lines(out)] == [1, 2, 3, 4]
    assert _same(_adapter(out), after_2_steps)


def test_early_stopping_needs_eval_every():
    with pytest.raises(SpecError, match="run.early_stopping needs run.eval_every"):
        load_spec(ROOT / DEMO, ["run.eval_every=0", "run.early_stopping.patience=2"])


# ---- GRPO: the held-out mean reward, higher is better ---------------------------------------------

GRPO_DEMO = "examples/tiny-grpo.yaml"
GRPO_SMALL = [
    "resources.num_workers=1",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "rollout.num_generations=4",
    "rollout.max_completion_length=6",
    f"data.eval_path={ROOT / 'examples/data/tiny-eval.jsonl'}",
    "run.checkpoint_every=1",
    "run.keep_checkpoints=2",
]


def _grpo_spec(out: Path, *extra: str):
    return absolutize(load_spec(ROOT / GRPO_DEMO, GRPO_SMALL + [f"run.output_dir={out}", *extra]))


def _script_rewards(monkeypatch, rewards: list) -> None:
    """GRPO's held-out evaluation replaced: no held-out loss, the scripted mean reward."""
    from jobs.objectives.grpo import GRPO

    monkeypatch.setattr(GRPO, "held_out", lambda *a, **k: (None, {"eval_reward": rewards.pop(0)}))


@pytest.fixture(scope="module")
def grpo_after_2_steps(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("grpo-ref") / "run"
    jobs_loop.train(_grpo_spec(out, "run.max_steps=2", "run.eval_every=0"), LocalContext(on_progress=lambda r: None))
    return _adapter(out)


def test_grpo_stops_on_the_held_out_reward_and_keeps_the_highest(tmp_path, monkeypatch, grpo_after_2_steps):
    out = tmp_path / "run"
    _script_rewards(monkeypatch, [0.1, 0.3, 0.2, 0.25, 0.9, 0.9])  # lower is worse: step 2 is the best
    spec = _grpo_spec(out, "run.max_steps=6", "run.eval_every=1", "run.early_stopping.patience=2")
    summary = jobs_loop.train(spec, LocalContext(on_progress=lambda r: None))
    assert [r["step"] for r in metric_lines(out)] == [1, 2, 3, 4]  # stopped at the 2nd bad evaluation
    assert summary["best_step"] == 2 and summary["stopped_early_at_step"] == 4
    assert summary["best_eval_reward"] == 0.3 and "best_eval_loss" not in summary
    assert _same(_adapter(out), grpo_after_2_steps)


def test_grpo_rising_reward_runs_to_the_end(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _script_rewards(monkeypatch, [0.1, 0.2, 0.3])  # judged as a loss, 0.2 and 0.3 would be two bad ones
    spec = _grpo_spec(out, "run.max_steps=3", "run.eval_every=1", "run.early_stopping.patience=2")
    summary = jobs_loop.train(spec, LocalContext(on_progress=lambda r: None))
    assert summary["best_step"] == 3 and summary["stopped_early_at_step"] is None


def test_a_metric_the_objective_does_not_report_is_refused():
    with pytest.raises(SpecError, match="run.early_stopping.metric=eval_loss: objective.name=grpo reports eval_reward"):
        load_spec(ROOT / GRPO_DEMO, ["run.eval_every=1", "run.early_stopping.metric=eval_loss"])
    with pytest.raises(SpecError, match="objective.name=sft reports eval_loss on held-out data"):
        load_spec(ROOT / DEMO, ["run.eval_every=1", "run.early_stopping.metric=eval_reward"])
    spec = load_spec(ROOT / GRPO_DEMO, ["run.eval_every=1", "run.early_stopping.patience=2"])
    stopper = EarlyStopping.of(spec, None)
    assert (stopper.metric, stopper.sign) == ("eval_reward", -1.0)
