"""Preference pairs -> `Pair`s: the token ids of the prompt and of each response, truncated to `max_seq_len`.

Rendering:

* standard pairs (strings): P = BOS + prompt (`encode_prompt`'s rule), C = chosen + EOS,
  R = rejected + EOS, each text tokenized on its own with add_special_tokens=False (as TRL does);
* conversational pairs (message lists): the texts of `chat_pair_texts` (TRL's rule: a response is
  what the template adds after the prompt rendered with the generation prompt), each tokenized on
  its own; nothing is added: the template decides BOS and the end-of-turn tokens, as in chat SFT.

Truncation to L = `max_seq_len`, which counts P and the longer response (so each of the pair's two
rows, P + C and P + R, holds at most L tokens and its input, one shorter, fits where an SFT
sequence does): if len(P) + max(len C, len R) > L, the prompt is cut from the LEFT to

    max(L - max(len C, len R), min(len P, L // 2)) tokens

(a leading BOS stays, counted among them: the end of the prompt, next to the responses, is what
is kept, and a long prompt keeps at least half of L), then each response is cut from the RIGHT to
L - len(P kept) tokens. The rule never empties a non-empty prompt or response (L >= 2).

Dropped, and counted apart: a pair with an empty prompt or response (one that tokenizes to
nothing: an empty string where the tokenizer has no EOS, a template that renders nothing), and a
pair whose responses are identical after tokenization and truncation (the loss of such a pair is
a constant: it teaches nothing).

What one record costs is bounded by L, never by the record: the texts are cut to `char_bound`
characters before tokenizing, a prompt keeping its *last* characters (and a leading BOS text),
a response its first, so the result equals tokenizing the whole texts and truncating.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from jobs.data.chat import chat_pair_texts
from jobs.data.records import char_bound, cut_record, cut_text
from jobs.data.tokenizing import with_bos

DROP_EMPTY, DROP_IDENTICAL = "empty", "identical"  # why `tokenize_pairs_iter` dropped a pair


@dataclass(frozen=True)
class Pair:
    """One tokenized preference pair, truncated: the prompt's ids and each response's.

    A micro-batch runs it as two rows, prompt + chosen and prompt + rejected, each shifted as an
    SFT sequence is (input = row[:-1]); only the response tokens carry labels
    (`jobs.data.batches.collate_pairs`). Invariant: all three are non-empty."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]

    @property
    def n_labels(self) -> int:
        """The response tokens: the labels of both rows."""
        return len(self.chosen) + len(self.rejected)

    @property
    def n_inputs(self) -> int:
        """Input tokens of both rows: (len P + len C - 1) + (len P + len R - 1)."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected) - 2

    @property
    def length(self) -> int:
        """The longer row's input length: the row length it needs in a padded micro-batch."""
        return len(self.prompt) + max(len(self.chosen), len(self.rejected)) - 1


def truncate_pair(
    prompt: Sequence[int], chosen: Sequence[int], rejected: Sequence[int], max_seq_len: int, bos: int | None
) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) cut to `max_seq_len` by the module's rule: the prompt from the
    left (keeping a leading `bos`), then the responses from the right."""
    prompt, chosen, rejected = list(prompt), list(chosen), list(rejected)
    longer = max(len(chosen), len(rejected))
    if len(prompt) + longer <= max_seq_len:
        return prompt, chosen, rejected
    keep = max(max_seq_len - longer, min(len(prompt), max_seq_len // 2))
    if keep < len(prompt):
        if bos is not None and prompt and prompt[0] == bos:
            prompt = [bos] + (prompt[len(prompt) - keep + 1 :] if keep > 1 else [])
        else:
            prompt = prompt[len(prompt) - keep :]
    room = max_seq_len - len(prompt)
    return prompt, chosen[:room], rejected[:room]


def tokenize_pairs_iter(
    records: Sequence[dict], tokenizer, max_seq_len: int, model_name: str | None = None, chunk: int = 512
) -> Iterator[Pair | str]:
    """Per pair record, in order: its `Pair`, or why it was dropped (`DROP_EMPTY`,
    `DROP_IDENTICAL`). Records are tokenized `chunk` at a time (one batched tokenizer call per
    field)."""
    for x, _truncated in tokenize_pairs_iter_truncated(records, tokenizer, max_seq_len, model_name, chunk):
        yield x


def tokenize_pairs_iter_truncated(
    records: Sequence[dict], tokenizer, max_seq_len: int, model_name: str | None = None, chunk: int = 512
) -> Iterator[tuple[Pair | str, bool]]:
    """`tokenize_pairs_iter`'s results, each with whether truncation cut the pair (len P + the
    longer response was more than `max_seq_len`). `rayft data preview` counts what truncation cut."""
    cut = char_bound(tokenizer, max_seq_len)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    end = [eos] if eos is not None else []
    for start in range(0, len(records), chunk):
        part = [cut_record(r, cut) for r in records[start : start + chunk]]
        texts = [_texts(r, tokenizer, cut, model_name) for r in part]
        enc = [_encode_many(tokenizer, [t[j] for t in texts]) for j in range(3)]
        for i, rec in enumerate(part):
            p, c, r = enc[0][i], enc[1][i], enc[2][i]
            if isinstance(rec["prompt"], str):  # standard: BOS + prompt, each response + EOS
                p, c, r = with_bos(p, bos), c + end, r + end
            truncated = len(p) + max(len(c), len(r)) > max_seq_len
            p, c, r = truncate_pair(p, c, r, max_seq_len, bos)
            if not (p and c and r):
                yield DROP_EMPTY, truncated
            elif c == r:
                yield DROP_IDENTICAL, truncated
            else:
                yield Pair(tuple(p), tuple(c), tuple(r)), truncated


def tokenize_pairs(
    records: Sequence[dict], tokenizer, max_seq_len: int, model_name: str | None = None
) -> tuple[list[Pair], dict[str, int]]:
    """The `Pair`s of `records` that survive truncation, and how many were dropped, by reason."""
    pairs, dropped = [], {DROP_EMPTY: 0, DROP_IDENTICAL: 0}
    for x in tokenize_pairs_iter(records, tokenizer, max_seq_len, model_name):
        if isinstance(x, Pair):
            pairs.append(x)
        else:
            dropped[x] += 1
    return pairs, dropped


def _texts(rec: dict, tokenizer, cut: int, model_name: str | None) -> tuple[str, str, str]:
    """The (prompt, chosen, rejected) texts of a pair record (its fields already cut), each cut
    to `cut` characters: a prompt keeps its end, a response its beginning."""
    if isinstance(rec["prompt"], str):
        prompt, chosen, rejected = rec["prompt"], rec["chosen"], rec["rejected"]
    else:
        prompt, chosen, rejected = chat_pair_texts(tokenizer, rec["prompt"], rec["chosen"], rec["rejected"], model_name)
    return _prompt_tail(prompt, cut, tokenizer.bos_token), cut_text(chosen, cut), cut_text(rejected, cut)


def _prompt_tail(text: str, cut: int, bos_text: str | None) -> str:
    """The last `cut` characters of a prompt text, after its leading BOS text if it has one (a
    truncated prompt keeps its BOS token)."""
    if len(text) <= cut:
        return text
    head = bos_text if bos_text and text.startswith(bos_text) else ""
    return head + cut_text(text[len(head) :], cut, keep_end=True)


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
