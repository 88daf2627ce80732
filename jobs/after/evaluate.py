"""Exact-match evaluation: greedy decoding with the base model and with the trained adapter, on
the spec's held-out source (`data.eval_path`). Runs in one process. A preference spec's held-out
pairs are scored by `jobs.after.evaluate_preference` (exact match, preference accuracy, margins).

A chat record is prompted with its messages before the last assistant turn, rendered through the
model's chat template with the generation prompt (`jobs.data.chat_prompt_ids`: the tokens the
training labels of that turn follow); the reference is that turn's content. A prompt/completion
record is prompted with BOS + prompt (`encode_prompt`), as in training."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from jobs.data import chat_prompt_ids, encode_prompt, read_jsonl
from jobs.model.loading import load_base_model, without_peft_alias_notice
from jobs.rollout.engine import left_padded
from jobs.run import mirror, run_hold
from jobs.run.outputs import check_output_dir, claim_output_dir, write_json_atomic
from jobs.run.remote_run import fetch, local_run
from jobs.run.storage import is_uri
from jobs.spec import JobSpec, SpecError


@torch.no_grad()
def generate(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int = 8) -> list[str]:
    """Greedy, left-padded batches; stops at EOS. A prompt is a text (encoded as in training by
    `encode_prompt`) or a list of token ids (a chat prompt, see `prompt_of`)."""
    outs: list[str] = []
    pad = tokenizer.pad_token_id
    for start in range(0, len(prompts), batch_size):
        enc = [p if isinstance(p, list) else encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        ids, mask = left_padded(enc, pad)
        width = ids.shape[1]
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        )
        outs += [tokenizer.decode(g[width:], skip_special_tokens=True) for g in gen]
    return outs


def prompt_of(rec: dict, tokenizer, model_name: str) -> tuple:
    """(prompt, reference, prompt text shown in eval.json) of one held-out record."""
    if "messages" in rec:
        msgs = rec["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        ids = chat_prompt_ids(tokenizer, msgs[:last], model_name)
        return ids, msgs[last]["content"], tokenizer.decode(ids)
    return rec["prompt"], rec["completion"], rec["prompt"]


def exact_match(preds: list[str], refs: list[str]) -> float:
    return sum(p.strip() == r.strip() for p, r in zip(preds, refs, strict=True)) / max(1, len(refs))


def evaluate(spec: JobSpec, adapter_dir: Path | None = None, max_new_tokens: int = 16) -> dict:
    """Evaluate on the held-out data and write `<output_dir>/eval.json`: exact match of the base and
    of the adapter (`adapter_dir`, default `<output_dir>/adapter`) for an SFT spec; for a preference
    spec also preference accuracy, margins and rewards (`jobs.after.evaluate_preference`); for an
    online-RL spec the held-out reward of greedy answers (`jobs.after.evaluate_rl`). By the kind
    of record the objective trains on."""
    adapter_dir = local_run(adapter_dir) if adapter_dir else _run_adapter(spec)
    result = _BY_RECORDS[spec.objective.records](spec, adapter_dir, max_new_tokens)
    # Written under the run's hold (jobs.run.run_hold: the local lock, and a bucket's lease), taken
    # only now: the evaluation reads, and a run may start meanwhile; a run that holds the directory
    # refuses this write in one line. A run in a bucket gets eval.json there too.
    if is_uri(spec.output_location):  # the prefix: rayft's own (with --adapter, any prefix may be named)
        check_output_dir(spec.output_location)
    run_hold.hold(spec)
    try:
        out = claim_output_dir(spec.output_path, name=spec.name)  # a later `rayft run` may use it too
        write_json_atomic(out / "eval.json", result)
        mirror.claim(spec)
        mirror.push_file(spec, "eval.json")
    finally:
        run_hold.let_go(spec)
    return result


def _run_adapter(spec: JobSpec) -> Path:
    """The run's adapter: `<output_dir>/adapter`, fetched first when the run is in a bucket."""
    if is_uri(spec.output_location):
        return fetch(spec.output_location) / "adapter"
    return spec.output_path / "adapter"


def _evaluate_pairs(spec: JobSpec, adapter_dir: Path, max_new_tokens: int) -> dict:
    if not spec.data.eval_path:
        raise SpecError(
            f"data.eval_path: rayft eval of objective.name={spec.objective.name} needs a held-out file of "
            "preference pairs"
        )
    from jobs.after.evaluate_preference import evaluate_preference

    return evaluate_preference(spec, adapter_dir, max_new_tokens, generate, exact_match)


def _evaluate_prompts(spec: JobSpec, adapter_dir: Path, max_new_tokens: int) -> dict:
    from jobs.after.evaluate_rl import evaluate_rl

    return evaluate_rl(spec, adapter_dir)  # answers are as long as the run's rollout.max_completion_length


def _evaluate_sft(spec: JobSpec, adapter_dir: Path, max_new_tokens: int) -> dict:
    if not spec.data.eval_path:
        raise SpecError("data.eval_path: rayft eval needs a held-out file of chat or prompt/completion records")
    records = [
        r
        for r in read_jsonl(
            spec.data.eval_path, "data.eval_path", fields=spec.data.fields, hf_token_env=spec.data.hf_token_env
        )
        if "prompt" in r or "messages" in r
    ]
    if not records:
        raise SpecError(f"data.eval_path: {spec.data.eval_path} has no chat or prompt/completion records")
    model, tok = load_base_model(spec, "fp32")
    prompts, refs, shown = (list(c) for c in zip(*(prompt_of(r, tok, spec.model.name) for r in records), strict=True))
    model.eval()
    result: dict = {"records": len(records)}
    t0 = time.perf_counter()
    base_preds = generate(model, tok, prompts, max_new_tokens)
    result["base_exact_match"] = exact_match(base_preds, refs)
    if (adapter_dir / "adapter_config.json").is_file():
        from peft import PeftModel

        with without_peft_alias_notice():
            tuned = PeftModel.from_pretrained(model, adapter_dir)
        tuned.eval()
        preds = generate(tuned, tok, prompts, max_new_tokens)
        result["adapter_exact_match"] = exact_match(preds, refs)
        result["adapter_dir"] = str(adapter_dir)
    else:
        preds = None
    result["eval_time_s"] = time.perf_counter() - t0
    result["examples"] = [
        {"prompt_tail": p[-60:], "reference": r, "base": b, **({"adapter": a} if preds else {})}
        for p, r, b, a in zip(shown, refs, base_preds, preds or base_preds, strict=True)
    ][:8]
    return result


# The evaluation of each kind of record an objective trains on (`objective.records`).
_BY_RECORDS = {"sft": _evaluate_sft, "pairs": _evaluate_pairs, "prompts": _evaluate_prompts}
