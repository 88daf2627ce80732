"""`rayft data preview` of a GRPO spec (`jobs.data.preview_prompts`): prompt i of the preview is
prompt i of the run's prompt set (what `GRPOObjective.load_data` gives every rank), token for token,
with the columns the reward functions receive; the prompts the run drops as too long are counted as
dropped, per split; the command prints it (and --json gives it) in one call, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runs import write_jsonl

from jobs.model.loading import load_tokenizer
from jobs.objectives import Objective
from jobs.spec import load_spec
from orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[3]
DEMO = str(ROOT / "examples" / "tiny-grpo.yaml")


def _prompts(tmp_path: Path, name: str, lengths: list[int]) -> Path:
    """Prompts of `lengths` words each (the tiny tokenizer: about a token per character), each with
    an `answer` column naming its record."""
    rows = [{"prompt": " ".join(["ab"] * n), "answer": f"r{i}"} for i, n in enumerate(lengths)]
    return write_jsonl(tmp_path / name, rows)


def _spec(tmp_path: Path, *more: str):
    train = _prompts(tmp_path, "train.jsonl", [3, 40, 5, 2, 60, 4, 6, 7, 3, 2])
    held = _prompts(tmp_path, "held.jsonl", [2, 50, 3])
    overrides = [f"data.path={train}", f"data.eval_path={held}", "data.max_seq_len=96", *more]
    return load_spec(DEMO, [*overrides, f"run.output_dir={tmp_path / 'out'}"], files=False)


def test_the_previewed_prompts_are_the_runs_token_for_token(tmp_path):
    spec = _spec(tmp_path, "rollout.max_completion_length=16")
    tok = load_tokenizer(spec)
    objective = Objective.of(spec)
    doc = objective.preview(spec, tok, 50)
    data, _, _ = objective.load_data(spec, tok)
    assert doc["kind"] == "prompts" and doc["prompt_budget"] == 96 - 16
    assert [[t["id"] for t in s["tokens"]] for s in doc["samples"]] == data.train.ids
    assert [s["columns"] for s in doc["samples"]] == data.train.columns
    assert [s["prompt"] for s in doc["samples"]] == data.train.prompts
    assert all(not t["label"] for s in doc["samples"] for t in s["tokens"])  # the loss is on completions
    assert "".join(t["text"] for t in doc["samples"][0]["tokens"]) == tok.decode(data.train.ids[0])
    assert doc["samples"][1]["where"].endswith("train.jsonl line 3")  # line 2 is too long: dropped


def test_prompts_the_run_drops_as_too_long_are_counted_per_split(tmp_path):
    spec = _spec(tmp_path, "rollout.max_completion_length=48")  # 48 tokens left for a prompt
    tok = load_tokenizer(spec)
    doc = Objective.of(spec).preview(spec, tok, 3)
    data, _, _ = Objective.of(spec).load_data(spec, tok)
    train, held = doc["train"], doc["eval"]
    assert data.train.dropped > 0 and data.eval.dropped > 0  # the shape this test needs
    assert (train["records"], train["kept"]) == (10, len(data.train))
    assert train["dropped_by_reason"] == {"too_long": data.train.dropped} == {"too_long": train["dropped"]}
    assert (held["records"], held["kept"], held["dropped"]) == (3, len(data.eval), data.eval.dropped)
    assert train["seq_len"]["max"] == max(len(ids) for ids in data.train.ids) <= doc["prompt_budget"]
    assert train["tokens"] == sum(len(ids) for ids in data.train.ids)
    assert len(doc["samples"]) == 3


@pytest.mark.parametrize("as_json", [False, True])
def test_rayft_data_preview_shows_a_grpo_specs_prompts(tmp_path, capsys, as_json):
    spec = _spec(tmp_path, "rollout.max_completion_length=16")
    args = ["data", "preview", DEMO, f"data.path={spec.data.path[0]}", f"data.eval_path={spec.data.eval_path}"]
    args += ["data.max_seq_len=96", "rollout.max_completion_length=16", f"data.cache_dir={tmp_path / 'cache'}"]
    code = main([*args, "-n", "2", *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    assert code == 0, err
    if as_json:
        doc = json.loads(out)
        assert [s["columns"]["answer"] for s in doc["samples"]] == ["r0", "r2"]  # r1 is too long: dropped
    else:
        assert "train prompt 0" in out and "train prompt 1" in out and "train prompt 2" not in out
        assert 'reward columns: {"answer": "r2"}' in out and "kept (prompts)" in out
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()  # read-only
