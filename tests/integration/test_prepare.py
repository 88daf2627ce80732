"""`rayft data prepare`: the entry it builds on Ray (tokenization in Ray Data tasks, blocks of a few
records so every build spans many tasks) is byte-identical, file for file (meta.json and the .npy
count arrays included), to the job's own single-process build, at the same path, on JSONL,
Parquet and chat data and on preference pairs (standard and conversational); a run afterwards
tokenizes nothing; an existing entry is left alone; bad input is one line, exit 2, nothing created.

One in-process local Ray (2 CPUs) for the module; the single-process build is `load_dataset`, as a
job's worker calls it. tiny-llama's byte tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from inproc import ROOT, rayft_in_process
from runs import write_jsonl

import jobs.data.cache as data_mod
import jobs.data.prepare as prepare_mod
from jobs.data import load_dataset
from jobs.model.loading import load_tokenizer
from jobs.spec import load_spec

DEMO = str(ROOT / "examples" / "tiny-lora.yaml")
CHAT = str(ROOT / "examples" / "tiny-chat.yaml")
L = 48  # some records are cut, some dropped (SFT: no label left; pairs: identical responses)
TEXT = [{"text": "word " * (1 + i % 23)} for i in range(40)]
PC = [{"prompt": ("x" * 60 if i % 7 == 0 else f"q{i} "), "completion": f"answer {i} " * (1 + i % 5)} for i in range(40)]
PAIRS = [
    {"prompt": f"Capital {i}? " * (1 + i % 9), "chosen": f"yes {i}", "rejected": "yes" if i % 6 else f"yes {i}"}
    for i in range(40)
]
CONVO = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"}],
        "chosen": [{"role": "assistant", "content": f"a{i} " * (1 + i % 11)}],
        "rejected": [{"role": "assistant", "content": f"no{i}"}],
    }
    for i in range(30)
]
COMMON = [
    f"data.max_seq_len={L}",
    "data.eval_path=null",
    "data.eval_fraction=0.2",
    "resources.num_workers=1",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(prepare_mod, "BLOCK_RECORDS", 7)  # many blocks, one that spans train and eval


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def entry_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def cases(tmp_path: Path) -> dict[str, tuple[str, list[str]]]:
    chat = ROOT / "examples" / "data" / "tiny-chat.jsonl"
    return {
        "jsonl text": (DEMO, [f"data.path={write_jsonl(tmp_path / 't.jsonl', TEXT)}"]),
        "parquet prompt/completion": (DEMO, [f"data.path={write_parquet(tmp_path / 'pc.parquet', PC)}"]),
        "jsonl chat": (CHAT, [f"data.path={chat}", "data.max_seq_len=96"]),
        "jsonl pairs": (DEMO, ["objective.name=dpo", f"data.path={write_jsonl(tmp_path / 'p.jsonl', PAIRS)}"]),
        "parquet conversational pairs": (
            DEMO,
            ["objective.name=dpo", f"data.path={write_parquet(tmp_path / 'c.parquet', CONVO)}"],
        ),
    }


def test_bad_input_is_one_line_exit_2_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "connect", lambda *a: pytest.fail("reached Ray on bad input"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"txet": "a typo"}])
    where = [f"data.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path / 'out'}"]
    for args in (
        [DEMO, *where, "lora.r=0"],  # a spec field
        [DEMO, *where, f"data.path={tmp_path / 'missing.jsonl'}"],  # a file that is not there
        [DEMO, *where, f"data.path={bad}"],  # a record that is not a record
        [str(tmp_path / "no-spec.yaml")],
        [DEMO, *where, "--num-cpus", "0"],
    ):
        p = rayft_in_process("data", "prepare", *args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and "error" in p.stderr, (args, p.stderr)
        assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists(), args


def test_an_address_where_no_cluster_answers_is_one_line_exit_2(tmp_path):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = write_jsonl(tmp_path / "t.jsonl", TEXT)
    where = [f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path / 'out'}"]
    p = rayft_in_process("data", "prepare", DEMO, *where, "--address", f"127.0.0.1:{port}")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"rayft: error: --address 127.0.0.1:{port}: no Ray cluster answers (Connection refused)"
    ]
    assert not (tmp_path / "cache").exists()


# The tests above start no Ray; those below share the module's (the fixture is torn down at the end).


@pytest.mark.ray
@pytest.mark.slow
def test_prepare_writes_the_single_process_entry_byte_for_byte(tmp_path, local_ray, small_blocks):
    for name, (spec_path, extra) in cases(tmp_path).items():
        where = [*COMMON, *extra, f"run.output_dir={tmp_path / 'out'}"]
        p = rayft_in_process("data", "prepare", spec_path, *where, f"data.cache_dir={tmp_path / name / 'ray'}")
        assert p.returncode == 0, (name, p.stderr)
        spec = load_spec(spec_path, [*where, f"data.cache_dir={tmp_path / name / 'one'}"])
        built = load_dataset(spec, load_tokenizer(spec)).cache_dir
        prepared = tmp_path / name / "ray" / built.name  # the same key: the path the job looks at
        assert f"prepared: {prepared}" in p.stdout, (name, p.stdout)
        assert entry_files(prepared) == entry_files(built), name
        meta = json.loads((built / "meta.json").read_text())
        assert meta["eval"]["n"] > 0 and meta["train"]["n"] > 2 * prepare_mod.BLOCK_RECORDS, name
        if name in ("parquet prompt/completion", "jsonl pairs"):  # these drop records: their counts compared too
            assert meta["dropped"] > 0, name


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_after_prepare_tokenizes_nothing_and_an_existing_entry_is_left_alone(tmp_path, local_ray, monkeypatch):
    data = write_jsonl(tmp_path / "t.jsonl", TEXT)
    where = [
        *COMMON,
        f"data.path={data}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"run.output_dir={tmp_path / 'out'}",
        "run.max_steps=1",
        "run.eval_every=0",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
    ]
    assert rayft_in_process("data", "prepare", DEMO, *where).returncode == 0
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in [entry, *entry.iterdir()]}

    def fail(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_mod, "tokenize_iter", fail)
    monkeypatch.setattr(data_mod, "read_records", fail)
    monkeypatch.setattr(prepare_mod, "read_records", fail)
    monkeypatch.setattr(prepare_mod, "connect", fail)  # an existing entry starts no Ray
    again = rayft_in_process("data", "prepare", DEMO, *where)
    assert again.returncode == 0 and f"already prepared, left as it is: {entry}" in again.stdout, again.stderr
    run = rayft_in_process("run", DEMO, *where, "--local")
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in [entry, *entry.iterdir()]} == before


@pytest.mark.ray
@pytest.mark.slow
def test_a_damaged_entry_is_set_aside_and_prepared_again(tmp_path, local_ray, caplog):
    """An existing entry is verified as a job's open verifies it before prepare leaves it alone: one
    whose tokens changed is set aside (kept, never deleted) with one line, and built again to the
    same bytes."""
    data = write_jsonl(tmp_path / "t.jsonl", TEXT)
    where = [*COMMON, f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path / 'o'}"]
    assert rayft_in_process("data", "prepare", DEMO, *where).returncode == 0
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    clean = entry_files(entry)
    tokens = entry / "train.input_ids.bin"
    damaged = bytearray(tokens.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01  # one token id changed, its size the same
    tokens.write_bytes(bytes(damaged))
    again = rayft_in_process("data", "prepare", DEMO, *where)
    assert again.returncode == 0, again.stderr
    assert "already prepared" not in again.stdout and f"prepared: {entry}" in again.stdout, again.stdout
    (line,) = [r for r in again.stderr.splitlines() if "set aside" in r]
    assert "train.input_ids.bin" in line and "rebuilt" in line, again.stderr
    assert entry_files(entry) == clean
    (aside,) = [p for p in (tmp_path / "cache").iterdir() if ".bad-" in p.name]
    assert (aside / "train.input_ids.bin").read_bytes() == bytes(damaged)  # kept as it was found


@pytest.mark.ray
@pytest.mark.slow
def test_a_mixture_is_prepared_as_one_entry_per_source_byte_for_byte(tmp_path, local_ray, small_blocks):
    """A mixture's entries are its sources' own (the keys `load_dataset` looks up for each source):
    prepare builds every one, and each is the single-process build of that source, file for file."""
    mix = (
        f"data.mix=[{{path: {write_jsonl(tmp_path / 't.jsonl', TEXT)}, weight: 2}}, "
        f"{{path: {write_parquet(tmp_path / 'pc.parquet', PC)}, weight: 1}}]"
    )
    # the demo's data.path and data.eval_path unset (COMMON unsets the latter): data.mix stands alone
    where = [*COMMON, "data.path=null", mix, f"run.output_dir={tmp_path / 'out'}"]
    p = rayft_in_process("data", "prepare", DEMO, *where, f"data.cache_dir={tmp_path / 'ray'}")
    assert p.returncode == 0, p.stderr
    spec = load_spec(DEMO, [*where, f"data.cache_dir={tmp_path / 'one'}"])
    sources = load_dataset(spec, load_tokenizer(spec)).sources
    assert [s.n_train > 0 for s in sources] == [True, True]
    for s in sources:
        assert s.cache_dir is not None
        assert entry_files(tmp_path / "ray" / s.cache_dir.name) == entry_files(s.cache_dir), s.name
    assert sorted(d.name for d in (tmp_path / "ray").iterdir() if d.is_dir()) == sorted(
        s.cache_dir.name for s in sources if s.cache_dir
    )
