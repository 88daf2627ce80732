"""The report tables: estimates laid out for people (`rayft estimate`, Tune's feasibility) and
for queue admission, which decides per GPU size from a table it stored without the spec.

Every table asks the same `SpecEstimator` the plan asks, and applies the plan's rules
(`choices`), so a row that says "chosen" is what `plan_for_spec` runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobs.memory import config_io
from jobs.memory.choices import (
    CHOICES,
    checkpointing_candidates,
    checkpointing_str,
    choose_plan,
    fixed_choice,
    strategy_choices,
)
from jobs.memory.components import STRATEGIES
from jobs.memory.plan import MemoryPlan, estimate_for_spec, plan_from
from jobs.memory.spec_estimate import SpecEstimator

if TYPE_CHECKING:
    from jobs.spec import JobSpec


def plan_table(spec: JobSpec, *, device: str = "cuda", config=None) -> dict:
    """Everything `choose_plan` needs to decide later, for any per-GPU budget, without the spec:
    {"choices": the ordered strategy choices, "gib": {choice: {k: estimated GiB with checkpointing
    every k-th layer (0 = off)}}}. Queue admission stores it at `queue add` and applies
    `choose_plan_from_table` per GPU size, getting what `plan_for_spec` gets on that GPU."""
    config = config if config is not None else config_io.config_from_spec(spec)
    r = spec.resources
    choices = strategy_choices(r.strategy, r.fsdp_reshard_after_forward, r.num_workers, spec.model.quantization)
    est = SpecEstimator(spec, config, device)
    candidates = checkpointing_candidates(est.num_layers)
    return {"choices": choices, "gib": {choice: {k: est.gib(choice, k) for k in candidates} for choice in choices}}


def choose_plan_from_table(table: dict, mode: Any, num_layers: int, budget_gib: float | None) -> tuple[str, int, float]:
    """`choose_plan` over a stored `plan_table` (keys may have come back from JSON as strings):
    (choice, checkpoint every k-th layer, its estimated GiB)."""
    gib = {c: {int(k): float(v) for k, v in row.items()} for c, row in table["gib"].items()}
    choice, every = choose_plan(table["choices"], mode, lambda c, k: gib[c][k], num_layers, budget_gib)
    return choice, every, gib[choice][every]


def strategy_table(spec: JobSpec, *, device: str = "cuda", config=None) -> list[dict]:
    """DDP and FSDP side by side (and, for a quantized spec, unquantized beside quantized): one
    row per (quantization, strategy) with the checkpointing and FSDP resharding the plan's rule
    would give that strategy under the spec's budget, its estimate, whether it fits, and which
    row the plan chose. FSDP rows need >= 2 workers and a base `auto` may shard (not int8:
    `strategy_choices`)."""
    config = config if config is not None else config_io.config_from_spec(spec)
    r = spec.resources
    quants = ["none"] + ([spec.model.quantization] if spec.model.quantization != "none" else [])
    estimators = {quant: SpecEstimator(spec, config, device, quantization=quant) for quant in quants}
    plan = plan_from(estimators[spec.model.quantization], None)
    rows = []
    for quant, est in estimators.items():
        for strategy in STRATEGIES:
            if strategy == "fsdp" and (r.num_workers < 2 or quant == "int8"):
                continue
            reshard = r.fsdp_reshard_after_forward if r.strategy != "ddp" else None
            choice, every = choose_plan(
                strategy_choices(strategy, reshard, r.num_workers),
                spec.memory.gradient_checkpointing,
                est.gib,
                est.num_layers,
                plan.budget_gib,
            )
            rows.append(_strategy_row(est, choice, every, plan))
    return rows


def _strategy_row(est: SpecEstimator, choice: str, every: int, plan: MemoryPlan) -> dict:
    e = est.estimate(choice, every)
    strategy, reshard = CHOICES[choice]
    budget = plan.budget_gib
    return {
        "strategy": strategy,
        "reshard_after_forward": reshard,
        "quantization": est.quantization,
        "num_workers": est.spec.resources.num_workers,
        "checkpoint_every_n_layers": every,
        "checkpointing": checkpointing_str(every),
        "components": dict(e.components),
        "total_bytes": e.total_bytes,
        "total_gib": e.total_gib,
        "fits": None if budget is None else e.total_gib <= budget,
        "chosen": (strategy, reshard, est.quantization, every)
        == (plan.strategy, plan.reshard_after_forward, plan.quantization, plan.checkpoint_every_n_layers),
    }


def feasible_pairs(spec: JobSpec, budget_gib: float | None = None, *, device: str | None = None) -> list[dict]:
    """Every (micro_batch_size, grad_accum_steps) that splits the global batch, checkpointing off and on.

    A pair needs micro_batch_size x grad_accum_steps x num_workers == global_batch_size.
    Rows are sorted by micro-batch, then checkpointing off before on (every layer); `fits` is
    estimate <= budget (always True without a budget). Each micro-batch runs the strategy the
    spec fixes, else the one its plan chooses (under `memory.budget_gib`, as `estimate_for_spec`).
    """
    device = device or spec.planned_device
    budget = budget_gib if budget_gib is not None else spec.memory.budget_gib
    r = spec.resources
    per_worker, rem = divmod(spec.batch.global_batch_size, r.num_workers)
    if rem:
        raise ValueError(
            f"batch.global_batch_size={spec.batch.global_batch_size} is not divisible by "
            f"resources.num_workers={r.num_workers}"
        )
    config = config_io.config_from_spec(spec)
    rows = []
    for mb in (d for d in range(1, per_worker + 1) if per_worker % d == 0):
        est = SpecEstimator(spec, config, device, micro_batch_size=mb)
        choice = fixed_choice(r.strategy, r.fsdp_reshard_after_forward) or plan_from(est, None).choice
        for gc in (False, True):
            gib = est.gib(choice, int(gc))
            rows.append(
                {
                    "micro_batch_size": mb,
                    "grad_accum_steps": per_worker // mb,
                    "gradient_checkpointing": gc,
                    "estimate_gib": gib,
                    "fits": budget is None or gib <= budget,
                }
            )
    return rows


def smallest_budget_gib(spec: JobSpec, *, device: str | None = None) -> float:
    """The least memory the job can run in: micro-batch 1 with checkpointing."""
    return estimate_for_spec(
        spec, micro_batch_size=1, gradient_checkpointing=True, device=device or spec.planned_device
    ).total_gib
