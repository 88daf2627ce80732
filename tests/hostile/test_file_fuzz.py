"""Property-based fuzzing of the files rayft reads back: a tokenized cache entry, a checkpoint
directory, an adapter directory, a queue database, a precomputed reference entry, a starting
adapter and the place `--svg` writes (`tests/helpers/filefuzz.py`), each mutated in one drawn
file (truncated to a drawn length, a drawn byte flipped, replaced by a FIFO, by a link to a
sibling, a dangling link or a link to /dev/zero, garbage appended, a header grown by bytes put
in front, deleted, replaced by a directory) and run through its reader in-process under a 30 s alarm.

Property: exit 0 or 2 (a refusal in one line), never a traceback or a hang; for the cache entry,
the checkpoint, the reference entry, the starting adapter and the svg place, never a silent wrong result (exit 0
means the clean entry's tokens or reference values, a clean checkpoint's contents, the adapter
file's weights loaded; see each target's docstring for what holds).

Each clean target is built once per module and copied per example. Counts: a fixed, derandomized
number per target (`EXAMPLES`: 100 cache, 150 checkpoint, 80 adapter, 150 queue, 100 reference,
80 starting adapter, 100 svg); `bench/fuzz_files.py` runs the same targets for longer.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from filefuzz import DEMO, TARGETS, Mutation, alarm, check, mutations
from hypothesis import given, settings
from inproc import rayft_in_process

EXAMPLES = {"cache": 100, "checkpoint": 150, "adapter": 80, "queue": 150, "reference": 100, "start": 80, "svg": 100}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every clean target, built once."""
    made = {}
    for name, cls in TARGETS.items():
        t = cls()
        t.build(tmp_path_factory.mktemp(f"clean-{name}"))
        made[name] = t
    return made


def _fuzz(target, name: str):
    @settings(max_examples=EXAMPLES[name])
    @given(mutations)
    def run(m: Mutation) -> None:
        check(target, m)

    run()


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_mutated_file_is_read_or_refused_in_one_line(built, name):
    _fuzz(built[name], name)


def _index(target, name: str) -> int:
    """The index `Mutation` picks `name` by (the newest checkpoint's, where there are two)."""
    root = target.root(target.source)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    return max(i for i, p in enumerate(files) if p.name == name)


@pytest.mark.parametrize("name", list(TARGETS))
def test_the_fuzzer_reaches_both_outcomes(built, name, tmp_path):
    """A clean target reads (exit 0), and a known-bad mutation is refused (exit 2) or, for the
    cache and the reference entry, rebuilt: the fuzz cannot pass by testing nothing. (A single
    damaged file never refuses a cache entry or a run directory of two checkpoints: the entry is
    rebuilt, the older checkpoint resumed; exit 2 there needs both checkpoints damaged, or an entry
    that cannot be set aside, which tests/unit/data/test_cache_verify.py covers.)"""
    target = built[name]
    assert check(target, None)[0] == 0
    # the file each reader opens first turned into a FIFO: refused (or rebuilt), never blocked on
    first = {
        "cache": "meta.json",
        "checkpoint": "state.json",
        "adapter": "adapter_config.json",
        "queue": "q.db",
        "reference": "meta.json",
        "start": "adapter_config.json",
        "svg": "p.svg",  # the picture's own path a FIFO: refused, not opened
    }
    code, hit = check(target, Mutation("fifo", _index(target, first[name]), 0, b"x"))
    assert hit == first[name]
    if name in ("cache", "reference"):  # a bad entry is ours to rebuild: exit 0 with the clean values (inside)
        assert code == 0
    elif name == "checkpoint":  # the newest is skipped, the older one resumed (asserted inside)
        assert code == 0
        copy = _copy(target, tmp_path)  # both checkpoints damaged: refused, never a fresh start
        for state in sorted(copy.rglob("state.json")):
            state.write_text("{")
        with alarm():
            assert target.read(copy, True) == 2
    else:
        assert code == 2


# ---- what the longer run found, kept as fixed cases ---------------------------------------------


def _copy(target, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(target.source, dst, symlinks=True)
    return dst


def test_bytes_appended_to_adapter_weights_are_one_line(built, tmp_path):
    adapter = _copy(built["adapter"], tmp_path)
    with open(adapter / "adapter_model.safetensors", "ab") as f:
        f.write(b"GGUF")
    r = rayft_in_process("generate", str(adapter), "hi", "--max-new-tokens", "2")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "4 bytes past its tensors" in lines[0], r.stderr


def test_a_starting_adapter_without_one_b_is_one_line(built, tmp_path):
    """A weights file short of one layer's B (PEFT left it at its zero init) is refused, not loaded."""
    from safetensors.torch import load_file, save_file

    adapter = _copy(built["start"], tmp_path)
    tensors = load_file(adapter / "adapter_model.safetensors")
    del tensors[min(k for k in tensors if "lora_B" in k)]
    save_file(tensors, adapter / "adapter_model.safetensors")
    with alarm():
        assert built["start"].read(adapter, True) == 2


@pytest.mark.parametrize(
    "edit,code,said",
    [
        ("UPDATE jobs SET name=CAST(X'88' AS TEXT) WHERE id=2", 0, ""),
        ("ALTER TABLE jobs RENAME COLUMN priority TO prio", 2, "jobs.priority"),
    ],
    ids=["text-not-utf8", "column-renamed"],
)
def test_a_damaged_queue_database_is_read_or_refused_in_one_line(built, tmp_path, edit, code, said):
    db = _copy(built["queue"], tmp_path) / "q.db"
    c = sqlite3.connect(db, isolation_level=None)
    c.execute(edit)
    c.close()
    for args in (["status"], ["status", "--json"]):
        r = rayft_in_process("queue", *args, "--db", str(db))
        assert r.returncode == code and "Traceback" not in r.stderr, r.stderr
        if code:
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and said in lines[0], r.stderr


def test_a_queue_database_linked_to_itself_is_one_line(built, tmp_path):
    db = _copy(built["queue"], tmp_path) / "q.db"
    db.unlink()
    db.symlink_to(db)
    for args in (["status"], ["add", DEMO]):
        r = rayft_in_process("queue", *args, "--db", str(db))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "symbolic link" in lines[0], r.stderr
