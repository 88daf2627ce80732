"""The training loop end to end: loss curves independent of the split, outputs, the real CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gradtools import ROOT, final_adapter, rel_err, tiny_spec
from runs import metric_lines

from jobs.run.checkpoint import load_adapter
from jobs.spec import load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train

# What `make demo`'s console may show: rayft's lines, nothing else (no Ray token-auth notice, no
# Ray-internal error lines, no library notices about code the run does not use).
DEMO_CONSOLE = [
    re.compile(r"^step \d+/\d+ loss "),  # the progress line per step (no terminal: one line each)
    re.compile(r"^\(RayTrainWorker pid=\d+\) job tiny-lora: \d+ steps, global batch "),
    re.compile(r"^\s*rayft run tiny-lora\s*$|^[┌│├└]"),  # the summary table
]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def unexpected_console_lines(text: str) -> list[str]:
    lines = (ANSI.sub("", line) for line in text.splitlines())
    return [line for line in lines if line.strip() and not any(p.search(line) for p in DEMO_CONSOLE)]


def _as_a_user_runs_it(tmp: Path) -> dict:
    """The environment of a user's shell: no RAY_AUTH_MODE (the tests set it for their own Ray
    clients; Ray prints its token notice only when it is unset), Ray Train's PreemptionWatcher on
    (its known noise line must stay off the console) and a HOME of its own."""
    unset = ("RAY_AUTH_MODE", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return {**env, "HOME": str(tmp / "home")}


def _run_local(tmp: Path, *overrides: str) -> tuple[dict, list[dict]]:
    spec = tiny_spec("run.max_steps=3", "optim.lr=0.01", f"run.output_dir={tmp}", *overrides)
    summary = train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    return summary, metric_lines(tmp)


def test_loss_curves_agree_for_1_2_4_accumulation_steps(tmp_path):
    curves, adapters = {}, {}
    for micro in (8, 4, 2):  # global batch 8 -> N = 1, 2, 4
        out = tmp_path / f"m{micro}"
        summary, records = _run_local(out, f"batch.micro_batch_size={micro}")
        assert summary["grad_accum_steps"] == 8 // micro
        curves[micro] = [r["loss"] for r in records]
        adapters[micro] = final_adapter(out)
    assert len(curves[8]) == 3
    for micro in (4, 2):
        for step, (a, b) in enumerate(zip(curves[micro], curves[8], strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), (micro, step, a, b)
        assert rel_err(adapters[micro], adapters[8]) <= 1e-5
    # and the loss is not trivially constant: training moved it
    assert curves[8][0] != curves[8][-1]


def test_grouping_by_length_changes_padding_not_the_result(tmp_path):
    runs = {}
    for group in (True, False):
        out = tmp_path / str(group)
        _, records = _run_local(out, "batch.micro_batch_size=2", f"data.group_by_length={str(group).lower()}")
        runs[group] = ([r["loss"] for r in records], final_adapter(out))
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert rel_err(runs[True][1], runs[False][1]) <= 1e-5


def test_outputs_metrics_summary_plot_adapter(tmp_path):
    summary, records = _run_local(
        tmp_path,
        "run.checkpoint_every=1",
        "run.keep_checkpoints=2",
        "data.eval_fraction=0.1",
        "optim.warmup_steps=2",
        "optim.schedule=constant",
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_mem_gib", "estimate_gib"):
            assert isinstance(r[key], float | int) and r[key] >= 0, key
    # lr: linear warmup over 2 steps, then constant
    assert [r["lr"] for r in records] == pytest.approx([0.005, 0.01, 0.01])
    assert records[-1]["eval_loss"] is not None
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["steps"] == 3 and saved["final_loss"] == records[-1]["loss"]
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    # keep the newest 2 checkpoints only
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    # the adapter loads with PEFT onto the saved base and reproduces the trained weights
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    trained = load_adapter(tmp_path / "checkpoints" / "step-00000003")
    named = dict(model.named_parameters())
    assert trained and all(torch.equal(named[k], v) for k, v in trained.items())
    assert any(float(v.abs().sum()) > 0 for k, v in trained.items() if "lora_B" in k)  # it trained


def test_lr_scaling_rules():
    base = {
        "name": "x",
        "data": {"path": "x.jsonl"},
        "batch": {"global_batch_size": 64, "micro_batch_size": 4},
        "optim": {"lr": 1e-3, "reference_batch_size": 16},
    }
    for rule, factor in (("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)):
        spec = load_spec(data=base, overrides=[f"optim.lr_scaling={rule}"], files=False)
        assert spec.effective_lr == pytest.approx(1e-3 * factor)


@pytest.mark.ray
@pytest.mark.slow
def test_rayft_run_two_workers_matches_single_process_and_pins_loss(tmp_path, monkeypatch):
    """`rayft run` on the embedded local Ray: 2 workers x 4 accumulation x 4 micro (gloo DDP,
    gradient checkpointing) ends with a loadable adapter, a lower loss, and the same adapter
    as one process computing each global batch of 32 in one piece."""
    out = tmp_path / "ray"
    monkeypatch.chdir(ROOT)
    rayft = Path(sys.executable).parent / "rayft"
    p = subprocess.run(
        [
            str(rayft),
            "run",
            "examples/tiny-lora.yaml",
            f"run.output_dir={out}",
            "run.max_steps=8",
            "run.checkpoint_every=4",
            "run.eval_every=4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=_as_a_user_runs_it(tmp_path),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    records = metric_lines(out)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    # Pinned: step-1 loss of the demo (seed 0, tiny-llama init, first global batch). It only
    # depends on the init, the data order and the loss normalization.
    assert records[0]["loss"] == pytest.approx(6.8577, abs=2e-3)
    assert "rayft run tiny-lora" in p.stderr  # the summary table
    # The first screen: only rayft's lines (no Ray Train PreemptionWatcher error line, no
    # bitsandbytes missing-kernel notice in a run that quantizes nothing).
    assert unexpected_console_lines(p.stdout + p.stderr) == []

    local = tmp_path / "local"
    spec = load_spec(
        ROOT / "examples/tiny-lora.yaml",
        [
            f"run.output_dir={local}",
            "run.max_steps=8",
            "run.checkpoint_every=4",
            "run.eval_every=4",
            "resources.num_workers=1",
            "batch.micro_batch_size=32",
        ],
    )
    monkeypatch.chdir(ROOT)
    train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    local_records = metric_lines(local)
    for a, b in zip(records, local_records, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert rel_err(final_adapter(out), final_adapter(local)) <= 1e-4


def test_lora_inputs_in_the_compute_dtype_same_gradient_fewer_saved_bytes():
    """Under bf16 autocast rayft keeps PEFT from casting each adapter's input to fp32 (autocast
    casts it straight back): the gradient is bitwise the same, and backward keeps less."""
    from gradtools import build_engine, grads, window_inputs

    from jobs.train.step import train_window

    result = {}
    for casting in (True, False):
        spec = tiny_spec("batch.micro_batch_size=4", "precision=bf16")
        engine, model, tok = build_engine(spec, precision="bf16")
        lora_layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
        assert lora_layers and not any(m.cast_input_dtype_enabled for m in lora_layers)  # rayft's default
        for m in lora_layers:
            m.cast_input_dtype_enabled = casting
        mbs, n_labels, _, _ = window_inputs(spec, tok, 0, 1)
        storages: dict[int, int] = {}

        def pack(t, storages=storages):
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = train_window(engine, mbs[:1], n_labels)
        result[casting] = (loss.item(), grads(model), sum(storages.values()))
    assert result[False][0] == result[True][0]
    assert rel_err(result[False][1], result[True][1]) == 0.0
    assert result[False][2] < 0.9 * result[True][2], (result[False][2], result[True][2])
