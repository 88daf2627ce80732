"""What rayft's commands print first is rayft's own: the deprecation notice transformers raises
when PEFT probes its `is_gradient_checkpointing` alias is dropped wherever rayft wraps a model
in PEFT (training, `rayft eval`, `rayft export`), and only there."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from gradtools import tiny_spec

from jobs.model.loading import load_base_model, without_peft_alias_notice

ROOT = Path(__file__).resolve().parents[3]
NOTICE = "is_gradient_checkpointing"


def _notices_when_wrapped(quiet: bool) -> list[str]:
    from peft import LoraConfig, get_peft_model

    model, _ = load_base_model(tiny_spec(), "fp32")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with without_peft_alias_notice() if quiet else warnings.catch_warnings():
            get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    return [str(w.message) for w in seen if NOTICE in str(w.message)]


def test_the_alias_notice_is_dropped_when_rayft_wraps_a_model():
    assert _notices_when_wrapped(quiet=False), "the notice no longer comes: this test can retire"
    assert _notices_when_wrapped(quiet=True) == []


@pytest.mark.parametrize("module", ["after/evaluate.py", "after/evaluate_preference.py", "after/export.py"])
def test_every_command_that_loads_an_adapter_goes_through_the_one_rule(module):
    source = (ROOT / "jobs" / module).read_text()
    assert "PeftModel.from_pretrained" in source and "with without_peft_alias_notice():" in source
    assert "filterwarnings" not in source  # the rule lives in jobs.model.loading only
