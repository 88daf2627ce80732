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

import torch
import torch.distributed as dist

from jobs.run import checkpoint as ckpt
from jobs.run.step_record import StepRecord


class Context:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    on_ray: bool = False  # a Ray Train worker: Ray places what the run starts (a vLLM engine)

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
