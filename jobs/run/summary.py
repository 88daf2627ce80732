"""summary.json, typed: what a finished run reports, written by the main rank at the end
(`jobs.train.loop.write_outputs`) and read by `rayft run`'s table and Tune's trials.

Invariant: `RunSummary.from_json(s.as_json()) == s`, and `as_json` is summary.json's content:
the named fields, then the objective's held-out statistics and early stopping's keys (`stats`,
flat beside them, as TRL names them: `eval_rewards/accuracies`, ...). A summary that lacks a
named field is refused in one line naming it (a summary.json from another program, or cut off)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from jobs.errors import RunError


@dataclass(frozen=True)
class RunSummary:
    name: str
    steps: int  # optimizer steps of the whole run (a resumed run counts the steps before it too)
    resumed_from_step: int  # 0: started fresh
    first_loss: float | None  # the first step's training loss (None: no step recorded)
    final_loss: float | None
    eval_loss: float | None  # the last held-out evaluation (None: no held-out data)
    tokens_seen: int
    skipped_steps: int  # fp16 steps the loss scaler skipped
    wall_time_s: float
    mean_tokens_per_s: float | None  # this run's steps only (None: it trained no step)
    peak_mem_gib: float | None
    peak_mem_kind: str | None  # "cuda_max_allocated" or "cpu_max_rss"
    estimate_gib: float  # the memory plan's estimate for the step
    precision: str
    gradient_checkpointing: bool
    checkpoint_every_n_layers: int
    compiled_layers: bool
    effective_lr: float
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    num_workers: int
    strategy: str  # "ddp" or "fsdp"
    adapter_dir: str
    dropped_records: int
    objective: str  # objective.name
    stats: dict[str, Any] = field(default_factory=dict)  # the objective's and early stopping's keys

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k != "stats"}, **self.stats}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "summary.json") -> RunSummary:
        named = [f.name for f in fields(cls) if f.name != "stats"]
        missing = [k for k in named if k not in data]
        if missing:
            raise RunError(f"{where}: not a rayft run summary (no {', '.join(missing[:5])})")
        stats = {k: v for k, v in data.items() if k not in named}
        return cls(**{k: data[k] for k in named}, stats=stats)

    def stat(self, key: str) -> Any:
        """One of the objective's statistics (`eval_rewards/accuracies`, ...), or None."""
        return self.stats.get(key)
