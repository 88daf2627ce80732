"""Held-out reward: one greedy completion per held-out prompt, scored by the run's reward functions.

Greedy (not sampled) so that the number depends on the policy alone and two evaluations of the same
adapter agree; the run's `rollout.max_completion_length` bounds it. What a reward function returns
as None (not applicable) counts in no mean. The training loop's held-out evaluation
(`GRPO.held_out`, `eval_reward` and `eval_rewards/<name>/mean` in metrics.jsonl) and `rayft eval`
(`jobs.after.evaluate_rl`) both score through here, so they agree.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch

from jobs.rollout.engine import Completion, Request, RolloutEngine, Sampling
from jobs.rollout.rewards import Batch, completions_as_trl, score


def greedy(engine: RolloutEngine, prompts, indices: Sequence[int], max_completion_length: int) -> list[Completion]:
    """The greedy completion of each prompt `indices` names, from `engine` (the run's: in-process
    through the loss module's forward, `jobs.objectives.grpo_batch.InLossForward`; `rayft eval`'s:
    an `HFEngine` on the loaded model)."""
    requests = [Request(i, 0, tuple(prompts.ids[i]), 0) for i in indices]
    with torch.no_grad():
        return engine.generate(requests, Sampling(max_completion_length, temperature=0.0))


def scored(functions: list, prompts, indices: Sequence[int], done: list[Completion], tokenizer, timeout_s: float):
    """(values [completion][function], rewards [completion], completion texts) of `done`."""
    ids = [list(c.ids) for c in done]
    keys = sorted({k for i in indices for k in prompts.columns[i]})
    texts = completions_as_trl(tokenizer, ids, prompts.conversational)
    batch = Batch(
        [prompts.prompts[i] for i in indices],
        texts,
        ids,
        list(indices),
        {k: [prompts.columns[i].get(k) for i in indices] for k in keys},
    )
    values, rewards = score(functions, batch, timeout_s)
    return values, rewards, texts


def sums_of(values: list[list[float]], rewards: list[float], n_functions: int) -> torch.Tensor:
    """[F + 1, 2] float64: per function, then the weighted reward, (sum, count) of what is not NaN."""
    out = torch.zeros(n_functions + 1, 2, dtype=torch.float64)
    for row, reward in zip(values, rewards, strict=True):
        for f, v in enumerate([*row, reward]):
            if not math.isnan(v):
                out[f] += torch.tensor([v, 1.0], dtype=torch.float64)
    return out


def source_sums(rewards: list[float], indices: Sequence[int], offsets: Sequence[int]) -> torch.Tensor:
    """[S, 2] float64: per mixture source (its held-out prompts start at `offsets[s]`), the
    weighted rewards of `indices`' completions that are not NaN, (sum, count)."""
    out = torch.zeros(len(offsets), 2, dtype=torch.float64)
    for i, reward in zip(indices, rewards, strict=True):
        if offsets and not math.isnan(reward):
            out[bisect.bisect_right(offsets, i) - 1] += torch.tensor([reward, 1.0], dtype=torch.float64)
    return out


def mean_of(total: torch.Tensor | float, count: torch.Tensor | float) -> float:
    """A (sum, count) pair's mean; NaN where nothing was scored."""
    return float(total / count) if count else math.nan


def means(sums: torch.Tensor, labels: Sequence[str]) -> dict[str, float]:
    """TRL's names: `reward` and `rewards/<name>/mean` (NaN where nothing was scored)."""
    mean = [mean_of(s, n) for s, n in sums]
    return {"reward": mean[-1], **{f"rewards/{label}/mean": m for label, m in zip(labels, mean, strict=False)}}
