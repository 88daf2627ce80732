"""`rayft eval` of a preference spec (`objective.name` dpo, ipo, simpo, orpo): the held-out pairs
(`data.eval_path`) scored by the base, the starting adapter (`model.adapter`, when set) and the
trained adapter, in one process.

Every number is computed on the pairs exactly as training sees them: the records are read with the
spec's objective and cut as `jobs.data.read_records` cuts them, tokenized and truncated by
`tokenize_pairs_iter` (a pair it drops is dropped here too, and counted), collated by
`collate_pairs` and scored by `PreferenceLoss.sequence_logps` (fp32, eval mode, no dropout).

Per model:

* exact match: greedy decoding from the pair's prompt tokens (the training prompt: BOS + prompt,
  or the conversation rendered with the generation prompt), until EOS or `max_new_tokens`,
  compared (stripped) with the chosen response's text (a conversational pair: the content of its
  first chosen message, the turn greedy decoding produces);
* preference accuracy: the fraction of pairs with log pi(chosen | prompt) > log pi(rejected | prompt),
  each the *summed* log-probability of the response tokens (those training labels: a string
  response with its EOS, a conversational one with the template's end of turn);
* mean margin: the mean of log pi(chosen) - log pi(rejected), in nats.

For the trained adapter also the objective's loss and TRL's reward statistics
(`jobs.objectives.pair_losses`, means over the pairs, as the run's `eval_rewards/*`): for DPO and
IPO against the run's reference, the starting adapter when `model.adapter` is set, else the base
with the adapter off (the values `reference: precomputed` stores are the same forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from jobs.data import DROP_EMPTY, DROP_IDENTICAL, Pair, char_bound, collate_pairs, read_jsonl, tokenize_pairs_iter
from jobs.errors import SpecError
from jobs.model.loading import without_peft_alias_notice
from jobs.objectives import Objective, PairObjective, PreferenceLoss, pair_losses
from jobs.spec import JobSpec, one_line

# The models scored, in table order: role -> what the table calls it.
ROLES = {"base": "base", "start": "starting adapter", "adapter": "trained adapter"}


def held_out_pairs(spec: JobSpec, tokenizer) -> tuple[list[Pair], list[dict], dict[str, int], int]:
    """(the held-out `Pair`s, the record each came from, pairs dropped by reason, records read)."""
    if spec.data.eval_path is None:
        raise SpecError("data.eval_path: not set; rayft eval of a preference spec scores its held-out pairs")
    records = read_jsonl(
        spec.data.eval_path,
        "data.eval_path",
        max_chars=char_bound(tokenizer, spec.data.max_seq_len),
        fields=spec.data.fields,
        hf_token_env=spec.data.hf_token_env,
        objective=spec.objective.name,
    )
    pairs, kept, dropped = [], [], {DROP_EMPTY: 0, DROP_IDENTICAL: 0}
    tokenized = tokenize_pairs_iter(records, tokenizer, spec.data.max_seq_len, spec.model.name)
    for rec, x in zip(records, tokenized, strict=True):
        if isinstance(x, Pair):
            pairs.append(x)
            kept.append(rec)
        else:
            dropped[x] += 1
    if not pairs:
        raise SpecError(
            f"data.eval_path: none of its {len(records)} pairs survives tokenization "
            f"(dropped: {dropped[DROP_EMPTY]} empty, {dropped[DROP_IDENTICAL]} identical)"
        )
    return pairs, kept, dropped, len(records)


def response_text(response) -> str:
    """The text exact match compares with: a string response, or its first message's content."""
    return response if isinstance(response, str) else response[0]["content"]


@torch.no_grad()
def pair_logps(model, pairs: list[Pair], pad_id: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] chosen, [P] rejected) summed response log-probabilities (fp32) under `model` as it is
    (its active adapter), through the training loss module's forward."""
    scorer = PreferenceLoss(model, PairObjective("dpo"))  # only its log-probabilities are used
    device = next(model.parameters()).device
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        batch = collate_pairs(pairs[start : start + batch_size], pad_id)
        logps = scorer.sequence_logps(*(batch[k].to(device) for k in ("input_ids", "label_pos", "label_ids"))).cpu()
        m = logps.shape[0] // 2
        chosen.append(logps[:m])
        rejected.append(logps[m:])
    return torch.cat(chosen), torch.cat(rejected)


def preference_numbers(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    margin = (chosen - rejected).double()
    return {
        "preference_accuracy": (margin > 0).double().mean().item(),
        "mean_margin": margin.mean().item(),
        "mean_logp_chosen": chosen.double().mean().item(),
        "mean_logp_rejected": rejected.double().mean().item(),
    }


def reward_numbers(obj: PairObjective, pairs: list[Pair], pi: tuple, ref: tuple | None) -> dict:
    """The objective's mean loss and TRL's statistics, means over the pairs (`pair_losses`)."""
    n_w = torch.tensor([len(p.chosen) for p in pairs], dtype=torch.float32)
    n_l = torch.tensor([len(p.rejected) for p in pairs], dtype=torch.float32)
    loss, stats = pair_losses(obj, pi[0], pi[1], n_w, n_l, *(ref if ref is not None else (None, None)))
    return {"loss": loss.double().mean().item(), **{k: v.double().mean().item() for k, v in stats.items()}}


def evaluate_preference(
    spec: JobSpec, adapter_dir: Path, max_new_tokens: int, generate: Callable, exact_match: Callable
) -> dict:
    """Score the base, the starting adapter and the trained adapter (each when it exists) on the
    held-out pairs; eval.json's content (see the module docstring). `generate` and `exact_match`
    are `jobs.after.evaluate`'s, the ones an SFT spec's evaluation uses."""
    from jobs.model.loading import load_base_model

    obj = cast(PairObjective, Objective.of(spec))  # `rayft eval` of a preference spec
    model, tok = load_base_model(spec, "fp32")
    model.eval()
    pairs, records, dropped, n_records = held_out_pairs(spec, tok)
    prompts = [list(p.prompt) for p in pairs]
    refs = [response_text(r["chosen"]) for r in records]
    adapters = {
        "start": spec.model.adapter,
        "adapter": str(adapter_dir) if (adapter_dir / "adapter_config.json").is_file() else None,
    }
    t0 = time.perf_counter()
    rows, logps, preds = [], {}, {}
    for role in ROLES:
        if role != "base":
            path = adapters[role]
            if not path:
                continue
            model = _with_adapter(model, path, role, spec.model.name)
        preds[role] = generate(model, tok, prompts, max_new_tokens)
        logps[role] = pair_logps(model, pairs, tok.pad_token_id, spec.batch.micro_batch_size)
        row = {"model": role, "exact_match": exact_match(preds[role], refs), **preference_numbers(*logps[role])}
        if role != "base":
            row["adapter_dir"] = adapters[role]
        rows.append(row)
    result: dict = {
        "objective": obj.name,
        "beta": obj.beta,
        "records": n_records,
        "pairs": len(pairs),
        "dropped": dropped,
        "models": rows,
    }
    if "adapter" in logps:
        reference = ("start" if "start" in logps else "base") if obj.needs_reference else None
        rows[-1].update(reward_numbers(obj, pairs, logps["adapter"], logps[reference] if reference else None))
        result["reference"] = reference
    result["base_exact_match"] = rows[0]["exact_match"]  # as in an SFT spec's eval.json
    if "adapter" in logps:
        result["adapter_exact_match"], result["adapter_dir"] = rows[-1]["exact_match"], adapters["adapter"]
    result["eval_time_s"] = time.perf_counter() - t0
    result["examples"] = [
        {
            "prompt_tail": tok.decode(p)[-60:],
            "chosen": c,
            "rejected": response_text(r["rejected"]),
            **{role: preds[role][i] for role in preds},
        }
        for i, (p, c, r) in enumerate(zip(prompts, refs, records, strict=True))
    ][:8]
    return result


def _with_adapter(model, path: str, name: str, spec_name: str):
    """`model` (the base, or a PEFT model of it) with the adapter at `path` loaded as `name` and
    active, in eval mode; one copy of the base serves every adapter."""
    from peft import PeftModel

    try:
        if isinstance(model, PeftModel):
            model.load_adapter(path, adapter_name=name, is_trainable=False)
            model.set_adapter(name)
        else:
            with without_peft_alias_notice():
                model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
    except (RuntimeError, ValueError, OSError) as e:
        what = "model.adapter" if name == "start" else "the trained adapter"
        raise SpecError(f"{what}: {path} does not load on model.name={spec_name} ({one_line(str(e))[:200]})") from None
    model.eval()
    return model
