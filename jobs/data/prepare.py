"""`rayft data prepare`: build a job's tokenized cache entries ahead of the job, with Ray Data.

The entry is the one the job would build itself (`jobs.data.cache.load_dataset`), byte for byte,
at the same path (`data_cache_dir(spec, cache_key(spec, tokenizer))`), so the job finds it and
tokenizes nothing; a job whose entry is missing still builds it in one process, as before.

What runs where:

- **Driver (this process): reading, the held-out split, writing.** `read_records` reads and
  checks the records and holds out the eval split: the one rule for the split, the one the job
  applies. The tokenized results stream back in record order (Ray Data's `preserve_order`) into
  `write_entry`, the writer of the single-process build, and `publish_entry` publishes the entry
  (`build_once`: a lock, an atomic rename; a failure leaves no entry).
- **Cluster: tokenization**, the costly part. The records (train then eval) are cut into blocks of
  `BLOCK_RECORDS`, each a Ray Data block; `map_batches` runs `tokenized` (the build's per-record
  rule) on each block as a task of one CPU, spread over every node's CPUs. A record's result
  depends on that record only, so the blocks' results, concatenated in order, are the
  single-process build's results.

The driver's read and write do not scale with the cluster: they bound what more nodes give (see
docs/training.md). A multi-node reader would have to apply the same held-out rule (a seeded
shuffle of all record indices) across readers, and the order of records within the entry.

`spec_entries` lists the entries a spec needs, each with how its records are read (today one: all
of `data.path` and the held-out split, as `load_dataset` builds it); `prepare_entry` builds one
from its records, whatever entry it is.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray

from jobs.data.cache import (
    cache_key,
    content_hash,
    data_cache_dir,
    data_kind,
    publish_entry,
    source_keys,
    tokenized,
    verified_if_published,
    vocab_size,
    write_entry,
)
from jobs.data.pairs import Pair
from jobs.data.records import PAIR_FIELDS, PAIRS
from jobs.data.sources import read_records
from jobs.data.tokenizing import Example
from jobs.errors import ClusterError, ClusterUnreachable, RayftError, error_line, worker_error
from jobs.launch.cluster_check import check_cluster
from jobs.spec import JobSpec

log = logging.getLogger("rayft")

# Records per Ray Data block (one tokenization task): small enough that every CPU gets many
# blocks (load balance, bounded memory per task), large enough that a task's overhead (its
# scheduling, the tokenizer's deserialization) stays small next to its tokenization.
BLOCK_RECORDS = 2048


@dataclass(frozen=True)
class Entry:
    """One cache entry a spec's job reads: where it is published, the content hash its meta.json
    records, the spec whose data settings tokenize it, and how its (training, held-out) records
    are read on the driver, as that entry's own build reads them."""

    final: Path
    content: str
    spec: JobSpec
    read: Callable[[], tuple[list[dict], list[dict]]]


def spec_entries(spec: JobSpec, tokenizer) -> list[Entry]:
    """The cache entries the job of `spec` reads, as `load_dataset` finds them: one for
    `data.path` (every file of it, `data.eval_path` or the held-out split), or one per source of
    a mixture (`data.mix`: each source's entry is the one it has as a job's only data,
    `JobSpec.for_source`), a problem in a source named by its `data.mix.<i>` key."""
    if spec.data.mix is None:
        final = data_cache_dir(spec, cache_key(spec, tokenizer))
        return [Entry(final, content_hash(spec), spec, lambda: read_records(spec, tokenizer))]
    entries = []
    for i in range(len(spec.data.mix)):
        one = spec.for_source(i)
        with source_keys(i):
            final, content = data_cache_dir(one, cache_key(one, tokenizer)), content_hash(one)
        entries.append(Entry(final, content, one, functools.partial(_read_source, i, one, tokenizer)))
    return entries


def _read_source(i: int, spec: JobSpec, tokenizer) -> tuple[list[dict], list[dict]]:
    with source_keys(i):
        return read_records(spec, tokenizer)


def connect(address: str | None, num_cpus: int | None) -> str:
    """Connect to the cluster at `address` (else $RAY_ADDRESS), or start a local Ray with
    `num_cpus` logical CPUs (default: this machine's cores); a Ray this process is already
    connected to is used as it is. Returns what was chosen, in words. An address where no Ray
    cluster answers within `jobs.launch.cluster_check`'s bounds is `ClusterUnreachable` (ray.init would
    wait for minutes)."""
    if ray.is_initialized():
        return f"the Ray this process is connected to ({_cpus()} CPUs)"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_cluster(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ClusterUnreachable(f"--address {address}: no Ray cluster answers ({error_line(e)})") from None
        return f"the cluster at {address} ({_cpus()} CPUs)"
    n = num_cpus or os.cpu_count() or 1
    ray.init(address="local", num_cpus=n, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    return f"a local Ray with {n} CPUs (--num-cpus)"


def _cpus() -> int:
    return int(ray.cluster_resources().get("CPU", 0))


def prepare_entry(entry: Entry, tokenizer, records: Sequence[dict], eval_records: Sequence[dict]) -> bool:
    """Build `entry` from its records (`read_records`'s split) on the connected Ray unless it is
    published meanwhile; True when this call published it. A failure leaves no entry: a task's
    SpecError comes back as that SpecError, any other failure on the cluster as a ClusterError."""
    built = []

    def build(tmp: Path) -> None:
        stream = iter(tokenize_on_ray(entry.spec, tokenizer, [*records, *eval_records]))
        splits = {"train": (len(records), itertools.islice(stream, len(records))), "eval": (len(eval_records), stream)}
        write_entry(tmp, entry.spec, entry.content, splits)
        built.append(True)

    try:
        publish_entry(entry.final, build)
    except RayftError:
        raise
    except Exception as e:  # a task's error, as Ray wraps it
        raise worker_error(e) or ClusterError(f"tokenizing on Ray failed: {error_line(e)}") from None
    return bool(built)


def tokenize_on_ray(spec: JobSpec, tokenizer, records: Sequence[dict]) -> Iterator[Any]:
    """`tokenized(spec, tokenizer, records)`'s results, in record order, computed by Ray Data
    tasks over blocks of BLOCK_RECORDS records (`_tokenize_block`) and decoded here
    (`_decode_block`)."""
    if not records:
        return
    import pyarrow as pa
    import ray.data

    blocks = [
        pa.table({"record": pa.array([pickle.dumps(r) for r in records[i : i + BLOCK_RECORDS]], pa.binary())})
        for i in range(0, len(records), BLOCK_RECORDS)
    ]
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True  # the driver writes in record order
    ctx.enable_progress_bars = False
    consoles = [h for h in logging.getLogger("ray.data").handlers if type(h).__name__ != "SessionFileHandler"]
    for h in consoles:
        h.addFilter(_quiet_ray_data)
    try:
        ds = ray.data.from_arrow(blocks).map_batches(
            cast(Any, _tokenize_block),  # a function of (block, **fn_kwargs): Ray's annotation knows only (block)
            batch_size=None,  # a batch is a whole block: one task per block
            batch_format="pyarrow",
            fn_kwargs={"spec": spec, "tokenizer": tokenizer},
            num_cpus=1,
        )
        kind = data_kind(spec)
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            yield from _decode_block(table, kind)
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        for h in consoles:
            h.removeFilter(_quiet_ray_data)


def _quiet_ray_data(record: logging.LogRecord) -> bool:
    """On Ray Data's console handlers: its lines a user cannot act on (its execution plan and
    timing at INFO, the notice that progress bars are off) stay in its log files (its session
    file handler is left alone); its warnings and errors are printed."""
    return record.levelno >= logging.WARNING and not record.getMessage().startswith("Progress bars disabled")


def _tokenize_block(table, spec: JobSpec, tokenizer):
    """On a Ray worker: one block's records (pickled, one per row) -> their tokenized results as
    columns of int32 lists. SFT: `kept` (an Example, not None), `input_ids`, `targets`; pairs:
    `drop` (the reason, "" for a kept pair) and one column per field."""
    import pyarrow as pa

    records = [pickle.loads(b) for b in table.column("record").to_pylist()]
    items = list(tokenized(spec, tokenizer, records))
    if data_kind(spec) == PAIRS:
        pairs = [x if isinstance(x, Pair) else None for x in items]
        cols = {"drop": pa.array(["" if isinstance(x, Pair) else x for x in items], pa.string())}
        for f in PAIR_FIELDS:
            cols[f] = _lists([getattr(p, f) if p is not None else () for p in pairs])
        return pa.table(cols)
    return pa.table(
        {
            "kept": pa.array([x is not None for x in items], pa.bool_()),
            "input_ids": _lists([x.input_ids if x is not None else () for x in items]),
            "targets": _lists([x.targets if x is not None else () for x in items]),
        }
    )


def _lists(seqs: Sequence[Sequence[int]]):
    """`seqs` as one Arrow list<int32> column, built from flat numpy arrays."""
    import pyarrow as pa

    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(offsets[-1]))
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """An Arrow list column (one or more chunks) -> (its int32 values, its int64 offsets)."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    return np.asarray(arr.values, dtype=np.int32), offsets - offsets[0]


def _decode_block(table, kind: str) -> Iterable[Any]:
    """A tokenized block back into `tokenized`'s results, in order. Token fields are numpy views
    rather than tuples: the writers read them as int32 arrays, so the bytes written are the same,
    and the driver (which does not scale with the cluster) builds no Python ints."""
    if kind == PAIRS:
        drops = table.column("drop").to_pylist()
        fields = {f: _flat(table.column(f)) for f in PAIR_FIELDS}
        for i, drop in enumerate(drops):
            if drop:
                yield drop
            else:
                yield Pair(*(cast(Any, v[o[i] : o[i + 1]]) for v, o in fields.values()))
        return
    kept = table.column("kept").to_pylist()
    (ids, at), (targets, _) = _flat(table.column("input_ids")), _flat(table.column("targets"))
    for i, k in enumerate(kept):
        yield Example(cast(Any, ids[at[i] : at[i + 1]]), cast(Any, targets[at[i] : at[i + 1]])) if k else None


def prepare(
    spec: JobSpec, tokenizer, address: str | None = None, num_cpus: int | None = None, say=log.warning
) -> list[dict]:
    """Every entry `spec` needs, built on Ray where missing: one report per entry (`path`,
    `built`: False when it already existed and passed the checks a job's open applies; a bad one is
    set aside, with one warning line, and built again). An entry's records are read and checked before Ray is
    reached (bad data: a SpecError, nothing started or created); Ray is started or connected to
    only when an entry is missing, and `say` is told where it runs."""
    reports, id_bound = [], vocab_size(tokenizer)
    for entry in spec_entries(spec, tokenizer):
        expected = {"content_hash": entry.content, "kind": data_kind(entry.spec)}
        if verified_if_published(entry.final, expected, id_bound):
            reports.append({"path": str(entry.final), "built": False})
            continue
        records, eval_records = entry.read()
        where = connect(address, num_cpus)
        say(f"tokenizing {len(records) + len(eval_records)} records on {where}")
        built = prepare_entry(entry, tokenizer, records, eval_records)
        reports.append({"path": str(entry.final), "built": built, "records": len(records) + len(eval_records)})
    return reports
