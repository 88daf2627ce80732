"""The shape algebra of a decoder-only transformer: which parameters it has and how many bytes
each takes, frozen, LoRA, quantized by bitsandbytes or sharded by FSDP2.

Pure arithmetic on a `ModelShape` (read from a transformers config object already in memory):
no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

GIB = 1024**3
MIB = 1024**2

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32_BYTES = 4
INDEX_BYTES = 8  # int64 label positions / label ids

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

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


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
    sliding_window: int | None = None
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
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


def model_shape(config) -> ModelShape:
    """Read a transformers config (LlamaConfig, MistralConfig, Qwen2Config, GPTNeoXConfig)."""
    mt = getattr(config, "model_type", None)
    h = config.hidden_size
    heads = config.num_attention_heads
    common = dict(
        hidden=h,
        layers=config.num_hidden_layers,
        heads=heads,
        vocab=config.vocab_size,
        intermediate=config.intermediate_size,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
    )
    if mt in LLAMA_FAMILY:
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        window = None
        if mt == "mistral" or (mt == "qwen2" and getattr(config, "use_sliding_window", False)):
            window = getattr(config, "sliding_window", None)
        bias = bool(getattr(config, "attention_bias", False))
        return ModelShape(
            family="llama",
            kv_heads=kv,
            head_dim=head_dim,
            qkv_bias=bias or mt == "qwen2",
            o_bias=bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_window=window,
            **common,
        )
    if mt == "gpt_neox":
        head_dim = h // heads
        pct = getattr(config, "rotary_pct", None)
        if pct is None:
            pct = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        return ModelShape(
            family="gpt_neox",
            kv_heads=heads,
            head_dim=head_dim,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            rotary_dims=int(head_dim * pct),
            parallel_residual=bool(getattr(config, "use_parallel_residual", True)),
            **common,
        )
    raise ValueError(f"memory estimate: unsupported model_type {mt!r} (supported: {', '.join(LLAMA_FAMILY)}, gpt_neox)")


def lora_targets(shape: ModelShape, target_modules: Iterable[str]) -> set[str]:
    """The LoRA target modules as a set; a name that is no linear of a decoder layer is an error."""
    targets = set(target_modules)
    unknown = targets - set(shape.linear_shapes())
    if unknown:
        raise ValueError(
            f"memory estimate: lora target modules {sorted(unknown)} are not linear layers of a "
            f"{shape.family} decoder layer (known: {sorted(shape.linear_shapes())})"
        )
    return targets


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
    return {
        "embeddings": embed,
        "layers": per_layer * L,
        "final_norm": final_norm,
        "lm_head": 0 if shape.tied_embeddings else embed,
    }


def count_lora_params(shape: ModelShape, r: int, target_modules: Iterable[str], dora: bool = False) -> int:
    """r x (in + out) per adapted linear per layer (A is r x in, B is out x r); DoRA adds a
    magnitude vector of `out` per adapted linear."""
    linears = shape.linear_shapes()
    targets = lora_targets(shape, target_modules)
    return shape.layers * sum(r * (linears[t][0] + linears[t][1]) + (linears[t][1] if dora else 0) for t in targets)


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


def fsdp_unit_shapes(shape: ModelShape) -> dict[str, list[tuple[int, ...]]]:
    """The frozen parameters of the FSDP units beside the decoder layers, as `jobs.train.fsdp.units`
    makes them: "embeddings" (the input embeddings) and "head" (the final norm's parameters and
    the LM head). Tied embeddings are one weight for both ends, so one unit: "embeddings" is
    empty and "head" holds the shared embedding and the final norm."""
    root = [dims for where, _, dims in base_param_shapes(shape) if where == "root"]
    if shape.tied_embeddings:
        return {"embeddings": [], "head": root}
    return {"embeddings": root[:1], "head": root[1:]}


def lora_param_shapes(
    shape: ModelShape, r: int, target_modules: Iterable[str], dora: bool = False
) -> list[tuple[int, ...]]:
    """One decoder layer's LoRA parameters: A [r, in] and B [out, r] per adapted linear (+ DoRA's
    magnitude [out])."""
    linears = shape.linear_shapes()
    out: list[tuple[int, ...]] = []
    for t in sorted(lora_targets(shape, target_modules)):
        fan_in, fan_out = linears[t]
        out += [(r, fan_in), (fan_out, r)] + ([(fan_out,)] if dora else [])
    return out


def quantized_bytes(numel: int, rows: int, quantization: str) -> tuple[tuple[int, ...], int, int]:
    """A quantized linear weight of `numel` elements and `rows` output rows, as bitsandbytes
    stores it: (the parameter's shape, bytes per element, bytes of its constants). The constants
    live beside the parameter (`quant_state` / `SCB`), so FSDP does not shard them."""
    if quantization == "nf4":
        blocks = -(-numel // NF4_BLOCK)
        consts = (
            blocks  # uint8 absmax per 64 weights
            + -(-blocks // NF4_CONST_BLOCK) * FP32_BYTES  # fp32 absmax per 256 constants
            + FP32_BYTES  # offset (the constants' mean)
            + NF4_CODE_BYTES
            + NF4_CONST_CODE_BYTES
        )
        return (-(-numel // 2), 1), 1, consts  # Params4bit: [ceil(n/2), 1] uint8
    if quantization == "int8":
        return (rows, numel // rows), 1, rows * FP32_BYTES
    raise ValueError(f"memory estimate: quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def shard_bytes(dims: tuple[int, ...], elem_bytes: int, world: int) -> int:
    """Bytes one rank holds of a parameter FSDP2 shards over `world` ranks: dim 0 padded to a
    multiple of `world` (`FSDPParam`'s padded sharded size), the rest whole. `world=1`: all of it."""
    return -(-dims[0] // world) * math.prod(dims[1:]) * elem_bytes


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
