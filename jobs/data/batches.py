"""The global-batch sequence, how one global batch is split, and a micro-batch as tensors.

A sample is an SFT `Example` or a preference `Pair` (`batch.*` then counts pairs): the sequence
and the split only count samples, and `count_labels` / `count_inputs` read the properties both
kinds have (`n_labels`, `n_inputs`); `collate` lays out Examples, `collate_pairs` Pairs.

The sequence of global batches is a pure function of (dataset size, global batch, seed): an
endless stream of per-epoch permutations, cut into consecutive global batches. How a global
batch is then split into workers x accumulation steps x micro-batches only decides *who*
computes which sample, never *which* samples form optimizer step k. That makes "accumulation ==
large batch" a testable fact and resume exact (the data position is just k).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from ..spec import JobSpec
from .pairs import Pair
from .tokenizing import IGNORE, Example


class GlobalBatches:
    """Optimizer step k -> the dataset indices of its global batch (independent of the split)."""

    def __init__(self, n_examples: int, global_batch_size: int, seed: int):
        self.n = n_examples
        self.g = global_batch_size
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._perms = {epoch: order}  # keep one epoch: steps advance monotonically
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.g
        out = []
        for pos in range(start, start + self.g):
            epoch, i = divmod(pos, self.n)
            out.append(self._perm(epoch)[i])
        return out

    def epoch_of(self, step: int) -> float:
        return step * self.g / self.n


def total_steps(spec: JobSpec, n_train: int) -> int:
    if spec.run.max_steps is not None:
        return spec.run.max_steps
    epochs = spec.run.epochs if spec.run.epochs is not None else 1.0
    return max(1, math.ceil(epochs * n_train / spec.batch.global_batch_size))


def split_window(
    indices: Sequence[int], rank: int, world_size: int, micro_batch_size: int, grad_accum_steps: int
) -> list[list[int]]:
    """Rank `rank`'s micro-batches for one global batch: micro-step j takes slot (j, rank)."""
    assert len(indices) == world_size * micro_batch_size * grad_accum_steps, "split must cover the batch"
    out = []
    for j in range(grad_accum_steps):
        start = (j * world_size + rank) * micro_batch_size
        out.append(list(indices[start : start + micro_batch_size]))
    return out


def eval_shard(n: int, rank: int, world_size: int) -> list[int]:
    return list(range(rank, n, world_size))


def count_labels(examples: Sequence[Example | Pair], indices: Sequence[int]) -> int:
    """Label tokens of the samples at `indices` (a pair's: both responses)."""
    return sum(examples[i].n_labels for i in indices)


def count_inputs(examples: Sequence[Example | Pair], indices: Sequence[int]) -> int:
    """Input tokens of the samples at `indices` (a pair's: both rows)."""
    return sum(examples[i].n_inputs for i in indices)


def collate(
    examples: Sequence[Example], pad_id: int, pin_memory: bool = False, *, pack_tokens: int = 0, row_multiple: int = 1
) -> dict[str, torch.Tensor]:
    """One micro-batch as tensors; precompute the flat positions of label tokens.

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
    """
    lengths = [len(e.input_ids) for e in examples]
    rows = pack_rows(lengths, pack_tokens) if pack_tokens else []
    packed = 0 < len(rows) < len(examples)
    if not packed:
        rows = [[i] for i in range(len(examples))]
    length = max(sum(lengths[i] for i in row) for row in rows)
    if packed:
        length = -(-length // row_multiple) * row_multiple
    input_ids, targets = _rows_tensors(examples, rows, lengths, length, pad_id)
    flat = targets.view(-1)
    label_pos = (flat != IGNORE).nonzero().squeeze(1)
    batch = {
        "input_ids": input_ids,
        "label_pos": label_pos,
        "label_ids": flat.index_select(0, label_pos),
    }
    if packed:
        batch["position_ids"], batch["seq_ids"] = _packed_positions(rows, lengths, length)
    if pin_memory:
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return batch


def collate_pairs(pairs: Sequence[Pair], pad_id: int, pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """A micro-batch of m pairs as 2m rows, so chosen and rejected go through one forward.

    Row i < m is P_i + C_i, row m + i is P_i + R_i, each shifted as an SFT sequence is (input =
    row[:-1], target = row[1:], the prompt positions without a label), right-padded with `pad_id`
    and with no attention mask, for the reason `collate` gives (causal attention and right
    padding: no real token sees a pad, and pads carry no label). `label_pos` / `label_ids` are the
    flat positions and ids of the label tokens, as in `collate`: row r's labels are exactly its
    response, at `label_pos // T == r`; `resp_len` [2m] (int64) counts each row's labels."""
    rows = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    length = max(len(prompt) + len(resp) - 1 for prompt, resp in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, (prompt, resp) in enumerate(rows):
        n = len(prompt) + len(resp) - 1
        input_ids[r, :n] = torch.tensor((prompt + resp)[:-1])
        targets[r, len(prompt) - 1 : n] = torch.tensor(resp)
    flat = targets.view(-1)
    label_pos = (flat != IGNORE).nonzero().squeeze(1)
    batch = {
        "input_ids": input_ids,
        "label_pos": label_pos,
        "label_ids": flat.index_select(0, label_pos),
        "resp_len": torch.tensor([len(resp) for _, resp in rows], dtype=torch.long),
    }
    if pin_memory:
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return batch


def _rows_tensors(
    examples: Sequence[Example], rows: list[list[int]], lengths: Sequence[int], length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, length] input ids (padded with `pad_id`) and targets (padded with IGNORE), each
    row its sequences side by side in the row's order."""
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            e, n = examples[i], lengths[i]
            input_ids[r, at : at + n] = torch.tensor(e.input_ids)
            targets[r, at : at + n] = torch.tensor(e.targets)
            at += n
    return input_ids, targets


def _packed_positions(rows: list[list[int]], lengths: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids restarting at 0 per sequence, and each token's sequence slot in its row
    (the padding after the last sequence is one more slot)."""
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    seq_ids = torch.zeros((len(rows), length), dtype=torch.int32)
    for r, row in enumerate(rows):
        at = 0
        for slot, i in enumerate(row):
            n = lengths[i]
            position_ids[r, at : at + n] = torch.arange(n)
            seq_ids[r, at : at + n] = slot
            at += n
        position_ids[r, at:] = torch.arange(length - at)
        seq_ids[r, at:] = len(row)
    return position_ids, seq_ids


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
