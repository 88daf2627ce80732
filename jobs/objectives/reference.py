"""Precomputed reference log-probabilities (`objective.reference: precomputed`): computed once
per (base, data, template) through the loss module's `reference_only` forward and stored beside
the data cache, so a DPO/IPO step skips the reference forward."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger("rayft")

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
    from jobs.data.cache import file_sha256

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
    from jobs.spec import resolve_model_dir

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
    whole table, and the entry is published once (`jobs.run.build_once.build_once`). Whether to compute is
    decided by all ranks together, so no rank enters the collective alone."""
    import numpy as np
    import torch.distributed as dist

    from jobs.data import equal_micro_batches
    from jobs.run.build_once import build_once

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
