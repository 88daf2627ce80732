"""Weighted mixtures (`data.mix`): the sources side by side, and the global batches drawn from them by weight.

A mixture's training samples are its sources' tokenized entries concatenated (`Concatenated`:
source s holds the indices `[offset_s, offset_s + n_s)`), and `MixtureBatches` plays the part
`GlobalBatches` plays for one source: optimizer step k -> the indices of its global batch, a pure
function of (the sources' sizes, the weights, the global batch, the seed, k). How the batch is
then split over workers x accumulation x micro-batches is the loop's business and never changes
which samples form step k, so accumulation equals the big batch and resume is exact (the data
position is still just k).

The sampling rule (Sainte-Lague's, as a stream of sample slots):

* Source s, of weight w_s, owns the slot times t(s, j) = (j + 1/2) / w_s for j = 0, 1, 2, ...
  All sources' slots merged in the order of (t, s) -- equal times go to the lower source index --
  form one endless sequence; the global batch of step k is its slots [k*G, (k+1)*G), in that order.
* Source s's j-th slot takes its sample j of its own stream: epoch e = j // n_s, position
  j % n_s of a permutation of its n_s samples drawn for (run.seed, s, e). So each source has its
  own epochs: a small source repeats (a new permutation each epoch), a large one is not used up
  before it, and within one epoch of a source no sample comes twice.

After T slots source s has had N_s(T) of them, the Sainte-Lague apportionment of T seats by the
weights, which stays within (1 + S * p_s) / 2 samples of its share T * p_s for S sources, p_s =
w_s / sum(w), at every T (each N_s is round(x * w_s) at the time x of the T-th slot). Over 100
steps of G = 8 that is within 1.5 of 800 * p_s for two sources. The counts are exact (the weights
are taken as exact fractions and compared in integers), so every rank and every resumed run draws
the same batches, and `indices(k)` costs O(G log S) whatever k is (no walk from step 0).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Protocol

from .batches import GlobalBatches, count_labels
from .pairs import Pair
from .tokenizing import Example


class Sampler(Protocol):
    """What the loop asks of the global-batch sequence: `GlobalBatches` or `MixtureBatches`."""

    def indices(self, step: int) -> list[int]: ...

    def epoch_of(self, step: int) -> float: ...


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


class Concatenated(Sequence):
    """Several sequences of samples read as one (part i's sample j at `offsets[i] + j`), without
    copying: each part stays memory-mapped, and an index touches only the part it falls in."""

    def __init__(self, parts: Sequence[Sequence[Example | Pair]]):
        self.parts = list(parts)
        self.offsets = [0]
        for p in self.parts:
            self.offsets.append(self.offsets[-1] + len(p))

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        part = bisect.bisect_right(self.offsets, i) - 1
        return self.parts[part][i - self.offsets[part]]


def integer_weights(weights: Sequence[float]) -> list[int]:
    """The weights as integers in the same exact ratios (each float is an exact binary fraction)."""
    fr = [Fraction(w) for w in weights]
    if not fr or any(w <= 0 for w in fr):
        raise ValueError("mixture weights must be positive")
    scale = math.lcm(*(w.denominator for w in fr))
    ints = [int(w * scale) for w in fr]
    g = math.gcd(*ints)
    return [w // g for w in ints]


class MixtureBatches:
    """Optimizer step k -> the indices (into the concatenated sources) of its global batch, drawn by
    weight. The rule, and why it is exact and split-independent, is in the module docstring."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int, seed: int):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError("one size and one weight per source")
        if any(n <= 0 for n in sizes):
            raise ValueError("every mixture source needs at least one sample")
        self.sizes = list(sizes)
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.a = integer_weights(weights)  # slot times (2j + 1) / (2 a_s): compared in integers
        self.g = global_batch_size
        self.seed = seed
        self._perms: dict[tuple[int, int], list[int]] = {}

    # ---- the slot sequence ------------------------------------------------------------------

    def _before(self, p: int, q: int) -> list[int]:
        """Per source, its slots with time < p / q: #{j >= 0 : (2j + 1) q < 2 p a_s}."""
        out = []
        for a in self.a:
            n = 2 * p * a - q  # j < n / (2q)
            out.append(max(0, -(-n // (2 * q))))
        return out

    def _time(self, s: int, j: int) -> Fraction:
        return Fraction(2 * j + 1, 2 * self.a[s])

    def counts(self, total: int) -> list[int]:
        """N_s(total): how many of the first `total` slots each source has."""
        # Every slot with a time below total / sum(a) precedes every other: a prefix of the merged
        # sequence, within S / 2 slots of `total`; the rest is a few steps either way.
        n = self._before(total, sum(self.a))
        have = sum(n)
        while have < total:  # add the next slots: smallest (time, source) first
            s = min(range(len(n)), key=lambda s: (self._time(s, n[s]), s))
            n[s] += 1
            have += 1
        while have > total:  # drop the last slots: largest (time, source) first
            s = max((s for s in range(len(n)) if n[s]), key=lambda s: (self._time(s, n[s] - 1), s))
            n[s] -= 1
            have -= 1
        return n

    def slots(self, step: int) -> list[tuple[int, int]]:
        """(source, j) of the global batch's slots in their order: source s's j-th sample overall."""
        n = self.counts(step * self.g)
        heap = [(self._time(s, n[s]), s) for s in range(len(n))]
        heapq.heapify(heap)
        out = []
        for _ in range(self.g):
            _, s = heapq.heappop(heap)
            out.append((s, n[s]))
            n[s] += 1
            heapq.heappush(heap, (self._time(s, n[s]), s))
        return out

    # ---- samples ----------------------------------------------------------------------------

    def _perm(self, s: int, epoch: int) -> list[int]:
        key = (s, epoch)
        if key not in self._perms:
            order = list(range(self.sizes[s]))
            # A string seed: hashed with sha512 by `random`, the same in every process and version.
            random.Random(f"rayft-mix:{self.seed}:{s}:{epoch}").shuffle(order)
            # Steps advance monotonically: keep the epochs now in use, at most two per source.
            self._perms = {k: v for k, v in self._perms.items() if k[0] != s or k[1] >= epoch - 1}
            self._perms[key] = order
        return self._perms[key]

    def sample(self, s: int, j: int) -> int:
        """The index of source s's j-th sample overall: its epoch j // n_s, position j % n_s."""
        epoch, i = divmod(j, self.sizes[s])
        return self.offsets[s] + self._perm(s, epoch)[i]

    def indices(self, step: int) -> list[int]:
        return [self.sample(s, j) for s, j in self.slots(step)]

    def source_of(self, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1

    def epoch_of(self, step: int) -> float:
        """Passes over the concatenation after `step` steps (as `GlobalBatches.epoch_of`)."""
        return step * self.g / self.offsets[-1]

    def source_epochs(self, step: int) -> list[float]:
        """Each source's passes over its own samples after `step` steps."""
        return [n / size for n, size in zip(self.counts(step * self.g), self.sizes, strict=True)]


def batches_for(spec, data) -> Sampler:
    """The run's global-batch sequence: by weight over the sources for a mixture (`data.sources`),
    else `GlobalBatches` over the one dataset."""
    if data.sources:
        return MixtureBatches(
            [p.n_train for p in data.sources],
            [p.weight for p in data.sources],
            spec.batch.global_batch_size,
            spec.run.seed,
        )
    return GlobalBatches(len(data.train), spec.batch.global_batch_size, spec.run.seed)


def step_metrics(batches: Sampler, data, step: int, indices: Sequence[int] | None = None) -> dict[str, float]:
    """A mixture's per-source numbers for optimizer step `step` (0-based): the samples and label
    tokens each source gave the global batch, and each source's epoch after it; {} for one source."""
    if not isinstance(batches, MixtureBatches):
        return {}
    idx = batches.indices(step) if indices is None else indices
    mine: list[list[int]] = [[] for _ in data.sources]
    for i in idx:
        mine[batches.source_of(i)].append(i)
    out: dict[str, float] = {}
    epochs = batches.source_epochs(step + 1)
    for part, got, epoch in zip(data.sources, mine, epochs, strict=True):
        out[f"samples/{part.name}"] = len(got)
        out[f"label_tokens/{part.name}"] = count_labels(data.train, got)
        out[f"epoch/{part.name}"] = epoch
    return out
