"""The model side of the preference objectives: per-sequence log-probabilities from one forward
over a micro-batch of pairs, the reference forward without a second model, and the loss module
the loop runs (`PreferenceLoss`).

A micro-batch of m pairs is 2m rows (`jobs.data` collates them): rows 0..m-1 are the pairs'
prompt + chosen response, rows m..2m-1 their prompt + rejected response, so chosen and rejected
go through *one* forward (and one backward), as TRL's `concatenated_forward` does. Only the
response tokens carry labels; a row's log-probability is the sum over its labels of
log p(token | everything before it).

The reference (DPO, IPO), in order of preference:

* precomputed: the values stored beside the data cache (`ref_logps` in the batch); no forward;
* the frozen starting adapter (`model.adapter`), held as a second LoRA adapter named
  `REFERENCE_ADAPTER`, made active for the reference forward;
* the base alone: PEFT's `disable_adapter()`.

The reference forward runs under `no_grad` (nothing is saved for backward) and in eval mode
(no dropout, so it is deterministic and equal to the precomputed values), before the policy
forward, whose activations then have the memory to themselves.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .objectives import Objective, pair_losses, summed_stats

REFERENCE_ADAPTER = "reference"


def _token_logps(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -F.cross_entropy(head(h).float(), y, reduction="none")


@contextlib.contextmanager
def active_adapter(model: nn.Module, name: str):
    """Make adapter `name` the active one of every PEFT tuner layer for the duration, without
    touching `requires_grad` (PEFT's `set_adapter` also marks the active adapter trainable, which
    would unfreeze the reference and, under DDP, change what the reducer expects)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._active_adapter for m in layers]
    try:
        for m in layers:
            m._active_adapter = [name]
        yield
    finally:
        for m, prev in zip(layers, before):
            m._active_adapter = prev


class PreferenceLoss(nn.Module):
    """Summed per-pair loss of one micro-batch of pairs, and the per-pair statistics summed
    (`jobs.objectives.summed_stats`): `forward(...) -> (loss_sum, stats_sum)`.

    With `chunk_tokens`, the LM head runs per chunk of label tokens under checkpointing, as in
    the SFT loss, so the fp32 [tokens, vocab] logits never exist at once."""

    def __init__(self, model: nn.Module, objective: Objective, chunk_tokens: int = 0,
                 reference_adapter: Optional[str] = None):
        super().__init__()
        self.model = model
        self.objective = objective
        self.chunk_tokens = chunk_tokens
        self.reference_adapter = reference_adapter

    def _causal_lm(self):
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def sequence_logps(self, input_ids: torch.Tensor, label_pos: torch.Tensor,
                       label_ids: torch.Tensor) -> torch.Tensor:
        """[rows] summed log-probabilities of each row's label tokens (fp32)."""
        lm = self._causal_lm()
        hidden = lm.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        h = hidden.flatten(0, 1).index_select(0, label_pos)
        head = lm.get_output_embeddings()
        if not self.chunk_tokens or h.shape[0] <= self.chunk_tokens:
            token = _token_logps(head, h, label_ids)
        else:
            token = torch.cat([torch.utils.checkpoint.checkpoint(
                _token_logps, head, h[s:s + self.chunk_tokens], label_ids[s:s + self.chunk_tokens],
                use_reentrant=False) for s in range(0, h.shape[0], self.chunk_tokens)])
        rows = torch.div(label_pos, input_ids.shape[1], rounding_mode="floor")
        return token.new_zeros(input_ids.shape[0]).index_add(0, rows, token)

    def reference_context(self):
        if self.reference_adapter:
            return active_adapter(self.model, self.reference_adapter)
        return self.model.disable_adapter()

    @torch.no_grad()
    def reference_logps(self, input_ids: torch.Tensor, label_pos: torch.Tensor,
                        label_ids: torch.Tensor) -> torch.Tensor:
        """The reference's [rows] log-probabilities: eval mode, no grad, the adapter off (or the
        frozen starting adapter active)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with self.reference_context():
                return self.sequence_logps(input_ids, label_pos, label_ids)
        finally:
            self.model.train(was_training)

    def forward(self, input_ids: torch.Tensor, label_pos: torch.Tensor, label_ids: torch.Tensor,
                resp_len: torch.Tensor, ref_logps: Optional[torch.Tensor] = None):
        ref = ref_logps
        if ref is None and self.objective.needs_reference:
            ref = self.reference_logps(input_ids, label_pos, label_ids)
        pi = self.sequence_logps(input_ids, label_pos, label_ids)
        m = input_ids.shape[0] // 2
        n = resp_len.to(pi.dtype)
        loss, stats = pair_losses(self.objective, pi[:m], pi[m:], n[:m], n[m:],
                                  None if ref is None else ref[:m], None if ref is None else ref[m:])
        return loss.sum(), summed_stats(self.objective, stats)
