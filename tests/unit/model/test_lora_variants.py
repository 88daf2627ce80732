"""LoRA variants through PEFT's LoraConfig (`lora.use_dora`, `lora.use_rslora`, `lora.init`):
they reach the model, the memory model accounts for DoRA (magnitude vectors and the activations
DoRA keeps for backward, checked against the tensors autograd keeps), and accumulation == big
batch holds with DoRA."""

from __future__ import annotations

import math

import pytest
import torch
from gradtools import accumulated_grads, reference_grads, rel_err, spawn, tiny_spec
from torch.multiprocessing.reductions import StorageWeakRef

from jobs import memory
from jobs.model.loading import add_lora, keep_lora_inputs_in_compute_dtype, load_base_model
from jobs.spec import DEFAULT_TARGET_MODULES
from tests.unit.memory.test_memory import DTYPES, Case, autocast, batch_for, loss_module

TOL_SAVED = 0.01


def build(case: Case, dora: bool):
    """As tests/unit/memory/test_memory.py's `build`, with DoRA on or off."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(case.config())
    model.to(DTYPES[case.dtype])
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(
        model,
        LoraConfig(
            r=case.r,
            lora_alpha=2 * case.r,
            lora_dropout=case.lora_dropout,
            target_modules=case.targets,
            task_type="CAUSAL_LM",
            use_dora=dora,
        ),
    )
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if case.dtype != "fp32":
        keep_lora_inputs_in_compute_dtype(model)
    model.train()
    return model


def kept_bytes(case: Case, dora: bool) -> int:
    """Bytes of the non-parameter storages autograd saved in forward that are still alive when
    forward ends (what backward will read), counted once per storage."""
    model = build(case, dora)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            ref = StorageWeakRef(st)
            refs.setdefault(ref.cdata, (ref, st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast(case):
            loss = loss_module(model, case)(**batch_for(case))
    alive = sum(n for ref, n in refs.values() if not ref.expired())
    del loss
    return alive


def estimated_kept(case: Case, dora: bool) -> int:
    est = case.estimate(lora_dora=dora)
    return est.components["activations"] + est.details["loss_saved_bytes"]


DORA_CASES = [
    Case("dora-fp32"),
    Case("dora-bf16", dtype="bf16"),
    Case("dora-qv", targets=["q_proj", "v_proj"]),
    Case("dora-mlp-r16-bf16", targets=["gate_proj", "up_proj", "down_proj"], r=16, dtype="bf16"),
    Case("dora-long-seq", batch=1, seq=96),
    Case("dora-dropout", lora_dropout=0.1),
    Case("dora-dropout-bf16", lora_dropout=0.1, dtype="bf16"),
    Case("dora-padded-gqa", padded=True, kv_heads=1),
]


@pytest.mark.parametrize("case", DORA_CASES, ids=[c.id for c in DORA_CASES])
def test_dora_activations_match_what_autograd_keeps(case):
    plain, dora = kept_bytes(case, False), kept_bytes(case, True)
    assert dora > plain * 1.1  # DoRA keeps more: the estimate has something to get right
    assert abs(estimated_kept(case, False) - plain) / plain <= TOL_SAVED
    assert abs(estimated_kept(case, True) - dora) / dora <= TOL_SAVED, (estimated_kept(case, True), dora)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], list(DEFAULT_TARGET_MODULES)])
def test_dora_trainable_parameters_include_the_magnitude_vectors(targets):
    case = Case("count", targets=targets)
    model = build(case, True)
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = memory.model_shape(case.config())
    assert memory.count_lora_params(shape, case.r, targets, dora=True) == real
    assert memory.count_lora_params(shape, case.r, targets) < real
    est = case.estimate(lora_dora=True)
    assert est.components["lora_weights"] == real * 4


def test_the_spec_reaches_peft():
    spec = tiny_spec("lora.use_dora=true", "lora.use_rslora=true", "lora.init=gaussian")
    model, _ = load_base_model(spec, "fp32")
    peft_model = add_lora(model, spec)
    cfg = peft_model.peft_config["default"]
    assert cfg.use_dora and cfg.use_rslora and cfg.init_lora_weights == "gaussian"
    layer = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(spec.lora.alpha / math.sqrt(spec.lora.r))  # rsLoRA
    assert "default" in layer.lora_magnitude_vector  # DoRA
    from jobs.memory import estimate_for_spec

    plain = estimate_for_spec(tiny_spec(), device="cpu")
    with_dora = estimate_for_spec(spec, device="cpu")
    assert with_dora.components["lora_weights"] > plain.components["lora_weights"]
    assert with_dora.components["activations"] > plain.components["activations"]


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_and_olora_initialise_from_the_base(init):
    """The adapted model starts where the base is (the base keeps the residual), with A and B
    both non-zero (unlike the default init, B = 0)."""
    spec = tiny_spec(f"lora.init={init}")
    base, _ = load_base_model(spec, "fp32")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base(input_ids=ids).logits.clone()
    model = add_lora(base, spec)
    b = model.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert b.abs().sum() > 0
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert ((got - want).norm() / want.norm()).item() <= 1e-4


W_M = [(1, 2), (2, 2)]


@pytest.mark.parametrize("w,m", W_M, ids=[f"W{w}xN{8 // (w * m)}xm{m}" for w, m in W_M])
def test_dora_accumulation_equals_big_batch(w, m, tmp_path):
    over = (f"resources.num_workers={w}", f"batch.micro_batch_size={m}", "lora.use_dora=true")
    ref = reference_grads(tiny_spec(*over))
    assert any("magnitude" in k for k in ref)  # the magnitude vectors get gradients too
    if w == 1:
        got = accumulated_grads(0, 1, over, False, "fp32")
    else:
        per_rank = spawn(accumulated_grads, w, tmp_path, over, False, "fp32")
        assert rel_err(per_rank[1], per_rank[0]) == 0.0
        got = per_rank[0]
    assert rel_err(got, ref) <= 1e-5


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_and_olora_adapters_are_saved_for_the_unmodified_base(init, tmp_path):
    """The saved adapter (converted to rank 2r) on a freshly loaded base computes what the
    trained model computes on its residual base."""
    from peft import PeftModel

    spec = tiny_spec(f"lora.init={init}")
    model = add_lora(load_base_model(spec, "fp32")[0], spec)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        for _n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)  # as if trained
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits.clone()
    model.save_pretrained(tmp_path / "adapter")
    fresh = PeftModel.from_pretrained(load_base_model(spec, "fp32")[0], tmp_path / "adapter")
    with torch.no_grad():
        got = fresh(input_ids=ids).logits
    assert ((got - want).norm() / want.norm()).item() <= 1e-4
    assert fresh.peft_config["default"].r == 2 * spec.lora.r
