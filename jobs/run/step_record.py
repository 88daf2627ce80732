"""One optimizer step's record: what the loop writes to metrics.jsonl, shows on the progress line,
sends to the trackers and Ray, and what `read_metrics`, Tune and `rayft` read back.

Invariants: the line written is the named fields in their order, then `extra` (the per-source
counts of a mixture, the objective's statistics under TRL's names such as `rewards/margins`), so
metrics.jsonl keeps the keys and order it always had; a line read back is checked (every named field
present with its type) and a foreign or cut line is one `RunError` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jobs.errors import RunError


@dataclass(frozen=True)
class StepRecord:
    step: int
    """Optimizer steps done (1-based: the record of the first step says 1)."""
    loss: float
    """The step's training loss: the objective's loss over the whole global batch (one denominator)."""
    lr: float
    """The learning rate the step used."""
    grad_norm: float
    """The gradient's global norm before clipping."""
    tokens: int
    """Input tokens of the step's global batch (padding not counted)."""
    tokens_seen: int
    """Input tokens of every step so far, resumed steps included."""
    label_tokens: int
    """Tokens the loss was computed on (the global batch's denominator for token-mean losses)."""
    tokens_per_s: float
    """`tokens` over this rank's wall time of the step."""
    step_time_s: float
    """Wall time of the step (generation, when online, included)."""
    epoch: float
    """Passes over the training data after the step."""
    peak_mem_gib: float
    """The device's peak memory so far (the process's peak RSS on a CPU)."""
    peak_mem_kind: str
    """What `peak_mem_gib` measures ("cuda allocated", "rss", ...)."""
    estimate_gib: float
    """The memory plan's estimate of that peak."""
    skipped: bool
    """The fp16 GradScaler skipped the update (an overflow)."""
    eval_loss: float | None
    """The newest held-out loss (carried forward between evaluations), or None before the first."""
    evaluated: bool = False
    """`eval_loss` was measured at this step."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The window's per-source counts and the objective's statistics (TRL's names), in the order
    they were added."""
    total_steps: int | None = None
    """The run's optimizer steps, for the progress line only (not written to metrics.jsonl)."""

    def line(self) -> dict[str, Any]:
        """The record as metrics.jsonl, the trackers and Ray's report hold it."""
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in LINE_FIELDS}
        return {**named, **self.extra}

    def value(self, key: str) -> Any:
        """The value named `key` (a field or a key of `extra`), None where the step has none."""
        return getattr(self, key) if key in LINE_FIELDS else self.extra.get(key)

    @classmethod
    def from_line(cls, line: Mapping[str, Any], where: str) -> StepRecord:
        """The record a metrics.jsonl line holds; a line without a named field, or with one of the
        wrong type, is one `RunError` naming `where`."""
        if not isinstance(line, Mapping):
            raise RunError(f"{where}: not a step record (a JSON object per line)")
        named = {**LATE_FIELDS, **{k: line[k] for k in LINE_FIELDS if k in line}}
        for name, kind in LINE_FIELDS.items():
            if name not in named or not _is(named[name], kind):
                raise RunError(f"{where}: not a rayft step record ({name} is {_shown(name, line)})")
        # null was a value that was not finite (a step the fp16 scaler skipped): NaN again
        named |= {k: math.nan for k, kind in LINE_FIELDS.items() if kind == "float" and named[k] is None}
        return cls(**named, extra={k: v for k, v in line.items() if k not in LINE_FIELDS})

    def with_total(self, total_steps: int) -> StepRecord:
        return dataclasses.replace(self, total_steps=total_steps)


def _is(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    # JSON has no NaN: a non-finite value was written as null (`jobs.run.outputs.strict_json`)
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _shown(name: str, line: Mapping[str, Any]) -> str:
    return f"{json.dumps(line[name])[:40]}" if name in line else "missing"


# The named fields as metrics.jsonl holds them, in order, with the JSON type each must have
# ("float": a number, or null for a value that was not finite, read back as NaN; "float?": a
# number or null, the eval loss before the first evaluation).
LINE_FIELDS: dict[str, str] = {
    "step": "int",
    "loss": "float",
    "lr": "float",
    "grad_norm": "float",
    "tokens": "int",
    "tokens_seen": "int",
    "label_tokens": "int",
    "tokens_per_s": "float",
    "step_time_s": "float",
    "epoch": "float",
    "peak_mem_gib": "float",
    "peak_mem_kind": "str",
    "estimate_gib": "float",
    "skipped": "bool",
    "eval_loss": "float?",
    "evaluated": "bool",
}
# Named fields a line written before the field existed lacks, with what such a line meant.
LATE_FIELDS: dict[str, Any] = {"evaluated": False}
