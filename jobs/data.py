"""Data sources, tokenization into a shared on-disk cache, and the global-batch sequence.

Sources (`data.path`): JSONL files (read line by line, each line checked, text cut to what
`max_seq_len` can use), and through the `datasets` library JSON, Parquet and CSV files, a
`Dataset.save_to_disk` directory, or a hub dataset `hf:ORG/NAME[:SPLIT]`. `data.fields` renames
the user's columns to ours. Three record formats: `{"text"}` (loss on all of it),
`{"prompt", "completion"}` (loss on the completion) and `{"messages": [{"role", "content"}]}`
(rendered with the model's chat template; loss on assistant turns, see `chat_example`).

Tokenized data lives in a cache directory (`data_cache_dir`) keyed by the data's content, the
tokenizer and its chat template, `max_seq_len`, the fields, `train_on` and the held-out split: one
process builds it (`jobs.cache.build_once`: a lock, an atomic rename), every worker memory-maps
its flat int32 token arrays (`TokenizedSplit`), so a restart, a resume, a Tune trial or a later run
tokenizes nothing and holds only the pages it touches.

The sequence of global batches is a pure function of (dataset size, global batch, seed):
an endless stream of per-epoch permutations, cut into consecutive global batches. How a
global batch is then split into workers x accumulation steps x micro-batches only decides
*who* computes which sample, never *which* samples form optimizer step k. That makes
"accumulation == large batch" a testable fact and resume exact (the data position is just k).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from .spec import JobSpec, SpecError, one_line, path_problem

log = logging.getLogger("rayft")

IGNORE = -100
CACHE_FORMAT = 1  # bump when the cache's files or the tokenization change meaning
ROLES = ("system", "user", "assistant")
OUR_FIELDS = ("text", "prompt", "completion", "messages")


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
DATASETS_SUFFIXES = {".json": "json", ".parquet": "parquet", ".csv": "csv"}


def is_hub(path: str) -> bool:
    return str(path).startswith("hf:")


def read_jsonl(path: str, key: str = "data.path", max_chars: Optional[int] = None,
               fields: Optional[dict] = None, hf_token_env: Optional[str] = None) -> list[dict]:
    """The records of one data source, each checked for shape (after renaming `fields`, ours ->
    theirs); a problem is one SpecError naming `key`, the source and the line or row. A `.jsonl`
    (or any file `datasets` has no reader for) is read line by line; `.json`, `.parquet`, `.csv`,
    a `save_to_disk` directory and `hf:ORG/NAME[:SPLIT]` go through `datasets`. With `max_chars`,
    each record's texts are cut to that many characters as soon as it is read (see `char_bound`)."""
    shown = one_line(str(path))
    if is_hub(path) or os.path.isdir(path) or Path(path).suffix.lower() in DATASETS_SUFFIXES:
        rows = _datasets_rows(str(path), key, hf_token_env)
        records = [_cut(check_record(dict(row), f"{key}: {shown} row {i}", fields), max_chars)
                   for i, row in enumerate(rows)]
    else:
        records = _read_lines(path, key, max_chars, fields)
    if not records:
        raise SpecError(f"{key}: {shown}: no records")
    return records


def _cut(rec: dict, max_chars: Optional[int]) -> dict:
    if max_chars is None:
        return rec
    out = {k: (v[:max_chars] if k in TEXT_FIELDS else v) for k, v in rec.items()}
    if "messages" in out:
        out["messages"] = [{"role": m["role"], "content": m["content"][:max_chars]} for m in out["messages"]]
    return out


def _read_lines(path: str, key: str, max_chars: Optional[int], fields: Optional[dict]) -> list[dict]:
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
                records.append(_cut(_parse_record(line, f"{key}: {shown} line {i}", fields), max_chars))
    except UnicodeDecodeError:
        raise SpecError(f"{key}: {shown}: not UTF-8 text") from None
    except OSError as e:
        raise SpecError(f"{key}: {shown}: cannot be read ({e.strerror or e})") from None
    return records


def _datasets_rows(path: str, key: str, hf_token_env: Optional[str]):
    """A `datasets.Dataset` (Arrow, memory-mapped from datasets' cache) for a non-JSONL source."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    shown = one_line(path)
    try:
        if is_hub(path):
            name, _, split = path[3:].partition(":")
            token = os.environ.get(hf_token_env) if hf_token_env else None
            ds = datasets.load_dataset(name, split=split or "train", token=token)
        elif os.path.isdir(path):
            try:
                ds = datasets.load_from_disk(path)
            except FileNotFoundError:
                raise SpecError(f"{key}: {shown} is a directory that is not a dataset "
                                "(expected one written by Dataset.save_to_disk)") from None
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise SpecError(f"{key}: {shown}: a DatasetDict without a 'train' split "
                                    f"(has {', '.join(sorted(ds))})")
                ds = ds["train"]
        else:
            problem = path_problem(path)
            if problem:
                raise SpecError(f"{key}: {problem}")
            builder = DATASETS_SUFFIXES[Path(path).suffix.lower()]
            # CSV has no types: every cell is text ("4" stays "4", an empty cell is "", not NaN)
            kw = {"features": _csv_text_features(path), "keep_default_na": False} if builder == "csv" else {}
            ds = datasets.load_dataset(builder, data_files=str(Path(path).resolve()), split="train", **kw)
    except SpecError:
        raise
    except Exception as e:  # pyarrow/datasets errors: one line, the first line of their message
        msg = one_line(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)[:200]
        raise SpecError(f"{key}: {shown}: cannot be read as a dataset ({msg})") from None
    return ds


def _csv_text_features(path: str):
    import csv

    import datasets

    with open(path, encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _rename(rec: dict, where: str, fields: Optional[dict]) -> dict:
    if not fields:
        return rec
    out = dict(rec)
    for ours, theirs in fields.items():
        if theirs not in rec:
            raise SpecError(f"{where}: no field {theirs!r} (data.fields.{ours} names it)")
        out[ours] = out.pop(theirs) if theirs != ours else rec[theirs]
    return out


def _parse_record(line: str, where: str, fields: Optional[dict] = None) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise SpecError(f"{where}: nested too deeply to be a record") from None
    except ValueError as e:  # e.g. an integer longer than Python converts
        raise SpecError(f"{where}: not a usable JSON value ({one_line(str(e))[:100]})") from None
    return check_record(rec, where, fields)


def check_record(rec, where: str, fields: Optional[dict] = None) -> dict:
    """`rec` with `fields` renamed, checked to be one of the three formats; a SpecError otherwise."""
    if not isinstance(rec, dict):
        raise SpecError(f"{where}: expected a JSON object")
    rec = _rename(rec, where, fields)
    if "messages" in rec:
        _check_messages(rec["messages"], where)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]}
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise SpecError(f"{where}: \"text\" must be a string")
    elif "prompt" in rec and "completion" in rec:
        if not (isinstance(rec["prompt"], str) and isinstance(rec["completion"], str)):
            raise SpecError(f"{where}: \"prompt\" and \"completion\" must be strings")
    else:
        raise SpecError(f"{where}: expected {{\"text\": ...}}, {{\"prompt\": ..., \"completion\": ...}} or "
                        f"{{\"messages\": [...]}} (data.fields maps other column names onto these)")
    for k in TEXT_FIELDS:
        if isinstance(rec.get(k), str) and _SURROGATE.search(rec[k]):
            raise SpecError(f"{where}: \"{k}\" is not valid Unicode (an unpaired surrogate)")
    return rec


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


def _model_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or "the model"


def _render(tokenizer, messages: list[dict], generation_prompt: bool, model_name: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise SpecError(f"model.name: {model_name} has no chat template; chat records (\"messages\") need one")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # a Jinja error raised by the template itself (e.g. "roles must alternate")
        raise SpecError(f"model.name: the chat template of {model_name} refused a conversation "
                        f"({one_line(str(e))[:160]})") from None


def chat_spans(tokenizer, messages: list[dict], train_on: str = "assistant",
               model_name: Optional[str] = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans that carry loss.

    The span of assistant turn i is what the template adds between rendering `messages[:i]` with
    the generation prompt and rendering `messages[:i+1]`: the turn's content and the template's
    end-of-turn text, nothing of the prompt. That needs a prefix-stable template (each rendering a
    prefix of the next); one that is not is refused with a SpecError naming the model."""
    name = model_name or _model_name(tokenizer)
    full = _render(tokenizer, messages, False, name)
    # An assistant message that opens the conversation answers nothing: it is context, not a turn
    # (templates cannot render the empty conversation before it).
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    if train_on == "last_assistant":
        turns = turns[-1:]
    spans = []
    for i in turns:
        before = _render(tokenizer, messages[:i], True, name)
        after = _render(tokenizer, messages[:i + 1], False, name)
        if not (after.startswith(before) and full.startswith(after)):
            raise SpecError(f"model.name: the chat template of {name} is not prefix-stable (rendering the first "
                            f"{i + 1} messages is not a prefix of the whole conversation), so the tokens of an "
                            "assistant turn cannot be told apart; use prompt/completion records instead")
        spans.append((len(before), len(after)))
    return full, spans


def chat_prompt_ids(tokenizer, messages: list[dict], model_name: Optional[str] = None) -> list[int]:
    """Token ids of `messages` rendered with the generation prompt: what `rayft eval` feeds the
    model, the same text the training labels of the next assistant turn follow."""
    text = _render(tokenizer, messages, True, model_name or _model_name(tokenizer))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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


def tokenize_iter(records: Sequence[dict], tokenizer, max_seq_len: int, train_on: str = "assistant",
                  model_name: Optional[str] = None, chunk: int = 512) -> Iterable[Optional[Example]]:
    """One Example per record (None where truncation leaves no label), in record order.

    text: BOS + text + EOS, all labelled. prompt/completion: BOS + prompt + completion + EOS,
    labels on completion + EOS. messages: the chat template's rendering, labels on the spans of
    `chat_spans` (the template decides BOS and end-of-turn tokens; nothing is added). Every text
    is cut to `char_bound` characters before it reaches the tokenizer, so what one record costs
    is bounded by max_seq_len; the result equals tokenizing the whole text and truncating.
    Records are tokenized `chunk` at a time (one batched call of the fast tokenizer)."""
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    cut = char_bound(tokenizer, max_seq_len)
    for start in range(0, len(records), chunk):
        part = records[start:start + chunk]
        chats = [i for i, r in enumerate(part) if "messages" in r]
        rendered = {i: chat_spans(tokenizer, part[i]["messages"], train_on, model_name) for i in chats}
        firsts = [(r["text"] if "text" in r else r["prompt"])[:cut] if "messages" not in r else "" for r in part]
        enc1 = _encode_many(tokenizer, firsts)["input_ids"]
        comps = [r["completion"][:cut] if "completion" in r and "text" not in r and "messages" not in r else ""
                 for r in part]
        enc2 = _encode_many(tokenizer, comps)["input_ids"]
        chat_enc = _encode_many(tokenizer, [rendered[i][0][:cut] for i in chats], offsets=True)
        chat_at = {i: j for j, i in enumerate(chats)}
        for i, rec in enumerate(part):
            if "messages" in rec:
                j = chat_at[i]
                seq = list(chat_enc["input_ids"][j])
                labels = _labels_from_spans(chat_enc["offset_mapping"][j], seq, rendered[i][1])
            else:
                head = list(enc1[i])
                if bos is not None and (not head or head[0] != bos):
                    head = [bos] + head
                if "text" in rec:
                    seq = head + [eos]
                    labels = list(seq)
                else:
                    c = list(enc2[i])
                    seq = head + c + [eos]
                    labels = [IGNORE] * len(head) + c + [eos]
            seq, labels = seq[:max_seq_len], labels[:max_seq_len]
            ex = Example(tuple(seq[:-1]), tuple(labels[1:]))
            yield ex if ex.n_labels else None  # a prompt longer than max_seq_len leaves nothing to learn


def tokenize(records: Sequence[dict], tokenizer, max_seq_len: int, train_on: str = "assistant",
             model_name: Optional[str] = None) -> list[Example]:
    """The Examples of `records` that keep a label after truncation (see `tokenize_iter`)."""
    return [e for e in tokenize_iter(records, tokenizer, max_seq_len, train_on, model_name) if e is not None]


# ---- content hashes and the tokenized cache ---------------------------------------------------

_HASHES: dict[tuple, str] = {}


def _file_sha256(path: Path) -> str:
    st = path.stat()
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if memo in _HASHES:  # a checkpoint every few steps hashes the data again: once is enough
        return _HASHES[memo]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    # A file modified within the filesystem's timestamp granularity of now could change again
    # without changing (size, mtime): remember only hashes of files that have been still a while.
    if time.time() - st.st_mtime > 2:
        _HASHES[memo] = digest
    return digest


def source_hash(path: str, hf_token_env: Optional[str] = None) -> str:
    """sha256 of a data source's content: a file's bytes, every file of a `save_to_disk`
    directory (names and bytes), or a hub dataset's fingerprint (datasets' hash of its files)."""
    if is_hub(path):
        return "hf:" + _datasets_rows(path, "data.path", hf_token_env)._fingerprint
    p = Path(path)
    if not p.is_dir():
        problem = path_problem(p)  # never open a FIFO or a device to hash it
        if problem:
            raise SpecError(f"data.path: {problem}")
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(q for q in p.rglob("*") if q.is_file()):
            h.update(f"{f.relative_to(p)}\0{_file_sha256(f)}\0".encode())
        return h.hexdigest()
    return _file_sha256(p)


def content_hash(spec: JobSpec) -> str:
    """One hash of everything `data.path` and `data.eval_path` hold: it changes exactly when the
    data under the same paths changes (the checkpoint's resume key records it)."""
    h = hashlib.sha256()
    for p in list(spec.data.path) + ([spec.data.eval_path] if spec.data.eval_path else []):
        try:
            h.update(source_hash(p, spec.data.hf_token_env).encode() + b"\0")
        except OSError as e:
            raise SpecError(f"data: {one_line(str(p))}: cannot be read ({e.strerror or e})") from None
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """The tokenizer's full definition (vocabulary, merges, normalizer, special tokens) and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [getattr(tokenizer, "chat_template", None), tokenizer.bos_token_id, tokenizer.eos_token_id]
    return hashlib.sha256((body + json.dumps(extra, default=str)).encode()).hexdigest()


def cache_key(spec: JobSpec, tokenizer) -> str:
    d = spec.data
    parts = {"format": CACHE_FORMAT, "content": content_hash(spec), "tokenizer": tokenizer_hash(tokenizer),
             "max_seq_len": d.max_seq_len, "fields": d.fields, "train_on": d.train_on,
             "n_sources": len(d.path), "eval_path": bool(d.eval_path),
             "eval_fraction": d.eval_fraction, "split_seed": spec.run.seed if d.eval_fraction > 0 and not d.eval_path else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def data_cache_dir(spec: JobSpec, key: str) -> Path:
    """`data.cache_dir/<key>`, by default `<parent of run.output_dir>/.rayft-data/<key>`: storage
    every worker of a run sees (the output directory's volume, shared on Kubernetes), and every
    run, resume and Tune trial writing next to it reuses the same tokenized data."""
    if spec.data.cache_dir:
        return Path(spec.data.cache_dir).resolve() / key
    return spec.output_path.resolve().parent / ".rayft-data" / key


class TokenizedSplit(SequenceABC):
    """Examples stored as flat int32 arrays (`input_ids.bin`, `targets.bin`) and int64 offsets,
    memory-mapped read-only: an index costs only the pages of the examples it touches."""

    def __init__(self, directory: Path, name: str, n: int, n_tokens: int):
        self.n = n
        self.offsets = np.load(directory / f"{name}.offsets.npy", mmap_mode="r")
        if n_tokens:
            self.ids = np.memmap(directory / f"{name}.input_ids.bin", dtype=np.int32, mode="r", shape=(n_tokens,))
            self.targets = np.memmap(directory / f"{name}.targets.bin", dtype=np.int32, mode="r", shape=(n_tokens,))
        else:
            self.ids = self.targets = np.zeros(0, dtype=np.int32)

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


class _SplitWriter:
    def __init__(self, directory: Path, name: str):
        self.directory, self.name = directory, name
        self.f_ids = open(directory / f"{name}.input_ids.bin", "wb")
        self.f_targets = open(directory / f"{name}.targets.bin", "wb")
        self.offsets = [0]

    def add(self, ex: Example) -> None:
        self.f_ids.write(np.asarray(ex.input_ids, dtype=np.int32).tobytes())
        self.f_targets.write(np.asarray(ex.targets, dtype=np.int32).tobytes())
        self.offsets.append(self.offsets[-1] + len(ex.input_ids))

    def close(self) -> dict:
        self.f_ids.close()
        self.f_targets.close()
        np.save(self.directory / f"{self.name}.offsets.npy", np.asarray(self.offsets, dtype=np.int64))
        return {"n": len(self.offsets) - 1, "n_tokens": self.offsets[-1]}


@dataclass
class Dataset:
    train: Sequence[Example]
    eval: Sequence[Example]
    dropped: int  # records with no label token left after truncation
    content_hash: str = ""  # `content_hash(spec)`: what the checkpoint's resume key records
    cache_dir: Optional[Path] = None


def count_checked_records(spec: JobSpec) -> int:
    """Check every record of `data.path` and `data.eval_path` (nothing is kept: the memory of one
    record) and return the number of training records. The driver calls this before anything
    is created. A success is remembered in an existing cache root (`checked-<hash>.json`, keyed
    by the content hash and `data.fields`), so a later start on the same data skips the pass."""
    d = spec.data
    try:
        key = hashlib.sha256(json.dumps([content_hash(spec), d.fields]).encode()).hexdigest()[:24]
        memo: Optional[Path] = data_cache_dir(spec, f"checked-{key}.json")
        return int(json.loads(memo.read_text())["train_records"])
    except SpecError:  # a source that cannot be hashed: the pass below names the problem
        memo = None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    n_train = 0
    for i, p in enumerate(d.path):
        n_train += len(read_jsonl(p, "data.path" if len(d.path) == 1 else f"data.path.{i}", max_chars=0,
                                  fields=d.fields, hf_token_env=d.hf_token_env))
    if d.eval_path:
        read_jsonl(d.eval_path, "data.eval_path", max_chars=0, fields=d.fields, hf_token_env=d.hf_token_env)
    # Remembered only where a tokenized cache already lives: a client that submits to a cluster
    # (or a first run) creates nothing here.
    if memo is None or not memo.parent.is_dir():
        return n_train
    try:  # only a success is remembered; a failed write costs the next start one more pass
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"train_records": n_train}))
        os.replace(tmp, memo)
    except OSError:
        pass
    return n_train


def read_records(spec: JobSpec, tokenizer) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) of the spec, texts cut to what max_seq_len can use."""
    cut = char_bound(tokenizer, spec.data.max_seq_len)
    d = spec.data
    records: list[dict] = []
    for i, p in enumerate(d.path):
        records += read_jsonl(p, "data.path" if len(d.path) == 1 else f"data.path.{i}", max_chars=cut,
                              fields=d.fields, hf_token_env=d.hf_token_env)
    eval_records: list[dict] = []
    if d.eval_path:
        eval_records = read_jsonl(d.eval_path, "data.eval_path", max_chars=cut, fields=d.fields,
                                  hf_token_env=d.hf_token_env)
    elif d.eval_fraction > 0:
        order = list(range(len(records)))
        random.Random(spec.run.seed).shuffle(order)
        n_eval = max(1, int(round(len(records) * d.eval_fraction)))
        held = set(order[:n_eval])
        eval_records = [r for i, r in enumerate(records) if i in held]
        records = [r for i, r in enumerate(records) if i not in held]
    return records, eval_records


def load_dataset(spec: JobSpec, tokenizer) -> Dataset:
    """The spec's data, tokenized once into the shared cache (`data_cache_dir`) and memory-mapped.

    The first process to need a cache entry reads and tokenizes the data under a lock and
    publishes the entry by atomic rename (`jobs.cache.build_once`); every other process, now or
    in a later run, maps the published files. Bad data raises a SpecError and leaves no entry."""
    from .cache import build_once

    h = content_hash(spec)
    key = cache_key(spec, tokenizer)
    final = data_cache_dir(spec, key)

    def build(tmp: Path) -> None:
        records, eval_records = read_records(spec, tokenizer)
        meta = {"content_hash": h, "records": len(records), "eval_records": len(eval_records)}
        kept = 0
        for name, recs in (("train", records), ("eval", eval_records)):
            w = _SplitWriter(tmp, name)
            for ex in tokenize_iter(recs, tokenizer, spec.data.max_seq_len, spec.data.train_on, spec.model.name):
                if ex is not None:
                    w.add(ex)
            meta[name] = w.close()
            kept += meta[name]["n"]
        meta["dropped"] = len(records) + len(eval_records) - kept
        (tmp / "meta.json").write_text(json.dumps(meta))

    try:
        final = build_once(final, build, "the tokenized data")
    except SpecError:
        _remove_if_unused(final)
        raise
    meta = json.loads((final / "meta.json").read_text())
    train = TokenizedSplit(final, "train", meta["train"]["n"], meta["train"]["n_tokens"])
    evals = TokenizedSplit(final, "eval", meta["eval"]["n"], meta["eval"]["n_tokens"])
    if len(train) < spec.batch.global_batch_size:
        raise SpecError(
            f"data.path: {len(train)} usable training records, fewer than "
            f"batch.global_batch_size={spec.batch.global_batch_size}"
        )
    return Dataset(train, evals, dropped=meta["dropped"], content_hash=h, cache_dir=final)


def _remove_if_unused(final: Path) -> None:
    """After bad data: leave nothing behind (the lock file, and the cache root if it is empty).
    Every process reading the same data fails the same way, so no builder needs this lock."""
    if final.is_dir():
        return
    try:
        final.with_name(final.name + ".lock").unlink()
        final.parent.rmdir()
    except OSError:
        pass


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
