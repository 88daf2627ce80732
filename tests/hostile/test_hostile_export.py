"""Damaged run, adapter and export directories, and `rayft generate`'s own arguments: each is one
line, exit 2, before a byte of weights is allocated, and nothing is written (`jobs.model.adapter_check`)."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from inproc import rayft_in_process

from jobs.spec import absolutize, load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
DEMO = "examples/tiny-lora.yaml"
SMALL = [
    "resources.num_workers=1",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "memory.gradient_checkpointing=false",
    "run.max_steps=1",
    "lora.r=4",
    "lora.alpha=8",
    "data.max_seq_len=64",
    "run.eval_every=0",
    "data.eval_path=null",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile-export") / "run"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        spec = absolutize(load_spec(DEMO, SMALL + [f"run.output_dir={out}"]))
        train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    finally:
        os.chdir(cwd)
    return out


def _one_line(r, *fragments: str, code: int = 2) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run (its adapter pointing at the original's saved base)."""
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst, ignore=shutil.ignore_patterns("checkpoints"))
    return dst


def _edit(adapter: Path, **changes) -> None:
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def _both(run: Path, tmp_path: Path, *fragments: str) -> None:
    """`rayft export RUN --to T` and `rayft generate RUN/adapter PROMPT` both refuse; T is not made."""
    target = tmp_path / "exported"
    for args in (["export", str(run), "--merge", "--to", str(target)], ["generate", str(run / "adapter"), "hi"]):
        r = rayft_in_process(*args)
        _one_line(r, *fragments)
        assert r.stdout == ""
    assert not target.exists() and not list(tmp_path.glob("exported.tmp-*"))


CONFIG_DAMAGE = [
    pytest.param({"r": 0}, ("adapter_config.json", "r=0", "LoRA rank"), id="r-zero"),
    pytest.param(
        {"r": True},
        (
            "adapter_config.json",
            "r=True",
        ),
        id="r-bool",
    ),
    pytest.param(
        {"r": "8"},
        (
            "adapter_config.json",
            "r=8",
        ),
        id="r-string",
    ),
    pytest.param({"r": 60000}, ("adapter_config.json", "r=60000", "hidden size"), id="r-huge"),
    pytest.param(
        {"r": 10**12},
        (
            "adapter_config.json",
            "LoRA rank",
        ),
        id="r-absurd",
    ),
    pytest.param({"r": 8}, ("adapter_model.safetensors", "shape", "r=8"), id="r-disagrees-with-weights"),
    pytest.param(
        {"lora_alpha": float("nan")},
        (
            "adapter_config.json",
            "lora_alpha",
        ),
        id="alpha-nan",
    ),
    pytest.param(
        {"target_modules": ["no_such_proj"]}, ("adapter_config.json", "no_such_proj", "no layer"), id="unknown-target"
    ),
    pytest.param(
        {"target_modules": []},
        (
            "adapter_config.json",
            "target_modules",
        ),
        id="no-targets",
    ),
    pytest.param(
        {"base_model_name_or_path": "../../../../etc"},
        (
            "adapter_config.json",
            "'..'",
        ),
        id="base-traversal",
    ),
    pytest.param(
        {"base_model_name_or_path": "/etc"},
        (
            "adapter_config.json",
            "system directory",
        ),
        id="base-system-dir",
    ),
    pytest.param(
        {"base_model_name_or_path": "/nonexistent/model"},
        (
            "adapter_config.json",
            "not a model directory",
        ),
        id="base-absent",
    ),
    pytest.param(
        {"base_model_name_or_path": "a b c"},
        (
            "adapter_config.json",
            "neither a model directory nor a hub id",
        ),
        id="base-garbage",
    ),
    pytest.param(
        {"base_model_name_or_path": None},
        (
            "adapter_config.json",
            "base_model_name_or_path",
        ),
        id="base-missing",
    ),
    pytest.param(
        {"peft_type": "IA3"},
        (
            "adapter_config.json",
            "peft_type",
        ),
        id="not-lora",
    ),
]


@pytest.mark.parametrize("changes,fragments", CONFIG_DAMAGE)
def test_a_tampered_adapter_config_is_refused_before_loading(run_dir, tmp_path, changes, fragments):
    run = _copy(run_dir, tmp_path)
    _edit(run / "adapter", **changes)
    _both(run, tmp_path, *fragments)


@pytest.mark.parametrize(
    "content,fragment",
    [
        (b"{not json", "is not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        (b"", "is not JSON"),
    ],
    ids=["broken", "a-list", "binary", "empty"],
)
def test_an_adapter_config_that_is_not_json_is_one_line(run_dir, tmp_path, content, fragment):
    run = _copy(run_dir, tmp_path)
    (run / "adapter" / "adapter_config.json").write_bytes(content)
    _both(run, tmp_path, "adapter_config.json", fragment)


def test_an_adapter_config_fifo_does_not_block(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path)
    cfg = run / "adapter" / "adapter_config.json"
    cfg.unlink()
    os.mkfifo(cfg)
    r = rayft_in_process("generate", str(run / "adapter"), "hi")
    _one_line(r, "adapter_config.json")


@pytest.mark.parametrize(
    "damage,fragment",
    [
        (lambda b: b[:5], "shorter than its header"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], "header of"),
        (lambda b: b[:8] + b"x" * (len(b) - 8), "not JSON"),
    ],
    ids=["truncated", "header-too-long", "header-garbage"],
)
def test_damaged_adapter_weights_are_one_line(run_dir, tmp_path, damage, fragment):
    run = _copy(run_dir, tmp_path)
    w = run / "adapter" / "adapter_model.safetensors"
    w.write_bytes(damage(w.read_bytes()))
    _both(run, tmp_path, "adapter_model.safetensors", fragment)


@pytest.fixture(scope="module")
def merged(run_dir, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("hostile-merged") / "merged"
    r = rayft_in_process("export", str(run_dir), "--merge", "--to", str(target))
    assert r.returncode == 0, r.stderr
    return target


@pytest.mark.parametrize(
    "edit,fragment",
    [
        (lambda c: {**c, "hidden_size": 4096}, "shape"),
        (lambda c: {**c, "hidden_size": 10**9}, "hidden_size"),
        (lambda c: {**c, "num_hidden_layers": True}, "num_hidden_layers"),
        (lambda c: {**c, "model_type": "no-such-model"}, "not a model config"),
    ],
    ids=["wider-than-weights", "absurd", "bool", "unknown-type"],
)
def test_a_tampered_merged_export_is_refused_before_loading(merged, tmp_path, edit, fragment):
    m = tmp_path / "merged"
    shutil.copytree(merged, m)
    cfg = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps(edit(cfg)))
    r = rayft_in_process("generate", str(m), "hi")
    _one_line(r, "config.json", fragment)
    assert r.stdout == ""


def test_a_merged_export_with_a_broken_config_is_one_line(merged, tmp_path):
    m = tmp_path / "merged"
    shutil.copytree(merged, m)
    (m / "config.json").write_text("{")
    _one_line(rayft_in_process("generate", str(m), "hi"), "config.json", "not JSON")


# ---- rayft generate's own arguments ---------------------------------------------------------


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--temperature", "nan"], "--temperature nan"),
        (["--temperature", "inf"], "--temperature inf"),
        (["--temperature", "-1"], "--temperature -1"),
        (["--temperature", "1e9"], "--temperature 1000000000"),
        (["--seed", str(2**64)], "--seed"),
        (["--seed", "-1"], "--seed"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--max-new-tokens", str(10**12)], "--max-new-tokens"),
    ],
)
def test_generate_arguments_are_checked_before_the_model_loads(tmp_path, args, fragment):
    r = rayft_in_process("generate", str(tmp_path / "nothing-here"), "hi", *args)
    _one_line(r, fragment)
    assert r.stdout == ""


def test_an_undecodable_prompt_argument_is_named(tmp_path):
    r = rayft_in_process("generate", str(tmp_path / "nothing-here"), "bad \udcff byte")
    _one_line(r, "prompt", "UTF-8")


def test_undecodable_stdin_is_named_with_its_line(run_dir, monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"first prompt\n\xff\xfe not text\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    r = rayft_in_process("generate", str(run_dir), "--max-new-tokens", "2")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("rayft: error: stdin: line 2 is not UTF-8 text (byte 0xff)"), r.stderr


def _drop_tensors(weights: Path, keep) -> list[str]:
    """Rewrite the safetensors file `weights` with only the tensors `keep(key)` accepts; the dropped keys."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if keep(k)}, str(weights))
    return [k for k in tensors if not keep(k)]


@pytest.mark.parametrize("part", ["lora_A", "lora_B"])
def test_an_adapter_missing_one_layers_a_or_b_is_one_line(run_dir, tmp_path, part):
    """PEFT loads an adapter without one layer's B (or A) with that tensor at its fresh init (a
    zero B: the layer silently unadapted): export and generate refuse it, naming the layer."""
    run = _copy(run_dir, tmp_path)
    weights = run / "adapter" / "adapter_model.safetensors"
    first = sorted(k for k in _safetensor_keys(weights) if f".{part}." in k)[0]
    assert _drop_tensors(weights, lambda k: k != first) == [first]
    layer = first.split(f".{part}.")[0].removeprefix("base_model.model.")
    _both(run, tmp_path, f"holds no LoRA {part[-1]} of layer", layer)


def test_an_adapter_of_some_layers_by_layers_to_transform_is_complete(run_dir, tmp_path):
    """`layers_to_transform` narrows what PEFT adapts: an adapter of layer 0 only, saying so, exports."""
    run = _copy(run_dir, tmp_path)
    adapter = run / "adapter"
    _drop_tensors(adapter / "adapter_model.safetensors", lambda k: ".layers.0." in k)
    _edit(adapter, layers_to_transform=[0])
    r = rayft_in_process("export", str(run), "--to", str(tmp_path / "exported"))
    assert r.returncode == 0, r.stderr


def _safetensor_keys(weights: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        return list(f.keys())


def _hub_cache(root: Path, hub_id: str, config: dict) -> None:
    """A local Hugging Face cache holding `hub_id`'s config.json (its layout: refs/main -> snapshot)."""
    repo = root / f"models--{hub_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))


def test_a_hub_base_is_checked_wherever_its_config_is_cached(run_dir, tmp_path, monkeypatch):
    """An adapter whose base is a hub id was trusted until the download: where that base's config is
    in the local cache, an adapter of another shape is refused before anything loads."""
    from huggingface_hub import constants

    from jobs.model.adapter_check import check_adapter

    run = _copy(run_dir, tmp_path)
    adapter = run / "adapter"
    base_dir = Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    config = json.loads((base_dir / "config.json").read_text())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _hub_cache(tmp_path / "hub", "rayft-test/same", config)
    _hub_cache(tmp_path / "hub", "rayft-test/wider", {**config, "hidden_size": config["hidden_size"] * 2})
    _edit(adapter, base_model_name_or_path="rayft-test/same")
    assert check_adapter(adapter) == "rayft-test/same"
    _edit(adapter, base_model_name_or_path="rayft-test/wider")
    r = rayft_in_process("export", str(run), "--merge", "--to", str(tmp_path / "exported"))
    _one_line(r, "adapter_model.safetensors", "shape")
    assert not (tmp_path / "exported").exists()
