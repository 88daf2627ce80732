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

Pure: a function of a model config object (or a `ModelShape`) and numbers; no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jobs.memory.replay import ReplayTensor, Walk
from jobs.memory.shapes import (
    DTYPE_BYTES,
    FP32_BYTES,
    GIB,
    INDEX_BYTES,
    MIB,
    QUANTIZATIONS,
    ModelShape,
    base_param_shapes,
    count_base_params,
    count_lora_params,
    fsdp_unit_shapes,
    lora_param_shapes,
    lora_targets,
    model_shape,
    quantized_bytes,
    shard_bytes,
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
TRANSIENT_COMPONENTS = ("logits_loss", "layer_backward", "reference_forward")
BEFORE_FORWARD_COMPONENTS = ("reference_forward",)
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

# Components a spec has only with a preference objective's reference (not in every estimate).
REFERENCE_COMPONENTS = ("reference_adapter", "reference_forward")
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
    "reference_forward",
    "logits_loss",
    "layer_backward",
    "framework_overhead",
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
    def peak_allocated_bytes(self) -> int:
        c = self.components
        static = sum(v for k, v in c.items() if k not in TRANSIENT_COMPONENTS + ("activations", "framework_overhead"))
        during = c.get("activations", 0) + max(
            (c.get(k, 0) for k in TRANSIENT_COMPONENTS if k not in BEFORE_FORWARD_COMPONENTS), default=0
        )
        return static + max(during, *(c.get(k, 0) for k in BEFORE_FORWARD_COMPONENTS))

    @property
    def total_bytes(self) -> int:
        return self.peak_allocated_bytes + self.components.get("framework_overhead", 0)

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
    adds `no_sync_grads`: what the window's gradients hold beyond `lora_grads` (`_no_sync_grads`).
    `device="cuda"` adds `framework_overhead` and follows the CUDA kernels where they differ
    from the CPU ones (dropout masks, layer_norm under autocast, attention output layout);
    `device="cpu"` is what the CPU tests measure.

    `strategy="fsdp"` (FSDP2 over `world_size` ranks in `jobs.train.fsdp`'s units: the embeddings, each
    decoder layer, [final norm, LM head]): every parameter -- frozen and LoRA -- is sharded on dim
    0, padded to a multiple of `world_size`, and so are the LoRA gradients and optimizer state;
    there is no DDP bucket. `fsdp_gathered` is the most that is all-gathered at once at any
    moment of the step (`_fsdp_gathered`): with `reshard_after_forward` two units' worth -- a unit
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
    (`jobs.objectives.sft.compiled_head_loss`): its logits stay in the compute dtype (`_loss_head`).
    `compiled_head` overrides that last rule (the H200 rows of compiled layers with an eager head).
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
    step = _Step(
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
    frozen = _frozen_base(step, world_size if fsdp else 1, quantization)
    components, fsdp_layer = _static(
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
    acts = _activations(step, gradient_checkpointing, checkpoint_every_n_layers)
    components["cublas_workspace"] = CUBLAS_WORKSPACE_BYTES if device == "cuda" else 0
    components["activations"] = acts.total_bytes
    if compiled_head is None:
        compiled_head = compiled and not pairs and not fsdp
    loss = _loss_head(step, label_fraction, loss_chunk_tokens, compiled_head=compiled_head)
    components["logits_loss"] = loss.peak_bytes
    components["layer_backward"] = _layer_backward(step, acts, checkpoint_every_n_layers, frozen.largest_quantized)
    if reference == "adapter_off":
        components["reference_forward"] = _reference_forward(step, loss, frozen.largest_quantized)
    components["framework_overhead"] = _framework_overhead(components, device, world_size)
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
        # and every unit's (`_fsdp_gathered`).
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
    }
    return MemoryEstimate({k: int(v) for k, v in components.items()}, details)


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
    if reference is not None and (reference not in REFERENCES or not pairs):
        raise ValueError(
            f"memory estimate: reference must be None or, with pairs, one of {', '.join(REFERENCES)}; got {reference!r}"
        )
    if reference_adapter and reference != "adapter_off":
        raise ValueError("memory estimate: reference_adapter needs reference='adapter_off'")


@dataclass(frozen=True)
class _Step:
    """One micro-step as the pieces of `estimate` read it: `batch` rows of `seq` tokens, the
    activations (and frozen weights) `act_bytes` per element, under autocast unless fp32."""

    shape: ModelShape
    batch: int
    seq: int
    act_bytes: int
    autocast: bool
    mask: bool  # attention gets a mask: packed rows, eager attention, or a sliding window the rows reach
    targets: set[str]
    lora_r: int
    lora_dropout: float
    dora: bool
    attn: str
    device: str
    packed: bool
    pairs: bool  # rows are a preference objective's chosen and rejected
    reference_adapter: bool  # a frozen copy of the LoRA weights is the reference
    compiled: bool = False  # the decoder layers run through torch.compile

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def walk(self) -> Walk:
        return Walk(
            self.shape,
            batch=self.batch,
            seq=self.seq,
            act_bytes=self.act_bytes,
            autocast=self.autocast,
            targets=self.targets,
            r=self.lora_r,
            lora_dropout=self.lora_dropout,
            attn=self.attn,
            mask=self.mask,
            device=self.device,
            packed=self.packed,
            dora=self.dora,
            compiled=self.compiled,
        )

    def hidden_states(self, w: Walk, requires_grad: bool) -> ReplayTensor:
        """A new [batch, seq, hidden] tensor in `w`: a decoder layer's input."""
        return w.new(self.tokens * self.shape.hidden * self.act_bytes, requires_grad)


# ---- static: weights, gradients, optimizer state ----------------------------------------------


@dataclass(frozen=True)
class _Frozen:
    """The frozen base on one rank (sharded under FSDP), quantization constants included."""

    layer_bytes: int  # every decoder layer's parameters
    root_bytes: int  # embeddings, final norm, LM head
    gathered_layer_bytes: int  # one decoder layer's parameters, all-gathered (FSDP)
    largest_quantized: int  # elements of the largest quantized linear weight (0: not quantized)


def _frozen_base(step: _Step, shard_world: int, quantization: str) -> _Frozen:
    shape, a = step.shape, step.act_bytes
    frozen = {"layer": 0, "root": 0}
    gathered_layer = 0
    largest_quantized = 0
    for where, kind, dims in base_param_shapes(shape):
        n, elem, consts = math.prod(dims), a, 0
        # A quantized weight is the packed uint8 parameter (Params4bit: [ceil(n/2), 1]; Int8Params:
        # [rows, cols]): FSDP2 shards and all-gathers those bytes as they are (its mixed-precision
        # policy casts floating-point parameters only), while the constants (`quant_state`, `SCB`)
        # are plain attributes, not parameters, and stay whole on every rank.
        if quantization != "none" and kind != "other":
            dims, elem, consts = quantized_bytes(n, dims[0], quantization)
            largest_quantized = max(largest_quantized, n)
        count = shape.layers if where == "layer" else 1
        frozen[where] += count * (shard_bytes(dims, elem, shard_world) + consts)
        if where == "layer":
            gathered_layer += shard_world * shard_bytes(dims, elem, shard_world)
    return _Frozen(frozen["layer"], frozen["root"], gathered_layer, largest_quantized)


def _static(
    step: _Step,
    frozen: _Frozen,
    *,
    optimizer: str,
    momentum: float,
    world_size: int,
    gradient_as_bucket_view: bool,
    fsdp: bool,
    reshard_after_forward: bool,
    grad_accum_steps: int,
) -> tuple[dict[str, int], dict[str, Any] | None]:
    """The components that live through the whole step, and (FSDP) one layer's gathered bytes."""
    shape, a = step.shape, step.act_bytes
    shard_world = world_size if fsdp else 1
    lora_bytes = count_lora_params(shape, step.lora_r, step.targets, dora=step.dora) * FP32_BYTES
    opt_states = 2 if optimizer == "adamw" else (1 if momentum > 0 else 0)
    lora_shapes = lora_param_shapes(shape, step.lora_r, step.targets, dora=step.dora)
    lora_rank_bytes = shape.layers * sum(shard_bytes(d, FP32_BYTES, shard_world) for d in lora_shapes)
    assert shard_world > 1 or lora_rank_bytes == lora_bytes
    components = {
        "frozen_weights": frozen.layer_bytes + frozen.root_bytes,
        "lora_weights": lora_rank_bytes,
        "lora_grads": lora_rank_bytes,
        **({"reference_adapter": lora_rank_bytes} if step.reference_adapter else {}),
        "no_sync_grads": _no_sync_grads(
            lora_bytes,
            lora_rank_bytes,
            world_size=world_size,
            fsdp=fsdp,
            gradient_as_bucket_view=gradient_as_bucket_view,
            grad_accum_steps=grad_accum_steps,
        ),
        "optimizer_state": opt_states * lora_rank_bytes,
        "ddp_buckets": lora_bytes if world_size > 1 and not gradient_as_bucket_view and not fsdp else 0,
        "fsdp_gathered": 0,
    }
    if not fsdp:
        return components, None

    # An all-gathered parameter's storage is the whole padded dim 0 (world x the padded shard;
    # the parameter is a view of it), measured on 2 gloo ranks (tests/test_memory.py).
    # jobs.train.fsdp gathers in the compute dtype (MixedPrecisionPolicy(param_dtype=...)).
    def gathered(dims: list[tuple[int, ...]]) -> int:
        return sum(shard_world * shard_bytes(d, a, shard_world) for d in dims)

    others = fsdp_unit_shapes(shape)
    adapters = 2 if step.reference_adapter else 1  # the reference adapter lives in the layers too
    units = {
        "embeddings": gathered(others["embeddings"]),
        "layer": frozen.gathered_layer_bytes + adapters * gathered(lora_shapes),
        "head": gathered(others["head"]),
    }
    components["fsdp_gathered"] = _fsdp_gathered(units, shape.layers, reshard_after_forward, shape.tied_embeddings)
    return components, {
        "frozen": frozen.gathered_layer_bytes,
        "lora": units["layer"] - frozen.gathered_layer_bytes,
        "units": units,
    }


def _no_sync_grads(
    lora_bytes: int,
    lora_rank_bytes: int,
    *,
    world_size: int,
    fsdp: bool,
    gradient_as_bucket_view: bool,
    grad_accum_steps: int,
) -> int:
    """What a window of `grad_accum_steps` > 1 micro-steps holds beyond `lora_grads` (and
    `ddp_buckets`), from its first no-sync backward into the last micro-step's backward: the
    gradients are set to None after each optimizer step (`zero_grad(set_to_none=True)`), so

    * FSDP2 accumulates them unsharded, the whole fp32 gradient on every rank (in the reduce
      dtype: bf16 gradients are upcast as they accumulate), until the last micro-step's backward
      reduce-scatters them layer by layer into the shards `lora_grads` counts: the whole gradient
      less its shard, beyond it;
    * DDP with `gradient_as_bucket_view` accumulates them in fresh tensors beside its buckets, which
      stay allocated, until the last micro-step's backward copies each into its bucket: a second
      copy. Without bucket views the buckets are that copy already (`ddp_buckets`); one process
      has no buckets.

    Measured on 2 gloo ranks (tests/test_memory.py::test_a_no_sync_window_holds_what_the_estimate_counts)."""
    if grad_accum_steps < 2:
        return 0
    if fsdp:
        return lora_bytes - lora_rank_bytes
    return lora_bytes if world_size > 1 and gradient_as_bucket_view else 0


def _fsdp_gathered(units: dict[str, int], layers: int, reshard_after_forward: bool, tied: bool) -> int:
    """The most FSDP2 holds all-gathered at once over a step, for `jobs.train.fsdp.units` (bytes of one
    unit all-gathered: E embeddings, l a decoder layer, H [final norm, LM head]; L layers).

    What FSDP2 does (torch 2.13, `FSDPParamGroup`), and so what is counted: a unit's all-gather
    lands in one flat buffer, copied out into the unit's parameters; in forward that buffer is
    freed only when the next unit's copy-out starts (so the next all-gather overlaps this copy-
    out), so the next unit's buffer arrives while it is still held. In backward, a unit's pre-
    backward prefetches the unit before it, and a unit is freed right after its backward. So:

    * resharding after forward: two units' worth, at most -- a unit with its own buffer (2E at the
      embedding, 2l at a layer, 2H at the head), a unit and the next one's buffer (E + l, l + H),
      or in backward a unit and the one it prefetches (H + l, 2l): 2 max(E, l, H);
    * keeping layers gathered (`reshard_after_forward=False`): every layer stays from its forward
      to its backward and the embeddings to the end of backward, so at the head's all-gather E, L
      layers, the last one's buffer and the head's (E + Ll + l + H), at its copy-out E + Ll + 2H
      (and 2E + l at the first layer's all-gather);
    * tied embeddings: the one unit T = H holding embeddings, final norm and LM head is gathered
      from the embedding lookup to the end of backward, beside the above: T + max(T + l, 2l), or
      T + max(T + l, (L + 1) l) keeping the layers.

    Measured equal on 2 gloo ranks, every storage counted (tests/test_memory.py::test_fsdp_*)."""
    emb, layer, head = units["embeddings"], units["layer"], units["head"]
    if tied:
        return head + max(head + layer, 2 * layer if reshard_after_forward else (layers + 1) * layer)
    if reshard_after_forward:
        return 2 * max(emb, layer, head)
    return max(2 * emb + layer, emb + layers * layer + head + max(layer, head))


# ---- activations: replay the forward ------------------------------------------------------------


@dataclass(frozen=True)
class _Activations:
    total_bytes: int  # saved at the end of forward: decoder, final norm, held mask
    decoder_saved_bytes: int  # the decoder layers' share of it
    held_mask_bytes: int  # HF's [B, 1, S, S] mask kept by the checkpoint frames
    layer_saved_bytes: int  # what one layer keeps when its input requires grad (a recomputed layer)
    first_layer_saved_bytes: int  # what the first layer keeps on frozen embeddings (no checkpointing)
    checkpointed_layers: int


def _one_layer_saved(step: _Step, input_requires_grad: bool) -> int:
    w = step.walk()
    w.layer(step.hidden_states(w, input_requires_grad))
    return w.saved_bytes


def _shared_kept(w: Walk) -> set[str]:
    """Which of the tensors every layer shares (RoPE tables, position ids, packed bias) are kept."""
    shared = {"cos": w.cos, "sin": w.sin, "position_ids": w.position_ids, "bias": w.bias}
    return {k for k, t in shared.items() if t is not None and t.sid in w.saved}


def _steady_layer(step: _Step) -> tuple[set[str], int]:
    """A layer whose input requires grad keeps the same new bytes as any other such layer once
    the shared tensors it saves are kept: replay that layer once (the second of two) so that
    `_activations` adds its bytes for each such layer, instead of replaying 80 identical layers
    for a 70B model. Returns (the shared tensors it needs kept, its new bytes)."""
    probe = step.walk()
    probe.layer(step.hidden_states(probe, True))
    needs, before = _shared_kept(probe), probe.saved_bytes
    probe.layer(step.hidden_states(probe, True))
    return needs, probe.saved_bytes - before


def _activations(step: _Step, gradient_checkpointing: bool, every: int) -> _Activations:
    shape = step.shape
    needs, steady_layer_bytes = _steady_layer(step)
    repeated = 0  # bytes of the layers counted as steady_layer_bytes, not replayed
    w = step.walk()
    # HF's activation_checkpointing_enable() makes the embedding output require grad.
    x = step.hidden_states(w, gradient_checkpointing)
    checkpointed = 0
    for i in range(shape.layers):
        if gradient_checkpointing and i % every == 0:
            # torch.utils.checkpoint keeps the layer's arguments: the hidden states, RoPE cos/sin,
            # position ids (and the mask, below); everything else is recomputed in backward.
            w.save(x, w.cos, w.sin, w.position_ids)
            if w.bias is not None:  # packed rows
                w.save(w.bias)
            x = w.new(x.nbytes, True)
            checkpointed += 1
        elif x.rg and needs <= _shared_kept(w):
            repeated += steady_layer_bytes
            x = w.new(x.nbytes, True)
        else:
            x = w.layer(x)
    decoder_bytes = w.saved_bytes + repeated
    w.final_norm(x)
    # The float/bool mask HF builds once ([B, 1, S, S]) stays referenced by the checkpoint frames.
    held_mask = checkpointed > 0 and step.mask and not step.packed
    mask_bytes = step.batch * step.seq * step.seq * (step.act_bytes if step.attn == "eager" else 1) if held_mask else 0
    return _Activations(
        total_bytes=w.saved_bytes + repeated + mask_bytes,
        decoder_saved_bytes=decoder_bytes,
        held_mask_bytes=mask_bytes,
        layer_saved_bytes=_one_layer_saved(step, True),
        first_layer_saved_bytes=_one_layer_saved(step, False),
        checkpointed_layers=checkpointed,
    )


# ---- transients: the loss head, one layer's backward ----------------------------------------------


@dataclass(frozen=True)
class _LossHead:
    peak_bytes: int  # the `logits_loss` component
    saved_bytes: int  # what it keeps from forward to backward
    label_tokens: int
    chunk_tokens: int  # label tokens per LM head + loss chunk


def _loss_head(
    step: _Step, label_fraction: float, loss_chunk_tokens: int | None, compiled_head: bool = False
) -> _LossHead:
    """`CausalLMLoss`, in one piece or in checkpointed chunks of `loss_chunk_tokens`. Compiled
    (`compiled_head`): the logits are kept in the compute dtype with two fp32 per-token
    reductions (max and log-sum-exp), and backward's fused pass writes their gradient over the
    saved logits' own buffer (their last use): one [c, V] tensor in the compute dtype at the
    widest point, not three fp32 ones (on an H200 the 1B and 8B compiled rows peaked exactly one
    such tensor below a model that kept the gradient beside the logits). Pairs
    (`PreferenceLoss`): the same head with per-token log-probabilities, summed per row by an
    `index_add` that keeps its [T] row index and its [T] float64 source (the per-token
    log-probabilities, summed in float64; measured: 16 bytes a label token, plus a few bytes a
    pair)."""
    T = max(1, math.ceil(label_fraction * step.tokens))
    V, H, a = step.shape.vocab, step.shape.hidden, step.act_bytes
    # label_pos (index_select) and label_ids (cross-entropy); pairs: the row index and the float64
    # log-probs index_add keeps
    index_bytes = 2 * T * INDEX_BYTES + (T * (INDEX_BYTES + 2 * FP32_BYTES) if step.pairs else 0)
    chunk = T if not loss_chunk_tokens or T <= loss_chunk_tokens else loss_chunk_tokens
    # Forward: logits [c, V] in the compute dtype, .float() copy, log-softmax output (saved).
    # Backward: d(log-softmax) and d(logits) in fp32 while the saved output is alive: 12 bytes/elem.
    logit_bytes = a if compiled_head else FP32_BYTES
    logits_peak = 3 * FP32_BYTES * chunk * V if not compiled_head else a * chunk * V + 2 * FP32_BYTES * chunk
    if chunk < T:
        # Checkpointed chunks keep only the gathered hidden states [T, H] (views of one tensor).
        saved = T * H * a + index_bytes
    else:
        saved = logit_bytes * T * V + (2 * FP32_BYTES * T if compiled_head else 0) + index_bytes
    return _LossHead(
        peak_bytes=logits_peak + index_bytes + (T * H * a if chunk < T else 0),
        saved_bytes=saved,
        label_tokens=T,
        chunk_tokens=chunk,
    )


def _reference_forward(step: _Step, loss: _LossHead, largest_quantized: int) -> int:
    """The widest moment of the reference forward (`PreferenceLoss.reference_logps`: no grad, eval
    mode, over the same rows, before the policy forward): nothing is kept, so it is one layer's
    working set or the head's, whichever is wider.

    In a layer (L >= 2): the residual stream's [N, hidden] tensors alive at the MLP (the
    embeddings, the layer's input, its residual and normed input), RoPE tables, and the gated
    MLP's gate, up and their product ([N, intermediate] each; with the reference adapter active,
    its up-projection's LoRA output beside them); eager attention instead its fp32 softmax beside
    the scores ([B, heads, S, S]: an upper bound, 10-20% over on CPU) and the mask. At the head:
    the decoder output, the label positions' hidden states, and 8 bytes a logit (the fp32 copy
    and the log-softmax) for the label tokens of one chunk. Measured on CPU with the live-storage
    tracker (tests/test_memory.py::test_reference_forward_*)."""
    s, N, a = step.shape, step.tokens, step.act_bytes
    rows = step.batch if step.packed else 1
    stream = (4 if s.layers > 1 else 3) * N * s.hidden * a
    stream += 2 * rows * step.seq * (s.rotary_dims or s.head_dim) * a + rows * step.seq * INDEX_BYTES
    stream += step.batch * step.seq * step.seq * a if step.packed else 0  # the shared block mask
    up = "up_proj" if s.family == "llama" else "dense_h_to_4h"
    mlp = (3 if s.family == "llama" else 2) + (step.reference_adapter and up in step.targets)
    widest = mlp * N * s.intermediate * a
    if step.attn == "eager":
        scores = step.batch * s.heads * step.seq * step.seq
        widest = max(widest, 12 * scores + step.batch * step.seq * step.seq * a)
    layer_point = stream + widest + largest_quantized * a
    T, c = loss.label_tokens, loss.chunk_tokens
    head_point = N * s.hidden * a + T * s.hidden * a + 2 * FP32_BYTES * c * s.vocab + FP32_BYTES * (T + step.batch)
    return max(layer_point, head_point)


def _layer_backward(step: _Step, acts: _Activations, every: int, largest_quantized: int) -> int:
    """The widest moment of one layer's backward beyond what it saves.

    At the MLP: [N, intermediate] gradients (fp32: two of them; under autocast one in the
    compute dtype, plus a few [N, hidden] gradients). At the norms: fp32 [N, hidden] temporaries.
    Checkpointing adds the recomputed layer, all alive when the MLP backward (the first part of
    the layer's backward) runs; beside it, fewer [N, hidden] gradients coexist under autocast.
    Measured on CPU with a live-storage tracker over forward + backward
    (tests/test_memory.py::test_peak_*)."""
    N, L, a = step.tokens, step.shape.layers, step.act_bytes
    H, inter = step.shape.hidden, step.shape.intermediate
    mlp_point = N * (inter * a + 5 * H * a) if step.autocast else N * inter * (FP32_BYTES + a)
    norm_point = N * 5 * H * FP32_BYTES
    plain_point = max(mlp_point, norm_point) if acts.checkpointed_layers < L else 0
    if acts.checkpointed_layers:
        # The last checkpointed layer is recomputed after the (plain) layers above it were
        # freed; earlier checkpointed layers find even less alive.
        last = (L - 1) // every * every
        freed = (L - 1 - last) * acts.layer_saved_bytes
        recomputed_point = N * (inter * a + 3 * H * a) if step.autocast else mlp_point
        widest = max(plain_point, acts.layer_saved_bytes + recomputed_point - freed)
    else:
        widest = plain_point
    # bitsandbytes de-quantizes a linear's weight to the compute dtype for its matmuls (forward
    # and the input gradient); one at a time, the largest bounds it.
    return widest + largest_quantized * a


def _framework_overhead(components: dict[str, int], device: str, world_size: int) -> int:
    """Outside the allocator (CUDA only): the context, NCCL's buffers with > 1 rank, allocator slack."""
    if device != "cuda":
        return 0
    allocated = MemoryEstimate(dict(components)).peak_allocated_bytes
    return int(CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if world_size > 1 else 0) + ALLOCATOR_SLACK_FRACTION * allocated)
