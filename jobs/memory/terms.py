"""The terms of `jobs.memory.components.estimate`, each a pure function of the step's shapes: the
static bytes (weights, LoRA gradients, optimizer state, DDP buckets, FSDP's gathered units), the
activations the forward saves (replayed, `replay.Walk`), and the transients (the loss head, the
reference forward, the old-log-probability forward, one layer's backward) and the framework's overhead."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from jobs.memory.replay import ReplayTensor, Walk
from jobs.memory.shapes import (
    FP32_BYTES,
    INDEX_BYTES,
    ModelShape,
    base_param_shapes,
    count_lora_params,
    fsdp_unit_shapes,
    lora_param_shapes,
    quantized_bytes,
    shard_bytes,
)


@dataclass(frozen=True)
class Step:
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
class Frozen:
    """The frozen base on one rank (sharded under FSDP), quantization constants included."""

    layer_bytes: int  # every decoder layer's parameters
    root_bytes: int  # embeddings, final norm, LM head
    gathered_layer_bytes: int  # one decoder layer's parameters, all-gathered (FSDP)
    largest_quantized: int  # elements of the largest quantized linear weight (0: not quantized)


def frozen_base(step: Step, shard_world: int, quantization: str) -> Frozen:
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
    return Frozen(frozen["layer"], frozen["root"], gathered_layer, largest_quantized)


def static(
    step: Step,
    frozen: Frozen,
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
        "no_sync_grads": no_sync_grads(
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
    # the parameter is a view of it), measured on 2 gloo ranks (tests/unit/memory/test_memory.py).
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
    components["fsdp_gathered"] = fsdp_gathered(units, shape.layers, reshard_after_forward, shape.tied_embeddings)
    return components, {
        "frozen": frozen.gathered_layer_bytes,
        "lora": units["layer"] - frozen.gathered_layer_bytes,
        "units": units,
    }


def no_sync_grads(
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

    Measured on 2 gloo ranks
    (tests/unit/memory/test_memory.py::test_a_no_sync_window_holds_what_the_estimate_counts)."""
    if grad_accum_steps < 2:
        return 0
    if fsdp:
        return lora_bytes - lora_rank_bytes
    return lora_bytes if world_size > 1 and gradient_as_bucket_view else 0


def fsdp_gathered(units: dict[str, int], layers: int, reshard_after_forward: bool, tied: bool) -> int:
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

    Measured equal on 2 gloo ranks, every storage counted (tests/unit/memory/test_memory.py::test_fsdp_*)."""
    emb, layer, head = units["embeddings"], units["layer"], units["head"]
    if tied:
        return head + max(head + layer, 2 * layer if reshard_after_forward else (layers + 1) * layer)
    if reshard_after_forward:
        return 2 * max(emb, layer, head)
    return max(2 * emb + layer, emb + layers * layer + head + max(layer, head))


# ---- activations: replay the forward ------------------------------------------------------------


@dataclass(frozen=True)
class Activations:
    total_bytes: int  # saved at the end of forward: decoder, final norm, held mask
    decoder_saved_bytes: int  # the decoder layers' share of it
    held_mask_bytes: int  # HF's [B, 1, S, S] mask kept by the checkpoint frames
    layer_saved_bytes: int  # what one layer keeps when its input requires grad (a recomputed layer)
    first_layer_saved_bytes: int  # what the first layer keeps on frozen embeddings (no checkpointing)
    checkpointed_layers: int


def one_layer_saved(step: Step, input_requires_grad: bool) -> int:
    w = step.walk()
    w.layer(step.hidden_states(w, input_requires_grad))
    return w.saved_bytes


def shared_kept(w: Walk) -> set[str]:
    """Which of the tensors every layer shares (RoPE tables, position ids, packed bias) are kept."""
    shared = {"cos": w.cos, "sin": w.sin, "position_ids": w.position_ids, "bias": w.bias}
    return {k for k, t in shared.items() if t is not None and t.sid in w.saved}


def steady_layer(step: Step) -> tuple[set[str], int]:
    """A layer whose input requires grad keeps the same new bytes as any other such layer once
    the shared tensors it saves are kept: replay that layer once (the second of two) so that
    `activations` adds its bytes for each such layer, instead of replaying 80 identical layers
    for a 70B model. Returns (the shared tensors it needs kept, its new bytes)."""
    probe = step.walk()
    probe.layer(step.hidden_states(probe, True))
    needs, before = shared_kept(probe), probe.saved_bytes
    probe.layer(step.hidden_states(probe, True))
    return needs, probe.saved_bytes - before


def activations(step: Step, gradient_checkpointing: bool, every: int) -> Activations:
    shape = step.shape
    needs, steady_layer_bytes = steady_layer(step)
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
        elif x.rg and needs <= shared_kept(w):
            repeated += steady_layer_bytes
            x = w.new(x.nbytes, True)
        else:
            x = w.layer(x)
    decoder_bytes = w.saved_bytes + repeated
    w.final_norm(x)
    # The float/bool mask HF builds once ([B, 1, S, S]) stays referenced by the checkpoint frames.
    held_mask = checkpointed > 0 and step.mask and not step.packed
    mask_bytes = step.batch * step.seq * step.seq * (step.act_bytes if step.attn == "eager" else 1) if held_mask else 0
    return Activations(
        total_bytes=w.saved_bytes + repeated + mask_bytes,
        decoder_saved_bytes=decoder_bytes,
        held_mask_bytes=mask_bytes,
        layer_saved_bytes=one_layer_saved(step, True),
        first_layer_saved_bytes=one_layer_saved(step, False),
        checkpointed_layers=checkpointed,
    )


# ---- transients: the loss head, one layer's backward ----------------------------------------------


@dataclass(frozen=True)
class LossHead:
    peak_bytes: int  # the `logits_loss` component
    saved_bytes: int  # what it keeps from forward to backward
    label_tokens: int
    chunk_tokens: int  # label tokens per LM head + loss chunk


def loss_head(
    step: Step, label_fraction: float, loss_chunk_tokens: int | None, compiled_head: bool = False
) -> LossHead:
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
    return LossHead(
        peak_bytes=logits_peak + index_bytes + (T * H * a if chunk < T else 0),
        saved_bytes=saved,
        label_tokens=T,
        chunk_tokens=chunk,
    )


def reference_forward(step: Step, loss: LossHead, largest_quantized: int) -> int:
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
    tracker (tests/unit/memory/test_memory.py::test_reference_forward_*)."""
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


def old_logprobs_forward(step: Step, rows: int, largest_quantized: int) -> int:
    """The trainer's old-log-probability pass (`num_iterations` > 1; `grpo_batch.old_logps`):
    no-grad forwards of `rows` completions at a time, with the policy's adapter active, whose
    head takes every label position's logits in one piece: the reference forward's widest moment
    over those rows (an adapter active, the head unchunked)."""
    rows_step = dataclasses.replace(step, batch=rows, reference_adapter=True)
    return reference_forward(rows_step, loss_head(rows_step, 1.0, None), largest_quantized)


def layer_backward(step: Step, acts: Activations, every: int, largest_quantized: int) -> int:
    """The widest moment of one layer's backward beyond what it saves.

    At the MLP: [N, intermediate] gradients (fp32: two of them; under autocast one in the
    compute dtype, plus a few [N, hidden] gradients). At the norms: fp32 [N, hidden] temporaries.
    Checkpointing adds the recomputed layer, all alive when the MLP backward (the first part of
    the layer's backward) runs; beside it, fewer [N, hidden] gradients coexist under autocast.
    Measured on CPU with a live-storage tracker over forward + backward
    (tests/unit/memory/test_memory.py::test_peak_*)."""
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
