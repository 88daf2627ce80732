"""Run a job on Ray Train: an existing cluster (address, or inside `ray job submit`), or an
embedded local Ray started here. Used by `python -m jobs.finetune` and by `rayft run`."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
from typing import Callable, Optional

import ray

from .errors import user_error
from .spec import JobSpec

log = logging.getLogger("rayft")


@ray.remote(num_cpus=0)
class ProgressActor:
    """Rank 0 pushes one record per optimizer step; the driver polls. Holds no GPU or CPU."""

    def __init__(self):
        self.records: list[dict] = []

    def put(self, record: dict) -> None:
        self.records.append(record)

    def since(self, n: int) -> list[dict]:
        return self.records[n:]


def train_worker(config: dict) -> None:
    # Runs on every Ray Train worker.
    from .loop import train
    from .ray_context import RayContext

    # Ray Train logs every report at INFO under a logger its level filter misses; keep the
    # worker console to warnings (rayft's own progress comes through the progress actor).
    logging.getLogger().setLevel(logging.WARNING)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    spec = JobSpec.model_validate(config["spec"])
    train(spec, RayContext(config.get("progress")), resume=config["resume"])


def init_ray(address: Optional[str], num_cpus: int, log_to_driver: bool = True) -> None:
    """Connect to `address`, or the cluster of the enclosing Ray job, or start a local one with
    at least `num_cpus` logical CPUs (Ray's own tests oversubscribe a small machine the same way)."""
    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, log_to_driver=log_to_driver, logging_level=logging.WARNING)
        return
    # Pin the GCS address and hand it to every process as RAY_ADDRESS. Ray Train's detached
    # PlacementGroupCleaner asks the state API whether its controller is alive; without
    # RAY_ADDRESS that API resolves the address from /tmp/ray/ray_current_cluster, i.e. the newest
    # `ray start` cluster on the machine -- not this one -- finds no controller, and removes the
    # placement group of a live run. The dashboard stays on: that state API is served by it.
    gcs_port = _free_port()
    os.environ["RAY_GCS_SERVER_PORT"] = str(gcs_port)
    try:
        # address="local": never attach to some other `ray start` cluster on this machine.
        ray.init(address="local", num_cpus=max(num_cpus, os.cpu_count() or 1), log_to_driver=log_to_driver,
                 logging_level=logging.WARNING, _node_ip_address="127.0.0.1", dashboard_port=_free_port(),
                 runtime_env={"env_vars": {"RAY_ADDRESS": f"127.0.0.1:{gcs_port}"}})
    finally:
        os.environ.pop("RAY_GCS_SERVER_PORT", None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _progress_actor():
    """The progress relay, pinned to this driver's node: it holds no resources, so Ray could put
    it on any node, and losing that node would end the run whatever `run.max_failures` allows."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ProgressActor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()


def make_trainer(spec: JobSpec, *, resume: bool = True, progress=None, callbacks: Optional[list] = None):
    """The TorchTrainer that runs `spec` (the one setup `run_on_ray` and every Tune trial use):
    `resources.num_workers` workers with `cpus_per_worker` CPUs and one GPU each when `use_gpu`,
    checkpoints in `<output_dir>/checkpoints/step-NNNNNNNN` (Ray Train's storage is the output
    dir, see jobs.checkpoint), `run.max_failures` restarts, `run.env` in every worker."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    r = spec.resources
    return TorchTrainer(
        train_worker,
        train_loop_config={"spec": spec.to_dict(), "progress": progress, "resume": resume},
        scaling_config=ScalingConfig(
            num_workers=r.num_workers, use_gpu=r.use_gpu, accelerator_type=r.accelerator_type,
            resources_per_worker={"CPU": r.cpus_per_worker, **({"GPU": 1} if r.use_gpu else {})},
        ),
        run_config=RunConfig(
            name="checkpoints",
            storage_path=str(spec.output_path.resolve()),
            failure_config=FailureConfig(max_failures=spec.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=spec.run.keep_checkpoints),
            logging_config=LoggingConfig(log_level="WARNING"),  # rayft prints its own progress
            worker_runtime_env={"env_vars": dict(spec.run.env)} if spec.run.env else None,
            callbacks=callbacks,
        ),
    )


def run_on_ray(spec: JobSpec, *, address: Optional[str] = None, resume: bool = True,
               on_progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Train `spec` on Ray; returns summary.json's content. Blocks until the run ends."""
    from .outputs import SUMMARY

    # One logical CPU per worker plus one for Ray Train's controller.
    init_ray(address, math.ceil(spec.resources.num_workers * spec.resources.cpus_per_worker) + 1)
    out = spec.output_path.resolve()
    progress = _progress_actor() if on_progress else None
    trainer = make_trainer(spec, resume=resume, progress=progress)
    result: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
        except Exception as e:  # surfaced below, in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    seen = 0
    while thread.is_alive():
        thread.join(timeout=0.5)
        if progress is not None:
            for rec in ray.get(progress.since.remote(seen)):
                seen += 1
                on_progress(rec)
    if progress is not None:
        for rec in ray.get(progress.since.remote(seen)):
            on_progress(rec)
    if "error" in result:
        raise user_error(result["error"]) or result["error"]
    return json.loads((out / SUMMARY).read_text())
