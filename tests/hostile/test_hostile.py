"""Hostile and careless input to the jobs side: planted checkpoints, output directories that are
not rayft's, YAML bombs, non-finite numbers, huge and deep records, names with a newline.

Every refusal is one line, exit code 2, no traceback, and creates nothing. A run that fails for a
reason no input fixes (it diverged, a bad RAYFT_FAULT) is one line too, exit code 1."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch
from runs import step_line

from jobs.errors import RunError, SpecError
from jobs.finetune import main as finetune_main
from jobs.finetune import prepare
from jobs.run import checkpoint as ckpt
from jobs.run.outputs import RUN_MARKER, MetricsLog, strict_json, write_json_atomic
from jobs.run.step_record import StepRecord
from jobs.spec import absolutize, load_spec, validate

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "tiny.jsonl"
DEMO = str(ROOT / "examples" / "tiny-lora.yaml")
# The demo, made small: one worker, short sequences, a small batch.
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


def _cli(args: list[str]) -> tuple[int, str]:
    """`rayft run ARGS --local` in-process through the real CLI entry (`python -m jobs.finetune`
    shares its preparation and error mapping): (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = finetune_main([*args, "--local"])
    return rc, err.getvalue()


def _assert_one_line(rc: int, err: str, *fragments: str, exit_code: int = 2) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == exit_code, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


# ---- 1. a checkpoint never runs code -------------------------------------------------------


class _Planted:
    """Unpickling this calls open(marker, "w"): a stand-in for any code a pickle can run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _run_small(out: Path, *extra: str) -> int:
    rc, err = _cli([DEMO, f"run.output_dir={out}", *SMALL, *extra])
    return rc


def _plant(step_dir: Path, name: str, obj) -> None:
    """Replace `name` in a checkpoint and rewrite rank 0's manifest to match (as an attacker
    who can write the directory can)."""
    torch.save(obj, step_dir / name)
    manifest_path = step_dir / ckpt.manifest_file(0)
    manifest = json.loads(manifest_path.read_text())
    p = step_dir / name
    manifest[name] = {"bytes": p.stat().st_size, "sha256": ckpt._sha256(p)}
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("planted_file", [ckpt.OPTIMIZER_FILE, ckpt.rng_file(0)])
def test_a_planted_pickle_in_a_checkpoint_is_refused_and_never_runs(tmp_path, monkeypatch, planted_file):
    monkeypatch.chdir(ROOT)
    out, marker = tmp_path / "run", tmp_path / "code-ran"
    assert _run_small(out, "run.max_steps=1", "run.checkpoint_every=1") == 0
    step_dir = out / "checkpoints" / ckpt.step_dir_name(1)
    _plant(step_dir, planted_file, {"state": {}, "param_groups": [], "x": _Planted(marker)})
    assert ckpt.is_complete(step_dir)  # the manifest vouches for it: integrity is not origin

    rc, err = _cli([DEMO, f"run.output_dir={out}", *SMALL, "run.max_steps=2", "run.checkpoint_every=1"])
    line = _assert_one_line(rc, err, planted_file, "refused to load", "--fresh")
    assert "open" in line  # names what the pickle wanted to call
    assert not marker.exists()
    # the worker's own path refuses it the same way
    with pytest.raises(SpecError, match=re.escape(planted_file)):
        ckpt.load_plain(step_dir / planted_file)
    assert not marker.exists()


def test_restore_reads_plain_data_only(tmp_path):
    """`restore` itself (what a worker calls) refuses a planted optimizer state."""
    marker = tmp_path / "code-ran"
    spec = load_spec(DEMO, SMALL, files=False)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = {"step": 1, "tokens_seen": 0, "skipped_steps": 0, "world_size": 1, "resume_key": ckpt.resume_key(spec)}
    d = tmp_path / ckpt.step_dir_name(1)
    ckpt.write_rank_files(
        d,
        0,
        {
            ckpt.ADAPTER_FILE: dict(model.named_parameters()),
            ckpt.STATE_FILE: state,
            ckpt.OPTIMIZER_FILE: {"evil": _Planted(marker)},
            ckpt.rng_file(0): ckpt.rng_state(),
        },
    )
    assert ckpt.is_complete(d)
    with pytest.raises(SpecError, match="optimizer.pt: refused to load"):
        ckpt.restore(d, spec, 0, 1, model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
    assert not marker.exists()


def test_every_torch_load_in_the_project_reads_weights_only():
    calls = []
    for sub in ("jobs", "tune", "orchestrator", "bench"):
        for f in (ROOT / sub).rglob("*.py"):
            for m in re.finditer(r"torch\.load\(([^)]*)\)", f.read_text()):
                calls.append((f.relative_to(ROOT), m.group(1)))
    assert calls
    for where, args in calls:
        assert "weights_only=True" in args, (where, args)


def test_rng_state_round_trips_through_weights_only(tmp_path):
    import random

    before = ckpt.rng_state()
    torch.save(before, tmp_path / "rng.pt")
    expected = (random.random(), torch.rand(3))
    ckpt.set_rng_state(ckpt.load_plain(tmp_path / "rng.pt"))
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


# ---- 2. rayft writes only into a directory of its own ---------------------------------------


@pytest.fixture
def foreign(tmp_path) -> Path:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    (d / "summary.json").write_text('{"mine": true}')
    return d


def test_a_non_empty_directory_that_is_not_rayfts_is_refused(foreign, monkeypatch):
    monkeypatch.chdir(ROOT)
    for extra in ([], ["--fresh"]):
        rc, err = _cli([DEMO, f"run.output_dir={foreign}", *SMALL, *extra])
        _assert_one_line(rc, err, "run.output_dir=", "not empty and was not made by rayft", RUN_MARKER)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt", "summary.json"]
    assert (foreign / "summary.json").read_text() == '{"mine": true}'


@pytest.mark.parametrize(
    "where,fragment",
    [
        ("", "is empty"),
        ("/", "system directory"),
        ("/etc", "system directory"),
        ("/etc/rayft-out", "system directory"),
        ("/usr", "system directory"),
        ("/proc/self", "system directory"),
        ("HOME", "home directory"),
    ],
)
def test_empty_root_system_and_home_directories_are_refused(where, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    target = str(home) if where == "HOME" else where
    rc, err = _cli([DEMO, f"run.output_dir={target}", *SMALL])
    _assert_one_line(rc, err, "run.output_dir=", fragment)
    assert not (ROOT / RUN_MARKER).exists() and os.listdir(home) == []


def test_a_symlink_into_a_system_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    link = tmp_path / "looks-harmless"
    link.symlink_to("/etc")
    rc, err = _cli([DEMO, f"run.output_dir={link}", *SMALL])
    _assert_one_line(rc, err, "system directory", "/etc")


def test_new_empty_and_own_directories_are_claimed(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    new, empty = tmp_path / "a" / "new", tmp_path / "empty"
    empty.mkdir()
    for d in (new, empty):
        spec = prepare(DEMO, [f"run.output_dir={d}", *SMALL], fresh=False, local=True)
        assert spec.output_path == d.resolve() and (d / RUN_MARKER).is_file()
        (d / "metrics.jsonl").write_text("")
        prepare(DEMO, [f"run.output_dir={d}", *SMALL], fresh=True, local=True)  # its own: again, and --fresh
    # a run directory made before the marker existed holds only rayft's files: still rayft's
    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "events.jsonl").write_text('{"event": "start"}\n')
    (old / "metrics.jsonl").write_text("")
    prepare(DEMO, [f"run.output_dir={old}", *SMALL], fresh=False, local=True)
    assert (old / RUN_MARKER).is_file()


def test_the_loop_claims_its_directory_before_loading_the_model(foreign):
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    (foreign / "metrics.jsonl").write_text("not rayft's\n")
    spec = load_spec(DEMO, [f"run.output_dir={foreign}", *SMALL], files=False)
    with pytest.raises(SpecError, match="not made by rayft"):
        train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    assert (foreign / "metrics.jsonl").read_text() == "not rayft's\n"


# ---- 4. YAML: alias bombs, cycles, duplicate keys, depth --------------------------------------

BOMB = (
    "name: x\ndata:\n  path: examples/data/tiny.jsonl\na: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
)


@pytest.mark.parametrize(
    "text,fragment",
    [
        (BOMB, "aliases expand this value to more than"),
        ("name: x\ndata:\n  path: a.jsonl\nname: y\n", "line 4: duplicate key 'name' (first at line 1)"),
        (
            "name: x\ndata:\n  path: a.jsonl\n  max_seq_len: 8\n  max_seq_len: 9\n",
            "line 5: duplicate key 'max_seq_len'",
        ),
        ("name: x\ndata: &d\n  path: [*d]\n", "line 2: this value contains an alias to itself"),
        ("name: x\nrun:\n  env: " + "[" * 200 + "]" * 200 + "\n", "nested"),
        ("name: x\nrun:\n  env: " + "[" * 100_000 + "\n", "nested"),
    ],
)
def test_hostile_yaml_is_refused_quickly_with_file_and_line(tmp_path, text, fragment):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    t0 = time.perf_counter()
    rc, err = _cli([str(path), f"run.output_dir={tmp_path / 'out'}"])
    assert time.perf_counter() - t0 < 5
    _assert_one_line(rc, err, str(path), fragment)
    assert not (tmp_path / "out").exists()


def test_an_alias_bomb_in_an_override_is_refused(tmp_path):
    value = (
        "{a: &a [x,x,x,x,x,x,x,x,x], b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b],"
        " d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c], e: [*d,*d,*d,*d,*d,*d,*d,*d,*d]}"
    )
    rc, err = _cli([DEMO, f"run.output_dir={tmp_path / 'out'}", f"run.env={value}"])
    _assert_one_line(rc, err, "override run.env", "aliases expand")
    assert not (tmp_path / "out").exists()


def test_merge_keys_and_small_aliases_still_work(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(
        f"name: x\ndata:\n  path: {DATA}\nbatch: &b\n  global_batch_size: 8\n  micro_batch_size: 2\n"
        "lora:\n  target_modules: &t [q_proj, v_proj]\nrun:\n  env:\n    A: &v '1'\n    B: *v\n"
    )
    spec = load_spec(path)
    assert spec.lora.target_modules == ["q_proj", "v_proj"] and spec.run.env == {"A": "1", "B": "1"}


# ---- 5. non-finite numbers ------------------------------------------------------------------

FLOAT_FIELDS = [
    "optim.lr",
    "lora.alpha",
    "lora.dropout",
    "run.epochs",
    "optim.max_grad_norm",
    "optim.weight_decay",
    "optim.min_lr_ratio",
    "optim.momentum",
    "memory.budget_gib",
    "resources.cpus_per_worker",
    "data.eval_fraction",
]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_no_float_field_takes_nan_or_infinity(field, value):
    extra = ["run.max_steps=null"] if field == "run.epochs" else []
    with pytest.raises(SpecError) as e:
        load_spec(DEMO, [f"{field}={value}", *extra], files=False)
    assert f"{field}: " in str(e.value) and len(str(e.value).splitlines()) == 1
    with pytest.raises(SpecError, match="optim.betas"):
        load_spec(DEMO, [f"optim.betas=[0.9, {value}]"], files=False)


def test_a_diverging_run_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    # lr 1e30 is finite (the spec takes it) and blows the weights up within a few steps.
    rc, err = _cli(
        [
            DEMO,
            f"run.output_dir={out}",
            *SMALL,
            "optim.lr=1e30",
            "optim.warmup_steps=0",
            "optim.max_grad_norm=null",
            "run.max_steps=6",
            "run.checkpoint_every=1",
        ]
    )
    line = _assert_one_line(rc, err, "training diverged", "optimizer step", "optim.lr", exit_code=1)
    bad = int(re.search(r"optimizer step (\d+)", line).group(1))
    assert bad > 1, line  # the first step's loss is finite
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps[-1] == ckpt.step_dir_name(bad - 1) and ckpt.is_complete(out / "checkpoints" / steps[-1])
    assert str(out / "checkpoints" / steps[-1]) in line
    for text in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
        assert rec["step"] < bad


def test_an_fp16_scaler_skip_is_not_a_divergence():
    from jobs.train.loop import stop_if_not_finite

    spec = load_spec(DEMO, files=False)
    stop_if_not_finite(spec, 3, math.inf, math.nan, skipped=True)
    with pytest.raises(RunError, match="optimizer step 3: training diverged"):
        stop_if_not_finite(spec, 3, 2.0, math.inf, skipped=False)


def test_failure_lines_of_a_run_into_a_bucket_name_its_checkpoints_in_the_bucket(tmp_path, monkeypatch):
    """Over several nodes rank 0's staging directory holds only its own part of each checkpoint (it
    never verifies there) and the driver's may hold none: a divergence names the newest checkpoint
    in the bucket, and a lost node's line the bucket's URI, never "no checkpoint" or a staging path."""
    from jobs.launch.on_ray import resume_hint
    from jobs.train.loop import stop_if_not_finite

    monkeypatch.setenv("RAYFT_CACHE", str(tmp_path / "cache"))
    spec = load_spec(DEMO, ["run.output_dir=s3://bucket/runs/{name}"], files=False)
    for step in (1, 2):  # rank 0's part only, as on its node
        ckpt.write_rank_files(spec.output_path / "checkpoints" / ckpt.step_dir_name(step), 0, {"rank0.pt": {}})
    with pytest.raises(RunError) as e:
        stop_if_not_finite(spec, 3, math.nan, 1.0, skipped=False)
    assert f"the last good checkpoint is kept: s3://bucket/runs/{spec.name}/checkpoints/step-00000002" in str(e.value)
    hint = resume_hint(spec)
    assert f"run.output_dir=s3://bucket/runs/{spec.name} resumes from the newest" in hint, hint
    assert str(spec.output_path) not in hint


def test_a_divergence_on_a_ray_worker_comes_back_as_itself():
    """Ray wraps a worker's error (as an object it keeps, or only as text): unwrapped, a divergence
    is a RunError again (exit 1) and a bad data line a SpecError (exit 2), each with its one line."""
    from jobs.errors import worker_error

    class Wrapped(Exception):  # like Ray Train's WorkerGroupError
        def __init__(self, failures):
            super().__init__("Training failed")
            self.worker_failures = failures

    diverged = "optimizer step 3: training diverged (loss nan, grad norm nan); stopped"
    got = worker_error(Wrapped({0: RunError(diverged)}))
    assert type(got) is RunError and str(got) == diverged and got.exit_code == 1
    got = worker_error(RuntimeError(f"Traceback ...\n  File x\njobs.errors.RunError: {diverged}\n"))
    assert type(got) is RunError and str(got) == diverged
    got = worker_error(RuntimeError("ray.exceptions.RayTaskError: SpecError: data.path: line 3: not JSON"))
    assert type(got) is SpecError and str(got) == "data.path: line 3: not JSON" and got.exit_code == 2
    assert worker_error(RuntimeError("TrainRunError: not rayft's")) is None


def test_a_bad_rayft_fault_is_one_line_exit_1(tmp_path, monkeypatch):
    """RAYFT_FAULT is a test's or a drill's setting, not the user's input: a runtime failure."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("RAYFT_FAULT", "explode:step=1")
    rc, err = _cli([DEMO, f"run.output_dir={tmp_path / 'run'}", *SMALL, "run.max_steps=1"])
    _assert_one_line(rc, err, "RAYFT_FAULT: unknown fault 'explode'", exit_code=1)
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()  # refused before the first step


@pytest.mark.parametrize(
    "fault,says",
    [
        ("kill:step", "cannot parse"),
        ("kill:rank=1", "needs step=<int>"),
        ("oom:micro_batch_gt=two", "needs micro_batch_gt=<int>"),
        ("sleep:step=1,seconds=", "needs seconds=<float>"),
    ],
)
def test_every_bad_rayft_fault_is_refused_before_the_first_step(monkeypatch, fault, says):
    from jobs.train.faults import from_env

    monkeypatch.setenv("RAYFT_FAULT", f"oom:micro_batch_gt=2; {fault}")
    with pytest.raises(RunError, match=f"RAYFT_FAULT: .*{re.escape(says)}") as e:
        from_env()
    assert len(str(e.value).splitlines()) == 1


def test_a_sleep_fault_with_a_rank_stalls_that_rank_only_and_its_marker_names_the_process(monkeypatch, tmp_path):
    import os
    import time

    from jobs.train.faults import from_env

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    marker = tmp_path / "stalled"
    monkeypatch.setenv("RAYFT_FAULT", f"sleep:step=5,seconds=9,rank=1,once={marker}")
    faults = from_env()
    faults.at_step(4, 1, 2)
    faults.at_step(5, 0, 2)
    assert slept == [] and not marker.exists()  # another step, another rank: no stall
    faults.at_step(5, 1, 2)
    assert slept == [9.0] and marker.read_text() == f"slept at step 5: rank 1, pid {os.getpid()}\n"
    faults.at_step(5, 1, 2)
    assert slept == [9.0]  # once
    monkeypatch.setenv("RAYFT_FAULT", "sleep:step=5,seconds=2")
    everyone = from_env()
    for rank in (0, 1, 2):
        everyone.at_step(5, rank, 2)
    assert slept == [9.0, 2.0, 2.0, 2.0]  # without rank=, every rank stalls


def test_json_outputs_are_strict_non_finite_becomes_null(tmp_path):
    write_json_atomic(tmp_path / "s.json", {"a": math.nan, "b": [math.inf, 1.5], "c": {"d": -math.inf}})
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": None, "b": [None, 1.5], "c": {"d": None}}
    log = MetricsLog(tmp_path, 0)
    log.write(StepRecord.from_line(step_line(1, loss=math.nan, grad_norm=math.inf), "a test"))
    log.close()
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (written["loss"], written["grad_norm"]) == (None, None)
    assert strict_json({"x": 1.0}) == '{"x": 1.0}'


# ---- 7. one huge record costs what max_seq_len allows ---------------------------------------


class _Recording:
    """A tokenizer wrapper that remembers the longest text it was handed."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        texts = [text] if isinstance(text, str) else list(text)  # single or batched calls
        self.longest = max([self.longest, *(len(t) for t in texts)])
        return self.tok(text, **kw)

    def __len__(self):  # the vocabulary size (a cache entry's id bound): dunders skip __getattr__
        return len(self.tok)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_huge_record_is_cut_before_tokenization(tmp_path):
    from jobs.data import char_bound, load_dataset, read_jsonl, tokenize
    from jobs.model.loading import byte_tokenizer

    tok = byte_tokenizer()
    huge = "many words, " * 150_000  # 1.8 MB in one line
    path = tmp_path / "d.jsonl"
    normal = [{"text": f"short record number {i}"} for i in range(8)]
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [{"text": huge}, {"prompt": huge, "completion": "x"}, {"prompt": "q", "completion": huge}, *normal]
        )
        + "\n"
    )
    # A fresh output dir: the tokenized-data cache beside it is empty, so this load tokenizes.
    spec = load_spec(
        data={
            "name": "big",
            "data": {"path": str(path), "max_seq_len": 64},
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "run": {"output_dir": str(tmp_path / "out")},
        }
    )
    bound = char_bound(tok, 64)
    assert bound < 10_000
    recording = _Recording(tok)
    data = load_dataset(spec, recording)
    assert 0 < recording.longest <= bound
    assert all(len(v) <= bound for r in read_jsonl(str(path), max_chars=bound) for v in r.values())
    # The same examples as tokenizing everything whole, then truncating.
    records = read_jsonl(str(path))
    whole = []
    for rec in records:
        if "text" in rec:
            seq = [tok.bos_token_id] + tok(rec["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            labels = seq
        else:
            head = [tok.bos_token_id] + tok(rec["prompt"], add_special_tokens=False)["input_ids"]
            c = tok(rec["completion"], add_special_tokens=False)["input_ids"]
            seq, labels = head + c + [tok.eos_token_id], [-100] * len(head) + c + [tok.eos_token_id]
        seq, labels = seq[:64], labels[:64]
        if any(t != -100 for t in labels[1:]):
            whole.append((tuple(seq[:-1]), tuple(labels[1:])))
    assert [(e.input_ids, e.targets) for e in tokenize(records, tok, 64)] == whole
    assert [(e.input_ids, e.targets) for e in data.train + data.eval] == whole
    assert data.dropped == 1  # the prompt that fills max_seq_len leaves nothing to learn


def test_a_deeply_nested_or_oversized_record_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    for name, line in (
        ("deep", "[" * 100_000 + "]" * 100_000),
        ("deep-obj", '{"text": ' + "[" * 100_000),
        ("huge-int", '{"text": "a", "n": ' + "9" * 20_000 + "}"),
        ("surrogate", '{"text": "\\ud800"}'),
    ):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(line + "\n")
        out = tmp_path / f"out-{name}"
        rc, err = _cli([DEMO, f"data.path={path}", f"run.output_dir={out}", *SMALL])
        _assert_one_line(rc, err, "data.path", f"{name}.jsonl line 1")
        assert not out.exists()


# ---- 8. DNS-1123 names are matched whole ----------------------------------------------------


@pytest.mark.parametrize("name", ["ok\n", "ok\r\n", "\nok", "ok\u2028", "ok\x00"])
def test_a_name_with_a_line_break_is_not_dns_1123(name):
    with pytest.raises(SpecError) as e:
        validate({"name": name, "data": {"path": "x"}})
    assert "name: " in str(e.value) and len(str(e.value).splitlines()) == 1


# ---- 9. what used to end in a traceback ------------------------------------------------------


@pytest.fixture
def empty_dir(tmp_path) -> Path:
    d = tmp_path / "empty-model"
    d.mkdir()
    return d


TRACEBACK_CASES = [
    (["optim.betas=[5,-3]"], "optim.betas: betas[0]=5.0 must be in [0, 1)"),
    (["run.seed=1e26"], "run.seed"),
    (["run.seed=100000000000000000000000000"], "run.seed: Input should be less than or equal to 4294967295"),
    (["run.epochs=.inf", "run.max_steps=null"], "run.epochs: Input should be a finite number"),
    (["lora.r=1e8"], "lora.r"),
    (["lora.r=100000000"], "lora.r: Input should be less than or equal to"),
    (["lora.r=128"], "lora.r=128 exceeds the model's hidden size 64"),
    (["model.name=EMPTY"], "holds no model (no config.json"),
    (["model.name=pkg:json"], "model.name: pkg:json"),
    (["model.name=pkg:os.path"], "is not a package name"),
    (["optim.lr=.inf"], "optim.lr: Input should be a finite number"),
    (["lora.alpha=.inf"], "lora.alpha: Input should be a finite number"),
    (["run.env=!!set {a, b}"], "run.env: Input should be a valid dictionary"),
    (["name=2024-01-01T10:00:00"], "name: '2024-01-01T10:00:00' is not a DNS-1123 label"),
    (["batch.global_batch_size=1000000000000"], "fewer than batch.global_batch_size=1000000000000"),
]


@pytest.mark.parametrize("overrides,fragment", TRACEBACK_CASES, ids=[c[0][0] for c in TRACEBACK_CASES])
def test_former_tracebacks_are_one_line_exit_2_nothing_created(overrides, fragment, empty_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    overrides = [o.replace("EMPTY", str(empty_dir)) for o in overrides]
    rc, err = _cli([DEMO, f"run.output_dir={out}", *SMALL, *overrides])
    _assert_one_line(rc, err, fragment)
    assert not out.exists()


def test_former_tracebacks_through_the_rayft_cli(tmp_path, monkeypatch, capsys):
    """The same, through `rayft` itself (its `run` and `spec check`)."""
    cli = pytest.importorskip("orchestrator.cli")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    for overrides, fragment in TRACEBACK_CASES:
        if "EMPTY" in " ".join(overrides):
            continue
        for cmd in (["run", DEMO, "--local"], ["spec", "check", DEMO]):
            if cmd[0] == "spec" and ("hidden size" in fragment or "fewer than" in fragment):
                continue  # checked when preparing a run (they need the data or the model's config)
            rc = cli.main([*cmd, f"run.output_dir={out}", *SMALL, *overrides])
            _assert_one_line(rc, capsys.readouterr().err, fragment)
            assert not out.exists()


# ---- 10. corrupt checkpoints, odd data paths, --local with several workers -------------------


def _fake_checkpoint(root: Path, step: int) -> Path:
    d = root / ckpt.step_dir_name(step)
    ckpt.write_rank_files(d, 0, {ckpt.rng_file(0): ckpt.rng_state(), ckpt.STATE_FILE: {"step": step, "world_size": 1}})
    return d


def test_a_corrupt_checkpoint_is_named_and_all_corrupt_is_refused(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    assert _run_small(out, "run.max_steps=1", "run.checkpoint_every=1") == 0
    root = out / "checkpoints"
    torn = _fake_checkpoint(root, 5)
    (torn / ckpt.rng_file(0)).write_bytes(b"torn")
    with caplog.at_level(logging.WARNING, logger="rayft"):
        assert ckpt.resumable(root) == root / ckpt.step_dir_name(1)
    assert f"skipping checkpoint {torn}" in caplog.text and "does not match" in caplog.text
    good = root / ckpt.step_dir_name(1)
    (good / ckpt.ADAPTER_FILE).write_bytes(b"torn too")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rayft"):
        rc, err = _cli([DEMO, f"run.output_dir={out}", *SMALL, "run.max_steps=2"])
    assert caplog.text.count("skipping checkpoint") == 2  # a warning names each one ...
    err = "\n".join(line for line in err.splitlines() if "skipping checkpoint" not in line)
    _assert_one_line(rc, err, "all 2 checkpoints are incomplete or corrupt", "--fresh")  # ... then one error
    spec = prepare(DEMO, [f"run.output_dir={out}", *SMALL, "run.max_steps=2"], fresh=True, local=True)
    assert not (spec.output_path / "checkpoints").exists() and list(out.glob("checkpoints.set-aside-*"))


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_data_path_that_is_not_a_file_says_what_it_is(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "data.jsonl"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    rc, err = _cli([DEMO, f"data.path={path}", f"run.output_dir={tmp_path / 'out'}", *SMALL])
    _assert_one_line(rc, err, "data.path", "is a directory" if kind == "directory" else "is a FIFO (named pipe)")
    rc, err = _cli([DEMO, f"data.eval_path={path}", f"run.output_dir={tmp_path / 'out'}", *SMALL[:-1]])
    _assert_one_line(rc, err, "data.eval_path")
    assert not (tmp_path / "out").exists()


def test_local_with_several_workers_is_refused_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "out"
    rc, err = _cli([DEMO, f"run.output_dir={out}"])  # the shipped example: 2 workers
    _assert_one_line(rc, err, "resources.num_workers=2 with --local", "torchrun", "resources.num_workers=1")
    assert not out.exists()
    monkeypatch.setenv("WORLD_SIZE", "3")
    rc, err = _cli([DEMO, f"run.output_dir={out}"])
    _assert_one_line(rc, err, "WORLD_SIZE=3")
    # a caller that prepared without --local is still stopped before the model loads
    from jobs.finetune import run

    monkeypatch.delenv("WORLD_SIZE")
    spec = absolutize(load_spec(DEMO, [f"run.output_dir={out}"]))
    with pytest.raises(SpecError, match="torchrun"):
        run(spec, local=True)


def test_local_with_a_separate_vllm_engine_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """Without Ray nothing places an engine on resources of its own: `--local` refuses
    `rollout.vllm_placement: separate` in one line, exit 2, before the model loads or anything is
    written (the same spec colocated gets past this check)."""
    from grpo_rollouts import save_tiny_base

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base, out = save_tiny_base(tmp_path / "base"), tmp_path / "out"
    grpo = [str(ROOT / "examples" / "tiny-grpo.yaml"), f"model.name={base}", "rollout.engine=vllm"]
    grpo += ["resources.num_workers=1"]
    rc, err = _cli([*grpo, "rollout.vllm_placement=separate", f"run.output_dir={out}"])
    _assert_one_line(rc, err, "rollout.vllm_placement=separate with --local", "run on Ray")
    assert not out.exists()
    from jobs.finetune import check_local_workers

    check_local_workers(absolutize(load_spec(grpo[0], [*grpo[1:], f"run.output_dir={out}"])), local=True)
