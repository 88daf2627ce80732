"""Nothing blocks on a special file, and a long chat costs what max_seq_len can use.

A FIFO (or a link to a device) where rayft reads a user file (a data file, a file of a
`save_to_disk` directory, a checkpoint's state, manifest or a file a manifest names) is refused
in one line naming it, never opened: opening a FIFO blocks until someone writes to it. The
commands run as subprocesses with a timeout, the unit checks under an alarm, so a regression
fails instead of hanging. A chat record of 100,000 turns is rendered with a bounded number of
template calls, and records of any length tokenize as rendering the whole conversation does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filefuzz import alarm
from runs import SMALL_RUN

from jobs.data import char_bound, chat_spans, tokenize
from jobs.data import tokenizing as tokenizing_module
from jobs.errors import SpecError
from jobs.model.loading import byte_tokenizer
from jobs.run import checkpoint as ckpt
from jobs.run.outputs import RUN_MARKER

ROOT = Path(__file__).resolve().parents[2]
RAYFT = Path(sys.executable).parent / "rayft"
SPEC = "examples/tiny-lora.yaml"
SMALL = SMALL_RUN
TIMEOUT_S = 120  # a run that would hang on a FIFO fails here instead


def _rayft_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [str(RAYFT), "run", SPEC, *SMALL, f"data.cache_dir={tmp_path / 'cache'}", *overrides, "--local"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)


def _refused(r: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and lines, r.stderr
    for f in fragments:
        assert f in lines[-1], lines[-1]
    return lines[-1]


# ---- data --------------------------------------------------------------------------------------


def test_a_fifo_as_the_data_file_is_one_line(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    r = _rayft_run(tmp_path, f"data.path={fifo}", f"run.output_dir={tmp_path / 'run'}")
    assert "FIFO" in _refused(r, str(fifo)) and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def _saved_dataset(directory: Path) -> Path:
    import datasets

    rows = [{"prompt": f"q{i} ", "completion": f"a{i}"} for i in range(8)]
    datasets.Dataset.from_list(rows).save_to_disk(str(directory))
    return directory


def test_a_fifo_in_a_save_to_disk_directory_is_one_line(tmp_path):
    ds = _saved_dataset(tmp_path / "ds")
    arrow = json.loads((ds / "state.json").read_text())["_data_files"][0]["filename"]
    (ds / arrow).unlink()
    os.mkfifo(ds / arrow)
    r = _rayft_run(tmp_path, f"data.path={ds}", f"run.output_dir={tmp_path / 'run'}")
    assert "FIFO" in _refused(r, arrow) and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_fifo_as_the_starting_adapter_weights_is_one_line(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 32}))
    os.mkfifo(adapter / "adapter_model.safetensors")
    r = _rayft_run(tmp_path, f"model.adapter={adapter}", f"run.output_dir={tmp_path / 'run'}")
    assert "FIFO" in _refused(r, "model.adapter", "adapter_model.safetensors")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


# ---- checkpoints -------------------------------------------------------------------------------


def _checkpoint(out: Path) -> Path:
    """A run directory holding one complete one-rank checkpoint (as `write_rank_files` writes it)."""
    step = out / "checkpoints" / ckpt.step_dir_name(2)
    state = {"step": 2, "tokens_seen": 0, "skipped_steps": 0, "world_size": 1, "resume_key": {}}
    ckpt.write_rank_files(step, 0, {ckpt.rng_file(0): ckpt.rng_state(), ckpt.STATE_FILE: state})
    (out / RUN_MARKER).write_text("{}")
    return step


def _special(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero"])
def test_a_checkpoint_manifest_entry_that_is_special_is_refused_without_hanging(tmp_path, kind):
    out = tmp_path / "run"
    step = _checkpoint(out)
    manifest = json.loads((step / ckpt.manifest_file(0)).read_text())
    manifest[ckpt.rng_file(0)] = {"bytes": 0, "sha256": "0" * 64}  # what a FIFO's or a device's stat says
    (step / ckpt.manifest_file(0)).write_text(json.dumps(manifest))
    _special(step / ckpt.rng_file(0), kind)
    r = _rayft_run(tmp_path, f"run.output_dir={out}")
    _refused(r, "incomplete or corrupt", "--fresh")
    assert ckpt.rng_file(0) in r.stderr and ("FIFO" in r.stderr or "device" in r.stderr)


@pytest.mark.parametrize("name", [ckpt.STATE_FILE, ckpt.manifest_file(0), ckpt.rng_file(0)])
@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero"])
def test_no_checkpoint_reader_opens_a_special_file(tmp_path, name, kind):
    step = _checkpoint(tmp_path / "run")
    _special(step / name, kind)
    with alarm(20):
        why = ckpt.why_incomplete(step)
        assert why is not None and name in why and ("FIFO" in why or "device" in why)
        if name == ckpt.STATE_FILE:
            with pytest.raises(SpecError, match="not a regular file"):
                ckpt.load_state(step)
        if name.endswith(".pt"):
            with pytest.raises(SpecError, match="not a regular file"):
                ckpt.load_plain(step / name)
            with pytest.raises(SpecError, match="not a regular file"):
                ckpt.check_loadable(step)


def test_a_special_adapter_file_in_a_checkpoint_is_refused(tmp_path):
    step = _checkpoint(tmp_path / "run")
    os.mkfifo(step / ckpt.ADAPTER_FILE)
    with alarm(20), pytest.raises(SpecError, match="FIFO"):
        ckpt.load_adapter(step)


# ---- a long chat -------------------------------------------------------------------------------


class CountingTokenizer:
    """The byte tokenizer, counting template calls and the messages they render."""

    def __init__(self):
        self.inner, self.calls, self.messages = byte_tokenizer(), 0, 0

    def apply_chat_template(self, messages, **kw):
        self.calls += 1
        self.messages += len(messages)
        return self.inner.apply_chat_template(messages, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *a, **kw):
        return self.inner(*a, **kw)


def _turns(n: int, text: str = "m") -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{text}{i}"} for i in range(n)]


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
def test_a_chat_of_100000_turns_renders_what_max_seq_len_can_use(train_on):
    tok = CountingTokenizer()
    kept = tokenize([{"messages": _turns(100_000)}], tok, 256, train_on, "test-model")
    # The last assistant turn lies far past max_seq_len: with only it trained on, nothing is left.
    assert [len(e.input_ids) for e in kept] == ([255] if train_on == "assistant" else [])
    # Rendering every prefix (two renders per assistant turn) would take 100,001 calls over ~5e9
    # messages; what the first char_bound characters hold needs a few hundred over ~1e4 (the
    # last-assistant mode renders the whole conversation at most three times: linear).
    if train_on == "assistant":
        assert tok.calls <= 2 * char_bound(tok.inner, 256) // 8 and tok.messages <= 50_000, (tok.calls, tok.messages)
    else:
        assert tok.calls <= 3 and tok.messages <= 3 * 100_000, (tok.calls, tok.messages)


def _whole(tokenizer, messages, train_on="assistant", model_name=None, max_chars=None):
    return chat_spans(tokenizer, messages, train_on, model_name)  # every turn rendered: the unbounded rule


@pytest.mark.parametrize("max_seq_len", [16, 64, 256])
@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
def test_bounded_rendering_gives_the_tokens_of_rendering_everything(monkeypatch, max_seq_len, train_on):
    tok = byte_tokenizer()
    records = [{"messages": _turns(n, "x" * (n % 7))} for n in range(2, 120, 3)]
    records += [{"messages": [{"role": "system", "content": "s" * 300}, *_turns(40)]}]
    bounded = tokenize(records, tok, max_seq_len, train_on, "test-model")
    monkeypatch.setattr(tokenizing_module, "chat_spans", _whole)
    assert bounded == tokenize(records, tok, max_seq_len, train_on, "test-model")
