"""Gradient checkpointing (non-reentrant, through PEFT): same gradients, fewer saved bytes."""

from __future__ import annotations

import torch
from gradtools import build_engine, grads, rel_err, tiny_spec, window_inputs

from jobs.train.step import train_window


def saved_bytes_and_grads(gc: bool) -> tuple[int, dict]:
    spec = tiny_spec("batch.micro_batch_size=8")
    engine, model, tok = build_engine(spec, gc=gc)
    mbs, n_labels, _, _ = window_inputs(spec, tok, 0, 1)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:  # weights are not activations
            storages[st.data_ptr()] = st.nbytes()
        return t

    # Forward only under the hook: what autograd keeps alive between forward and backward.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine.module(**mbs[0])
    (loss / n_labels).backward()
    return sum(storages.values()), grads(model)


def test_checkpointing_keeps_gradients_and_saves_fewer_bytes():
    off_bytes, off_grads = saved_bytes_and_grads(gc=False)
    on_bytes, on_grads = saved_bytes_and_grads(gc=True)
    assert rel_err(on_grads, off_grads) <= 1e-6
    assert on_bytes < 0.6 * off_bytes, (on_bytes, off_bytes)


def test_checkpointing_through_train_window_matches():
    spec = tiny_spec("batch.micro_batch_size=2")
    got = {}
    for gc in (False, True):
        engine, model, tok = build_engine(spec, gc=gc)
        mbs, n_labels, _, _ = window_inputs(spec, tok, 0, 1)
        train_window(engine, mbs, n_labels)
        got[gc] = grads(model)
    assert rel_err(got[True], got[False]) <= 1e-6


def test_chunked_loss_gives_the_same_gradient_and_keeps_fewer_logits():
    """memory.loss_chunk_tokens: the LM head + loss per chunk under checkpointing."""
    results = {}
    for chunk in (0, 7):
        spec = tiny_spec("batch.micro_batch_size=8", f"memory.loss_chunk_tokens={chunk}")
        engine, model, tok = build_engine(spec)
        engine.module.chunk_tokens = spec.memory.loss_chunk_tokens
        mbs, n_labels, _, _ = window_inputs(spec, tok, 0, 1)
        vocab = model.get_base_model().config.vocab_size
        logits_like = []

        def pack(t, vocab=vocab, logits_like=logits_like):
            if t.dim() == 2 and t.shape[-1] == vocab and t.dtype == torch.float32:
                logits_like.append(t.shape[0])
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = engine.module(**mbs[0])
        (loss / n_labels).backward()
        results[chunk] = (loss.item(), grads(model), max(logits_like, default=0))
    (l0, g0, rows0), (l7, g7, rows7) = results[0], results[7]
    assert abs(l7 - l0) <= 1e-5 * abs(l0)
    assert rel_err(g7, g0) <= 1e-6
    assert rows0 > 7 and rows7 == 0  # chunks recompute: no [tokens, vocab] fp32 tensor kept


def test_auto_checkpointing_picks_the_sparsest_layers_that_fit():
    from jobs.memory import estimate_for_spec
    from jobs.train.loop import memory_plan

    spec = tiny_spec("batch.micro_batch_size=8", "memory.gradient_checkpointing=auto")

    def gib(on: bool, every: int = 1) -> float:
        return estimate_for_spec(
            spec, gradient_checkpointing=on, device="cpu", checkpoint_every_n_layers=every
        ).total_gib

    off, every2, every1 = gib(False), gib(True, 2), gib(True, 1)
    assert off > every2 > every1  # tiny-llama has 2 layers: every 2nd = only the first
    cpu = torch.device("cpu")
    for budget, want in ((off * 1.01, 0), ((off + every2) / 2, 2), ((every2 + every1) / 2, 1), (every1 / 2, 1)):
        s = tiny_spec("batch.micro_batch_size=8", "memory.gradient_checkpointing=auto", f"memory.budget_gib={budget}")
        assert memory_plan(s, cpu).checkpoint_every_n_layers == want, (budget, want)
    assert memory_plan(tiny_spec("memory.gradient_checkpointing=true"), cpu).checkpoint_every_n_layers == 1
    assert memory_plan(tiny_spec("memory.gradient_checkpointing=false"), cpu).checkpoint_every_n_layers == 0
