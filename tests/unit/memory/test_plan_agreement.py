"""One memory plan: every consumer of `jobs.memory.plan_for_spec` decides exactly what it decides.

One table of cases, one function per consumer returning (estimate GiB, checkpointing, strategy) --
or None where that consumer does not judge the case -- and one test that every column equals the
plan's, with `==`, not approximately. To check another consumer, add a column to `COLUMNS`.

The cases: tiny-llama (CPU and GPU) under DDP with gradient checkpointing auto / true / false and
a per-GPU budget below, between and above the estimates of every checkpointing choice, and none;
`resources.strategy` auto and fsdp (FSDP2) with budgets cut at every strategy's smallest and
largest estimate, so that `auto` picks DDP, FSDP keeping the layers gathered, and FSDP
resharding after forward, over a bf16 (LoRA r 32) and (QLoRA under FSDP2) an nf4 base; the
preference objectives (DPO with the reference forward, with the starting adapter as reference,
and with precomputed reference log-probabilities; SimPO; ORPO); online RL (examples/tiny-grpo.yaml:
generation in-process beside training, the old-log-prob forward with num_iterations 2, and a
generation batch fixed so large that generation is the peak); and the 70B example
(examples/llama70b-lora.yaml, a config without weights) on the gpu overlay's H100s: unquantized
over 8 GPUs, and QLoRA nf4 / int8 over 2.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from jobs.memory import CHOICES, GIB, checkpointing_str, plan_for_spec, plan_table
from jobs.spec import JobSpec, load_spec

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "examples" / "tiny-lora.yaml"
GRPO_SPEC = ROOT / "examples" / "tiny-grpo.yaml"
BIG = ROOT / "examples" / "llama70b-lora.yaml"
GPU_OVERLAY, CPU_OVERLAY = "gpu", "dev-cpu"

# (estimate GiB per worker, checkpointing as checkpointing_str says it, strategy choice as
# jobs.memory.CHOICES names it: ddp, fsdp, fsdp-keep); a consumer that does not say its
# strategy gives None there (its exact estimate still pins it: the strategies' estimates differ).
Column = tuple | None
REFUSED = "refused"


def _choice(strategy: str, reshard: bool | None) -> str:
    return next(k for k, v in CHOICES.items() if v == (strategy, reshard))


@dataclass(frozen=True)
class Case:
    device: str  # "cuda" or "cpu"
    gradient_checkpointing: str  # "auto", "true", "false"
    budget_gib: float | None  # memory.budget_gib
    where: str  # which plan boundary the budget sits at, for the test id
    overrides: tuple = ()  # beyond device, checkpointing and budget
    spec_path: Path = SPEC
    family: str = "ddp"  # the group of cases its budgets were cut for, for the test id

    @property
    def id(self) -> str:
        return f"{self.family}-{self.device}-gc_{self.gradient_checkpointing}-{self.where}"

    def spec(self) -> JobSpec:
        return load_spec(
            self.spec_path,
            self.base_overrides(self.device, self.overrides, self.spec_path)
            + [
                f"memory.gradient_checkpointing={self.gradient_checkpointing}",
                f"memory.budget_gib={self.budget_gib!r}" if self.budget_gib is not None else "memory.budget_gib=null",
            ],
            files=False,
        )

    @staticmethod
    def base_overrides(device: str, overrides: tuple, spec_path: Path) -> list[str]:
        out = [f"resources.use_gpu={'true' if device == 'cuda' else 'false'}", *overrides]
        if spec_path == BIG:  # its config directory, wherever the tests run from
            out.append(f"model.name={ROOT / 'examples' / 'llama3-70b-shape'}")
        return out


def gpu_memory_gib() -> float:
    """The GPU every GPU column judges against: the gpu overlay's node type (what k8s render uses)."""
    from orchestrator.backends.kuberay import load_node_type

    return load_node_type(GPU_OVERLAY).gpu_memory_gib


def budgets(
    device: str, overrides: tuple = (), spec_path: Path = SPEC, every_k: bool = True, cap: float | None = None
) -> list[tuple[str, float | None]]:
    """Budgets in every interval the estimates cut the line into, and none. `every_k`: every
    checkpointing choice of every strategy choice; else each strategy choice's least and most
    memory only (80 decoder layers have 81 choices). `cap`: only budgets up to it (a GPU's memory)."""
    spec = load_spec(
        spec_path, Case.base_overrides(device, overrides, spec_path) + ["memory.budget_gib=null"], files=False
    )
    table = plan_table(spec, device=device)["gib"]
    gib = sorted(
        {v for row in table.values() for v in (row.values() if every_k else (min(row.values()), max(row.values())))}
    )
    out = [("below_all", gib[0] * 0.99)]
    out += [(f"between_{i}_{i + 1}", (a + b) / 2) for i, (a, b) in enumerate(itertools.pairwise(gib))]
    out += [("above_all", gib[-1] * 1.01), ("no_budget", None)]
    return [(w, b) for w, b in out if cap is None or b is None or b <= cap]


DDP = ("resources.strategy=ddp",)
FSDP = ("resources.strategy=fsdp",)
NF4_2 = ("model.quantization=nf4", "resources.num_workers=2", "batch.global_batch_size=32")
INT8_2 = ("model.quantization=int8", "resources.num_workers=2", "batch.global_batch_size=32")
CASES = [
    Case(device, gc, budget, where, DDP)
    for device in ("cuda", "cpu")
    for gc in ("auto", "true", "false")
    for where, budget in budgets(device, DDP)
]
# Eager layers: compiled ones (the GPU default) keep less under DDP, whose SFT head is compiled
# too, and DDP then fits wherever FSDP keeping the layers gathered would (the compiled plan is
# the "auto-compiled" family's).
EAGER = ("model.compile=false",)
CASES += [
    Case(device, "auto", budget, where, EAGER, family="auto")
    for device in ("cuda", "cpu")
    for where, budget in budgets(device, EAGER, every_k=False)
]
CASES += [
    Case("cuda", "auto", budget, where, (), family="auto-compiled")
    for where, budget in budgets("cuda", (), every_k=False)
]
CASES += [
    Case("cuda", gc, budget, where, FSDP, family="fsdp")
    for gc in ("auto", "true")
    for where, budget in budgets("cuda", FSDP, every_k=False)
]
# QLoRA under FSDP: nf4 tiny-llama over its 2 workers, fsdp asked for and left to auto.
NF4 = ("model.quantization=nf4",)
CASES += [
    Case("cuda", gc, budget, where, FSDP + NF4, family="fsdp-nf4")
    for gc in ("auto", "true")
    for where, budget in budgets("cuda", FSDP + NF4, every_k=False)
]
CASES += [
    Case("cuda", "auto", budget, where, NF4, family="auto-nf4") for where, budget in budgets("cuda", NF4, every_k=False)
]
# A bf16 base where keeping the layers gathered beats DDP: LoRA r 32 (its sharded states outweigh
# the embeddings and head FSDP keeps gathered beside tiny-llama's two layers).
R32 = ("lora.r=32",)
CASES += [
    Case("cuda", "auto", budget, where, R32, family="auto-r32") for where, budget in budgets("cuda", R32, every_k=False)
]
# Preference objectives: a micro-batch of pairs is two rows each; DPO with the reference forward
# (the base with the adapter off, or the starting adapter held frozen), with precomputed
# reference log-probabilities, and the reference-free SimPO and ORPO; budgets at every
# strategy's bounds, so that the reference terms move the plan's boundaries.
PREFERENCE = {
    "dpo": ("objective.name=dpo",),
    "dpo-adapter": ("objective.name=dpo", "model.adapter=outputs/sft/adapter"),
    "dpo-precomputed": ("objective.name=dpo", "objective.reference=precomputed"),
    "simpo": ("objective.name=simpo",),
    "orpo": ("objective.name=orpo",),
}
CASES += [
    Case("cuda", "auto", budget, where, overrides, family=f"pref-{name}")
    for name, overrides in PREFERENCE.items()
    for where, budget in budgets("cuda", overrides, every_k=False)
]
CASES += [
    Case("cpu", "auto", budget, where, PREFERENCE["dpo-adapter"], family="pref-dpo-adapter")
    for where, budget in budgets("cpu", PREFERENCE["dpo-adapter"], every_k=False)
]
# Online RL: generation (the KV cache, prefill, sampler at the plan's generation batch) and the
# old-log-prob forward are transients before the forward; with a generation batch fixed at the
# worker's whole share beside micro-batch 1, generation is the peak and moves every boundary.
GRPO = {
    "grpo": (),
    "grpo-mu2": ("objective.num_iterations=2",),
    "grpo-gen-peak": ("rollout.generation_batch_size=8", "batch.micro_batch_size=1", "rollout.num_generations=2"),
}
CASES += [
    Case(device, "auto", budget, where, overrides, GRPO_SPEC, family=name)
    for name, overrides in GRPO.items()
    for device in ("cuda", "cpu")
    for where, budget in budgets(device, overrides, GRPO_SPEC, every_k=False)
]
CASES += [
    Case("cuda", "auto", budget, where, (), BIG, family="70b")
    for where, budget in budgets("cuda", (), BIG, every_k=False, cap=80)
]
CASES += [
    Case("cuda", "auto", budget, where, NF4_2, BIG, family="70b-nf4")
    for where, budget in budgets("cuda", NF4_2, BIG, every_k=False, cap=80)
]
CASES += [
    Case("cuda", "true", budget, where, INT8_2 + ("data.max_seq_len=512",), BIG, family="70b-int8")
    for where, budget in budgets("cuda", INT8_2 + ("data.max_seq_len=512",), BIG, every_k=False, cap=80)
]


# ---- the columns: one function per consumer ----------------------------------------------------


def plan_column(case: Case) -> Column:
    """`jobs.memory.plan_for_spec`, on the GPU every column assumes (none for a CPU job)."""
    gpu = gpu_memory_gib() if case.device == "cuda" else None
    plan = plan_for_spec(case.spec(), device=case.device, gpu_memory_gib=gpu)
    return plan.total_gib, plan.checkpointing, plan.choice


def queue_column(case: Case) -> Column:
    """Queue admission: the `Demand` stored at `queue add`, asked about that GPU. It judges GPU
    memory only, so a CPU job has no column here."""
    from orchestrator.queue.admission import Demand

    if case.device != "cuda":
        return None
    demand = Demand.from_json(Demand.from_spec(case.spec()).to_json())
    every, gib = demand.gpu_plan(gpu_memory_gib())
    return gib, checkpointing_str(every), demand.gpu_strategy(gpu_memory_gib())


def k8s_column(case: Case) -> Column:
    """`rayft k8s render`: the RayJob's annotations (exact bytes, the checkpointing, the strategy). A GPU
    job whose plan exceeds the overlay's GPU is refused: then the plan must say so."""
    from jobs.errors import SpecError
    from orchestrator.backends import kuberay
    from orchestrator.backends.kuberay.node_types import NodeType

    overlay = GPU_OVERLAY if case.device == "cuda" else CPU_OVERLAY
    try:
        # This column judges memory: render's refusal of more GPUs than Kueue hands out (the 70B's 8
        # on the gpu overlay's 6, jobQuotaGpus) is tested in tests/integration/test_k8s_flavours.py.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(NodeType, "gpus_refusal", lambda self, gpus: "")
            ann = kuberay.render(case.spec(), overlay=overlay)[1]["metadata"]["annotations"]
    except SpecError as e:
        assert case.device == "cuda" and plan_column(case)[0] > gpu_memory_gib(), e
        return None
    assert ann[kuberay.ANN_ESTIMATE] == f"{int(ann[kuberay.ANN_ESTIMATE_BYTES]) / GIB:.2f}"
    return int(ann[kuberay.ANN_ESTIMATE_BYTES]) / GIB, ann[kuberay.ANN_CHECKPOINTING], ann[kuberay.ANN_STRATEGY]


def loop_column(case: Case) -> Column:
    """The training loop: `jobs.train.loop.memory_plan`, what `train()` runs on its device. There is no
    GPU here, so for a GPU case only the device's total memory -- the one thing the worker reads
    from CUDA for its plan -- is supplied as the gpu overlay's GPU would report it."""
    import torch

    from jobs.train.loop import memory_plan

    if case.device == "cpu":
        plan = memory_plan(case.spec(), torch.device("cpu"))
    else:
        gpu = type("Props", (), {"total_memory": int(gpu_memory_gib() * GIB)})()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
            plan = memory_plan(case.spec(), torch.device("cuda", 0))
    return plan.total_gib, plan.checkpointing, plan.choice


COLUMNS: dict[str, Callable[[Case], Column]] = {
    "training loop": loop_column,
    "queue admission": queue_column,
    "k8s render": k8s_column,
}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_consumer_agrees_with_the_plan(case):
    want = plan_column(case)
    got = {name: column(case) for name, column in COLUMNS.items()}
    assert {name: v for name, v in got.items() if v is not None and not _same(v, want)} == {}, (
        f"plan_for_spec says {want}"
    )


def training_only(est) -> int:
    """The estimate's total without generation: what the training step alone needs."""
    from jobs.memory import MemoryEstimate
    from jobs.memory.components import framework_overhead

    kept = {k: v for k, v in est.components.items() if k not in ("generation", "framework_overhead")}
    device = "cuda" if est.components["cublas_workspace"] else "cpu"
    return MemoryEstimate(kept).total_bytes + framework_overhead(kept, device, est.details["world_size"])


def _same(got: tuple, want: tuple) -> bool:
    """Equal, where a consumer that does not report the strategy (None) is judged on the rest."""
    return got == want or (got[2] is None and got[:2] == want[:2])


def test_the_cases_reach_every_checkpointing_and_strategy_choice():
    """The budgets are where they must be: `auto` picks each checkpointing choice somewhere, and
    each strategy choice, over a bf16 and an nf4 base; the 70B needs FSDP over 8 H100s and fits
    with nf4 over 2 under DDP (int8 is never sharded by auto); every
    consumer judges every GPU case but the ones render refuses."""
    for device in ("cuda", "cpu"):
        chosen = {
            plan_column(c)[1]
            for c in CASES
            if c.device == device and c.family == "ddp" and c.gradient_checkpointing == "auto"
        }
        assert chosen == {"off", "every 2nd layer", "on"}, (device, chosen)
    auto = {c.family: set() for c in CASES}
    for c in CASES:
        auto[c.family].add(plan_column(c)[2])
    assert auto["ddp"] == {"ddp"} and auto["fsdp"] == {"fsdp", "fsdp-keep"}
    # Over tiny-llama's bf16 base at r 4, FSDP keeping its two layers gathered also keeps its
    # embeddings, head and one unit's all-gather buffer, but DDP holds a second copy of the LoRA
    # gradients through the accumulation window (`no_sync_grads`): auto reaches every choice; at
    # r 32 too.
    assert auto["auto"] | auto["70b"] == {"ddp", "fsdp", "fsdp-keep"}
    assert auto["auto-compiled"] == {"ddp", "fsdp"}
    assert auto["auto-r32"] == {"ddp", "fsdp", "fsdp-keep"}
    assert auto["70b"] == {"fsdp"} and auto["70b-int8"] == {"ddp"}
    # An nf4 base is sharded when DDP does not fit: auto reaches every choice over it too.
    assert auto["fsdp-nf4"] == {"fsdp", "fsdp-keep"} and auto["auto-nf4"] == {"ddp", "fsdp", "fsdp-keep"}
    assert "ddp" in auto["70b-nf4"]
    # Each preference objective's plan is its own: two rows a pair, the reference forward's transient
    # and the reference adapter's weights move its estimates off SFT's.
    sft = {plan_column(c)[0] for c in CASES if c.family == "auto"}
    for name in PREFERENCE:
        assert {"ddp", "fsdp"} <= auto[f"pref-{name}"], name
        assert not {plan_column(c)[0] for c in CASES if c.family == f"pref-{name}"} & sft, name
    # Online RL's plans count generation (and, with num_iterations 2, the old-log-prob forward); where
    # generation is the peak, the plan's total is generation's, not training's.
    for name in GRPO:
        assert {"ddp", "fsdp"} <= auto[name], name
        for c in (c for c in CASES if c.family == name):
            plan = plan_for_spec(c.spec(), device=c.device, gpu_memory_gib=gpu_memory_gib())
            assert "generation" in plan.estimate.components and plan.generation_batch_size, c.id
            assert ("old_logprobs_forward" in plan.estimate.components) == (name == "grpo-mu2"), c.id
            assert (training_only(plan.estimate) < plan.estimate.total_bytes) == (name == "grpo-gen-peak"), c.id
    refused = [c for c in CASES if c.device == "cuda" and k8s_column(c) is None]
    assert all(plan_column(c)[0] > gpu_memory_gib() for c in refused)
    assert all(
        sum(col(c) is not None for col in COLUMNS.values()) == len(COLUMNS)
        for c in CASES
        if c.device == "cuda" and c not in refused
    )


# ---- Tune's feasibility and `rayft estimate` -----------------------------------------------------
# Two more consumers, in their own test: each judges only some cases (a search needs a budget and may
# refuse to start; `rayft estimate` knows no GPU), so they stay out of `COLUMNS`, whose GPU cases
# every column judges.


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
    if not (d["data"].get("eval_path") or d["data"].get("eval_fraction")):
        d["data"]["eval_fraction"] = 0.25  # a search compares trials on held-out data (tiny-grpo holds none)
    d["search"] = {
        "grad_accum_steps": [job.grad_accum_steps],
        "samples_per_trial": job.batch.global_batch_size,
        "budget_gib": budget,
    }
    try:
        plan = plan_search(load_search_spec(data=d, files=False))
    except SpecError:
        return REFUSED
    (point,) = plan.points
    assert point.micro_batch_size == job.batch.micro_batch_size and point.status == "planned"
    return (
        point.estimate_gib,
        checkpointing_str(point.checkpoint_every_n_layers),
        _choice(point.strategy, point.reshard_after_forward),
    )


def estimate_column(case: Case) -> Column:
    """`rayft estimate`'s chosen row (the JSON's total and checkpointing). It has no GPU to ask, so a
    GPU job without a budget is not judged."""
    from orchestrator.cli.tune import estimate_report

    if case.device == "cuda" and case.budget_gib is None:
        return None
    rep = estimate_report(case.spec(), case.budget_gib, case.device, str(SPEC))
    assert rep["fits"] is None if case.budget_gib is None else rep["fits"] == (rep["total_gib"] <= case.budget_gib)
    (chosen,) = [r for r in rep["strategies"] if r["chosen"]]  # the side-by-side row the plan chose
    assert (chosen["total_bytes"], chosen["strategy"]) == (rep["total_bytes"], rep["strategy"])
    return (
        rep["total_gib"],
        checkpointing_str(rep["checkpoint_every_n_layers"]),
        _choice(rep["strategy"], rep["reshard_after_forward"]),
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tune_and_rayft_estimate_agree_with_the_plan(case):
    want = plan_column(case)
    fits = plan_for_spec(
        case.spec(), device=case.device, gpu_memory_gib=gpu_memory_gib() if case.device == "cuda" else None
    ).fits
    tune = tune_column(case)
    # a search refuses to start exactly when its one point does not fit; otherwise it plans the plan
    assert (tune == REFUSED) == (tune is not None and not fits), (tune, want, fits)
    if tune not in (None, REFUSED):
        assert tune == want
    estimate = estimate_column(case)
    assert estimate is None or estimate == want
    if case.device == "cuda":
        assert tune is not None  # every GPU case is judged by the search


# ---- online RL: queue admission and `rayft k8s render` count generation ---------------------------


def _generation_peak_spec() -> JobSpec:
    """tiny-grpo on a GPU where generation (8 completions at once, 2 per prompt, beside micro-batch 1)
    is the peak."""
    return Case("cuda", "auto", None, "no_budget", GRPO["grpo-gen-peak"], GRPO_SPEC).spec()


def test_queue_admission_counts_generation():
    from orchestrator.queue.admission import Demand

    spec = _generation_peak_spec()
    plan = plan_for_spec(spec, device="cuda", gpu_memory_gib=gpu_memory_gib())
    demand = Demand.from_json(Demand.from_spec(spec).to_json())
    assert demand.gpu_plan(gpu_memory_gib())[1] == plan.total_gib > training_only(plan.estimate) / GIB


def test_k8s_render_counts_generation():
    from orchestrator.backends import kuberay

    spec = _generation_peak_spec()
    plan = plan_for_spec(spec, device="cuda", gpu_memory_gib=gpu_memory_gib())
    with pytest.MonkeyPatch.context() as mp:
        from orchestrator.backends.kuberay.node_types import NodeType

        mp.setattr(NodeType, "gpus_refusal", lambda self, gpus: "")
        ann = kuberay.render(spec, overlay=GPU_OVERLAY)[1]["metadata"]["annotations"]
    assert int(ann[kuberay.ANN_ESTIMATE_BYTES]) == plan.estimate.total_bytes > training_only(plan.estimate)
