"""The oracles of the CPU suite, on a CUDA device: what a job on a GPU relies on and CPU cannot show.

Each test runs `jobs.train.loop.train` (no Ray) on the built-in tiny-llama with
`LocalContext(use_gpu=True)`, in fp32 so that the oracles can be tight (no TF32: torch's default
for matmuls), and checks one property against a second run that must agree:

- exact accumulation: micro-batch 8 x 1 and 2 x 4 accumulation steps give the same adapter;
- `model.compile` (the GPU default, `auto`): compiled layers train the adapter eager layers do;
- DPO: accumulation split and compiled layers, the same way;
- QLoRA (nf4 on bitsandbytes' CUDA kernels): the split equivalence over a 4-bit base;
- packing through FlexAttention's BlockMask: the adapter packing through SDPA's float bias trains;
- resume: 2 steps, then 2 more from the checkpoint, equal bit for bit to 4 steps straight.

Marked `gpu` and skipped without CUDA. `RAYFT_GPU_TESTS_ON_CPU=1` runs them on the CPU instead
(where `auto` does not compile, so that test checks the eager answer only), to check the module
itself. On the GPU machine: `python -m pytest -m gpu tests/gpu/test_gpu.py` (bench/gpu_all.sh runs it).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from gradtools import final_adapter, rel_err, tiny_spec
from runs import metric_lines

from jobs.train.context import LocalContext
from jobs.train.loop import train

ON_CPU = os.environ.get("RAYFT_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# fp32 on both sides of each comparison: what differs is only the order of the sums.
TOL = 1e-5


def _run(out, *overrides: str) -> tuple[list[float], dict, dict]:
    spec = tiny_spec(
        "precision=fp32",
        "optim.lr=0.01",
        "optim.schedule=constant",
        "run.max_steps=3",
        f"resources.use_gpu={str(not ON_CPU).lower()}",
        f"run.output_dir={out}",
        *overrides,
    )
    summary = train(spec, LocalContext(use_gpu=not ON_CPU, on_progress=lambda r: None), resume=False)
    return [r["loss"] for r in metric_lines(out)], final_adapter(out), summary


def _agree(a: tuple, b: tuple, tol: float = TOL) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        assert abs(x - y) <= tol * abs(y), (a[0], b[0])
    assert rel_err(a[1], b[1]) <= tol
    assert a[0][0] != a[0][-1]  # it trained


def test_accumulation_split_gives_the_big_batch_adapter(tmp_path):
    whole = _run(tmp_path / "8x1", "batch.micro_batch_size=8", "model.compile=false")
    split = _run(tmp_path / "2x4", "batch.micro_batch_size=2", "model.compile=false")
    assert split[2]["grad_accum_steps"] == 4 and whole[2]["grad_accum_steps"] == 1
    _agree(split, whole)


def test_compile_auto_compiles_on_the_gpu_and_trains_like_eager(tmp_path):
    torch._dynamo.reset()
    auto = _run(tmp_path / "auto", "batch.micro_batch_size=4")
    eager = _run(tmp_path / "eager", "batch.micro_batch_size=4", "model.compile=false")
    assert auto[2]["compiled_layers"] is (DEVICE == "cuda")
    assert eager[2]["compiled_layers"] is False
    _agree(auto, eager)
    torch._dynamo.reset()


PAIRS = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny-pairs.jsonl"
DPO = ("objective.name=dpo", f"data.path={PAIRS}", "batch.global_batch_size=4")


def test_dpo_split_and_compiled_layers_give_the_same_adapter(tmp_path):
    torch._dynamo.reset()
    whole = _run(tmp_path / "4x1", *DPO, "batch.micro_batch_size=4", "model.compile=false")
    split = _run(tmp_path / "1x4", *DPO, "batch.micro_batch_size=1", "model.compile=false")
    compiled = _run(tmp_path / "compiled", *DPO, "batch.micro_batch_size=4", "model.compile=true")
    assert compiled[2]["compiled_layers"] is True and whole[2]["objective"] == "dpo"
    _agree(split, whole)
    _agree(compiled, whole)
    torch._dynamo.reset()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_qlora_split_gives_the_big_batch_adapter(tmp_path):
    q = ("model.quantization=nf4", "model.compile=false")
    whole = _run(tmp_path / "8x1", *q, "batch.micro_batch_size=8")
    split = _run(tmp_path / "2x4", *q, "batch.micro_batch_size=2")
    _agree(split, whole)


@pytest.mark.skipif(ON_CPU, reason="FlexAttention has no backward on CPU")
@pytest.mark.parametrize("compiled", ["false", "true"])
def test_packing_through_flex_attention_trains_the_sdpa_adapter(tmp_path, compiled):
    """Also with the layers compiled (the GPU default), which then hold FlexAttention's own
    compiled kernel."""
    torch._dynamo.reset()
    packed = ("data.packing=true", "data.max_seq_len=200", "batch.micro_batch_size=8")
    sdpa = _run(tmp_path / "sdpa", *packed, "model.compile=false")
    flex = _run(tmp_path / "flex", *packed, "model.attn_implementation=flex_attention", f"model.compile={compiled}")
    _agree(flex, sdpa)
    torch._dynamo.reset()


def test_resume_continues_bit_for_bit(tmp_path):
    """Bitwise, as on CPU: this also needs the step's kernels to be deterministic on the device
    (a failure here with the CPU suite green points at a kernel, not at the checkpoint)."""
    common = ("batch.micro_batch_size=4", "model.compile=false", "run.checkpoint_every=1")
    straight = _run(tmp_path / "straight", *common, "run.max_steps=4")
    _run(tmp_path / "resumed", *common, "run.max_steps=2")
    spec = tiny_spec(
        "precision=fp32",
        "optim.lr=0.01",
        "optim.schedule=constant",
        f"resources.use_gpu={str(not ON_CPU).lower()}",
        f"run.output_dir={tmp_path / 'resumed'}",
        *common,
        "run.max_steps=4",
    )
    summary = train(spec, LocalContext(use_gpu=not ON_CPU, on_progress=lambda r: None), resume=True)
    assert summary["resumed_from_step"] == 2
    resumed = final_adapter(tmp_path / "resumed")
    assert resumed.keys() == straight[1].keys()
    assert all(torch.equal(resumed[k], straight[1][k]) for k in resumed)
