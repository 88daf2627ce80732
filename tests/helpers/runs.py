"""What many tests share to make a small run: the overrides that make a run of the demo spec
small (one process, one step, short sequences, a small adapter) and one JSONL writer."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

# One worker, one optimizer step of 4 sequences of at most 64 tokens, LoRA rank 4.
SMALL_RUN = [
    "resources.num_workers=1",
    "run.max_steps=1",
    "data.max_seq_len=64",
    "lora.r=4",
    "batch.global_batch_size=4",
]


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    """`rows` as JSON Lines at `path` (one object per line, newline-terminated); returns `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# What the demo spec (examples/tiny-lora.yaml) needs beside `objective.name=NAME` to be a valid spec
# of that objective: GRPO takes a reward function, a group size dividing the global batch, and here
# no held-out split (its evaluation generates greedily: time a small test does not need).
OBJECTIVE_NEEDS = {
    "grpo": [
        "reward.functions=[{name: regex, pattern: a}]",
        "rollout.num_generations=4",
        "data.eval_path=null",
    ],
}


def objective_overrides(name: str) -> list[str]:
    """`objective.name=NAME` and what the demo spec needs beside it for that objective."""
    return [f"objective.name={name}", *OBJECTIVE_NEEDS.get(name, [])]


def step_line(step: int, **values) -> dict:
    """A well-formed metrics.jsonl line for `step` (every named field of `StepRecord`), with
    `values` over it: a field's value, or an objective's statistic."""
    from jobs.run.step_record import StepRecord

    zero = {"loss": 1.0, "lr": 1e-4, "grad_norm": 1.0, "tokens": 8, "tokens_seen": 8 * step, "label_tokens": 8}
    rest = {"tokens_per_s": 1.0, "step_time_s": 1.0, "epoch": 0.1 * step, "peak_mem_gib": 1.0}
    base = StepRecord(step=step, **zero, **rest, peak_mem_kind="rss", estimate_gib=1.0, skipped=False, eval_loss=None)
    return {**base.line(), **values}


def metric_lines(output_dir: Path) -> list[dict]:
    """A run's metrics.jsonl as its lines' dicts (read and checked by `jobs.run.outputs.read_metrics`)."""
    from jobs.run.outputs import read_metrics

    return [r.line() for r in read_metrics(output_dir)]
