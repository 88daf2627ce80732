"""What one job asks of the cluster, and whether one node type holds it: the job's kind (a
fine-tune or a search: its command, deadline and retries), its worker pods (`WorkerPods`), and the
refusals `render` makes before it writes anything (`refuse_unfit`: the node-fit rule queue admission
applies too; `refuse_over_quota`: Kueue's quota; `refuse_bucket_spread`: a run in a bucket on one
node; `refuse_words`: the entrypoint's plain words). Each refusal is a `SpecError` naming the spec's
fields and the node type's numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobs.errors import SpecError, UserError
from jobs.spec import JobSpec

from ..node_fit import GpuPlan, PodAsk, refusal
from .node_types import NodeType
from .object_storage import StorageAccess
from .policy import SHELL_SAFE

if TYPE_CHECKING:
    from jobs.memory import MemoryPlan

# Outputs in a bucket: the job's driver asks Ray for this many CPUs (`entrypointNumCpus`), which only
# the worker pod has (the head's num-cpus is 0), so it runs beside the workers, on their node.
DRIVER_CPUS = 1


# ---- the job's kind ------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobKind:
    """What the job's kind decides: its command, how long it may run, how often KubeRay retries it,
    and whether it runs trials side by side (a search)."""

    command: tuple[str, ...]
    active_deadline_s: int
    backoff_limit: int  # a fine-tune's retry resumes from its checkpoint; a search's does not
    searches: bool


JOB_KINDS = {
    "finetune": JobKind(("python", "-m", "jobs.finetune"), active_deadline_s=86400, backoff_limit=1, searches=False),
    "tune": JobKind(("rayft", "tune"), active_deadline_s=172800, backoff_limit=0, searches=True),
}
KINDS = tuple(JOB_KINDS)


def kind_of(kind: str) -> JobKind:
    if kind not in JOB_KINDS:
        raise UserError(f"--kind {kind}: expected one of {', '.join(KINDS)}")
    return JOB_KINDS[kind]


# ---- what one job asks of the cluster --------------------------------------------------------------


@dataclass(frozen=True)
class WorkerPods:
    """The job's worker pods. Ray Train runs one worker per GPU; a worker pod holds
    `gpus_per_worker` of them (workers that share a pod share NVLink and /dev/shm). CPU jobs: one
    worker per pod. num_workers is a multiple of gpus_per_worker (jobs.spec checks it)."""

    per_pod: int  # Ray Train workers in one pod
    gpus: int  # GPUs of one worker pod (0: a CPU job)
    cpus: float  # CPUs of one worker pod: its workers' and Ray Train's coordinator / trial
    trials: int  # trials at once (a search), else 1
    count: int  # worker pods of the whole job
    driver_cpus: int = 0  # >0: the job's driver runs on the worker pod too (`one_pod`), with these CPUs

    @classmethod
    def of(cls, spec: JobSpec, kind: JobKind, concurrent_trials: int, one_pod: bool = False) -> WorkerPods:
        """`one_pod`: the driver and every worker in one worker pod (outputs in a bucket: they share
        that pod's staging directory, as on one machine)."""
        res = spec.resources
        per_pod = res.num_workers if one_pod else res.gpus_per_worker if res.use_gpu else 1
        trials = max(1, concurrent_trials) if kind.searches else 1
        driver = DRIVER_CPUS if one_pod else 0
        return cls(
            per_pod=per_pod,
            gpus=per_pod if res.use_gpu else 0,
            cpus=math.ceil(res.cpus_per_worker * per_pod) + 1 + driver,
            trials=trials,
            count=res.num_workers // per_pod * trials,
            driver_cpus=driver,
        )


@dataclass(frozen=True)
class EnginePod:
    """The pod of a separate vLLM engine (`rollout.vllm_placement: separate`): its own GPUs and
    CPUs (one more for Ray's own processes, as a worker pod has), and the Ray resource
    (`ENGINE_RESOURCE`) that only this pod's Ray node offers and the engine's actor asks for, so
    that no training worker takes its place."""

    gpus: int
    cpus: float

    @classmethod
    def of(cls, spec: JobSpec) -> EnginePod | None:
        from orchestrator.queue.admission import separate_engine

        cpus, gpus = separate_engine(spec)
        return cls(gpus, math.ceil(cpus) + 1) if cpus or gpus else None


def refuse_engine_unfit(spec: JobSpec, node: NodeType, where: str, engine: EnginePod | None) -> None:
    """A separate engine's pod needs its GPUs and CPUs on one node of the type (SpecError)."""
    if engine is None:
        return
    desc = f"overlay {node.overlay}'s node type {node.name}"
    if engine.gpus > node.gpus_per_node:
        raise SpecError(
            f"{where}: rollout.vllm_num_gpus={engine.gpus}: the engine's pod needs {engine.gpus} GPU(s) on one "
            f"node but {desc} has {node.gpus_per_node} GPU(s) per node"
        )
    if engine.cpus > node.cpus_per_node:
        raise SpecError(
            f"{where}: rollout.vllm_num_cpus: the engine's pod needs {cpu_quantity(engine.cpus)} CPUs (one more "
            f"for Ray's own) but {desc} has {cpu_quantity(node.cpus_per_node)} CPUs per node"
        )


def refuse_unfit(spec: JobSpec, node: NodeType, where: str, pods: WorkerPods, plan: MemoryPlan | None) -> None:
    """Refuse (SpecError, both numbers named) a job one node of this type cannot hold: the node-fit
    rule (`node_fit.refusal`, the one queue admission applies) said as the spec's fields."""
    res = spec.resources
    on_gpu = None if plan is None else GpuPlan(plan.total_gib, plan.checkpointing, plan.choice)
    pod = PodAsk(
        gpus=pods.gpus,
        cpus=pods.cpus,
        accelerator_type=res.accelerator_type,
        budget_gib=spec.memory.budget_gib,
        plan=lambda gib: on_gpu,
    )  # made for this node type's GPU
    r = refusal(pod, node.offer(node.gpu_memory_gib))  # gpuMemoryGiB as written: 0 (unset) holds nothing
    if r is None:
        return
    desc = f"overlay {node.overlay}'s node type {node.name}"
    if r.fact in ("no-gpus", "gpus"):
        what = (
            f"resources.gpus_per_worker={res.gpus_per_worker} asks for {pods.gpus} GPUs per worker pod"
            if res.gpus_per_worker > 1
            else f"resources asks for {pods.gpus} GPU(s) per worker"
        )
        raise SpecError(f"{where}: {what} but {desc} has {node.gpus_per_node} GPU(s) per node")
    if r.fact == "cpus":
        per = f" x gpus_per_worker={res.gpus_per_worker}" if res.gpus_per_worker > 1 else ""
        raise SpecError(
            f"{where}: resources.cpus_per_worker={res.cpus_per_worker}{per} needs {cpu_quantity(pods.cpus)} CPUs per "
            f"worker pod but {desc} has {cpu_quantity(node.cpus_per_node)} CPUs per node"
        )
    if r.fact == "accelerator":
        raise SpecError(
            f"{where}: resources.accelerator_type={res.accelerator_type} but {desc} has "
            f"{node.ray_accelerator_type or 'unknown'} GPUs ({node.gpu_product}); pick an overlay for that GPU"
        )
    cap = r.have
    if r.fact == "budget":
        raise SpecError(
            f"{where}: memory.budget_gib={spec.memory.budget_gib:g} GiB per GPU exceeds the "
            f"{cap:g} GiB of one {node.gpu_product} GPU ({desc})"
        )
    assert r.fact == "plan" and r.plan is not None, r  # the offer's memory is always known here
    raise SpecError(
        f"{where}: the memory estimate is {r.need:.1f} GiB per GPU (gradient checkpointing "
        f"{r.plan.checkpointing}), more than the {cap:g} GiB of one {node.gpu_product} GPU ({desc}); lower "
        f"batch.micro_batch_size or data.max_seq_len, or turn on memory.gradient_checkpointing"
    )


def refuse_over_quota(
    spec: JobSpec, node: NodeType, where: str, pods: WorkerPods, kind: JobKind, engine: EnginePod | None = None
) -> None:
    """Kueue admits the RayJob only when all its GPUs fit the ClusterQueue's quota at once; more
    than the quota is never admitted, and Kueue says so nowhere: the RayJob waits suspended."""
    res = spec.resources
    engine_gpus = engine.gpus if engine is not None else 0
    gpus = (res.num_workers * pods.trials if pods.gpus else 0) + engine_gpus
    refusal_text = node.gpus_refusal(gpus) if gpus else ""
    if refusal_text:
        asks = f"resources.num_workers={res.num_workers}" + (
            f" x search.max_concurrent_trials={pods.trials}" if kind.searches else ""
        )
        asks += f" + rollout.vllm_num_gpus={engine_gpus}" if engine_gpus else ""
        raise SpecError(f"{where}: {asks}: {refusal_text}")


def refuse_bucket_search(spec: JobSpec, where: str, kind: JobKind, storage: StorageAccess) -> None:
    """A search with a bucket is refused: its trials write into its driver's staging directory
    (`tune.storage`), one node's disk, and a search's RayJob spreads its trials over worker pods. A
    run in a bucket may span pods: each rank uploads its own part of a checkpoint and each node
    fetches the one it resumes from (`jobs.run.mirror`)."""
    if storage.on_object_storage and kind.searches:
        raise SpecError(
            f"{where}: run.output_dir={spec.output_location}: a search in a bucket writes its trials into its "
            "driver's staging directory, one node's disk, and a search's RayJob spreads them over worker pods "
            "(object storage is not supported for a search on Kubernetes yet: use the shared volume)"
        )


def fits_one_pod(spec: JobSpec, node: NodeType) -> bool:
    """Every worker (and the driver's CPU) on one node of the type: a bucket run then keeps them on
    one pod, which stages the run once."""
    res = spec.resources
    if res.use_gpu:
        return res.num_workers <= node.gpus_per_node
    return math.ceil(res.cpus_per_worker * res.num_workers) + 1 + DRIVER_CPUS <= node.cpus_per_node


def refuse_words(where: str, entrypoint_overrides: Sequence[str]) -> None:
    for word in entrypoint_overrides:
        if not SHELL_SAFE.fullmatch(word):
            raise SpecError(
                f"{where}: override {word!r}: on Kubernetes overrides travel on the RayJob's command "
                "line and must be plain words (letters, digits, / . _ - = , : {{}})"
            )


def cpu_quantity(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{int(math.ceil(x * 1000))}m"
