"""`rayft eval` of an online-RL spec (`objective.name: grpo`): the held-out prompts (`data.eval_path`,
or `data.eval_fraction` of `data.path` as the run held them out) answered greedily by the base, the
starting adapter (`model.adapter`, when set) and the trained adapter, in one process, each answer
scored by the spec's reward functions (`jobs.rollout.held_out`: what the run's `eval_reward` is).
The prompts are generated in the batches the run's ranks generated them in (`run_layout`), so the
trained adapter's answers are the run's own, the same rows left-padded together.

Per model: the mean weighted reward (`reward`), each function's mean (`rewards/<name>/mean`), and
where a function is the built-in `exact_match`, that mean again as `exact_match` (a 0/1 reward: the
share of prompts answered exactly), the number `rayft eval` of SFT and DPO specs reports.
"""

from __future__ import annotations

import time
from pathlib import Path

from jobs.after.evaluate_preference import ROLES, _with_adapter
from jobs.data import equal_micro_batches
from jobs.data.prompts import read_prompt_splits
from jobs.errors import SpecError
from jobs.model.loading import load_base_model
from jobs.objectives.grpo_batch import end_ids
from jobs.rollout import held_out
from jobs.rollout.engine import HFEngine
from jobs.rollout.rewards import resolve
from jobs.spec import JobSpec

SHOWN_EXAMPLES = 8


def evaluate_rl(spec: JobSpec, adapter_dir: Path) -> dict:
    """eval.json's content (module doc)."""
    reward = spec.online.reward  # a grpo spec's, typed
    model, tok = load_base_model(spec, "fp32")
    model.eval()
    _, prompts = read_prompt_splits(spec, tok)
    if not len(prompts):
        raise SpecError(
            "data.eval_path: rayft eval of objective.name=grpo scores held-out prompts: set data.eval_path "
            "or data.eval_fraction"
        )
    functions, indices = resolve(reward), list(range(len(prompts)))
    adapters = {
        "start": spec.model.adapter,
        "adapter": str(adapter_dir) if (adapter_dir / "adapter_config.json").is_file() else None,
    }
    exact = [label for f, label in zip(reward.functions, reward.labels, strict=True) if f.name == "exact_match"]
    t0, rows, answers = time.perf_counter(), [], {}
    for role in ROLES:
        if role != "base":
            if not adapters[role]:
                continue
            model = _with_adapter(model, str(adapters[role]), role, spec.model.name)
        hf = HFEngine(model, end_ids(tok, model), tok.pad_token_id, batch_size=spec.batch.micro_batch_size)
        done = greedy_as_the_run(hf, prompts, spec)
        values, rewards, answers[role] = held_out.scored(functions, prompts, indices, done, tok, reward.timeout_s)
        row = {"model": role, **held_out.means(held_out.sums_of(values, rewards, len(functions)), reward.labels)}
        if exact:
            row["exact_match"] = row[f"rewards/{exact[0]}/mean"]
        if role != "base":
            row["adapter_dir"] = adapters[role]
        rows.append(row)
    result = {"objective": "grpo", "prompts": len(prompts), "dropped": prompts.dropped, "models": rows}
    result["eval_time_s"] = time.perf_counter() - t0
    result["examples"] = [
        {"prompt": prompts.prompts[i], **{role: answers[role][i] for role in answers}} for i in indices[:SHOWN_EXAMPLES]
    ]
    return result


def run_layout(n: int, spec: JobSpec) -> list[list[int]]:
    """The batches of `n` held-out prompts as the run's ranks generate them (`GRPO.held_out`: each
    rank's share in micro-batches of `batch.micro_batch_size`), the uncounted repeats left out."""
    w, micro = spec.resources.num_workers, spec.batch.micro_batch_size
    return [idx for rank in range(w) for idx, counted in equal_micro_batches(n, rank, w, micro) if counted]


def greedy_as_the_run(engine: HFEngine, prompts, spec: JobSpec) -> list:
    """Every held-out prompt's greedy completion, by prompt index, generated batch by batch in
    `run_layout` (padding changes a row's logits in the last bits: the same batches, the same ids)."""
    done = [
        c
        for idx in run_layout(len(prompts), spec)
        for c in held_out.greedy(engine, prompts, idx, spec.online.rollout.max_completion_length)
    ]
    return sorted(done, key=lambda c: c.prompt_index)
