"""JSONL data, tokenization, and the global-batch sequence.

The sequence of global batches is a pure function of (dataset size, global batch, seed):
an endless stream of per-epoch permutations, cut into consecutive global batches. How a
global batch is then split into workers x accumulation steps x micro-batches only decides
*who* computes which sample, never *which* samples form optimizer step k. That makes
"accumulation == large batch" a testable fact and resume exact (the data position is just k).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .spec import JobSpec, SpecError, one_line, path_problem

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One tokenized sequence, already shifted: `targets[i]` is the label for `input_ids[i]`."""

    input_ids: tuple[int, ...]
    targets: tuple[int, ...]

    @property
    def n_labels(self) -> int:
        return sum(t != IGNORE for t in self.targets)


# Each record's text fields are cut to `char_bound` characters before they are kept or tokenized,
# so memory and tokenizer time are bounded by max_seq_len, never by what one line holds.
TEXT_FIELDS = ("text", "prompt", "completion")
_SURROGATE = re.compile("[\ud800-\udfff]")


def read_jsonl(path: str, key: str = "data.path", max_chars: Optional[int] = None) -> list[dict]:
    """The records of a JSONL file, each checked for shape; a problem is one SpecError naming
    `key`, the file and the line. Read line by line; with `max_chars`, each record's text fields
    are cut to that many characters as soon as the line is parsed (see `char_bound`)."""
    records = []
    shown = one_line(str(path))
    problem = path_problem(path)
    if problem:
        raise SpecError(f"{key}: {problem}")
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = _parse_record(line, f"{key}: {shown} line {i}")
                if max_chars is not None:
                    rec = {k: (v[:max_chars] if k in TEXT_FIELDS else v) for k, v in rec.items()}
                records.append(rec)
    except UnicodeDecodeError:
        raise SpecError(f"{key}: {shown}: not UTF-8 text") from None
    except OSError as e:
        raise SpecError(f"{key}: {shown}: cannot be read ({e.strerror or e})") from None
    if not records:
        raise SpecError(f"{key}: {shown}: no records")
    return records


def _parse_record(line: str, where: str) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise SpecError(f"{where}: nested too deeply to be a record") from None
    except ValueError as e:  # e.g. an integer longer than Python converts
        raise SpecError(f"{where}: not a usable JSON value ({one_line(str(e))[:100]})") from None
    if not isinstance(rec, dict):
        raise SpecError(f"{where}: expected a JSON object")
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise SpecError(f"{where}: \"text\" must be a string")
    elif "prompt" in rec and "completion" in rec:
        if not (isinstance(rec["prompt"], str) and isinstance(rec["completion"], str)):
            raise SpecError(f"{where}: \"prompt\" and \"completion\" must be strings")
    else:
        raise SpecError(f"{where}: expected {{\"text\": ...}} or {{\"prompt\": ..., \"completion\": ...}}")
    for k in TEXT_FIELDS:
        if isinstance(rec.get(k), str) and _SURROGATE.search(rec[k]):
            raise SpecError(f"{where}: \"{k}\" is not valid Unicode (an unpaired surrogate)")
    return rec


def longest_token_chars(tokenizer) -> int:
    """The most characters any one token of `tokenizer`'s vocabulary stands for (vocabulary
    strings: byte-level BPE spells each byte as one character, so this bounds bytes too)."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 64  # a tokenizer without a vocabulary listing: a generous default
    return max((len(t) for t in vocab), default=1) or 1


def char_bound(tokenizer, max_seq_len: int) -> int:
    """How many characters of a text can matter for its first `max_seq_len` tokens, with a margin.

    Each token covers at most `longest_token_chars` characters of (normalized) text, so the first
    `max_seq_len` tokens lie within that many times as many characters; the margin (16 more
    tokens, then x2) keeps the cut away from the last kept token, where a subword tokenizer may
    split a cut word differently, and covers normalizers that shrink text."""
    return 2 * (max_seq_len + 16) * longest_token_chars(tokenizer)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """BOS + text, unless the text already starts with it (a chat-templated prompt does).
    Training and `rayft eval` both encode prompts through here, so they agree."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def tokenize(records: Sequence[dict], tokenizer, max_seq_len: int) -> list[Example]:
    """BOS + prompt + completion + EOS, truncated; labels only on completion (or all of `text`).

    Each text is cut to `char_bound` characters before it reaches the tokenizer, so what one
    record costs is bounded by max_seq_len; the result equals tokenizing the whole text and
    truncating (the kept tokens lie well inside the cut)."""
    eos = tokenizer.eos_token_id
    cut = char_bound(tokenizer, max_seq_len)
    out = []
    for rec in records:
        if "text" in rec:
            seq = encode_prompt(tokenizer, rec["text"][:cut]) + [eos]
            labels = list(seq)
        else:
            head = encode_prompt(tokenizer, rec["prompt"][:cut])
            c = tokenizer(rec["completion"][:cut], add_special_tokens=False)["input_ids"]
            seq = head + c + [eos]
            labels = [IGNORE] * len(head) + c + [eos]
        seq, labels = seq[:max_seq_len], labels[:max_seq_len]
        ex = Example(tuple(seq[:-1]), tuple(labels[1:]))
        if ex.n_labels:  # a prompt longer than max_seq_len leaves nothing to learn
            out.append(ex)
    return out


@dataclass
class Dataset:
    train: list[Example]
    eval: list[Example]
    dropped: int  # records with no label token left after truncation


def load_dataset(spec: JobSpec, tokenizer) -> Dataset:
    cut = char_bound(tokenizer, spec.data.max_seq_len)
    records: list[dict] = []
    for i, p in enumerate(spec.data.path):
        records += read_jsonl(p, "data.path" if len(spec.data.path) == 1 else f"data.path.{i}", max_chars=cut)
    eval_records: list[dict] = []
    if spec.data.eval_path:
        eval_records = read_jsonl(spec.data.eval_path, "data.eval_path", max_chars=cut)
    elif spec.data.eval_fraction > 0:
        order = list(range(len(records)))
        random.Random(spec.run.seed).shuffle(order)
        n_eval = max(1, int(round(len(records) * spec.data.eval_fraction)))
        held = set(order[:n_eval])
        eval_records = [r for i, r in enumerate(records) if i in held]
        records = [r for i, r in enumerate(records) if i not in held]
    train = tokenize(records, tokenizer, spec.data.max_seq_len)
    evals = tokenize(eval_records, tokenizer, spec.data.max_seq_len)
    if len(train) < spec.batch.global_batch_size:
        raise SpecError(
            f"data.path: {len(train)} usable training records, fewer than "
            f"batch.global_batch_size={spec.batch.global_batch_size}"
        )
    return Dataset(train, evals, dropped=len(records) + len(eval_records) - len(train) - len(evals))


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


def split_window(indices: Sequence[int], rank: int, world_size: int, micro_batch_size: int,
                 grad_accum_steps: int) -> list[list[int]]:
    """Rank `rank`'s micro-batches for one global batch: micro-step j takes slot (j, rank)."""
    assert len(indices) == world_size * micro_batch_size * grad_accum_steps, "split must cover the batch"
    out = []
    for j in range(grad_accum_steps):
        start = (j * world_size + rank) * micro_batch_size
        out.append(list(indices[start:start + micro_batch_size]))
    return out


def collate(examples: Sequence[Example], pad_id: int, pin_memory: bool = False, *,
            pack_tokens: int = 0, row_multiple: int = 1) -> dict[str, torch.Tensor]:
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
    m = len(rows)
    input_ids = torch.full((m, length), pad_id, dtype=torch.long)
    targets = torch.full((m, length), IGNORE, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            e, n = examples[i], lengths[i]
            input_ids[r, at:at + n] = torch.tensor(e.input_ids)
            targets[r, at:at + n] = torch.tensor(e.targets)
            at += n
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


def _packed_positions(rows: list[list[int]], lengths: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids restarting at 0 per sequence, and each token's sequence slot in its row
    (the padding after the last sequence is one more slot)."""
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    seq_ids = torch.zeros((len(rows), length), dtype=torch.int32)
    for r, row in enumerate(rows):
        at = 0
        for slot, i in enumerate(row):
            n = lengths[i]
            position_ids[r, at:at + n] = torch.arange(n)
            seq_ids[r, at:at + n] = slot
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


def count_labels(examples: Sequence[Example], indices: Sequence[int]) -> int:
    return sum(examples[i].n_labels for i in indices)


def count_inputs(examples: Sequence[Example], indices: Sequence[int]) -> int:
    return sum(len(examples[i].input_ids) for i in indices)


def total_steps(spec: JobSpec, n_train: int) -> int:
    if spec.run.max_steps is not None:
        return spec.run.max_steps
    epochs = spec.run.epochs if spec.run.epochs is not None else 1.0
    return max(1, math.ceil(epochs * n_train / spec.batch.global_batch_size))


def eval_shard(n: int, rank: int, world_size: int) -> list[int]:
    return list(range(rank, n, world_size))
