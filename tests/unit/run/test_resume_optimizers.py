"""Every optimizer configuration rayft accepts resumes bit for bit: 2 steps, then 2 more from the
checkpoint, equal to 4 straight (adapter and losses). SGD without momentum keeps no optimizer
state, and resuming it raised torch's `AssertionError: Expected device to be set` from the
distributed-checkpoint loader (a traceback, exit 1)."""

from __future__ import annotations

import pytest
import torch
from gradtools import final_adapter, tiny_spec
from runs import metric_lines

from jobs.train.context import LocalContext
from jobs.train.loop import train

OPTIMIZERS = {
    "adamw": ("optim.name=adamw",),
    "adamw-decay": ("optim.name=adamw", "optim.weight_decay=0.1"),
    "sgd": ("optim.name=sgd", "optim.momentum=0.0", "optim.lr=0.1"),
    "sgd-momentum": ("optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.1"),
}


def _run(out, steps: int, *overrides: str) -> None:
    spec = tiny_spec(
        "optim.schedule=constant",
        "run.checkpoint_every=2",
        "run.keep_checkpoints=4",
        f"run.max_steps={steps}",
        f"run.output_dir={out}",
        *overrides,
    )
    train(spec, LocalContext(use_gpu=False, on_progress=lambda r: None))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_resumes_bit_for_bit(tmp_path, name):
    overrides = OPTIMIZERS[name]
    _run(tmp_path / "straight", 4, *overrides)
    _run(tmp_path / "resumed", 2, *overrides)
    _run(tmp_path / "resumed", 4, *overrides)
    a, b = final_adapter(tmp_path / "straight"), final_adapter(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    losses = [[r["loss"] for r in metric_lines(tmp_path / d)] for d in ("straight", "resumed")]
    assert losses[0] == losses[1] and len(losses[0]) == 4
