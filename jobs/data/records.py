"""Records: the formats a data source's rows may take, their checks, and the cut that bounds them.

Four formats, told apart by `record_format` (the one place that decides, in this order):

- `"messages"`: `{"messages": [{"role", "content"}, ...]}`, rendered with the model's chat
  template (`jobs.data.chat`); loss on the assistant turns;
- `"text"`: `{"text"}`, loss on all of it;
- `"prompt_completion"`: `{"prompt", "completion"}`, loss on the completion;
- `"pair"`: `{"prompt", "chosen", "rejected"}` for the preference objectives, either all strings
  (standard) or TRL's conversational form: `prompt` a list of messages ending with a user turn,
  `chosen` and `rejected` lists of assistant messages (`jobs.data.pairs` tokenizes them).

The first three are SFT records, the fourth a pair: the two *kinds* (`record_kind`) never mix in
one job's data (`jobs.data.sources` checks it). A preference job reads a record with `chosen` or
`rejected` as a pair first, because preference datasets often carry an SFT column beside the pair
(UltraFeedback's `messages`); an SFT job reads such a record as SFT, as it always has.

`data.fields` renames the user's columns to ours before a record is checked. A checked record
keeps exactly what its format needs to be tokenized (a chat record only its messages' role and
content, a pair only its three fields). Every problem is one SpecError naming where the record
came from.
"""

from __future__ import annotations

import re

from jobs.errors import SpecError
from jobs.spec import one_line

ROLES = ("system", "user", "assistant")
OUR_FIELDS = ("text", "prompt", "completion", "messages", "chosen", "rejected")
MESSAGES, TEXT, PROMPT_COMPLETION, PAIR = "messages", "text", "prompt_completion", "pair"
PAIR_FIELDS = ("prompt", "chosen", "rejected")
SFT, PAIRS = "sft", "pairs"  # the two kinds of data (`record_kind`): one job's records are all one kind
# Each record's text fields are cut to `char_bound` characters before they are kept or tokenized,
# so memory and tokenizer time are bounded by max_seq_len, never by what one line holds.
TEXT_FIELDS = ("text", "prompt", "completion")
_SURROGATE = re.compile("[\ud800-\udfff]")


def record_format(rec: dict, pairs: bool = False) -> str | None:
    """`MESSAGES`, `TEXT`, `PROMPT_COMPLETION` or `PAIR` (the first that `rec`'s keys fit, in that
    order; with `pairs`, a preference job's records, `PAIR` first), or None when it fits none. A
    record with `chosen` or `rejected` is a pair, so a missing third field is named, not guessed
    at. Checking and tokenizing both decide through here."""
    is_pair = "chosen" in rec or "rejected" in rec
    if pairs and is_pair:
        return PAIR
    if "messages" in rec:
        return MESSAGES
    if "text" in rec:
        return TEXT
    if "prompt" in rec and "completion" in rec:
        return PROMPT_COMPLETION
    return PAIR if is_pair else None


def record_kind(fmt: str | None) -> str:
    """`PAIRS` for the pair format, `SFT` for the others."""
    return PAIRS if fmt == PAIR else SFT


def check_record(rec, where: str, fields: dict | None = None, pairs: bool = False) -> dict:
    """`rec` with `fields` renamed, checked to be one of the four formats (`pairs`: read as a
    preference job reads it, see `record_format`); a SpecError otherwise."""
    if not isinstance(rec, dict):
        raise SpecError(f"{where}: expected a JSON object")
    rec = _rename(rec, where, fields)
    fmt = record_format(rec, pairs)
    if fmt == PAIR:
        return _check_pair(rec, where)
    if fmt is None and pairs:
        raise SpecError(
            f'{where}: expected a pair {{"prompt": ..., "chosen": ..., "rejected": ...}} '
            "(data.fields maps other column names onto these)"
        )
    if fmt == MESSAGES:
        _check_messages(rec["messages"], where)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]}
    if fmt == TEXT:
        if not isinstance(rec["text"], str):
            raise SpecError(f'{where}: "text" must be a string')
    elif fmt == PROMPT_COMPLETION:
        if not (isinstance(rec["prompt"], str) and isinstance(rec["completion"], str)):
            raise SpecError(f'{where}: "prompt" and "completion" must be strings')
    else:
        raise SpecError(
            f'{where}: expected {{"text": ...}}, {{"prompt": ..., "completion": ...}} or '
            f'{{"messages": [...]}} (data.fields maps other column names onto these)'
        )
    for k in TEXT_FIELDS:
        if isinstance(rec.get(k), str) and _SURROGATE.search(rec[k]):
            raise SpecError(f'{where}: "{k}" is not valid Unicode (an unpaired surrogate)')
    return rec


def _rename(rec: dict, where: str, fields: dict | None) -> dict:
    if not fields:
        return rec
    for ours, theirs in fields.items():
        if theirs not in rec:
            raise SpecError(f"{where}: no field {theirs!r} (data.fields.{ours} names it)")
    # Every value is read from the record as given, so two of our fields may name one column and
    # two fields may swap columns; a renamed column is not kept under its own name as well.
    out = {k: v for k, v in rec.items() if k in fields or k not in fields.values()}
    out.update({ours: rec[theirs] for ours, theirs in fields.items()})
    return out


def _check_messages(messages, where: str) -> None:
    _check_message_list(messages, where, "messages")
    if not any(m["role"] == "assistant" for m in messages):
        raise SpecError(f"{where}: a conversation without an assistant turn (nothing to learn)")


def _check_message_list(messages, where: str, name: str) -> None:
    """`messages` (the field `name`) is a non-empty list of {"role", "content"} with known roles
    and string contents."""
    if not isinstance(messages, list) or not messages:
        raise SpecError(f'{where}: "{name}" must be a non-empty list of {{"role", "content"}} objects')
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise SpecError(f'{where}: {name}[{j}] must be an object with "role" and "content"')
        if m["role"] not in ROLES:
            raise SpecError(
                f"{where}: {name}[{j}]: unknown role {one_line(repr(m['role']))[:40]} "
                f"(expected one of {', '.join(ROLES)})"
            )
        if not isinstance(m["content"], str):
            raise SpecError(f'{where}: {name}[{j}]: "content" must be a string')
        if _SURROGATE.search(m["content"]):
            raise SpecError(f'{where}: {name}[{j}]: "content" is not valid Unicode (an unpaired surrogate)')


def _check_pair(rec: dict, where: str) -> dict:
    """A pair's three fields: all strings, or all message lists (the prompt ending with a user
    turn, each response assistant messages only); the record reduced to them."""
    missing = [k for k in PAIR_FIELDS if k not in rec]
    if missing:
        raise SpecError(
            f'{where}: a pair needs "prompt", "chosen" and "rejected" (no "{missing[0]}"; '
            "data.fields maps other column names onto these)"
        )
    forms = {
        k: "string" if isinstance(rec[k], str) else "list" if isinstance(rec[k], list) else None for k in PAIR_FIELDS
    }
    for k, form in forms.items():
        if form is None:
            raise SpecError(f'{where}: "{k}" must be a string or a list of messages, not {type(rec[k]).__name__}')
    if len(set(forms.values())) > 1:
        shown = ", ".join(f"{k} a {form}" for k, form in forms.items())
        raise SpecError(
            f"{where}: a pair's prompt, chosen and rejected must be all strings or all lists of messages (here {shown})"
        )
    if forms["prompt"] == "string":
        for k in PAIR_FIELDS:
            if _SURROGATE.search(rec[k]):
                raise SpecError(f'{where}: "{k}" is not valid Unicode (an unpaired surrogate)')
        return {k: rec[k] for k in PAIR_FIELDS}
    _check_message_list(rec["prompt"], where, "prompt")
    last = rec["prompt"][-1]["role"]
    if last != "user":
        raise SpecError(
            f"{where}: prompt[{len(rec['prompt']) - 1}]: role {last!r}; a conversational prompt ends "
            "with a user message"
        )
    for k in ("chosen", "rejected"):
        _check_message_list(rec[k], where, k)
        for j, m in enumerate(rec[k]):
            if m["role"] != "assistant":
                raise SpecError(f"{where}: {k}[{j}]: role {m['role']!r}; a response is assistant message(s)")
    return {k: [{"role": m["role"], "content": m["content"]} for m in rec[k]] for k in PAIR_FIELDS}


def cut_record(rec: dict, max_chars: int | None) -> dict:
    """`rec` with every text (and every message's content) cut to `max_chars` characters; `rec`
    itself when `max_chars` is None. A pair's prompt keeps its *last* `max_chars` characters (a
    prompt is truncated from the left, `jobs.data.pairs`), its responses their first."""
    if max_chars is None:
        return rec
    if record_format(rec) == PAIR:
        return {k: _cut_field(v, max_chars, k == "prompt") for k, v in rec.items()}
    out = {k: (v[:max_chars] if k in TEXT_FIELDS else v) for k, v in rec.items()}
    if "messages" in out:
        out["messages"] = [{"role": m["role"], "content": m["content"][:max_chars]} for m in out["messages"]]
    return out


def cut_text(text: str, max_chars: int, keep_end: bool = False) -> str:
    """The first `max_chars` characters of `text` (with `keep_end`, the last)."""
    if not keep_end:
        return text[:max_chars]
    return text[max(0, len(text) - max_chars) :]


def _cut_field(value, max_chars: int, keep_end: bool):
    if isinstance(value, str):
        return cut_text(value, max_chars, keep_end)
    return [{"role": m["role"], "content": cut_text(m["content"], max_chars, keep_end)} for m in value]


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
