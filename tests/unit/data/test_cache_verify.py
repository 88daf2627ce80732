"""A cache entry is verified before it is used: a damaged, tampered or linked entry is set aside and
rebuilt with one warning line (the data are then those of a clean build), or refused in one line
naming the file where it cannot be set aside; the digest pass runs once per node and again after
a file changed, and a node's marker skips it otherwise."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from inproc import ROOT, rayft_in_process

import jobs.data.cache as data_mod
import jobs.data.verify as verify_mod
from jobs.data import load_dataset
from jobs.errors import SpecError
from jobs.model.loading import byte_tokenizer
from jobs.spec import load_spec

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
    "data.eval_fraction=0.1",
]
ARRAYS = ("ids", "targets", "offsets", "lengths", "label_tokens")


@pytest.fixture(autouse=True)
def markers(tmp_path, monkeypatch):
    """Each test its own node: markers under its tmp_path."""
    monkeypatch.setattr(verify_mod, "MARKER_DIR", str(tmp_path / "markers-{uid}"))
    return tmp_path


def spec_for(out: Path, path: Path = DATA):
    return load_spec(DEMO, [*SMALL, f"data.path={path}", f"run.output_dir={out}"], files=False)


def arrays(data) -> dict[str, np.ndarray]:
    return {f"{s}.{a}": np.array(getattr(getattr(data, s), a)) for s in ("train", "eval") for a in ARRAYS}


@pytest.fixture
def clean(tmp_path):
    """A built, verified entry and a copy of its arrays (what every rebuild must give again)."""
    spec = spec_for(tmp_path / "out")
    data = load_dataset(spec, byte_tokenizer())
    return spec, data.cache_dir, arrays(data)


def rewrite_meta(entry: Path, change) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    change(meta)
    (entry / "meta.json").write_text(json.dumps(meta))


def truncate(entry: Path) -> str:
    f = entry / "train.input_ids.bin"
    f.write_bytes(f.read_bytes()[:-4])
    return "train.input_ids.bin: holds"


def flip_middle(entry: Path) -> str:
    """Same size, same mtime put back: the ctime still changed, so the digest runs and differs."""
    f = entry / "train.targets.bin"
    st, raw = f.stat(), bytearray(f.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 4] = np.int32(65).tobytes() if raw[len(raw) // 2] != 65 else b"\x42\0\0\0"
    f.write_bytes(bytes(raw))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    return "train.targets.bin: content differs"


def ids_out_of_vocabulary(entry: Path) -> str:
    """Ids rewritten past the vocabulary, with meta.json's digest made to match: the range catches it."""
    f = entry / "train.input_ids.bin"
    ids = np.fromfile(f, dtype=np.int32)
    ids[len(ids) // 2] = 10**6
    ids.tofile(f)

    def digest(meta):
        meta["files"][f.name]["sha256"] = verify_mod.digest(f, None)

    rewrite_meta(entry, digest)
    return "train.input_ids.bin: holds token ids outside the vocabulary"


def garbage_meta(entry: Path) -> str:
    (entry / "meta.json").write_bytes(b"\x00{not json")
    return "meta.json: is not the JSON"


def missing_meta(entry: Path) -> str:
    (entry / "meta.json").unlink()
    return "meta.json: is missing"


def n_too_large(entry: Path) -> str:
    def grow(meta):
        meta["train"]["n"] += 5

    rewrite_meta(entry, grow)
    return "train.offsets.npy: holds int64"


def wrong_kind(entry: Path) -> str:
    def pairs(meta):
        meta["kind"] = "pairs"

    rewrite_meta(entry, pairs)
    return "meta.json: holds 'pairs' data"


def file_replaced_by_link(entry: Path) -> str:
    f = entry / "train.targets.bin"
    shutil.copyfile(f, entry.parent / "elsewhere.bin")
    f.unlink()
    f.symlink_to(entry.parent / "elsewhere.bin")
    return "train.targets.bin: is a symbolic link"


MUTATIONS = [
    truncate,
    flip_middle,
    ids_out_of_vocabulary,
    garbage_meta,
    missing_meta,
    n_too_large,
    file_replaced_by_link,
]


@pytest.mark.parametrize("mutate", MUTATIONS, ids=lambda m: m.__name__)
def test_a_bad_entry_is_set_aside_and_rebuilt_with_one_line(clean, tmp_path, caplog, mutate):
    spec, entry, want = clean
    said = mutate(entry)
    with caplog.at_level(logging.WARNING, logger="rayft"):
        data = load_dataset(spec_for(tmp_path / "out-2"), byte_tokenizer())
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and said in lines[0] and "rebuilt" in lines[0], lines
    assert data.cache_dir == entry and not entry.is_symlink()
    got = arrays(data)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    (aside,) = [p for p in entry.parent.iterdir() if p.name.startswith(entry.name + ".bad-")]
    assert aside.is_dir() and aside.name in lines[0]  # set aside, never deleted


def test_an_entry_linked_to_another_datasets_entry_is_never_followed(clean, tmp_path, caplog):
    spec, entry, want = clean
    other_data = tmp_path / "other.jsonl"
    other_data.write_text("".join(json.dumps({"text": f"other record {i} " * 3}) + "\n" for i in range(40)))
    other = load_dataset(spec_for(tmp_path / "out-o", other_data), byte_tokenizer()).cache_dir
    shutil.rmtree(entry)
    entry.symlink_to(other)
    with caplog.at_level(logging.WARNING, logger="rayft"):
        data = load_dataset(spec, byte_tokenizer())
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and f"{entry}: is a symbolic link" in lines[0] and "rebuilt" in lines[0], lines
    got = arrays(data)
    assert all(np.array_equal(got[k], want[k]) for k in want) and not entry.is_symlink()
    assert other.is_dir() and (other / "meta.json").is_file()  # the other dataset's entry untouched


def test_a_copy_of_another_datasets_entry_is_caught_by_its_content_hash(clean, tmp_path, caplog):
    spec, entry, want = clean
    other_data = tmp_path / "other.jsonl"
    other_data.write_text("".join(json.dumps({"text": f"other record {i} " * 3}) + "\n" for i in range(40)))
    other = load_dataset(spec_for(tmp_path / "out-o", other_data), byte_tokenizer()).cache_dir
    shutil.rmtree(entry)
    shutil.copytree(other, entry)
    with caplog.at_level(logging.WARNING, logger="rayft"):
        data = load_dataset(spec, byte_tokenizer())
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "meta.json: belongs to other data" in lines[0], lines
    got = arrays(data)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_where_it_cannot_be_set_aside_it_is_one_line_naming_the_file(clean, monkeypatch):
    spec, entry, _ = clean
    truncate(entry)

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(data_mod, "set_aside", read_only)  # as root, chmod cannot make a directory read-only
    with pytest.raises(SpecError) as e:
        load_dataset(spec, byte_tokenizer())
    text = str(e.value)
    assert "\n" not in text and f"{entry / 'train.input_ids.bin'}: holds" in text and "Read-only" in text
    assert sorted(p.name for p in entry.parent.iterdir() if ".bad-" in p.name) == []


def test_a_run_on_a_read_only_damaged_cache_is_one_line_exit_2(clean, tmp_path, monkeypatch):
    spec, entry, _ = clean
    garbage_meta(entry)
    monkeypatch.setattr(
        data_mod, "set_aside", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system"))
    )
    where = [*SMALL, f"data.path={DATA}", f"run.output_dir={tmp_path / 'out'}", "run.max_steps=1"]
    p = rayft_in_process("run", DEMO, *where, "--local")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and f"{entry / 'meta.json'}: is not the JSON" in p.stderr
    assert len([line for line in p.stderr.splitlines() if "meta.json" in line]) == 1, p.stderr


def test_the_marker_skips_the_digest_until_a_file_changes(clean, tmp_path, monkeypatch):
    spec, entry, _ = clean
    calls = []
    real = verify_mod.digest

    def counted(path, vocab_size):
        calls.append(Path(path).name)
        return real(path, vocab_size)

    monkeypatch.setattr(verify_mod, "digest", counted)
    load_dataset(spec, byte_tokenizer())
    assert calls == []  # verified when it was built on this node: nothing changed since
    os.utime(entry / "eval.lengths.npy")  # touched: every file is digested again, once
    load_dataset(spec, byte_tokenizer())
    n_files = len(data_mod.entry_files(data_mod.SFT))
    assert sorted(calls) == sorted(data_mod.entry_files(data_mod.SFT)) and len(calls) == n_files
    load_dataset(spec, byte_tokenizer())
    assert len(calls) == n_files
    monkeypatch.setattr(verify_mod, "MARKER_DIR", str(tmp_path / "another-node-{uid}"))  # a fresh node
    load_dataset(spec, byte_tokenizer())
    assert len(calls) == 2 * n_files


def test_meta_json_records_every_files_size_and_digest(clean):
    _, entry, _ = clean
    meta = json.loads((entry / "meta.json").read_text())
    assert sorted(meta["files"]) == data_mod.entry_files(data_mod.SFT)
    for name, rec in meta["files"].items():
        assert rec["size"] == (entry / name).stat().st_size
        assert rec["sha256"] == hashlib.sha256((entry / name).read_bytes()).hexdigest()


@pytest.mark.parametrize("damage", ["chosen tokens flipped", "prompt offsets shortened"])
def test_a_bad_pairs_entry_is_rebuilt_to_the_same_pairs(tmp_path, caplog, damage):
    pairs = ROOT / "examples" / "data" / "tiny-pairs.jsonl"
    spec = load_spec(
        DEMO, [*SMALL, "objective.name=dpo", f"data.path={pairs}", f"run.output_dir={tmp_path / 'out'}"], files=False
    )
    data = load_dataset(spec, byte_tokenizer())
    want, entry = list(data.train), data.cache_dir
    if damage == "chosen tokens flipped":
        f = entry / "train.chosen.bin"
        ids = np.fromfile(f, dtype=np.int32)
        ids[len(ids) // 2] = (ids[len(ids) // 2] + 1) % 256
        ids.tofile(f)
        said = "train.chosen.bin: content differs"
    else:
        np.save(entry / "train.prompt.offsets.npy", np.load(entry / "train.prompt.offsets.npy")[:-1])
        said = "train.prompt.offsets.npy: holds"
    with caplog.at_level(logging.WARNING, logger="rayft"):
        again = load_dataset(spec, byte_tokenizer())
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and said in lines[0] and "rebuilt" in lines[0], lines
    assert list(again.train) == want


def test_a_run_on_a_tampered_entry_trains_on_the_clean_tokens_and_says_it_rebuilt(clean, tmp_path):
    """Ids rewritten in place (same size): the run sets the entry aside, rebuilds it, says so in
    one line, and its losses are those of a run on the clean entry."""
    _, entry, _ = clean
    where = [*SMALL, f"data.path={DATA}", "run.max_steps=2", "run.checkpoint_every=0"]
    first = rayft_in_process("run", DEMO, *where, f"run.output_dir={tmp_path / 'out'}", "--local")
    assert first.returncode == 0, first.stderr
    f = entry / "train.input_ids.bin"
    ids = np.fromfile(f, dtype=np.int32)
    ids[: len(ids) // 2] = (ids[: len(ids) // 2] + 1) % 256
    ids.tofile(f)
    second = rayft_in_process("run", DEMO, *where, f"run.output_dir={tmp_path / 'out-2'}", "--local")
    assert second.returncode == 0, second.stderr
    said = [line for line in second.stderr.splitlines() if "rebuilt" in line]
    assert len(said) == 1 and f"{f}: content differs" in said[0], second.stderr
    runs = [json.loads((tmp_path / o / "summary.json").read_text()) for o in ("out", "out-2")]
    assert runs[0]["first_loss"] == runs[1]["first_loss"] and runs[0]["final_loss"] == runs[1]["final_loss"]
