"""The precomputed reference entry (`objective.reference: precomputed`) is checked like the data
entries: changed values, a changed shape with a consistent meta.json, a link to another entry, a
FIFO, a damaged meta.json or one whose file records lack a size or a digest are each set aside
(kept, never deleted) with one warning line and computed again, so the run trains exactly what a
clean run trains. Before these checks each of
them trained silently on the damaged values, gave a traceback, or hung (issue 49, item 2)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from gradtools import ROOT
from runs import metric_lines

from jobs.data.verify import file_records
from jobs.spec import absolutize, load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train

PAIRS = ROOT / "examples" / "data"


def _run(tmp: Path, name: str) -> float:
    """A 1-step DPO run with the precomputed reference; its step-1 loss."""
    data = {
        "name": "ref",
        "data": {
            "path": str(PAIRS / "tiny-pairs.jsonl"),
            "eval_path": str(PAIRS / "tiny-pairs-eval.jsonl"),
            "max_seq_len": 96,
            "cache_dir": str(tmp / "cache"),
        },
        "objective": {"name": "dpo", "beta": 0.5, "reference": "precomputed"},
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "run": {"max_steps": 1, "output_dir": str(tmp / name), "eval_every": 0},
        "memory": {"gradient_checkpointing": False},
    }
    spec = absolutize(load_spec(data=data, overrides=["resources.num_workers=1"]))
    train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    return metric_lines(tmp / name)[0]["loss"]


def _entry(tmp: Path) -> Path:
    (entry,) = [
        p for p in (tmp / "cache").iterdir() if ".reference-" in p.name and "." not in p.name.split(".reference-")[1]
    ]
    return entry


def _changed_values(entry: Path) -> None:
    table = np.load(entry / "train.npy")
    table[0, 0] += 5.0  # the same size: only the digest tells
    np.save(entry / "train.npy", table)


def _extra_column_consistent_meta(entry: Path) -> None:
    table = np.load(entry / "train.npy")
    np.save(entry / "train.npy", np.concatenate([table, table[:, :1]], axis=1))
    meta = json.loads((entry / "meta.json").read_text())
    meta["files"] = file_records(entry, ["eval.npy", "train.npy"])  # digests and sizes agree
    (entry / "meta.json").write_text(json.dumps(meta))


def _link_to_another_entry(entry: Path) -> None:
    other = entry.with_name(entry.name.replace(".reference-", ".other-"))
    shutil.copytree(entry, other)
    _changed_values(other)
    shutil.rmtree(entry)
    entry.symlink_to(other, target_is_directory=True)


def _fifo(entry: Path) -> None:
    (entry / "train.npy").unlink()
    os.mkfifo(entry / "train.npy")


def _meta_garbage(entry: Path) -> None:
    (entry / "meta.json").write_text("{not json")


def _meta_record_without_digest(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta["files"]["eval.npy"]["rha256"] = meta["files"]["eval.npy"].pop("sha256")  # a flipped bit, as CI's fuzz found
    (entry / "meta.json").write_text(json.dumps(meta))
    # as in a copied entry (the fuzz's): this node's marker no longer vouches for the files, so digests are read
    os.utime(entry / "eval.npy")


def _meta_record_without_size(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    del meta["files"]["train.npy"]["size"]
    (entry / "meta.json").write_text(json.dumps(meta))


DAMAGES = [
    _changed_values,
    _extra_column_consistent_meta,
    _link_to_another_entry,
    _fifo,
    _meta_garbage,
    _meta_record_without_digest,  # each was a KeyError traceback before
    _meta_record_without_size,
]


def test_a_damaged_reference_entry_is_set_aside_and_computed_again(tmp_path, caplog):
    clean = _run(tmp_path, "clean")
    for i, damage in enumerate(DAMAGES):
        damage(_entry(tmp_path))
        with caplog.at_level("WARNING", logger="rayft"):
            caplog.clear()
            loss = _run(tmp_path, f"after-{i}")
        warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precomputed reference: ")]
        assert len(warned) == 1 and "set aside as" in warned[0], (damage.__name__, warned)
        assert loss == clean, damage.__name__  # trained on the recomputed values, exactly
        assert len(list((tmp_path / "cache").glob("*.reference-*.bad-*"))) == i + 1  # kept, never deleted
