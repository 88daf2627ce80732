"""Adapter-only sync for `rollout.engine: vllm`: one run's vLLM engine (`VLLMRollout`) serving the
policy's adapter as of the step that samples with it.

The base is loaded once, when the engine starts, and never moves again. Before the rollouts of
optimizer step k, rank 0 writes the adapter once (PEFT format: `adapter_model.safetensors` and
`adapter_config.json`, megabytes), the engine loads it as the new version `step-k`, and the
previous version is unloaded (its files removed). Every rank waits for rank 0's load before it
generates (`from_rank0`: a broadcast of its outcome, so a refusal is every rank's one line),
and every request of step k names `step-k`: no completion of step k comes from step k-1's adapter.

Under DDP every rank sends its own requests to the one engine rank 0 started (or to
`rollout.vllm_url`). The adapter's files reach the engine's own disk as bytes
(`jobs.rollout.vllm_host`: on Ray through its actor, wherever `rollout.vllm_placement` put it); a
`rollout.vllm_url` engine must see rank 0's disk.
"""

from __future__ import annotations

import atexit
import logging
import secrets
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from jobs.errors import RunError
from jobs.rollout.vllm_engine import VLLMEngine
from jobs.rollout.vllm_host import ActorHost, LocalHost, start_actor_host
from jobs.rollout.vllm_server import ServerSettings, VLLMServer
from jobs.train.context import from_rank0

if TYPE_CHECKING:
    from jobs.spec import JobSpec

log = logging.getLogger("rayft")
UNLOAD_AT_CLOSE_TIMEOUT_S = 10.0  # a hung engine does not hold the end of the run for long


def adapter_state(model) -> dict:
    """The trained adapter's tensors under PEFT's saved names, whole and on the CPU (an FSDP2 shard
    is gathered: every rank calls this)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    return {k: v.detach().to("cpu").contiguous() for k, v in full.items()}


def adapter_files(model, state: dict) -> dict[str, bytes]:
    """The adapter in PEFT's format, as the files' bytes: what reaches the engine's disk."""
    from safetensors.torch import save

    files = {"adapter_model.safetensors": save(state, metadata={"format": "pt"})}
    with tempfile.TemporaryDirectory(prefix="rayft-adapter-config-") as d:
        model.peft_config[model.active_adapter].save_pretrained(d)
        files["adapter_config.json"] = (Path(d) / "adapter_config.json").read_bytes()
    return files


def version_of(step: int) -> str:
    """The name the engine serves optimizer step `step`'s adapter under."""
    return f"step-{step}"


@dataclass
class VLLMRollout:
    """One run's engine (`engine`, a `RolloutEngine`) and, on rank 0, where it lives (`host`, a
    `jobs.rollout.vllm_host` host: the adapters' files go there)."""

    engine: VLLMEngine
    host: LocalHost | ActorHost | None = None
    stops_engine: bool = True  # rayft started it (False: the user's rollout.vllm_url)
    sleeps: bool = False  # `rollout.vllm_sleep`: asleep from a batch's last completion to the next adapter
    asleep: bool = False

    def at_step(self, model, ctx, step: int) -> VLLMEngine:
        """The engine, serving optimizer step `step`'s adapter (loaded now if it is not yet)."""
        version = version_of(step)
        if self.engine.version != version:
            state = adapter_state(model)
            from_rank0(ctx, lambda: self.publish(model, state, version))
            self.engine.version = version
        return self.engine

    def publish(self, model, state: dict, version: str) -> None:
        """Rank 0: the files to the engine's disk, load `version`, unload the previous one; timed."""
        assert self.host is not None
        t0 = time.perf_counter()
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False
        files = adapter_files(model, state)
        self.engine.load(version, self.host.put(version, files))
        previous = self.engine.version
        if previous is not None:
            self.engine.unload(previous)
            self.host.drop(previous)
        seconds, sent = time.perf_counter() - t0, sum(len(b) for b in files.values())
        self.engine.sync_metrics = {"time/adapter_sync_s": seconds, "adapter_sync_bytes": float(sent)}
        log.info("%s: adapter %s loaded (%d bytes, %.0f ms)", self.engine.name, version, sent, 1000 * seconds)

    def rest(self, ctx) -> None:
        """After every rank's completions of a rollout batch are in (`rollout.vllm_sleep`): the
        engine sleeps while the trainer steps; `publish` wakes it before the next adapter."""
        if self.sleeps:
            from_rank0(ctx, self.engine.sleep)
            self.asleep = True

    def close(self) -> None:
        """When the run ends (`GRPO.release`), at the latest when the process exits: stops the
        engine rayft started (its log goes with it), or has the user's `rollout.vllm_url` engine
        unload the run's last version (a later run or a resume loads its own names there); removes
        the adapter versions' files. Rank 0 only does anything."""
        host, self.host = self.host, None
        if host is None:
            return
        if not self.stops_engine:
            self.unload_last()
        host.stop()

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
    client of it, and the API key of an engine rayft started (in memory only: never logged)."""
    r, hosts = spec.online.rollout, list[LocalHost | ActorHost]()

    def start() -> tuple[str, str | None]:
        if r.vllm_url:
            VLLMEngine(r.vllm_url, r.vllm_timeout_s, eos_ids).check()
            hosts.append(LocalHost())
            return r.vllm_url, None
        settings = replace(server_settings(spec, job), api_key=secrets.token_urlsafe(32))
        host = start_host(spec, ctx, settings, one_node)
        hosts.append(host)
        log.info("vLLM engine %s started", host.where())
        return host_url(host), settings.api_key

    one_node = ranks_on_one_node(ctx)
    if r.vllm_sleep and not one_node:
        raise RunError(
            "rollout.vllm_sleep: vLLM serves its sleep routes without the API key, so rayft serves them on "
            "loopback only, and this run's ranks are on more than one node; leave rollout.vllm_sleep unset"
        )
    url, api_key = from_rank0(ctx, start)
    host = hosts[0] if hosts else None
    engine = VLLMEngine(url, r.vllm_timeout_s, eos_ids, host if not r.vllm_url else None, api_key)
    rollout = VLLMRollout(engine, host, stops_engine=not r.vllm_url, sleeps=r.vllm_sleep)
    atexit.register(rollout.close)
    return rollout


def start_host(spec: JobSpec, ctx, settings: ServerSettings, one_node: bool) -> LocalHost | ActorHost:
    """On Ray, an `EngineActor` placed by `rollout.vllm_placement`; without Ray, rank 0's subprocess."""
    if ctx.on_ray:
        return start_actor_host(spec.online.rollout, spec.resources.use_gpu, settings, one_node)
    return LocalHost(VLLMServer.start(settings))


def ranks_on_one_node(ctx) -> bool:
    """Every rank on rank 0's node (Ray's node ids; a run without Ray is one machine)."""
    if not ctx.on_ray:
        return True
    import ray

    here: list[Any] = [ray.get_runtime_context().get_node_id()] * ctx.world_size
    if ctx.world_size > 1:
        dist.all_gather_object(here, here[0])
    return len(set(here)) == 1


def host_url(host: LocalHost | ActorHost) -> str:
    if isinstance(host, ActorHost):
        return host.url
    assert host.server is not None
    return host.server.url


def server_settings(spec: JobSpec, job) -> ServerSettings:
    from jobs.model.loading import served_base

    r, kv = spec.online.rollout, job.plan.vllm_engine["kv_cache"]  # the plan's size, as `rayft estimate` prints it
    settings = ServerSettings(
        served_base(spec), job.precision, spec.data.max_seq_len, spec.lora.r, kv, r.vllm_start_timeout_s
    )
    return replace(settings, sleep=r.vllm_sleep)
