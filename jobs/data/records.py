"""Records: the formats a data source's rows may take, their checks, and the cut that bounds them.

Three formats, told apart by `record_format` (the one place that decides, in this order):

- `"messages"`: `{"messages": [{"role", "content"}, ...]}`, rendered with the model's chat
  template (`jobs.data.chat`); loss on the assistant turns;
- `"text"`: `{"text"}`, loss on all of it;
- `"prompt_completion"`: `{"prompt", "completion"}`, loss on the completion.

`data.fields` renames the user's columns to ours before a record is checked. A checked record
keeps exactly what its format needs to be tokenized (a chat record only its messages' role and
content). Every problem is one SpecError naming where the record came from.
"""

from __future__ import annotations

import re
from typing import Optional

from ..errors import SpecError
from ..spec import one_line

ROLES = ("system", "user", "assistant")
OUR_FIELDS = ("text", "prompt", "completion", "messages")
MESSAGES, TEXT, PROMPT_COMPLETION = "messages", "text", "prompt_completion"
# Each record's text fields are cut to `char_bound` characters before they are kept or tokenized,
# so memory and tokenizer time are bounded by max_seq_len, never by what one line holds.
TEXT_FIELDS = ("text", "prompt", "completion")
_SURROGATE = re.compile("[\ud800-\udfff]")


def record_format(rec: dict) -> Optional[str]:
    """`MESSAGES`, `TEXT` or `PROMPT_COMPLETION` (the first that `rec`'s keys fit, in that order),
    or None when it fits none. Checking and tokenizing both decide through here."""
    if "messages" in rec:
        return MESSAGES
    if "text" in rec:
        return TEXT
    if "prompt" in rec and "completion" in rec:
        return PROMPT_COMPLETION
    return None


def check_record(rec, where: str, fields: Optional[dict] = None) -> dict:
    """`rec` with `fields` renamed, checked to be one of the three formats; a SpecError otherwise."""
    if not isinstance(rec, dict):
        raise SpecError(f"{where}: expected a JSON object")
    rec = _rename(rec, where, fields)
    fmt = record_format(rec)
    if fmt == MESSAGES:
        _check_messages(rec["messages"], where)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]}
    if fmt == TEXT:
        if not isinstance(rec["text"], str):
            raise SpecError(f"{where}: \"text\" must be a string")
    elif fmt == PROMPT_COMPLETION:
        if not (isinstance(rec["prompt"], str) and isinstance(rec["completion"], str)):
            raise SpecError(f"{where}: \"prompt\" and \"completion\" must be strings")
    else:
        raise SpecError(f"{where}: expected {{\"text\": ...}}, {{\"prompt\": ..., \"completion\": ...}} or "
                        f"{{\"messages\": [...]}} (data.fields maps other column names onto these)")
    for k in TEXT_FIELDS:
        if isinstance(rec.get(k), str) and _SURROGATE.search(rec[k]):
            raise SpecError(f"{where}: \"{k}\" is not valid Unicode (an unpaired surrogate)")
    return rec


def _rename(rec: dict, where: str, fields: Optional[dict]) -> dict:
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
    if not isinstance(messages, list) or not messages:
        raise SpecError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise SpecError(f"{where}: messages[{j}] must be an object with \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise SpecError(f"{where}: messages[{j}]: unknown role {one_line(repr(m['role']))[:40]} "
                            f"(expected one of {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise SpecError(f"{where}: messages[{j}]: \"content\" must be a string")
        if _SURROGATE.search(m["content"]):
            raise SpecError(f"{where}: messages[{j}]: \"content\" is not valid Unicode (an unpaired surrogate)")
    if not any(m["role"] == "assistant" for m in messages):
        raise SpecError(f"{where}: a conversation without an assistant turn (nothing to learn)")


def cut_record(rec: dict, max_chars: Optional[int]) -> dict:
    """`rec` with every text (and every message's content) cut to `max_chars` characters; `rec`
    itself when `max_chars` is None."""
    if max_chars is None:
        return rec
    out = {k: (v[:max_chars] if k in TEXT_FIELDS else v) for k, v in rec.items()}
    if "messages" in out:
        out["messages"] = [{"role": m["role"], "content": m["content"][:max_chars]} for m in out["messages"]]
    return out


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
