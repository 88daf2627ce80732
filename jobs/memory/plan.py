"""The one memory plan: what one training worker of a spec runs, and what it is estimated to need.

`plan_for_spec` is the only place the strategy and the checkpointing are decided for a spec
(by the rules in `choices`); the loop runs its plan, and `rayft estimate`, Tune's feasibility,
queue admission and `rayft k8s render` report and judge it. `estimate_for_spec` is the estimate
of one configuration, with whatever the caller leaves open decided as the plan decides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobs.memory import config_io
from jobs.memory.choices import CHOICES, checkpointing_str, choose_plan, fixed_choice, strategy_choices, strategy_str
from jobs.memory.components import MemoryEstimate
from jobs.memory.spec_estimate import (
    SpecEstimator,
    estimate_of_spec,
    spec_grad_accum_steps,
    spec_precision,
    spec_seq_len,
)

if TYPE_CHECKING:
    from jobs.spec import JobSpec


@dataclass(frozen=True)
class MemoryPlan:
    """What one training worker will run, and what it is estimated to need.

    Made by `plan_for_spec`, the only place these decisions are taken: the loop runs it, and
    `rayft estimate`, Tune's feasibility, queue admission and `rayft k8s render` report and
    judge it, so what is shown is what runs."""

    strategy: str  # "ddp": every worker holds the whole base; "fsdp": FSDP2 shards it
    reshard_after_forward: bool | None  # FSDP: free each layer's gathered weights after forward; None for DDP
    quantization: str  # model.quantization: "none", "nf4" or "int8"
    device: str  # "cuda" or "cpu"
    precision: str  # the compute dtype: "bf16", "fp16" or "fp32"
    micro_batch_size: int  # sequences per forward/backward on one worker
    grad_accum_steps: int  # micro-steps per optimizer step on one worker
    checkpoint_every_n_layers: int  # 0: no activation checkpointing; k: every k-th decoder layer
    loss_chunk_tokens: int  # 0: the loss head in one piece; n: checkpointed chunks of n tokens
    seq_len: int  # the row length the estimate assumes (see `spec_seq_len`)
    budget_gib: float | None  # judged against: memory.budget_gib, else the GPU's memory, else none
    estimate: MemoryEstimate  # per component, for exactly this plan
    # online RL in-process (`rollout.engine: hf`): completions generated at once; None otherwise
    generation_batch_size: int | None = None

    @property
    def total_gib(self) -> float:
        return self.estimate.total_gib

    @property
    def vllm_engine(self) -> dict | None:
        """The vLLM server rayft starts, by part in bytes (`weights`, `lora_slot`, `kv_cache`,
        `context`, `total`, and where: `colocated`, `devices`, `per_device`:
        `generation.engine_terms`); None without one."""
        return self.estimate.details.get("vllm_engine")

    @property
    def fits(self) -> bool:
        """The training device's total within the budget, and a separate vLLM engine's share on
        each of its own devices too (one budget: every GPU of the run is alike)."""
        if self.budget_gib is None:
            return True
        engine = self.vllm_engine
        apart = 0 if engine is None or engine["colocated"] else engine["per_device"] / 2**30
        return self.total_gib <= self.budget_gib and apart <= self.budget_gib

    @property
    def checkpointing(self) -> str:
        return checkpointing_str(self.checkpoint_every_n_layers)

    @property
    def choice(self) -> str:
        """The strategy as one word: "ddp", "fsdp" or "fsdp-keep" (`CHOICES`)."""
        return next(k for k, v in CHOICES.items() if v == (self.strategy, self.reshard_after_forward))

    @property
    def strategy_str(self) -> str:
        """ "ddp", "fsdp" or "fsdp (layers kept gathered)", as people read it."""
        return strategy_str(self.strategy, self.reshard_after_forward)

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "reshard_after_forward": self.reshard_after_forward,
            "quantization": self.quantization,
            "device": self.device,
            "precision": self.precision,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "checkpoint_every_n_layers": self.checkpoint_every_n_layers,
            "checkpointing": self.checkpointing,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "seq_len": self.seq_len,
            "budget_gib": self.budget_gib,
            "estimate_gib": self.total_gib,
            "fits": self.fits,
            "components_gib": dict(self.estimate.table()),
            "generation_batch_size": self.generation_batch_size,
        }


def plan_budget_gib(spec: JobSpec, device: str, gpu_memory_gib: float | None) -> float | None:
    """The per-GPU memory a plan must fit: `memory.budget_gib`, else (on a GPU) the GPU's memory."""
    if spec.memory.budget_gib is not None:
        return float(spec.memory.budget_gib)
    return float(gpu_memory_gib) if device == "cuda" and gpu_memory_gib is not None else None


def plan_for_spec(
    spec, *, device: str = "cuda", gpu_memory_gib: float | None = None, micro_batch_size: int | None = None, config=None
) -> MemoryPlan:
    """The plan one worker of `spec` runs on `device` (a GPU of `gpu_memory_gib` GiB, when known).

    The strategy (and FSDP's resharding) and checkpointing follow `choose_plan` under
    `plan_budget_gib`; the micro-batch is the spec's (or `micro_batch_size`, for a search point);
    the loss chunk is `memory.loss_chunk_tokens`; the quantization `model.quantization`; online RL's
    generation batch `rollout.generation_batch_size`, or the one the estimate chooses. Raises
    `SpecError` for a model or LoRA target the estimate cannot read. `config` is the model's
    config when the caller has read it (`config_io.config_from_spec`), else it is read here.
    """
    config = config if config is not None else config_io.config_from_spec(spec)
    return plan_from(SpecEstimator(spec, config, device, micro_batch_size=micro_batch_size), gpu_memory_gib)


def plan_from(est: SpecEstimator, gpu_memory_gib: float | None) -> MemoryPlan:
    """`plan_for_spec` over the estimates of `est` (its spec, device, micro-batch and quantization)."""
    spec, r = est.spec, est.spec.resources
    budget = plan_budget_gib(spec, est.device, gpu_memory_gib)
    choices = strategy_choices(r.strategy, r.fsdp_reshard_after_forward, r.num_workers, est.quantization)
    choice, every = choose_plan(choices, spec.memory.gradient_checkpointing, est.gib, est.num_layers, budget)
    strategy, reshard = CHOICES[choice]
    micro = est.micro_batch_size
    chosen = est.estimate(choice, every)
    return MemoryPlan(
        strategy=strategy,
        reshard_after_forward=reshard,
        quantization=est.quantization,
        device=est.device,
        precision=spec_precision(spec, est.device),
        micro_batch_size=micro,
        grad_accum_steps=spec_grad_accum_steps(spec, micro),
        checkpoint_every_n_layers=every,
        loss_chunk_tokens=int(spec.memory.loss_chunk_tokens or 0),
        seq_len=spec_seq_len(spec, est.device),
        budget_gib=budget,
        estimate=chosen,
        generation_batch_size=(chosen.details.get("generation") or {}).get("generation_batch_size"),
    )


def estimate_for_spec(
    spec,
    *,
    micro_batch_size: int | None = None,
    gradient_checkpointing: bool | None = None,
    device: str = "cuda",
    config=None,
    checkpoint_every_n_layers: int = 1,
    strategy: str | None = None,
    reshard_after_forward: bool | None = None,
    quantization: str | None = None,
) -> MemoryEstimate:
    """`estimate` of one configuration, everything else taken from a JobSpec.

    The sequence length is `data.max_seq_len - 1`, the longest input `jobs.data` produces
    (the last token is only a label), and every position is assumed to carry a label: an
    upper bound for ragged data. With `data.packing`, `micro_batch_size` full packed rows of
    `data.max_seq_len` tokens (rounded up to 16 on GPU, as `jobs.objectives.sft.layout_args` aligns
    them): an upper bound for packed micro-batches and for the unpacked ones packing leaves.
    `gradient_checkpointing=None` means "as planned": the checkpointing `plan_for_spec` chooses
    (without a GPU's memory: only `memory.budget_gib` counts). `strategy` and
    `reshard_after_forward` left None are the plan's for this micro-batch (the spec's when it
    fixes them); `quantization` None is `model.quantization`.
    """
    config = config if config is not None else config_io.config_from_spec(spec)
    if gradient_checkpointing is None:
        return plan_for_spec(spec, device=device, micro_batch_size=micro_batch_size, config=config).estimate
    r = spec.resources
    if strategy is None:
        choice = fixed_choice(r.strategy, r.fsdp_reshard_after_forward)
        if choice is None:
            choice = plan_for_spec(spec, device=device, micro_batch_size=micro_batch_size, config=config).choice
        strategy, planned_reshard = CHOICES[choice]
        if reshard_after_forward is None:
            reshard_after_forward = planned_reshard
    if reshard_after_forward is None:
        reshard_after_forward = r.fsdp_reshard_after_forward is not False
    return estimate_of_spec(
        spec,
        config,
        device=device,
        micro_batch_size=micro_batch_size or spec.batch.micro_batch_size,
        gradient_checkpointing=bool(gradient_checkpointing),
        checkpoint_every_n_layers=checkpoint_every_n_layers,
        strategy=strategy,
        reshard_after_forward=bool(reshard_after_forward),
        quantization=quantization or spec.model.quantization,
    )
