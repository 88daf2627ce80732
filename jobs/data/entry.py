"""A tokenized cache entry's files, read and written: `TokenizedSplit` (an SFT split: flat token
arrays, offsets and per-sample counts, memory-mapped), `TokenizedPairs` (preference pairs, per
field), their writers, and `Concatenated` (a mixture's entries side by side). The entry's layout,
its key and its checks are `jobs.data.cache`'s and `jobs.data.verify`'s; this module only maps and
writes the arrays, so the step's host work reads arrays and never turns a sample into Python objects."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jobs.data.pairs import Pair
from jobs.data.records import PAIR_FIELDS
from jobs.data.tokenizing import IGNORE, Example

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
