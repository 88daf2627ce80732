"""`model.compile`: decoder layers through torch.compile train exactly like eager ones."""

from __future__ import annotations

import pytest
from gradtools import final_adapter, rel_err, tiny_spec

from jobs.context import LocalContext
from jobs.loop import train
from jobs.outputs import read_metrics


@pytest.mark.slow
def test_compiled_layers_train_like_eager_layers(tmp_path):
    """Ragged micro-batches (so the compiled layer meets several sequence lengths) through
    checkpointing (so backward recomputes the compiled layer): same losses and adapter."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runs = {}
    for compiled in (False, True):
        out = tmp_path / str(compiled)
        spec = tiny_spec(
            "run.max_steps=3",
            "optim.lr=0.01",
            f"run.output_dir={out}",
            "batch.micro_batch_size=4",
            "memory.gradient_checkpointing=true",
            "data.group_by_length=false",
            f"model.compile={str(compiled).lower()}",
        )
        train(spec, LocalContext(on_progress=lambda r: None), resume=False)
        runs[compiled] = ([r["loss"] for r in read_metrics(out)], final_adapter(out))
        if not compiled:
            assert counters["stats"]["unique_graphs"] == 0
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really compiled the layers
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert rel_err(runs[True][1], runs[False][1]) <= 1e-5
    assert runs[True][0][0] != runs[True][0][-1]
    torch._dynamo.reset()
