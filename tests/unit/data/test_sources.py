"""Data sources through `datasets`: JSON, Parquet, CSV, a `save_to_disk` directory and a hub id
read the same records as JSONL; `data.fields` renames columns; bad data is one line, exit 2,
nothing created."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from runs import write_jsonl

from jobs.data import load_dataset, read_jsonl
from jobs.errors import SpecError
from jobs.finetune import main as finetune_main
from jobs.model.loading import byte_tokenizer
from jobs.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]
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
    "run.max_steps=1",
]
# Answers are digits: a CSV reader that guessed types would turn them into numbers.
QA = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i), "id": i} for i in range(12)]
OURS = [{"prompt": r["question"], "completion": r["answer"]} for r in QA]
FIELDS = {"prompt": "question", "completion": "answer"}


def write_all(tmp_path: Path, rows: list[dict]) -> dict[str, Path]:
    import datasets

    ds = datasets.Dataset.from_list(rows)
    paths = {
        "jsonl": tmp_path / "d.jsonl",
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
        "csv": tmp_path / "d.csv",
        "disk": tmp_path / "saved",
    }
    write_jsonl(paths["jsonl"], rows)
    paths["json"].write_text(json.dumps(rows))  # one JSON array, not lines
    ds.to_parquet(str(paths["parquet"]))
    ds.to_csv(str(paths["csv"]), index=False)
    ds.save_to_disk(str(paths["disk"]))
    return paths


def test_every_source_form_reads_the_same_records(tmp_path):
    for kind, path in write_all(tmp_path, QA).items():
        got = [{k: v for k, v in r.items() if k != "id"} for r in read_jsonl(str(path), fields=FIELDS)]
        assert got == OURS, kind


def test_chat_records_from_parquet_with_a_renamed_column(tmp_path):
    convo = [
        {"conversations": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    paths = write_all(tmp_path, convo)
    for kind in ("jsonl", "parquet", "disk"):
        got = read_jsonl(str(paths[kind]), fields={"messages": "conversations"})
        assert got == [{"messages": c["conversations"]} for c in convo], kind


def test_a_parquet_source_trains_on_the_same_examples_as_jsonl(tmp_path):
    paths = write_all(tmp_path, QA)
    runs = {}
    for kind in ("jsonl", "parquet"):
        spec = load_spec(
            DEMO,
            [
                *SMALL,
                f"data.path={paths[kind]}",
                f"run.output_dir={tmp_path / kind / 'out'}",
                "data.fields.prompt=question",
                "data.fields.completion=answer",
            ],
            files=False,
        )
        data = load_dataset(spec, byte_tokenizer())
        runs[kind] = [(e.input_ids, e.targets) for e in data.train]
    assert runs["jsonl"] == runs["parquet"] and len(runs["jsonl"]) == len(QA)


def test_a_hub_id_is_loaded_through_datasets_with_the_named_token(monkeypatch):
    """The hub cannot be reached here: `datasets.load_dataset` is replaced by a recorder; what
    rayft passes it (name, split, the token read from the variable `data.hf_token_env` names) is real."""
    import datasets

    calls = []

    def fake(name, split=None, token=None, **kw):
        calls.append((name, split, token))
        return datasets.Dataset.from_list(QA)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setenv("MY_HUB_VAR", "hf_secretvalue")
    assert (
        read_jsonl("hf:org/qa:validation", fields=FIELDS, hf_token_env="MY_HUB_VAR")[0]["prompt"] == QA[0]["question"]
    )
    read_jsonl("hf:org/qa", fields=FIELDS)
    assert calls == [("org/qa", "validation", "hf_secretvalue"), ("org/qa", "train", None)]


def _cli(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = finetune_main([*args, "--local"])
    return rc, err.getvalue()


def _bad_sources(tmp_path: Path) -> dict[str, tuple[Path, list[str], str]]:
    import datasets

    not_a_dataset = tmp_path / "plain-dir"
    not_a_dataset.mkdir()
    (not_a_dataset / "notes.txt").write_text("hello")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet at all" * 10)
    unmapped = tmp_path / "unmapped.parquet"
    datasets.Dataset.from_list(QA).to_parquet(str(unmapped))
    chat = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": "q"}, {"role": "narrator", "content": "a"}]}]
    ).to_parquet(str(chat))
    return {
        "not-a-dataset": (not_a_dataset, [], "is a directory that is not a dataset"),
        "unreadable-parquet": (garbage, [], "garbage.parquet: cannot be read as a dataset"),
        "missing-field": (
            unmapped,
            ["data.fields.prompt=question", "data.fields.completion=reply"],
            "no field 'reply' (data.fields.completion names it)",
        ),
        "unmapped": (unmapped, [], 'row 0: expected {"text": ...}'),
        "unknown-role": (chat, [], "unknown role 'narrator'"),
    }


def test_bad_sources_are_one_line_exit_2_and_create_nothing(tmp_path):
    for name, (path, extra, needle) in _bad_sources(tmp_path).items():
        out = tmp_path / "runs" / name / "out"
        rc, err = _cli([DEMO, f"data.path={path}", f"run.output_dir={out}", *SMALL, *extra])
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (name, err)
        assert needle in lines[0] and "data.path" in lines[0], (name, lines[0])
        assert not (tmp_path / "runs").exists(), name  # no output dir, no data cache


def test_bad_data_found_by_the_tokenizing_worker_leaves_no_cache(tmp_path):
    """A chat template error surfaces in load_dataset (the worker): no cache entry, no lock stays."""
    p = tmp_path / "c.jsonl"
    p.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n"
            for _ in range(8)
        )
    )
    spec = load_spec(DEMO, [*SMALL, f"data.path={p}", f"run.output_dir={tmp_path / 'runs' / 'out'}"], files=False)
    (tmp_path / "runs" / "out").mkdir(parents=True)  # the driver claimed the output dir before the workers start
    tok = byte_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(SpecError, match="chat template .* refused a conversation"):
        load_dataset(spec, tok)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["out"]  # no cache entry, lock or temporary copy
