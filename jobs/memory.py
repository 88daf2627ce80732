"""Per-GPU training memory of LoRA fine-tuning, estimated from the model's shape alone.

A pure function: no GPU, no model is built. Tune, the driver and
`memory.gradient_checkpointing: auto` call it before anything is launched, so it must be
cheap and must not need the weights.

What it models is what rayft actually runs (`jobs.model` + `jobs.loop`): frozen base weights
in the compute dtype (or quantized by bitsandbytes: nf4, int8), LoRA weights in fp32 (PEFT),
autocast for bf16/fp16, HF non-reentrant checkpointing of whole decoder layers, and
`CausalLMLoss` (LM head + fp32 cross-entropy on the label positions only, optionally in
checkpointed chunks), under DDP or FSDP2 (`jobs.fsdp`: every parameter sharded per rank, the
layers in flight gathered). `plan_for_spec` is the one place that picks the strategy and the
checkpointing (`choose_plan`).

Activations are not a rule of thumb: `_Walk` replays the forward of one decoder layer op by
op and records which tensors autograd keeps for backward, by storage (a tensor saved by
two ops, or a view of a saved tensor, is counted once), and only when the gradient that
needs it is required -- exactly as PyTorch's generated backward formulas decide. Facts this
captures that a "bytes per token" constant would miss, all measured on torch 2.13 /
transformers 5 / peft 0.21 (tests/test_memory.py checks them against
`saved_tensors_hooks`):

* Frozen base linears save nothing but their weight; the LoRA A matmul saves the input.
* PEFT would cast every LoRA input to fp32 under autocast (and autocast back), giving each
  adapted module its *own* bf16 copy of its input to keep; `jobs.model` turns that off, so
  the adapters of q, k and v (gate and up) keep one shared tensor, counted once.
* RMSNorm keeps an fp32 copy of its input; without checkpointing the first layer's input
  norm saves nothing (the embeddings are frozen); HF checkpointing turns input grads on.
* SDPA keeps q, k, v, out and the log-sum-exp, no seq x seq matrix. Padded batches carry no
  mask (`jobs.data.collate`: right padding + causal attention is exact), so they cost what
  full ones do. A mask -- packed rows' block-diagonal float bias (one tensor shared by every
  layer), or HF's sliding-window bool mask (converted to a float bias that each layer saves)
  -- disables SDPA's native GQA: k, v are repeated to all heads. Eager keeps the fp32
  softmax and its compute-dtype copy.
* The loss head (`CausalLMLoss`): [T, vocab] logits in the compute dtype, their fp32 copy,
  the saved log-softmax, and in backward its gradient and the input gradient: the
  transient peak is 12 bytes x T x vocab at the log-softmax backward.

Peak model. Static memory (weights, LoRA grads, optimizer state, DDP buckets) plus the
activations saved at the end of forward plus the larger of two transients that never
coexist: the loss head's peak (first thing in backward) and one decoder layer's backward
(the recomputed layer when checkpointing, plus its gradient buffers).

Checked on CPU by tests/test_memory.py (saved bytes to 1%, the forward+backward peak of
op-allocated storages to 10%) and on a GPU against `torch.cuda.max_memory_allocated` by
bench/gpu_memory.py (results in bench/results/). `framework_overhead` (CUDA context,
allocator slack) is a documented constant, not measured by either.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from .spec import DEFAULT_TARGET_MODULES as _SPEC_DEFAULT_TARGETS

GIB = 1024**3
MIB = 1024**2

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32_BYTES = 4
INDEX_BYTES = 8  # int64 label positions / label ids
DEFAULT_TARGET_MODULES = tuple(_SPEC_DEFAULT_TARGETS)

# CUDA context (driver, kernels of torch/cuBLAS/cuDNN loaded lazily) as seen by nvidia-smi on
# an H100/H200 with torch 2.x; it is outside `torch.cuda.max_memory_allocated`.
CUDA_CONTEXT_BYTES = 768 * MIB
# NCCL communicator buffers per process with DDP (world_size > 1), also outside the allocator.
NCCL_BUFFER_BYTES = 256 * MIB
# Caching-allocator fragmentation: reserved - allocated at the peak, as a fraction of the
# allocated peak. 5-10% is typical for a fixed-shape training step; we take the high end
# for safety because padded batches change shapes every step.
ALLOCATOR_SLACK_FRACTION = 0.08

# Components whose peaks happen at different moments of backward: the total adds the
# largest of them, not their sum.
TRANSIENT_COMPONENTS = ("logits_loss", "layer_backward")
COMPONENT_ORDER = ("frozen_weights", "lora_weights", "lora_grads", "optimizer_state", "ddp_buckets",
                   "fsdp_gathered", "activations", "logits_loss", "layer_backward", "framework_overhead")

STRATEGIES = ("ddp", "fsdp")
QUANTIZATIONS = ("none", "nf4", "int8")

# bitsandbytes' 4-bit NormalFloat (QLoRA; Dettmers et al. 2023, "QLoRA: Efficient Finetuning of
# Quantized LLMs", sec. 2-3; bitsandbytes `functional.quantize_4bit`): two 4-bit codes per byte,
# one absmax constant per block of 64 weights. Double quantization (`compress_statistics=True`,
# what HF's `bnb_4bit_use_double_quant` turns on) stores those constants as uint8 and keeps one
# fp32 absmax per block of 256 constants, their mean (`offset`, fp32) and the two code books:
# the 16-value NF4 table and the 256-value dynamic map of the 8-bit constants (fp32 each).
NF4_BLOCK = 64
NF4_CONST_BLOCK = 256
NF4_CODE_BYTES = 16 * FP32_BYTES
NF4_CONST_CODE_BYTES = 256 * FP32_BYTES
# LLM.int8() (Dettmers et al. 2022; bitsandbytes `Int8Params`): an int8 weight and one fp32
# scale per output row (`SCB`).


@dataclass
class MemoryEstimate:
    """Named per-GPU memory components in bytes.

    `total_bytes` = every component except the transients + the largest transient
    (`TRANSIENT_COMPONENTS`). `peak_allocated_bytes` is the same without
    `framework_overhead`: what `torch.cuda.max_memory_allocated()` should read.
    `details` holds finer terms (per-layer saved bytes, shapes used) for tests and logs.
    """

    components: dict[str, int]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_allocated_bytes(self) -> int:
        c = self.components
        steady = sum(v for k, v in c.items() if k not in TRANSIENT_COMPONENTS and k != "framework_overhead")
        return steady + max((c.get(k, 0) for k in TRANSIENT_COMPONENTS), default=0)

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
        rows = [(name, self.components[name] / GIB) for name in COMPONENT_ORDER if name in self.components]
        rows += [(k, v / GIB) for k, v in self.components.items() if k not in COMPONENT_ORDER]
        rows.append(("total", self.total_gib))
        return rows


# ---- model shape ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that memory depends on."""

    family: str  # "llama" (Llama, Mistral, Qwen2: RMSNorm, gated MLP, separate q/k/v) or "gpt_neox"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: Optional[int] = None
    attention_dropout: float = 0.0
    rotary_dims: int = 0  # gpt_neox: rotary part of each head
    parallel_residual: bool = True  # gpt_neox

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """LoRA-targetable linear modules of one layer: name -> (in_features, out_features)."""
        h, i = self.hidden, self.intermediate
        if self.family == "gpt_neox":
            return {"query_key_value": (h, 3 * h), "dense": (h, h), "dense_h_to_4h": (h, i), "dense_4h_to_h": (i, h)}
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def model_shape(config) -> ModelShape:
    """Read a transformers config (LlamaConfig, MistralConfig, Qwen2Config, GPTNeoXConfig)."""
    mt = getattr(config, "model_type", None)
    h = config.hidden_size
    heads = config.num_attention_heads
    common = dict(hidden=h, layers=config.num_hidden_layers, heads=heads, vocab=config.vocab_size,
                  intermediate=config.intermediate_size,
                  tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                  attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0))
    if mt in LLAMA_FAMILY:
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        window = None
        if mt == "mistral" or (mt == "qwen2" and getattr(config, "use_sliding_window", False)):
            window = getattr(config, "sliding_window", None)
        bias = bool(getattr(config, "attention_bias", False))
        return ModelShape(family="llama", kv_heads=kv, head_dim=head_dim, qkv_bias=bias or mt == "qwen2",
                          o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), sliding_window=window,
                          **common)
    if mt == "gpt_neox":
        head_dim = h // heads
        pct = getattr(config, "rotary_pct", None)
        if pct is None:
            pct = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        return ModelShape(family="gpt_neox", kv_heads=heads, head_dim=head_dim, qkv_bias=True, o_bias=True,
                          mlp_bias=True, rotary_dims=int(head_dim * pct),
                          parallel_residual=bool(getattr(config, "use_parallel_residual", True)), **common)
    raise ValueError(f"memory estimate: unsupported model_type {mt!r} (supported: {', '.join(LLAMA_FAMILY)}, gpt_neox)")


def count_base_params(shape: ModelShape) -> dict[str, int]:
    """Frozen parameters by part: embeddings, layers, final norm, lm_head (0 when tied)."""
    h, i, L = shape.hidden, shape.intermediate, shape.layers
    per_layer = sum(fi * fo for fi, fo in shape.linear_shapes().values())
    if shape.family == "gpt_neox":
        per_layer += 3 * h + h + i + h  # biases of qkv, dense, fc_in, fc_out
        per_layer += 2 * 2 * h  # two LayerNorms, weight + bias
        final_norm = 2 * h
    else:
        per_layer += (shape.q_dim + 2 * shape.kv_dim) * shape.qkv_bias + h * shape.o_bias
        per_layer += (2 * i + h) * shape.mlp_bias
        per_layer += 2 * h  # two RMSNorm weights
        final_norm = h
    embed = shape.vocab * h
    return {"embeddings": embed, "layers": per_layer * L, "final_norm": final_norm,
            "lm_head": 0 if shape.tied_embeddings else embed}


def count_lora_params(shape: ModelShape, r: int, target_modules: Iterable[str], dora: bool = False) -> int:
    """r x (in + out) per adapted linear per layer (A is r x in, B is out x r); DoRA adds a
    magnitude vector of `out` per adapted linear."""
    linears = shape.linear_shapes()
    targets = _targets(shape, target_modules)
    return shape.layers * sum(r * (linears[t][0] + linears[t][1]) + (linears[t][1] if dora else 0)
                              for t in targets)


def base_param_shapes(shape: ModelShape) -> list[tuple[str, str, tuple[int, ...]]]:
    """Every frozen parameter as (where, kind, torch shape): where is "layer" (one decoder
    layer's, listed once) or "root" (embeddings, final norm, LM head); kind is the linear's
    name for a linear weight (what bitsandbytes quantizes), else "other" (embeddings, LM head,
    norms and biases stay in the compute dtype). FSDP shards each of them on dim 0."""
    h = shape.hidden
    layer: list[tuple[str, str, tuple[int, ...]]] = []
    for name, (fan_in, fan_out) in shape.linear_shapes().items():
        layer.append(("layer", name, (fan_out, fan_in)))
        if shape.family == "gpt_neox":
            bias = True
        elif name in ("q_proj", "k_proj", "v_proj"):
            bias = shape.qkv_bias
        elif name == "o_proj":
            bias = shape.o_bias
        else:
            bias = shape.mlp_bias
        if bias:
            layer.append(("layer", "other", (fan_out,)))
    norms = 2 if shape.family == "gpt_neox" else 1  # LayerNorm: weight + bias; RMSNorm: weight
    layer += [("layer", "other", (h,))] * (2 * norms)
    root = [("root", "other", (shape.vocab, h))] + [("root", "other", (h,))] * norms
    if not shape.tied_embeddings:
        root.append(("root", "other", (shape.vocab, h)))
    return layer + root


def lora_param_shapes(shape: ModelShape, r: int, target_modules: Iterable[str],
                      dora: bool = False) -> list[tuple[int, ...]]:
    """One decoder layer's LoRA parameters: A [r, in] and B [out, r] per adapted linear (+ DoRA's
    magnitude [out])."""
    linears = shape.linear_shapes()
    out: list[tuple[int, ...]] = []
    for t in sorted(_targets(shape, target_modules)):
        fan_in, fan_out = linears[t]
        out += [(r, fan_in), (fan_out, r)] + ([(fan_out,)] if dora else [])
    return out


def quantized_bytes(numel: int, rows: int, quantization: str) -> tuple[tuple[int, ...], int, int]:
    """A quantized linear weight of `numel` elements and `rows` output rows, as bitsandbytes
    stores it: (the parameter's shape, bytes per element, bytes of its constants). The constants
    live beside the parameter (`quant_state` / `SCB`), so FSDP does not shard them."""
    if quantization == "nf4":
        blocks = -(-numel // NF4_BLOCK)
        consts = (blocks                                         # uint8 absmax per 64 weights
                  + -(-blocks // NF4_CONST_BLOCK) * FP32_BYTES   # fp32 absmax per 256 constants
                  + FP32_BYTES                                   # offset (the constants' mean)
                  + NF4_CODE_BYTES + NF4_CONST_CODE_BYTES)
        return (-(-numel // 2), 1), 1, consts                    # Params4bit: [ceil(n/2), 1] uint8
    if quantization == "int8":
        return (rows, numel // rows), 1, rows * FP32_BYTES
    raise ValueError(f"memory estimate: quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def _shard_bytes(dims: tuple[int, ...], elem_bytes: int, world: int) -> int:
    """Bytes one rank holds of a parameter FSDP2 shards over `world` ranks: dim 0 padded to a
    multiple of `world` (`FSDPParam`'s padded sharded size), the rest whole. `world=1`: all of it."""
    return -(-dims[0] // world) * math.prod(dims[1:]) * elem_bytes


def _targets(shape: ModelShape, target_modules: Iterable[str]) -> set[str]:
    targets = set(target_modules)
    unknown = targets - set(shape.linear_shapes())
    if unknown:
        raise ValueError(f"memory estimate: lora target modules {sorted(unknown)} are not linear layers of a "
                         f"{shape.family} decoder layer (known: {sorted(shape.linear_shapes())})")
    return targets


# ---- activations: a symbolic replay of the forward ------------------------------------------

@dataclass
class _T:
    """A tensor in the replay: its storage id, bytes and whether it requires grad."""

    sid: int
    nbytes: int
    rg: bool


class _Walk:
    """Replays the ops of a decoder layer and collects what autograd saves, by storage."""

    def __init__(self, shape: ModelShape, *, batch: int, seq: int, act_bytes: int, autocast: bool,
                 targets: set[str], r: int, lora_dropout: float, attn: str, mask: bool, device: str,
                 packed: bool = False, dora: bool = False):
        self.s, self.B, self.S, self.N = shape, batch, seq, batch * seq
        self.dora = dora
        self.a, self.autocast = act_bytes, autocast
        self.targets, self.r, self.p = targets, r, lora_dropout
        self.attn, self.mask, self.device = attn, mask, device
        self.saved: dict[int, int] = {}
        self._next = 0
        # Shared by every layer: RoPE cos/sin ([1, S, head_dim] each, in the embeddings' dtype;
        # [B, S, head_dim] for packed rows, whose position ids differ per row).
        rows = batch if packed else 1
        self.cos = self.new(rows * seq * (shape.rotary_dims or shape.head_dim) * act_bytes, False)
        self.sin = self.new(self.cos.nbytes, False)
        self.position_ids = self.new(rows * seq * INDEX_BYTES, False)
        # Packed rows: `jobs.loop.packed_attention_mask`, one [B, 1, S, S] float bias in the
        # compute dtype that every layer's attention uses (and SDPA saves) as is.
        self.packed = packed
        self.bias = self.new(batch * seq * seq * act_bytes, False) if packed else None

    def new(self, nbytes: int, rg: bool) -> _T:
        self._next += 1
        return _T(self._next, int(nbytes), rg)

    def save(self, *ts: _T) -> None:
        for t in ts:
            self.saved[t.sid] = t.nbytes

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    # -- building blocks --
    def rms_norm(self, x: _T) -> _T:
        """`x.float()`, pow, mean, rsqrt, mul; `weight * y.to(dtype)` with a frozen weight."""
        x32 = x if self.a == FP32_BYTES else self.new(self.N * self.s.hidden * FP32_BYTES, x.rg)
        if x.rg:
            self.save(x32, self.new(self.N * FP32_BYTES, True))  # fp32 input and rsqrt(var + eps)
        return self.new(self.N * self.s.hidden * self.a, x.rg)

    def layer_norm(self, x: _T) -> _T:
        """native_layer_norm saves its input, mean and rstd (the frozen weight is a parameter).

        CUDA autocast runs layer_norm in fp32: an fp32 copy of the input (and of the weight)
        is what gets saved, and the output is fp32. CPU autocast leaves it in the compute dtype.
        """
        n, h = self.N, self.s.hidden
        if self.autocast and self.device == "cuda":
            if x.rg:
                self.save(self.new(n * h * FP32_BYTES, True), self.new(n * FP32_BYTES, True),
                          self.new(n * FP32_BYTES, True), self.new(h * FP32_BYTES, False))
            return self.new(n * h * FP32_BYTES, x.rg)
        if x.rg:
            self.save(x, self.new(n * self.a, True), self.new(n * self.a, True))
        return self.new(n * h * self.a, x.rg)

    def linear(self, x: _T, name: str) -> _T:
        """Frozen base linear (+ LoRA when targeted). The base saves only its weight."""
        fan_in, fan_out = self.s.linear_shapes()[name]
        out = self.new(self.N * fan_out * self.a, x.rg or name in self.targets)
        if name not in self.targets:
            return out
        n, r, a = self.N, self.r, self.a
        # The adapters read their input in the compute dtype (`jobs.model` keeps PEFT from
        # casting it to fp32 under autocast), so lora_A keeps the very tensor the base linear
        # got: q, k and v (gate and up) share it.
        lora_in = x
        if self.p > 0:
            # Dropout on the LoRA input: CUDA's fused kernel keeps a bool mask, the CPU kernel
            # (input * bernoulli noise) keeps the noise in the input's dtype.
            if x.rg:
                self.save(self.new(n * fan_in if self.device == "cuda" else x.nbytes, True))
            lora_in = self.new(x.nbytes, x.rg)
        # An fp32 input under autocast (CUDA layer_norm's output) is cast for the matmul, and
        # lora_A keeps that copy.
        if self.autocast and lora_in.nbytes != n * fan_in * a:
            lora_in = self.new(n * fan_in * a, x.rg)
        self.save(lora_in)
        if self.autocast:
            if x.rg:
                self.save(self.new(r * fan_in * a, False))  # autocast copy of A (for the input gradient)
            self.save(self.new(fan_out * r * a, False))  # autocast copy of B
        self.save(self.new(n * r * a, True))  # lora_B saves lora_A's output (for B's gradient)
        if self.dora:
            self.dora_terms(x, fan_out)
        return out

    def dora_terms(self, x: _T, fan_out: int) -> None:
        """What PEFT's DoRA (`DoraLinearLayer.forward`) keeps beyond LoRA, per adapted linear.
        `(s - 1) * base_result` keeps the base linear's output (a storage of its own: the layer
        returns `base_result + dora_result`, a new tensor) and, when that output requires grad
        (the layer input does), the fp32 `s - 1`; `s * lora_result` keeps B(A(x)) in the compute
        dtype and the fp32 `s = m / ||W + BA||_c`; the division keeps the detached norm (in the
        activation dtype). The eye-matrix pass that builds BA for the norm is freed before
        forward ends (a per-layer transient of in x in, not counted)."""
        n, a = self.N, self.a
        self.save(self.new(n * fan_out * a, x.rg),  # base_result
                  self.new(n * fan_out * a, True),  # lora_result
                  self.new(fan_out * a, False),  # the detached weight norm
                  self.new(fan_out * FP32_BYTES, True))  # s
        if x.rg:
            self.save(self.new(fan_out * FP32_BYTES, True))  # s - 1

    def attention(self, q: _T, k: _T, v: _T) -> _T:
        s, B, S, N, a = self.s, self.B, self.S, self.N, self.a
        if q.rg or k.rg:
            self.save(self.cos, self.sin)  # RoPE's muls keep cos and sin, not q and k
        q = self.new(N * s.q_dim * a, q.rg)
        k = self.new(N * s.kv_dim * a, k.rg)
        any_rg = q.rg or k.rg or v.rg
        rep = s.heads // s.kv_heads
        if self.attn == "eager" or self.mask:
            # HF repeats k/v to all heads unless SDPA can do GQA natively (no mask). With one
            # kv head (MQA) the expand + reshape stays a view; otherwise it is a copy.
            if rep > 1 and s.kv_heads > 1:
                k = self.new(N * s.q_dim * a, k.rg)
                v = self.new(N * s.q_dim * a, v.rg)
        if self.attn == "sdpa":
            out = self.new(N * s.q_dim * a, any_rg)
            if any_rg:
                self.save(q, k, v, out, self.new(B * s.heads * S * FP32_BYTES, True))  # + log-sum-exp
                if self.packed:
                    self.save(self.bias)  # the shared bias: one storage however many layers save it
                elif self.mask:
                    # Bool mask -> float bias (one per call), padded to 16 columns for CUDA mem-efficient.
                    cols = _round_up(S, 16) if self.device == "cuda" else S
                    self.save(self.new(B * S * cols * a, False))
            # CUDA kernels write the output as [B, S, heads, D], so HF's transpose(1, 2).contiguous()
            # is free; the CPU kernel follows q's layout, which GPT-NeoX's rotary cat made [B, heads, S, D].
            if self.device != "cuda" and s.family == "gpt_neox":
                return self.new(out.nbytes, out.rg)
            return out
        # eager: matmul(q, k^T) * scale + mask -> softmax(fp32) -> .to(dtype) -> dropout -> matmul(., v)
        scores = B * s.heads * S * S
        if k.rg:
            self.save(q)
        if q.rg:
            self.save(k)
        probs32 = self.new(scores * FP32_BYTES, any_rg)
        if any_rg:
            self.save(probs32)
        probs = probs32 if a == FP32_BYTES else self.new(scores * a, any_rg)
        if s.attention_dropout > 0 and any_rg:
            self.save(self.new(scores * (1 if self.device == "cuda" else a), False))
            probs = self.new(scores * a, True)
        if v.rg:
            self.save(probs)
        if probs.rg:
            self.save(v)
        return self.new(N * s.q_dim * a, any_rg)  # transpose(1, 2).contiguous(): a new tensor

    def gated_mlp(self, x: _T) -> _T:
        gate, up = self.linear(x, "gate_proj"), self.linear(x, "up_proj")
        if gate.rg:
            self.save(gate)  # silu saves its input
        act = self.new(gate.nbytes, gate.rg)
        if up.rg:
            self.save(act)
        if act.rg:
            self.save(up)
        return self.linear(self.new(act.nbytes, act.rg or up.rg), "down_proj")

    # -- one decoder layer --
    def llama_layer(self, x: _T) -> _T:
        h = self.rms_norm(x)
        q, k, v = self.linear(h, "q_proj"), self.linear(h, "k_proj"), self.linear(h, "v_proj")
        o = self.linear(self.attention(q, k, v), "o_proj")
        x = self.new(x.nbytes, x.rg or o.rg)  # residual add saves nothing
        m = self.gated_mlp(self.rms_norm(x))
        return self.new(x.nbytes, x.rg or m.rg)

    def gpt_neox_layer(self, x: _T) -> _T:
        s = self.s
        qkv = self.linear(self.layer_norm(x), "query_key_value")
        # q, k, v are views of the fused output (saving v keeps all of it); RoPE makes new q, k.
        q = k = v = qkv
        attn_out = self.linear(self.attention(q, k, v), "dense")
        mlp_in = x if s.parallel_residual else self.new(x.nbytes, x.rg or attn_out.rg)
        fc = self.linear(self.layer_norm(mlp_in), "dense_h_to_4h")
        if fc.rg:
            self.save(fc)  # gelu saves its input
        mlp = self.linear(self.new(fc.nbytes, fc.rg), "dense_4h_to_h")
        return self.new(x.nbytes, x.rg or attn_out.rg or mlp.rg)

    def layer(self, x: _T) -> _T:
        return self.gpt_neox_layer(x) if self.s.family == "gpt_neox" else self.llama_layer(x)

    def final_norm(self, x: _T) -> _T:
        return self.layer_norm(x) if self.s.family == "gpt_neox" else self.rms_norm(x)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---- the estimate ----------------------------------------------------------------------------

def estimate(config, *, micro_batch_size: int, seq_len: int, gradient_checkpointing: bool,
             base_dtype: str = "bf16", lora_r: int = 8,
             lora_target_modules: Sequence[str] = DEFAULT_TARGET_MODULES, lora_dropout: float = 0.0,
             optimizer: str = "adamw", momentum: float = 0.0, world_size: int = 1,
             gradient_as_bucket_view: bool = True, attn_implementation: str = "sdpa",
             checkpoint_every_n_layers: int = 1, label_fraction: float = 1.0,
             loss_chunk_tokens: Optional[int] = None, packed: bool = False,
             device: str = "cuda", lora_dora: bool = False, strategy: str = "ddp",
             reshard_after_forward: bool = True, quantization: str = "none") -> MemoryEstimate:
    """Per-GPU memory of one micro-step of LoRA training, as named components in bytes.

    `config` is a transformers config (or a `ModelShape`). `base_dtype` is the dtype of the
    frozen weights and of the activations; anything but fp32 means autocast with fp32 LoRA
    weights, as `jobs.loop` runs it. Ragged micro-batches cost what full ones of the same
    padded length do (`jobs.data.collate` adds no mask). `packed` means `data.packing` rows
    (`micro_batch_size` rows of `seq_len` tokens, several sequences each): a shared float
    block mask and per-row RoPE tables. `label_fraction` is label tokens / (micro_batch_size x seq_len).
    `gradient_as_bucket_view` matches `jobs.loop`'s DDP (True): the LoRA gradients live in
    DDP's buckets, so buckets cost nothing extra; False adds a second fp32 copy.
    `device="cuda"` adds `framework_overhead` and follows the CUDA kernels where they differ
    from the CPU ones (dropout masks, layer_norm under autocast, attention output layout);
    `device="cpu"` is what the CPU tests measure.

    `strategy="fsdp"` (FSDP2, `fully_shard` per decoder layer and the root over `world_size`
    ranks): every parameter -- frozen and LoRA -- is sharded on dim 0, padded to a multiple of
    `world_size`, and so are the LoRA gradients and optimizer state; there is no DDP bucket.
    `fsdp_gathered` is what is all-gathered at the peak: the root's parameters (embeddings, final
    norm, LM head: FSDP2 never reshards the root after forward) and the decoder layers in flight
    -- the one in backward plus the next one prefetched, or, with `reshard_after_forward=False`,
    every layer (each stays gathered from its forward until its backward).
    `quantization` ("nf4", "int8": bitsandbytes, QLoRA) stores the decoder's linear weights as
    `quantized_bytes` says; embeddings, LM head, norms and biases stay in `base_dtype`, and one
    layer's backward also holds the largest linear de-quantized to `base_dtype`.
    """
    if base_dtype not in DTYPE_BYTES:
        raise ValueError(f"memory estimate: base_dtype must be one of {sorted(DTYPE_BYTES)}, got {base_dtype!r}")
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"memory estimate: attn_implementation must be sdpa or eager, got {attn_implementation!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"memory estimate: device must be cuda or cpu, got {device!r}")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"memory estimate: optimizer must be adamw or sgd, got {optimizer!r}")
    if micro_batch_size < 1 or seq_len < 1 or world_size < 1 or checkpoint_every_n_layers < 1:
        raise ValueError("memory estimate: micro_batch_size, seq_len, world_size, checkpoint_every_n_layers must be >= 1")
    if strategy not in STRATEGIES:
        raise ValueError(f"memory estimate: strategy must be ddp or fsdp, got {strategy!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"memory estimate: quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    if not 0 < label_fraction <= 1:
        raise ValueError(f"memory estimate: label_fraction must be in (0, 1], got {label_fraction}")
    shape = config if isinstance(config, ModelShape) else model_shape(config)
    targets = _targets(shape, lora_target_modules)
    B, S = micro_batch_size, seq_len
    N = B * S
    a = DTYPE_BYTES[base_dtype]
    autocast = base_dtype != "fp32"
    mask = (packed or attn_implementation == "eager"
            or (shape.sliding_window is not None and S >= shape.sliding_window))

    # ---- static ----
    params = count_base_params(shape)
    lora_params = count_lora_params(shape, lora_r, targets, dora=lora_dora)
    lora_bytes = lora_params * FP32_BYTES
    opt_states = 2 if optimizer == "adamw" else (1 if momentum > 0 else 0)
    fsdp = strategy == "fsdp"
    shard_world = world_size if fsdp else 1
    frozen = {"layer": 0, "root": 0}  # per rank (sharded under FSDP), constants included
    gathered_layer = 0  # one decoder layer's frozen parameters, all-gathered
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
        frozen[where] += count * (_shard_bytes(dims, elem, shard_world) + consts)
        if where == "layer":
            gathered_layer += shard_world * _shard_bytes(dims, elem, shard_world)
    lora_shapes = lora_param_shapes(shape, lora_r, targets, dora=lora_dora)
    lora_rank_bytes = shape.layers * sum(_shard_bytes(d, FP32_BYTES, shard_world) for d in lora_shapes)
    assert shard_world > 1 or lora_rank_bytes == lora_bytes
    components = {
        "frozen_weights": frozen["layer"] + frozen["root"],
        "lora_weights": lora_rank_bytes,
        "lora_grads": lora_rank_bytes,
        "optimizer_state": opt_states * lora_rank_bytes,
        "ddp_buckets": lora_bytes if world_size > 1 and not gradient_as_bucket_view and not fsdp else 0,
        "fsdp_gathered": 0,
    }
    fsdp_layer = None
    if fsdp:
        # An all-gathered parameter's storage is the whole padded dim 0 (world x the padded shard;
        # the parameter is a view of it), measured on 2 gloo ranks (tests/test_memory.py).
        # jobs.fsdp gathers in the compute dtype (MixedPrecisionPolicy(param_dtype=...)).
        root_full = sum(shard_world * _shard_bytes(d, a, shard_world)
                        for w, _, d in base_param_shapes(shape) if w == "root")
        layer_full = gathered_layer + sum(shard_world * _shard_bytes(d, a, shard_world) for d in lora_shapes)
        in_flight = min(2, shape.layers) if reshard_after_forward else shape.layers
        components["fsdp_gathered"] = root_full + in_flight * layer_full
        fsdp_layer = {"frozen": gathered_layer, "lora": layer_full - gathered_layer}

    # ---- activations: replay the forward ----
    def walk() -> _Walk:
        return _Walk(shape, batch=B, seq=S, act_bytes=a, autocast=autocast, targets=targets, r=lora_r,
                     lora_dropout=lora_dropout, attn=attn_implementation, mask=mask, device=device,
                     packed=packed, dora=lora_dora)

    def one_layer_saved(input_rg: bool) -> int:
        w = walk()
        w.layer(w.new(N * shape.hidden * a, input_rg))
        return w.saved_bytes

    full_layer_bytes = one_layer_saved(True)  # what a recomputed (or any non-first) layer keeps

    def shared_kept(wk: _Walk) -> set[str]:
        """Which of the tensors every layer shares (RoPE tables, position ids, packed bias) are kept."""
        shared = {"cos": wk.cos, "sin": wk.sin, "position_ids": wk.position_ids, "bias": wk.bias}
        return {k for k, t in shared.items() if t is not None and t.sid in wk.saved}

    # A layer whose input requires grad keeps the same new bytes as any other such layer once
    # the shared tensors it saves are kept: replay that layer once (the second of two) and add
    # its bytes for each such layer, instead of replaying 80 identical layers for a 70B model.
    probe = walk()
    probe.layer(probe.new(N * shape.hidden * a, True))
    probe_shared, before = shared_kept(probe), probe.saved_bytes
    probe.layer(probe.new(N * shape.hidden * a, True))
    steady_layer_bytes = probe.saved_bytes - before
    repeated = 0  # bytes of the layers counted as steady_layer_bytes, not replayed

    w = walk()
    # HF's activation_checkpointing_enable() makes the embedding output require grad.
    x = w.new(N * shape.hidden * a, gradient_checkpointing)
    checkpointed = 0
    held_mask = False
    for i in range(shape.layers):
        if gradient_checkpointing and i % checkpoint_every_n_layers == 0:
            # torch.utils.checkpoint keeps the layer's arguments: the hidden states, RoPE cos/sin,
            # position ids (and the mask, below); everything else is recomputed in backward.
            w.save(x, w.cos, w.sin, w.position_ids)
            if packed:
                w.save(w.bias)
            x = w.new(x.nbytes, True)
            checkpointed += 1
            held_mask = held_mask or mask
        elif x.rg and probe_shared <= shared_kept(w):
            repeated += steady_layer_bytes
            x = w.new(x.nbytes, True)
        else:
            x = w.layer(x)
    decoder_bytes = w.saved_bytes + repeated
    w.final_norm(x)
    # The float/bool mask HF builds once ([B, 1, S, S]) stays referenced by the checkpoint frames.
    mask_bytes = B * S * S * (a if attn_implementation == "eager" else 1) if held_mask and not packed else 0
    components["activations"] = w.saved_bytes + repeated + mask_bytes

    # ---- loss head: CausalLMLoss ----
    T = max(1, math.ceil(label_fraction * N))
    V = shape.vocab
    index_bytes = 2 * T * INDEX_BYTES  # label_pos (index_select) and label_ids (cross-entropy)
    chunk = T if not loss_chunk_tokens or T <= loss_chunk_tokens else loss_chunk_tokens
    # Forward: logits [c, V] in the compute dtype, .float() copy, log-softmax output (saved).
    # Backward: d(log-softmax) and d(logits) in fp32 while the saved output is alive: 12 bytes/elem.
    logits_peak = 3 * FP32_BYTES * chunk * V
    if chunk < T:
        # Checkpointed chunks keep only the gathered hidden states [T, H] (views of one tensor).
        loss_saved = T * shape.hidden * a + index_bytes
    else:
        loss_saved = FP32_BYTES * T * V + index_bytes
    components["logits_loss"] = logits_peak + index_bytes + (T * shape.hidden * a if chunk < T else 0)

    # ---- one decoder layer's backward ----
    # The widest moment of one layer beyond what it saves. At the MLP: [N, intermediate]
    # gradients (fp32: two of them; under autocast one in the compute dtype, plus a few
    # [N, hidden] gradients). At the norms: fp32 [N, hidden] temporaries. Checkpointing adds the
    # recomputed layer, all alive when the MLP backward (the first part of the layer's backward)
    # runs; beside it, fewer [N, hidden] gradients coexist under autocast. Measured on CPU with a
    # live-storage tracker over forward + backward (tests/test_memory.py::test_peak_*).
    H, I = shape.hidden, shape.intermediate
    mlp_point = N * (I * a + 5 * H * a) if autocast else N * I * (FP32_BYTES + a)
    norm_point = N * 5 * H * FP32_BYTES
    plain_point = max(mlp_point, norm_point) if checkpointed < shape.layers else 0
    if checkpointed:
        # The last checkpointed layer is recomputed after the (plain) layers above it were
        # freed; earlier checkpointed layers find even less alive.
        last = (shape.layers - 1) // checkpoint_every_n_layers * checkpoint_every_n_layers
        freed = (shape.layers - 1 - last) * full_layer_bytes
        recomputed_point = N * (I * a + 3 * H * a) if autocast else mlp_point
        components["layer_backward"] = max(plain_point, full_layer_bytes + recomputed_point - freed)
    else:
        components["layer_backward"] = plain_point
    # bitsandbytes de-quantizes a linear's weight to the compute dtype for its matmuls (forward
    # and the input gradient); one at a time, the largest bounds it.
    components["layer_backward"] += largest_quantized * a

    # ---- outside the allocator ----
    if device == "cuda":
        allocated = MemoryEstimate(dict(components)).peak_allocated_bytes
        components["framework_overhead"] = int(CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if world_size > 1 else 0)
                                               + ALLOCATOR_SLACK_FRACTION * allocated)
    else:
        components["framework_overhead"] = 0

    details = {
        "params": params, "lora_params": lora_params, "label_tokens": T, "logits_chunk_tokens": chunk,
        "strategy": strategy, "world_size": world_size, "quantization": quantization,
        "reshard_after_forward": reshard_after_forward if fsdp else None,
        # FSDP: one decoder layer's all-gathered parameters (frozen: packed bytes when quantized).
        "fsdp_gathered_layer_bytes": fsdp_layer,
        "frozen_layer_bytes": frozen["layer"], "frozen_root_bytes": frozen["root"],
        "mask": mask, "checkpointed_layers": checkpointed,
        "layer_saved_bytes": full_layer_bytes, "first_layer_saved_bytes": one_layer_saved(False),
        "decoder_saved_bytes": decoder_bytes, "held_mask_bytes": mask_bytes,
        "loss_saved_bytes": loss_saved,
    }
    return MemoryEstimate({k: int(v) for k, v in components.items()}, details)


# ---- from a job spec -------------------------------------------------------------------------

def config_from_spec(spec):
    """The transformers config of `spec.model`, without loading any weights.

    `tiny-llama` is built in; a directory (or hub id) is read with AutoConfig; a GGUF file
    is read from its metadata (transformers does this with the `gguf` package; no tensor is
    de-quantized). Problems raise `SpecError` naming `model.name` / `model.gguf_file`.
    """
    from transformers import AutoConfig

    from .errors import SpecError
    from .spec import resolve_model_dir

    m = spec.model
    if m.name == "tiny-llama":
        from .model import tiny_llama_config

        return tiny_llama_config(attn_implementation=m.attn_implementation)

    src = resolve_model_dir(m.name)  # `pkg:NAME` -> the package's directory
    try:
        if m.gguf_file:
            return AutoConfig.from_pretrained(src, gguf_file=m.gguf_file)
        token = os.environ.get(m.hf_token_env) if m.hf_token_env else None
        return AutoConfig.from_pretrained(src, token=token)
    except ImportError as e:
        raise SpecError(f"model.gguf_file: reading GGUF metadata needs the `gguf` package ({e})") from None
    except (OSError, ValueError) as e:
        key = "model.gguf_file" if m.gguf_file else "model.name"
        what = f"{m.name}/{m.gguf_file}" if m.gguf_file else m.name
        raise SpecError(f"{key}: cannot read the model config of {what!r} for the memory estimate: "
                        f"{str(e).splitlines()[0]}") from None


def spec_precision(spec, device: str) -> str:
    """The compute dtype of `spec` on `device`: `JobSpec.compute_precision`, the one rule."""
    return spec.compute_precision(device)


def spec_seq_len(spec, device: str) -> int:
    """The row length a spec's estimate assumes: `data.max_seq_len - 1` (the longest input), or
    with `data.packing` the packed row of `data.max_seq_len` tokens (16-aligned on GPU)."""
    if spec.data.packing:
        return _round_up(spec.data.max_seq_len, 16 if device == "cuda" else 1)
    return max(1, spec.data.max_seq_len - 1)


def estimate_for_spec(spec, *, micro_batch_size: Optional[int] = None,
                      gradient_checkpointing: Optional[bool] = None, device: str = "cuda",
                      config=None, checkpoint_every_n_layers: int = 1, strategy: Optional[str] = None,
                      reshard_after_forward: Optional[bool] = None,
                      quantization: Optional[str] = None) -> MemoryEstimate:
    """`estimate` of one configuration, everything else taken from a JobSpec.

    The sequence length is `data.max_seq_len - 1`, the longest input `jobs.data` produces
    (the last token is only a label), and every position is assumed to carry a label: an
    upper bound for ragged data. With `data.packing`, `micro_batch_size` full packed rows of
    `data.max_seq_len` tokens (rounded up to 16 on GPU, as `jobs.loop.layout_args` aligns
    them): an upper bound for packed micro-batches and for the unpacked ones packing leaves.
    `gradient_checkpointing=None` means "as planned": the checkpointing `plan_for_spec` chooses
    (without a GPU's memory: only `memory.budget_gib` counts). `strategy` and
    `reshard_after_forward` left None are the plan's for this micro-batch (the spec's when it
    fixes them); `quantization` None is `model.quantization`.
    """
    from .errors import SpecError

    if gradient_checkpointing is None:
        return plan_for_spec(spec, device=device, micro_batch_size=micro_batch_size, config=config).estimate
    config = config if config is not None else config_from_spec(spec)
    r = spec.resources
    if strategy is None and (r.strategy == "auto" or r.fsdp_reshard_after_forward is None):
        if r.strategy == "ddp":
            strategy = "ddp"
        else:
            plan = plan_for_spec(spec, device=device, micro_batch_size=micro_batch_size, config=config)
            strategy = plan.strategy
            if reshard_after_forward is None:
                reshard_after_forward = plan.reshard_after_forward
    strategy = strategy or r.strategy
    if reshard_after_forward is None:
        reshard_after_forward = r.fsdp_reshard_after_forward is not False
    try:
        return estimate(
            config,
            micro_batch_size=micro_batch_size or spec.batch.micro_batch_size,
            seq_len=spec_seq_len(spec, device),
            packed=spec.data.packing,
            gradient_checkpointing=bool(gradient_checkpointing),
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
            reshard_after_forward=bool(reshard_after_forward),
            quantization=quantization or spec.model.quantization,
        )
    except SpecError:
        raise
    except ValueError as e:  # an unsupported architecture or LoRA target: the user's spec
        raise SpecError(str(e)) from None


def checkpointing_str(every: Optional[int]) -> str:
    """0 -> off, 1 -> on, k -> "every 2nd layer" (None: not decided)."""
    if every is None:
        return "-"
    if every in (0, 1):
        return ("off", "on")[every]
    suffix = "th" if 10 <= every % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(every % 10, "th")
    return f"every {every}{suffix} layer"


# ---- the one memory plan ---------------------------------------------------------------------

def checkpointing_candidates(num_layers: int) -> list[int]:
    """Every checkpointing choice `auto` may make, in the order it tries them: off (0), then
    every k-th decoder layer from the sparsest (k = num_layers: the first layer only) down to
    every layer (1). Sparser is faster (fewer layers recomputed), so the first that fits wins."""
    return [0, *range(num_layers, 1, -1), 1]


def choose_checkpointing_every(mode: Any, gib_of: Callable[[int], float], num_layers: int,
                               budget_gib: Optional[float]) -> int:
    """The checkpointing rule, once: `mode` is `memory.gradient_checkpointing` (True, False or
    "auto"); `gib_of(k)` the estimated GiB with checkpointing every k-th layer (0 = off).

    True -> every layer; False -> off; "auto" -> off when it fits `budget_gib` (or there is no
    budget), else the first of `checkpointing_candidates` that fits, else every layer (the
    least memory there is; the plan then says it does not fit). Queue admission applies this
    same function to estimates it stored at `queue add` (it does not rebuild the spec)."""
    if mode is True or str(mode).lower() == "true":
        return 1
    if mode is False or str(mode).lower() == "false":
        return 0
    if budget_gib is None:
        return 0
    for every in checkpointing_candidates(num_layers):
        if gib_of(every) <= budget_gib:
            return every
    return 1


@dataclass(frozen=True)
class MemoryPlan:
    """What one training worker will run, and what it is estimated to need.

    Made by `plan_for_spec`, the only place these decisions are taken: the loop runs it, and
    `rayft estimate`, Tune's feasibility, queue admission and `rayft k8s render` report and
    judge it, so what is shown is what runs."""

    strategy: str                   # "ddp": every worker holds the whole base; "fsdp": FSDP2 shards it
    reshard_after_forward: Optional[bool]  # FSDP: free each layer's gathered weights after forward; None for DDP
    quantization: str               # model.quantization: "none", "nf4" or "int8"
    device: str                     # "cuda" or "cpu"
    precision: str                  # the compute dtype: "bf16", "fp16" or "fp32"
    micro_batch_size: int           # sequences per forward/backward on one worker
    grad_accum_steps: int           # micro-steps per optimizer step on one worker
    checkpoint_every_n_layers: int  # 0: no activation checkpointing; k: every k-th decoder layer
    loss_chunk_tokens: int          # 0: the loss head in one piece; n: checkpointed chunks of n tokens
    seq_len: int                    # the row length the estimate assumes (see `spec_seq_len`)
    budget_gib: Optional[float]     # judged against: memory.budget_gib, else the GPU's memory, else none
    estimate: MemoryEstimate        # per component, for exactly this plan

    @property
    def total_gib(self) -> float:
        return self.estimate.total_gib

    @property
    def fits(self) -> bool:
        return self.budget_gib is None or self.total_gib <= self.budget_gib

    @property
    def checkpointing(self) -> str:
        return checkpointing_str(self.checkpoint_every_n_layers)

    @property
    def choice(self) -> str:
        """The strategy as one word: "ddp", "fsdp" or "fsdp-keep" (`CHOICES`)."""
        return next(k for k, v in CHOICES.items() if v == (self.strategy, self.reshard_after_forward))

    @property
    def strategy_str(self) -> str:
        """"ddp", "fsdp" or "fsdp (layers kept gathered)", as people read it."""
        return strategy_str(self.strategy, self.reshard_after_forward)

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "reshard_after_forward": self.reshard_after_forward,
                "quantization": self.quantization, "device": self.device, "precision": self.precision,
                "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
                "checkpoint_every_n_layers": self.checkpoint_every_n_layers, "checkpointing": self.checkpointing,
                "loss_chunk_tokens": self.loss_chunk_tokens, "seq_len": self.seq_len,
                "budget_gib": self.budget_gib, "estimate_gib": self.total_gib, "fits": self.fits,
                "components_gib": dict(self.estimate.table())}


def strategy_str(strategy: str, reshard_after_forward: Optional[bool]) -> str:
    return "fsdp (layers kept gathered)" if strategy == "fsdp" and reshard_after_forward is False else strategy


def plan_budget_gib(spec, device: str, gpu_memory_gib: Optional[float]) -> Optional[float]:
    """The per-GPU memory a plan must fit: `memory.budget_gib`, else (on a GPU) the GPU's memory."""
    if spec.memory.budget_gib is not None:
        return float(spec.memory.budget_gib)
    return float(gpu_memory_gib) if device == "cuda" and gpu_memory_gib is not None else None


# A strategy choice as one string, so that a table of estimates by choice is plain JSON (queue
# admission stores one): "ddp", "fsdp" (reshard after forward) or "fsdp-keep" (layers stay gathered).
CHOICE_DDP, CHOICE_FSDP, CHOICE_FSDP_KEEP = "ddp", "fsdp", "fsdp-keep"
CHOICES = {CHOICE_DDP: ("ddp", None), CHOICE_FSDP: ("fsdp", True), CHOICE_FSDP_KEEP: ("fsdp", False)}


def strategy_choices(strategy: str, reshard_after_forward: Optional[bool], num_workers: int,
                     quantization: str = "none") -> list[str]:
    """The choices `resources.strategy` / `resources.fsdp_reshard_after_forward` leave, in the
    order the plan tries them: DDP first (nothing to gather: fastest), then FSDP keeping the
    layers gathered from forward to backward (no second all-gather), then FSDP resharding after
    forward (least memory). One worker has nothing to shard over: DDP only. An nf4 base (QLoRA)
    is sharded like any other when DDP does not fit: FSDP2 shards its packed 4-bit weights
    (tests/test_qlora.py trains it). An int8 base is not chosen for FSDP by `auto`: bitsandbytes'
    `Int8Params` lose their row scales and int8 codes under `fully_shard` (measured with
    bitsandbytes 0.50: the first forward fails with "'Parameter' object has no attribute 'CB'")."""
    if strategy == "ddp" or (strategy == "auto" and (num_workers < 2 or quantization == "int8")):
        return [CHOICE_DDP]
    fsdp = {None: [CHOICE_FSDP_KEEP, CHOICE_FSDP], True: [CHOICE_FSDP], False: [CHOICE_FSDP_KEEP]}[reshard_after_forward]
    return fsdp if strategy == "fsdp" else [CHOICE_DDP, *fsdp]


def choose_plan(choices: Sequence[str], mode: Any, gib_of: Callable[[str, int], float], num_layers: int,
                budget_gib: Optional[float]) -> tuple[str, int]:
    """The strategy and checkpointing rule, once: (choice, checkpoint every k-th layer).

    `gib_of(choice, k)` is the estimated GiB per GPU. Each choice in order gets its checkpointing
    from `choose_checkpointing_every`; the first whose estimate then fits `budget_gib` (or any,
    without a budget) wins; when none fits, the last (the least memory; the plan then says it does
    not fit). So `auto` runs DDP when DDP fits, else FSDP, keeping layers gathered only when that
    fits too. Queue admission applies this same function to the estimates it stored at `queue add`."""
    for choice in choices:
        every = choose_checkpointing_every(mode, lambda k: gib_of(choice, k), num_layers, budget_gib)
        if budget_gib is None or gib_of(choice, every) <= budget_gib:
            return choice, every
    return choice, every


def plan_for_spec(spec, *, device: str = "cuda", gpu_memory_gib: Optional[float] = None,
                  micro_batch_size: Optional[int] = None, config=None) -> MemoryPlan:
    """The plan one worker of `spec` runs on `device` (a GPU of `gpu_memory_gib` GiB, when known).

    The strategy (and FSDP's resharding) and checkpointing follow `choose_plan` under
    `plan_budget_gib`; the micro-batch is the spec's (or `micro_batch_size`, for a search point);
    the loss chunk is `memory.loss_chunk_tokens`; the quantization `model.quantization`. Raises
    `SpecError` for a model or LoRA target the estimate cannot read.
    """
    config = config if config is not None else config_from_spec(spec)
    micro = micro_batch_size or spec.batch.micro_batch_size
    r = spec.resources
    per_worker = spec.batch.global_batch_size // r.num_workers
    budget = plan_budget_gib(spec, device, gpu_memory_gib)
    cache: dict[tuple[str, int], MemoryEstimate] = {}

    def est(choice: str, every: int) -> MemoryEstimate:
        if (choice, every) not in cache:
            strategy, reshard = CHOICES[choice]
            cache[choice, every] = estimate_for_spec(
                spec, micro_batch_size=micro, gradient_checkpointing=every > 0, device=device, config=config,
                checkpoint_every_n_layers=max(1, every), strategy=strategy, reshard_after_forward=reshard is not False)
        return cache[choice, every]

    choice, every = choose_plan(strategy_choices(r.strategy, r.fsdp_reshard_after_forward, r.num_workers,
                                                 spec.model.quantization),
                                spec.memory.gradient_checkpointing, lambda c, k: est(c, k).total_gib,
                                model_shape(config).layers, budget)
    strategy, reshard = CHOICES[choice]
    return MemoryPlan(strategy=strategy, reshard_after_forward=reshard, quantization=spec.model.quantization,
                      device=device, precision=spec_precision(spec, device),
                      micro_batch_size=micro, grad_accum_steps=max(1, per_worker // micro),
                      checkpoint_every_n_layers=every, loss_chunk_tokens=int(spec.memory.loss_chunk_tokens or 0),
                      seq_len=spec_seq_len(spec, device), budget_gib=budget, estimate=est(choice, every))


def plan_table(spec, *, device: str = "cuda", config=None) -> dict:
    """Everything `choose_plan` needs to decide later, for any per-GPU budget, without the spec:
    {"choices": the ordered strategy choices, "gib": {choice: {k: estimated GiB with checkpointing
    every k-th layer (0 = off)}}}. Queue admission stores it at `queue add` and applies
    `choose_plan_from_table` per GPU size, getting what `plan_for_spec` gets on that GPU."""
    config = config if config is not None else config_from_spec(spec)
    r = spec.resources
    choices = strategy_choices(r.strategy, r.fsdp_reshard_after_forward, r.num_workers, spec.model.quantization)
    gib = {}
    for choice in choices:
        strategy, reshard = CHOICES[choice]
        gib[choice] = {k: estimate_for_spec(spec, gradient_checkpointing=k > 0, device=device, config=config,
                                            checkpoint_every_n_layers=max(1, k), strategy=strategy,
                                            reshard_after_forward=reshard is not False).total_gib
                       for k in checkpointing_candidates(model_shape(config).layers)}
    return {"choices": choices, "gib": gib}


def choose_plan_from_table(table: dict, mode: Any, num_layers: int,
                           budget_gib: Optional[float]) -> tuple[str, int, float]:
    """`choose_plan` over a stored `plan_table` (keys may have come back from JSON as strings):
    (choice, checkpoint every k-th layer, its estimated GiB)."""
    gib = {c: {int(k): float(v) for k, v in row.items()} for c, row in table["gib"].items()}
    choice, every = choose_plan(table["choices"], mode, lambda c, k: gib[c][k], num_layers, budget_gib)
    return choice, every, gib[choice][every]


def strategy_table(spec, *, device: str = "cuda", config=None) -> list[dict]:
    """DDP and FSDP side by side (and, for a quantized spec, unquantized beside quantized): one
    row per (quantization, strategy) with the checkpointing and FSDP resharding the plan's rule
    would give that strategy under the spec's budget, its estimate, whether it fits, and which
    row the plan chose. FSDP rows need >= 2 workers and a base `auto` may shard (not int8:
    `strategy_choices`)."""
    config = config if config is not None else config_from_spec(spec)
    r = spec.resources
    plan = plan_for_spec(spec, device=device, config=config)
    budget = plan.budget_gib
    layers = model_shape(config).layers
    quants = ["none"] + ([spec.model.quantization] if spec.model.quantization != "none" else [])
    rows = []
    for quant in quants:
        for strategy in STRATEGIES:
            if strategy == "fsdp" and (r.num_workers < 2 or quant == "int8"):
                continue
            reshard = r.fsdp_reshard_after_forward if r.strategy != "ddp" else None
            choices = strategy_choices(strategy, reshard, r.num_workers)
            cache: dict[tuple[str, int], MemoryEstimate] = {}

            def est(choice: str, every: int) -> MemoryEstimate:
                if (choice, every) not in cache:
                    st, rs = CHOICES[choice]
                    cache[choice, every] = estimate_for_spec(
                        spec, gradient_checkpointing=every > 0, device=device, config=config,
                        checkpoint_every_n_layers=max(1, every), strategy=st,
                        reshard_after_forward=rs is not False, quantization=quant)
                return cache[choice, every]

            choice, every = choose_plan(choices, spec.memory.gradient_checkpointing,
                                        lambda c, k: est(c, k).total_gib, layers, budget)
            e = est(choice, every)
            st, rs = CHOICES[choice]
            rows.append({"strategy": st, "reshard_after_forward": rs, "quantization": quant,
                         "num_workers": r.num_workers, "checkpoint_every_n_layers": every,
                         "checkpointing": checkpointing_str(every), "components": dict(e.components),
                         "total_bytes": e.total_bytes, "total_gib": e.total_gib,
                         "fits": None if budget is None else e.total_gib <= budget,
                         "chosen": (st, rs, quant, every) == (plan.strategy, plan.reshard_after_forward,
                                                              plan.quantization, plan.checkpoint_every_n_layers)})
    return rows


def feasible_pairs(spec, budget_gib: Optional[float] = None, *, device: Optional[str] = None) -> list[dict]:
    """Every (micro_batch_size, grad_accum_steps) that splits the global batch, checkpointing off and on.

    A pair needs micro_batch_size x grad_accum_steps x num_workers == global_batch_size.
    Rows are sorted by micro-batch, then checkpointing off before on; `fits` is
    estimate <= budget (always True without a budget).
    """
    device = device or spec.planned_device
    budget = budget_gib if budget_gib is not None else spec.memory.budget_gib
    per_worker, rem = divmod(spec.batch.global_batch_size, spec.resources.num_workers)
    if rem:
        raise ValueError(f"batch.global_batch_size={spec.batch.global_batch_size} is not divisible by "
                         f"resources.num_workers={spec.resources.num_workers}")
    config = config_from_spec(spec)
    rows = []
    for mb in (d for d in range(1, per_worker + 1) if per_worker % d == 0):
        for gc in (False, True):
            est = estimate_for_spec(spec, micro_batch_size=mb, gradient_checkpointing=gc, device=device,
                                    config=config)
            rows.append({"micro_batch_size": mb, "grad_accum_steps": per_worker // mb,
                         "gradient_checkpointing": gc, "estimate_gib": est.total_gib,
                         "fits": budget is None or est.total_gib <= budget})
    return rows


def smallest_budget_gib(spec, *, device: Optional[str] = None) -> float:
    """The least memory the job can run in: micro-batch 1 with checkpointing."""
    return estimate_for_spec(spec, micro_batch_size=1, gradient_checkpointing=True,
                             device=device or spec.planned_device).total_gib
