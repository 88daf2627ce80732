"""Where the vLLM engine of `rollout.engine: vllm` lives, and how an adapter version reaches its disk.

Invariants: the base is loaded once per engine (when it starts); afterwards only an adapter's files
(megabytes) travel, as bytes, and are written on the engine's own disk, so no disk needs to be
shared between rank 0 and the engine. Every host answers the same five calls: `put` (a version's
files, returns their directory on the engine's disk), `drop`, `exit_note` (why the engine stopped
answering, for an error line), `stop` and `where` (one line for the log).

- `LocalHost`: in rank 0's process. The server (if rayft starts one) is rank 0's subprocess on
  loopback: a run without Ray (`--local`, a test's gloo ranks). With `rollout.vllm_url` there is
  no server of rayft's: the user's engine reads the adapters from rank 0's disk.
- `ActorHost`: on Ray, the server is started by an `EngineActor` that `rollout.vllm_placement`
  places: `colocate` on rank 0's node, holding no resources (it shares rank 0's CPUs and GPU,
  whose ids it is given), `separate` on `vllm_num_gpus` GPUs and `vllm_num_cpus` CPUs of its own,
  wherever Ray finds them. The server listens on its node's address; the actor belongs to rank 0
  (Ray ends it, and its server, when rank 0's process goes).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jobs.errors import RunError
from jobs.rollout.vllm_server import ServerSettings, VLLMServer

# On Kubernetes a separate engine gets a pod of its own, whose Ray node alone offers this resource
# (`rayft k8s render`); the pods' environment names it, and the engine's actor then asks for one.
ENGINE_RESOURCE = "rayft_vllm_engine"
ENGINE_RESOURCE_ENV = "RAYFT_VLLM_ENGINE_RESOURCE"
NOTE_TIMEOUT_S = 10.0  # asking a dead engine's actor why must not hold an error line long
STOP_TIMEOUT_S = 60.0


class LocalHost:
    """The engine's files in this process's temporary directory; `server` when rayft started it."""

    def __init__(self, server: VLLMServer | None = None):
        self.server = server
        self.root = Path(tempfile.mkdtemp(prefix="rayft-adapters-"))

    def put(self, version: str, files: dict[str, bytes]) -> str:
        directory = self.root / version
        directory.mkdir()
        for name, data in files.items():
            (directory / name).write_bytes(data)
        return str(directory)

    def drop(self, version: str) -> None:
        shutil.rmtree(self.root / version, ignore_errors=True)

    def exit_note(self) -> str:
        return "" if self.server is None else self.server.exit_note()

    def where(self) -> str:
        return "in rank 0's process" if self.server is None else f"at {self.server.url} (rank 0's subprocess)"

    def stop(self) -> None:
        """Stops rayft's server (its log goes with it) and removes the adapters' files."""
        if self.server is not None:
            self.server.stop()
            shutil.rmtree(self.server.log_path.parent, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)


class EngineActor:
    """A Ray actor holding one `LocalHost` whose server listens on the actor's node address."""

    def __init__(self) -> None:
        self.host: LocalHost | None = None

    def start(self, settings: ServerSettings, loopback: bool) -> str:
        """The server on loopback (`loopback`: every rank runs on this node), else on the node's address."""
        import ray

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        server = VLLMServer.start(replace(settings, host=host))
        self.host = LocalHost(server)
        return server.url

    def put(self, version: str, files: dict[str, bytes]) -> str:
        assert self.host is not None
        return self.host.put(version, files)

    def drop(self, version: str) -> None:
        if self.host is not None:
            self.host.drop(version)

    def exit_note(self) -> str:
        return "" if self.host is None else self.host.exit_note()

    def stop(self) -> None:
        if self.host is not None:
            self.host.stop()


@dataclass
class ActorHost:
    """Rank 0's handle on an `EngineActor`; every call is bounded, and a failure inside the actor
    is the RunError it raised (one line), not Ray's traceback."""

    actor: Any
    url: str
    placement: str
    timeout_s: float

    def put(self, version: str, files: dict[str, bytes]) -> str:
        return self._get(self.actor.put.remote(version, files), self.timeout_s, f"writing adapter {version}")

    def drop(self, version: str) -> None:
        self._get(self.actor.drop.remote(version), self.timeout_s, f"removing adapter {version}")

    def exit_note(self) -> str:
        try:
            return self._get(self.actor.exit_note.remote(), NOTE_TIMEOUT_S, "its state")
        except RunError as e:
            return f"; {e}"

    def where(self) -> str:
        return f"at {self.url} ({self.placement})"

    def stop(self) -> None:
        import ray

        try:
            self._get(self.actor.stop.remote(), STOP_TIMEOUT_S, "stopping")
        except RunError:
            pass  # gone already, or hung: the kill below ends it and its server (parent-death signal)
        ray.kill(self.actor)

    def _get(self, ref, timeout_s: float, what: str):
        return actor_result(ref, timeout_s, f"the vLLM engine's Ray actor ({self.placement}), {what}")


def actor_result(ref, timeout_s: float, what: str):
    """`ray.get(ref)`, with the actor's own RunError raised as it was, and its death or silence as
    one RunError naming `what` was asked."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(ref, timeout=timeout_s)
    except RayTaskError as e:
        cause = e.cause
        raise RunError(str(cause) if isinstance(cause, RunError) else f"{what}: {cause}") from None
    except RayActorError as e:
        raise RunError(f"{what}: the actor died ({' '.join(str(e).split())[:300]})") from None
    except GetTimeoutError:
        raise RunError(f"{what}: no answer within {timeout_s:g} s") from None


def actor_options(rollout: Any, use_gpu: bool, rank0_node: str) -> dict:
    """Ray's options for the `EngineActor` of `rollout.vllm_placement`: colocated on rank 0's node
    (no resources held: it shares rank 0's), or separate on resources of its own."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if rollout.vllm_placement == "colocate":
        strategy = NodeAffinitySchedulingStrategy(rank0_node, soft=False)
        return {"num_cpus": 0, "num_gpus": 0, "scheduling_strategy": strategy}
    options = {"num_cpus": rollout.vllm_num_cpus, "num_gpus": separate_gpus(rollout, use_gpu)}
    pinned = os.environ.get(ENGINE_RESOURCE_ENV)
    return options | ({"resources": {pinned: 1}} if pinned else {})


def separate_gpus(rollout: Any, use_gpu: bool) -> int:
    """A separate engine's GPUs: `rollout.vllm_num_gpus`, else 1 on a GPU cluster and 0 on CPUs."""
    return rollout.vllm_num_gpus if rollout.vllm_num_gpus is not None else int(use_gpu)


def placement_line(rollout: Any, use_gpu: bool) -> str:
    if rollout.vllm_placement == "colocate":
        return "colocated with rank 0"
    gpus = separate_gpus(rollout, use_gpu)
    return f"separate: {gpus} GPU(s), {rollout.vllm_num_cpus:g} CPU(s) of its own"


def place_engine_actor(rollout: Any, use_gpu: bool) -> Any:
    """The `EngineActor` of `rollout.vllm_placement`, created for the rank 0 calling this (`colocate`:
    on this process's node), its server not started yet."""
    import ray

    options = actor_options(rollout, use_gpu, ray.get_runtime_context().get_node_id())
    return ray.remote(EngineActor).options(**options).remote()


def start_actor_host(rollout: Any, use_gpu: bool, settings: ServerSettings, one_node: bool) -> ActorHost:
    """Rank 0 on Ray: the `EngineActor` placed by `rollout.vllm_placement`, its server started.
    A colocated engine sees rank 0's GPUs; a separate one those Ray gave it (tensor parallel over
    them). A colocated engine listens on loopback when every rank is on rank 0's node (`one_node`),
    else on the node's address. An actor Ray cannot place, or a server that does not start, is one
    RunError."""
    import ray

    colocated = rollout.vllm_placement == "colocate"
    if colocated:
        settings = replace(settings, visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES") if use_gpu else None)
    else:
        settings = replace(settings, tensor_parallel=max(1, separate_gpus(rollout, use_gpu)))
    actor = place_engine_actor(rollout, use_gpu)
    where = placement_line(rollout, use_gpu)
    host = ActorHost(actor, "", where, rollout.vllm_timeout_s)
    try:
        started = actor.start.remote(settings, colocated and one_node)  # loopback when no rank is elsewhere
        host.url = actor_result(started, settings.start_timeout_s + 60, f"the vLLM engine ({where})")
    except RunError as e:
        ray.kill(actor)
        raise RunError(f"{e}{unplaced_hint(rollout, use_gpu)}") from None
    return host


def unplaced_hint(rollout: Any, use_gpu: bool) -> str:
    if rollout.vllm_placement == "colocate":
        return ""
    return (
        f" (a separate engine needs {separate_gpus(rollout, use_gpu)} GPU(s) and {rollout.vllm_num_cpus:g} CPU(s) "
        "free beside the training workers: see rollout.vllm_num_gpus / vllm_num_cpus)"
    )
