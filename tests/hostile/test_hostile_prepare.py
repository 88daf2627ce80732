"""Check everything, then write: every refusal of the data (every record dropped, a chat template
that is missing, raises or is not prefix-stable, a cache that cannot be written) comes before
the output dir is claimed or locked, before --fresh sets checkpoints aside, and leaves no cache
entry: one line, exit 2, and the disk as it was (`jobs.finetune.prepare`, `build_data`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from inproc import rayft_in_process
from runs import SMALL_RUN

from jobs.data import cache_key
from jobs.model import loading as model_module
from jobs.model.loading import byte_tokenizer
from jobs.run.outputs import RUN_MARKER
from jobs.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = "examples/tiny-lora.yaml"
SMALL = SMALL_RUN
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
# Not prefix-stable: each rendering counts the conversation's messages first.
UNSTABLE = "{{ messages | length }}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"


def _one_line(r, *fragments: str) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def _chats(tmp_path: Path, messages: list[dict], n: int = 8) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for _ in range(n)))
    return path


def _run(tmp_path: Path, data: Path, *extra: str):
    out, cache = tmp_path / "run", tmp_path / "cache"
    r = rayft_in_process(
        "run", SPEC, *SMALL, f"data.path={data}", f"run.output_dir={out}", f"data.cache_dir={cache}", *extra, "--local"
    )
    return r, out, cache


def _entries(cache: Path) -> list[str]:
    """What the cache root holds (a refused build leaves nothing; `checked-*.json` is no entry)."""
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith("checked-")) if cache.exists() else []


def _with_template(monkeypatch, template: str | None) -> None:
    def tokenizer():
        t = byte_tokenizer()  # the module's own, captured before the patch
        t.chat_template = template
        return t

    monkeypatch.setattr(model_module, "byte_tokenizer", tokenizer)


def test_every_record_dropped_is_refused_before_anything_is_written(tmp_path):
    # An assistant message that opens a chat answers nothing: no record keeps a label.
    data = _chats(tmp_path, [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "hi"}])
    r, out, cache = _run(tmp_path, data)
    _one_line(r, "0 usable training records", "8 records dropped", "batch.global_batch_size=4")
    assert not out.exists() and _entries(cache) == []


@pytest.mark.parametrize(
    "template,fragment",
    [
        (None, "has no chat template"),
        (UNSTABLE, "not prefix-stable"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ],
    ids=["no-template", "not-prefix-stable", "raises"],
)
def test_a_template_that_cannot_render_is_refused_before_anything_is_written(tmp_path, monkeypatch, template, fragment):
    _with_template(monkeypatch, template)
    r, out, cache = _run(tmp_path, _chats(tmp_path, CHAT))
    _one_line(r, "model.name", fragment)
    assert not out.exists() and _entries(cache) == []


def test_fresh_sets_nothing_aside_when_the_data_is_refused(tmp_path):
    out = tmp_path / "run"
    step = out / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    (out / RUN_MARKER).write_text("{}")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    data = _chats(tmp_path, [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "hi"}])
    r, _, cache = _run(tmp_path, data, "--fresh")
    _one_line(r, "0 usable training records")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing moved, no lock file
    assert _entries(cache) == []


def test_a_cache_entry_that_cannot_be_written_is_one_line_before_the_output_dir(tmp_path):
    data = _chats(tmp_path, CHAT)
    cache = tmp_path / "cache"
    cache.mkdir()
    spec = load_spec(ROOT / SPEC, [*SMALL, f"data.path={data}", f"data.cache_dir={cache}"])
    # Someone else's file where the entry goes: the build cannot publish it (as for a root-owned
    # directory, which root itself can write).
    (cache / cache_key(spec, byte_tokenizer())).write_text("not ours")
    r, out, _ = _run(tmp_path, data)
    _one_line(r, "data.cache_dir=", "cannot write the tokenized data")
    assert not out.exists()


def test_the_driver_builds_the_entry_the_workers_use(tmp_path):
    """The happy path: one entry, built before the claim, used by the run (nothing built twice)."""
    r, out, cache = _run(tmp_path, _chats(tmp_path, CHAT))
    assert r.returncode == 0, r.stderr
    entries = [e for e in _entries(cache) if not e.endswith(".lock")]
    assert len(entries) == 1 and (out / RUN_MARKER).exists()


def test_a_search_refuses_the_data_before_fresh_moves_the_previous_search(tmp_path):
    """`rayft tune --fresh` builds the trials' cache entry on the driver first (`build_data`, as
    `rayft run` does): refused data is one line, exit 2, the previous search where it was."""
    import yaml

    from tests.integration.test_tune import search_spec

    data = search_spec(tmp_path)
    data["data"] = {
        "path": str(_chats(tmp_path, [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "hi"}], 16)),
        "max_seq_len": 64,
        "eval_fraction": 0.25,
        "cache_dir": str(tmp_path / "cache"),
    }
    spec = tmp_path / "search.yaml"
    spec.write_text(yaml.safe_dump(data))
    out = Path(data["run"]["output_dir"])
    (out / "trials").mkdir(parents=True)
    (out / "results.json").write_text("{}")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    r = rayft_in_process("tune", str(spec), "--fresh")
    _one_line(r, "0 usable training records")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == ["out"]  # nothing set aside
    assert _entries(tmp_path / "cache") == []
