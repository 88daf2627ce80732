"""tiny-llama, the built-in random-initialized Llama (GQA) that needs no download: its shape.

Its own module so that what reads a model's config (`jobs.memory.config_io`) and what loads a model
(`jobs.model.loading`) both take it from here, neither from the other."""

from __future__ import annotations

from typing import Any

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.2,
)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    cfg: dict[str, Any] = dict(TINY_LLAMA, vocab_size=259, pad_token_id=256, bos_token_id=257, eos_token_id=258)
    cfg.update(overrides)
    return LlamaConfig(**cfg)
