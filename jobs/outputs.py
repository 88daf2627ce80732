"""What a finished job leaves in `run.output_dir` (written by rank 0 only)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLOT = "loss_curve.png"
EVENTS = "events.jsonl"


class MetricsLog:
    """`metrics.jsonl`, one line per optimizer step. On resume, lines past the checkpoint go."""

    def __init__(self, output_dir: Path, resume_step: int):
        self.path = output_dir / METRICS
        output_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut off by a crash
                if rec.get("step", 0) <= resume_step:
                    kept.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)
        self._f = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def append_event(output_dir: Path, event: str, **fields) -> None:
    """`events.jsonl`: run starts, resumes (with the step), ends. Never truncated."""
    rec = {"event": event, "time": time.time(), **fields}
    with open(Path(output_dir) / EVENTS, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_events(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / EVENTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_step(rec: dict) -> str:
    """One optimizer step as the plain progress line `rayft run` and `python -m jobs.finetune` print."""
    return (f"step {rec['step']}/{rec.get('total_steps')} loss {rec['loss']:.4f} lr {rec['lr']:.3g} "
            f"grad_norm {rec['grad_norm']:.3g} tokens/s {rec['tokens_per_s']:.0f}")


def write_text_atomic(path: Path, text: str) -> None:
    """Write beside `path`, then rename over it: a reader sees the old file or the new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: dict) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def set_aside(path: Path) -> Optional[Path]:
    """`--fresh`: rename `path` (old checkpoints, a previous search) to `<name>.set-aside-<time>`
    beside it, never deleting anything. None when there is nothing there."""
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    dest = path.with_name(f"{path.name}.set-aside-{time.strftime('%Y%m%dT%H%M%S')}")
    path.rename(dest)
    return dest


def plot_loss(output_dir: Path, records: list[dict], title: str) -> Optional[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss (token-weighted)")
    ev = [r for r in records if r.get("eval_loss") is not None]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / label token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(output_dir) / PLOT
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
