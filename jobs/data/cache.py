"""The tokenized cache: one build per (data, tokenizer, settings), memory-mapped by every worker.

An entry is a directory `data_cache_dir(spec, cache_key(spec, tokenizer))` holding, per split
(`train`, `eval`), the flat int32 token arrays `<split>.input_ids.bin` and `<split>.targets.bin`,
the int64 offsets `<split>.offsets.npy` (example i is `[offsets[i], offsets[i+1])`), and the
per-example int32 counts `<split>.lengths.npy` (input tokens) and `<split>.label_tokens.npy`
(targets that are not IGNORE), and a `meta.json` (content hash, record counts, dropped records,
each split's `n` and `n_tokens`). An entry of preference pairs (`meta.json`'s `"kind": "pairs"`)
holds instead, per split and per field F in (`prompt`, `chosen`, `rejected`), the flat int32 ids
`<split>.F.bin` and their int64 offsets `<split>.F.offsets.npy`, and per pair the int32
`<split>.lengths.npy` (its longer row's input length), `<split>.label_tokens.npy` (both responses)
and `<split>.input_tokens.npy` (both rows' inputs) (`TokenizedPairs`); its `meta.json` counts the
pairs dropped for an empty response and for identical responses apart. The counts are written
with the tokens, so the step's host work (length grouping, the window's label and input counts,
collation: `jobs.data.batches`) reads arrays and never turns a sample into Python objects.
`CACHE_FORMAT` is part of the key: bump it when these files or the tokenization change meaning,
and every existing entry is left alone (a new key: the entry is built again), never misread.
(Format 2 added the per-sample count arrays; format 3 each file's size and sha256 in `meta.json`'s
`"files"`, so an entry is verified before it is used: `load_entry`, `jobs.data.verify`.)

The key covers what decides the tokens: the data's content (`content_hash`), the tokenizer and
its chat template (`tokenizer_hash`), `max_seq_len`, the fields, `train_on`, the held-out split
and, for a preference objective, that the entry holds pairs (an SFT entry's key is what it was
before pairs existed, so existing SFT entries stay valid). One process builds an entry
(`jobs.run.build_once.build_once`: a lock, an atomic rename); a restart, a resume, a Tune trial or a later
run tokenizes nothing and holds only the pages it touches (`TokenizedSplit`, `TokenizedPairs`).
An entry that fails its checks (a partial write, another job's mistake, a link: `jobs.data.verify`
and `_check_layout`) was ours to build: it is set aside (`<entry>.bad-<time>`, never deleted)
and built again, with one warning line; where it cannot be set aside, one SpecError line names
the file.

A mixture (`data.mix`) has no entry of its own: each source is the entry it would be as a job's
only data (`load_mixture`), and the mixture is those entries side by side (`Concatenated`).
`rayft data prepare` (`jobs.data.prepare`) builds the same entry ahead of the job, tokenizing on Ray:
both builds share the per-record rule (`tokenized`), the writer (`write_entry`) and the
publication (`publish_entry`), so both write the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jobs.data.pairs import DROP_EMPTY, DROP_IDENTICAL, Pair, tokenize_pairs_iter
from jobs.data.records import PAIR_FIELDS, PAIRS, SFT, record_kind
from jobs.data.sources import dataset_dir_files, datasets_rows, first_record_format, is_hub, read_jsonl, read_records
from jobs.data.tokenizing import IGNORE, Example, tokenize_iter
from jobs.data.verify import DIGEST, BadEntry, check_contents, check_files, file_records, read_meta
from jobs.errors import SpecError
from jobs.run.build_once import build_once, set_aside
from jobs.spec import JobSpec, one_line, path_problem
from jobs.spec.online import offline_only

log = logging.getLogger("rayft")

CACHE_FORMAT = 3  # bump when the cache's files or the tokenization change meaning


# ---- content hashes and the key ---------------------------------------------------------------

_HASHES: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    st = path.stat()
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if memo in _HASHES:  # a checkpoint every few steps hashes the data again: once is enough
        return _HASHES[memo]
    h = hashlib.sha256()
    with open(path, "rb") as f:  # in blocks: hashlib.file_digest is Python 3.11+, rayft supports 3.10
        while block := f.read(1 << 20):
            h.update(block)
    digest = h.hexdigest()
    # A file modified within the filesystem's timestamp granularity of now could change again
    # without changing (size, mtime): remember only hashes of files that have been still a while.
    if time.time() - st.st_mtime > 2:
        _HASHES[memo] = digest
    return digest


def source_hash(path: str, hf_token_env: str | None = None) -> str:
    """sha256 of a data source's content: a file's bytes, every file of a `save_to_disk`
    directory and every file its descriptions name (names and bytes), or a hub dataset's
    fingerprint (datasets' hash of its files)."""
    if is_hub(path):
        return "hf:" + datasets_rows(path, "data.path", hf_token_env)._fingerprint
    p = Path(path)
    if not p.is_dir():
        problem = path_problem(p)  # never open a FIFO or a device to hash it
        if problem:
            raise SpecError(f"data.path: {problem}")
    if p.is_dir():
        # Every regular file below it, and every file its descriptions name (also one below a
        # linked directory, which rglob does not enter); a name outside it is refused there.
        files = {q for q in p.rglob("*") if q.is_file()} | set(dataset_dir_files(p))
        h = hashlib.sha256()
        for f in sorted(files):
            h.update(f"{f.relative_to(p)}\0{file_sha256(f)}\0".encode())
        return h.hexdigest()
    return file_sha256(p)


def content_hash(spec: JobSpec) -> str:
    """One hash of everything `data.path` and `data.eval_path` hold (a mixture: every source's
    path and eval_path, in order): it changes exactly when the data under the same paths changes
    (the checkpoint's resume key records it)."""
    h = hashlib.sha256()
    for _, p in spec.data.source_files():
        try:
            h.update(source_hash(p, spec.data.hf_token_env).encode() + b"\0")
        except OSError as e:
            raise SpecError(f"data: {one_line(str(p))}: cannot be read ({e.strerror or e})") from None
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """The tokenizer's full definition (vocabulary, merges, normalizer, special tokens) and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [getattr(tokenizer, "chat_template", None), tokenizer.bos_token_id, tokenizer.eos_token_id]
    return hashlib.sha256((body + json.dumps(extra, default=str)).encode()).hexdigest()


def data_kind(spec: JobSpec) -> str:
    """The kind of record the objective trains on (its spec class says): `PAIRS` for a preference
    objective (its samples are `Pair`s), else `SFT`."""
    offline_only(spec, "the data cache")  # GRPO reads its prompts itself (`jobs.data.prompts`)
    kind = spec.objective.records
    assert kind in (SFT, PAIRS)
    return kind


def cache_key(spec: JobSpec, tokenizer) -> str:
    d = spec.data
    parts = {
        "format": CACHE_FORMAT,
        "content": content_hash(spec),
        "tokenizer": tokenizer_hash(tokenizer),
        "max_seq_len": d.max_seq_len,
        "fields": d.fields,
        "train_on": d.train_on,
        "n_sources": len(d.path),
        "eval_path": bool(d.eval_path),
        "eval_fraction": d.eval_fraction,
        "split_seed": spec.run.seed if d.eval_fraction > 0 and not d.eval_path else None,
    }
    if data_kind(spec) == PAIRS:  # only then: an SFT entry keeps the key it always had
        parts["kind"] = PAIRS
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def data_cache_dir(spec: JobSpec, key: str) -> Path:
    """`data.cache_dir/<key>`, by default `<parent of run.output_dir>/.rayft-data/<key>`: storage
    every worker of a run sees (the output directory's volume, shared on Kubernetes), and every
    run, resume and Tune trial writing next to it reuses the same tokenized data."""
    if spec.data.cache_dir:
        return Path(spec.data.cache_dir).resolve() / key
    return spec.output_path.resolve().parent / ".rayft-data" / key


# ---- an entry's files -------------------------------------------------------------------------


class Segments(NamedTuple):
    """Where one field's tokens of some samples lie: sample k's are
    `arrays[part[k]][starts[k] : starts[k] + sizes[k]]` (int64 `part`, `starts`, `sizes`). A split
    has one array per field; a `Concatenated` one per source, so collation copies each sample
    straight from its own source's memory-mapped tokens (`jobs.data.batches`)."""

    arrays: tuple[np.ndarray, ...]
    part: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray


def _one_array(tokens: np.ndarray, offsets: np.ndarray, indices: np.ndarray) -> Segments:
    start = offsets[indices]
    return Segments((tokens,), np.zeros(len(indices), dtype=np.int64), start, offsets[indices + 1] - start)


class TokenizedSplit(Sequence):
    """Examples stored as flat int32 arrays (`ids`, `targets`), int64 `offsets` and per-example
    int32 counts (`lengths`: input tokens, also the length a padded row needs; `label_tokens`),
    memory-mapped read-only (`open`): an index costs only the pages of the examples it touches.
    `of(examples)` holds the same arrays in memory. `jobs.data.batches` reads the arrays;
    indexing gives an `Example` (tuples of ints), for tests and small tools."""

    def __init__(
        self, ids: np.ndarray, targets: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, label_tokens: np.ndarray
    ):
        self.ids, self.targets, self.offsets = ids, targets, offsets
        self.lengths, self.label_tokens = lengths, label_tokens
        self.n = len(lengths)

    @property
    def input_tokens(self) -> np.ndarray:
        """Input tokens per example (the model runs on each: its length)."""
        return self.lengths

    def segments(self, field: str, indices: np.ndarray) -> Segments:
        """Where the `field` (`ids` or `targets`) tokens of the examples at `indices` (int64) lie."""
        return _one_array(self.ids if field == "ids" else self.targets, self.offsets, indices)

    @classmethod
    def open(cls, directory: Path, name: str, n_tokens: int) -> TokenizedSplit:
        """Split `name` of the entry at `directory` (the files `_SplitWriter` wrote), memory-mapped."""
        ids, targets = (_tokens(directory / f"{name}.{f}.bin", n_tokens) for f in ("input_ids", "targets"))
        return cls(ids, targets, *(np.load(directory / f"{name}.{f}.npy", mmap_mode="r") for f in _SPLIT_ARRAYS))

    @classmethod
    def of(cls, examples: Sequence[Example]) -> TokenizedSplit:
        """`examples` in memory, laid out as an entry's split is."""
        lengths = np.fromiter((len(e.input_ids) for e in examples), dtype=np.int32, count=len(examples))
        offsets = np.zeros(len(examples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids, targets = (_concat([getattr(e, f) for e in examples]) for f in ("input_ids", "targets"))
        return cls(ids, targets, offsets, lengths, _segment_counts(targets != IGNORE, offsets))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Example(tuple(self.ids[a:b].tolist()), tuple(self.targets[a:b].tolist()))

    def __add__(self, other):
        return list(self) + list(other)


_SPLIT_ARRAYS = ("offsets", "lengths", "label_tokens")  # an SFT split's .npy files, in `TokenizedSplit`'s order
_PAIR_ARRAYS = ("lengths", "label_tokens", "input_tokens")  # a pair split's per-pair .npy files


def _tokens(path: Path, n_tokens: int) -> np.ndarray:
    """A flat int32 token file, memory-mapped read-only (an empty one cannot be mapped)."""
    return np.memmap(path, dtype=np.int32, mode="r", shape=(n_tokens,)) if n_tokens else np.zeros(0, dtype=np.int32)


def _concat(seqs: Sequence[Sequence[int]]) -> np.ndarray:
    """The token sequences `seqs` end to end, as one flat int32 array."""
    return np.concatenate([np.asarray(x, dtype=np.int32) for x in seqs]) if seqs else np.zeros(0, dtype=np.int32)


def _segment_counts(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """int32 count of the true `flags` in each segment `[offsets[i], offsets[i+1])`."""
    at = np.zeros(len(flags) + 1, dtype=np.int64)
    np.cumsum(flags, out=at[1:])
    return (at[offsets[1:]] - at[offsets[:-1]]).astype(np.int32)


class _SplitWriter:
    """Writes one split's files (the layout `TokenizedSplit.open` reads), one example at a time."""

    def __init__(self, directory: Path, name: str):
        self.directory, self.name = directory, name
        self.f_ids = open(directory / f"{name}.input_ids.bin", "wb")
        self.f_targets = open(directory / f"{name}.targets.bin", "wb")
        self.offsets = [0]
        self.label_tokens: list[int] = []

    def add(self, ex: Example) -> None:
        targets = np.asarray(ex.targets, dtype=np.int32)
        self.f_ids.write(np.asarray(ex.input_ids, dtype=np.int32).tobytes())
        self.f_targets.write(targets.tobytes())
        self.offsets.append(self.offsets[-1] + len(ex.input_ids))
        self.label_tokens.append(int(np.count_nonzero(targets != IGNORE)))

    def close(self) -> dict:
        self.f_ids.close()
        self.f_targets.close()
        offsets = np.asarray(self.offsets, dtype=np.int64)
        arrays: list[np.ndarray] = [offsets, np.diff(offsets).astype(np.int32)]
        arrays.append(np.asarray(self.label_tokens, dtype=np.int32))
        for f, a in zip(_SPLIT_ARRAYS, arrays, strict=True):
            np.save(self.directory / f"{self.name}.{f}.npy", a)
        return {"n": len(self.offsets) - 1, "n_tokens": self.offsets[-1]}


class TokenizedPairs(Sequence):
    """Pairs stored per field (prompt, chosen, rejected) as a flat int32 array and int64 offsets,
    with per-pair int32 counts (`lengths`: the longer row's input length, what a padded row
    needs; `label_tokens`: both responses; `input_tokens`: both rows' inputs), memory-mapped
    read-only (`open`) or in memory (`of`): reading pair i re-tokenizes nothing and touches only
    its pages. `jobs.data.batches.collate_pairs_at` reads the arrays; indexing gives a `Pair`."""

    def __init__(
        self,
        ids: dict[str, np.ndarray],
        offsets: dict[str, np.ndarray],
        lengths: np.ndarray,
        label_tokens: np.ndarray,
        input_tokens: np.ndarray,
    ):
        self.ids, self.offsets = ids, offsets
        self.lengths, self.label_tokens, self.input_tokens = lengths, label_tokens, input_tokens
        self.n = len(lengths)

    @classmethod
    def open(cls, directory: Path, name: str, n_tokens: dict[str, int]) -> TokenizedPairs:
        """Split `name` of the pairs entry at `directory` (the files `_PairWriter` wrote), memory-mapped."""
        ids = {f: _tokens(directory / f"{name}.{f}.bin", n_tokens[f]) for f in PAIR_FIELDS}
        offsets = {f: np.load(directory / f"{name}.{f}.offsets.npy", mmap_mode="r") for f in PAIR_FIELDS}
        return cls(ids, offsets, *(np.load(directory / f"{name}.{f}.npy", mmap_mode="r") for f in _PAIR_ARRAYS))

    @classmethod
    def of(cls, pairs: Sequence[Pair]) -> TokenizedPairs:
        """`pairs` in memory, laid out as an entry's split is."""
        ids, offsets = {}, {}
        for f in PAIR_FIELDS:
            lens = np.fromiter((len(getattr(p, f)) for p in pairs), dtype=np.int64, count=len(pairs))
            offsets[f] = np.zeros(len(pairs) + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[f][1:])
            ids[f] = _concat([getattr(p, f) for p in pairs])
        return cls(ids, offsets, *_pair_counts(offsets))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return Pair(*(self._field(f, i) for f in PAIR_FIELDS))

    def _field(self, f: str, i: int) -> tuple[int, ...]:
        a, b = int(self.offsets[f][i]), int(self.offsets[f][i + 1])
        return tuple(self.ids[f][a:b].tolist())

    def segments(self, field: str, indices: np.ndarray) -> Segments:
        """Where the `field` (one of `PAIR_FIELDS`) tokens of the pairs at `indices` (int64) lie."""
        return _one_array(self.ids[field], self.offsets[field], indices)

    def __add__(self, other):
        return list(self) + list(other)


def _pair_counts(offsets: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair, from each field's offsets: (`Pair.length`, `Pair.n_labels`, `Pair.n_inputs`), int32."""
    p, c, r = (np.diff(offsets[f]) for f in PAIR_FIELDS)
    counts = (p + np.maximum(c, r) - 1, c + r, 2 * p + c + r - 2)
    return tuple(x.astype(np.int32) for x in counts)  # type: ignore[return-value]


class _PairWriter:
    """Writes one split's pair files (the layout `TokenizedPairs.open` reads), one pair at a time."""

    def __init__(self, directory: Path, name: str):
        self.directory, self.name = directory, name
        self.files = {f: open(directory / f"{name}.{f}.bin", "wb") for f in PAIR_FIELDS}
        self.offsets = {f: [0] for f in PAIR_FIELDS}

    def add(self, pair: Pair) -> None:
        for f in PAIR_FIELDS:
            ids = getattr(pair, f)
            self.files[f].write(np.asarray(ids, dtype=np.int32).tobytes())
            self.offsets[f].append(self.offsets[f][-1] + len(ids))

    def close(self) -> dict:
        offsets = {f: np.asarray(self.offsets[f], dtype=np.int64) for f in PAIR_FIELDS}
        for f in PAIR_FIELDS:
            self.files[f].close()
            np.save(self.directory / f"{self.name}.{f}.offsets.npy", offsets[f])
        for f, a in zip(_PAIR_ARRAYS, _pair_counts(offsets), strict=True):
            np.save(self.directory / f"{self.name}.{f}.npy", a)
        return {"n": len(self.offsets["prompt"]) - 1, "n_tokens": {f: self.offsets[f][-1] for f in PAIR_FIELDS}}


# ---- a mixture's entries, side by side --------------------------------------------------------


class Concatenated(Sequence):
    """Splits of one kind (every part a `TokenizedSplit`, or every part a `TokenizedPairs`) read as
    one: part i's sample j is sample `starts[i] + j`, nothing copied (each part stays
    memory-mapped). It has the interface `jobs.data.batches` reads of a split, so grouping, counts
    and collation of a mixture are those of one source: the per-sample int32 counts (`lengths`,
    `label_tokens`, `input_tokens`: the parts' arrays end to end, 12 bytes a sample in memory), and
    `segments`, each sample's tokens in its own part. Indexing gives the part's `Example`/`Pair`."""

    lengths: np.ndarray
    label_tokens: np.ndarray
    input_tokens: np.ndarray

    def __init__(self, parts: Sequence[TokenizedSplit | TokenizedPairs | Concatenated]):
        self.parts = list(parts)
        self.starts = np.zeros(len(self.parts) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in self.parts], out=self.starts[1:])
        self.lengths, self.label_tokens = self._joined("lengths"), self._joined("label_tokens")
        same = all(p.input_tokens is p.lengths for p in self.parts)  # SFT: inputs are the lengths
        self.input_tokens = self.lengths if same else self._joined("input_tokens")

    def _joined(self, what: str) -> np.ndarray:
        arrays = [np.asarray(getattr(p, what)) for p in self.parts]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        part = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[part][i - int(self.starts[part])]

    def segments(self, field: str, indices: np.ndarray) -> Segments:
        """Where the `field` tokens of the samples at `indices` (int64) lie: each sample in its
        own part's arrays (the parts' `segments`, their arrays listed part after part)."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample index out of range 0..{len(self) - 1}")
        of = np.searchsorted(self.starts, idx, side="right") - 1
        arrays: list[np.ndarray] = []
        part, starts, sizes = (np.empty(len(idx), dtype=np.int64) for _ in range(3))
        for p, split in enumerate(self.parts):
            here = of == p
            seg = split.segments(field, idx[here] - self.starts[p])
            part[here], starts[here], sizes[here] = seg.part + len(arrays), seg.starts, seg.sizes
            arrays.extend(seg.arrays)
        return Segments(tuple(arrays), part, starts, sizes)

    def __add__(self, other):
        return list(self) + list(other)


@dataclass(frozen=True)
class SourcePart:
    """One mixture source inside the concatenated dataset: its name and weight, where its training
    and held-out samples start in `Dataset.train` / `Dataset.eval`, how many there are, its
    cache entry, and the records it dropped."""

    name: str
    weight: float
    train_offset: int
    n_train: int
    eval_offset: int
    n_eval: int
    cache_dir: Path | None = None
    dropped: int = 0


# ---- the spec's data --------------------------------------------------------------------------


@dataclass
class Dataset:
    train: TokenizedSplit | TokenizedPairs | Concatenated  # memory-mapped from the cache entry (a mixture's: entries)
    eval: TokenizedSplit | TokenizedPairs | Concatenated
    dropped: int  # records with no label token left after truncation (pairs: the two counts below)
    content_hash: str = ""  # `content_hash(spec)`: what the checkpoint's resume key records
    cache_dir: Path | None = None
    kind: str = SFT  # `SFT`: `train`/`eval` hold Examples; `PAIRS`: they hold Pairs
    dropped_empty: int = 0  # pairs with an empty prompt or response
    dropped_identical: int = 0  # pairs whose responses are identical after tokenization and truncation
    sources: list[SourcePart] = field(default_factory=list)  # a mixture's sources (`data.mix`); [] for one


def count_checked_records(spec: JobSpec) -> int:
    """Check every record of `data.path` and `data.eval_path` (nothing is kept: the memory of one
    record) and return the number of training records. The driver calls this before anything
    is created. A success is remembered in an existing cache root (`checked-<hash>.json`, keyed
    by the content hash, `data.fields` and the kind of data), so a later start on the same data
    skips the pass. The records are checked against the objective too: pairs for a preference
    objective, SFT records otherwise (`jobs.data.sources.read_jsonl`). A mixture's sources are
    checked one by one (each remembered on its own), after `check_mixture_kinds`."""
    if spec.data.mix is not None:
        check_mixture_kinds(spec)
        total = 0
        for i in range(len(spec.data.mix)):
            with source_keys(i):
                total += count_checked_records(spec.for_source(i))
        return total
    d = spec.data
    memo: Path | None = None
    try:
        checked = [content_hash(spec), d.fields] + ([PAIRS] if data_kind(spec) == PAIRS else [])
        key = hashlib.sha256(json.dumps(checked).encode()).hexdigest()[:24]
        memo = data_cache_dir(spec, f"checked-{key}.json")
        return int(json.loads(memo.read_text())["train_records"])
    except SpecError:  # a source that cannot be hashed: the pass below names the problem
        memo = None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    n_train = 0
    for i, p in enumerate(d.path):
        n_train += len(
            read_jsonl(
                p,
                "data.path" if len(d.path) == 1 else f"data.path.{i}",
                max_chars=0,
                fields=d.fields,
                hf_token_env=d.hf_token_env,
                objective=spec.objective.name,
            )
        )
    if d.eval_path:
        read_jsonl(
            d.eval_path,
            "data.eval_path",
            max_chars=0,
            fields=d.fields,
            hf_token_env=d.hf_token_env,
            objective=spec.objective.name,
        )
    # Remembered only where a tokenized cache already lives: a client that submits to a cluster
    # (or a first run) creates nothing here.
    if memo is None or not memo.parent.is_dir():
        return n_train
    try:  # only a success is remembered; a failed write costs the next start one more pass
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"train_records": n_train}))
        os.replace(tmp, memo)
    except OSError:
        pass
    return n_train


_KINDS_SHOWN = {PAIRS: "pairs", SFT: "SFT records"}


def check_mixture_kinds(spec: JobSpec) -> None:
    """Every source of a mixture holds the one kind of record its objective trains on (pairs for a
    preference objective, SFT records otherwise), judged by each source's first record; a source
    of the other kind is one SpecError naming it, a source of the right kind, and the objective."""
    assert spec.data.mix is not None
    pairs, want = spec.objective.is_preference, data_kind(spec)
    kinds = []
    for i in range(len(spec.data.mix)):
        sub = spec.for_source(i).data
        with source_keys(i):
            fmt = first_record_format(sub.path[0], "data.path", sub.fields, sub.hf_token_env, pairs)
        kinds.append(record_kind(fmt))
    for i, kind in enumerate(kinds):
        if kind == want:
            continue
        other = next((j for j, k in enumerate(kinds) if k == want), None)
        beside = f" and data.mix.{other}.path {_KINDS_SHOWN[want]}" if other is not None else ""
        raise SpecError(
            f"data.mix.{i}.path: {one_line(spec.data.mix[i].path)} holds {_KINDS_SHOWN[kind]}{beside}: every "
            f"source of a mixture holds the records objective.name={spec.objective.name} trains on "
            f"({_KINDS_SHOWN[want]})"
        )


@contextlib.contextmanager
def source_keys(i: int) -> Iterator[None]:
    """Within it, a SpecError about `data.path` / `data.eval_path` (how a mixture source is read:
    `JobSpec.for_source`) names the source's own keys, `data.mix.I.path` / `data.mix.I.eval_path`."""
    try:
        yield
    except SpecError as e:
        text = str(e)
        for ours in ("data.path", "data.eval_path"):
            if text.startswith(ours):
                raise SpecError(f"data.mix.{i}.{ours.removeprefix('data.')}{text[len(ours) :]}") from None
        raise


def load_dataset(spec: JobSpec, tokenizer) -> Dataset:
    """The spec's data, tokenized once into the shared cache (`data_cache_dir`) and memory-mapped.

    The first process to need a cache entry reads and tokenizes the data under a lock and
    publishes the entry by atomic rename (`jobs.run.build_once.build_once`); every other process, now or
    in a later run, maps the published files. Bad data raises a SpecError and leaves no entry.
    A mixture (`data.mix`) is each source's own entry (`load_mixture`)."""
    if spec.data.mix is not None:
        data = load_mixture(spec, tokenizer)
    else:
        data = load_entry(spec, tokenizer)
    check_enough_records(spec, len(data.train), data.dropped)
    return data


def load_mixture(spec: JobSpec, tokenizer) -> Dataset:
    """A mixture: each source tokenized into its own entry (`JobSpec.for_source`: the key of a
    source is the key it has as a job's only data, so adding a source to a mixture tokenizes only
    that one, and a mixture shares entries with one-source runs), then the entries side by side
    (`Concatenated`, nothing copied), `sources` saying where each one lies."""
    assert spec.data.mix is not None
    entries = []
    for i in range(len(spec.data.mix)):
        with source_keys(i):
            entries.append(load_entry(spec.for_source(i), tokenizer))
    parts, train_at, eval_at = [], 0, 0
    for src, e in zip(spec.data.mix, entries, strict=True):
        if not len(e.train):
            raise SpecError(
                f"data.mix: source {src.shown_name!r} ({one_line(src.path)}) has no usable training records"
            )
        parts.append(
            SourcePart(src.shown_name, src.weight, train_at, len(e.train), eval_at, len(e.eval), e.cache_dir, e.dropped)
        )
        train_at, eval_at = train_at + len(e.train), eval_at + len(e.eval)
    names = "\0".join(e.cache_dir.name for e in entries if e.cache_dir is not None)
    return Dataset(
        Concatenated([e.train for e in entries]),
        Concatenated([e.eval for e in entries]),
        dropped=sum(e.dropped for e in entries),
        content_hash=content_hash(spec),
        # Named by its sources' entries (in order): what a precomputed reference beside it is keyed by.
        cache_dir=data_cache_dir(spec, "mix-" + hashlib.sha256(names.encode()).hexdigest()[:24]),
        kind=entries[0].kind,
        dropped_empty=sum(e.dropped_empty for e in entries),
        dropped_identical=sum(e.dropped_identical for e in entries),
        sources=parts,
    )


def load_entry(spec: JobSpec, tokenizer) -> Dataset:
    """The one cache entry of a spec's `data.path` (built if missing), verified (`_verified`) and
    memory-mapped. An entry that fails verification is set aside and built again, once."""
    h = content_hash(spec)
    final = data_cache_dir(spec, cache_key(spec, tokenizer))
    expected = {"content_hash": h, "kind": data_kind(spec)}
    meta = _verified_or_rebuilt(final, lambda tmp: _build(tmp, spec, tokenizer, h), expected, vocab_size(tokenizer))
    split = TokenizedPairs if meta.get("kind") == PAIRS else TokenizedSplit
    train = split.open(final, "train", meta["train"]["n_tokens"])
    evals = split.open(final, "eval", meta["eval"]["n_tokens"])
    return Dataset(
        train,
        evals,
        dropped=meta["dropped"],
        content_hash=h,
        cache_dir=final,
        kind=meta.get("kind", SFT),
        dropped_empty=meta.get("dropped_empty", 0),
        dropped_identical=meta.get("dropped_identical", 0),
    )


# ---- checking an entry before it is used ------------------------------------------------------


def vocab_size(tokenizer) -> int:
    """One more than the largest id the tokenizer can give (its length, or past it where its ids
    have holes): the bound of an entry's token ids."""
    return max(len(tokenizer), 1 + max(tokenizer.get_vocab().values(), default=-1))


def _verified_or_rebuilt(final: Path, build: Callable[[Path], None], expected: dict, vocab_size: int) -> dict:
    """The entry `final`, published (`publish_entry`) and verified: its meta.json (`expected`: the
    content hash and kind of data it must hold). A bad entry
    is set aside as `<entry>.bad-<time>` (never deleted, never followed if a link) and built again,
    with one warning line; a SpecError naming the file where it cannot be set aside, or where the
    rebuilt entry is bad too."""
    seen = _published(final, build)
    try:
        return _verified(final, expected, vocab_size)
    except BadEntry as e:
        set_aside_bad(final, seen, e)
    _published(final, build)
    try:
        return _verified(final, expected, vocab_size)
    except BadEntry as e:
        raise SpecError(f"data cache: {e}, also after it was built again") from None


def verified_if_published(final: Path, expected: dict, vocab_size: int) -> bool:
    """True when an entry is published at `final` and passes the checks a job's open applies
    (`_verified`); a bad one is set aside as `_verified_or_rebuilt` does (one warning line) and
    False, as when there is none: the caller builds it (`rayft data prepare`)."""
    if not (final.exists() or final.is_symlink()):
        return False
    seen = os.lstat(final)
    try:
        _verified(final, expected, vocab_size)
        return True
    except BadEntry as e:
        set_aside_bad(final, seen, e)
        return False


def set_aside_bad(final: Path, seen: os.stat_result, bad: BadEntry, what: str = "data cache") -> None:
    """Take the bad entry `final` (as `seen` by its reader) out of the way to be built again, with
    one warning line; a SpecError naming it where it cannot be moved. `what` names the entry's kind
    in both (the precomputed reference's entries go through here too)."""
    # time, process and a random part: two entries set aside by one process within a second keep both
    suffix = time.strftime(".bad-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        aside = set_aside(final, seen, suffix)
    except OSError as e:
        raise SpecError(
            f"{what}: {bad}; it cannot be set aside to be built again ({e.strerror or e}): "
            f"remove {final} or set data.cache_dir to a writable directory"
        ) from None
    where = f"set aside as {aside.name}" if aside is not None else "replaced by another process"
    log.warning("%s: %s; %s and rebuilt", what, bad, where)


def _published(final: Path, build: Callable[[Path], None]) -> os.stat_result:
    """`publish_entry(final, build)`, and the entry's `lstat` (what `set_aside` compares). A link
    where the entry belongs is neither followed nor built over: `_verified` refuses it."""
    if not final.is_symlink():
        publish_entry(final, build)
    return os.lstat(final)


def _verified(final: Path, expected: dict, vocab_size: int) -> dict:
    """meta.json of the entry `final` once its files pass `jobs.data.verify`'s checks and the
    layout's (`_check_layout`); a BadEntry naming the first file that does not."""
    meta_path = final / "meta.json"
    meta = read_meta(final)
    problem = _meta_problem(meta, expected)
    if problem:
        raise BadEntry(meta_path, problem)
    names = entry_files(meta.get("kind", SFT))
    stats = check_files(final, meta["files"], ["meta.json", *names])
    _check_layout(final, meta)
    check_contents(final, meta["files"], stats, vocab_size)
    return meta


def entry_files(kind: str) -> list[str]:
    """Every file an entry of `kind` (`SFT` or `PAIRS`) holds besides meta.json, in sorted order."""
    if kind == PAIRS:
        per = (
            [f"{f}.bin" for f in PAIR_FIELDS]
            + [f"{f}.offsets.npy" for f in PAIR_FIELDS]
            + [f"{a}.npy" for a in _PAIR_ARRAYS]
        )
    else:
        per = ["input_ids.bin", "targets.bin"] + [f"{a}.npy" for a in _SPLIT_ARRAYS]
    return sorted(f"{split}.{f}" for split in ("train", "eval") for f in per)


def _meta_problem(meta: Any, expected: dict) -> str | None:
    """What is wrong with an entry's parsed meta.json (None: nothing), before any file is read:
    `expected` is its content hash and kind of data (`SFT`, `PAIRS`)."""
    if not isinstance(meta, dict):
        return "is not a JSON object"
    if meta.get("content_hash") != expected["content_hash"]:
        return "belongs to other data (its content hash is not that of data.path)"
    kind = meta.get("kind", SFT)
    if kind != expected["kind"]:
        return f"holds {one_line(str(kind))[:40]!r} data, not {expected['kind']!r}"
    files = meta.get("files")
    if not isinstance(files, dict) or sorted(files) != entry_files(kind):
        return "does not list the entry's files (an older or damaged entry)"
    for rec in files.values():
        if not (isinstance(rec, dict) and _count(rec.get("size")) and isinstance(rec.get(DIGEST), str)):
            return "lists a file without its size and digest"
    for split in ("train", "eval"):
        s = meta.get(split)
        sizes = s.get("n_tokens") if isinstance(s, dict) else None
        sizes_ok = (
            all(_count(sizes.get(f)) for f in PAIR_FIELDS) if kind == PAIRS and isinstance(sizes, dict) else False
        )
        if not (isinstance(s, dict) and _count(s.get("n")) and (sizes_ok if kind == PAIRS else _count(sizes))):
            return f"gives no valid size of split {split!r}"
    if not all(_count(meta.get(k, 0)) for k in ("dropped", "dropped_empty", "dropped_identical")):
        return "gives no valid count of dropped records"
    return None


def _count(x: Any) -> bool:
    """A non-negative integer (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_layout(final: Path, meta: dict) -> None:
    """Each split's arrays have the dtypes and shapes `meta.json` implies: the token files 4 bytes a
    token, offsets int64 from 0 rising to `n_tokens`, the per-sample int32 counts of length `n`
    and consistent with the offsets. O(samples): the small arrays only, never the tokens."""
    pairs = meta.get("kind") == PAIRS
    for split in ("train", "eval"):
        n, n_tokens = meta[split]["n"], meta[split]["n_tokens"]
        fields = PAIR_FIELDS if pairs else ("input_ids", "targets")
        offsets = {}
        for f in fields:
            size = n_tokens[f] if pairs else n_tokens
            tokens = final / f"{split}.{f}.bin"
            if meta["files"][tokens.name]["size"] != 4 * size:
                raise BadEntry(tokens, f"is not 4 bytes for each of the {size} tokens meta.json records")
            if pairs or f == "input_ids":
                name = f"{split}.{f}.offsets.npy" if pairs else f"{split}.offsets.npy"
                offsets[f] = _offsets(final / name, n, size)
        counts = _pair_counts(offsets) if pairs else (np.diff(offsets["input_ids"]),)
        for a, want in zip(_PAIR_ARRAYS if pairs else ("lengths",), counts, strict=True):
            got = _array(final / f"{split}.{a}.npy", np.int32, n)
            if not np.array_equal(got, want):
                raise BadEntry(final / f"{split}.{a}.npy", "does not match the offsets")
        if not pairs:
            labels = _array(final / f"{split}.label_tokens.npy", np.int32, n)
            if n and (labels.min() < 0 or np.any(labels > counts[0])):
                raise BadEntry(final / f"{split}.label_tokens.npy", "counts more labels than tokens")


def _offsets(path: Path, n: int, n_tokens: int) -> np.ndarray:
    offsets = _array(path, np.int64, n + 1)
    if offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) < 0):
        raise BadEntry(path, f"are not offsets rising from 0 to the {n_tokens} tokens meta.json records")
    return offsets


def _array(path: Path, dtype: type, n: int) -> np.ndarray:
    """The .npy array at `path`, memory-mapped (never a pickle), if it is 1-d of `dtype` and length `n`."""
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BadEntry(path, f"is no .npy array ({one_line(str(e))[:200]})") from None
    if a.dtype != dtype or a.shape != (n,):
        raise BadEntry(path, f"holds {a.dtype} {a.shape}, not {np.dtype(dtype)} ({n},) as meta.json implies")
    return a


def check_enough_records(spec: JobSpec, n_train: int, dropped: int) -> None:
    """At least `batch.global_batch_size` usable training records, else one SpecError line.
    `_build` calls it before an entry is published when nothing at all is usable, so data that
    can never train leaves no entry (a mixture's source may be smaller than one global batch: the
    mixture as a whole is checked by `load_dataset`)."""
    if n_train >= spec.batch.global_batch_size:
        return
    why = (
        f" ({dropped} records dropped, nothing left to learn in them: a prompt longer than data.max_seq_len, "
        "a chat whose only assistant message opens it, an empty or identical pair)"
        if dropped
        else ""
    )
    key = "data.mix" if spec.data.mix is not None else "data.path"
    raise SpecError(
        f"{key}: {n_train} usable training records, fewer than "
        f"batch.global_batch_size={spec.batch.global_batch_size}{why}"
    )


def publish_entry(final: Path, build: Callable[[Path], None]) -> Path:
    """`build_once` for the cache entry `final` (`build` writes its files into a temporary
    directory, published by atomic rename); bad data (a SpecError) leaves nothing behind. The one
    way an entry is published: by a job (`load_dataset`) and by `rayft data prepare`."""
    try:
        return build_once(final, build, "the tokenized data")
    except SpecError:
        _remove_if_unused(final)
        raise


def _build(tmp: Path, spec: JobSpec, tokenizer, content: str) -> None:
    """Read and tokenize the spec's data into a cache entry's files under `tmp`."""
    records, eval_records = read_records(spec, tokenizer)
    splits = {
        name: (len(recs), tokenized(spec, tokenizer, recs))
        for name, recs in (("train", records), ("eval", eval_records))
    }
    write_entry(tmp, spec, content, splits)


def tokenized(spec: JobSpec, tokenizer, records: Sequence[dict]) -> Iterable[Any]:
    """What an entry holds of each record, in record order: an `Example` or None (SFT), a `Pair`
    or its drop reason (preference). The one per-record rule of every build: each record's result
    depends on that record only, so any partition of the records gives the same results."""
    d = spec.data
    if data_kind(spec) == PAIRS:
        return tokenize_pairs_iter(records, tokenizer, d.max_seq_len, spec.model.name)
    return tokenize_iter(records, tokenizer, d.max_seq_len, d.train_on, spec.model.name)


def write_entry(tmp: Path, spec: JobSpec, content: str, splits: Mapping[str, tuple[int, Iterable[Any]]]) -> None:
    """Write an entry's files under `tmp` from `splits`: for "train" then "eval", the split's
    record count and what `tokenized` yields for its records, in order. Each split's iterable is
    consumed to its end before the next is read (so both may draw from one stream). The one
    writer of every build: the same results give the same bytes, `meta.json` included."""
    meta: dict[str, Any] = {"content_hash": content, "records": splits["train"][0], "eval_records": splits["eval"][0]}
    if data_kind(spec) == PAIRS:
        return _write_pairs(tmp, spec, meta, splits)
    kept = 0
    for name in ("train", "eval"):
        w = _SplitWriter(tmp, name)
        for ex in splits[name][1]:
            if ex is not None:
                w.add(ex)
        meta[name] = w.close()
        kept += meta[name]["n"]
    meta["dropped"] = meta["records"] + meta["eval_records"] - kept
    if not meta["train"]["n"]:  # a mixture's source may hold less than a global batch, never nothing
        check_enough_records(spec, 0, meta["dropped"])
    _write_meta(tmp, meta)


def _write_pairs(tmp: Path, spec: JobSpec, meta: dict, splits: Mapping[str, tuple[int, Iterable[Any]]]) -> None:
    meta["kind"] = PAIRS
    dropped = {DROP_EMPTY: 0, DROP_IDENTICAL: 0}
    for name in ("train", "eval"):
        w = _PairWriter(tmp, name)
        for x in splits[name][1]:
            if isinstance(x, Pair):
                w.add(x)
            else:
                dropped[x] += 1
        meta[name] = w.close()
    meta["dropped"] = dropped[DROP_EMPTY] + dropped[DROP_IDENTICAL]
    meta["dropped_empty"], meta["dropped_identical"] = dropped[DROP_EMPTY], dropped[DROP_IDENTICAL]
    if not meta["train"]["n"]:
        check_enough_records(spec, 0, meta["dropped"])
    _write_meta(tmp, meta)


def _write_meta(tmp: Path, meta: dict) -> None:
    """`meta.json`, last: with every other file's size and sha256 (what `_verified` checks)."""
    meta["files"] = file_records(tmp, entry_files(meta.get("kind", SFT)))
    (tmp / "meta.json").write_text(json.dumps(meta))


def _remove_if_unused(final: Path) -> None:
    """After bad data: leave nothing behind (the lock file, and the cache root if it is empty).
    Every process reading the same data fails the same way, so no builder needs this lock."""
    if final.is_dir():
        return
    try:
        final.with_name(final.name + ".lock").unlink()
        final.parent.rmdir()
    except OSError:
        pass
