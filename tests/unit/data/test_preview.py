"""`rayft data preview`: the samples it shows are the cache's samples, token for token and label for
label (the highlighted tokens are exactly the cache's label tokens), its statistics equal counts
taken from the cache's files and from the byte tokenizer's definition, `-n` is respected, nothing
is written, and bad input is one line, exit 2.

The cache is built here with `load_dataset` (as a worker builds it) for the same spec, after the
preview ran, into a directory that the preview left empty. tiny-llama's byte tokenizer: a byte
is its own id, <s> = 257, </s> = 258."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from inproc import ROOT, rayft_in_process
from runs import write_jsonl as write

from jobs.data import IGNORE, Example, Pair, load_dataset
from jobs.model.loading import byte_tokenizer
from jobs.spec import load_spec

DEMO = str(ROOT / "examples" / "tiny-lora.yaml")
CHAT = str(ROOT / "examples" / "tiny-chat.yaml")
L = 48  # data.max_seq_len of the generated sets: some records are cut, some dropped
SMALL = [
    "resources.num_workers=1",
    f"data.max_seq_len={L}",
    "batch.global_batch_size=2",
    "batch.micro_batch_size=1",
    "data.eval_path=null",
]
TEXT = [{"text": "word " * k} for k in (1, 3, 9, 20, 2)]  # 20 words: 102 tokens > L, cut
PC = [
    {"prompt": "2+2=", "completion": "4"},
    {"prompt": "x" * 60, "completion": "lost"},  # the prompt fills L: no label left, dropped
    {"prompt": "name: ", "completion": "y" * 60},  # cut, the completion's start kept
    {"prompt": "q ", "completion": "answer"},
]
PAIRS = [
    {"prompt": "Capital of Peru? ", "chosen": "Lima", "rejected": "Cusco"},
    {"prompt": "p" * 70, "chosen": "yes", "rejected": "no"},  # prompt cut from the left
    {"prompt": "same ", "chosen": "a", "rejected": "a"},  # identical responses: dropped
    {"prompt": "Capital of Chile? ", "chosen": "Santiago", "rejected": "Lima"},
]
CONVO = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"}],
        "chosen": [{"role": "assistant", "content": f"a{i}"}],
        "rejected": [{"role": "assistant", "content": f"no{i}"}],
    }
    for i in range(3)
]


@pytest.fixture
def where(tmp_path, monkeypatch):
    """The data cache and the model cache (RAYFT_CACHE) under tmp_path, both still absent."""
    monkeypatch.setenv("RAYFT_CACHE", str(tmp_path / "rayft-cache"))
    return ["data.cache_dir=" + str(tmp_path / "cache"), f"run.output_dir={tmp_path / 'out'}"]


def preview(*args: str) -> dict:
    p = rayft_in_process("data", "preview", *args, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def assert_nothing_written(tmp_path: Path) -> None:
    for name in ("cache", "rayft-cache", "out"):
        assert not (tmp_path / name).exists(), name


def cached(spec_path: str, overrides: list[str]):
    return load_dataset(load_spec(spec_path, overrides, files=False), byte_tokenizer())


def shown_sequence(sample: dict) -> tuple[list[int], list[bool]]:
    return [t["id"] for t in sample["tokens"]], [t["label"] for t in sample["tokens"]]


def assert_sample_is_the_cached_example(sample: dict, ex: Example) -> None:
    """The shown sequence is the example's inputs plus its last target when that is a label; a
    token is highlighted exactly where the cache holds a label for predicting it."""
    ids, labels = shown_sequence(sample)
    assert ids[: len(ex.input_ids)] == list(ex.input_ids)
    assert ids[len(ex.input_ids) :] == ([ex.targets[-1]] if ex.targets[-1] != IGNORE else [])
    assert not labels[0]
    assert [i for i, lab in zip(ids, labels, strict=True) if lab] == [t for t in ex.targets if t != IGNORE]
    assert labels[1:] == [t != IGNORE for t in ex.targets][: len(ids) - 1]
    assert sample["n_tokens"] == len(ex.input_ids) and sample["n_labels"] == ex.n_labels


def cache_split_counts(split, n_records: int, dropped: int, truncated: int) -> dict:
    """A split's statistics from the cache's flat arrays and offsets (not from the preview's code)."""
    seq = np.diff(np.asarray(split.offsets)) + 1
    targets = np.asarray(split.targets)
    return {
        "records": n_records,
        "kept": len(split),
        "dropped": dropped,
        "truncated": truncated,
        "tokens": int(np.asarray(split.offsets)[-1]),
        "label_tokens": int((targets != IGNORE).sum()),
        "seq_len": {"min": int(seq.min()), "mean": float(seq.mean()), "max": int(seq.max())},
    }


def assert_stats(stats: dict, want: dict, lengths: np.ndarray) -> None:
    for k, v in want.items():
        assert stats[k] == pytest.approx(v) if k == "seq_len" else stats[k] == v, k
    assert stats["label_fraction"] == pytest.approx(want["label_tokens"] / want["tokens"])
    bins = stats["histogram"]
    assert bins[0]["lo"] == 1 and bins[-1]["hi"] == L and len(bins) <= 10
    assert all(a["hi"] + 1 == b["lo"] for a, b in zip(bins, bins[1:], strict=False))
    assert [b["count"] for b in bins] == [int(((lengths >= b["lo"]) & (lengths <= b["hi"])).sum()) for b in bins]


# ---- SFT: text, prompt/completion, chat -----------------------------------------------------------


def test_text_records_show_every_token_trained_and_count_what_truncation_cut(tmp_path, where):
    ov = [*SMALL, f"data.path={write(tmp_path / 'text.jsonl', TEXT)}", *where]
    doc = preview(DEMO, *ov, "-n", "10")
    assert_nothing_written(tmp_path)
    data = cached(DEMO, ov)
    assert [s["example"] for s in doc["samples"]] == list(range(len(TEXT)))
    for sample, ex in zip(doc["samples"], data.train, strict=True):
        assert_sample_is_the_cached_example(sample, ex)
        assert all(t["label"] for t in sample["tokens"][1:])  # text: all of it is trained
    # Independently: BOS + the text's bytes + EOS, cut when longer than L.
    truncated = sum(len(r["text"].encode()) + 2 > L for r in TEXT)
    assert truncated == 1 and [s["truncated"] for s in doc["samples"]] == [len(r["text"]) + 2 > L for r in TEXT]
    want = cache_split_counts(data.train, len(TEXT), 0, truncated)
    assert_stats(doc["train"], want, np.diff(np.asarray(data.train.offsets)) + 1)
    assert doc["eval"]["records"] == 0 and doc["sources"][0]["train"] == doc["train"]


def test_prompt_completion_labels_the_completion_and_counts_dropped_records(tmp_path, where):
    ov = [*SMALL, f"data.path={write(tmp_path / 'pc.jsonl', PC)}", *where]
    doc = preview(DEMO, *ov, "-n", "10")
    assert_nothing_written(tmp_path)
    data = cached(DEMO, ov)
    assert len(doc["samples"]) == len(data.train) == 3 and data.dropped == 1
    assert [s["record"] for s in doc["samples"]] == [0, 2, 3]  # record 1 is dropped
    for sample, ex in zip(doc["samples"], data.train, strict=True):
        assert_sample_is_the_cached_example(sample, ex)
    # Independently: BOS + prompt bytes + completion bytes + EOS; cut when longer than L, dropped
    # when the prompt (with BOS) leaves no room for a completion token.
    lengths = [len(r["prompt"]) + len(r["completion"]) + 2 for r in PC]
    kept = [len(r["prompt"]) + 1 < L for r in PC]
    truncated = sum(n > L and k for n, k in zip(lengths, kept, strict=True))
    want = cache_split_counts(data.train, len(PC), data.dropped, truncated)
    assert_stats(doc["train"], want, np.diff(np.asarray(data.train.offsets)) + 1)
    assert doc["train"]["dropped_by_reason"] == {"no_label": 1} and truncated == 1


def test_chat_example_matches_the_cache_in_both_splits(tmp_path, where):
    ov = [*where, "batch.global_batch_size=2", "batch.micro_batch_size=1"]
    doc = preview(CHAT, *ov, "-n", "2")
    assert_nothing_written(tmp_path)
    data = cached(CHAT, ov)
    assert [s["example"] for s in doc["samples"]] == [0, 1]  # -n 2
    tok = byte_tokenizer()
    for sample, ex in zip(doc["samples"], data.train, strict=False):
        assert_sample_is_the_cached_example(sample, ex)
        # Each trained run is an assistant turn's content and its end-of-turn token.
        assert "".join(t["text"] for t in sample["tokens"]) == tok.decode(shown_sequence(sample)[0])
    records = [json.loads(line) for line in (ROOT / "examples/data/tiny-chat.jsonl").read_text().splitlines()]
    rendered = [len(tok.apply_chat_template(r["messages"], tokenize=True)["input_ids"]) for r in records]
    assert sum(n > 256 for n in rendered) == doc["train"]["truncated"] + doc["eval"]["truncated"] == 0
    for name, split in (("train", data.train), ("eval", data.eval)):
        want = cache_split_counts(split, len(split), 0, 0)
        assert_stats_sft = {k: v for k, v in want.items() if k != "seq_len"}
        assert {k: doc[name][k] for k in assert_stats_sft} == assert_stats_sft
    assert doc["train"]["records"] + doc["eval"]["records"] == len(records) == 64


def test_text_output_highlights_exactly_the_label_tokens(tmp_path, where):
    """Without colours (a pipe), trained runs are bracketed: each bracketed run is the decoded
    label tokens of the cache's example; with --tokens every boundary shows."""
    ov = [*SMALL, f"data.path={write(tmp_path / 'pc.jsonl', PC)}", *where]
    p = rayft_in_process("data", "preview", DEMO, *ov, "-n", "2", env={**os.environ, "COLUMNS": "300"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("train sample ") == 2  # -n 2 panels
    data = cached(DEMO, ov)
    tok = byte_tokenizer()
    runs = re.findall("⟦(.*?)⟧", p.stdout.split("statistics")[0])
    want = [tok.decode([t for t in ex.targets if t != IGNORE]) for ex in data.train[:2]]
    assert runs[1:] == want  # runs[0] is the legend's
    bounded = rayft_in_process(
        "data", "preview", DEMO, *ov, "-n", "1", "--tokens", env={**os.environ, "COLUMNS": "300"}
    )
    lines = bounded.stdout.splitlines()
    line = lines[next(i for i, x in enumerate(lines) if "train sample 0" in x) + 1].strip("│ ")
    ids = list(data.train[0].input_ids) + [data.train[0].targets[-1]]
    assert line.replace("⟦", "").replace("⟧", "").split("|") == [tok.decode([i]) for i in ids]


def test_svg_saved_and_nothing_else_written(tmp_path, where):
    svg = tmp_path / "preview.svg"
    p = rayft_in_process("data", "preview", CHAT, *where, "-n", "1", "--svg", str(svg))
    assert p.returncode == 0, p.stderr
    assert svg.read_text().lstrip().startswith("<svg") and "Tehran" in svg.read_text()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["preview.svg"]


# ---- preference pairs -------------------------------------------------------------------------------


def assert_pair_is_the_cached_pair(sample: dict, pair: Pair) -> None:
    for f in ("prompt", "chosen", "rejected"):
        assert [t["id"] for t in sample[f]["tokens"]] == list(getattr(pair, f)), f
        assert all(t["label"] == (f != "prompt") for t in sample[f]["tokens"]), f
    assert sample["n_labels"] == len(pair.chosen) + len(pair.rejected)


@pytest.mark.parametrize("rows", [PAIRS, CONVO], ids=["standard", "conversational"])
def test_pairs_show_prompt_and_responses_as_the_cache_holds_them(tmp_path, where, rows):
    ov = [*SMALL, "objective.name=dpo", f"data.path={write(tmp_path / 'pairs.jsonl', rows)}", *where]
    doc = preview(DEMO, *ov, "-n", "10")
    assert_nothing_written(tmp_path)
    data = cached(DEMO, ov)
    assert doc["kind"] == "pairs" and len(doc["samples"]) == len(data.train)
    for sample, pair in zip(doc["samples"], data.train, strict=True):
        assert_pair_is_the_cached_pair(sample, pair)
    # From the cache's per-field offsets: each pair runs as two rows, P + C and P + R, shifted.
    n = {f: np.diff(np.asarray(data.train.offsets[f])) for f in ("prompt", "chosen", "rejected")}
    st = doc["train"]
    assert st["tokens"] == int((2 * n["prompt"] + n["chosen"] + n["rejected"] - 2).sum())
    assert st["label_tokens"] == int((n["chosen"] + n["rejected"]).sum())
    assert st["field_tokens"] == {f: int(v.sum()) for f, v in n.items()}
    assert st["records"] == len(rows) and st["kept"] == len(data.train)
    assert st["dropped_by_reason"] == {"empty": data.dropped_empty, "identical": data.dropped_identical}
    lengths = n["prompt"] + np.maximum(n["chosen"], n["rejected"])
    assert st["seq_len"]["max"] == int(lengths.max())
    assert [b["count"] for b in st["histogram"]] == [
        int(((lengths >= b["lo"]) & (lengths <= b["hi"])).sum()) for b in st["histogram"]
    ]
    if rows is PAIRS:  # independently: BOS + prompt bytes, each response's bytes + EOS
        want_cut = [len(r["prompt"]) + 1 + max(len(r["chosen"]), len(r["rejected"])) + 1 > L for r in rows]
        assert st["truncated"] == sum(want_cut) == 1 and data.dropped_identical == 1


def test_pairs_text_output_names_the_three_parts(tmp_path, where):
    ov = [*SMALL, "objective.name=dpo", f"data.path={write(tmp_path / 'pairs.jsonl', PAIRS)}", *where]
    p = rayft_in_process("data", "preview", DEMO, *ov, "-n", "1", env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    body = p.stdout.split("statistics")[0]
    assert [w for w in ("prompt", "chosen", "rejected") if w in body] == ["prompt", "chosen", "rejected"]
    assert re.findall("⟦(.*?)⟧", body)[1:] == ["Lima</s>", "Cusco</s>"]
    assert "prompt / chosen / rejected tokens" in p.stdout


def test_several_files_are_one_source_and_n_counts_over_them(tmp_path, where):
    a, b = write(tmp_path / "a.jsonl", TEXT[:2]), write(tmp_path / "b.jsonl", TEXT[2:])
    doc = preview(DEMO, *SMALL, f"data.path={json.dumps([str(a), str(b)])}", *where, "-n", "3")
    assert [s["name"] for s in doc["sources"]] == ["data.path"] and doc["sources"][0]["paths"] == [str(a), str(b)]
    assert len(doc["samples"]) == 3 and doc["train"]["records"] == len(TEXT)


# ---- refusals ---------------------------------------------------------------------------------------


def refused(*args: str) -> str:
    p = rayft_in_process("data", "preview", *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, p.stderr
    return p.stderr


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, where):
    assert "spec file not found" in refused(str(tmp_path / "nope.yaml"))
    for bad in ("0", "-2", "x", "1.5"):
        assert "-n" in refused(DEMO, *where, "-n", bad)
    assert "batch.global_batch_size" in refused(DEMO, *where, "batch.global_batch_size=0")
    assert "data.path" in refused(DEMO, *where, f"data.path={tmp_path / 'missing.jsonl'}")
    rows = write(tmp_path / "bad.jsonl", TEXT[:2])
    rows.write_text(rows.read_text() + "{not json\n")
    assert "line 3: not valid JSON" in refused(DEMO, *SMALL, f"data.path={rows}", *where)
    assert "objective.name=dpo" in refused(DEMO, *SMALL, "objective.name=dpo", f"data.path={rows}", *where)
    assert "--svg" in refused(DEMO, *where, "--json", "--svg", str(tmp_path / "no-dir" / "p.svg"))
    assert_nothing_written(tmp_path)


def test_preview_needs_no_ray(tmp_path):
    """In a fresh process, the preview imports no Ray module."""
    code = (
        "import sys; from orchestrator.cli import main; "
        f"rc = main(['data', 'preview', {CHAT!r}, 'run.output_dir={tmp_path / 'out'}', '--json']); "
        "assert rc == 0; assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray imported'"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["samples"] and not (tmp_path / "out").exists()
