"""The node-fit rule: can one worker pod of a job ever run on one node, and if not, which fact says no.

A job's workers come in pods of `resources.gpus_per_worker` GPUs (one Ray Train worker per GPU; a
CPU job has one worker per pod), and all of a pod is on one node. `refusal(pod, node)` is the one
place that decides whether a node can hold such a pod, for every caller:

    render              refuses a spec that one node of the overlay's node type cannot hold;
    KubeRay admission   marks a queued job "can never fit" that node type (Kueue counts quota only);
    Ray Jobs admission  places pods only on the Ray nodes the rule allows.

It checks these facts in this order and returns the first that fails (the last four only for a
pod that needs GPUs):

    no-gpus         the pod needs GPUs and the node has none
    gpus            the pod's GPUs exceed the node's
    cpus            the pod's CPUs exceed the node's
    accelerator     `resources.accelerator_type` is none of the names of the node's GPU
    memory-unknown  the GPU's memory is not known (it is never guessed)
    budget          `memory.budget_gib` exceeds the GPU's memory
    plan            the memory plan on that GPU (strategy, checkpointing) needs more than the GPU has

What a caller does not judge it leaves unset: a Ray node's size (`NodeOffer.sized_by_placement`:
the placement holds each pod against the node's *free* GPUs and CPUs), the pod's CPUs in KubeRay
admission (render refuses them at submission), the budget in Ray Jobs admission (`PodAsk`).

The rule decides; it does not phrase. A `Refusal` names the fact and its numbers, and each caller
says it in its own terms -- render to the spec's author, naming the spec's fields; admission in
`rayft queue status` -- because the same fact reads differently in those places.

A GPU's memory is looked up in one place too: `gpu_memory_of` (`--gpu-memory TYPE=GiB` first,
then what the node says, then `--gpu-memory default=GiB`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPlan:
    """The memory plan a pod's workers run with on one GPU: what the rule holds against its memory."""

    gib: float  # estimated GiB per GPU
    checkpointing: str  # its gradient checkpointing, as `jobs.memory.checkpointing_str` says it
    choice: str = "ddp"  # its strategy choice (`jobs.memory.CHOICES`: ddp, fsdp, fsdp-keep)


def _no_plan(gpu_memory_gib: float) -> GpuPlan | None:
    return None


@dataclass(frozen=True)
class PodAsk:
    """What one worker pod asks of the node it lands on. None: not judged by this caller."""

    gpus: int  # 0: a CPU pod
    cpus: float | None = None
    accelerator_type: str | None = None  # resources.accelerator_type
    budget_gib: float | None = None  # memory.budget_gib, held against the GPU's memory
    # The plan on a GPU of that many GiB (None: not known here, e.g. a hub model read offline).
    plan: Callable[[float], GpuPlan | None] = _no_plan


@dataclass(frozen=True)
class NodeOffer:
    """One node as the rule sees it."""

    gpus: float  # GPUs of the node
    cpus: float  # CPUs of the node
    gpu_names: tuple[str, ...] = ()  # what `resources.accelerator_type` may call its GPU
    gpu_memory_gib: float | None = None  # of one GPU (None: unknown)
    # True: a placement holds each pod against the node's free GPUs and CPUs (Ray Jobs admission),
    # so its size is not judged here.
    sized_by_placement: bool = False


@dataclass(frozen=True)
class Refusal:
    """Why a pod can never run on a node: the first failing fact (see the module) and its numbers."""

    fact: str
    need: float = 0.0  # the pod's GPUs / CPUs / budget / plan GiB
    have: float = 0.0  # the node's GPUs / CPUs / GPU memory
    plan: GpuPlan | None = None  # for "plan": the plan that does not fit


def refusal(pod: PodAsk, node: NodeOffer) -> Refusal | None:
    """The first fact (module docstring) by which `pod` can never run on `node`; None when it can."""
    if pod.gpus and node.gpus < 1:
        return Refusal("no-gpus", pod.gpus, node.gpus)
    if not node.sized_by_placement:
        if pod.gpus > node.gpus:
            return Refusal("gpus", pod.gpus, node.gpus)
        if pod.cpus is not None and pod.cpus > node.cpus:
            return Refusal("cpus", pod.cpus, node.cpus)
    if not pod.gpus:
        return None
    if pod.accelerator_type and pod.accelerator_type.lower() not in {n.lower() for n in node.gpu_names}:
        return Refusal("accelerator")
    mem = node.gpu_memory_gib
    if mem is None:
        return Refusal("memory-unknown")
    if pod.budget_gib is not None and pod.budget_gib > mem:
        return Refusal("budget", pod.budget_gib, mem)
    plan = pod.plan(mem)
    if plan is not None and plan.gib > mem:
        return Refusal("plan", plan.gib, mem, plan)
    return None


def gpu_memory_of(accel: str | None, overrides: dict[str, float], known: float | None = None) -> float | None:
    """GiB of one GPU of Ray accelerator type `accel`: `--gpu-memory` for that type (any case) first,
    then `known` (what the node says of itself: a node type's gpuMemoryGiB, or admission's table of
    Ray accelerator types), then `--gpu-memory default=GiB`; None when unknown (never guessed)."""
    lower = {k.lower(): v for k, v in overrides.items()}
    if accel and accel.lower() in lower:
        return lower[accel.lower()]
    if known:
        return known
    return lower.get("default")
