"""The per-step record (`jobs.run.step_record.StepRecord`): metrics.jsonl's line is its named fields
in order, then the objective's statistics; what the progress line is shown is what the file holds;
a line read back is checked, and a foreign or cut line is one RunError naming the file and line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from runs import SMALL_RUN, objective_overrides

from jobs.errors import RunError
from jobs.run.outputs import format_step, read_metrics
from jobs.run.step_record import LINE_FIELDS, StepRecord
from jobs.spec import absolutize, load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train

ROOT = Path(__file__).resolve().parents[3]
PAIRS = ROOT / "examples" / "data" / "tiny-pairs.jsonl"


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory) -> tuple[Path, list[StepRecord]]:
    """A 2-step DPO run (an objective with statistics of its own) and the records its progress saw."""
    out = tmp_path_factory.mktemp("step-record") / "run"
    cwd = os.getcwd()
    os.chdir(ROOT)
    shown: list[StepRecord] = []
    try:
        overrides = [
            *SMALL_RUN,
            *objective_overrides("dpo"),
            f"data.path={PAIRS}",
            "data.eval_path=null",
            "run.max_steps=2",
        ]
        spec = absolutize(load_spec("examples/tiny-lora.yaml", [*overrides, f"run.output_dir={out}"]))
        train(spec, LocalContext(on_progress=shown.append), resume=False)
    finally:
        os.chdir(cwd)
    return out, shown


def test_a_runs_records_read_back_whole_and_in_the_files_order(dpo_run):
    out, _ = dpo_run
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    records = read_metrics(out)
    assert [r.line() for r in records] == lines
    assert [list(r.line()) for r in records] == [list(x) for x in lines]  # the key order too
    assert list(lines[0])[: len(LINE_FIELDS)] == list(LINE_FIELDS)
    assert records[-1].value("rewards/margins") == lines[-1]["rewards/margins"]  # TRL's names, from `extra`
    assert records[-1].value("no-such-key") is None


def test_the_progress_line_shows_what_the_file_holds(dpo_run):
    out, shown = dpo_run
    assert [s.total_steps for s in shown] == [2, 2]
    assert [s.line() for s in shown] == [r.line() for r in read_metrics(out)]
    line = format_step(shown[-1])
    assert line.startswith("step 2/2 loss ") and "rewards/accuracies" in line


def _line(**changes) -> dict:
    base = {k: {"int": 1, "float": 1.0, "float?": None, "str": "rss", "bool": False}[t] for k, t in LINE_FIELDS.items()}
    return {**base, **changes}


@pytest.mark.parametrize(
    "changes,said",
    [
        ({"step": "1"}, 'step is "1"'),
        ({"step": True}, "step is true"),
        ({"loss": "low"}, 'loss is "low"'),
        ({"skipped": 0}, "skipped is 0"),
    ],
)
def test_a_line_of_the_wrong_shape_is_one_line_naming_the_field(tmp_path, changes, said):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_line()) + "\n" + json.dumps(_line(**changes)) + "\n")
    with pytest.raises(RunError) as e:
        read_metrics(tmp_path)
    assert f"metrics.jsonl:2: not a rayft step record ({said})" in str(e.value) and "\n" not in str(e.value)


def test_a_missing_field_a_foreign_line_and_a_cut_line_are_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    missing = _line()
    del missing["loss"]
    for text, said in [
        (json.dumps(missing), "metrics.jsonl:1: not a rayft step record (loss is missing)"),
        ('["a list"]', "metrics.jsonl:1: not a step record"),
        (json.dumps(_line())[:30], "metrics.jsonl:1: not a JSON line"),
    ]:
        path.write_text(text + "\n")
        with pytest.raises(RunError, match=None) as e:
            read_metrics(tmp_path)
        assert said in str(e.value), str(e.value)


def test_a_line_before_evaluated_existed_and_a_non_finite_value_read_back():
    """`evaluated` came later (such a line never said a step evaluated); a value that was not finite
    was written as null (JSON has no NaN) and reads back as NaN."""
    old = _line(loss=None)
    del old["evaluated"]
    r = StepRecord.from_line(old, "m:1")
    assert r.evaluated is False and math.isnan(r.loss) and r.eval_loss is None
