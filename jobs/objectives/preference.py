"""The preference objectives (DPO, IPO, SimPO, ORPO) as the loop runs them (`PairObjective`), and
their model side: per-sequence log-probabilities from one forward over a micro-batch of pairs, the
reference forward without a second model, and the loss module (`PreferenceLoss`). The per-pair
losses themselves are `jobs.objectives.pair_losses`.

A micro-batch of m pairs is 2m rows (`jobs.data` collates them): rows 0..m-1 are the pairs'
prompt + chosen response, rows m..2m-1 their prompt + rejected response, so chosen and rejected
go through *one* forward (and one backward), as TRL's `concatenated_forward` does. Only the
response tokens carry labels; a row's log-probability is the sum over its labels of
log p(token | everything before it).

The reference (DPO, IPO), in order of preference:

* precomputed: the values stored beside the data cache (`ref_logps` in the batch, `reference.py`); no forward;
* the frozen starting adapter (`model.adapter`), held as a second LoRA adapter named
  `REFERENCE_ADAPTER`, made active for the reference forward;
* the base alone: every adapter off (`adapters_off`; not PEFT's `disable_adapter()`, which
  changes `requires_grad`, see there).

The reference forward runs under `no_grad` (nothing is saved for backward) and in eval mode
(no dropout, so it is deterministic and equal to the precomputed values), before the policy
forward, whose activations then have the memory to themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

from jobs.data import Concatenated, TokenizedPairs, collate_pairs_at
from jobs.objectives.base import DatasetObjective
from jobs.objectives.pair_losses import ORPO_STATS, STATS, pair_losses, summed_stats
from jobs.objectives.reference import precomputed_reference
from jobs.spec import OBJECTIVE_BY_NAME, DPOObjective, IPOObjective, JobSpec, ORPOObjective, SimPOObjective

REFERENCE_ADAPTER = "reference"


@dataclass(frozen=True)
class PairObjective(DatasetObjective):
    """A preference objective on `{prompt, chosen, rejected}` pairs: `batch.*` counts pairs, and the
    step's loss is the mean over the pairs of the global batch of the per-pair loss, with TRL's
    statistics. Its settings are its spec class's, resolved (None where it does not take one)."""

    specs: ClassVar[tuple[type[BaseModel], ...]] = (DPOObjective, IPOObjective, SimPOObjective, ORPOObjective)
    name: str
    beta: float | None = None
    simpo_gamma: float | None = None
    label_smoothing: float | None = None
    reference: str | None = None  # "adapter_off" | "precomputed" where the objective has a reference
    rpo_alpha: float | None = None  # DPO: the weight of the chosen NLL (0: plain DPO)

    @classmethod
    def from_section(cls, section) -> PairObjective:
        return cls(**section.model_dump())

    @property
    def needs_reference(self) -> bool:
        """Its spec class takes `objective.reference`: the loss compares against a reference."""
        return "reference" in OBJECTIVE_BY_NAME[self.name].model_fields

    @property
    def with_nll(self) -> bool:
        """DPO with an NLL term on the chosen response (RPO)."""
        return bool(self.rpo_alpha)

    @property
    def stat_names(self) -> tuple[str, ...]:
        if self.name == "orpo":
            return STATS + ORPO_STATS
        return STATS + (("nll_loss",) if self.with_nll else ())

    @property
    def unit(self) -> str:
        return f" {self.name.upper()} pairs"

    def loss_module(self, model: nn.Module, chunk_tokens: int, compiled_head: bool) -> nn.Module:
        """The summed pair loss with its statistics; the reference is the frozen starting adapter
        when `model.adapter` loaded one, else the base with the adapter off. The head stays eager."""
        reference = REFERENCE_ADAPTER if REFERENCE_ADAPTER in getattr(model, "peft_config", {}) else None
        return PreferenceLoss(model, self, chunk_tokens, reference)

    def batch(
        self, spec, job, split: str, indices: Sequence[int] | np.ndarray, device: torch.device, pin: bool
    ) -> dict:
        return pair_batch(job, split, indices)

    def count(self, samples, indices: Sequence[int] | np.ndarray) -> int:
        return len(indices)

    def plot_labels(self, spec: JobSpec) -> dict[str, str]:
        return {
            "title": f"{spec.name}: {spec.batch.global_batch_size} pairs/step, accum {spec.grad_accum_steps}",
            "ylabel": f"{self.name} loss (mean per pair)",
            "train_label": "train loss (mean over pairs)",
        }

    def prepare(self, spec: JobSpec, ctx, job, engine) -> None:
        if self.reference == "precomputed":  # once per (base, data, template); reused after
            job.reference = precomputed_reference(spec, ctx, job, engine, pair_batch)


def pair_batch(job, split: str, indices: Sequence[int] | np.ndarray) -> dict:
    """`collate_pairs_at` of the pairs `indices` of `split`, with their precomputed reference
    log-probabilities (chosen rows, then rejected rows) when the run has them."""
    # A preference run's samples are Pairs (`Dataset.kind`).
    pairs = cast(TokenizedPairs | Concatenated, job.data.train if split == "train" else job.data.eval)
    pin = job.device is not None and job.device.type == "cuda"
    batch = collate_pairs_at(pairs, indices, job.tokenizer.pad_token_id, pin_memory=pin)
    if job.reference is not None:
        ref = job.reference[split][np.asarray(indices, dtype=np.int64)]
        batch["ref_logps"] = torch.from_numpy(np.concatenate([ref[:, 0], ref[:, 1]]))
    return batch


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
        for m, prev in zip(layers, before, strict=True):
            m._active_adapter = prev


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base alone for the duration: every PEFT tuner layer's adapters off. Invariant: no
    parameter's `requires_grad` changes, on entry or exit.

    Not PEFT's `disable_adapter()`: it freezes the adapter parameters it finds on entry and marks
    trainable those it finds on exit. Under FSDP2 with `reshard_after_forward=False` these are
    different tensors (the shards on entry, the gathered copies the forward left on exit), so the
    shards -- what the optimizer steps and the saver selects -- stayed frozen, and the run saved
    an empty adapter (issue 49). Only the layers' switch is flipped here, as `active_adapter` does."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield
    finally:
        for m, prev in zip(layers, before, strict=True):
            m._disable_adapters = prev


class PreferenceLoss(nn.Module):
    """Summed per-pair loss of one micro-batch of pairs, and the per-pair statistics summed
    (`jobs.objectives.pair_losses.summed_stats`): `forward(...) -> (loss_sum, stats_sum)`.

    With `chunk_tokens`, the LM head runs per chunk of label tokens under checkpointing, as in
    the SFT loss, so the fp32 [tokens, vocab] logits never exist at once."""

    model: Any  # a peft PeftModel (peft ships no types)

    def __init__(
        self, model: nn.Module, objective: PairObjective, chunk_tokens: int = 0, reference_adapter: str | None = None
    ):
        super().__init__()
        self.model = model
        self.objective = objective
        self.chunk_tokens = chunk_tokens
        self.reference_adapter = reference_adapter

    def _causal_lm(self):
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def sequence_logps(self, input_ids: torch.Tensor, label_pos: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
        """[rows] summed log-probabilities of each row's label tokens, summed in float64: DPO and
        IPO take differences of such sums (hundreds of nats), whose fp32 rounding would otherwise
        show in the per-pair weights of the gradient."""
        lm = self._causal_lm()
        hidden = lm.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
        h = hidden.flatten(0, 1).index_select(0, label_pos)
        head = lm.get_output_embeddings()
        if not self.chunk_tokens or h.shape[0] <= self.chunk_tokens:
            token = _token_logps(head, h, label_ids)
        else:
            token = torch.cat(
                [
                    torch.utils.checkpoint.checkpoint(
                        _token_logps,
                        head,
                        h[s : s + self.chunk_tokens],
                        label_ids[s : s + self.chunk_tokens],
                        use_reentrant=False,
                    )
                    for s in range(0, h.shape[0], self.chunk_tokens)
                ]
            )
        rows = torch.div(label_pos, input_ids.shape[1], rounding_mode="floor")
        return token.new_zeros(input_ids.shape[0], dtype=torch.float64).index_add(0, rows, token.double())

    def reference_context(self):
        if self.reference_adapter:
            return active_adapter(self.model, self.reference_adapter)
        return adapters_off(self.model)

    @torch.no_grad()
    def reference_logps(
        self, input_ids: torch.Tensor, label_pos: torch.Tensor, label_ids: torch.Tensor
    ) -> torch.Tensor:
        """The reference's [rows] log-probabilities: eval mode, no grad, the adapter off (or the
        frozen starting adapter active)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with self.reference_context():
                return self.sequence_logps(input_ids, label_pos, label_ids)
        finally:
            self.model.train(was_training)

    def forward(
        self,
        input_ids: torch.Tensor,
        label_pos: torch.Tensor,
        label_ids: torch.Tensor,
        resp_len: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
        reference_only: bool = False,
    ):
        """(summed pair loss, summed statistics); with `reference_only`, the reference's [rows]
        log-probabilities alone (the precompute pass: through `forward`, so DDP and FSDP hooks run)."""
        if reference_only:
            return self.reference_logps(input_ids, label_pos, label_ids)
        ref = ref_logps
        if ref is None and self.objective.needs_reference:
            ref = self.reference_logps(input_ids, label_pos, label_ids)
        pi = self.sequence_logps(input_ids, label_pos, label_ids)
        m = input_ids.shape[0] // 2
        n = resp_len.to(pi.dtype)
        loss, stats = pair_losses(
            self.objective,
            pi[:m],
            pi[m:],
            n[:m],
            n[m:],
            None if ref is None else ref[:m],
            None if ref is None else ref[m:],
        )
        return loss.sum(), summed_stats(self.objective, stats)
