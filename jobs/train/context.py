"""Worker context: what the training loop needs from whoever runs it.

The loop core never imports Ray. `LocalContext` runs in one process or under `torchrun`
(env://); `jobs.train.ray_context.RayContext` wraps Ray Train. Both expose the same few members.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from jobs.errors import RunError
from jobs.run import checkpoint as ckpt
from jobs.run import mirror
from jobs.run.step_record import StepRecord

T = TypeVar("T")


class Context:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    on_ray: bool = False  # a Ray Train worker: Ray places what the run starts (a vLLM engine)
    run_token: str | None = None  # the driver's hold on the run (its lease's token), where rank 0 is elsewhere

    def report(self, metrics: dict) -> None:
        """Called by every rank at the same points (checkpoint steps and the end)."""

    def progress(self, record: StepRecord) -> None:
        """Called on rank 0 after every optimizer step; cheap, non-blocking."""

    def save_checkpoint(self, root: Path, step: int, files: dict, metrics: dict, keep: int) -> None:
        """Every rank calls this with its own files (rank 0 adds the shared ones).

        Default (no Ray): all ranks write into one temporary directory on a shared file
        system; once all are done, rank 0 renames it to its final name and prunes.
        """
        tmp = root / f".tmp-{ckpt.step_dir_name(step)}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died mid-write
        self.barrier()
        ckpt.write_rank_files(tmp, self.rank, files)
        self.barrier()
        if self.is_main:
            ckpt.publish(tmp, root, step, keep)
        self.barrier()
        self.report(metrics)

    def publish_checkpoint(self, spec: Any, step: int) -> None:
        """Every rank, once every rank's files of checkpoint `step` are in place: an object-store
        `run.output_dir` gets it (rank 0 uploads it from the shared staging directory)."""
        if self.is_main:
            mirror.push_checkpoint(spec, step)  # a local run.output_dir: nothing to do

    def newest_checkpoint(self, spec: Any) -> Path | None:
        """The checkpoint a (re)start resumes from: the newest complete one on disk (for an object
        store, the driver has brought the store's newest into the staging directory it shares)."""
        return ckpt.newest_complete(spec.output_path / "checkpoints")

    def barrier(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class LocalContext(Context):
    """No Ray: one process, or several started by `torchrun` (RANK/WORLD_SIZE/LOCAL_RANK, env://)."""

    def __init__(self, use_gpu: bool = False, on_progress: Callable[[StepRecord], None] | None = None):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if use_gpu and torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self._on_progress = on_progress

    def progress(self, record: StepRecord) -> None:
        if self._on_progress is not None:
            self._on_progress(record)
        else:
            keys = ("step", "loss", "lr", "grad_norm", "tokens_per_s")
            print(json.dumps({k: record.value(k) for k in keys}), file=sys.stderr, flush=True)


def from_rank0(ctx: Context, fn: Callable[[], T]) -> T:
    """`fn()` run on rank 0 and its result given to every rank; a RunError there is raised on every
    rank (the others never wait for an answer that does not come)."""
    out: list[Any] = [None, None]
    if ctx.is_main:
        try:
            out = [fn(), None]
        except RunError as e:
            out = [None, str(e)]
    if ctx.world_size > 1:
        dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        raise RunError(out[1])
    return out[0]
