"""Tokenize once, memory-map everywhere: the tokenized cache gives the same examples and batches
as tokenizing in memory, is built by one process, reused by later loads, keyed by content; a
checkpoint refuses to resume on data that changed under the same path."""

from __future__ import annotations

import contextlib
import io
import json
import threading
from pathlib import Path

import numpy as np
import pytest

import jobs.data.cache as data_mod  # where load_dataset and count_checked_records look up their helpers
from jobs.data import GlobalBatches, collate, load_dataset, read_jsonl, tokenize
from jobs.errors import SpecError
from jobs.finetune import main as finetune_main
from jobs.model.loading import byte_tokenizer
from jobs.run import checkpoint as ckpt
from jobs.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "examples" / "data" / "tiny.jsonl"
DEMO = str(ROOT / "examples" / "tiny-lora.yaml")
SMALL = [
    "resources.num_workers=1",
    "data.max_seq_len=64",
    "lora.r=4",
    "lora.alpha=8",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.eval_every=0",
    "data.eval_path=null",
]


def spec_for(path: Path, out: Path, *extra: str):
    return load_spec(DEMO, [*SMALL, f"data.path={path}", f"run.output_dir={out}", *extra], files=False)


def test_same_data_gives_the_same_examples_and_batches_as_tokenizing_in_memory(tmp_path):
    tok = byte_tokenizer()
    spec = spec_for(DATA, tmp_path / "out", "data.eval_fraction=0.1")
    data = load_dataset(spec, tok)
    assert isinstance(data.train.ids, np.memmap) and data.cache_dir.parent == tmp_path / ".rayft-data"
    # The in-memory path: read every record, hold the same split out, tokenize into tuples.
    records, held = data_mod.read_records(spec, tok)
    train, evals = tokenize(records, tok, 64), tokenize(held, tok, 64)
    assert [(e.input_ids, e.targets) for e in data.train] == [(e.input_ids, e.targets) for e in train]
    assert [(e.input_ids, e.targets) for e in data.eval] == [(e.input_ids, e.targets) for e in evals]
    a, b = GlobalBatches(len(data.train), 8, spec.run.seed), GlobalBatches(len(train), 8, spec.run.seed)
    for step in (0, 1, 7):
        assert a.indices(step) == b.indices(step)
        mine = collate([data.train[i] for i in a.indices(step)], tok.pad_token_id)
        ref = collate([train[i] for i in b.indices(step)], tok.pad_token_id)
        assert all(mine[k].equal(ref[k]) for k in ref)


def test_a_second_load_tokenizes_nothing(tmp_path, monkeypatch):
    tok = byte_tokenizer()
    spec = spec_for(DATA, tmp_path / "out")
    first = load_dataset(spec, tok)

    def fail(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_mod, "tokenize_iter", fail)
    monkeypatch.setattr(data_mod, "read_records", fail)
    # A later run next to the first (another output dir, same parent) maps the same entry.
    again = load_dataset(spec_for(DATA, tmp_path / "out-2"), tok)
    assert again.cache_dir == first.cache_dir and list(again.train) == list(first.train)


def test_concurrent_loads_build_once(tmp_path, monkeypatch):
    tok = byte_tokenizer()
    spec = spec_for(DATA, tmp_path / "out")
    calls, real = [], data_mod.read_records

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(data_mod, "read_records", counted)
    results = []
    threads = [threading.Thread(target=lambda: results.append(load_dataset(spec, tok))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(calls) == 1
    assert len({r.cache_dir for r in results}) == 1
    assert sorted(p.name for p in (tmp_path / ".rayft-data").iterdir()) == sorted(
        [results[0].cache_dir.name, results[0].cache_dir.name + ".lock"]
    )  # no temporary copy left


def test_changed_content_under_the_same_path_is_a_new_entry(tmp_path):
    tok = byte_tokenizer()
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(10)))
    spec = spec_for(p, tmp_path / "out")
    before = load_dataset(spec, tok)
    p.write_text("".join(json.dumps({"text": f"other {i}"}) + "\n" for i in range(10)))
    after = load_dataset(spec, tok)
    assert after.cache_dir != before.cache_dir and after.content_hash != before.content_hash
    assert [e.input_ids for e in after.train] == [e.input_ids for e in tokenize(read_jsonl(str(p)), tok, 64)]
    # Settings that change the tokens change the key too.
    assert load_dataset(spec_for(p, tmp_path / "out", "data.max_seq_len=32"), tok).cache_dir != after.cache_dir


def test_resume_refuses_data_that_changed_under_the_same_path(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text((ROOT / "examples" / "data" / "tiny.jsonl").read_text())
    spec = spec_for(p, tmp_path / "out")
    saved = ckpt.resume_key(spec)
    ckpt.check_resumable(saved, spec, "ckpt")  # unchanged: fine
    p.write_text(p.read_text().replace("ray", "Ray"))
    with pytest.raises(SpecError) as e:
        ckpt.check_resumable(saved, spec, "ckpt")
    assert "the data changed" in str(e.value) and "--fresh" in str(e.value) and "\n" not in str(e.value)


def _cli(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = finetune_main([*args, "--local"])
    return rc, err.getvalue()


def test_a_rerun_on_changed_data_is_refused_before_anything_runs(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text((ROOT / "examples" / "data" / "tiny.jsonl").read_text())
    out = tmp_path / "out"
    args = [DEMO, f"data.path={p}", f"run.output_dir={out}", *SMALL, "run.max_steps=1", "run.checkpoint_every=1"]
    rc, err = _cli(args)
    assert rc == 0, err
    metrics = (out / "metrics.jsonl").read_text()
    p.write_text(p.read_text().replace("ray", "Ray"))  # same size, same path, other content
    rc, err = _cli([*args, "run.max_steps=2"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "the data changed" in lines[0] and "--fresh" in lines[0], err
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing ran
    rc, err = _cli([*args, "run.max_steps=2", "--fresh"])
    assert rc == 0, err


def test_the_driver_checks_the_same_data_once(tmp_path, monkeypatch):
    """`count_checked_records` (the driver's pass over every record) remembers a success by
    content: a second start on the same data reads nothing; changed data is read and checked again."""
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(10)))
    spec = spec_for(p, tmp_path / "out")
    assert data_mod.count_checked_records(spec) == 10
    assert not (tmp_path / ".rayft-data").exists()  # no cache root yet (a first run): nothing written
    load_dataset(spec, byte_tokenizer())  # what a worker does: the cache root now exists
    assert data_mod.count_checked_records(spec) == 10
    real = data_mod.read_jsonl
    monkeypatch.setattr(data_mod, "read_jsonl", lambda *a, **k: pytest.fail("read again"))
    assert data_mod.count_checked_records(spec) == 10
    monkeypatch.setattr(data_mod, "read_jsonl", real)
    p.write_text(p.read_text() + '{"oops": 1}\n')
    with pytest.raises(SpecError, match="line 11"):
        data_mod.count_checked_records(spec)


def _parsed_lines(monkeypatch) -> list[str]:
    """Where each JSONL line the process parses from now on lies ("KEY: FILE line N"), in order."""
    import jobs.data.sources as sources

    seen: list[str] = []
    real = sources._json_value

    def parse(line: str, where: str):
        seen.append(where.split(": ", 1)[1])  # the file and line, whichever key names it
        return real(line, where)

    monkeypatch.setattr(sources, "_json_value", parse)
    return seen


def _entry_bytes(cache: Path) -> dict[str, bytes]:
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "objective",
    [
        pytest.param([], id="sft"),
        pytest.param(
            ["objective.name=grpo", "reward.functions=[{name: regex, pattern: a}]", "rollout.num_generations=4"]
            + ["rollout.max_completion_length=16"],
            id="grpo",
        ),
    ],
)
def test_a_run_start_parses_each_data_line_once_on_the_driver(tmp_path, monkeypatch, objective):
    """`rayft run`'s driver (`jobs.finetune.prepare`) checks every record before anything is created,
    then builds the cache entry from them: every line of the training and held-out files is parsed
    once between the two (`jobs.data.sources.read_once`), nothing is kept after the build, and the
    entry is byte for byte the one two separate reads build. Without `read_once` each line is parsed
    twice (checked below: the count would catch a second read)."""
    from runs import write_jsonl

    import jobs.data.sources as sources
    from jobs.finetune import build_data, preflight, prepare
    from jobs.run import run_hold
    from jobs.spec import absolutize

    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    train, held = write_jsonl(tmp_path / "train.jsonl", rows[:40]), write_jsonl(tmp_path / "held.jsonl", rows[40:48])
    where = [f"data.path={train}", f"data.eval_path={held}", "run.eval_every=2", *objective]
    seen = _parsed_lines(monkeypatch)
    spec = prepare(DEMO, [*SMALL, *where, f"run.output_dir={tmp_path / 'out'}"], fresh=False, local=True)
    run_hold.let_go(spec)
    trained, evaluated = [f"{train} line {i}" for i in range(1, 41)], [f"{held} line {i}" for i in range(1, 9)]
    assert sorted(seen) == sorted(trained + evaluated) and sources._kept is None

    # The same start without read_once: two reads of every line, and the same entry.
    seen.clear()
    other = absolutize(load_spec(DEMO, [*SMALL, *where, f"data.cache_dir={tmp_path / 'cache-2'}"]))
    preflight(other)
    build_data(other)
    # (GRPO's count pass checks the training prompts only: its held-out prompts are read by the build)
    assert sorted(seen) == sorted(trained * 2 + evaluated * (1 if objective else 2))
    if not objective:  # GRPO's prompts are tokenized on each rank; it keeps no entry
        assert _entry_bytes(tmp_path / ".rayft-data") == _entry_bytes(tmp_path / "cache-2")
