"""Weighted mixtures (`data.mix`): the global batches drawn from the sources by weight.

A mixture's training samples are its sources' tokenized entries side by side
(`jobs.data.cache.Concatenated`: source s holds the indices `[offset_s, offset_s + n_s)`), and
`MixtureBatches` plays the part `GlobalBatches` plays for one source: optimizer step k -> the
indices of its global batch (`index_array`: the same int64 array, which the loop groups, counts,
splits and collates as it does one source's), a pure function of (the sources' sizes, the
weights, the global batch, the seed, k). How the batch is then split over workers x accumulation
x micro-batches is the loop's business and never changes which samples form step k, so
accumulation equals the big batch and resume is exact (the data position is still just k).

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
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jobs.data.batches import GlobalBatches, count_labels
from jobs.data.cache import Dataset
from jobs.errors import SpecError

if TYPE_CHECKING:
    from jobs.spec import JobSpec


class Sampler(Protocol):
    """What the loop asks of the global-batch sequence: `GlobalBatches` or `MixtureBatches`."""

    def index_array(self, step: int) -> np.ndarray: ...

    def indices(self, step: int) -> list[int]: ...

    def epoch_of(self, step: int) -> float: ...


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
        self._perms: dict[tuple[int, int], np.ndarray] = {}

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

    def _perm(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._perms:
            order = list(range(self.sizes[s]))
            # A string seed: hashed with sha512 by `random`, the same in every process and version.
            random.Random(f"rayft-mix:{self.seed}:{s}:{epoch}").shuffle(order)
            # Steps advance monotonically: keep the epochs now in use, at most two per source.
            self._perms = {k: v for k, v in self._perms.items() if k[0] != s or k[1] >= epoch - 1}
            self._perms[key] = np.asarray(order, dtype=np.int64)
        return self._perms[key]

    def index_array(self, step: int) -> np.ndarray:
        """The global batch of `step` as an int64 array (as `GlobalBatches.index_array`): slot
        (s, j) is source s's sample j overall, its epoch j // n_s, position j % n_s."""
        slots = np.asarray(self.slots(step), dtype=np.int64).reshape(-1, 2)
        src, j = slots[:, 0], slots[:, 1]
        epoch, at = np.divmod(j, np.asarray(self.sizes, dtype=np.int64)[src])
        out = np.empty(len(src), dtype=np.int64)
        for s, e in sorted(set(zip(src.tolist(), epoch.tolist(), strict=True))):  # per source, epochs ascending
            here = (src == s) & (epoch == e)
            out[here] = self.offsets[s] + self._perm(s, e)[at[here]]
        return out

    def indices(self, step: int) -> list[int]:
        return self.index_array(step).tolist()

    def source_of(self, index: int) -> int:
        return bisect.bisect_right(self.offsets, index) - 1

    def epoch_of(self, step: int) -> float:
        """Passes over the concatenation after `step` steps (as `GlobalBatches.epoch_of`)."""
        return step * self.g / self.offsets[-1]

    def source_epochs(self, step: int) -> list[float]:
        """Each source's passes over its own samples after `step` steps."""
        return [n / size for n, size in zip(self.counts(step * self.g), self.sizes, strict=True)]


def check_every_source_sampled(batches: Sampler, sources: Sequence, steps: int) -> None:
    """Refuse a mixture whose weights leave a source without a single sample in the whole run
    (its weight is too small for steps x global batch slots): it would be tokenized, listed and
    counted, and never trained on, without a word. `sources`: each with its `name` and `weight`
    (`SourcePart`s: a token cache's, or online RL's prompts'; `steps`: the batches drawn)."""
    if not isinstance(batches, MixtureBatches):
        return
    counts = batches.counts(steps * batches.g)
    for part, n in zip(sources, counts, strict=True):
        if n == 0:
            raise SpecError(
                f"data.mix: source {part.name!r} (weight {part.weight:g}) gets no sample in this run's "
                f"{steps} steps of {batches.g} (its share of {steps * batches.g} samples rounds to 0); "
                "raise its weight, train longer, or leave it out"
            )


def batches_for(spec: JobSpec, data) -> Sampler:
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


def step_metrics(
    batches: Sampler, data: Dataset, step: int, indices: Sequence[int] | np.ndarray | None = None
) -> dict[str, float]:
    """A mixture's per-source numbers for optimizer step `step` (0-based): the samples and label
    tokens each source gave the global batch (`indices`: its samples in any order, by default
    `batches.index_array(step)`), and each source's epoch after it; {} for one source."""
    if not isinstance(batches, MixtureBatches):
        return {}
    idx = batches.index_array(step) if indices is None else np.asarray(indices, dtype=np.int64)
    source = np.searchsorted(np.asarray(batches.offsets, dtype=np.int64), idx, side="right") - 1
    out: dict[str, float] = {}
    epochs = batches.source_epochs(step + 1)
    for s, (part, epoch) in enumerate(zip(data.sources, epochs, strict=True)):
        mine = idx[source == s]
        out[f"samples/{part.name}"] = len(mine)
        out[f"label_tokens/{part.name}"] = count_labels(data.train, mine)
        out[f"epoch/{part.name}"] = epoch
    return out
