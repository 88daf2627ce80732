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
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .objectives import Objective, pair_losses, summed_stats

log = logging.getLogger("rayft")

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
        for m, prev in zip(layers, before, strict=True):
            m._active_adapter = prev


class PreferenceLoss(nn.Module):
    """Summed per-pair loss of one micro-batch of pairs, and the per-pair statistics summed
    (`jobs.objectives.summed_stats`): `forward(...) -> (loss_sum, stats_sum)`.

    With `chunk_tokens`, the LM head runs per chunk of label tokens under checkpointing, as in
    the SFT loss, so the fp32 [tokens, vocab] logits never exist at once."""

    model: Any  # a peft PeftModel (peft ships no types)

    def __init__(
        self, model: nn.Module, objective: Objective, chunk_tokens: int = 0, reference_adapter: str | None = None
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
        return self.model.disable_adapter()

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


# ---- precomputed reference log-probabilities -----------------------------------------------------

REFERENCE_FORMAT = 1  # bump when what the reference entry holds changes meaning


def _files_fingerprint(directory: Path) -> list:
    """(name, size, mtime) of a model directory's files: a changed weight file changes the key
    without hashing gigabytes at every start."""
    if not directory.is_dir():
        return []
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in directory.iterdir() if f.is_file())


# The files of an adapter directory PEFT reads (`PeftModel.from_pretrained` / `load_adapter`): other
# files there, however named, change nothing it loads.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def _adapter_digest(path: str | None) -> str | None:
    """The starting adapter's identity: the SHA-256 of each file PEFT reads, streamed in blocks
    (a junk `adapter_model.old` of a gigabyte beside it is neither read nor hashed)."""
    if not path:
        return None
    from .data.cache import file_sha256

    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(f"{name}\0{file_sha256(f)}\0".encode())
    return h.hexdigest()


def reference_key(spec, data_dir: Path, precision: str) -> str:
    """What the reference log-probabilities depend on: the tokenized pairs (the data cache entry,
    whose key holds the data, tokenizer, template and truncation), the base (its files; tiny-llama
    is built from `run.seed`), its quantization and compute precision, the attention kernel and
    the starting adapter's bytes. Not the objective, beta or batch sizes: a search reuses one entry."""
    from .spec import resolve_model_dir

    m = spec.model
    base = (
        ["tiny-llama", spec.run.seed]
        if m.name == "tiny-llama"
        else [m.name, m.gguf_file, _files_fingerprint(Path(resolve_model_dir(m.name)))]
    )
    parts = {
        "format": REFERENCE_FORMAT,
        "data": data_dir.name,
        "base": base,
        "quantization": m.quantization,
        "precision": precision,
        "attn": m.attn_implementation,
        "adapter": _adapter_digest(m.adapter),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def precomputed_reference(spec, ctx, job, engine, pair_batch) -> dict:
    """{"train": [pairs, 2], "eval": [pairs, 2]} float64 reference log-probabilities (chosen,
    rejected) of every pair, from the entry beside the data cache, computed first if it is missing.

    Every rank computes its share (`equal_micro_batches`: the same number of forwards everywhere,
    as FSDP needs) through the loss module's `reference_only` forward, under the run's autocast;
    a sum over ranks (each pair filled by exactly one rank, zeros elsewhere) gives every rank the
    whole table, and the entry is published once (`jobs.cache.build_once`). Whether to compute is
    decided by all ranks together, so no rank enters the collective alone."""
    import numpy as np
    import torch.distributed as dist

    from .cache import build_once
    from .data import equal_micro_batches

    final = job.data.cache_dir.with_name(
        f"{job.data.cache_dir.name}.reference-{reference_key(spec, job.data.cache_dir, job.precision)}"
    )
    have = torch.tensor([float(final.is_dir())], device=engine.device)
    if ctx.world_size > 1:
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if not have.item():
        tables = {
            split: _reference_table(
                engine, job, split, ctx, pair_batch, equal_micro_batches, spec.batch.micro_batch_size
            )
            for split in ("train", "eval")
        }

        def write(tmp: Path) -> None:
            for split, table in tables.items():
                np.save(tmp / f"{split}.npy", table)
            (tmp / "meta.json").write_text(
                json.dumps({"format": REFERENCE_FORMAT, "pairs": {k: int(v.shape[0]) for k, v in tables.items()}})
            )

        final = build_once(final, write, "the precomputed reference log-probabilities")
        if ctx.is_main:
            log.warning(
                "reference log-probabilities of %d pairs computed and stored at %s",
                sum(len(t) for t in tables.values()),
                final,
            )
    return {split: np.load(final / f"{split}.npy") for split in ("train", "eval")}


@torch.no_grad()
def _reference_table(engine, job, split: str, ctx, pair_batch, equal_micro_batches, micro_batch_size: int):
    import torch.distributed as dist

    pairs = job.data.train if split == "train" else job.data.eval
    table = torch.zeros(len(pairs), 2, dtype=torch.float64, device=engine.device)
    if len(pairs):
        for idx, counted in equal_micro_batches(len(pairs), ctx.rank, ctx.world_size, micro_batch_size):
            batch = {k: v.to(engine.device) for k, v in pair_batch(job, split, idx).items()}
            with engine.autocast():
                logps = engine.module(**batch, reference_only=True)
            if counted:
                m = len(idx)
                table[idx, 0], table[idx, 1] = logps[:m], logps[m:]
        if ctx.world_size > 1:
            dist.all_reduce(table)
    return table.cpu().numpy()
