"""Oracles for the heart of the project: accumulation == big batch, one all-reduce per step.

Global batch 8 of ragged sequences; N accumulation steps x W workers x m micro-batch with
N in {1, 2, 4} and W in {1, 2}. The reference is the same 8 sequences in one forward and
backward, loss = sum of token losses / token count. These fail on a mean of per-micro-batch
means (wrong weighting of ragged micro-batches), on a missing W factor under DDP averaging,
on a GradScaler unscaled twice or never, and on all-reduces inside the accumulation window.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gradtools import (
    accumulated_grads,
    build_engine,
    grads,
    reference_grads,
    rel_err,
    sgd_update,
    spawn,
    tiny_spec,
    window_inputs,
)

from jobs.train.step import train_window

# (workers, micro_batch_size) for global batch 8 -> N = 8 / (W * m)
SPLITS = [(1, 8), (1, 4), (1, 2), (2, 4), (2, 2), (2, 1)]


def _split_overrides(w: int, m: int) -> tuple:
    return (f"resources.num_workers={w}", f"batch.micro_batch_size={m}")


@pytest.mark.parametrize("gc", [False, True], ids=["no-gc", "gc"])
@pytest.mark.parametrize("w,m", SPLITS, ids=[f"W{w}xN{8 // (w * m)}xm{m}" for w, m in SPLITS])
def test_accumulated_gradient_equals_big_batch_fp32(w, m, gc, tmp_path):
    spec = tiny_spec(*_split_overrides(w, m))
    ref = reference_grads(spec, gc=False)
    if w == 1:
        got = accumulated_grads(0, 1, _split_overrides(w, m), gc, "fp32")
    else:
        per_rank = spawn(accumulated_grads, w, tmp_path, _split_overrides(w, m), gc, "fp32")
        # After the synchronizing micro-step every rank holds the same reduced gradient.
        assert rel_err(per_rank[1], per_rank[0]) == 0.0
        got = per_rank[0]
    assert len(got) == len(ref) > 0
    assert rel_err(got, ref) <= 1e-5


PACKED_SPLITS = [(1, 4), (2, 4), (2, 2)]


@pytest.mark.parametrize("w,m", PACKED_SPLITS, ids=[f"W{w}xN{8 // (w * m)}xm{m}" for w, m in PACKED_SPLITS])
def test_packed_accumulation_equals_the_unpacked_big_batch(w, m, tmp_path):
    """data.packing under DDP and accumulation: packed micro-batches, one unpacked reference."""
    over = (*_split_overrides(w, m), "data.packing=true")
    spec = tiny_spec(*over)
    _, tok = build_engine(spec, optimizer=False)[1:]
    packed = [mb for r in range(w) for mb in window_inputs(spec, tok, r, w)[0] if "seq_ids" in mb]
    assert packed, "no micro-batch was packed: the test would not exercise packing"
    ref = reference_grads(tiny_spec(*_split_overrides(w, m)))
    if w == 1:
        got = accumulated_grads(0, 1, over, False, "fp32")
    else:
        per_rank = spawn(accumulated_grads, w, tmp_path, over, False, "fp32")
        assert rel_err(per_rank[1], per_rank[0]) == 0.0
        got = per_rank[0]
    assert rel_err(got, ref) <= 1e-5


def test_mean_of_micro_means_would_be_caught():
    """Guard on the oracle itself: the naive normalization is measurably wrong on this data."""
    spec = tiny_spec("batch.micro_batch_size=2")
    ref = reference_grads(spec)
    engine, model, tok = build_engine(spec)
    mbs, _, _, _ = window_inputs(spec, tok, 0, 1)
    for mb in mbs:  # per-micro-batch mean, averaged over micro-steps
        (engine.module(**mb) / len(mb["label_ids"]) / len(mbs)).backward()
    assert rel_err(grads(model), ref) > 1e-3


@pytest.mark.parametrize("w,m", [(1, 2), (2, 2)], ids=["W1xN4", "W2xN2"])
def test_fp16_scaler_path_unscales_exactly_once(w, m, tmp_path):
    """fp16 autocast + GradScaler (initial scale 2**16), full optimizer_step with SGD(lr=1):
    the applied update must be the big-batch gradient. Bound: 2e-2 relative, from fp16
    rounding of activations (the scale factor itself is exact: a power of two). Unscaling
    twice or never would be off by a factor of 65536."""
    spec = tiny_spec(*_split_overrides(w, m))
    ref = reference_grads(spec, precision="fp16")
    if w == 1:
        delta, scale = sgd_update(0, 1, _split_overrides(w, m), "fp16")
    else:
        delta, scale = spawn(sgd_update, w, tmp_path, _split_overrides(w, m), "fp16")[0]
    assert scale == 2.0**16
    assert rel_err(delta, ref) <= 2e-2
    # and fp16 agrees with the fp32 gradient to the same stated bound
    assert rel_err(delta, reference_grads(spec)) <= 2e-2


def _count_allreduces(rank: int, world: int, micro: int):
    spec = tiny_spec(f"resources.num_workers={world}", f"batch.micro_batch_size={micro}")
    engine, model, tok = build_engine(spec, world_size=world)
    calls = {"n": 0}

    def hook(state, bucket):
        calls["n"] += 1
        t = bucket.buffer().div_(world)
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    engine.module.register_comm_hook(None, hook)
    per_step, differs = [], []
    for step in range(2):
        mbs, n_labels, _, _ = window_inputs(spec, tok, rank, world, step=step)
        before = calls["n"]

        def observe(j, step=step):
            # Accelerate's test_sync idea: inside the window each rank's gradient is its own;
            # after the last micro-step they agree.
            flat = torch.cat([p.grad.flatten() for p in engine.params])
            gathered = [torch.zeros_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            differs.append((step, j, not torch.equal(gathered[0], gathered[1])))

        train_window(engine, mbs, n_labels, after_micro_step=observe)
        per_step.append(calls["n"] - before)
        engine.optimizer.zero_grad(set_to_none=True)
    return per_step, differs, spec.grad_accum_steps


def test_one_allreduce_per_optimizer_step_and_grads_differ_until_sync(tmp_path):
    # Baseline: N=1 (no accumulation) tells how many buckets one sync reduces.
    base, _, n1 = spawn(_count_allreduces, 2, tmp_path / "a", 4)[0]
    per_step, differs, n4 = spawn(_count_allreduces, 2, tmp_path / "b", 1)[0]
    assert n1 == 1 and n4 == 4
    buckets = base[0]
    assert buckets >= 1 and base == [buckets, buckets]
    assert per_step == [buckets, buckets], "all-reduce must happen once per optimizer step, not per micro-step"
    for step, j, differ in differs:
        if j < n4 - 1:
            assert differ, f"step {step} micro-step {j}: gradients already synchronized inside no_sync"
        else:
            assert not differ, f"step {step}: gradients differ after the synchronizing micro-step"
