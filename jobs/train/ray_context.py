"""Ray Train implementation of the worker context (the only part of `jobs` that imports Ray
on a worker; the loop core itself stays Ray-free)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch

from jobs.run import checkpoint as ckpt
from jobs.run.step_record import StepRecord
from jobs.train.context import Context


class RayContext(Context):
    on_ray = True

    def __init__(self, progress_actor: Any = None) -> None:
        tc = ray.train.get_context()
        self.rank = tc.get_world_rank()
        self.world_size = tc.get_world_size()
        self.local_rank = tc.get_local_rank()
        self.device = ray.train.torch.get_device()
        self._progress = progress_actor

    def report(self, metrics: dict) -> None:
        ray.train.report(_scalars(metrics))

    def progress(self, record: StepRecord) -> None:
        if self._progress is not None:
            self._progress.put.remote(record)  # fire and forget: never blocks the loop

    def save_checkpoint(self, root: Path, step: int, files: dict, metrics: dict, keep: int) -> None:
        """Each rank writes its files locally; Ray Train merges them into `root/step-...`.

        `root` is the run's storage (RunConfig(storage_path=output_dir, name="checkpoints")),
        so Ray's copy is the checkpoint; its manifests make a cut-off copy detectable.
        """
        tmp = Path(tempfile.mkdtemp(prefix=f"rayft-{ckpt.step_dir_name(step)}-"))
        try:
            ckpt.write_rank_files(tmp, self.rank, files)
            ray.train.report(
                _scalars(metrics),
                checkpoint=ray.train.Checkpoint.from_directory(str(tmp)),
                checkpoint_dir_name=ckpt.step_dir_name(step),
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, bool, str)) or v is None}
