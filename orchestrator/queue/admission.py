"""Admission: does a queued job fit the cluster now, could it ever, and why not.

A job's `Demand` is what it holds while it runs: the driver's CPU share, `cpus_per_worker` per
worker and, for GPU jobs, one GPU per worker whose memory holds the job's memory plan. Workers
come in pods of `resources.gpus_per_worker` GPUs (one Ray Train worker per GPU): each pod's
GPUs must be free on one node, so four free GPUs on four nodes do not hold one pod of two. The plan
is `jobs.memory`'s, decided by the one rule (`choose_plan`: strategy, then checkpointing) for the
GPU it would land on: `Demand` keeps the estimate of every strategy and checkpointing choice
(`plan_table`, made once at `queue add`), so admission applies the rule per GPU size without
reloading the spec, and
gets exactly what `plan_for_spec(spec, device="cuda", gpu_memory_gib=GPU)` -- and so the training
loop on that GPU -- gets.

GPU memory comes from the node's Ray `accelerator_type` (`GPU_MEMORY_GIB`; on KubeRay the node
type's `gpuMemoryGiB`), overridable with `--gpu-memory TYPE=GiB`. Whether one worker pod can ever
run on one node is the node-fit rule (`orchestrator.backends.node_fit.refusal`), the one `render`
refuses specs on; this module only says its refusals in the queue's words.

Two ways to admit, by backend:

    place / reserve  Ray Jobs: rayft is the only scheduler, so it admits a job when the cluster's
                     free CPUs/GPUs (a `ClusterView`) hold it now. `place` says where it would
                     go (pure); `reserve` also takes that off the view for the rest of the pass.
    fit_node_type    KubeRay: Kueue admits RayJobs by quota, so rayft creates them at once and
                     checks only what Kueue cannot: that one node of the overlay's node type holds
                     a worker pod (GPUs per node, GPU model, GPU memory for the memory plan).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from jobs.errors import UserError
from orchestrator.backends.base import ClusterView, Node
from orchestrator.backends.node_fit import GpuPlan, NodeOffer, PodAsk, Refusal, gpu_memory_of, refusal
from orchestrator.backends.ray_jobs import DRIVER_NUM_CPUS

if TYPE_CHECKING:
    from jobs.spec import JobSpec

# GiB of memory per GPU by Ray `accelerator_type` (ray.util.accelerators). Where one name covers
# two sizes (V100 16/32 GB, A100 40/80 GB) the smaller is used; `--gpu-memory TYPE=GiB` overrides.
GPU_MEMORY_GIB: dict[str, float] = {
    "K80": 12,
    "P4": 8,
    "P100": 16,
    "V100": 16,
    "T4": 16,
    "A10G": 24,
    "L4": 24,
    "L40S": 48,
    "A100": 40,
    "A100-40G": 40,
    "A100-80G": 80,
    "H100": 80,
    "H200": 141,
    "H20": 96,
    "B200": 180,
    "B300": 288,
    "GB200": 186,
    "GB300": 288,
    "RTX-PRO-6000": 96,
    "AMD-Instinct-MI210": 64,
    "AMD-Instinct-MI250X": 64,
    "AMD-Instinct-MI250X-MI250": 64,
    "AMD-Instinct-MI300X-OAM": 192,
    "AMD-Instinct-MI300X-HF": 192,
    "AMD-Instinct-MI325X-OAM": 256,
    "AMD-Instinct-MI350X-OAM": 288,
    "AMD-Instinct-MI355X-OAM": 288,
    "Intel-GPU-Max-1550": 128,
    "Intel-GPU-Max-1100": 48,
}


@dataclass
class Demand:
    """What one job holds while it runs, and what it needs of a GPU.

    `plan_table` (`jobs.memory.plan_table`, device cuda) is {k: estimated GiB per GPU with
    gradient checkpointing every k-th layer (0 = off)} for every strategy choice the spec leaves
    (DDP, FSDP keeping layers gathered, FSDP resharding); with `gc_mode`, `budget_gib` and
    `num_layers` it is all `gpu_plan` needs. `gib_by_every` is the first choice's row (what
    `est_gib_off`/`est_gib_on` show), and all a row queued before `plan_table` existed has (DDP).
    Stored as JSON in the queue database, so it must stay plain data.
    """

    num_workers: int
    cpus_per_worker: float
    use_gpu: bool = False
    accelerator_type: str | None = None
    driver_cpus: float = DRIVER_NUM_CPUS
    gib_by_every: dict[int, float] | None = None
    gc_mode: str = "auto"  # memory.gradient_checkpointing: "true", "false" or "auto"
    budget_gib: float | None = None  # memory.budget_gib
    num_layers: int = 1  # decoder layers of the model (the checkpointing candidates)
    plan_table: dict | None = None  # jobs.memory.plan_table: estimates by strategy and checkpointing
    gpus_per_worker: int = 1  # resources.gpus_per_worker: GPUs of one worker pod, on one node
    # A separate vLLM engine (rollout.vllm_placement: separate): its own CPUs and GPUs, on one node
    engine_cpus: float = 0.0
    engine_gpus: int = 0

    @property
    def cpus(self) -> float:
        return self.driver_cpus + self.num_workers * self.cpus_per_worker + self.engine_cpus

    @property
    def gpus(self) -> float:
        return (float(self.num_workers) if self.use_gpu else 0.0) + self.engine_gpus

    @property
    def pod_gpus(self) -> int:
        """GPUs one worker pod needs on one node (0 for a CPU job)."""
        return max(1, self.gpus_per_worker) if self.use_gpu else 0

    @property
    def pods(self) -> int:
        """Worker pods: the workers, `gpus_per_worker` to a pod (spec validation makes it divide)."""
        return self.num_workers // max(1, self.pod_gpus)

    def _choose(self, gpu_mem_gib: float) -> tuple[str, int, float]:
        """(strategy choice, checkpoint every k-th layer, GiB per GPU) the job runs with on a GPU of
        `gpu_mem_gib`: `choose_plan_from_table` (for a row queued before the table,
        `choose_checkpointing_every` on its DDP row) under the budget `memory.budget_gib`, else the
        GPU's memory."""
        from jobs.memory import choose_checkpointing_every, choose_plan_from_table

        budget = self.budget_gib if self.budget_gib is not None else gpu_mem_gib
        if self.plan_table:
            return choose_plan_from_table(self.plan_table, self.gc_mode, self.num_layers, budget)
        if not self.gib_by_every:
            return "ddp", 0, 0.0
        every = choose_checkpointing_every(self.gc_mode, self.gib_by_every.__getitem__, self.num_layers, budget)
        return "ddp", every, self.gib_by_every[every]

    def gpu_plan(self, gpu_mem_gib: float) -> tuple[int, float]:
        """(checkpoint every k-th layer, GiB per GPU) the job runs with on a GPU of `gpu_mem_gib`."""
        _, every, gib = self._choose(gpu_mem_gib)
        return every, gib

    def gpu_strategy(self, gpu_mem_gib: float) -> str:
        """The strategy choice (`jobs.memory.CHOICES`: ddp, fsdp, fsdp-keep) on a GPU of `gpu_mem_gib`."""
        return self._choose(gpu_mem_gib)[0]

    def plan_on_gpu(self, gpu_mem_gib: float) -> GpuPlan:
        """The plan on a GPU of `gpu_mem_gib`, as the node-fit rule holds it against the GPU."""
        from jobs.memory import checkpointing_str

        choice, every, gib = self._choose(gpu_mem_gib)
        return GpuPlan(gib, checkpointing_str(every), choice)

    def pod(self) -> PodAsk:
        """One worker pod as the node-fit rule sees it: its GPUs, their type and the memory plan.
        Its CPUs and `memory.budget_gib` are judged by the kind of admission that judges them."""
        return PodAsk(gpus=self.pod_gpus, accelerator_type=self.accelerator_type, plan=self.plan_on_gpu)

    def gpu_need_gib(self, gpu_mem_gib: float) -> float:
        """The estimate the job will run with on a GPU of `gpu_mem_gib` GiB (see `gpu_plan`)."""
        return self.gpu_plan(gpu_mem_gib)[1]

    @property
    def est_gib_off(self) -> float | None:
        """GiB per GPU with gradient checkpointing off."""
        return None if not self.gib_by_every else self.gib_by_every[0]

    @property
    def est_gib_on(self) -> float | None:
        """GiB per GPU with gradient checkpointing on every layer."""
        return None if not self.gib_by_every else self.gib_by_every[1]

    @classmethod
    def from_spec(cls, spec: JobSpec, driver_cpus: float = DRIVER_NUM_CPUS) -> Demand:
        """The demand of a validated JobSpec; for a GPU job this runs the memory model (once per
        checkpointing choice), which is why the queue stores the result instead of the spec."""
        r = spec.resources
        d = cls(
            r.num_workers,
            r.cpus_per_worker,
            r.use_gpu,
            r.accelerator_type,
            driver_cpus,
            gc_mode=str(spec.memory.gradient_checkpointing).lower(),
            budget_gib=spec.memory.budget_gib,
            gpus_per_worker=r.gpus_per_worker if r.use_gpu else 1,
        )
        d.engine_cpus, d.engine_gpus = separate_engine(spec)
        if r.use_gpu:
            from jobs.memory import config_from_spec, model_shape, plan_table

            config = config_from_spec(spec)
            d.plan_table = plan_table(spec, device="cuda", config=config)
            d.gib_by_every = d.plan_table["gib"][d.plan_table["choices"][0]]
            d.num_layers = model_shape(config).layers
        return d

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Demand:
        d: dict[str, Any] = json.loads(text)
        table = d.pop("gib_by_every", None)
        # A row queued before the checkpointing table existed has off/on estimates only.
        off, on = d.pop("est_gib_off", None), d.pop("est_gib_on", None)
        if table is None and off is not None:
            table, d["num_layers"] = {0: off, 1: on if on is not None else off}, 1
        d["gib_by_every"] = None if table is None else {int(k): float(v) for k, v in table.items()}
        return cls(**d)


def _ray_gpu_memory_gib(accel: str | None, overrides: dict[str, float]) -> float | None:
    """GiB per GPU of a Ray node whose GPUs are of Ray accelerator type `accel` (`GPU_MEMORY_GIB`
    under `--gpu-memory`, `node_fit.gpu_memory_of`); None when unknown (never guessed)."""
    table = {k.lower(): v for k, v in GPU_MEMORY_GIB.items()}
    return gpu_memory_of(accel, overrides, table.get(accel.lower()) if accel else None)


def _ray_node_offer(n: Node, gpu_memory: dict[str, float]) -> NodeOffer:
    """A Ray node as the node-fit rule sees it: its size is the placement's, against its free resources."""
    return NodeOffer(
        gpus=n.gpu_total,
        cpus=n.cpu_total,
        gpu_names=(n.accelerator_type or "",),
        gpu_memory_gib=_ray_gpu_memory_gib(n.accelerator_type, gpu_memory),
        sized_by_placement=True,
    )


def _ray_node_ok(demand: Demand, n: Node, gpu_memory: dict[str, float]) -> tuple[bool, str]:
    """(may a worker pod of `demand` go on Ray node `n`, why not). The reason is "" for a node
    without GPUs: the cluster-wide reason (`place`) says that. `memory.budget_gib` steers the plan
    only: a Ray cluster's nodes are of many kinds, and a budget above one GPU's memory is refused
    there only when the plan it picks does not fit (render refuses it for the one node type)."""
    r = refusal(demand.pod(), _ray_node_offer(n, gpu_memory))
    if r is None:
        return True, ""
    if r.fact == "accelerator":
        return False, f"accelerator_type {n.accelerator_type or 'unknown'} is not {demand.accelerator_type}"
    if r.fact == "memory-unknown":
        return False, (
            f"GPU memory of accelerator_type {n.accelerator_type or '(none)'} is unknown: pass "
            f"--gpu-memory {n.accelerator_type or 'default'}=GiB"
        )
    if r.fact == "plan" and r.plan is not None:
        return False, (
            f"needs {r.need:.1f} GiB per GPU, {n.accelerator_type} has {r.have:g} GiB "
            f"({r.plan.choice}, gradient checkpointing {r.plan.checkpointing})"
        )
    return False, ""


@dataclass(frozen=True)
class Placement:
    """Where a job would go on a Ray cluster now (`place`): whether it fits now, could ever fit
    this cluster, why not, and every node's free (CPUs, GPUs) once it is placed (when it fits now)."""

    now: bool
    ever: bool
    why: str = ""
    free_after: dict[str, tuple[float, float]] | None = None


def _first_fit(
    demand: Demand, nodes: list[Node], allowed: dict[str, bool], free: dict[str, tuple[float, float]]
) -> dict[str, tuple[float, float]] | None:
    """`free` after placing the job's worker pods first-fit (all of a pod's GPUs and CPUs on one
    allowed node), a separate vLLM engine's CPUs and GPUs on one node, and then the driver's CPU
    share anywhere; None when they do not all fit."""
    pod_gpus = demand.pod_gpus
    pod_cpus = demand.cpus_per_worker * max(1, pod_gpus)
    free = dict(free)
    for _ in range(demand.pods):
        for n in nodes:
            c, g = free[n.node_id]
            if allowed[n.node_id] and c >= pod_cpus - 1e-9 and g >= pod_gpus - 1e-9:
                free[n.node_id] = (c - pod_cpus, g - pod_gpus)
                break
        else:
            return None
    if demand.engine_cpus or demand.engine_gpus:  # a separate vLLM engine: one actor, on one node
        fits = [
            n
            for n in nodes
            if min(free[n.node_id][0] - demand.engine_cpus, free[n.node_id][1] - demand.engine_gpus) >= -1e-9
        ]
        if not fits:
            return None
        c, g = free[fits[0].node_id]
        free[fits[0].node_id] = (c - demand.engine_cpus, g - demand.engine_gpus)
    rest = demand.driver_cpus
    for n in nodes:  # the driver's share, wherever CPUs are left
        c, g = free[n.node_id]
        take = min(max(c, 0.0), rest)
        free[n.node_id] = (c - take, g)
        rest -= take
    return free if rest <= 1e-9 else None


def _never_why(demand: Demand, view: ClusterView, reasons: list[str]) -> str:
    """Why a job can never fit this cluster, even empty; `reasons`: why nodes refuse its pods."""
    pod_gpus = demand.pod_gpus
    most_gpus = max((n.gpu_total for n in view.nodes), default=0.0)
    if demand.use_gpu and view.gpu_total < 1:
        why = "the cluster has no GPUs"
    elif pod_gpus > 1 and most_gpus < pod_gpus and not reasons:
        why = (
            f"resources.gpus_per_worker={pod_gpus} needs {pod_gpus} GPUs on one node, the largest node "
            f"has {most_gpus:g}"
        )
    elif reasons and demand.use_gpu:
        why = "; ".join(reasons)
    else:
        why = f"needs {demand.cpus:g} CPUs{f' and {demand.gpus:g} GPUs' if demand.gpus else ''} in total"
    return f"can never fit this cluster ({view.cpu_total:g} CPUs, {view.gpu_total:g} GPUs): {why}"


def place(
    demand: Demand,
    view: ClusterView,
    gpu_memory: dict[str, float] | None = None,
    held: tuple[float, float] | None = None,
) -> Placement:
    """Where `demand` would go on a Ray cluster now; `view` is not changed (`reserve` takes it off).

    Worker pods (`gpus_per_worker` workers each, all of a pod's GPUs and CPUs on one node) are
    placed first-fit on nodes' free CPUs/GPUs, on the nodes the node-fit rule allows (a GPU node
    only when its GPU memory holds the job's plan and its type matches `resources.accelerator_type`);
    the driver's CPU share goes anywhere. `held` = (CPUs, GPUs) of this queue's active jobs: a job
    submitted moments ago holds resources the cluster's usage report may not show yet, so free is
    at most total - held.
    """
    checked = {n.node_id: _ray_node_ok(demand, n, gpu_memory or {}) for n in view.nodes}
    allowed = {k: ok for k, (ok, _) in checked.items()}
    if _first_fit(demand, view.nodes, allowed, {n.node_id: (n.cpu_total, n.gpu_total) for n in view.nodes}) is None:
        reasons = sorted({r for ok, r in checked.values() if not ok and r})
        return Placement(False, False, _never_why(demand, view, reasons))
    placed = _first_fit(demand, view.nodes, allowed, {n.node_id: (n.cpu_free, n.gpu_free) for n in view.nodes})
    now = placed is not None
    cpu_free, gpu_free = view.cpu_free, view.gpu_free
    if held is not None:
        cpu_free = min(cpu_free, view.cpu_total - held[0])
        gpu_free = min(gpu_free, view.gpu_total - held[1])
        now = now and demand.cpus <= cpu_free + 1e-9 and demand.gpus <= gpu_free + 1e-9
    if not now:
        pod_gpus = demand.pod_gpus
        what = (
            f"{demand.cpus:g} CPUs"
            + (f" and {demand.gpus:g} GPUs" if demand.gpus else "")
            + (f" ({pod_gpus} GPUs on one node per worker pod)" if pod_gpus > 1 else "")
        )
        have = f"{max(cpu_free, 0):g} CPUs" + (f" and {max(gpu_free, 0):g} GPUs" if demand.gpus else "") + " free"
        return Placement(False, True, f"waiting for resources: needs {what}, {have}")
    return Placement(True, True, "", placed)


def reserve(
    demand: Demand,
    view: ClusterView,
    gpu_memory: dict[str, float] | None = None,
    held: tuple[float, float] | None = None,
) -> tuple[bool, bool, str]:
    """(fits now, could ever fit this cluster, why not) of `place`; when the job fits now, its
    placement is taken off `view`'s free resources, so the next job of the same admission pass
    sees what is left."""
    p = place(demand, view, gpu_memory, held)
    if p.free_after is not None:
        for n in view.nodes:
            n.cpu_free, n.gpu_free = p.free_after[n.node_id]
    return p.now, p.ever, p.why


def _node_type_why(demand: Demand, node, r: Refusal) -> str:
    """A node-fit refusal as KubeRay admission says it (the node type in the third person)."""
    if r.fact == "no-gpus":
        return "it has no GPUs"
    if r.fact == "gpus":
        return (
            f"resources.gpus_per_worker={demand.pod_gpus} needs {demand.pod_gpus} GPUs on one node, "
            f"it has {node.gpus_per_node}"
        )
    if r.fact == "accelerator":
        return (
            f"resources.accelerator_type {demand.accelerator_type} is not its "
            f"{node.ray_accelerator_type or node.gpu_product}"
        )
    if r.fact == "memory-unknown":
        return (
            f"its GPU memory is unknown: set gpuMemoryGiB in the node type or pass "
            f"--gpu-memory {node.ray_accelerator_type or 'default'}=GiB"
        )
    if r.fact == "budget":
        return f"memory.budget_gib={r.need:g} GiB per GPU exceeds its {r.have:g} GiB"
    checkpointing = r.plan.checkpointing if r.plan is not None else "-"
    return f"needs {r.need:.1f} GiB per GPU (gradient checkpointing {checkpointing}), its GPU has {r.have:g} GiB"


def fit_node_type(demand: Demand, node, gpu_memory: dict[str, float] | None = None) -> tuple[bool, bool, str]:
    """(fits, could ever fit, why not) of a job on a KubeRay cluster of one node type
    (`orchestrator.backends.kuberay.NodeType`). Pure: nothing is reserved.

    Kueue admits by quota: it counts GPUs, not where they are or how much memory they have. So
    rayft checks what quota cannot see, with the node-fit rule `render` refuses on
    (`node_fit.refusal`): a worker pod's `gpus_per_worker` GPUs on one node, `resources.accelerator_type`
    against the node's GPU, `memory.budget_gib` and the memory plan against the GPU's memory
    (`--gpu-memory` for the node's Ray accelerator type overrides the node type's `gpuMemoryGiB`);
    then no more GPUs than Kueue's ClusterQueue hands out to RayJobs (`jobQuotaGpus`) or the node
    type's cluster has (`clusterGpus`): Kueue would keep such a job suspended forever
    (`NodeType.gpus_refusal`, the check `render` makes). A pod's CPUs are left to `render`, which
    refuses them at submission. Never "not now": waiting for free GPUs is Kueue's.
    """
    if not demand.use_gpu:
        return True, True, ""
    mem = gpu_memory_of(node.ray_accelerator_type, gpu_memory or {}, node.gpu_memory_gib or None)
    r = refusal(replace(demand.pod(), budget_gib=demand.budget_gib), node.offer(mem))
    quota = node.gpus_refusal(demand.gpus)
    # Said in this order: the node's size, then Kueue's quota, then its GPU's model and memory.
    if r is not None and (r.fact in ("no-gpus", "gpus") or not quota):
        why = _node_type_why(demand, node, r)
    elif quota:
        why = f"resources.num_workers={demand.num_workers}: {quota}"
    else:
        return True, True, ""
    return (
        False,
        False,
        (
            f"can never fit node type {node.overlay}/{node.name} "
            f"({node.gpus_per_node} x {node.gpu_product or 'no GPU'}): {why}"
        ),
    )


def parse_gpu_memory(items: list[str]) -> dict[str, float]:
    """`--gpu-memory TYPE=GiB` (repeatable; a bare `GiB` is `default=GiB`) as {type: GiB}."""
    out = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep:
            key, val = "default", item
        try:
            gib = float(val)
        except ValueError:
            raise UserError(f"--gpu-memory {item!r}: expected TYPE=GiB (e.g. H100=80) or GiB") from None
        if gib <= 0 or not math.isfinite(gib):
            raise UserError(f"--gpu-memory {item!r}: GiB must be positive")
        out[key.strip()] = gib
    return out


def separate_engine(spec: JobSpec) -> tuple[float, int]:
    """(CPUs, GPUs) of the vLLM engine a run starts on resources of its own (`rollout.vllm_placement:
    separate`); (0, 0) for a colocated engine (it shares rank 0's), a user's `rollout.vllm_url`, or none."""
    r = spec.rollout
    if r is None or r.engine != "vllm" or r.vllm_url or r.vllm_placement != "separate":
        return 0.0, 0
    from jobs.rollout.vllm_host import separate_gpus

    return r.vllm_num_cpus, separate_gpus(r, spec.resources.use_gpu)
