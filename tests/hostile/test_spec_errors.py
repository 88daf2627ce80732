"""Every malformed spec or override: one line naming the field and the reason, exit code 2,
no traceback, nothing created in run.output_dir. Run through the real CLI entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from gradtools import DATA, ROOT

from orchestrator.cli import main

BASE = {
    "name": "bad-spec",
    "data": {"path": str(DATA)},
    "batch": {"global_batch_size": 8, "micro_batch_size": 2},
    "run": {"max_steps": 1},
}

# (id, change to BASE as {dotted.key: value} or None to delete, expected fragment of the message)
SPEC_CASES = [
    ("unknown-top-key", {"foo": 1}, "foo: unknown key"),
    ("unknown-section-key", {"batch.foo": 1}, "batch.foo: unknown key"),
    ("missing-name", {"name": None}, "name: required key is missing"),
    ("missing-data", {"data": None}, "data: required key is missing"),
    ("missing-data-path", {"data.path": None}, "data.path: required key is missing"),
    ("data-file-missing", {"data.path": "nope/none.jsonl"}, "data.path: file not found: nope/none.jsonl"),
    ("data-path-empty-list", {"data.path": []}, "data.path: must name at least one JSONL file"),
    ("second-data-file-missing", {"data.path": [str(DATA), "gone.jsonl"]}, "data.path.1: file not found"),
    ("eval-file-missing", {"data.eval_path": "gone.jsonl"}, "data.eval_path: file not found"),
    ("name-uppercase", {"name": "Bad"}, "name: 'Bad' is not a DNS-1123 label"),
    ("name-underscore", {"name": "a_b"}, "is not a DNS-1123 label"),
    ("name-too-long", {"name": "a" * 64}, "is not a DNS-1123 label"),
    ("name-trailing-dash", {"name": "job-"}, "is not a DNS-1123 label"),
    ("name-number", {"name": 5}, "name: Input should be a valid string"),
    (
        "not-divisible",
        {"batch.global_batch_size": 30, "batch.micro_batch_size": 4, "resources.num_workers": 2},
        "batch.global_batch_size=30 is not divisible by batch.micro_batch_size=4 x resources.num_workers=2 = 8",
    ),
    (
        "accum-disagrees",
        {
            "batch.global_batch_size": 32,
            "batch.micro_batch_size": 4,
            "resources.num_workers": 2,
            "batch.grad_accum_steps": 3,
        },
        "batch.grad_accum_steps=3 disagrees with batch.global_batch_size / (batch.micro_batch_size x "
        "resources.num_workers) = 32 / (4 x 2) = 4",
    ),
    ("micro-zero", {"batch.micro_batch_size": 0}, "batch.micro_batch_size: Input should be greater than 0"),
    ("global-negative", {"batch.global_batch_size": -8}, "batch.global_batch_size: Input should be greater than 0"),
    ("global-string", {"batch.global_batch_size": "many"}, "batch.global_batch_size: Input should be a valid integer"),
    ("global-float", {"batch.global_batch_size": 8.5}, "batch.global_batch_size: Input should be a valid integer"),
    ("accum-zero", {"batch.grad_accum_steps": 0}, "batch.grad_accum_steps: Input should be greater than 0"),
    ("lr-zero", {"optim.lr": 0}, "optim.lr: Input should be greater than 0"),
    ("lr-negative", {"optim.lr": -1e-4}, "optim.lr: Input should be greater than 0"),
    ("lr-string", {"optim.lr": "fast"}, "optim.lr: Input should be a valid number"),
    ("optim-name", {"optim.name": "adam"}, "optim.name: Input should be 'adamw' or 'sgd'"),
    ("lr-scaling", {"optim.lr_scaling": "cubic"}, "optim.lr_scaling: Input should be 'none', 'linear' or 'sqrt'"),
    ("schedule", {"optim.schedule": "linear"}, "optim.schedule: Input should be 'cosine' or 'constant'"),
    ("warmup-negative", {"optim.warmup_steps": -1}, "optim.warmup_steps: Input should be greater than or equal to 0"),
    ("betas-short", {"optim.betas": [0.9]}, "optim.betas"),
    ("grad-norm-negative", {"optim.max_grad_norm": -1}, "optim.max_grad_norm: Input should be greater than or equal"),
    ("reference-batch-zero", {"optim.reference_batch_size": 0}, "optim.reference_batch_size: Input should be greater"),
    ("momentum-one", {"optim.momentum": 1.0}, "optim.momentum: Input should be less than 1"),
    ("precision", {"precision": "fp8"}, "precision: Input should be 'auto', 'bf16', 'fp16' or 'fp32'"),
    (
        "gc-maybe",
        {"memory.gradient_checkpointing": "maybe"},
        "memory.gradient_checkpointing: must be true, false or auto",
    ),
    ("budget-zero", {"memory.budget_gib": 0}, "memory.budget_gib: Input should be greater than 0"),
    ("workers-zero", {"resources.num_workers": 0}, "resources.num_workers: Input should be greater than 0"),
    ("workers-fraction", {"resources.num_workers": 1.5}, "resources.num_workers: Input should be a valid integer"),
    ("use-gpu-maybe", {"resources.use_gpu": "maybe"}, "resources.use_gpu: Input should be a valid boolean"),
    ("cpus-zero", {"resources.cpus_per_worker": 0}, "resources.cpus_per_worker: Input should be greater than 0"),
    ("max-steps-zero", {"run.max_steps": 0}, "run.max_steps: Input should be greater than 0"),
    ("steps-and-epochs", {"run.epochs": 2}, "run: give run.max_steps or run.epochs, not both"),
    ("epochs-negative", {"run.max_steps": None, "run.epochs": -1}, "run.epochs: Input should be greater than 0"),
    (
        "checkpoint-every-negative",
        {"run.checkpoint_every": -1},
        "run.checkpoint_every: Input should be greater than or equal",
    ),
    ("keep-zero", {"run.keep_checkpoints": 0}, "run.keep_checkpoints: Input should be greater than 0"),
    ("seed-string", {"run.seed": "lucky"}, "run.seed: Input should be a valid integer"),
    ("max-failures-negative", {"run.max_failures": -1}, "run.max_failures: Input should be greater than or equal"),
    ("lora-r-zero", {"lora.r": 0}, "lora.r: Input should be greater than 0"),
    ("lora-dropout", {"lora.dropout": 1.5}, "lora.dropout: Input should be less than 1"),
    ("lora-targets-empty", {"lora.target_modules": []}, "lora.target_modules: must name at least one module"),
    ("lora-targets-string", {"lora.target_modules": "q_proj"}, "lora.target_modules: Input should be a valid list"),
    ("max-seq-len-one", {"data.max_seq_len": 1}, "data.max_seq_len: Input should be greater than 1"),
    ("eval-fraction-one", {"data.eval_fraction": 1.0}, "data.eval_fraction: Input should be less than 1"),
    ("token-value-not-name", {"model.hf_token_env": "hf_AbCdEf-123"}, "model.hf_token_env: must be the NAME"),
    (
        "attn-impl",
        {"model.attn_implementation": "flash"},
        "model.attn_implementation: Input should be 'sdpa', 'eager' or 'flex_attention'",
    ),
    ("model-name-empty", {"model.name": " "}, "model.name: must not be empty"),
    ("model-dir-missing", {"model.name": "./no-such-model"}, "model.name: directory not found"),
    (
        "gguf-missing",
        {"model.name": str(ROOT / "examples"), "model.gguf_file": "none.gguf"},
        "model.gguf_file: file not found",
    ),
    ("section-is-list", {"data": ["a"]}, "data: Input should be a valid dictionary"),
    ("section-is-scalar", {"batch": 5}, "batch: Input should be a valid dictionary"),
]

# (id, overrides, expected fragment)
OVERRIDE_CASES = [
    ("no-equals", ["batch.micro_batch_size"], "override 'batch.micro_batch_size': expected section.field=value"),
    ("empty-segment", ["batch..x=1"], "is not a field path like section.field"),
    ("unknown-field", ["batch.micro=2"], "batch.micro: unknown key"),
    ("unknown-section", ["foo.bar=1"], "foo: unknown key"),
    ("wrong-type", ["batch.micro_batch_size=two"], "batch.micro_batch_size: Input should be a valid integer"),
    ("into-scalar", ["name.x=1"], "override 'name.x=1': name is not a section"),
    ("bad-enum", ["optim.name=lion"], "optim.name: Input should be 'adamw' or 'sgd'"),
    ("lr-zero", ["optim.lr=0"], "optim.lr: Input should be greater than 0"),
    ("breaks-divisibility", ["resources.num_workers=3"], "is not divisible by"),
]

# (id, file content, expected fragment)
FILE_CASES = [
    ("yaml-does-not-parse", "name: [unclosed\n", "not valid YAML at line"),
    ("yaml-is-a-list", "- a\n- b\n", "the spec must be a YAML mapping of sections, got list"),
    ("yaml-is-a-string", "just words\n", "the spec must be a YAML mapping of sections, got str"),
    ("yaml-empty", "", "the spec must be a YAML mapping of sections, got NoneType"),
    ("yaml-tab-indent", "name: x\ndata:\n\tpath: y\n", "not valid YAML"),
]

# (id, JSONL content, expected fragment) -- found by the pre-flight check, before anything starts
DATA_CASES = [
    ("jsonl-not-json", "{oops\n", "line 1: not valid JSON"),
    ("jsonl-wrong-shape", '{"input": "x"}\n', 'line 1: expected {"text"'),
    ("jsonl-empty", "\n", "no records"),
]


def _set(d: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    if value is None:
        d.pop(parts[-1], None)
    else:
        d[parts[-1]] = value


def _run(capsys, args: list[str]) -> tuple[int, str]:
    rc = main(args)
    err = capsys.readouterr().err
    return rc, err


def _assert_refused(rc: int, err: str, fragment: str, out: Path) -> None:
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("rayft: error: ")
    assert fragment in lines[0], lines[0]
    assert not out.exists(), "nothing may be created for a refused spec"


# Every command that reads a job spec, with what it needs besides the spec to get that far.
SPEC_COMMANDS = [
    (["run"], []),
    (["spec", "check"], []),
    (["estimate"], []),
    (["k8s", "render"], ["--overlay", "dev-cpu"]),
    (["submit"], ["--dry-run", "--address", "http://127.0.0.1:1"]),
    (["queue", "add"], ["--db", "{tmp}/q.db"]),
]
SHARED_CASES = ["unknown-section-key", "not-divisible", "lr-zero", "name-uppercase", "token-value-not-name"]


@pytest.mark.parametrize("case", SHARED_CASES)
def test_every_command_that_reads_a_spec_refuses_it_the_same_way(tmp_path, capsys, case):
    """The same mistake, through every command: exit 2, one line naming the field, nothing created.
    The spec lives inside the project (submit and the queue refuse specs outside it first)."""
    change, fragment = next(c[1:] for c in SPEC_CASES if c[0] == case)
    spec = yaml.safe_load(yaml.safe_dump(BASE))
    spec.setdefault("run", {})["output_dir"] = str(tmp_path / "out")
    for k, v in change.items():
        _set(spec, k, v)
    where = ROOT / "outputs" / "test-spec-errors"
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{case}-{tmp_path.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    try:
        for words, extra in SPEC_COMMANDS:
            rc, err = _run(capsys, [*words, str(path), *[e.format(tmp=tmp_path) for e in extra]])
            _assert_refused(rc, err, fragment, tmp_path / "out")
        from orchestrator.queue.store import Queue

        assert Queue(tmp_path / "q.db").jobs() == []  # nothing queued
    finally:
        path.unlink()


@pytest.mark.parametrize("change,fragment", [c[1:] for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES])
def test_bad_spec_is_refused(tmp_path, capsys, change, fragment):
    spec = yaml.safe_load(yaml.safe_dump(BASE))
    spec.setdefault("run", {})["output_dir"] = str(tmp_path / "out")
    for k, v in change.items():
        if k in ("data", "batch") and not isinstance(v, dict) and v is not None:
            spec[k] = v
        else:
            _set(spec, k, v)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    rc, err = _run(capsys, ["run", str(path)])
    _assert_refused(rc, err, fragment, tmp_path / "out")
    assert str(path) in err  # says where


@pytest.mark.parametrize("overrides,fragment", [c[1:] for c in OVERRIDE_CASES], ids=[c[0] for c in OVERRIDE_CASES])
def test_bad_override_is_refused(tmp_path, capsys, overrides, fragment):
    spec = dict(BASE, run={"max_steps": 1, "output_dir": str(tmp_path / "out")})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    rc, err = _run(capsys, ["run", str(path), *overrides])
    _assert_refused(rc, err, fragment, tmp_path / "out")


@pytest.mark.parametrize("content,fragment", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_bad_spec_file_is_refused(tmp_path, capsys, content, fragment):
    path = tmp_path / "spec.yaml"
    path.write_text(content)
    rc, err = _run(capsys, ["run", str(path)])
    _assert_refused(rc, err, fragment, tmp_path / "out")


@pytest.mark.parametrize("content,fragment", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_bad_data_file_is_refused_before_start(tmp_path, capsys, content, fragment):
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    spec = dict(BASE, data={"path": str(data)}, run={"max_steps": 1, "output_dir": str(tmp_path / "out")})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    rc, err = _run(capsys, ["run", str(path)])
    _assert_refused(rc, err, fragment, tmp_path / "out")
    assert "data.path" in err and "d.jsonl" in err


def test_missing_spec_file_and_bad_cli_arguments(tmp_path, capsys):
    rc, err = _run(capsys, ["run", str(tmp_path / "absent.yaml")])
    _assert_refused(rc, err, "spec file not found", tmp_path / "out")
    with pytest.raises(SystemExit) as e:
        main(["run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "required" in err


def test_real_console_script_refuses_with_one_line(tmp_path):
    """The installed `rayft` script, in a fresh process: exit 2, one line, no traceback."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(dict(BASE, optim={"lr": 0}, run={"output_dir": str(tmp_path / "out")})))
    rayft = Path(sys.executable).parent / "rayft"
    p = subprocess.run([str(rayft), "run", str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"rayft: error: {path}: optim.lr: Input should be greater than 0 (got 0)"]
    assert not (tmp_path / "out").exists()


def test_schema_has_a_description_for_every_field(capsys):
    import json

    assert main(["spec", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    missing = []
    for name, definition in schema["$defs"].items():
        for field, prop in definition.get("properties", {}).items():
            if not prop.get("description"):
                missing.append(f"{name}.{field}")
    for field, prop in schema["properties"].items():
        if not prop.get("description") and "$ref" not in prop:
            missing.append(field)
    assert not missing, missing


@pytest.mark.parametrize(
    ("key", "uri", "why"),
    [
        *[("data.cache_dir", u, "is a URI") for u in ("s3://bucket/run", "gs://bucket/run", "file:///tmp/run")],
        ("data.cache_dir", "hdfs://nn:8020/x", "is a URI"),
        # run.output_dir takes s3:// and gs:// (tests/integration/test_object_storage.py), no other scheme
        ("run.output_dir", "file:///tmp/run", "is not a local path, s3://bucket/prefix or gs://bucket/prefix"),
        ("run.output_dir", "hdfs://nn:8020/x", "is not a local path, s3://bucket/prefix or gs://bucket/prefix"),
        ("run.output_dir", "s3://Not_A_Bucket/run", "is not a valid s3:// or gs:// location"),
        ("run.output_dir", "s3://bucket/../run", "is not a valid s3:// or gs:// location"),
    ],
)
def test_a_uri_where_rayft_writes_is_refused_not_made_a_local_directory(tmp_path, capsys, monkeypatch, key, uri, why):
    """A `scheme://` cache directory, or an output directory that is not an S3 or GCS bucket, is
    refused in one line before anything starts, instead of a run written into a local directory
    named after the scheme (`s3:/bucket/run`), which exited 0 having saved nowhere the user looks."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(dict(BASE, run={"max_steps": 1, "output_dir": str(tmp_path / "out")})))
    rc, err = _run(capsys, ["run", str(path), f"{key}={uri}"])
    _assert_refused(rc, err, f"{key}: {uri} {why}", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]
