"""`estimate`: the per-GPU memory of one micro-step of LoRA training, as named components.

Peak model. Static memory (weights, LoRA grads, optimizer state, DDP buckets, FSDP's gathered
units) plus the activations saved at the end of forward (`replay.Walk`) plus the larger of two
transients that never coexist: the loss head's peak (first thing in backward) and one decoder
layer's backward (the recomputed layer when checkpointing, plus its gradient buffers).

The loss head (`CausalLMLoss`): [T, vocab] logits in the compute dtype, their fp32 copy, the
saved log-softmax, and in backward its gradient and the input gradient: the transient peak is
12 bytes x T x vocab at the log-softmax backward.

Preference objectives (`jobs.objectives.preference.PreferenceLoss`): a micro-batch of m pairs is 2m rows
(chosen and rejected, one forward), and the head keeps per-token log-probabilities over the label
tokens, as the SFT head does. DPO and IPO with `reference: adapter_off` first run the reference
forward (no grad, eval mode: nothing saved) before the policy's: a third transient, and the only
one that never meets the step's activations (`BEFORE_FORWARD_COMPONENTS`).

Online RL (`rollout`: GRPO): generation (`generation.generation_terms`: the KV cache, the prefill,
the sampler, the LoRA weights' compute-dtype copies) and, with `num_iterations` > 1, the trainer's
old-log-probability forward run before the window, never beside a backward: two more transients
before the forward, weighed against the training peak, never added to it.

Pure: a function of a model config object (or a `ModelShape`) and numbers; no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jobs.memory.generation import Rollout, choose_generation_batch, engine_terms, generation_terms
from jobs.memory.shapes import (
    DTYPE_BYTES,
    GIB,
    MIB,
    QUANTIZATIONS,
    ModelShape,
    count_base_params,
    count_lora_params,
    lora_targets,
    model_shape,
)
from jobs.memory.terms import (
    Step,
    activations,
    frozen_base,
    layer_backward,
    loss_head,
    old_logprobs_forward,
    reference_forward,
    static,
)
from jobs.spec import DEFAULT_TARGET_MODULES

# CUDA context (driver, kernels of torch/cuBLAS/cuDNN loaded lazily) as seen by nvidia-smi on
# an H100/H200 with torch 2.x; it is outside `torch.cuda.max_memory_allocated`.
CUDA_CONTEXT_BYTES = 768 * MIB
# cuBLAS and cuBLASLt workspaces (32 MiB each on Hopper), taken from the caching allocator at the
# first matmul and held from then on, so inside `torch.cuda.max_memory_allocated`: every one of
# the 31 combinations of bench/gpu_memory.py and every plain and QLoRA row of bench/gpu_compare.py
# on an H200 read 64.3-65.3 MiB above the estimate without this term
# (bench/results/gpu-2026-12-04-nvidia-h200/).
CUBLAS_WORKSPACE_BYTES = 64 * MIB
# NCCL communicator buffers per process with DDP (world_size > 1), also outside the allocator.
NCCL_BUFFER_BYTES = 256 * MIB
# Caching-allocator fragmentation: reserved - allocated at the peak, as a fraction of the
# allocated peak. 5-10% is typical for a fixed-shape training step; we take the high end
# for safety because padded batches change shapes every step.
ALLOCATOR_SLACK_FRACTION = 0.08

# Components whose peaks happen at different moments of the micro-step: the total adds the
# largest of them, not their sum. Those of `BEFORE_FORWARD_COMPONENTS` come before the forward,
# when no activation of the micro-step exists yet.
TRANSIENT_COMPONENTS = ("logits_loss", "layer_backward", "reference_forward", "generation", "old_logprobs_forward")
BEFORE_FORWARD_COMPONENTS = ("reference_forward", "generation", "old_logprobs_forward")
COMPONENT_ORDER = (
    "frozen_weights",
    "lora_weights",
    "lora_grads",
    "no_sync_grads",
    "optimizer_state",
    "ddp_buckets",
    "fsdp_gathered",
    "cublas_workspace",
    "activations",
    "logits_loss",
    "layer_backward",
    "framework_overhead",
)

# Components in another process on the same device: not in the trainer's `peak_allocated_bytes`,
# added to the device's total (`rollout.engine: vllm`: the server rank 0 starts beside it).
OTHER_PROCESS_COMPONENTS = ("vllm_engine",)

# Components a spec has only with a preference objective's reference (not in every estimate).
REFERENCE_COMPONENTS = ("reference_adapter", "reference_forward")
# Components a spec has only with online RL: generation in-process (`rollout.engine: hf`), and the
# old-log-probability forward (`objective.num_iterations` > 1).
GENERATION_COMPONENTS = ("generation", "old_logprobs_forward")
_TABLE_ORDER = (
    "frozen_weights",
    "lora_weights",
    "lora_grads",
    "no_sync_grads",
    "optimizer_state",
    "reference_adapter",
    "ddp_buckets",
    "fsdp_gathered",
    "cublas_workspace",
    "activations",
    "generation",
    "old_logprobs_forward",
    "reference_forward",
    "logits_loss",
    "layer_backward",
    "framework_overhead",
    "vllm_engine",
)
REFERENCES = ("adapter_off", "precomputed")

STRATEGIES = ("ddp", "fsdp")


@dataclass
class MemoryEstimate:
    """Named per-GPU memory components in bytes.

    `total_bytes` = every component except the transients and the activations + the larger of
    (activations + the largest transient of the forward and backward) and the largest transient
    before the forward (`BEFORE_FORWARD_COMPONENTS`). `peak_allocated_bytes` is the same without
    `framework_overhead`: what `torch.cuda.max_memory_allocated()` should read.
    `details` holds finer terms (per-layer saved bytes, shapes used) for tests and logs.
    """

    components: dict[str, int]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def static_bytes(self) -> int:
        """What lives through the whole step: every component but the transients, the activations
        and `framework_overhead`."""
        skip = TRANSIENT_COMPONENTS + OTHER_PROCESS_COMPONENTS + ("activations", "framework_overhead")
        return sum(v for k, v in self.components.items() if k not in skip)

    @property
    def peak_allocated_bytes(self) -> int:
        c = self.components
        static = self.static_bytes
        during = c.get("activations", 0) + max(
            (c.get(k, 0) for k in TRANSIENT_COMPONENTS if k not in BEFORE_FORWARD_COMPONENTS), default=0
        )
        return static + max(during, *(c.get(k, 0) for k in BEFORE_FORWARD_COMPONENTS))

    @property
    def total_bytes(self) -> int:
        """The device's: the trainer's peak, what it holds outside the allocator, and the other
        processes rayft puts on it (`OTHER_PROCESS_COMPONENTS`). A colocated vLLM engine that sleeps
        while the trainer steps (`rollout.vllm_sleep`) is whole only while it generates, when the
        trainer holds its static memory alone: the larger of the two moments."""
        other = sum(self.components.get(k, 0) for k in OTHER_PROCESS_COMPONENTS)
        overhead = self.components.get("framework_overhead", 0)
        engine = self.details.get("vllm_engine") or {}
        if engine.get("sleeps") and "vllm_engine" in self.components:
            stepping = self.peak_allocated_bytes + engine["asleep"]
            generating = self.static_bytes + self.components["vllm_engine"]
            return max(stepping, generating) + overhead + other - self.components["vllm_engine"]
        return self.peak_allocated_bytes + overhead + other

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def peak_allocated_gib(self) -> float:
        return self.peak_allocated_bytes / GIB

    def table(self) -> list[tuple[str, float]]:
        """(name, GiB) rows: every component, then `total` (transients: only the largest counts)."""
        rows = [(name, self.components[name] / GIB) for name in _TABLE_ORDER if name in self.components]
        rows += [(k, v / GIB) for k, v in self.components.items() if k not in _TABLE_ORDER]
        rows.append(("total", self.total_gib))
        return rows


def estimate(
    config,
    *,
    micro_batch_size: int,
    seq_len: int,
    gradient_checkpointing: bool,
    base_dtype: str = "bf16",
    lora_r: int = 8,
    lora_target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
    lora_dropout: float = 0.0,
    optimizer: str = "adamw",
    momentum: float = 0.0,
    world_size: int = 1,
    gradient_as_bucket_view: bool = True,
    attn_implementation: str = "sdpa",
    checkpoint_every_n_layers: int = 1,
    label_fraction: float = 1.0,
    loss_chunk_tokens: int | None = None,
    packed: bool = False,
    device: str = "cuda",
    lora_dora: bool = False,
    strategy: str = "ddp",
    reshard_after_forward: bool = True,
    quantization: str = "none",
    grad_accum_steps: int = 1,
    pairs: bool = False,
    reference: str | None = None,
    reference_adapter: bool = False,
    compiled: bool = False,
    compiled_head: bool | None = None,
    rollout: Rollout | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of one micro-step of LoRA training, as named components in bytes.

    `config` is a transformers config (or a `ModelShape`). `base_dtype` is the dtype of the
    frozen weights and of the activations; anything but fp32 means autocast with fp32 LoRA
    weights, as `jobs.train.loop` runs it. Ragged micro-batches cost what full ones of the same
    padded length do (`jobs.data.collate` adds no mask). `packed` means `data.packing` rows
    (`micro_batch_size` rows of `seq_len` tokens, several sequences each): a shared float
    block mask and per-row RoPE tables. `label_fraction` is label tokens / (micro_batch_size x seq_len).
    `gradient_as_bucket_view` matches `jobs.train.loop`'s DDP (True): the LoRA gradients live in
    DDP's buckets, so buckets cost nothing extra; False adds a second fp32 copy.
    `grad_accum_steps` > 1 (micro-steps per optimizer step, the gate off on all but the last)
    adds `no_sync_grads`: what the window's gradients hold beyond `lora_grads` (`no_sync_grads`).
    `device="cuda"` adds `framework_overhead` and follows the CUDA kernels where they differ
    from the CPU ones (dropout masks, layer_norm under autocast, attention output layout);
    `device="cpu"` is what the CPU tests measure.

    `strategy="fsdp"` (FSDP2 over `world_size` ranks in `jobs.train.fsdp`'s units: the embeddings, each
    decoder layer, [final norm, LM head]): every parameter -- frozen and LoRA -- is sharded on dim
    0, padded to a multiple of `world_size`, and so are the LoRA gradients and optimizer state;
    there is no DDP bucket. `fsdp_gathered` is the most that is all-gathered at once at any
    moment of the step (`fsdp_gathered`): with `reshard_after_forward` two units' worth -- a unit
    and its all-gather buffer, or a unit and the next one prefetched -- of the largest unit; with
    `reshard_after_forward=False` every layer (each stays gathered from its forward until its
    backward) beside the embeddings and the head.
    `quantization` ("nf4", "int8": bitsandbytes, QLoRA) stores the decoder's linear weights as
    `quantized_bytes` says; embeddings, LM head, norms and biases stay in `base_dtype`, and one
    layer's backward also holds the largest linear de-quantized to `base_dtype`.

    `pairs` (a preference objective): `micro_batch_size` counts pairs, and each is two rows
    (chosen, rejected) of `seq_len` through one forward. `reference="adapter_off"` (DPO, IPO): a
    reference forward precedes the policy's (`reference_forward`); "precomputed": none. With
    `reference_adapter` (the starting adapter `model.adapter` as the reference) the reference is a
    second, frozen copy of the LoRA weights (`reference_adapter`: fp32 as PEFT loads an adapter,
    sharded and gathered with its layer under FSDP) that is active in that forward; without it
    the reference is the base with the adapter off, and holds nothing.

    `compiled` (`model.compile`): the decoder layers run through torch.compile, which keeps less
    for backward (`replay.Walk`), and an SFT loss head off FSDP runs compiled too
    (`jobs.objectives.sft.compiled_head_loss`): its logits stay in the compute dtype (`loss_head`).
    `compiled_head` overrides that last rule (the H200 rows of compiled layers with an eager head).

    `rollout` (online RL): generation in-process adds `generation`, the peak of one generation
    batch (`generation.generation_terms`) -- of `rollout.batch_size` rows, or else of the largest
    batch whose peak stays within the training peak (`choose_generation_batch`), written to
    `details["generation"]` -- and `num_iterations` > 1 adds `old_logprobs_forward`; both come
    before the forward (`BEFORE_FORWARD_COMPONENTS`). The vLLM server rank 0 starts
    (`rollout.engine`) adds `vllm_engine` (`generation.engine_terms`, parts in
    `details["vllm_engine"]`): another process on the device, in `total_bytes`, not in the
    trainer's `peak_allocated_bytes` -- when colocated; a separate engine (`rollout.vllm_placement`)
    is only in the details, its `per_device` bytes judged against its own devices.
    """
    _check_arguments(
        base_dtype=base_dtype,
        attn_implementation=attn_implementation,
        device=device,
        optimizer=optimizer,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        world_size=world_size,
        checkpoint_every_n_layers=checkpoint_every_n_layers,
        strategy=strategy,
        quantization=quantization,
        label_fraction=label_fraction,
        grad_accum_steps=grad_accum_steps,
        pairs=pairs,
        reference=reference,
        reference_adapter=reference_adapter,
    )
    shape = config if isinstance(config, ModelShape) else model_shape(config)
    rows = micro_batch_size * (2 if pairs else 1)
    step = Step(
        shape=shape,
        batch=rows,
        seq=seq_len,
        act_bytes=DTYPE_BYTES[base_dtype],
        autocast=base_dtype != "fp32",
        targets=lora_targets(shape, lora_target_modules),
        lora_r=lora_r,
        lora_dropout=lora_dropout,
        dora=lora_dora,
        attn=attn_implementation,
        device=device,
        packed=packed,
        pairs=pairs,
        reference_adapter=reference_adapter,
        compiled=compiled,
        mask=(
            (packed and attn_implementation != "flex_attention")  # flex: a BlockMask, not a bias
            or attn_implementation == "eager"
            or (shape.sliding_window is not None and seq_len >= shape.sliding_window)
        ),
    )
    fsdp = strategy == "fsdp"
    frozen = frozen_base(step, world_size if fsdp else 1, quantization)
    components, fsdp_layer = static(
        step,
        frozen,
        optimizer=optimizer,
        momentum=momentum,
        world_size=world_size,
        gradient_as_bucket_view=gradient_as_bucket_view,
        fsdp=fsdp,
        reshard_after_forward=reshard_after_forward,
        grad_accum_steps=grad_accum_steps,
    )
    acts = activations(step, gradient_checkpointing, checkpoint_every_n_layers)
    components["cublas_workspace"] = CUBLAS_WORKSPACE_BYTES if device == "cuda" else 0
    components["activations"] = acts.total_bytes
    if compiled_head is None:
        compiled_head = compiled and not pairs and not fsdp
    loss = loss_head(step, label_fraction, loss_chunk_tokens, compiled_head=compiled_head)
    components["logits_loss"] = loss.peak_bytes
    components["layer_backward"] = layer_backward(step, acts, checkpoint_every_n_layers, frozen.largest_quantized)
    if reference == "adapter_off":
        components["reference_forward"] = reference_forward(step, loss, frozen.largest_quantized)
    generated: dict[str, int] = {}
    if rollout is not None:
        lora_params = count_lora_params(shape, lora_r, step.targets, dora=lora_dora)
        generated = rollout_components(step, rollout, components, lora_params, frozen.largest_quantized)
    components["framework_overhead"] = framework_overhead(components, device, world_size)
    engine = None
    if rollout is not None and rollout.engine is not None:
        engine = engine_terms(shape, rollout.engine, step.act_bytes, CUDA_CONTEXT_BYTES if device == "cuda" else 0)
        if engine["colocated"]:  # a separate engine is on devices of its own: not in this one's total
            components["vllm_engine"] = engine["total"]
    details = {
        "params": count_base_params(shape),
        "lora_params": count_lora_params(shape, lora_r, step.targets, dora=lora_dora),
        "label_tokens": loss.label_tokens,
        "logits_chunk_tokens": loss.chunk_tokens,
        "strategy": strategy,
        "world_size": world_size,
        "quantization": quantization,
        "grad_accum_steps": grad_accum_steps,
        "rows": step.batch,
        "pairs": pairs,
        "reference": reference,
        "reshard_after_forward": reshard_after_forward if fsdp else None,
        # FSDP: one decoder layer's all-gathered parameters (frozen: packed bytes when quantized),
        # and every unit's (`fsdp_gathered`).
        "fsdp_gathered_layer_bytes": fsdp_layer and {"frozen": fsdp_layer["frozen"], "lora": fsdp_layer["lora"]},
        "fsdp_unit_bytes": fsdp_layer and fsdp_layer["units"],
        "frozen_layer_bytes": frozen.layer_bytes,
        "frozen_root_bytes": frozen.root_bytes,
        "mask": step.mask,
        "checkpointed_layers": acts.checkpointed_layers,
        "layer_saved_bytes": acts.layer_saved_bytes,
        "first_layer_saved_bytes": acts.first_layer_saved_bytes,
        "decoder_saved_bytes": acts.decoder_saved_bytes,
        "held_mask_bytes": acts.held_mask_bytes,
        "loss_saved_bytes": loss.saved_bytes,
        "generation": generated or None,
        "vllm_engine": engine,
    }
    return MemoryEstimate({k: int(v) for k, v in components.items()}, details)


def rollout_components(
    step: Step, rollout: Rollout, components: dict[str, int], lora_params: int, largest_quantized: int
) -> dict[str, int]:
    """Adds online RL's transients to `components` (`old_logprobs_forward`; `generation` at the
    generation batch the spec fixes, capped by the worker's share, or the largest whose peak stays
    within the training peak) and returns generation's parts for `details` (empty without it)."""
    if rollout.old_logprobs:
        components["old_logprobs_forward"] = old_logprobs_forward(step, rollout.old_logprobs_rows, largest_quantized)
    if not rollout.in_process:
        return {}
    training = MemoryEstimate(dict(components))
    up = "up_proj" if step.shape.family == "llama" else "dense_h_to_4h"

    def terms_of(rows: int):
        gen = rollout.batch(rows)
        return generation_terms(step.shape, gen, step.act_bytes, step.autocast, lora_params, up in step.targets)

    if rollout.batch_size is not None:
        rows = min(rollout.batch_size, rollout.share)
    else:
        peak_of = lambda g: training.static_bytes + terms_of(g).peak_bytes  # noqa: E731
        rows = choose_generation_batch(peak_of, training.peak_allocated_bytes, rollout.share)
    terms = terms_of(rows)
    components["generation"] = terms.peak_bytes
    return {"generation_batch_size": rows, **terms.as_dict()}


def _check_arguments(
    *,
    base_dtype: str,
    attn_implementation: str,
    device: str,
    optimizer: str,
    micro_batch_size: int,
    seq_len: int,
    world_size: int,
    checkpoint_every_n_layers: int,
    strategy: str,
    quantization: str,
    label_fraction: float,
    grad_accum_steps: int,
    pairs: bool,
    reference: str | None,
    reference_adapter: bool,
) -> None:
    """`estimate`'s arguments it cannot model raise ValueError (the spec adapter turns it into SpecError)."""
    if base_dtype not in DTYPE_BYTES:
        raise ValueError(f"memory estimate: base_dtype must be one of {sorted(DTYPE_BYTES)}, got {base_dtype!r}")
    if attn_implementation not in ("sdpa", "eager", "flex_attention"):
        raise ValueError(
            f"memory estimate: attn_implementation must be sdpa, eager or flex_attention, got {attn_implementation!r}"
        )
    if device not in ("cuda", "cpu"):
        raise ValueError(f"memory estimate: device must be cuda or cpu, got {device!r}")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"memory estimate: optimizer must be adamw or sgd, got {optimizer!r}")
    if min(micro_batch_size, seq_len, world_size, checkpoint_every_n_layers, grad_accum_steps) < 1:
        raise ValueError(
            "memory estimate: micro_batch_size, seq_len, world_size, checkpoint_every_n_layers, "
            "grad_accum_steps must be >= 1"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"memory estimate: strategy must be ddp or fsdp, got {strategy!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"memory estimate: quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    if not 0 < label_fraction <= 1:
        raise ValueError(f"memory estimate: label_fraction must be in (0, 1], got {label_fraction}")
    if reference is not None and reference not in REFERENCES:  # pairs (DPO, IPO) or completions (GRPO, beta > 0)
        raise ValueError(
            f"memory estimate: reference must be None or one of {', '.join(REFERENCES)}; got {reference!r}"
        )
    if reference_adapter and reference != "adapter_off":
        raise ValueError("memory estimate: reference_adapter needs reference='adapter_off'")


def framework_overhead(components: dict[str, int], device: str, world_size: int) -> int:
    """Outside the allocator (CUDA only): the context, NCCL's buffers with > 1 rank, allocator slack."""
    if device != "cuda":
        return 0
    allocated = MemoryEstimate(dict(components)).peak_allocated_bytes
    return int(CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if world_size > 1 else 0) + ALLOCATOR_SLACK_FRACTION * allocated)
