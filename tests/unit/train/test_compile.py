"""`model.compile`: decoder layers through torch.compile train exactly like eager ones."""

from __future__ import annotations

import pytest
from gradtools import final_adapter, rel_err, tiny_spec
from runs import metric_lines

from jobs.errors import SpecError
from jobs.model.loading import compile_wanted
from jobs.train.context import LocalContext
from jobs.train.loop import train


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
        summary = train(spec, LocalContext(on_progress=lambda r: None), resume=False)
        assert summary["compiled_layers"] is compiled
        runs[compiled] = ([r["loss"] for r in metric_lines(out)], final_adapter(out))
        if not compiled:
            assert counters["stats"]["unique_graphs"] == 0
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really compiled the layers
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert rel_err(runs[True][1], runs[False][1]) <= 1e-5
    assert runs[True][0][0] != runs[True][0][-1]
    torch._dynamo.reset()


def test_compile_auto_is_on_for_an_unquantized_base_on_a_gpu_only():
    """`model.compile: auto` (the default) compiles where it was measured to pay off: a CUDA
    device and an unquantized base; true and false are taken as written on any device."""
    model = tiny_spec().model
    assert model.compile == "auto"
    for device, quantization, wanted in [
        ("cuda", "none", True),
        ("cpu", "none", False),
        ("cuda", "nf4", False),
        ("cuda", "int8", False),
        ("cpu", "nf4", False),
    ]:
        m = model.model_copy(update={"quantization": quantization})
        assert compile_wanted(m, device) is wanted, (device, quantization)
    for written, wanted in (("true", True), ("false", False)):
        m = tiny_spec(f"model.compile={written}").model
        for device in ("cuda", "cpu"):
            assert compile_wanted(m.model_copy(update={"quantization": "nf4"}), device) is wanted
            assert compile_wanted(m, device) is wanted


def test_compile_refuses_a_value_other_than_auto_true_false():
    with pytest.raises(SpecError, match="model.compile") as err:
        tiny_spec("model.compile=sometimes")
    assert "\n" not in str(err.value)
