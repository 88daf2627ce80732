"""The resume key covers what decides step k's samples: the held-out split (`data.eval_fraction`,
`data.eval_path`, the seed that draws it) and every file a `save_to_disk` description names. A
change refuses the resume in one line saying what changed; a checkpoint written before a key
existed stays resumable."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from inproc import rayft_in_process
from runs import SMALL_RUN

from jobs.data import content_hash
from jobs.errors import SpecError
from jobs.run import checkpoint as ckpt
from jobs.spec import absolutize, load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = "examples/tiny-lora.yaml"
SMALL = SMALL_RUN
TINY, TINY_EVAL = ROOT / "examples/data/tiny.jsonl", ROOT / "examples/data/tiny-eval.jsonl"


def _spec(*overrides: str):
    return absolutize(load_spec(ROOT / SPEC, [*SMALL, *overrides]))


def _refusal(saved: dict, spec) -> str:
    with pytest.raises(SpecError) as e:
        ckpt.check_resumable(saved, spec, "ckpt")
    line = str(e.value)
    assert "\n" not in line and "cannot resume" in line and "--fresh" in line
    return line


def test_a_changed_held_out_fraction_refuses_the_resume(tmp_path):
    fraction = _spec("data.eval_path=null", "data.eval_fraction=0.25")
    assert fraction.data.eval_path is None
    saved = ckpt.resume_key(fraction)
    ckpt.check_resumable(saved, fraction, "ckpt")  # unchanged: fine
    assert "data.eval_fraction: 0.25 -> 0.5" in _refusal(saved, _spec("data.eval_path=null", "data.eval_fraction=0.5"))
    assert "data.eval_fraction: 0.25 -> 0.0" in _refusal(saved, _spec("data.eval_path=null"))
    assert "run.seed" in _refusal(saved, _spec("data.eval_path=null", "data.eval_fraction=0.25", "run.seed=3"))


def test_a_changed_held_out_file_refuses_the_resume(tmp_path):
    other = tmp_path / "eval.jsonl"
    other.write_bytes(TINY_EVAL.read_bytes())  # the same records elsewhere: the path is the key
    saved = ckpt.resume_key(_spec())
    line = _refusal(saved, _spec(f"data.eval_path={other}"))
    assert "data.eval_path:" in line and str(other) in line
    # Holding out a fraction instead of the file: both keys say so.
    line = _refusal(saved, _spec("data.eval_path=null", "data.eval_fraction=0.25"))
    assert "data.eval_path:" in line and "data.eval_fraction: None -> 0.25" in line


def test_the_fraction_decides_nothing_beside_a_held_out_file():
    saved = ckpt.resume_key(_spec())
    ckpt.check_resumable(saved, _spec("data.eval_fraction=0.5"), "ckpt")


def test_a_checkpoint_from_before_the_held_out_keys_still_resumes():
    spec = _spec("data.eval_path=null", "data.eval_fraction=0.25")
    old = {k: v for k, v in ckpt.resume_key(spec).items() if k not in ckpt.LATE_KEYS}
    ckpt.check_resumable(old, spec, "ckpt")  # trained with a fraction it did not record: not compared
    assert "lora.r" in _refusal(old, _spec("data.eval_path=null", "data.eval_fraction=0.25", "lora.r=8"))


def test_a_changed_held_out_fraction_refuses_a_rerun_in_one_line(tmp_path):
    out = tmp_path / "run"
    base = ["run", SPEC, *SMALL, "data.eval_path=null", f"run.output_dir={out}", "run.checkpoint_every=1", "--local"]
    assert rayft_in_process(*base, "data.eval_fraction=0.25").returncode == 0
    r = rayft_in_process(*base, "data.eval_fraction=0.5", "run.max_steps=2")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "data.eval_fraction: 0.25 -> 0.5" in lines[0], r.stderr


# ---- save_to_disk: every named file ------------------------------------------------------------


def _saved_dataset(directory: Path) -> Path:
    import datasets

    rows = [json.loads(line) for line in TINY.read_text().splitlines() if line.strip()]
    datasets.Dataset.from_list(rows).save_to_disk(str(directory))
    return directory


def _state(ds: Path) -> dict:
    return json.loads((ds / "state.json").read_text())


@pytest.mark.parametrize("name", ["../outside.arrow", "/tmp/outside.arrow", "sub/../../outside.arrow"])
def test_a_description_naming_a_file_outside_its_directory_is_refused(tmp_path, name):
    ds = _saved_dataset(tmp_path / "ds")
    state = _state(ds)
    state["_data_files"][0]["filename"] = name
    (ds / "state.json").write_text(json.dumps(state))
    out = tmp_path / "run"
    r = rayft_in_process("run", SPEC, *SMALL, f"data.path={ds}", f"run.output_dir={out}", "--local")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "outside its directory" in lines[0] and "state.json" in lines[0]
    assert not out.exists()


def test_a_named_file_below_a_linked_directory_is_hashed(tmp_path):
    ds = _saved_dataset(tmp_path / "ds")
    state = _state(ds)
    arrow = state["_data_files"][0]["filename"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (ds / arrow).rename(elsewhere / arrow)
    os.symlink(elsewhere, ds / "shards")  # rglob does not enter a linked directory
    state["_data_files"][0]["filename"] = f"shards/{arrow}"
    (ds / "state.json").write_text(json.dumps(state))
    spec = _spec(f"data.path={ds}")
    before = content_hash(spec)
    import datasets

    other = tmp_path / "other"  # other records, the same layout
    datasets.Dataset.from_list([{"prompt": "changed ", "completion": "records"}] * 8).save_to_disk(str(other))
    (elsewhere / arrow).write_bytes((other / _state(other)["_data_files"][0]["filename"]).read_bytes())
    assert content_hash(spec) != before


def test_a_dataset_dict_naming_a_split_outside_its_directory_is_refused(tmp_path):
    import datasets

    from jobs.data.sources import dataset_dir_files

    rows = [{"text": f"t{i}"} for i in range(4)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    assert any(p.name == "state.json" and p.parent.name == "train" for p in dataset_dir_files(tmp_path / "dd"))
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["../../elsewhere"]}))
    with pytest.raises(SpecError, match="outside its directory"):
        dataset_dir_files(tmp_path / "dd")


def test_a_starting_adapter_replaced_under_the_same_path_refuses_the_resume(tmp_path):
    """The key holds the bytes PEFT reads of `model.adapter`, not only its path (issue 49 item 3):
    before, an adapter replaced between attempts resumed silently with another reference."""
    adapter = tmp_path / "start"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights one")
    spec = _spec(f"model.adapter={adapter}")
    saved = ckpt.resume_key(spec)
    ckpt.check_resumable(saved, spec, "ckpt")  # unchanged: fine
    (adapter / "notes.txt").write_text("PEFT never reads this")
    ckpt.check_resumable(saved, spec, "ckpt")  # a file PEFT does not read changes nothing
    (adapter / "adapter_model.safetensors").write_bytes(b"weights two")
    assert "model.adapter: its files changed since the checkpoint" in _refusal(saved, spec)
    # A checkpoint written before the key existed is not compared on it (it stays resumable).
    ckpt.check_resumable({k: v for k, v in saved.items() if k != ckpt.ADAPTER_HASH_KEY}, spec, "ckpt")
