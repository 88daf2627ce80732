"""What a new user runs first, on a machine with nothing in HOME: the search example
`rayft tune examples/tune-accum.yaml`. (`make demo` is run through the CLI by test_train, the
README's `ray job submit` by test_submit, `make demo-real` by test_cache; .ci/run gives every
test an empty HOME.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EXAMPLE = "examples/tune-accum.yaml"


def test_tune_example_plans_what_its_comment_promises():
    """The example's header: micro-batch 2 fits the budget at every accumulation (launched),
    micro-batch 8 does not fit with or without checkpointing (never launched)."""
    from tune.plan import plan_search
    from tune.spec import load_search_spec

    plan = plan_search(load_search_spec(str(ROOT / EXAMPLE), []), EXAMPLE)
    launched = {(p.micro_batch_size, p.grad_accum_steps) for p in plan.points if p.status == "planned"}
    assert launched == {(2, 1), (2, 2), (2, 4), (2, 8)}
    micro8 = [p for p in plan.points if p.micro_batch_size == 8]
    assert len(micro8) == 12 and all(p.status != "planned" for p in micro8)
    assert any(p.status == "infeasible" and p.estimate_gib > plan.budget_gib for p in micro8)


@pytest.mark.slow
@pytest.mark.ray
def test_tune_example_runs_on_an_empty_home(tmp_path):
    """The README's `rayft tune examples/tune-accum.yaml`, shrunk to one short trial, with an
    empty HOME (no ~/.ray, no caches): the embedded Ray starts, the trial finishes, best.yaml
    is a job spec."""
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    for var in ("RAY_ADDRESS", "RAYFT_CACHE"):
        env.pop(var, None)
    cmd = [
        str(BIN / "rayft"),
        "tune",
        EXAMPLE,
        "search.micro_batch_size=[2]",
        "search.grad_accum_steps=[1]",
        "search.lr_scaling=[none]",
        "search.samples_per_trial=16",
        "search.eval_every_samples=8",
        f"run.output_dir={out}",
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    trials = json.loads((out / "results.json").read_text())["trials"]
    assert [(t["status"], t["samples_seen"]) for t in trials] == [("finished", 16)]
    assert trials[0]["eval_loss"] > 0
    best = load_spec(out / "best.yaml")
    assert (best.batch.micro_batch_size, best.batch.grad_accum_steps) == (2, 1)
