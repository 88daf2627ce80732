"""Adapter-only sync for `rollout.engine: vllm`: one run's vLLM engine (`VLLMRollout`) serving the
policy's adapter as of the step that samples with it.

The base is loaded once, when the engine starts, and never moves again. Before the rollouts of
optimizer step k, rank 0 writes the adapter once (PEFT format: `adapter_model.safetensors` and
`adapter_config.json`, megabytes), the engine loads it as the new version `step-k`, and the
previous version is unloaded (its files removed). Every rank waits for rank 0's load before it
generates (`from_rank0`: a broadcast of its outcome, so a refusal is every rank's one line),
and every request of step k names `step-k`: no completion of step k comes from step k-1's adapter.

Under DDP every rank sends its own requests to the one engine rank 0 started (or to
`rollout.vllm_url`). The adapter's files must be readable where the engine runs: the engine rayft
starts runs beside rank 0; a `rollout.vllm_url` engine must see rank 0's disk.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from jobs.errors import RunError
from jobs.rollout.vllm_engine import VLLMEngine
from jobs.rollout.vllm_server import ServerSettings, VLLMServer

if TYPE_CHECKING:
    from jobs.spec import JobSpec

log = logging.getLogger("rayft")
T = TypeVar("T")
UNLOAD_AT_CLOSE_TIMEOUT_S = 10.0  # a hung engine does not hold the end of the run for long


def from_rank0(ctx, fn: Callable[[], T]) -> T:
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


def adapter_state(model) -> dict:
    """The trained adapter's tensors under PEFT's saved names, whole and on the CPU (an FSDP2 shard
    is gathered: every rank calls this)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    return {k: v.detach().to("cpu").contiguous() for k, v in full.items()}


def write_adapter(model, state: dict, directory: Path) -> int:
    """The adapter in PEFT's format in `directory`; returns the bytes written."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config[model.active_adapter].save_pretrained(str(directory))
    return sum(f.stat().st_size for f in directory.iterdir())


def version_of(step: int) -> str:
    """The name the engine serves optimizer step `step`'s adapter under."""
    return f"step-{step}"


@dataclass
class VLLMRollout:
    """One run's engine (`engine`, a `RolloutEngine`), the server rayft started (None for a
    `rollout.vllm_url`), and rank 0's directory of adapter versions."""

    engine: VLLMEngine
    server: VLLMServer | None = None
    root: Path | None = None

    def at_step(self, model, ctx, step: int) -> VLLMEngine:
        """The engine, serving optimizer step `step`'s adapter (loaded now if it is not yet)."""
        version = version_of(step)
        if self.engine.version != version:
            state = adapter_state(model)
            from_rank0(ctx, lambda: self.publish(model, state, version))
            self.engine.version = version
        return self.engine

    def publish(self, model, state: dict, version: str) -> None:
        """Rank 0: write, load `version`, unload the previous one; timed."""
        assert self.root is not None
        t0 = time.perf_counter()
        written = write_adapter(model, state, self.root / version)
        self.engine.load(version, str(self.root / version))
        previous = self.engine.version
        if previous is not None:
            self.engine.unload(previous)
            shutil.rmtree(self.root / previous, ignore_errors=True)
        seconds = time.perf_counter() - t0
        self.engine.sync_metrics = {"time/adapter_sync_s": seconds, "adapter_sync_bytes": float(written)}
        log.info("%s: adapter %s loaded (%d bytes, %.0f ms)", self.engine.name, version, written, 1000 * seconds)

    def close(self) -> None:
        """When the run ends (`GRPO.release`), at the latest when the process exits: stops the
        server rayft started (its log goes with it), or has the user's `rollout.vllm_url` engine
        unload the run's last version (a later run or a resume loads its own names there); removes
        the adapter versions' files. Rank 0 only does anything."""
        if self.server is not None:
            self.server.stop()
            shutil.rmtree(self.server.log_path.parent, ignore_errors=True)
        elif self.root is not None:
            self.unload_last()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def unload_last(self) -> None:
        """The version the user's engine still holds unloaded; an engine gone already is left be."""
        version, self.engine.version = self.engine.version, None
        if version is None:
            return
        self.engine.timeout_s = min(self.engine.timeout_s, UNLOAD_AT_CLOSE_TIMEOUT_S)  # the run is over
        try:
            self.engine.unload(version)
        except RunError as e:
            log.warning("%s", e)


def connect(spec: JobSpec, ctx, job, eos_ids) -> VLLMRollout:
    """Rank 0 starts the engine (or checks that `rollout.vllm_url` answers); every rank gets a
    client of it."""
    r, started = spec.online.rollout, []

    def start() -> str:
        if r.vllm_url:
            VLLMEngine(r.vllm_url, r.vllm_timeout_s, eos_ids).check()
            return r.vllm_url
        server = VLLMServer.start(server_settings(spec, job))
        started.append(server)
        log.info("vLLM server at %s started in %.1f s (log: %s)", server.url, server.started_s, server.log_path)
        return server.url

    url = from_rank0(ctx, start)
    server = started[0] if started else None
    root = Path(tempfile.mkdtemp(prefix="rayft-adapters-")) if ctx.is_main else None
    rollout = VLLMRollout(VLLMEngine(url, r.vllm_timeout_s, eos_ids, server), server, root)
    atexit.register(rollout.close)
    return rollout


def server_settings(spec: JobSpec, job) -> ServerSettings:
    from jobs.model.loading import served_base

    r, kv = spec.online.rollout, job.plan.vllm_engine["kv_cache"]  # the plan's size, as `rayft estimate` prints it
    return ServerSettings(
        served_base(spec), job.precision, spec.data.max_seq_len, spec.lora.r, kv, r.vllm_start_timeout_s
    )
