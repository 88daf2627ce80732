"""Exact-match evaluation of prompt/completion records: greedy decoding with the base model and
with the trained adapter, on the spec's held-out file (`data.eval_path`). Runs in one process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from .data import encode_prompt, read_jsonl
from .model import load_base_model
from .outputs import claim_output_dir, write_json_atomic
from .spec import JobSpec, SpecError


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 8) -> list[str]:
    """Greedy, left-padded batches; stops at EOS. Prompts are encoded exactly as in training."""
    outs: list[str] = []
    pad = tokenizer.pad_token_id
    for start in range(0, len(prompts), batch_size):
        enc = [encode_prompt(tokenizer, p) for p in prompts[start:start + batch_size]]
        width = max(len(e) for e in enc)
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
        outs += [tokenizer.decode(g[width:], skip_special_tokens=True) for g in gen]
    return outs


def exact_match(preds: list[str], refs: list[str]) -> float:
    return sum(p.strip() == r.strip() for p, r in zip(preds, refs)) / max(1, len(refs))


def evaluate(spec: JobSpec, adapter_dir: Optional[Path] = None, max_new_tokens: int = 16) -> dict:
    if not spec.data.eval_path:
        raise SpecError("data.eval_path: rayft eval needs a held-out prompt/completion file")
    records = [r for r in read_jsonl(spec.data.eval_path, "data.eval_path") if "prompt" in r]
    if not records:
        raise SpecError(f"data.eval_path: {spec.data.eval_path} has no prompt/completion records")
    adapter_dir = Path(adapter_dir or spec.output_path / "adapter")
    prompts, refs = [r["prompt"] for r in records], [r["completion"] for r in records]
    model, tok = load_base_model(spec, "fp32")
    model.eval()
    result: dict = {"records": len(records)}
    t0 = time.perf_counter()
    base_preds = generate(model, tok, prompts, max_new_tokens)
    result["base_exact_match"] = exact_match(base_preds, refs)
    if (adapter_dir / "adapter_config.json").is_file():
        from peft import PeftModel

        tuned = PeftModel.from_pretrained(model, adapter_dir)
        tuned.eval()
        preds = generate(tuned, tok, prompts, max_new_tokens)
        result["adapter_exact_match"] = exact_match(preds, refs)
        result["adapter_dir"] = str(adapter_dir)
    else:
        preds = None
    result["eval_time_s"] = time.perf_counter() - t0
    result["examples"] = [{"prompt_tail": p[-60:], "reference": r, "base": b, **({"adapter": a} if preds else {})}
                          for p, r, b, a in zip(prompts, refs, base_preds, preds or base_preds)][:8]
    out = claim_output_dir(spec.output_path, name=spec.name)  # a later `rayft run` may use it too
    write_json_atomic(out / "eval.json", result)
    return result
