"""Records -> Examples: token ids and their shifted labels, truncated to `max_seq_len`.

text: BOS + text + EOS, all labelled. prompt/completion: BOS + prompt + completion + EOS, labels
on completion + EOS. messages: the chat template's rendering, labels on the spans of
`chat_spans` (the template decides BOS and end-of-turn tokens; nothing is added). Every text is
cut to `char_bound` characters before it reaches the tokenizer, so what one record costs is
bounded by max_seq_len; the result equals tokenizing the whole text and truncating.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from jobs.data.chat import chat_spans
from jobs.data.records import MESSAGES, PROMPT_COMPLETION, TEXT, char_bound, record_format

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One tokenized sequence, already shifted: `targets[i]` is the label for `input_ids[i]`."""

    input_ids: tuple[int, ...]
    targets: tuple[int, ...]

    @property
    def n_labels(self) -> int:
        return sum(t != IGNORE for t in self.targets)

    @property
    def n_inputs(self) -> int:
        """Input tokens the model runs on (a preference `Pair` counts both of its rows)."""
        return len(self.input_ids)

    @property
    def length(self) -> int:
        """The row length it needs in a padded micro-batch: what length grouping sorts by."""
        return len(self.input_ids)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """BOS + text, unless the text already starts with it (a chat-templated prompt does).
    Training and `rayft eval` both encode prompts through here, so they agree."""
    return with_bos(tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.bos_token_id)


def with_bos(ids: Sequence[int], bos: int | None) -> list[int]:
    """`ids` with `bos` in front, unless they start with it (or the tokenizer has none): the rule
    `encode_prompt` applies, for ids tokenized in a batch."""
    ids = list(ids)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def tokenize_iter(
    records: Sequence[dict],
    tokenizer,
    max_seq_len: int,
    train_on: str = "assistant",
    model_name: str | None = None,
    chunk: int = 512,
) -> Iterable[Example | None]:
    """One Example per record (None where truncation leaves no label), in record order (see the
    module docstring for what each format becomes). Records are tokenized `chunk` at a time (one
    batched call of the fast tokenizer)."""
    for ex, _truncated in tokenize_iter_truncated(records, tokenizer, max_seq_len, train_on, model_name, chunk):
        yield ex


def tokenize_iter_truncated(
    records: Sequence[dict],
    tokenizer,
    max_seq_len: int,
    train_on: str = "assistant",
    model_name: str | None = None,
    chunk: int = 512,
) -> Iterator[tuple[Example | None, bool]]:
    """`tokenize_iter`'s results, each with whether truncation cut the record (its sequence had
    more than `max_seq_len` tokens; a text cut to `char_bound` characters has more, so the cut
    before tokenizing does not hide one). `rayft data preview` counts what truncation cut."""
    cut = char_bound(tokenizer, max_seq_len)
    for start in range(0, len(records), chunk):
        for seq, labels in _chunk_sequences(records[start : start + chunk], tokenizer, cut, train_on, model_name):
            truncated = len(seq) > max_seq_len
            seq, labels = seq[:max_seq_len], labels[:max_seq_len]
            ex = Example(tuple(seq[:-1]), tuple(labels[1:]))
            yield (ex if ex.n_labels else None), truncated  # a prompt longer than max_seq_len leaves nothing to learn


def tokenize(
    records: Sequence[dict], tokenizer, max_seq_len: int, train_on: str = "assistant", model_name: str | None = None
) -> list[Example]:
    """The Examples of `records` that keep a label after truncation (see `tokenize_iter`)."""
    return [e for e in tokenize_iter(records, tokenizer, max_seq_len, train_on, model_name) if e is not None]


def _chunk_sequences(
    part: Sequence[dict], tokenizer, cut: int, train_on: str, model_name: str | None
) -> Iterator[tuple[list[int], list[int]]]:
    """(token ids, labels) of each record of `part`, in order, before truncation: texts cut to
    `cut` characters, then one batched tokenizer call per kind of text."""
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    formats = [record_format(r) for r in part]
    chats = [i for i, f in enumerate(formats) if f == MESSAGES]
    rendered = {i: chat_spans(tokenizer, part[i]["messages"], train_on, model_name, cut) for i in chats}
    firsts = [
        (r["text"] if f == TEXT else r["prompt"])[:cut] if f != MESSAGES else ""
        for r, f in zip(part, formats, strict=True)
    ]
    enc1 = _encode_many(tokenizer, firsts)["input_ids"]
    comps = [r["completion"][:cut] if f == PROMPT_COMPLETION else "" for r, f in zip(part, formats, strict=True)]
    enc2 = _encode_many(tokenizer, comps)["input_ids"]
    chat_enc = _encode_many(tokenizer, [rendered[i][0][:cut] for i in chats], offsets=True)
    chat_at = {i: j for j, i in enumerate(chats)}
    for i, f in enumerate(formats):
        if f == MESSAGES:
            j = chat_at[i]
            seq = list(chat_enc["input_ids"][j])
            yield seq, _labels_from_spans(chat_enc["offset_mapping"][j], seq, rendered[i][1])
            continue
        head = with_bos(enc1[i], bos)
        if f == TEXT:
            yield head + [eos], head + [eos]
        else:
            c = list(enc2[i])
            yield head + c + [eos], [IGNORE] * len(head) + c + [eos]


def _labels_from_spans(offsets, ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    labels = [IGNORE] * len(ids)
    k = 0
    for j, (start, _end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= start < spans[k][1]:
            labels[j] = ids[j]
    return labels


def _encode_many(tokenizer, texts: list[str], offsets: bool = False):
    if not texts:
        return {"input_ids": [], "offset_mapping": []}
    return tokenizer(texts, add_special_tokens=False, return_offsets_mapping=offsets)
