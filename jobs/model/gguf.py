"""A GGUF base (`model.gguf_file`) as a plain model directory: de-quantized once per machine into
rayft's cache (`gguf_cache`), in the layout transformers' `save_pretrained` writes
(`save_dequantized`), which the trainer loads and an inference server (`rollout.engine: vllm`)
serves alike."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from jobs.run.build_once import build_once

log = logging.getLogger("rayft")

# The de-quantized copy's layout (`save_dequantized`); 2: a tied LM head under the embeddings' name.
GGUF_LAYOUT = 2


def gguf_cache_dir(directory: Path, gguf_file: str) -> Path:
    """Where `gguf_cache` keeps the de-quantized copy of `directory / gguf_file`."""
    path = directory / gguf_file
    st = path.stat()
    # `GGUF_LAYOUT`: a copy written by an older rule is not reused (it is made again, once).
    key = f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}:{GGUF_LAYOUT}"
    from jobs.run.storage import cache_root

    return cache_root() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def gguf_cache(directory: Path, gguf_file: str) -> Path:
    """De-quantize a GGUF once and keep it as safetensors; later loads skip the slow path.
    Workers that start together on one machine de-quantize it once (`build_once`)."""
    path = directory / gguf_file
    cache = gguf_cache_dir(directory, gguf_file)

    def dequantize(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("de-quantizing %s (first load; cached at %s)", path, cache)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        save_dequantized(model, tokenizer, tmp)

    return build_once(cache, dequantize, f"the de-quantized {gguf_file}")


def save_dequantized(model, tokenizer, out: Path) -> None:
    """A GGUF-loaded model as a plain model directory, in the layout transformers' own
    `save_pretrained` writes (which refuses a GGUF-loaded model): its config without the GGUF
    quantization marker, the tokenizer, and each weight once, under the first name that holds it
    -- a tied LM head is `model.embed_tokens.weight` only. (safetensors' `save_model` keeps the
    alphabetically first name, `lm_head.weight`; vLLM skips that name for a tied head and left the
    embeddings it never loaded random: 13-18 nats between its log-probs and the trainer's.)"""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    seen, state = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # a tied name: the weight is written under its first name
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.detach().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
