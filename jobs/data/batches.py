"""The global-batch sequence, how one global batch is split, and a micro-batch as tensors.

A sample is an SFT `Example` or a preference `Pair` (`batch.*` then counts pairs): the sequence
and the split only count samples, and `count_labels` / `count_inputs` / `group_by_length` read
the per-sample counts both kinds have (`sample_counts`: the cache's int32 arrays); `collate_at`
lays out Examples of a `TokenizedSplit`, `collate_pairs_at` Pairs of a `TokenizedPairs` (either
also of a mixture's `Concatenated` splits, which have the same arrays), each by array copies from
the memory-mapped tokens (`collate` / `collate_pairs` take lists). A step's host work is thus
numpy over index arrays, with Python per micro-batch (and per sequence only where packing places
it), never per token.

The sequence of global batches is a pure function of (dataset size, global batch, seed): an
endless stream of per-epoch permutations, cut into consecutive global batches. How a global
batch is then split into workers x accumulation steps x micro-batches only decides *who*
computes which sample, never *which* samples form optimizer step k. That makes "accumulation ==
large batch" a testable fact and resume exact (the data position is just k).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import numpy as np
import torch

from jobs.data.entry import Concatenated, Segments, TokenizedPairs, TokenizedSplit
from jobs.data.pairs import Pair
from jobs.data.records import PAIR_FIELDS
from jobs.data.tokenizing import IGNORE, Example
from jobs.spec import JobSpec


class GlobalBatches:
    """Optimizer step k -> the dataset indices of its global batch (independent of the split)."""

    def __init__(self, n_examples: int, global_batch_size: int, seed: int):
        self.n = n_examples
        self.g = global_batch_size
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            order = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)  # the order runs have always used
            self._perms = {epoch: np.asarray(order, dtype=np.int64)}  # keep one epoch: steps advance monotonically
        return self._perms[epoch]

    def index_array(self, step: int) -> np.ndarray:
        """`indices(step)` as an int64 array: positions [k*G, (k+1)*G) of the stream of epochs."""
        epoch, at = np.divmod(np.arange(step * self.g, (step + 1) * self.g, dtype=np.int64), self.n)
        out = np.empty(self.g, dtype=np.int64)
        for e in np.unique(epoch).tolist():  # ascending: one epoch, or two across an epoch's end
            here = epoch == e
            out[here] = self._perm(e)[at[here]]
        return out

    def indices(self, step: int) -> list[int]:
        return self.index_array(step).tolist()

    def epoch_of(self, step: int) -> float:
        return step * self.g / self.n


def total_steps(spec: JobSpec, n_train: int) -> int:
    if spec.run.max_steps is not None:
        return spec.run.max_steps
    epochs = spec.run.epochs if spec.run.epochs is not None else 1.0
    return max(1, math.ceil(epochs * n_train / spec.batch.global_batch_size))


def split_window(
    indices: Sequence[int] | np.ndarray, rank: int, world_size: int, micro_batch_size: int, grad_accum_steps: int
) -> np.ndarray:
    """Rank `rank`'s micro-batches for one global batch, as an int64 array [grad_accum_steps,
    micro_batch_size]: micro-step j takes slot (j, rank), the indices from (j * world_size + rank)
    * micro_batch_size on."""
    idx = np.asarray(indices, dtype=np.int64)
    assert len(idx) == world_size * micro_batch_size * grad_accum_steps, "split must cover the batch"
    return np.ascontiguousarray(idx.reshape(grad_accum_steps, world_size, micro_batch_size)[:, rank])


def eval_shard(n: int, rank: int, world_size: int) -> list[int]:
    return list(range(rank, n, world_size))


_PER_SAMPLE = {"lengths": "length", "label_tokens": "n_labels", "input_tokens": "n_inputs"}


def sample_counts(samples: Sequence[Example | Pair], what: str) -> np.ndarray:
    """Per-sample counts, one of `lengths` (the row length a padded micro-batch needs: what length
    grouping sorts by), `label_tokens`, `input_tokens`: the arrays a `TokenizedSplit` or
    `TokenizedPairs` holds (written with the tokens), or, for a plain list of Examples or Pairs
    (tests, small tools), their properties (`length`, `n_labels`, `n_inputs`) collected."""
    counts = getattr(samples, what, None)
    if counts is None:
        counts = np.fromiter((getattr(s, _PER_SAMPLE[what]) for s in samples), dtype=np.int64, count=len(samples))
    return counts


def count_labels(samples: Sequence[Example | Pair], indices: Sequence[int] | np.ndarray) -> int:
    """Label tokens of the samples at `indices` (a pair's: both responses)."""
    return int(sample_counts(samples, "label_tokens")[np.asarray(indices, dtype=np.int64)].sum(dtype=np.int64))


def count_inputs(samples: Sequence[Example | Pair], indices: Sequence[int] | np.ndarray) -> int:
    """Input tokens of the samples at `indices` (a pair's: both rows)."""
    return int(sample_counts(samples, "input_tokens")[np.asarray(indices, dtype=np.int64)].sum(dtype=np.int64))


def group_by_length(samples: Sequence[Example | Pair], indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """`indices` ordered by (the sample's length, its index): the same samples, so that
    consecutive ones -- a micro-batch -- pad little (a stable sort: repeated indices keep their
    order)."""
    idx = np.asarray(indices, dtype=np.int64)
    return idx[np.lexsort((idx, sample_counts(samples, "lengths")[idx]))]


def collate_at(
    split: TokenizedSplit | Concatenated,
    indices: Sequence[int] | np.ndarray,
    pad_id: int,
    pin_memory: bool = False,
    *,
    pack_tokens: int = 0,
    row_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """The examples of `split` at `indices` as one micro-batch of tensors; precompute the flat
    positions of label tokens.

    Default: one row per sequence, right-padded to the longest, and *no attention mask*: with
    right padding, causal attention already keeps every real token from seeing padding (pads
    only come after it), and pads carry no label, so their outputs never reach the loss or a
    gradient. SDPA then runs its mask-free causal kernel (no [B, S, S] bias, native GQA, no
    host sync in HF's mask code) on ragged batches too.

    With `pack_tokens`, the sequences are packed first-fit-decreasing into rows of at most
    `pack_tokens` tokens (`pack_rows`), with `position_ids` that restart at 0 for every
    sequence and `seq_ids` (each token's sequence slot in its row; padding is a slot of its
    own), from which the loss builds one block-diagonal causal mask: no token attends across
    sequences. Packed rows are padded to a multiple of `row_multiple` (16 on GPU, so SDPA
    uses the mask as is). If packing would leave one sequence per row, the plain layout is used.
    The samples, their positions and so the loss are the same in both layouts.

    `label_pos` lets the loss gather exactly the hidden states that have a label with an
    index computed here on the host, so the device never syncs to find them.

    Every field is one tensor (pinned with `pin_memory`), filled by array copies straight from
    the split's (memory-mapped) token arrays (a mixture's `Concatenated`: each sample from its own
    source's, `segments`): no sample becomes Python objects.
    """
    idx = np.asarray(indices, dtype=np.int64)
    lengths = split.lengths[idx].astype(np.int64)
    rows = pack_rows(lengths.tolist(), pack_tokens) if pack_tokens else []
    packed = 0 < len(rows) < len(idx)
    if not packed:
        rows = [[i] for i in range(len(idx))]
    order, row_of, at, fill = _row_layout(rows, lengths)
    length = int(fill.max())
    if packed:
        length = -(-length // row_multiple) * row_multiple
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long, pin_memory=pin_memory)
    targets = np.full(len(rows) * length, IGNORE, dtype=np.int32)
    dst, n = row_of * length + at, lengths[order]
    _copy_segments(input_ids.view(-1).numpy(), split.segments("ids", idx[order]), dst)
    _copy_segments(targets, split.segments("targets", idx[order]), dst)
    batch = {"input_ids": input_ids, **_labels(targets, pin_memory)}
    if packed:
        position_ids, seq_ids = _packed_positions(rows, n, row_of, length - fill, length)
        batch["position_ids"], batch["seq_ids"] = _tensor(position_ids, pin_memory), _tensor(seq_ids, pin_memory)
    return batch


def collate(
    examples: Sequence[Example], pad_id: int, pin_memory: bool = False, *, pack_tokens: int = 0, row_multiple: int = 1
) -> dict[str, torch.Tensor]:
    """`collate_at` of a list of Examples, in their order (tests, small tools): the same tensors."""
    return collate_at(
        TokenizedSplit.of(examples),
        range(len(examples)),
        pad_id,
        pin_memory,
        pack_tokens=pack_tokens,
        row_multiple=row_multiple,
    )


def collate_pairs_at(
    pairs: TokenizedPairs | Concatenated, indices: Sequence[int] | np.ndarray, pad_id: int, pin_memory: bool = False
) -> dict[str, torch.Tensor]:
    """A micro-batch of the m pairs of `pairs` at `indices` as 2m rows, so chosen and rejected go
    through one forward.

    Row i < m is P_i + C_i, row m + i is P_i + R_i, each shifted as an SFT sequence is (input =
    row[:-1], target = row[1:], the prompt positions without a label), right-padded with `pad_id`
    and with no attention mask, for the reason `collate_at` gives (causal attention and right
    padding: no real token sees a pad, and pads carry no label). `label_pos` / `label_ids` are the
    flat positions and ids of the label tokens, as in `collate_at`: row r's labels are exactly its
    response, at `label_pos // T == r`; `resp_len` [2m] (int64) counts each row's labels. Filled
    by array copies from the pairs' token arrays, as `collate_at` is."""
    idx = np.asarray(indices, dtype=np.int64)
    m = len(idx)
    seg = {f: pairs.segments(f, idx) for f in PAIR_FIELDS}
    size = {f: seg[f].sizes for f in PAIR_FIELDS}
    prompt, resp_len = np.concatenate([size["prompt"]] * 2), np.concatenate([size["chosen"], size["rejected"]])
    length = int((prompt + resp_len - 1).max())
    row = np.arange(2 * m, dtype=np.int64) * length
    input_ids = torch.full((2 * m, length), pad_id, dtype=torch.long, pin_memory=pin_memory)
    flat = input_ids.view(-1).numpy()
    targets = np.full(2 * m * length, IGNORE, dtype=np.int32)
    for f, rows in (("chosen", row[:m]), ("rejected", row[m:])):
        # input: P + response[:-1]; targets: the response, from the prompt's last position on
        _copy_segments(flat, seg["prompt"], rows)
        _copy_segments(flat, seg[f], rows + size["prompt"], size[f] - 1)
        _copy_segments(targets, seg[f], rows + size["prompt"] - 1)
    return {"input_ids": input_ids, **_labels(targets, pin_memory), "resp_len": _tensor(resp_len, pin_memory)}


def collate_pairs(pairs: Sequence[Pair], pad_id: int, pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """`collate_pairs_at` of a list of Pairs, in their order (`rayft eval`, tests): the same tensors."""
    return collate_pairs_at(TokenizedPairs.of(pairs), range(len(pairs)), pad_id, pin_memory)


def _tensor(a: np.ndarray, pin_memory: bool) -> torch.Tensor:
    t = torch.from_numpy(a)
    return t.pin_memory() if pin_memory else t


def _labels(targets: np.ndarray, pin_memory: bool) -> dict[str, torch.Tensor]:
    """`label_pos` (the flat positions of `targets`, the int32 [rows * length] label layout,
    that are not IGNORE, ascending) and `label_ids` (those targets), both int64 tensors."""
    label_pos = np.flatnonzero(targets != IGNORE)
    label_ids = targets[label_pos].astype(np.int64)
    return {"label_pos": _tensor(label_pos, pin_memory), "label_ids": _tensor(label_ids, pin_memory)}


def _copy_segments(dst: np.ndarray, src: Segments, dst_starts: np.ndarray, sizes: np.ndarray | None = None) -> None:
    """dst[dst_starts[k] : + n_k] = segment k of `src` (its first n_k tokens; n_k = `sizes[k]`,
    by default the whole segment) for every k: one slice copy per segment (a sequence, or a pair's
    field), each from the array its sample lies in (a mixture's: its source's), no Python per
    token. (Slices, not one fancy-indexed gather: for sequences of hundreds of tokens and more,
    measured 5x faster.) An `np.memmap` source is sliced as a plain array over the same map: a
    memmap's slices each run a Python finalizer."""
    arrays = [a.view(np.ndarray) for a in src.arrays]
    n_of = src.sizes if sizes is None else np.asarray(sizes)
    for p, a, b, n in zip(src.part.tolist(), src.starts.tolist(), dst_starts.tolist(), n_of.tolist(), strict=True):
        dst[b : b + n] = arrays[p][a : a + n]


def _row_layout(rows: list[list[int]], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where each sequence of `rows` (lists of positions into `lengths`) goes, the rows' sequences
    side by side in each row's order: (`order`, the positions in row order; `row_of` and `at`,
    each one's row and first column; `fill`, each row's tokens)."""
    per_row = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    order = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(per_row.sum()))
    n = lengths[order]
    end = np.cumsum(n)
    first = np.cumsum(per_row) - per_row  # each row's first sequence, in `order`
    row_start = end[first] - n[first]
    return (
        order,
        np.repeat(np.arange(len(rows)), per_row),
        end - n - np.repeat(row_start, per_row),
        end[first + per_row - 1] - row_start,
    )


def _packed_positions(
    rows: list[list[int]], n: np.ndarray, row_of: np.ndarray, pad: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Position ids restarting at 0 per sequence, and each token's sequence slot in its row
    (the padding after the last sequence is one more slot, its positions counting from 0 too).
    `n`, `row_of`: each sequence's length and row, in row order; `pad`: each row's padding."""
    per_row = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    # segments in row-major order -- each row's sequences, then its padding -- tile the rows exactly
    seq_at = np.arange(len(n)) + row_of
    pad_at = np.cumsum(per_row) + np.arange(len(rows))
    seg, slot = np.empty(len(n) + len(rows), dtype=np.int64), np.empty(len(n) + len(rows), dtype=np.int64)
    seg[seq_at], seg[pad_at] = n, pad
    slot[seq_at], slot[pad_at] = np.arange(len(n)) - np.repeat(np.cumsum(per_row) - per_row, per_row), per_row
    position_ids = np.arange(len(rows) * length, dtype=np.int64) - np.repeat(np.cumsum(seg) - seg, seg)
    return position_ids.reshape(len(rows), length), np.repeat(slot, seg).astype(np.int32).reshape(len(rows), length)


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices into rows of at most `capacity` tokens (a longer sequence
    gets a row of its own). Deterministic: ties keep index order; each row lists its indices
    in ascending order."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return [sorted(row) for row in rows]


def equal_micro_batches(n: int, rank: int, world_size: int, micro_batch_size: int) -> list[tuple[list[int], bool]]:
    """This rank's share of `n` items (`eval_shard`) in micro-batches, as (indices, counted).
    Every rank gets the same number of micro-batches (under FSDP each forward is a collective):
    a rank whose share runs out repeats its last micro-batch (or item 0), uncounted."""
    mine = eval_shard(n, rank, world_size)
    out = [(mine[s : s + micro_batch_size], True) for s in range(0, len(mine), micro_batch_size)]
    per_rank = -(-n // world_size)
    while len(out) < -(-per_rank // micro_batch_size):
        out.append((out[-1][0] if out else [0], False))
    return out
