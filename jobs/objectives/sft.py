"""SFT: the summed next-token loss over the label tokens, a mean over the label tokens of the
global batch (`jobs.train.loop` module doc). `CausalLMLoss` is its loss module (moved here verbatim from
`jobs.train.loop`, which re-exports it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

from jobs.data import Concatenated, TokenizedSplit, collate_at, count_labels
from jobs.objectives.base import DatasetObjective
from jobs.spec import JobSpec, SFTObjective


@dataclass(frozen=True)
class SFT(DatasetObjective):
    """Next-token loss on the labelled tokens; `batch.*` counts sequences."""

    specs: ClassVar[tuple[type[BaseModel], ...]] = (SFTObjective,)
    name: str = "sft"

    @classmethod
    def from_section(cls, section) -> SFT:
        return cls()

    def loss_module(self, model: nn.Module, chunk_tokens: int, compiled_head: bool) -> nn.Module:
        return CausalLMLoss(model, chunk_tokens=chunk_tokens, compiled_head=compiled_head)

    def batch(
        self, spec, job, split: str, indices: Sequence[int] | np.ndarray, device: torch.device, pin: bool
    ) -> dict:
        # An SFT run's samples are Examples (`Dataset.kind`).
        examples = cast(TokenizedSplit | Concatenated, job.data.train if split == "train" else job.data.eval)
        return collate_at(examples, indices, job.tokenizer.pad_token_id, pin_memory=pin, **layout_args(spec, device))

    def count(self, samples, indices: Sequence[int] | np.ndarray) -> int:
        return count_labels(samples, indices)

    def plot_labels(self, spec: JobSpec) -> dict[str, str]:
        return {"title": f"{spec.name}: {spec.batch.global_batch_size} seq/step, accum {spec.grad_accum_steps}"}


def layout_args(spec: JobSpec, device: torch.device) -> dict:
    """`collate`'s layout arguments: with `data.packing`, rows of up to `data.max_seq_len`
    tokens, aligned to 16 on GPU."""
    return {
        "pack_tokens": spec.data.max_seq_len if spec.data.packing else 0,
        "row_multiple": 16 if device.type == "cuda" else 1,
    }


class CausalLMLoss(nn.Module):
    """Summed next-token cross-entropy over the label positions only.

    The decoder runs once; only hidden states that carry a label (`label_pos`, computed on
    the host by `collate`) go through the LM head, so prompt and padding positions never
    produce logits. With `chunk_tokens`, the head + loss run per chunk under checkpointing,
    so the fp32 [T, vocab] logits never exist at once (they dominate memory at 128k vocab).
    With `compiled_head` (compiled decoder layers, `model.compile`), the head and the loss run
    as one compiled graph (`compiled_head_loss`): the logits stay in the compute dtype and the
    log-softmax is fused into one pass over them, so neither fp32 copy of the logits exists.
    """

    model: Any  # a transformers causal LM, or a peft PeftModel around one (peft ships no types)

    def __init__(self, model: nn.Module, chunk_tokens: int = 0, compiled_head: bool = False):
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.head_loss = compiled_head_loss() if compiled_head else _head_loss

    def _causal_lm(self):
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def forward(self, input_ids, label_pos, label_ids, attention_mask=None, position_ids=None, seq_ids=None):
        lm = self._causal_lm()
        if seq_ids is not None:  # packed rows (`jobs.data.collate`)
            if lm.config._attn_implementation == "flex_attention":
                attention_mask = packed_block_mask(seq_ids)
            else:
                attention_mask = packed_attention_mask(seq_ids, lm.get_input_embeddings().weight.dtype)
        # `base_model` is the decoder stack under any HF causal LM (`model`, `gpt_neox`, ...).
        hidden = lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        h = hidden.flatten(0, 1).index_select(0, label_pos)
        head = lm.get_output_embeddings()
        if not self.chunk_tokens or h.shape[0] <= self.chunk_tokens:
            return self.head_loss(head, h, label_ids)
        total = h.new_zeros((), dtype=torch.float32)
        for start in range(0, h.shape[0], self.chunk_tokens):
            sl = slice(start, start + self.chunk_tokens)
            total = total + torch.utils.checkpoint.checkpoint(
                self.head_loss, head, h[sl], label_ids[sl], use_reentrant=False
            )
        return total


def packed_attention_mask(seq_ids: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """The block-diagonal causal mask of packed rows, as the additive float bias SDPA and eager
    attention take ([rows, 1, T, T]: 0 where query i may see key j -- same sequence slot,
    j <= i -- the dtype's minimum elsewhere; padding is a slot of its own, so every query sees
    at least itself and no softmax row is empty).

    Built on the device from `seq_ids` (no host sync), once per micro-batch, in the dtype the
    attention runs in: SDPA then uses this one tensor in every layer (a bool mask would be
    converted to a new float bias per layer, each saved for backward)."""
    device = seq_ids.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight_dtype
    T = seq_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
    allowed = (seq_ids[:, :, None] == seq_ids[:, None, :]) & causal
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias.unsqueeze(1)


def packed_block_mask(seq_ids: torch.Tensor):
    """The same block-diagonal causal mask as `packed_attention_mask`, as FlexAttention's
    `BlockMask` (`model.attn_implementation: flex_attention`): query i may see key j when both
    are in the same sequence slot and j <= i. Block-sparse (128 x 128 tiles; the tiles no query
    may see are skipped), a few KiB per row instead of the [rows, 1, T, T] bias; transformers
    passes a 4-D `BlockMask` to every layer as is. Built on the device, once per micro-batch."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_sequence_causal(b, h, q, kv):
        return (seq_ids[b, q] == seq_ids[b, kv]) & (kv <= q)

    rows, T = seq_ids.shape
    return create_block_mask(same_sequence_causal, rows, None, T, T, device=seq_ids.device)


def _head_loss(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), y, reduction="sum")


_COMPILED_HEAD_LOSS: list[Callable] = []


def compiled_head_loss() -> Callable:
    """`_head_loss` through torch.compile, made once per process. The label count changes from
    micro-batch to micro-batch, so after the first other count dynamo recompiles it once with a
    dynamic token dimension (its default, `dynamic=None`) and reuses that graph from then on."""
    if not _COMPILED_HEAD_LOSS:
        _COMPILED_HEAD_LOSS.append(torch.compile(_head_loss))
    return _COMPILED_HEAD_LOSS[0]
