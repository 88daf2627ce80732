"""Precomputed reference log-probabilities (`objective.reference: precomputed`): computed once
per (base, data, template) through the loss module's `reference_only` forward and stored beside
the data cache, so a DPO/IPO step skips the reference forward."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jobs.data.cache import set_aside_bad
from jobs.data.verify import BadEntry
from jobs.errors import SpecError
from jobs.model.adapter_check import adapter_digest

if TYPE_CHECKING:
    from jobs.spec import JobSpec

log = logging.getLogger("rayft")

REFERENCE_FORMAT = 1  # bump when what the reference entry holds changes meaning


def _files_fingerprint(directory: Path) -> list:
    """(name, size, mtime) of a model directory's files: a changed weight file changes the key
    without hashing gigabytes at every start."""
    if not directory.is_dir():
        return []
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in directory.iterdir() if f.is_file())


def reference_key(spec: JobSpec, data_dir: Path, precision: str) -> str:
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
        "adapter": adapter_digest(m.adapter),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def precomputed_reference(spec: JobSpec, ctx, job, engine, pair_batch) -> dict:
    """{"train": [pairs, 2], "eval": [pairs, 2]} float64 reference log-probabilities (chosen,
    rejected) of every pair, from the entry beside the data cache, computed first if it is missing
    or bad.

    The entry is checked as the data entries are (`jobs.data.verify`): a real directory of regular
    files, none a link; meta.json's key and pair counts are this run's; each file's size and
    sha256 are what its build recorded; each table is float64 [pairs, 2] and finite. A bad entry is
    set aside (never deleted) with one warning line and computed again; bad again: one line, exit 2.

    Every rank computes its share (`equal_micro_batches`: the same number of forwards everywhere,
    as FSDP needs) through the loss module's `reference_only` forward, under the run's autocast;
    a sum over ranks (each pair filled by exactly one rank, zeros elsewhere) gives every rank the
    whole table, and the entry is published once (`jobs.run.build_once.build_once`). Whether to
    compute is decided by all ranks together, so no rank enters the collective alone."""
    from jobs.run.build_once import build_once

    key = reference_key(spec, job.data.cache_dir, job.precision)
    final = job.data.cache_dir.with_name(f"{job.data.cache_dir.name}.reference-{key}")
    expected = {"key": key, "pairs": {"train": len(job.data.train), "eval": len(job.data.eval)}}
    bad = _problem(final, expected)
    if not _everywhere(bad is None, ctx, engine):
        if ctx.is_main and bad is not None and bad[0] is not None:
            set_aside_bad(final, bad[0], bad[1], "precomputed reference")
        _barrier(ctx)
        tables = {split: _reference_table(engine, job, split, ctx, pair_batch, spec) for split in SPLITS}
        final = build_once(final, lambda tmp: _write(tmp, tables, key), "the precomputed reference log-probabilities")
        if ctx.is_main:
            log.warning("reference log-probabilities of %d pairs computed and stored at %s", _pairs(tables), final)
    try:
        return _verified(final, expected)
    except BadEntry as e:
        raise SpecError(f"precomputed reference: {e}, also after it was computed again") from None


SPLITS = ("train", "eval")
TABLES = tuple(f"{split}.npy" for split in SPLITS)


def _pairs(tables: dict) -> int:
    return sum(len(t) for t in tables.values())


def _everywhere(ok: bool, ctx, engine) -> bool:
    """`ok` on every rank (one small all-reduce): all ranks take the same branch."""
    import torch.distributed as dist

    flag = torch.tensor([float(ok)], device=engine.device)
    if ctx.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _barrier(ctx) -> None:
    import torch.distributed as dist

    if ctx.world_size > 1:
        dist.barrier()


def _write(tmp: Path, tables: dict, key: str) -> None:
    """The entry's files: each split's table, then meta.json recording each one's size and sha256."""
    import numpy as np

    from jobs.data.verify import file_records

    for split, table in tables.items():
        np.save(tmp / f"{split}.npy", table)
    meta = {
        "format": REFERENCE_FORMAT,
        "key": key,
        "pairs": {k: int(v.shape[0]) for k, v in tables.items()},
        "files": file_records(tmp, TABLES),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True))


def _problem(final: Path, expected: dict) -> tuple[os.stat_result | None, BadEntry] | None:
    """None when the entry at `final` passes `_verified`; else (its lstat, or None where there is
    nothing there, and what is wrong)."""
    try:
        seen = os.lstat(final)
    except FileNotFoundError:
        return None, BadEntry(final, "is missing")
    except OSError as e:
        return None, BadEntry(final, f"cannot be read ({e.strerror or e})")
    try:
        _verified(final, expected)
    except BadEntry as e:
        return seen, e
    return None


def _verified(final: Path, expected: dict) -> dict:
    """The entry's tables once every check of the docstring above passes; a BadEntry naming the
    first file that does not."""
    from jobs.data.verify import check_contents, check_files, read_meta

    meta = _meta(final / "meta.json", read_meta(final), expected)
    stats = check_files(final, meta["files"], list(TABLES))
    check_contents(final, meta["files"], stats, vocab_size=0)  # no token files: digests only
    return {split: _table(final / f"{split}.npy", expected["pairs"][split]) for split in SPLITS}


def _meta(path: Path, meta: Any, expected: dict) -> dict:
    """`meta` (the entry's parsed meta.json at `path`) once it is this run's reference's."""
    if not isinstance(meta, dict) or meta.get("format") != REFERENCE_FORMAT or meta.get("key") != expected["key"]:
        raise BadEntry(path, "belongs to another reference (format or key differs)")
    if meta.get("pairs") != expected["pairs"]:
        raise BadEntry(path, f"counts pairs {meta.get('pairs')}, the data has {expected['pairs']}")
    files = meta.get("files")
    if (
        not isinstance(files, dict)
        or sorted(files) != sorted(TABLES)
        or not all(isinstance(v, dict) for v in files.values())
    ):
        raise BadEntry(path, "does not list the entry's files")
    return meta


def _table(path: Path, pairs: int):
    """The float64 [pairs, 2] finite table at `path` (no pickle is ever loaded)."""
    import numpy as np

    try:
        table = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BadEntry(path, f"is not a numpy array ({str(e)[:200]})") from None
    if table.dtype != np.float64 or table.shape != (pairs, 2):
        raise BadEntry(path, f"holds {table.dtype} {list(table.shape)}, not float64 [{pairs}, 2]")
    if not np.isfinite(table).all():
        raise BadEntry(path, "holds a value that is not finite")
    return table


@torch.no_grad()
def _reference_table(engine, job, split: str, ctx, pair_batch, spec: JobSpec):
    import torch.distributed as dist

    from jobs.data import equal_micro_batches

    micro_batch_size = spec.batch.micro_batch_size

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
