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
