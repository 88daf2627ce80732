"""The memory estimate against what torch actually keeps, on CPU.

Two oracles, both on real transformers models with real PEFT LoRA and rayft's loss
(`jobs.train.loop.CausalLMLoss`):

* `saved_bytes`: tensors autograd keeps for backward at the end of forward, seen through
  `torch.autograd.graph.saved_tensors_hooks`, plus the tensors non-reentrant checkpointing
  holds as layer arguments. Counted once per storage (a view of a saved tensor or a tensor
  saved by two ops is one allocation); parameter storages are weights, not activations.
* `LivePeak`: a TorchDispatchMode that tracks every storage an op allocates until it is
  freed -- a CPU stand-in for `torch.cuda.max_memory_allocated` over forward + backward.

Each case checks the estimate within 10%. Shapes are tiny so the file runs in seconds on
two cores; what makes them meaningful is that they vary every term the formula has
(hidden, intermediate, heads vs kv-heads, vocab, tied embeddings, micro-batch, sequence,
padding, eager vs sdpa, LoRA targets and dropout, fp32 vs bf16 autocast, checkpointing).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from jobs import memory
from jobs.memory import estimate
from jobs.model.loading import compile_layers, keep_lora_inputs_in_compute_dtype
from jobs.objectives import sft as jobs_sft
from jobs.spec import DEFAULT_TARGET_MODULES
from jobs.train.loop import CausalLMLoss

TOL = 0.10
# The activation replay follows autograd op by op, so on saved bytes it is held to 1%: that
# catches small terms (log-sum-exp, LoRA's r-wide inputs, GQA repeats) the 10% would not.
TOL_SAVED = 0.01
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALL7 = list(DEFAULT_TARGET_MODULES)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These ops are tiny: intra-op threads only add synchronization (and stall badly when
    other test processes share the two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- building the real thing -------------------------------------------------------------------


@dataclass
class Case:
    """One configuration: model shape + training settings."""

    id: str
    hidden: int = 64
    intermediate: int = 160
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 300
    tied: bool = False
    arch: str = "llama"
    batch: int = 2
    seq: int = 32
    gc: bool = False
    dtype: str = "fp32"
    attn: str = "sdpa"
    padded: bool = False
    packed: bool = False
    r: int = 4
    targets: list = field(default_factory=lambda: list(ALL7))
    lora_dropout: float = 0.0
    label_fraction: float = 1.0
    chunk: int = 0
    every_n: int = 1
    extra: dict = field(default_factory=dict)
    compiled: bool = False  # decoder layers (and the SFT head) through torch.compile, as `model.compile`

    def config(self):
        common = dict(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tied,
            attn_implementation=self.attn,
            max_position_embeddings=512,
            **self.extra,
        )
        if self.arch == "llama":
            from transformers import LlamaConfig

            return LlamaConfig(num_key_value_heads=self.kv_heads, **common)
        if self.arch == "qwen2":
            from transformers import Qwen2Config

            return Qwen2Config(num_key_value_heads=self.kv_heads, **common)
        if self.arch == "mistral":
            from transformers import MistralConfig

            return MistralConfig(num_key_value_heads=self.kv_heads, **common)
        if self.arch == "gpt_neox":
            from transformers import GPTNeoXConfig

            return GPTNeoXConfig(**common)
        raise ValueError(self.arch)

    def estimate(self, **overrides):
        labels = len(batch_for(self)["label_pos"])  # padding carries no labels
        kw = dict(
            micro_batch_size=self.batch,
            seq_len=self.seq,
            gradient_checkpointing=self.gc,
            base_dtype=self.dtype,
            lora_r=self.r,
            lora_target_modules=self.targets,
            lora_dropout=self.lora_dropout,
            attn_implementation=self.attn,
            label_fraction=labels / (self.batch * self.seq),
            loss_chunk_tokens=self.chunk or None,
            packed=self.packed,
            checkpoint_every_n_layers=self.every_n,
            device="cpu",
            compiled=self.compiled,
        )
        kw.update(overrides)
        return estimate(self.config(), **kw)


def build(case: Case):
    """Random-init model, frozen base in the case's dtype, fp32 LoRA reading its input in the
    compute dtype under autocast (as jobs.model.loading.add_lora does)."""
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
        ),
    )
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if case.dtype != "fp32":
        keep_lora_inputs_in_compute_dtype(model)
    if case.gc:
        model.get_base_model().activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=case.every_n
        )
    if case.compiled:
        torch._dynamo.reset()  # each case traces its own shapes: no recompile limit across cases
        compile_layers(model)
    model.train()
    return model


def batch_for(case: Case) -> dict:
    """Like jobs.data.collate: right padding without a mask, label positions gathered on the
    host; `packed`: two sequences per row, positions restarting, seq_ids for the block mask."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq), generator=g)
    mask = torch.ones_like(ids)
    if case.padded:
        mask[-1, case.seq // 2 :] = 0  # the last sequence is half as long
    labels = torch.full_like(ids, -100)
    n = max(1, round(case.label_fraction * case.seq))
    labels[:, case.seq - n :] = ids[:, case.seq - n :]  # completion-style: labels at the end
    labels[mask == 0] = -100
    flat = labels.view(-1)
    pos = (flat != -100).nonzero().squeeze(1)
    batch = {"input_ids": ids, "label_pos": pos, "label_ids": flat.index_select(0, pos)}
    if case.packed:
        half = case.seq // 2
        batch["position_ids"] = torch.cat([torch.arange(half), torch.arange(case.seq - half)]).repeat(case.batch, 1)
        batch["seq_ids"] = (torch.arange(case.seq) >= half).to(torch.int32).repeat(case.batch, 1)
    return batch


class _BaseModelLoss(CausalLMLoss):
    """`CausalLMLoss` reaches the decoder as `lm.model`; GPT-NeoX names it `gpt_neox`.
    Same computation, through `base_model` (HF's name-independent handle)."""

    def forward(self, input_ids, label_pos, label_ids):
        lm = self._causal_lm()
        hidden = lm.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        h = hidden.flatten(0, 1).index_select(0, label_pos)
        return jobs_sft._head_loss(lm.get_output_embeddings(), h, label_ids)


def loss_module(model, case: Case):
    if case.arch == "gpt_neox":
        assert not case.chunk
        return _BaseModelLoss(model)
    return CausalLMLoss(model, chunk_tokens=case.chunk, compiled_head=case.compiled)


def decoder_of(model):
    return model.get_base_model().base_model


def autocast(case: Case):
    return torch.autocast("cpu", dtype=DTYPES[case.dtype], enabled=case.dtype != "fp32")


# ---- oracle 1: bytes saved for backward ------------------------------------------------------


def saved_bytes(case: Case, loss_of=None) -> dict:
    """Unique non-parameter storages kept for backward after forward, split decoder / loss head.
    `loss_of(model)` gives the loss to run on the case's batch (default: `loss_module`)."""
    model = build(case)
    loss_mod = (loss_of or (lambda m: loss_module(m, case)))(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    where = ["decoder"]

    def note(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen and st.nbytes():
            seen[st.data_ptr()] = (where[0], st.nbytes())

    def pack(t):
        note(t)
        return t

    # Non-reentrant checkpointing keeps the layer's arguments alive (the hidden states go
    # through saved_tensors_hooks; the kwargs -- mask, cos/sin -- are held by reference).
    base = model.get_base_model()
    layers = decoder_of(model).layers
    hooks = []
    if case.gc:

        def hold(mod, args, kwargs):
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    note(t)

        hooks = [
            layer.register_forward_pre_hook(hold, with_kwargs=True) for layer in layers if layer.gradient_checkpointing
        ]
    # Everything saved after the decoder returns belongs to the loss head.
    hooks.append(decoder_of(model).register_forward_hook(lambda m, a, o: where.__setitem__(0, "loss")))
    head = base.get_output_embeddings()
    if case.chunk:
        # The head runs under checkpoint: its input chunks are held as arguments.
        hooks.append(head.register_forward_pre_hook(lambda m, a: note(a[0])))
    b = batch_for(case)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast(case):
            loss = loss_mod(**b)
    for h in hooks:
        h.remove()
    out = {"decoder": 0, "loss": 0}
    for w, n in seen.values():
        out[w] += n
    del loss
    return out


# ---- oracle 2: live storages over forward + backward ------------------------------------------


class LivePeak(TorchDispatchMode):
    """Bytes of op-allocated storages alive, and their peak, over everything run under it.

    Tensors created before entering (weights, the batch) are not counted: the peak is the
    dynamic part of `max_memory_allocated` (activations, logits, gradients, temporaries).
    """

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        # Views of tensors made before entering (e.g. `weight.t()`) allocate nothing.
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def _sweep(self):
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st.data_ptr() in self.existing:
                    continue
                ref = StorageWeakRef(st)
                old = self.live.get(ref.cdata)
                if old is not None and old[0].expired():  # address reused after a free
                    self.current -= self.live.pop(ref.cdata)[1]
                if ref.cdata not in self.live:
                    self.live[ref.cdata] = (ref, st.nbytes())
                    self.current += st.nbytes()
        if self.current > self.peak:
            self._sweep()
            self.peak = max(self.peak, self.current)
        return out


def live_peak_bytes(case: Case, loss_of=None) -> int:
    """Peak of dynamic memory over one forward + backward (`loss_of` as for `saved_bytes`).

    The LoRA gradients are allocated beforehand (a later micro-step of an accumulation
    window), so they count as static memory, like the weights.
    """
    model = build(case)
    loss_mod = (loss_of or (lambda m: loss_module(m, case)))(model)
    b = batch_for(case)
    for p in model.parameters():  # steady state: gradients of earlier micro-steps exist
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    existing = [
        *model.parameters(),
        *model.buffers(),
        *b.values(),
        *(p.grad for p in model.parameters() if p.grad is not None),
    ]
    with LivePeak(existing) as mode:
        with autocast(case):
            loss = loss_mod(**b)
        loss.backward()
    return mode.peak


def rel(est: int, meas: int) -> float:
    return (est - meas) / meas


def static_bytes(est: memory.MemoryEstimate) -> int:
    c = est.components
    return sum(c[k] for k in ("frozen_weights", "lora_weights", "lora_grads", "optimizer_state", "ddp_buckets"))


# ---- the cases -------------------------------------------------------------------------------

NEOX_ALL = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
CASES = [
    Case("llama-fp32"),
    Case("llama-bf16", dtype="bf16"),
    Case("llama-fp16", dtype="fp16"),
    Case("gc-fp32", gc=True),
    Case("gc-bf16", dtype="bf16", gc=True),
    Case("gc-every2-L4-bf16", layers=4, gc=True, every_n=2, dtype="bf16"),
    Case("gc-every3-L4", layers=4, gc=True, every_n=3),
    Case("padded-bf16", dtype="bf16", padded=True),
    Case("padded-gc", padded=True, gc=True),
    Case("padded-mqa-mb4", batch=4, seq=16, padded=True, kv_heads=1),
    Case("eager-fp32", attn="eager"),
    Case("eager-bf16", attn="eager", dtype="bf16"),
    Case("eager-gc-bf16", attn="eager", gc=True, dtype="bf16"),
    Case("eager-attn-dropout", attn="eager", dtype="bf16", extra=dict(attention_dropout=0.1)),
    Case("targets-qv", targets=["q_proj", "v_proj"]),
    Case("targets-qv-bf16", targets=["q_proj", "v_proj"], dtype="bf16"),
    Case("targets-mlp-bf16", targets=["gate_proj", "down_proj"], dtype="bf16", r=8),
    Case("lora-dropout", lora_dropout=0.1),
    Case("lora-dropout-bf16", lora_dropout=0.1, dtype="bf16"),
    Case("mha-tied-h96", hidden=96, heads=6, kv_heads=6, tied=True),
    Case("many-small-heads", heads=16, kv_heads=16, intermediate=64, dtype="bf16"),
    Case("padded-gqa-wide", hidden=128, heads=8, kv_heads=2, intermediate=128, padded=True, dtype="bf16"),
    Case("packed-fp32", packed=True),
    Case("packed-bf16-gqa", packed=True, dtype="bf16", hidden=128, heads=8, kv_heads=2, intermediate=128),
    Case("packed-gc-bf16", packed=True, gc=True, dtype="bf16"),
    Case("packed-gc-every2-L4", packed=True, gc=True, every_n=2, layers=4),
    Case("packed-eager-bf16", packed=True, attn="eager", dtype="bf16"),
    Case("rank-64", r=64, dtype="bf16"),
    Case("wide-mlp-small-vocab", intermediate=512, vocab=40, dtype="bf16"),
    Case("small-vocab-gc", intermediate=256, vocab=40, gc=True),
    Case("L4-small-vocab-bf16", layers=4, intermediate=256, vocab=40, dtype="bf16"),
    Case("long-seq-mb1", batch=1, seq=128, vocab=1000, dtype="bf16"),
    Case("label-half", label_fraction=0.5, dtype="bf16"),
    Case("loss-chunks", chunk=16, dtype="bf16"),
    Case("qwen2-bias-bf16", arch="qwen2", dtype="bf16"),
    Case("mistral-window-mask", arch="mistral", extra=dict(sliding_window=16)),
    Case("neox-fp32", arch="gpt_neox", targets=NEOX_ALL, extra=dict(rotary_pct=0.25)),
    Case("neox-bf16", arch="gpt_neox", targets=NEOX_ALL, dtype="bf16", extra=dict(rotary_pct=0.25)),
    Case(
        "neox-gc-bf16",
        arch="gpt_neox",
        targets=["query_key_value", "dense_4h_to_h"],
        dtype="bf16",
        gc=True,
        extra=dict(rotary_pct=0.5),
    ),
    Case(
        "neox-sequential",
        arch="gpt_neox",
        targets=["query_key_value", "dense_h_to_4h"],
        extra=dict(rotary_pct=1.0, use_parallel_residual=False),
    ),
]


# Compiled layers and head (`model.compile`): `saved_tensors_hooks` see what a compiled graph
# saves, so the replay's compiled variant is held to the same 1%. (The live-storage peak cannot see
# inside compiled kernels: the transients are the eager model's. Checkpointed compiled layers kept
# about 5 KiB each beyond their inputs at the tiny shape here, which the replay does not model.)
COMPILED = [
    Case("compiled-bf16", dtype="bf16", compiled=True),
    Case("compiled-fp32", compiled=True),
    Case("compiled-bf16-gqa-L3", dtype="bf16", compiled=True, layers=3, hidden=128, heads=8, kv_heads=2),
    Case("compiled-targets-qv-bf16", dtype="bf16", compiled=True, targets=["q_proj", "v_proj"]),
    Case("compiled-loss-chunks-bf16", dtype="bf16", compiled=True, chunk=16),
]


def _ids(cases):
    return [c.id for c in cases]


# ---- the estimate against the oracles ----------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_saved_for_backward_matches_estimate(case):
    """`activations` = what the decoder keeps for backward; the loss head's saved part too."""
    est = case.estimate()
    got = saved_bytes(case)
    assert got["decoder"] > 0 and got["loss"] > 0
    assert abs(rel(est.components["activations"], got["decoder"])) <= TOL_SAVED, (est.details, got)
    assert abs(rel(est.details["loss_saved_bytes"], got["loss"])) <= TOL_SAVED, (est.details, got)


@pytest.mark.parametrize("case", COMPILED, ids=_ids(COMPILED))
def test_compiled_layers_keep_what_the_estimate_says(case):
    """The compiled replay against the compiled graphs, and it differs from the eager one (so the
    test would fail on an estimate that ignored compilation)."""
    est, eager = case.estimate(), case.estimate(compiled=False)
    got = saved_bytes(case)
    assert abs(rel(est.components["activations"], got["decoder"])) <= TOL_SAVED, (est.details, got)
    assert abs(rel(est.details["loss_saved_bytes"], got["loss"])) <= TOL_SAVED, (est.details, got)
    assert est.components["activations"] < eager.components["activations"]
    torch._dynamo.reset()


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_peak_matches_estimate(case):
    """Everything but static memory: activations + the larger transient (loss head or one
    layer's backward, recompute included) against the live-storage peak."""
    est = case.estimate()
    dynamic = est.peak_allocated_bytes - static_bytes(est)
    assert abs(rel(dynamic, live_peak_bytes(case))) <= TOL, est.components


def test_checkpointing_cuts_saved_bytes_in_estimate_and_measurement():
    off, on = Case("off", layers=4, dtype="bf16"), Case("on", layers=4, dtype="bf16", gc=True)
    est_off, est_on = off.estimate().components["activations"], on.estimate().components["activations"]
    got_off, got_on = saved_bytes(off)["decoder"], saved_bytes(on)["decoder"]
    assert est_on < est_off / 5 and got_on < got_off / 5
    assert abs(rel(est_off / est_on, got_off / got_on)) <= TOL
    # ... and checkpointing pays for it with a recompute: one full layer in the transient.
    assert on.estimate().components["layer_backward"] > off.estimate().components["layer_backward"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_saved_bytes_track_sequence_length(attn):
    """sdpa grows linearly with seq; eager also keeps seq x seq probabilities (quadratic)."""
    cases = [Case(f"s{s}", seq=s, batch=1, attn=attn, dtype="bf16") for s in (16, 64, 128)]
    est = [c.estimate().components["activations"] for c in cases]
    got = [saved_bytes(c)["decoder"] for c in cases]
    for e, g in zip(est, got, strict=True):
        assert abs(rel(e, g)) <= TOL
    growth = got[2] / got[1]
    assert abs(rel(est[2] / est[1], growth)) <= TOL
    if attn == "sdpa":
        assert 1.9 < growth <= 2.0  # linear, plus constants (autocast copies of the LoRA weights)
    else:
        assert growth > 2.3


def test_micro_batch_scales_activations_and_logits_linearly():
    one, four = Case("mb1", batch=1), Case("mb4", batch=4)
    for key in ("activations", "logits_loss"):
        r = four.estimate().components[key] / one.estimate().components[key]
        assert 3.8 < r <= 4.0, key  # rope tables and position ids do not grow with the batch
    assert saved_bytes(four)["decoder"] / saved_bytes(one)["decoder"] == pytest.approx(
        four.estimate().components["activations"] / one.estimate().components["activations"], rel=TOL
    )


# ---- preference objectives: pairs, the reference forward ---------------------------------------


def preference_loss(model, case: Case, name: str, reference_adapter=None):
    """`jobs.objectives.preference.PreferenceLoss` for `name` with the spec's defaults."""
    from jobs.objectives import Objective
    from jobs.objectives.preference import PreferenceLoss
    from jobs.spec import OBJECTIVE_BY_NAME

    keys = OBJECTIVE_BY_NAME[name]().model_dump(exclude={"reference"})
    return PreferenceLoss(model, Objective(**keys), chunk_tokens=case.chunk, reference_adapter=reference_adapter)


def pair_loss(case: Case, name: str):
    """`loss_of` for `saved_bytes` / `live_peak_bytes`: the case's rows are its pairs' chosen then
    rejected rows, through `PreferenceLoss` (DPO given its precomputed reference log-probabilities);
    the summed loss."""

    def make(model):
        loss = preference_loss(model, case, name)
        resp_len = torch.full((case.batch,), 5)
        ref = torch.zeros(case.batch) if name in ("dpo", "ipo") else None
        return lambda **b: loss(**b, resp_len=resp_len, ref_logps=ref)[0]

    return make


def with_reference_adapter(model, case: Case):
    """A second, frozen fp32 LoRA adapter named as `jobs.objectives.preference` names the starting adapter."""
    from peft import LoraConfig

    from jobs.objectives.preference import REFERENCE_ADAPTER

    model.add_adapter(
        REFERENCE_ADAPTER,
        LoraConfig(r=case.r, lora_alpha=2 * case.r, target_modules=case.targets, task_type="CAUSAL_LM"),
    )
    for n, prm in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in n:
            prm.requires_grad_(False)
            prm.data = prm.data.float()
    return REFERENCE_ADAPTER


def pair_estimate(case: Case, **kw) -> memory.MemoryEstimate:
    """The case's rows as `case.batch // 2` pairs."""
    return case.estimate(micro_batch_size=case.batch // 2, pairs=True, **kw)


PAIR_CASES = [
    Case("pairs-fp32", batch=4),
    Case("pairs-bf16", batch=4, dtype="bf16"),
    Case("pairs-gc-bf16", batch=4, dtype="bf16", gc=True),
    Case("pairs-chunks", batch=4, dtype="bf16", vocab=3000, chunk=16),
    Case("pairs-label-half", batch=4, dtype="bf16", label_fraction=0.5),
]


@pytest.mark.parametrize("name", ["dpo", "simpo", "orpo"])
@pytest.mark.parametrize("case", PAIR_CASES, ids=_ids(PAIR_CASES))
def test_pairs_are_two_rows_each_in_saved_bytes_and_peak(case, name):
    """A micro-batch of m pairs is 2m rows through one forward: the policy forward of
    `PreferenceLoss` keeps exactly the decoder bytes of 2m rows (the estimate with `pairs`), its head
    the SFT head's plus the row index and per-token log-probabilities (to 1%), and forward +
    backward peak within 10%."""
    est = pair_estimate(case)
    assert est.details["rows"] == case.batch and est.details["pairs"]
    got = saved_bytes(case, loss_of=pair_loss(case, name))
    assert got["decoder"] == est.components["activations"]
    assert abs(rel(est.details["loss_saved_bytes"], got["loss"])) <= TOL_SAVED, (est.details, got)
    dynamic = est.peak_allocated_bytes - static_bytes(est)
    assert abs(rel(dynamic, live_peak_bytes(case, loss_of=pair_loss(case, name)))) <= TOL, est.components


REFERENCE_CASES = [
    Case("ref-fp32", batch=4),
    Case("ref-bf16", batch=4, dtype="bf16"),
    Case("ref-big-vocab-bf16", batch=4, dtype="bf16", vocab=3000),
    Case("ref-chunks", batch=4, dtype="bf16", vocab=3000, chunk=16),
    Case("ref-wide-mlp", batch=4, intermediate=512, dtype="bf16"),
    Case("ref-gqa-h128", batch=2, hidden=128, heads=8, kv_heads=2, intermediate=256, dtype="bf16"),
]


@pytest.mark.parametrize("adapter", [False, True], ids=["adapter-off", "reference-adapter"])
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=_ids(REFERENCE_CASES))
def test_reference_forward_matches_estimate(case, adapter):
    """DPO's reference forward (`PreferenceLoss.reference_logps`: no grad, eval mode, the adapter off
    or the frozen reference adapter active) keeps nothing for backward, and its live-storage peak
    -- the widest of a layer's working set and the head's logits -- is the estimate's
    `reference_forward` to 1% (measured: to a dozen bytes)."""
    model = build(case)
    name = with_reference_adapter(model, case) if adapter else None
    loss_mod = preference_loss(model, case, "dpo", reference_adapter=name)
    b = batch_for(case)
    kept: list[torch.Tensor] = []
    existing = [*model.parameters(), *model.buffers(), *b.values()]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        with LivePeak(existing) as mode:
            with autocast(case):
                ref = loss_mod.reference_logps(b["input_ids"], b["label_pos"], b["label_ids"])
    assert not kept and not ref.requires_grad and ref.shape == (case.batch,)
    est = pair_estimate(case, reference="adapter_off", reference_adapter=adapter)
    assert abs(rel(est.components["reference_forward"], mode.peak)) <= TOL_SAVED, (est.components, mode.peak)


def test_reference_components_and_where_they_count():
    """`reference_adapter`: the frozen copy of the LoRA weights (DPO/IPO from `model.adapter`), sharded
    and gathered with its layer under FSDP; `reference_forward`: a transient before the policy
    forward, so it is weighed against activations + the other transients, not added to them;
    precomputed reference log-probabilities, and SimPO and ORPO, hold neither."""
    cfg = _llama(num_hidden_layers=4, intermediate_size=1024, vocab_size=64)  # the reference's widest: the MLP
    kw = dict(micro_batch_size=2, seq_len=16, gradient_checkpointing=True, device="cpu")
    pairs = estimate(cfg, pairs=True, **kw)
    assert pairs.components["activations"] == estimate(cfg, **{**kw, "micro_batch_size": 4}).components["activations"]
    assert not set(memory.REFERENCE_COMPONENTS) & set(pairs.components)
    assert estimate(cfg, pairs=True, reference="precomputed", **kw).components == pairs.components
    off = estimate(cfg, pairs=True, reference="adapter_off", **kw).components
    assert "reference_adapter" not in off and off["reference_forward"] > 0
    held = estimate(cfg, pairs=True, reference="adapter_off", reference_adapter=True, **kw)
    c = held.components
    # the active reference adapter's up-projection output beside the MLP's three [N, intermediate]
    assert c["reference_adapter"] == c["lora_weights"]
    assert c["reference_forward"] - off["reference_forward"] == 2 * 2 * 16 * 1024 * 2  # rows x seq x inter x bf16
    static = sum(v for k, v in c.items() if k not in memory.TRANSIENT_COMPONENTS + ("activations",))
    assert held.peak_allocated_bytes == static + max(
        c["activations"] + max(c["logits_loss"], c["layer_backward"]), c["reference_forward"]
    )
    rows = [name for name, _ in held.table()]
    assert rows.index("optimizer_state") < rows.index("reference_adapter") < rows.index("activations")
    assert rows.index("reference_forward") < rows.index("logits_loss")
    sharded = estimate(
        cfg, pairs=True, reference="adapter_off", reference_adapter=True, strategy="fsdp", world_size=2, **kw
    )
    plain = estimate(cfg, pairs=True, reference="adapter_off", strategy="fsdp", world_size=2, **kw)
    assert sharded.components["reference_adapter"] == sharded.components["lora_weights"]
    units, one = sharded.details["fsdp_unit_bytes"], plain.details["fsdp_unit_bytes"]
    assert units["layer"] - one["layer"] == plain.details["fsdp_gathered_layer_bytes"]["lora"]
    # a reference forward over plain rows: GRPO's with beta > 0, over its completions
    assert estimate(cfg, reference="adapter_off", **kw).components["reference_forward"] > 0
    for bad in (
        dict(reference="ref"),
        dict(pairs=True, reference="ref"),
        dict(pairs=True, reference="precomputed", reference_adapter=True),
    ):
        with pytest.raises(ValueError, match="reference"):
            estimate(cfg, **kw, **bad)


def test_the_objective_reaches_the_estimate_from_the_spec():
    """`objective.name` and `objective.reference`, `model.adapter`: rows, the reference forward and
    the reference adapter, as `jobs.memory.spec_objective` reads them."""
    base = memory.estimate_for_spec(_spec(), gradient_checkpointing=True, device="cpu")
    by = {}
    for name, extra in [("dpo", {}), ("dpo", {"reference": "precomputed"}), ("ipo", {}), ("simpo", {}), ("orpo", {})]:
        for adapter in (None, "/saved/sft/adapter"):
            spec = _spec(objective={"name": name, **extra}, model={"adapter": adapter} if adapter else {})
            by[name, extra.get("reference"), adapter] = memory.estimate_for_spec(
                spec, gradient_checkpointing=True, device="cpu"
            )
    for (name, reference, adapter), est in by.items():
        assert est.details["rows"] == 2 * base.details["rows"] and est.details["pairs"]
        forward = name in ("dpo", "ipo") and reference != "precomputed"
        assert ("reference_forward" in est.components) == forward, (name, reference)
        assert ("reference_adapter" in est.components) == (forward and adapter is not None), (name, reference, adapter)
    assert not base.details["pairs"] and "reference_forward" not in base.components


# ---- pure properties -------------------------------------------------------------------------


def _llama(**kw):
    from transformers import LlamaConfig

    base = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**base, **kw})


LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    tie_word_embeddings=True,
)
LLAMA_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if c.id
        in ("llama-fp32", "mha-tied-h96", "qwen2-bias-bf16", "mistral-window-mask", "neox-fp32", "targets-mlp-bf16")
    ],
    ids=lambda c: c.id,
)
def test_parameter_counts_match_real_models(case):
    model = build(case)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = memory.model_shape(case.config())
    assert sum(memory.count_base_params(shape).values()) == frozen
    assert memory.count_lora_params(shape, case.r, case.targets) == lora


def test_published_llama_sizes():
    """Llama-3.2-1B has 1,235,814,400 parameters and Llama-3.1-8B 8,030,261,248."""
    one = memory.model_shape(_llama(**LLAMA_1B))
    eight = memory.model_shape(_llama(**LLAMA_8B))
    assert sum(memory.count_base_params(one).values()) == 1_235_814_400
    assert sum(memory.count_base_params(eight).values()) == 8_030_261_248
    est = estimate(_llama(**LLAMA_8B), micro_batch_size=1, seq_len=512, gradient_checkpointing=True)
    assert est.components["frozen_weights"] == 2 * 8_030_261_248  # bf16


def test_optimizer_state():
    cfg = _llama()
    kw = dict(micro_batch_size=1, seq_len=8, gradient_checkpointing=False, lora_r=8)
    adamw = estimate(cfg, optimizer="adamw", **kw).components
    sgd = estimate(cfg, optimizer="sgd", **kw).components
    momentum = estimate(cfg, optimizer="sgd", momentum=0.9, **kw).components
    lora_params = memory.count_lora_params(memory.model_shape(cfg), 8, DEFAULT_TARGET_MODULES)
    assert adamw["lora_weights"] == adamw["lora_grads"] == 4 * lora_params
    assert adamw["optimizer_state"] == 2 * 4 * lora_params
    assert sgd["optimizer_state"] == 0
    assert momentum["optimizer_state"] == 4 * lora_params


def test_gqa_shrinks_k_and_v_projections():
    kw = dict(micro_batch_size=1, seq_len=8, gradient_checkpointing=False, base_dtype="fp32")
    mha, gqa = estimate(_llama(num_key_value_heads=4), **kw), estimate(_llama(num_key_value_heads=1), **kw)
    head_dim, layers, hidden, r = 16, 2, 64, 8
    dropped_kv = (4 - 1) * head_dim
    assert mha.components["frozen_weights"] - gqa.components["frozen_weights"] == 4 * layers * 2 * hidden * dropped_kv
    assert mha.components["lora_weights"] - gqa.components["lora_weights"] == 4 * layers * 2 * r * dropped_kv
    assert gqa.components["activations"] < mha.components["activations"]


def test_tied_embeddings_drop_lm_head():
    kw = dict(micro_batch_size=1, seq_len=8, gradient_checkpointing=False, base_dtype="bf16")
    untied = estimate(_llama(tie_word_embeddings=False), **kw).components["frozen_weights"]
    tied = estimate(_llama(tie_word_embeddings=True), **kw).components["frozen_weights"]
    assert untied - tied == 2 * 300 * 64


def test_total_adds_only_the_largest_transient():
    est = estimate(_llama(), micro_batch_size=2, seq_len=32, gradient_checkpointing=True, device="cuda")
    c = est.components
    steady = sum(v for k, v in c.items() if k not in memory.TRANSIENT_COMPONENTS)
    assert est.total_bytes == steady + max(c["logits_loss"], c["layer_backward"])
    assert est.peak_allocated_bytes == est.total_bytes - c["framework_overhead"]
    rows = est.table()
    assert rows[-1] == ("total", est.total_gib) and {n for n, _ in rows[:-1]} == set(c)


def test_framework_overhead_and_ddp_buckets():
    kw = dict(micro_batch_size=1, seq_len=8, gradient_checkpointing=False)
    assert estimate(_llama(), device="cpu", **kw).components["framework_overhead"] == 0
    assert estimate(_llama(), device="cuda", **kw).components["framework_overhead"] >= memory.CUDA_CONTEXT_BYTES
    view = estimate(_llama(), world_size=2, **kw).components
    copy = estimate(_llama(), world_size=2, gradient_as_bucket_view=False, **kw).components
    assert view["ddp_buckets"] == 0 and copy["ddp_buckets"] == copy["lora_grads"]


def test_no_sync_grads_follow_the_accumulation():
    """What a window of grad_accum_steps > 1 holds beyond `lora_grads`: nothing for one micro-step or
    one process; DDP with bucket views, a second fp32 copy (fresh gradients beside the buckets);
    without bucket views the buckets are that copy already; FSDP, the whole gradient less its shard
    (unsharded until the last micro-step). Gradients accumulate in place: 2 or 16 micro-steps hold
    the same."""
    cfg = _llama()
    lora = 4 * memory.count_lora_params(memory.model_shape(cfg), 8, DEFAULT_TARGET_MODULES)

    def parts(**kw):
        return estimate(cfg, micro_batch_size=1, seq_len=8, gradient_checkpointing=False, device="cpu", **kw).components

    assert parts(world_size=2)["no_sync_grads"] == 0 and parts(grad_accum_steps=4)["no_sync_grads"] == 0
    ddp = parts(world_size=2, grad_accum_steps=4)
    assert ddp["no_sync_grads"] == ddp["lora_grads"] == lora and ddp["ddp_buckets"] == 0
    copy = parts(world_size=2, grad_accum_steps=4, gradient_as_bucket_view=False)
    assert copy["no_sync_grads"] == 0 and copy["ddp_buckets"] == lora
    fsdp = parts(world_size=2, grad_accum_steps=2, strategy="fsdp")
    assert fsdp["lora_grads"] + fsdp["no_sync_grads"] == lora and 0 < fsdp["no_sync_grads"] < lora
    assert parts(world_size=2, strategy="fsdp")["no_sync_grads"] == 0
    assert parts(world_size=2, grad_accum_steps=16) == parts(world_size=2, grad_accum_steps=2)
    one = estimate(cfg, micro_batch_size=1, seq_len=8, gradient_checkpointing=False, world_size=2)
    window = estimate(
        cfg, micro_batch_size=1, seq_len=8, gradient_checkpointing=False, world_size=2, grad_accum_steps=2
    )
    assert window.total_bytes > one.total_bytes + lora  # and the allocator slack on it


def test_chunked_loss_keeps_one_chunk_of_logits():
    cfg = _llama(**LLAMA_1B)
    kw = dict(micro_batch_size=4, seq_len=2048, gradient_checkpointing=True)
    whole = estimate(cfg, **kw).components["logits_loss"]
    chunked = estimate(cfg, loss_chunk_tokens=1024, **kw).components["logits_loss"]
    assert whole == pytest.approx(12 * 4 * 2048 * 128256, rel=0.001)  # 12 bytes per logit
    assert chunked < whole / 6
    half = estimate(cfg, label_fraction=0.5, **kw).components["logits_loss"]
    assert half == pytest.approx(whole / 2, rel=0.001)


def test_rejects_what_it_cannot_model():
    kw = dict(micro_batch_size=1, seq_len=8, gradient_checkpointing=False)
    with pytest.raises(ValueError, match="lm_head"):
        estimate(_llama(), lora_target_modules=["q_proj", "lm_head"], **kw)
    from transformers import BertConfig

    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        estimate(BertConfig(), **kw)
    with pytest.raises(ValueError, match="attn_implementation"):
        estimate(_llama(), attn_implementation="flash_attention_2", **kw)


# ---- from a job spec -------------------------------------------------------------------------


def _spec(**sections):
    from jobs.spec import validate

    data = {
        "name": "m",
        "data": {"path": "unused.jsonl", "max_seq_len": 129},
        "batch": {"global_batch_size": 12, "micro_batch_size": 2},
        "resources": {"num_workers": 2},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return validate(data)


def test_estimate_for_spec_reads_the_spec():
    from jobs.model.loading import tiny_llama_config

    spec = _spec(lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, optim={"name": "sgd"})
    cpu = memory.estimate_for_spec(spec, device="cpu")
    direct = estimate(
        tiny_llama_config(),
        micro_batch_size=2,
        seq_len=128,
        gradient_checkpointing=False,
        base_dtype="fp32",
        lora_r=4,
        lora_target_modules=["q_proj", "v_proj"],
        optimizer="sgd",
        world_size=2,
        device="cpu",
        grad_accum_steps=3,
    )
    # precision auto -> fp32 on CPU; seq = max_seq_len - 1; 12 sequences / (2 workers x 2) = 3 micro-steps
    assert cpu.components == direct.components and cpu.details["grad_accum_steps"] == 3
    gpu = memory.estimate_for_spec(spec, device="cuda")  # auto -> bf16 on GPU
    assert gpu.components["frozen_weights"] * 2 == cpu.components["frozen_weights"]
    assert memory.estimate_for_spec(spec, micro_batch_size=6, device="cpu").total_bytes > cpu.total_bytes
    # a micro-batch of all 6 sequences per worker is one micro-step: no window to hold gradients through
    assert memory.estimate_for_spec(spec, micro_batch_size=6, device="cpu").components["no_sync_grads"] == 0
    assert memory.plan_for_spec(spec, device="cpu").grad_accum_steps == spec.grad_accum_steps == 3


def test_auto_checkpointing_follows_the_budget():
    spec = _spec(memory={"gradient_checkpointing": "auto"})
    off = memory.estimate_for_spec(spec, gradient_checkpointing=False, device="cpu")
    on = memory.estimate_for_spec(spec, gradient_checkpointing=True, device="cpu")
    assert on.total_bytes < off.total_bytes
    every2 = memory.estimate_for_spec(spec, gradient_checkpointing=True, checkpoint_every_n_layers=2, device="cpu")
    assert on.total_bytes < every2.total_bytes < off.total_bytes  # tiny-llama: 2 layers
    roomy = _spec(memory={"gradient_checkpointing": "auto", "budget_gib": off.total_gib * 2})
    sparse = _spec(memory={"gradient_checkpointing": "auto", "budget_gib": (off.total_gib + every2.total_gib) / 2})
    tight = _spec(memory={"gradient_checkpointing": "auto", "budget_gib": (every2.total_gib + on.total_gib) / 2})
    assert memory.estimate_for_spec(roomy, device="cpu").components == off.components
    # `auto` takes the sparsest checkpointing that fits (the plan the loop runs), not "every layer"
    assert memory.estimate_for_spec(sparse, device="cpu").components == every2.components
    assert memory.estimate_for_spec(tight, device="cpu").components == on.components
    plan = memory.plan_for_spec(sparse, device="cpu")
    assert (plan.checkpoint_every_n_layers, plan.fits) == (2, True)


def test_feasible_pairs_lists_only_divisors():
    spec = _spec()  # 12 sequences over 2 workers: 6 per worker
    rows = memory.feasible_pairs(spec, budget_gib=None, device="cpu")
    assert [(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows[::2]] == [(1, 6), (2, 3), (3, 2), (6, 1)]
    assert [r["gradient_checkpointing"] for r in rows] == [False, True] * 4
    for r in rows:
        assert r["micro_batch_size"] * r["grad_accum_steps"] * 2 == 12 and r["fits"]
    by = {(r["micro_batch_size"], r["gradient_checkpointing"]): r["estimate_gib"] for r in rows}
    assert all(by[(m, True)] < by[(m, False)] for m in (1, 2, 3, 6))
    assert by[(1, False)] < by[(2, False)] < by[(3, False)] < by[(6, False)]
    budget = by[(3, True)]
    fits = {
        (r["micro_batch_size"], r["gradient_checkpointing"]): r["fits"]
        for r in memory.feasible_pairs(spec, budget, device="cpu")
    }
    assert fits == {k: v <= budget for k, v in by.items()}
    assert memory.smallest_budget_gib(spec, device="cpu") == by[(1, True)] == min(by.values())


def test_smallest_budget_is_monotone():
    base = memory.smallest_budget_gib(_spec(), device="cuda")
    assert memory.smallest_budget_gib(_spec(data={"path": "x", "max_seq_len": 1025}), device="cuda") > base
    assert memory.smallest_budget_gib(_spec(lora={"r": 64}), device="cuda") > base
    assert memory.smallest_budget_gib(_spec(optim={"name": "sgd"}), device="cuda") < base
    assert memory.smallest_budget_gib(_spec(), device="cpu") < base  # no CUDA context on CPU


def test_config_from_local_dir_and_gguf(tmp_path):
    from jobs.model.loading import tiny_llama_config

    tiny_llama_config(num_hidden_layers=3).save_pretrained(tmp_path / "local")
    cfg = memory.config_from_spec(_spec(model={"name": str(tmp_path / "local")}))
    assert cfg.num_hidden_layers == 3

    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(5)
    w.add_feed_forward_length(176)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(259)])
    w.add_tensor("token_embd.weight", np.zeros((259, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    spec = _spec(model={"name": str(tmp_path), "gguf_file": "m.gguf"})
    shape = memory.model_shape(memory.config_from_spec(spec))
    assert (shape.layers, shape.hidden, shape.kv_heads, shape.vocab, shape.tied_embeddings) == (5, 64, 2, 259, True)
    assert memory.estimate_for_spec(spec, device="cpu").total_bytes > 0


def test_spec_errors_name_the_field(tmp_path):
    from jobs.spec import SpecError

    with pytest.raises(SpecError, match="model.name"):
        memory.config_from_spec(_spec(model={"name": str(tmp_path / "missing")}))
    with pytest.raises(SpecError, match="lora target modules"):
        memory.estimate_for_spec(_spec(lora={"target_modules": ["c_attn"]}), device="cpu")


def test_gpu_benchmark_script_runs_on_cpu(tmp_path):
    """bench/gpu_memory.py's --dry-run path: same code as the GPU run, tiny shapes, CPU tracker."""
    import json

    from bench_scripts import load_bench

    bench = load_bench("gpu_memory")
    assert (
        bench.main(
            [
                "--dry-run",
                "--shapes",
                "tiny-gqa",
                "--seq-lens",
                "32",
                "--micro-batches",
                "1,2",
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    (out,) = tmp_path.glob("memory-*-cpu.json")
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert all(abs(r["rel_err"]) <= TOL for r in rows)


# ---- FSDP2: sharded weights, measured on 2 gloo ranks -------------------------------------------

# Odd sizes everywhere FSDP pads: vocab 301 and intermediate 161 rows, r = 5 (LoRA A's dim 0).
FSDP_CASE = dict(id="fsdp", vocab=301, intermediate=161, r=5, kv_heads=2)


def _local_storage_bytes(params) -> dict[str, int]:
    """Bytes of the storages one rank holds, once each: frozen and trainable (LoRA) apart. A
    DTensor's local shard lives in FSDP's padded storage, so its padding counts."""
    seen: set[int] = set()
    out = {"frozen": 0, "lora": 0}
    for p in params:
        t = p.to_local() if hasattr(p, "to_local") else p
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out["lora" if p.requires_grad else "frozen"] += st.nbytes()
    return out


class GatheredPeak(TorchDispatchMode):
    """The most FSDP2 holds all-gathered at once, checked after every op run under it: the
    unsharded parameters of every unit and the flat all-gather buffers (a unit's own, awaiting
    its copy-out, and the one forward keeps until the next copy-out), every storage once. Reads
    FSDP2's internals (torch 2.13 `FSDPParamGroup`): a test instrument, not rayft's code.
    `units_in_backward`: which units were ever gathered after `backward` was set."""

    def __init__(self, root: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        super().__init__()
        self.groups = []
        for m in root.modules():
            if isinstance(m, FSDPModule):
                self.groups += [g for g in m._get_fsdp_state()._fsdp_param_groups if g not in self.groups]
        self.peak = 0
        self.backward = False
        self.units_in_backward: set[str] = set()

    def gathered(self) -> int:
        live: dict[int, int] = {}

        def add(t: torch.Tensor) -> bool:
            st = t.untyped_storage()
            if st.nbytes():
                live[st.data_ptr()] = st.nbytes()
            return st.nbytes() > 0

        for g in self.groups:
            own = [add(t) for fp in g.fsdp_params for t in (*fp.all_gather_outputs, *fp._unsharded_inner_tensors)]
            if g._all_gather_result is not None:
                own.append(add(g._all_gather_result.all_gather_output))
            if self.backward and any(own):
                self.units_in_backward.add(g._module_fqn)
            held = getattr(g.comm_ctx, "all_gather_state", None)  # set at the lazy init
            if held is not None:
                add(held.all_gather_result.all_gather_output)
        return sum(live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.gathered())
        return out


# (case, reshard_after_forward) pairs whose all-gathered peak the two ranks measure: the layers,
# the embeddings or the head the largest unit; tied embeddings; the chunked loss head.
GATHERED_CASES = [
    (FSDP_CASE, True),
    (FSDP_CASE, False),
    ({**FSDP_CASE, "gc": True}, True),
    ({**FSDP_CASE, "id": "big-vocab", "vocab": 1001, "gc": True}, True),
    ({**FSDP_CASE, "id": "big-vocab-chunks", "vocab": 1001, "chunk": 16}, False),
    ({**FSDP_CASE, "id": "tied", "vocab": 1001, "tied": True}, True),
    ({**FSDP_CASE, "id": "tied", "vocab": 1001, "tied": True, "gc": True}, False),
]


def _gathered_peak(kw: dict, reshard: bool) -> dict:
    """One forward + backward of `Case(**kw)` sharded by `jobs.train.fsdp.shard`: the all-gathered peak,
    and which units were gathered in backward."""
    from jobs.train import fsdp

    case = Case(**kw)
    model = build(case)
    module = fsdp.shard(loss_module(model, case), model, case.dtype, reshard, torch.device("cpu"), 2)
    units = fsdp.units(model)
    batch = batch_for(case)
    with GatheredPeak(module) as mode:
        loss = module(**batch)
        mode.backward = True
        loss.backward()
    names = {n: m for n, m in model.get_base_model().named_modules()}
    embeddings = None if units.tied else next(n for n, m in names.items() if m is units.embeddings)
    return {
        "peak": mode.peak,
        "embeddings_in_backward": any(embeddings and n.endswith(embeddings) for n in mode.units_in_backward),
    }


WINDOW = 3  # micro-steps of the measured accumulation window; the gate is off on the first two
WINDOW_RUNS = {"fsdp-fp32": ("fsdp", "fp32"), "fsdp-bf16": ("fsdp", "bf16"), "ddp-fp32": ("ddp", "fp32")}


def _storage_bytes(tensors) -> int:
    """Bytes of the storages of `tensors`, once each (a freed storage has none)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _unsharded_grads(module) -> list[torch.Tensor]:
    """FSDP2's gradients accumulated unsharded while the gate is off (torch 2.13 `FSDPParam`: upcast
    to the reduce dtype in `unsharded_accumulated_grad`, else on the unsharded parameter)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for fp in (fp for g in m._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params):
                grad = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
                out += [t for t in (fp.unsharded_accumulated_grad, grad) if t is not None]
    return out


def _wrapped(strategy: str, case: Case):
    """The case's model and loss as `jobs.train.loop` runs them: sharded by `jobs.train.fsdp.shard`, or in DDP
    with bucket views; with its gate (`Engine.sync_gate`) and every gradient storage it holds."""
    from jobs.train import fsdp

    model = build(case)
    if strategy == "fsdp":
        module = fsdp.shard(loss_module(model, case), model, case.dtype, True, torch.device("cpu"), 2)
        params = [p for p in model.parameters() if p.requires_grad]  # the shards replace the parameters
        return (
            module,
            params,
            lambda last: fsdp.gradient_sync(module, last),
            lambda: _unsharded_grads(module) + [p.grad.to_local() for p in params if p.grad is not None],
        )
    module = torch.nn.parallel.DistributedDataParallel(loss_module(model, case), gradient_as_bucket_view=True)
    params = [p for p in model.parameters() if p.requires_grad]
    return (
        module,
        params,
        lambda last: contextlib.nullcontext() if last else module.no_sync(),
        lambda: [p.grad for p in params if p.grad is not None],
    )


def _no_sync_window(strategy: str, dtype: str) -> dict:
    """Three windows of `WINDOW` micro-steps, the gradients set to None before each (`optimizer_step`'s
    `zero_grad`): in the third (DDP rebuilds its buckets once, in the forward after its first synced
    backward, so the second window starts with new ones), the bytes of
    every gradient storage alive after the gate-off micro-steps (DDP: and of the buckets its synced
    gradients were views of) and after the last, and what autograd keeps in a gate-off forward."""
    case = Case(**{**FSDP_CASE, "dtype": dtype})
    module, params, gate, held = _wrapped(strategy, case)
    batch, out, buckets = batch_for(case), {}, {}
    for window in range(3):
        for p in params:
            p.grad = None
        for j in range(WINDOW):
            saved: list[torch.Tensor] = []
            with gate(j == WINDOW - 1):
                with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
                    with autocast(case):
                        loss = module(**batch)
                loss.backward()
            if window == 2 and j == WINDOW - 2:
                weights = {
                    (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                    for p in module.parameters()
                }
                out["saved"] = _storage_bytes(t for t in saved if t.untyped_storage().data_ptr() not in weights)
                out["no_sync"] = _storage_bytes(held()) + sum(n for ref, n in buckets.values() if not ref.expired())
        out["synced"] = _storage_bytes(held())
        if strategy == "ddp":
            buckets = {st.data_ptr(): (StorageWeakRef(st), st.nbytes()) for st in (g.untyped_storage() for g in held())}
    return out


def _fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    """One of two gloo ranks: the case's model with PEFT LoRA, sharded by `jobs.train.fsdp.shard` as the
    loop does, then this rank's parameter bytes and the bytes autograd keeps after one forward;
    the all-gathered peak of each of `GATHERED_CASES`; and what an accumulation window holds
    (`_no_sync_window`)."""
    import json
    import os

    import torch.distributed as dist

    from jobs.train import fsdp

    torch.set_num_threads(1)
    try:
        case = Case(**FSDP_CASE)
        model = build(case)
        loss_mod = fsdp.shard(loss_module(model, case), model, case.dtype, True, torch.device("cpu"), 2)
        held = _local_storage_bytes(loss_mod.parameters())
        saved: list[tuple[str, torch.Tensor]] = []
        where = ["decoder"]
        hook = decoder_of(model).register_forward_hook(lambda m, a, o: where.__setitem__(0, "loss"))

        def pack(t):
            saved.append((where[0], t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_mod(**batch_for(case))
        hook.remove()
        # After forward each layer's gathered weights are freed (their storages are empty now); the
        # head's stay gathered and are parameters: weights, not activations, either way.
        params = {
            (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in loss_mod.parameters()
        }
        kept: dict[int, tuple[str, int]] = {}
        for w, t in saved:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in params:
                kept.setdefault(st.data_ptr(), (w, st.nbytes()))
        out = dict(
            held,
            decoder=sum(n for w, n in kept.values() if w == "decoder"),
            loss=sum(n for w, n in kept.values() if w == "loss"),
        )
        loss.backward()  # the sharded model trains: the LoRA shards get gradients
        # FSDP2 hands each shard's gradient out of one reduce-scatter buffer: count storages once.
        grads = {
            p.grad.to_local().untyped_storage().data_ptr(): p.grad.to_local().untyped_storage().nbytes()
            for p in loss_mod.parameters()
            if p.requires_grad
        }
        out["lora_grads"] = sum(grads.values())
        out["gathered"] = [_gathered_peak(kw, reshard) for kw, reshard in GATHERED_CASES]
        out["window"] = {key: _no_sync_window(*run) for key, run in WINDOW_RUNS.items()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_measured(tmp_path_factory) -> list[dict]:
    import json

    from gloo_pool import run_on_ranks

    out = tmp_path_factory.mktemp("fsdp")
    run_on_ranks(_fsdp_worker, 2, out / "ranks", str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_fsdp_sharded_weights_match_fully_shard_on_two_ranks(fsdp_measured):
    """Every rank holds exactly the frozen and LoRA bytes the estimate names for FSDP over 2
    (dim 0 padded to a multiple of 2); LoRA gradients are sharded alike; DDP holds it all."""
    case = Case(**FSDP_CASE)
    fsdp = case.estimate(strategy="fsdp", world_size=2).components
    ddp = case.estimate(world_size=2).components
    for rank in fsdp_measured:
        assert rank["frozen"] == fsdp["frozen_weights"]
        assert rank["lora"] == fsdp["lora_weights"] == fsdp["lora_grads"] == rank["lora_grads"]
    # The padding is real: an unpadded half of DDP's bytes would be less.
    assert fsdp["frozen_weights"] > ddp["frozen_weights"] / 2 and fsdp["lora_weights"] > ddp["lora_weights"] / 2
    assert fsdp["ddp_buckets"] == 0 and fsdp["fsdp_gathered"] > 0 and ddp["fsdp_gathered"] == 0


@pytest.mark.slow
def test_fsdp_keeps_the_same_activations(fsdp_measured):
    """Sharding changes where weights live, not what autograd keeps: the saved bytes on each rank
    equal the unsharded model's, and the estimate's activations are the same for both strategies."""
    case = Case(**FSDP_CASE)
    plain = saved_bytes(case)
    for rank in fsdp_measured:
        assert (rank["decoder"], rank["loss"]) == (plain["decoder"], plain["loss"])
    est = {s: case.estimate(strategy=s, world_size=2).components for s in ("ddp", "fsdp")}
    assert est["ddp"]["activations"] == est["fsdp"]["activations"]
    assert abs(rel(est["fsdp"]["activations"], plain["decoder"])) <= TOL_SAVED


@pytest.mark.slow
def test_fsdp_gathered_units_match_fully_shard_on_two_ranks(fsdp_measured):
    """The most FSDP2 holds all-gathered at once over forward + backward, every storage counted
    (unsharded parameters and all-gather buffers), equals the estimate's `fsdp_gathered` for
    `jobs.train.fsdp`'s units: layers, embeddings or head the largest unit, resharding after forward
    or not, tied embeddings, the chunked loss head. Resharding after forward, the untied
    embeddings are not gathered in backward (frozen, fed token ids: nothing of them is needed)."""
    for (kw, reshard), *ranks in zip(GATHERED_CASES, *(r["gathered"] for r in fsdp_measured), strict=True):
        est = Case(**kw).estimate(strategy="fsdp", world_size=2, reshard_after_forward=reshard)
        for rank in ranks:
            assert rank["peak"] == est.components["fsdp_gathered"], (kw, reshard, est.details["fsdp_unit_bytes"])
            # resharding, the embeddings are not gathered again in backward; kept, they are still held
            assert rank["embeddings_in_backward"] == (not reshard and not kw.get("tied")), (kw, reshard)


@pytest.mark.slow
def test_a_no_sync_window_holds_what_the_estimate_counts(fsdp_measured):
    """An accumulation window of 3 micro-steps, the gate off on the first two, on 2 gloo ranks: after
    them each rank holds the whole LoRA gradient -- FSDP2 unsharded (in fp32 under bf16 too), DDP in
    fresh tensors beside its buckets -- which is `lora_grads` + `no_sync_grads` (+ `ddp_buckets`) at
    grad_accum_steps=3; after the last micro-step the shards (FSDP) or the buckets (DDP) alone,
    `lora_grads`. A gate-off forward keeps what a synced one keeps."""
    plain = saved_bytes(Case(**FSDP_CASE))
    for key, (strategy, dtype) in WINDOW_RUNS.items():
        est = (
            Case(**{**FSDP_CASE, "dtype": dtype})
            .estimate(strategy=strategy, world_size=2, grad_accum_steps=WINDOW)
            .components
        )
        assert est["no_sync_grads"] > 0
        for rank in fsdp_measured:
            window = rank["window"][key]
            assert window["no_sync"] == est["lora_grads"] + est["no_sync_grads"] + est["ddp_buckets"], key
            assert window["synced"] == est["lora_grads"], key
    for rank in fsdp_measured:
        assert rank["window"]["fsdp-fp32"]["saved"] == rank["decoder"] + rank["loss"]
        assert rank["window"]["ddp-fp32"]["saved"] == plain["decoder"] + plain["loss"]


def test_fsdp_gathered_layers_and_resharding():
    """What is gathered at the peak, unit by unit (`jobs.train.fsdp.units`: embeddings E, each layer l,
    [final norm, LM head] H): resharding after forward, two units' worth of the largest; keeping
    them gathered, the embeddings and every layer beside the head and one more unit's buffer; tied
    embeddings, their one unit beside the layers. The sharded part shrinks with the world size, the
    gathered part does not."""
    cfg = _llama(num_hidden_layers=6)
    shape = memory.model_shape(cfg)
    kw = dict(
        micro_batch_size=1,
        seq_len=8,
        gradient_checkpointing=False,
        base_dtype="bf16",
        lora_r=8,
        strategy="fsdp",
        world_size=4,
        device="cpu",
    )
    reshard = estimate(cfg, reshard_after_forward=True, **kw).components
    keep = estimate(cfg, reshard_after_forward=False, **kw).components
    params = memory.count_base_params(shape)
    E, H = 2 * params["embeddings"], 2 * (params["final_norm"] + params["lm_head"])
    lora_layer = memory.count_lora_params(shape, 8, DEFAULT_TARGET_MODULES) // 6
    layer = 2 * (params["layers"] // 6 + lora_layer)  # frozen + LoRA, gathered in bf16
    assert layer > H > E  # (300 x 64 embeddings: no padding over 4 ranks)
    assert reshard["fsdp_gathered"] == 2 * layer
    assert keep["fsdp_gathered"] == E + 6 * layer + H + layer
    # Resharding, the old root unit (embeddings, norm and head gathered all along) is gone.
    assert reshard["fsdp_gathered"] < E + H + 2 * layer
    wide = _llama(num_hidden_layers=6, vocab_size=3000)  # the embeddings and the head outgrow a layer
    E_wide, H_wide = 2 * 3000 * 64, 2 * (3000 * 64 + 64)
    assert estimate(wide, reshard_after_forward=True, **kw).components["fsdp_gathered"] == 2 * H_wide
    assert (
        estimate(wide, reshard_after_forward=False, **kw).components["fsdp_gathered"] == E_wide + 6 * layer + 2 * H_wide
    )
    tied = _llama(num_hidden_layers=6, tie_word_embeddings=True)
    T = 2 * (params["embeddings"] + params["final_norm"])  # one unit: embeddings (= LM head) and norm
    assert estimate(tied, reshard_after_forward=True, **kw).components["fsdp_gathered"] == T + 2 * layer
    assert estimate(tied, reshard_after_forward=False, **kw).components["fsdp_gathered"] == T + 7 * layer
    eight = estimate(cfg, reshard_after_forward=True, **{**kw, "world_size": 8}).components
    # The gathered units do not shrink with the world size; only dim 0's padding to a multiple of
    # the world size (part of the all-gathered storage) can grow them.
    assert eight["frozen_weights"] < reshard["frozen_weights"]
    assert reshard["fsdp_gathered"] <= eight["fsdp_gathered"] < 1.01 * reshard["fsdp_gathered"]


def test_parameter_shapes_add_up_to_the_counts():
    for cfg in (
        _llama(),
        _llama(tie_word_embeddings=True),
        Case("q", arch="qwen2").config(),
        Case("n", arch="gpt_neox").config(),
    ):
        shape = memory.model_shape(cfg)
        listed = sum(
            math.prod(d) * (shape.layers if w == "layer" else 1) for w, _, d in memory.base_param_shapes(shape)
        )
        assert listed == sum(memory.count_base_params(shape).values())


# ---- quantized bases: the bytes bitsandbytes allocates ------------------------------------------


def _quantize_linears(model, quantization: str):
    """Every decoder-layer nn.Linear replaced by bitsandbytes' (nf4: `Linear4bit` with double-
    quantized constants, blocks of 64, as HF's `bnb_4bit_use_double_quant` loads it; int8:
    `Linear8bitLt`); embeddings, LM head, norms and biases untouched, as HF leaves them."""
    import bitsandbytes as bnb

    for layer in model.base_model.layers:
        for name, mod in list(layer.named_modules()):
            if not isinstance(mod, torch.nn.Linear):
                continue
            parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
            w = mod.weight.data
            if quantization == "nf4":
                new = bnb.nn.Linear4bit(
                    mod.in_features,
                    mod.out_features,
                    bias=mod.bias is not None,
                    compute_dtype=w.dtype,
                    compress_statistics=True,
                    quant_type="nf4",
                )
                new.weight = bnb.nn.Params4bit(
                    w, requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=memory.NF4_BLOCK
                )
            else:
                new = bnb.nn.Linear8bitLt(
                    mod.in_features, mod.out_features, bias=mod.bias is not None, has_fp16_weights=False
                )
                new.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
            if mod.bias is not None:
                new.bias = torch.nn.Parameter(mod.bias.data, requires_grad=False)
            setattr(parent, name.rpartition(".")[2], new.to("cpu"))  # .to quantizes
    return model


def _allocated_bytes(model) -> int:
    """Every storage the model's parameters hold, and their quantization constants, once each."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _weight_tensors(model)}.values())


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
@pytest.mark.parametrize(
    "case", [Case("tiny-llama"), Case("qwen2-odd", arch="qwen2", intermediate=161, vocab=301)], ids=lambda c: c.id
)
def test_quantized_weights_match_bitsandbytes(case, quantization):
    """The estimate's frozen weights for a quantized base equal the bytes bitsandbytes allocates:
    4-bit codes + uint8 block constants + their fp32 constants and code books (nf4), int8 + fp32
    row scales (int8); unquantized embeddings, LM head, norms and biases in bf16."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from jobs.model.loading import tiny_llama_config

    cfg = tiny_llama_config() if case.id == "tiny-llama" else case.config()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if quantization == "nf4" else torch.float16  # LLM.int8() computes in fp16
    model = _quantize_linears(AutoModelForCausalLM.from_config(cfg).to(dtype), quantization)
    est = estimate(
        cfg,
        micro_batch_size=1,
        seq_len=8,
        gradient_checkpointing=False,
        base_dtype="bf16",
        quantization=quantization,
        device="cpu",
    ).components
    assert est["frozen_weights"] == _allocated_bytes(model)
    plain = estimate(
        cfg, micro_batch_size=1, seq_len=8, gradient_checkpointing=False, base_dtype="bf16", device="cpu"
    ).components
    assert est["frozen_weights"] < plain["frozen_weights"]
    with torch.no_grad():  # the quantized model runs
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits.float()).all()


def test_quantization_shrinks_a_70b_base():
    """Llama-3-70B shape: bf16 needs ~131 GiB for the base; nf4 about 0.5 byte per decoder weight
    (+ ~1.6% constants) plus the bf16 embeddings and LM head; int8 about 1 byte."""
    cfg = _llama(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    kw = dict(micro_batch_size=1, seq_len=8, gradient_checkpointing=True)
    params = memory.count_base_params(memory.model_shape(cfg))
    bf16, nf4, int8 = (
        estimate(cfg, quantization=q, **kw).components["frozen_weights"] for q in ("none", "nf4", "int8")
    )
    head = 2 * (params["embeddings"] + params["lm_head"] + params["final_norm"])
    assert bf16 == 2 * sum(params.values())
    linear = params["layers"] - 80 * 2 * 8192  # the norms stay bf16
    assert 0.5 * linear < nf4 - head - 2 * 80 * 2 * 8192 < 0.52 * linear
    assert linear < int8 - head - 2 * 80 * 2 * 8192 < 1.001 * linear


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_quantized_weights_match_what_rayft_loads(quantization):
    """The same equality for the base `jobs.model.loading.load_base_model` builds for a QLoRA job (through
    transformers' BitsAndBytesConfig), judged by the spec's own estimate."""
    pytest.importorskip("bitsandbytes")
    from jobs.model.loading import load_base_model

    spec = _spec(model={"name": "tiny-llama", "quantization": quantization}, precision="bf16")
    model, _ = load_base_model(spec, "bf16")
    est = memory.estimate_for_spec(spec, gradient_checkpointing=False, device="cpu")
    assert est.components["frozen_weights"] == _allocated_bytes(model)
    assert est.details["quantization"] == quantization


@pytest.mark.parametrize("quantization", ["none", "nf4", "int8"])
def test_quantized_base_keeps_the_same_activations(quantization):
    """Over a bitsandbytes base the LoRA model keeps for backward exactly what it keeps over a bf16
    base (the quantized matmuls save their frozen weight, not their input): the estimate's
    activations, unchanged by quantization, match the saved bytes of the model rayft builds."""
    if quantization != "none":
        pytest.importorskip("bitsandbytes")
    from jobs.model.loading import add_lora, load_base_model

    spec = _spec(model={"name": "tiny-llama", "quantization": quantization}, precision="bf16", lora={"r": 4})
    model, _ = load_base_model(spec, "bf16")
    model = add_lora(model, spec, "bf16")
    model.train()
    weights = {t.untyped_storage().data_ptr() for t in _weight_tensors(model)}
    kept: dict[int, tuple[str, int]] = {}
    where = ["decoder"]
    hook = model.get_base_model().model.register_forward_hook(lambda m, a, o: where.__setitem__(0, "loss"))

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights and st.nbytes():
            kept.setdefault(st.data_ptr(), (where[0], st.nbytes()))
        return t

    B, S = 2, 32
    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = CausalLMLoss(model)(input_ids=ids, label_pos=torch.arange(B * S), label_ids=ids.view(-1))
    hook.remove()
    decoder = sum(n for w, n in kept.values() if w == "decoder")
    est = estimate(
        model.config,
        micro_batch_size=B,
        seq_len=S,
        gradient_checkpointing=False,
        base_dtype="bf16",
        lora_r=4,
        quantization=quantization,
        device="cpu",
    ).components
    assert est["activations"] == decoder
    loss.backward()  # and it trains
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _qlora_fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    """One of two gloo ranks: the nf4 tiny-llama `jobs.model.loading.load_base_model` builds, with LoRA
    (r = 5: odd, so the LoRA A shards are padded), sharded by `jobs.train.fsdp.shard` as the loop does;
    then what this rank holds (every parameter's local shard storage, and the quantization
    constants, which are no parameters) and, inside the first layer's forward, the storages of
    that layer's all-gathered parameters."""
    import json
    import os

    import torch.distributed as dist

    from jobs.model.loading import add_lora, load_base_model
    from jobs.train import fsdp

    torch.set_num_threads(1)
    try:
        spec = _spec(**QLORA_FSDP_SPEC)
        model = add_lora(load_base_model(spec, "bf16")[0], spec, "bf16")
        model.train()
        module = fsdp.shard(CausalLMLoss(model), model, "bf16", True, torch.device("cpu"), 2)
        held = _local_storage_bytes(module.parameters())
        consts = {}
        for m in module.modules():
            # fully_shard replaces the Params4bit by a DTensor; bitsandbytes' Linear4bit keeps its
            # own reference to the quant_state, which is where the constants live on.
            for qs in (getattr(getattr(m, "weight", None), "quant_state", None), getattr(m, "quant_state", None)):
                for st in (qs, getattr(qs, "state2", None)):
                    if st is not None:
                        for t in (st.absmax, st.code, getattr(st, "offset", None)):
                            if t is not None:
                                consts[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        layer = model.get_base_model().model.layers[0]
        gathered: dict[int, tuple[int, bool, str]] = {}

        def hold(mod, args, out):
            for p in layer.parameters():
                st = p.untyped_storage()
                gathered[st.data_ptr()] = (st.nbytes(), p.requires_grad, str(p.dtype))

        hook = layer.self_attn.register_forward_hook(hold)
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(rank))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module(input_ids=ids, label_pos=torch.arange(16), label_ids=ids.view(-1))
        hook.remove()
        loss.backward()
        out = dict(
            held,
            constants=sum(consts.values()),
            n_constants=len(consts),
            gathered_frozen=sum(n for n, rg, _ in gathered.values() if not rg),
            gathered_lora=sum(n for n, rg, _ in gathered.values() if rg),
            gathered_dtypes=sorted({d for _, rg, d in gathered.values() if not rg}),
        )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


QLORA_FSDP_SPEC = dict(
    model={"name": "tiny-llama", "quantization": "nf4"},
    precision="bf16",
    lora={"r": 5},
    resources={"num_workers": 2, "strategy": "fsdp"},
)


@pytest.mark.slow  # ~20 s: two spawned ranks loading bitsandbytes
def test_fsdp_over_an_nf4_base_matches_fully_shard_on_two_ranks(tmp_path):
    """QLoRA under FSDP2 on 2 gloo ranks: each rank holds exactly the estimate's frozen bytes --
    its dim-0 shard of every parameter, the 4-bit weights as packed uint8 ([ceil(n/2), 1], padded
    to a multiple of 2), plus every quantization constant whole (`quant_state` is no parameter,
    fully_shard leaves it on each rank) -- and the LoRA bytes; a layer's all-gather brings the
    packed uint8 bytes (not de-quantized, not cast to bf16) beside its LoRA in bf16."""
    pytest.importorskip("bitsandbytes")
    import json

    from gloo_pool import run_on_ranks

    run_on_ranks(_qlora_fsdp_worker, 2, tmp_path / "ranks", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    spec = _spec(**QLORA_FSDP_SPEC)
    est = memory.estimate_for_spec(spec, gradient_checkpointing=False, device="cpu")
    unsharded = memory.estimate_for_spec(spec, gradient_checkpointing=False, device="cpu", strategy="ddp")
    assert est.details["strategy"] == "fsdp" and est.details["quantization"] == "nf4"
    gathered = est.details["fsdp_gathered_layer_bytes"]
    for rank in ranks:
        assert rank["frozen"] + rank["constants"] == est.components["frozen_weights"]
        assert rank["lora"] == est.components["lora_weights"]
        assert (rank["gathered_frozen"], rank["gathered_lora"]) == (gathered["frozen"], gathered["lora"])
        assert "torch.uint8" in rank["gathered_dtypes"]
        # Not every constant is sharded away: each rank's constants are the whole model's.
        assert rank["constants"] > 0 and rank["frozen"] < unsharded.components["frozen_weights"] - rank["constants"]
    # The constants stay whole: sharding them too would give less than the measured bytes.
    layers = memory.model_shape(memory.config_from_spec(spec)).layers
    assert est.components["frozen_weights"] - est.details["frozen_root_bytes"] > layers * gathered["frozen"] / 2


def _weight_tensors(model) -> list[torch.Tensor]:
    """Parameters and their bitsandbytes quantization constants: weights, not activations."""
    out = []
    for p in model.parameters():
        out.append(p)
        qs = getattr(p, "quant_state", None)
        for st in (qs, getattr(qs, "state2", None)):
            if st is not None:
                out += [t for t in (st.absmax, st.code, getattr(st, "offset", None)) if t is not None]
        if getattr(p, "SCB", None) is not None:
            out.append(p.SCB)
    return out
