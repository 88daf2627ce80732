"""From a JobSpec to `estimate`, and the one cached estimator of a spec.

`estimate_of_spec` reads everything `estimate` needs from the spec except the few choices the
plan makes (micro-batch, checkpointing, strategy, quantization), which it is given.
`SpecEstimator` is the one estimator the plan and the report tables ask: the estimates of one
spec on one device, for one micro-batch and one base quantization, by (strategy choice,
checkpoint every k-th layer), each computed once.

Pure: the model config comes in as an object (`config_io` reads it, at the entry points).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobs.errors import SpecError
from jobs.memory.choices import CHOICES
from jobs.memory.components import MemoryEstimate, estimate
from jobs.memory.generation import Engine, Rollout
from jobs.memory.shapes import model_shape, round_up
from jobs.spec import GRPOObjective, compute_precision

if TYPE_CHECKING:
    from jobs.spec import JobSpec


def spec_precision(spec: JobSpec, device: str) -> str:
    """The compute dtype of `spec` on `device`: `jobs.spec.compute_precision`, the one rule."""
    return compute_precision(spec.precision, device)


def spec_seq_len(spec: JobSpec, device: str) -> int:
    """The row length a spec's estimate assumes: `data.max_seq_len - 1` (the longest input), or
    with `data.packing` the packed row of `data.max_seq_len` tokens (16-aligned on GPU)."""
    if spec.data.packing:
        return round_up(spec.data.max_seq_len, 16 if device == "cuda" else 1)
    return max(1, spec.data.max_seq_len - 1)


def spec_grad_accum_steps(spec: JobSpec, micro_batch_size: int) -> int:
    """Micro-steps per optimizer step on one worker at `micro_batch_size`: `batch.grad_accum_steps`
    at the spec's own micro-batch, and what a search point's micro-batch gives at the same global
    batch."""
    return max(1, spec.batch.global_batch_size // spec.resources.num_workers // micro_batch_size)


def spec_objective(spec: JobSpec) -> dict:
    """What the objective changes in the estimate, as its spec class says (`memory_terms`): a
    preference objective's micro-batch counts pairs (two rows each); DPO and IPO with `reference:
    adapter_off` run a reference forward, which with `model.adapter` is the starting adapter held
    frozen a second time."""
    return spec.objective.memory_terms(bool(spec.model.adapter))


def spec_rollout(spec: JobSpec) -> Rollout | None:
    """Online RL's rollouts as the estimate reads them (`generation.Rollout`); None for an objective
    that samples nothing. The prompt is the longest `data.max_seq_len - rollout.max_completion_length`
    lets through; the worker's share is `batch.global_batch_size / resources.num_workers`."""
    if spec.objective.records != "prompts":
        return None
    r, objective = spec.rollout, spec.objective
    assert r is not None and isinstance(objective, GRPOObjective)  # a spec of prompts is a GRPO one
    completion = r.max_completion_length
    return Rollout(
        prompt_tokens=spec.data.max_seq_len - completion,
        completion_tokens=completion,
        share=max(1, spec.batch.global_batch_size // spec.resources.num_workers),
        batch_size=r.generation_batch_size,
        top_k=r.top_k > 0,
        top_p=r.top_p < 1,
        num_generations=r.num_generations,
        in_process=r.engine == "hf",
        # the trainer's log-probs of the sampled ids: the old ones (num_iterations > 1), or beside
        # the engine's (vLLM returns its own: `engine_logprob_gap`, `importance_correction`)
        old_logprobs=objective.num_iterations > 1 or r.engine == "vllm",
        engine=spec_engine(spec),
    )


def spec_engine(spec: JobSpec) -> Engine | None:
    """The vLLM server rank 0 starts (`rollout.engine: vllm` without `vllm_url`): every completion
    of a step at once (all ranks ask the one server), each up to `data.max_seq_len` tokens, or
    `rollout.vllm_kv_cache_gib`; None when rayft starts no engine."""
    r = spec.rollout
    if r is None or r.engine != "vllm" or r.vllm_url:
        return None
    from jobs.rollout.vllm_host import separate_gpus  # the GPUs a separate engine is given
    from jobs.rollout.vllm_server import lora_rank_bound  # the flag the server is started with

    explicit = None if r.vllm_kv_cache_gib is None else int(r.vllm_kv_cache_gib * 2**30)
    colocated = r.vllm_placement == "colocate"
    devices = 1 if colocated else max(1, separate_gpus(r, spec.resources.use_gpu))
    rank = lora_rank_bound(spec.lora.r)
    steps = (spec.batch.global_batch_size, spec.data.max_seq_len, rank, explicit)
    return Engine(*steps, colocated=colocated, devices=devices, sleeps=r.vllm_sleep)


def estimate_of_spec(
    spec,
    config,
    *,
    device: str,
    micro_batch_size: int,
    gradient_checkpointing: bool,
    checkpoint_every_n_layers: int,
    strategy: str,
    reshard_after_forward: bool,
    quantization: str,
) -> MemoryEstimate:
    """`estimate` of `spec` (with the model `config`) under the given choices.

    The accumulation is `spec_grad_accum_steps` at that micro-batch, the objective's terms
    `spec_objective`'s (a pair's rows as long as SFT's). The sequence length is
    `spec_seq_len`, and every position is assumed to carry a label: an
    upper bound for ragged data and for packed micro-batches. What `estimate` cannot model (an
    unsupported architecture, a LoRA target that is no linear layer) is the user's spec: SpecError."""
    try:
        return estimate(
            config,
            micro_batch_size=micro_batch_size,
            seq_len=spec_seq_len(spec, device),
            packed=spec.data.packing,
            gradient_checkpointing=gradient_checkpointing,
            base_dtype=spec_precision(spec, device),
            lora_r=spec.lora.r,
            lora_target_modules=list(spec.lora.target_modules),
            lora_dropout=spec.lora.dropout,
            lora_dora=spec.lora.use_dora,
            optimizer=spec.optim.name,
            momentum=spec.optim.momentum,
            world_size=spec.resources.num_workers,
            attn_implementation=spec.model.attn_implementation,
            loss_chunk_tokens=spec.memory.loss_chunk_tokens or None,
            checkpoint_every_n_layers=checkpoint_every_n_layers,
            device=device,
            strategy=strategy,
            reshard_after_forward=reshard_after_forward,
            quantization=quantization,
            grad_accum_steps=spec_grad_accum_steps(spec, micro_batch_size),
            # The quantization weighed here, not the spec's: the plan weighs nf4 beside bf16.
            compiled=spec.model.model_copy(update={"quantization": quantization}).compiles_on(device),
            rollout=spec_rollout(spec),
            **spec_objective(spec),
        )
    except SpecError:
        raise
    except ValueError as e:
        raise SpecError(str(e)) from None


class SpecEstimator:
    """The estimates of `spec` on `device` with the model `config`, for one micro-batch (default:
    `batch.micro_batch_size`) and one base quantization (default: `model.quantization`), keyed by
    (strategy choice of `choices.CHOICES`, checkpoint every k-th layer; 0 = off) and computed
    once each: the plan and the tables weigh the same choices, often more than once."""

    def __init__(
        self, spec, config, device: str, *, micro_batch_size: int | None = None, quantization: str | None = None
    ):
        self.spec, self.config, self.device = spec, config, device
        self.micro_batch_size = micro_batch_size or spec.batch.micro_batch_size
        self.quantization = quantization or spec.model.quantization
        self._cache: dict[tuple[str, int], MemoryEstimate] = {}

    @property
    def num_layers(self) -> int:
        return model_shape(self.config).layers

    def estimate(self, choice: str, every: int) -> MemoryEstimate:
        if (choice, every) not in self._cache:
            strategy, reshard = CHOICES[choice]
            self._cache[choice, every] = estimate_of_spec(
                self.spec,
                self.config,
                device=self.device,
                micro_batch_size=self.micro_batch_size,
                gradient_checkpointing=every > 0,
                checkpoint_every_n_layers=max(1, every),
                strategy=strategy,
                reshard_after_forward=reshard is not False,
                quantization=self.quantization,
            )
        return self._cache[choice, every]

    def gib(self, choice: str, every: int) -> float:
        """`estimate(choice, every)` in GiB: what the plan's rules (`choices.choose_plan`) weigh."""
        return self.estimate(choice, every).total_gib
