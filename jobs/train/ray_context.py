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
from jobs.run import mirror
from jobs.run.step_record import StepRecord
from jobs.train.context import Context, from_rank0


class RayContext(Context):
    on_ray = True

    def __init__(self, progress_actor: Any = None, spec: Any = None, run_token: str | None = None) -> None:
        tc = ray.train.get_context()
        # An object-store run.output_dir: each rank uploads its own part of a checkpoint and each
        # node fetches the newest itself (the ranks may be on nodes that share no disk).
        self._bucket_spec = spec if spec is not None and mirror.store_of(spec) is not None else None
        self.run_token = run_token
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
        so Ray's copy is the checkpoint; its manifests make a cut-off copy detectable. With an
        object-store `run.output_dir`, each rank uploads its own files there instead (its manifest
        last), once rank 0 has seen the run still holds the store's lease.
        """
        if self._bucket_spec is not None:
            self._upload_checkpoint(step, files, metrics)
            return
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

    def _upload_checkpoint(self, step: int, files: dict, metrics: dict) -> None:
        spec = self._bucket_spec
        assert spec is not None
        from_rank0(self, lambda: mirror.check_lease(spec, self.run_token))  # a lost lease: nobody uploads
        tmp = Path(tempfile.mkdtemp(prefix=f"rayft-{ckpt.step_dir_name(step)}-"))
        try:
            ckpt.write_rank_files(tmp, self.rank, files)
            mirror.push_rank_checkpoint(spec, tmp, self.rank, step)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        ray.train.report(_scalars(metrics))

    def publish_checkpoint(self, spec: Any, step: int) -> None:
        """Every rank's part is in the store (`save_checkpoint`): rank 0 adds the history files and
        prunes; a local run.output_dir: Ray Train's copy is the checkpoint."""
        if self._bucket_spec is not None and self.is_main:
            mirror.push_history(spec, spec.run.keep_checkpoints, self.run_token)

    def newest_checkpoint(self, spec: Any) -> Path | None:
        """An object-store run: rank 0 brings the store's newest complete checkpoint onto its node
        and names it; on every other node one rank brings that one too (the first there, under a
        lock: `mirror.fetch_checkpoint`), so that every rank resumes from the same step, whatever
        its node held before (the ranks may share no disk, and a restart may move them)."""
        if self._bucket_spec is None:
            return super().newest_checkpoint(spec)
        pulled = from_rank0(self, lambda: _name_of(mirror.pull_newest(spec)))
        if pulled is None:
            return None
        return mirror.fetch_checkpoint(spec, pulled) if not self.is_main else spec.output_path / "checkpoints" / pulled


def _name_of(path: Path | None) -> str | None:
    return None if path is None else path.name


def _scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float, bool, str)) or v is None}
