"""What one step's rollouts leave: TRL's metrics (`rollout_metrics`) and the lines of
`rollouts/step-NNNNNN.jsonl` (`rollout_lines`, `write_rollouts`).

Invariant: every number here is computed over the WHOLE global batch of the step (the caller
gathers it first), so a metric does not depend on the split. Names are TRL's `GRPOTrainer`'s:
`reward`, `reward_std`, `rewards/<name>/mean|std`, `frac_reward_zero_std`,
`completions/mean_length|min_length|max_length`, `completions/clipped_ratio`,
`completions/mean_terminated_length|min_terminated_length|max_terminated_length`. A value that is
None (not applicable) or every completion unscored reads as NaN here and null in JSON. The
rollouts file holds, per completion, the exact ids it was trained on.

Where the engine returns its own log-probs of the sampled ids (vLLM), the trainer's are recorded
beside them and their gap |trainer - engine| per completion token is reported over the whole
batch's completion tokens (`engine_logprob_gap/mean|max`: a token mean, not a mean of completions'
or ranks' means) and per completion in its rollouts line (`logprob_fields`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from jobs.run.outputs import strict_json, write_text_atomic


def step_file(output_dir: Path, step: int) -> Path:
    """`<output_dir>/rollouts/step-NNNNNN.jsonl` of optimizer step `step`."""
    return output_dir / "rollouts" / f"step-{step:06d}.jsonl"


def _scored(values: Sequence[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def _mean(values: Sequence[float]) -> float:
    kept = _scored(values)
    return math.fsum(kept) / len(kept) if kept else math.nan


def _std(values: Sequence[float]) -> float:
    """Bessel-corrected, over the values that are not NaN (TRL's `nanstd`); NaN with fewer than two."""
    kept = _scored(values)
    return statistics.stdev(kept) if len(kept) > 1 else math.nan


def reward_metrics(
    values: Sequence[Sequence[float]], rewards: Sequence[float], labels: Sequence[str], num_generations: int
) -> dict[str, float]:
    """`reward`, `reward_std`, `rewards/<label>/mean|std` and `frac_reward_zero_std` (the share of
    completions whose group's rewards all agree: no learning signal)."""
    out = {"reward": _mean(rewards), "reward_std": _std(rewards)}
    for f, label in enumerate(labels):
        column = [row[f] for row in values]
        out[f"rewards/{label}/mean"], out[f"rewards/{label}/std"] = _mean(column), _std(column)
    groups = [rewards[s : s + num_generations] for s in range(0, len(rewards), num_generations)]
    flat = [1.0 if len(_scored(g)) < 2 or _std(g) < 1e-12 else 0.0 for g in groups]
    out["frac_reward_zero_std"] = _mean(flat) if flat else math.nan
    return out


def length_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """Completion lengths in tokens, all and those that ended with EOS, and the truncated share."""
    ended = [n for n, cut in zip(lengths, truncated, strict=True) if not cut] or [0]  # TRL's edge case
    return {
        "completions/mean_length": math.fsum(lengths) / len(lengths),
        "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/clipped_ratio": sum(truncated) / len(truncated),
        "completions/mean_terminated_length": math.fsum(ended) / len(ended),
        "completions/min_terminated_length": float(min(ended)),
        "completions/max_terminated_length": float(max(ended)),
    }


def _token_gaps(trainer: Sequence[float], engine: Sequence[float]) -> list[float]:
    return [abs(t - e) for t, e in zip(trainer, engine, strict=True)]


def logprob_gap_metrics(trainer: Sequence[Sequence[float]], engine: Sequence[Sequence[float]]) -> dict[str, float]:
    """`engine_logprob_gap/mean|max`: |trainer - engine| log-prob over every completion token of the
    batch (NaN for a batch without tokens)."""
    gaps = [g for t, e in zip(trainer, engine, strict=True) for g in _token_gaps(t, e)]
    mean = math.fsum(gaps) / len(gaps) if gaps else math.nan
    return {"engine_logprob_gap/mean": mean, "engine_logprob_gap/max": max(gaps, default=math.nan)}


def logprob_fields(trainer: Sequence[float], engine: Sequence[float]) -> dict:
    """One completion's rollouts-line fields: `trainer_logprobs`, `engine_logprobs` (per token) and
    `engine_logprob_gap` {mean, max} of |trainer - engine| over its tokens (null without tokens)."""
    gaps = _token_gaps(trainer, engine)
    gap = {"mean": math.fsum(gaps) / len(gaps), "max": max(gaps)} if gaps else {"mean": None, "max": None}
    return {"trainer_logprobs": list(trainer), "engine_logprobs": list(engine), "engine_logprob_gap": gap}


def rollout_metrics(
    values: Sequence[Sequence[float]],
    rewards: Sequence[float],
    labels: Sequence[str],
    num_generations: int,
    completion_ids: Sequence[Sequence[int]],
    truncated: Sequence[bool],
) -> dict[str, float]:
    """TRL's rollout metrics of one step's global batch (module doc)."""
    lengths = [len(ids) for ids in completion_ids]
    return reward_metrics(values, rewards, labels, num_generations) | length_metrics(lengths, truncated)


def rollout_lines(
    prompt_indices: Sequence[int],
    prompts: Sequence,
    prompt_ids: Sequence[Sequence[int]],
    completions: Sequence,
    completion_ids: Sequence[Sequence[int]],
    truncated: Sequence[bool],
    values: Sequence[Sequence[float]],
    labels: Sequence[str],
    rewards: Sequence[float],
    advantages: Sequence[float],
) -> list[dict]:
    """One record per completion: `prompt_index`, `prompt`, `prompt_ids`, `completion`,
    `completion_ids` (exactly the trained ids), `truncated`, `rewards` (per function), `reward`
    (weighted sum), `advantage`."""
    return [
        {
            "prompt_index": int(prompt_indices[i]),
            "prompt": prompts[i],
            "prompt_ids": [int(t) for t in prompt_ids[i]],
            "completion": completions[i],
            "completion_ids": [int(t) for t in completion_ids[i]],
            "truncated": bool(truncated[i]),
            "rewards": dict(zip(labels, values[i], strict=True)),
            "reward": rewards[i],
            "advantage": advantages[i],
        }
        for i in range(len(completion_ids))
    ]


def write_rollouts(output_dir: Path, step: int, lines: Sequence[dict]) -> Path:
    """`step_file`, written whole (a reader never sees half a step); NaN as null."""
    path = step_file(output_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(strict_json(line) + "\n" for line in lines))
    return path
