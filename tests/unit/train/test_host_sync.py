"""No host synchronization inside the accumulation window.

Oracle: every op that copies a device scalar to the host (`aten._local_scalar_dense`, behind
`.item()`, `bool(t)`, `if t:`; `aten.is_nonzero`) is recorded by a TorchDispatchMode while
`train_window` runs forward and backward of all micro-batches. On a GPU each such op would stall
the CPU until the device drained its queue. The count must be zero on every path: ragged padded
micro-batches, packed rows, checkpointing, chunked loss.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from gradtools import build_engine, tiny_spec
from torch.utils._python_dispatch import TorchDispatchMode

import jobs.model.loading
from jobs.data import GlobalBatches, collate, count_labels, load_dataset, split_window
from jobs.train.loop import CausalLMLoss
from jobs.train.step import train_window

SYNC_OPS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")


class HostSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(SYNC_OPS):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _window(packing: bool, gc: bool, chunk: int = 0):
    spec = tiny_spec("batch.micro_batch_size=4", f"memory.loss_chunk_tokens={chunk}")
    engine, model, tok = build_engine(spec, gc=gc)
    if chunk:
        engine.module = CausalLMLoss(model, chunk_tokens=chunk)
    data = load_dataset(spec, tok)
    idx = GlobalBatches(len(data.train), spec.batch.global_batch_size, spec.run.seed).indices(0)
    mine = split_window(idx, 0, 1, spec.batch.micro_batch_size, spec.grad_accum_steps)
    layout = {"pack_tokens": spec.data.max_seq_len} if packing else {}
    mbs = [collate([data.train[i] for i in mb], tok.pad_token_id, **layout) for mb in mine]
    assert any("seq_ids" in mb for mb in mbs) == packing
    assert len({tuple(mb["input_ids"].shape) for mb in mbs}) > 1 or packing  # ragged: padding in play
    return engine, mbs, count_labels(data.train, idx)


@pytest.mark.parametrize(
    "packing,gc,chunk",
    [(False, False, 0), (False, True, 0), (True, False, 0), (True, True, 0), (False, False, 16)],
    ids=["padded", "padded-checkpointing", "packed", "packed-checkpointing", "chunked-loss"],
)
def test_no_host_sync_inside_the_window(packing, gc, chunk):
    engine, mbs, n_labels = _window(packing, gc, chunk)
    with HostSyncs() as mode:
        loss = train_window(engine, mbs, n_labels)
    assert mode.ops == []
    assert loss.item() > 0 and all(p.grad is not None for p in engine.params)


def test_the_oracle_sees_transformers_own_sync(monkeypatch):
    """Without rayft's guard, transformers' packed-sequence detection syncs once per forward."""
    from transformers import masking_utils

    engine, mbs, n_labels = _window(False, False)  # loads the model: the guard is installed
    monkeypatch.setattr(
        masking_utils, "find_packed_sequence_indices", inspect.unwrap(masking_utils.find_packed_sequence_indices)
    )
    with HostSyncs() as mode:
        train_window(engine, mbs, n_labels)
    assert len(mode.ops) == len(mbs)


def test_the_guard_is_installed_once_at_model_load():
    from transformers import masking_utils

    build_engine(tiny_spec())
    guard = masking_utils.find_packed_sequence_indices
    original = inspect.unwrap(guard)
    assert guard is not original
    assert guard(torch.tensor([[0, 1, 0, 1]])) is None
    assert original(torch.tensor([[0, 1, 0, 1]])) is not None
    jobs.model.loading.skip_packed_sequence_detection()
    assert masking_utils.find_packed_sequence_indices is guard and inspect.unwrap(guard) is original
