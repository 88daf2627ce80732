"""The de-quantized copy of a GGUF base (`jobs.model.gguf.save_dequantized`) is written in the
layout transformers' own `save_pretrained` writes -- the same tensor names, each weight once, a
tied LM head under the embeddings' name -- so every loader reads the same model: transformers (the
trainer) and vLLM (`rollout.engine: vllm`, which skips `lm_head.weight` for a tied head and so
never loaded the embeddings of the old copy). Checked on a tied tiny Llama against
`save_pretrained`'s file; safetensors' `save_model`, the old writer, fails the same check."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_model
from transformers import LlamaForCausalLM

from jobs.model.gguf import save_dequantized
from jobs.model.loading import byte_tokenizer, tiny_llama_config


def tied_tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # the case
    return model


def test_the_copy_holds_what_save_pretrained_writes_and_loads_back_the_same_model(tmp_path):
    model = tied_tiny_llama()
    save_dequantized(model, byte_tokenizer(), tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs")
    ours, theirs = (load_file(tmp_path / d / "model.safetensors") for d in ("ours", "theirs"))
    assert ours.keys() == theirs.keys() and "model.embed_tokens.weight" in ours and "lm_head.weight" not in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    again = LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_the_old_writer_kept_only_the_lm_heads_name(tmp_path):
    """Why the layout changed (`GGUF_LAYOUT` 2): `save_model` keeps the alphabetically first of the
    tied names, so the old copy had no `model.embed_tokens.weight` for a loader that skips the head."""
    model = tied_tiny_llama()
    save_model(model, str(tmp_path / "old.safetensors"))
    assert "model.embed_tokens.weight" not in load_file(tmp_path / "old.safetensors")
