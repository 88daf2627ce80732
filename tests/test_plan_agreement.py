"""One memory plan: every consumer of `jobs.memory.plan_for_spec` decides exactly what it decides.

One table of cases (tiny-llama; CPU and GPU; gradient checkpointing auto / true / false; a per-GPU
budget placed below, between and above the estimates of every checkpointing choice, and none),
one function per consumer returning (estimate GiB, checkpointing) -- or None where that consumer
does not judge the case -- and one test that every column equals the plan's, with `==`, not
approximately. To check another consumer, add a column to `COLUMNS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest

from jobs.memory import GIB, checkpointing_str, checkpointing_table, plan_for_spec
from jobs.spec import JobSpec, load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny-lora.yaml"
GPU_OVERLAY, CPU_OVERLAY = "gpu", "dev-cpu"

Column = Optional[tuple[float, str]]      # (estimate GiB per worker, checkpointing as checkpointing_str says it)


@dataclass(frozen=True)
class Case:
    device: str                        # "cuda" or "cpu"
    gradient_checkpointing: str        # "auto", "true", "false"
    budget_gib: Optional[float]        # memory.budget_gib
    where: str                         # which plan boundary the budget sits at, for the test id

    @property
    def id(self) -> str:
        return f"{self.device}-gc_{self.gradient_checkpointing}-{self.where}"

    def spec(self) -> JobSpec:
        overrides = [f"resources.use_gpu={'true' if self.device == 'cuda' else 'false'}",
                     f"memory.gradient_checkpointing={self.gradient_checkpointing}"]
        if self.budget_gib is not None:
            overrides.append(f"memory.budget_gib={self.budget_gib!r}")
        return load_spec(SPEC, overrides, files=False)


def gpu_memory_gib() -> float:
    """The GPU every GPU column judges against: the gpu overlay's node type (what k8s render uses)."""
    from orchestrator.backends.kuberay import load_node_type

    return load_node_type(GPU_OVERLAY).gpu_memory_gib


def budgets(device: str) -> list[tuple[str, Optional[float]]]:
    """A budget in every interval the checkpointing choices' estimates cut the line into, and none."""
    table = checkpointing_table(load_spec(SPEC, [f"resources.use_gpu={device == 'cuda'}"], files=False),
                                device=device)
    gib = sorted(set(table.values()))
    assert len(gib) == len(table) >= 3, table          # off, every 2nd layer, every layer: distinct
    out = [("below_all", gib[0] * 0.99)]
    out += [(f"between_{i}_{i + 1}", (a + b) / 2) for i, (a, b) in enumerate(zip(gib, gib[1:]))]
    return out + [("above_all", gib[-1] * 1.01), ("no_budget", None)]


CASES = [Case(device, gc, budget, where)
         for device in ("cuda", "cpu")
         for gc in ("auto", "true", "false")
         for where, budget in budgets(device)]


# ---- the columns: one function per consumer ----------------------------------------------------

def plan_column(case: Case) -> Column:
    """`jobs.memory.plan_for_spec`, on the GPU every column assumes (none for a CPU job)."""
    gpu = gpu_memory_gib() if case.device == "cuda" else None
    plan = plan_for_spec(case.spec(), device=case.device, gpu_memory_gib=gpu)
    return plan.total_gib, plan.checkpointing


def queue_column(case: Case) -> Column:
    """Queue admission: the `Demand` stored at `queue add`, asked about that GPU. It judges GPU
    memory only, so a CPU job has no column here."""
    from orchestrator.queue.admission import Demand

    if case.device != "cuda":
        return None
    every, gib = Demand.from_json(Demand.from_spec(case.spec()).to_json()).gpu_plan(gpu_memory_gib())
    return gib, checkpointing_str(every)


def k8s_column(case: Case) -> Column:
    """`rayft k8s render`: the RayJob's annotations (exact bytes, and the checkpointing)."""
    from orchestrator.backends import kuberay

    overlay = GPU_OVERLAY if case.device == "cuda" else CPU_OVERLAY
    ann = kuberay.render(case.spec(), overlay=overlay)[1]["metadata"]["annotations"]
    assert ann[kuberay.ANN_ESTIMATE] == f"{int(ann[kuberay.ANN_ESTIMATE_BYTES]) / GIB:.2f}"
    return int(ann[kuberay.ANN_ESTIMATE_BYTES]) / GIB, ann[kuberay.ANN_CHECKPOINTING]


def loop_column(case: Case) -> Column:
    """The training loop: `jobs.loop.memory_plan`, what `train()` runs on its device. There is no
    GPU here, so for a GPU case only the device's total memory -- the one thing the worker reads
    from CUDA for its plan -- is supplied as the gpu overlay's GPU would report it."""
    import torch

    from jobs.loop import memory_plan

    if case.device == "cpu":
        plan = memory_plan(case.spec(), torch.device("cpu"))
    else:
        gpu = type("Props", (), {"total_memory": int(gpu_memory_gib() * GIB)})()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
            plan = memory_plan(case.spec(), torch.device("cuda", 0))
    return plan.total_gib, plan.checkpointing


COLUMNS: dict[str, Callable[[Case], Column]] = {
    "training loop": loop_column,
    "queue admission": queue_column,
    "k8s render": k8s_column,
}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_consumer_agrees_with_the_plan(case):
    want = plan_column(case)
    got = {name: column(case) for name, column in COLUMNS.items()}
    assert {name: v for name, v in got.items() if v is not None and v != want} == {}, f"plan_for_spec says {want}"


def test_the_cases_reach_every_checkpointing_choice():
    """The budgets are where they must be: `auto` picks each choice somewhere, and more than one
    consumer judges every GPU case."""
    for device in ("cuda", "cpu"):
        chosen = {plan_column(c)[1] for c in CASES if c.device == device and c.gradient_checkpointing == "auto"}
        assert chosen == {"off", "every 2nd layer", "on"}, (device, chosen)
    assert all(sum(col(c) is not None for col in COLUMNS.values()) == len(COLUMNS)
               for c in CASES if c.device == "cuda")


# ---- Tune's feasibility and `rayft estimate` -----------------------------------------------------
# Two more consumers, in their own test: each judges only some cases (a search needs a budget and may
# refuse to start; `rayft estimate` knows no GPU), so they stay out of `COLUMNS`, whose GPU cases
# every column judges.

REFUSED = "refused"


def tune_column(case: Case):
    """Tune's feasibility (`tune.plan.plan_search`) of a one-point search of the case's job, with its
    budget as `search.budget_gib` -- for a GPU job without one, the GPU's memory (what the plan judges
    against then). `REFUSED` when the search refuses to start; None for a CPU job without a budget."""
    from jobs.errors import SpecError
    from tune.plan import plan_search
    from tune.spec import load_search_spec

    job = case.spec()
    budget = case.budget_gib if case.budget_gib is not None else (gpu_memory_gib() if case.device == "cuda" else None)
    if budget is None:
        return None
    d = job.to_dict()
    d["run"].update(max_steps=None, epochs=None)
    d["search"] = {"grad_accum_steps": [job.grad_accum_steps], "samples_per_trial": job.batch.global_batch_size,
                   "budget_gib": budget}
    try:
        plan = plan_search(load_search_spec(data=d, files=False))
    except SpecError:
        return REFUSED
    (point,) = plan.points
    assert point.micro_batch_size == job.batch.micro_batch_size and point.status == "planned"
    return point.estimate_gib, checkpointing_str(point.checkpoint_every_n_layers)


def estimate_column(case: Case) -> Column:
    """`rayft estimate`'s chosen row (the JSON's total and checkpointing). It has no GPU to ask, so a
    GPU job without a budget is not judged."""
    from orchestrator.cli.tune import estimate_report

    if case.device == "cuda" and case.budget_gib is None:
        return None
    rep = estimate_report(case.spec(), case.budget_gib, case.device, str(SPEC))
    assert rep["fits"] is None if case.budget_gib is None else rep["fits"] == (rep["total_gib"] <= case.budget_gib)
    return rep["total_gib"], checkpointing_str(rep["checkpoint_every_n_layers"])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tune_and_rayft_estimate_agree_with_the_plan(case):
    want = plan_column(case)
    fits = plan_for_spec(case.spec(), device=case.device,
                         gpu_memory_gib=gpu_memory_gib() if case.device == "cuda" else None).fits
    tune = tune_column(case)
    # a search refuses to start exactly when its one point does not fit; otherwise it plans the plan
    assert (tune == REFUSED) == (tune is not None and not fits), (tune, want, fits)
    if tune not in (None, REFUSED):
        assert tune == want
    estimate = estimate_column(case)
    assert estimate is None or estimate == want
    if case.device == "cuda":
        assert tune is not None  # every GPU case is judged by the search
