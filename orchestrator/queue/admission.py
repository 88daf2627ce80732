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

GPU memory comes from the node's Ray `accelerator_type` (`GPU_MEMORY_GIB`, overridable with
`--gpu-memory TYPE=GiB`).

Two ways to admit, by backend:

    fit            Ray Jobs: rayft is the only scheduler, so it admits a job when the cluster's
                   free CPUs/GPUs (a `ClusterView`) hold it now.
    fit_node_type  KubeRay: Kueue admits RayJobs by quota, so rayft creates them at once and
                   checks only what Kueue cannot: that one node of the overlay's node type holds
                   a worker pod (GPUs per node, GPU model, GPU memory for the memory plan).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from jobs.errors import UserError
from orchestrator.backends.base import ClusterView, Node
from orchestrator.backends.ray_jobs import DRIVER_NUM_CPUS

# GiB of memory per GPU by Ray `accelerator_type` (ray.util.accelerators). Where one name covers
# two sizes (V100 16/32 GB, A100 40/80 GB) the smaller is used; `--gpu-memory TYPE=GiB` overrides.
GPU_MEMORY_GIB: dict[str, float] = {
    "K80": 12, "P4": 8, "P100": 16, "V100": 16, "T4": 16, "A10G": 24, "L4": 24, "L40S": 48,
    "A100": 40, "A100-40G": 40, "A100-80G": 80, "H100": 80, "H200": 141, "H20": 96,
    "B200": 180, "B300": 288, "GB200": 186, "GB300": 288, "RTX-PRO-6000": 96,
    "AMD-Instinct-MI210": 64, "AMD-Instinct-MI250X": 64, "AMD-Instinct-MI250X-MI250": 64,
    "AMD-Instinct-MI300X-OAM": 192, "AMD-Instinct-MI300X-HF": 192, "AMD-Instinct-MI325X-OAM": 256,
    "AMD-Instinct-MI350X-OAM": 288, "AMD-Instinct-MI355X-OAM": 288,
    "Intel-GPU-Max-1550": 128, "Intel-GPU-Max-1100": 48,
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
    accelerator_type: Optional[str] = None
    driver_cpus: float = DRIVER_NUM_CPUS
    gib_by_every: Optional[dict[int, float]] = None
    gc_mode: str = "auto"                 # memory.gradient_checkpointing: "true", "false" or "auto"
    budget_gib: Optional[float] = None    # memory.budget_gib
    num_layers: int = 1                   # decoder layers of the model (the checkpointing candidates)
    plan_table: Optional[dict] = None     # jobs.memory.plan_table: estimates by strategy and checkpointing
    gpus_per_worker: int = 1              # resources.gpus_per_worker: GPUs of one worker pod, on one node

    @property
    def cpus(self) -> float:
        return self.driver_cpus + self.num_workers * self.cpus_per_worker

    @property
    def gpus(self) -> float:
        return float(self.num_workers) if self.use_gpu else 0.0

    @property
    def pod_gpus(self) -> int:
        """GPUs one worker pod needs on one node (0 for a CPU job)."""
        return max(1, self.gpus_per_worker) if self.use_gpu else 0

    @property
    def pods(self) -> int:
        """Worker pods: the workers, `gpus_per_worker` to a pod (spec validation makes it divide)."""
        return self.num_workers // max(1, self.pod_gpus)

    def gpu_plan(self, gpu_mem_gib: float) -> tuple[int, float]:
        """(checkpoint every k-th layer, GiB per GPU) the job runs with on a GPU of `gpu_mem_gib`:
        `choose_checkpointing_every` under the budget `memory.budget_gib`, else the GPU's memory."""
        from jobs.memory import choose_checkpointing_every, choose_plan_from_table

        budget = self.budget_gib if self.budget_gib is not None else gpu_mem_gib
        if self.plan_table:
            _, every, gib = choose_plan_from_table(self.plan_table, self.gc_mode, self.num_layers, budget)
            return every, gib
        if not self.gib_by_every:
            return 0, 0.0
        every = choose_checkpointing_every(self.gc_mode, self.gib_by_every.__getitem__, self.num_layers, budget)
        return every, self.gib_by_every[every]

    def gpu_strategy(self, gpu_mem_gib: float) -> str:
        """The strategy choice (`jobs.memory.CHOICES`: ddp, fsdp, fsdp-keep) on a GPU of `gpu_mem_gib`."""
        from jobs.memory import choose_plan_from_table

        if not self.plan_table:
            return "ddp"
        budget = self.budget_gib if self.budget_gib is not None else gpu_mem_gib
        return choose_plan_from_table(self.plan_table, self.gc_mode, self.num_layers, budget)[0]

    def gpu_need_gib(self, gpu_mem_gib: float) -> float:
        """The estimate the job will run with on a GPU of `gpu_mem_gib` GiB (see `gpu_plan`)."""
        return self.gpu_plan(gpu_mem_gib)[1]

    @property
    def est_gib_off(self) -> Optional[float]:
        """GiB per GPU with gradient checkpointing off."""
        return None if not self.gib_by_every else self.gib_by_every[0]

    @property
    def est_gib_on(self) -> Optional[float]:
        """GiB per GPU with gradient checkpointing on every layer."""
        return None if not self.gib_by_every else self.gib_by_every[1]

    @classmethod
    def from_spec(cls, spec, driver_cpus: float = DRIVER_NUM_CPUS) -> "Demand":
        """The demand of a validated JobSpec; for a GPU job this runs the memory model (once per
        checkpointing choice), which is why the queue stores the result instead of the spec."""
        r = spec.resources
        d = cls(r.num_workers, r.cpus_per_worker, r.use_gpu, r.accelerator_type, driver_cpus,
                gc_mode=str(spec.memory.gradient_checkpointing).lower(), budget_gib=spec.memory.budget_gib,
                gpus_per_worker=r.gpus_per_worker if r.use_gpu else 1)
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
    def from_json(cls, text: str) -> "Demand":
        d: dict[str, Any] = json.loads(text)
        table = d.pop("gib_by_every", None)
        # A row queued before the checkpointing table existed has off/on estimates only.
        off, on = d.pop("est_gib_off", None), d.pop("est_gib_on", None)
        if table is None and off is not None:
            table, d["num_layers"] = {0: off, 1: on if on is not None else off}, 1
        d["gib_by_every"] = None if table is None else {int(k): float(v) for k, v in table.items()}
        return cls(**d)


def gpu_memory_of(accel: Optional[str], overrides: dict[str, float]) -> Optional[float]:
    """GiB per GPU of a Ray accelerator type: `--gpu-memory` first, then `GPU_MEMORY_GIB`, then
    `--gpu-memory default=GiB`; None when unknown (never guessed)."""
    lower = {k.lower(): v for k, v in overrides.items()}
    if accel:
        if accel.lower() in lower:
            return lower[accel.lower()]
        table = {k.lower(): v for k, v in GPU_MEMORY_GIB.items()}
        if accel.lower() in table:
            return table[accel.lower()]
    return lower.get("default")


def fit(demand: Demand, view: ClusterView, gpu_memory: Optional[dict[str, float]] = None,
        held: Optional[tuple[float, float]] = None) -> tuple[bool, bool, str]:
    """(fits now, could ever fit this cluster, why not).

    Worker pods (`gpus_per_worker` workers each, all of a pod's GPUs and CPUs on one node) are
    placed first-fit on nodes' free CPUs/GPUs (a GPU node only when its GPU memory holds the job's
    estimate and its type matches `resources.accelerator_type`); the driver's CPU share goes anywhere. `held` = (CPUs, GPUs) of this queue's active jobs: a job submitted
    moments ago holds resources the cluster's usage report may not show yet, so free is at most
    total - held. When the job fits, its placement is taken off `view`'s free resources, so the
    next job of the same admission pass sees what is left.
    """
    gpu_memory = gpu_memory or {}

    def node_ok(n: Node) -> tuple[bool, str]:
        if not demand.use_gpu:
            return True, ""
        if n.gpu_total < 1:
            return False, ""
        if demand.accelerator_type and (n.accelerator_type or "").lower() != demand.accelerator_type.lower():
            return False, f"accelerator_type {n.accelerator_type or 'unknown'} is not {demand.accelerator_type}"
        mem = gpu_memory_of(n.accelerator_type, gpu_memory)
        if mem is None:
            return False, (f"GPU memory of accelerator_type {n.accelerator_type or '(none)'} is unknown: pass "
                           f"--gpu-memory {n.accelerator_type or 'default'}=GiB")
        every, need = demand.gpu_plan(mem)
        if need > mem:
            from jobs.memory import checkpointing_str

            return False, (f"needs {need:.1f} GiB per GPU, {n.accelerator_type} has {mem:g} GiB "
                           f"({demand.gpu_strategy(mem)}, gradient checkpointing {checkpointing_str(every)})")
        return True, ""

    pod_gpus = demand.pod_gpus
    pod_cpus = demand.cpus_per_worker * max(1, pod_gpus)

    def place(free: dict[str, tuple[float, float]]) -> Optional[dict[str, tuple[float, float]]]:
        free = dict(free)
        for _ in range(demand.pods):
            for n in view.nodes:
                ok, _ = node_ok(n)
                c, g = free[n.node_id]
                if ok and c >= pod_cpus - 1e-9 and g >= pod_gpus - 1e-9:
                    free[n.node_id] = (c - pod_cpus, g - pod_gpus)
                    break
            else:
                return None
        rest = demand.driver_cpus
        for n in view.nodes:             # the driver's share, wherever CPUs are left
            c, g = free[n.node_id]
            take = min(max(c, 0.0), rest)
            free[n.node_id] = (c - take, g)
            rest -= take
        return free if rest <= 1e-9 else None

    ever = place({n.node_id: (n.cpu_total, n.gpu_total) for n in view.nodes}) is not None
    if not ever:
        reasons = sorted({r for n in view.nodes for ok, r in [node_ok(n)] if not ok and r})
        most_gpus = max((n.gpu_total for n in view.nodes), default=0.0)
        if demand.use_gpu and view.gpu_total < 1:
            why = "the cluster has no GPUs"
        elif pod_gpus > 1 and most_gpus < pod_gpus and not reasons:
            why = (f"resources.gpus_per_worker={pod_gpus} needs {pod_gpus} GPUs on one node, the largest node "
                   f"has {most_gpus:g}")
        elif reasons and demand.use_gpu:
            why = "; ".join(reasons)
        else:
            why = f"needs {demand.cpus:g} CPUs{f' and {demand.gpus:g} GPUs' if demand.gpus else ''} in total"
        return False, False, f"can never fit this cluster ({view.cpu_total:g} CPUs, {view.gpu_total:g} GPUs): {why}"
    placed = place({n.node_id: (n.cpu_free, n.gpu_free) for n in view.nodes})
    now = placed is not None
    cpu_free, gpu_free = view.cpu_free, view.gpu_free
    if held is not None:
        cpu_free = min(cpu_free, view.cpu_total - held[0])
        gpu_free = min(gpu_free, view.gpu_total - held[1])
        now = now and demand.cpus <= cpu_free + 1e-9 and demand.gpus <= gpu_free + 1e-9
    if not now:
        what = f"{demand.cpus:g} CPUs" + (f" and {demand.gpus:g} GPUs" if demand.gpus else "") \
            + (f" ({pod_gpus} GPUs on one node per worker pod)" if pod_gpus > 1 else "")
        have = f"{max(cpu_free, 0):g} CPUs" + (f" and {max(gpu_free, 0):g} GPUs" if demand.gpus else "") + " free"
        return False, True, f"waiting for resources: needs {what}, {have}"
    for n in view.nodes:                 # so that the next job of the same pass sees what is left
        n.cpu_free, n.gpu_free = placed[n.node_id]
    return True, True, ""


def fit_node_type(demand: Demand, node, gpu_memory: Optional[dict[str, float]] = None) -> tuple[bool, bool, str]:
    """(fits, could ever fit, why not) of a job on a KubeRay cluster of one node type
    (`orchestrator.backends.kuberay.NodeType`).

    Kueue admits by quota: it counts GPUs, not where they are or how much memory they have. So
    rayft checks what quota cannot see, the same facts `render` refuses on: a worker pod's
    `gpus_per_worker` GPUs on one node, `resources.accelerator_type` against the node's GPU, the
    memory plan against the GPU's memory (`--gpu-memory` for the node's Ray accelerator type
    overrides the node type's `gpuMemoryGiB`), and no more GPUs than Kueue's ClusterQueue hands out
    to RayJobs (`jobQuotaGpus`) or the node type's cluster has (`clusterGpus`): Kueue would keep
    such a job suspended forever (`NodeType.gpus_refusal`, the check `render` makes). Never "not
    now": waiting for free GPUs is Kueue's.
    """
    if not demand.use_gpu:
        return True, True, ""
    desc = f"node type {node.overlay}/{node.name}"

    def never(why: str) -> tuple[bool, bool, str]:
        return False, False, f"can never fit {desc} ({node.gpus_per_node} x {node.gpu_product or 'no GPU'}): {why}"

    if node.gpus_per_node < 1:
        return never("it has no GPUs")
    if demand.pod_gpus > node.gpus_per_node:
        return never(f"resources.gpus_per_worker={demand.pod_gpus} needs {demand.pod_gpus} GPUs on one node, "
                     f"it has {node.gpus_per_node}")
    refusal = node.gpus_refusal(demand.gpus)
    if refusal:
        return never(f"resources.num_workers={demand.num_workers}: {refusal}")
    accel = demand.accelerator_type
    if accel and accel.lower() not in {node.ray_accelerator_type.lower(), node.gpu_product.lower()}:
        return never(f"resources.accelerator_type {accel} is not its {node.ray_accelerator_type or node.gpu_product}")
    given = {k.lower(): v for k, v in (gpu_memory or {}).items()}
    mem = given.get((node.ray_accelerator_type or "").lower()) or node.gpu_memory_gib or given.get("default")
    if not mem:
        return never(f"its GPU memory is unknown: set gpuMemoryGiB in the node type or pass "
                     f"--gpu-memory {node.ray_accelerator_type or 'default'}=GiB")
    if demand.budget_gib is not None and demand.budget_gib > mem:
        return never(f"memory.budget_gib={demand.budget_gib:g} GiB per GPU exceeds its {mem:g} GiB")
    every, need = demand.gpu_plan(mem)
    if need > mem:
        from jobs.memory import checkpointing_str

        return never(f"needs {need:.1f} GiB per GPU (gradient checkpointing {checkpointing_str(every)}), "
                     f"its GPU has {mem:g} GiB")
    return True, True, ""


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
