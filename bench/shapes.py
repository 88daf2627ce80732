"""The model shapes the GPU benchmarks measure (`gpu_compare.py`, `gpu_memory.py`) and
tests/unit/memory/test_memory_gpu_results.py reads back: one table. Llama-3.2-1B and Llama-3.1-8B's
configurations (the fields that set memory and FLOPs); the weights are random, nothing is
downloaded."""

SHAPES = {
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
