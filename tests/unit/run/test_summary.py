"""summary.json is typed (`jobs.run.summary.RunSummary`): what a run writes reads back field for
field, the objective's statistics ride beside the named fields, and a file that is not a rayft
summary is refused in one line naming what it lacks."""

from __future__ import annotations

import json

import pytest
from gradtools import ROOT, tiny_spec

from jobs.errors import RunError
from jobs.run.summary import RunSummary
from jobs.train.context import LocalContext
from jobs.train.loop import train


def test_a_run_writes_a_summary_that_reads_back_whole(tmp_path):
    pairs = ROOT / "examples" / "data"
    spec = tiny_spec(
        "run.max_steps=2",
        "objective.name=dpo",
        f"run.output_dir={tmp_path}",
        f"data.path={pairs / 'tiny-pairs.jsonl'}",
        f"data.eval_path={pairs / 'tiny-pairs-eval.jsonl'}",
    )
    returned = train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert returned == on_disk
    s = RunSummary.from_json(on_disk)
    assert s.as_json() == on_disk  # nothing lost, nothing added, the same order
    assert (s.steps, s.objective, s.resumed_from_step) == (2, "dpo", 0)
    assert 0.0 <= s.stat("eval_rewards/accuracies") <= 1.0  # a statistic of the objective, by its TRL name


def test_a_file_that_is_not_a_summary_is_refused_naming_what_it_lacks():
    with pytest.raises(RunError, match=r"x\.json: not a rayft run summary \(no name, steps"):
        RunSummary.from_json({"loss": 1.0}, "x.json")
