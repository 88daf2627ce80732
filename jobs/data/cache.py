"""The tokenized cache: one build per (data, tokenizer, settings), memory-mapped by every worker.

An entry is a directory `data_cache_dir(spec, cache_key(spec, tokenizer))` holding, per split
(`train`, `eval`), the flat int32 token arrays `<split>.input_ids.bin` and `<split>.targets.bin`,
the int64 offsets `<split>.offsets.npy` (example i is `[offsets[i], offsets[i+1])`), and the
per-example int32 counts `<split>.lengths.npy` (input tokens) and `<split>.label_tokens.npy`
(targets that are not IGNORE), and a `meta.json` (content hash, record counts, dropped records,
each split's `n` and `n_tokens`). An entry of preference pairs (`meta.json`'s `"kind": "pairs"`)
holds instead, per split and per field F in (`prompt`, `chosen`, `rejected`), the flat int32 ids
`<split>.F.bin` and their int64 offsets `<split>.F.offsets.npy`, and per pair the int32
`<split>.lengths.npy` (its longer row's input length), `<split>.label_tokens.npy` (both responses)
and `<split>.input_tokens.npy` (both rows' inputs) (`TokenizedPairs`); its `meta.json` counts the
pairs dropped for an empty response and for identical responses apart. The counts are written
with the tokens, so the step's host work (length grouping, the window's label and input counts,
collation: `jobs.data.batches`) reads arrays and never turns a sample into Python objects.
`CACHE_FORMAT` is part of the key: bump it when these files or the tokenization change meaning,
and every existing entry is left alone (a new key: the entry is built again), never misread.
(Format 2 added the per-sample count arrays; format 3 each file's size and sha256 in `meta.json`'s
`"files"`, so an entry is verified before it is used: `load_entry`, `jobs.data.verify`.)

The key covers what decides the tokens: the data's content (`content_hash`), the tokenizer and
its chat template (`tokenizer_hash`), `max_seq_len`, the fields, `train_on`, the held-out split
and, for a preference objective, that the entry holds pairs (an SFT entry's key is what it was
before pairs existed, so existing SFT entries stay valid). One process builds an entry
(`jobs.run.build_once.build_once`: a lock, an atomic rename); a restart, a resume, a Tune trial or a later
run tokenizes nothing and holds only the pages it touches (`TokenizedSplit`, `TokenizedPairs`).
An entry that fails its checks (a partial write, another job's mistake, a link: `jobs.data.verify`
and `_check_layout`) was ours to build: it is set aside (`<entry>.bad-<time>`, never deleted)
and built again, with one warning line; where it cannot be set aside, one SpecError line names
the file.

A mixture (`data.mix`) has no entry of its own: each source is the entry it would be as a job's
only data (`load_mixture`), and the mixture is those entries side by side (`Concatenated`).
`rayft data prepare` (`jobs.data.prepare`) builds the same entry ahead of the job, tokenizing on Ray:
both builds share the per-record rule (`tokenized`), the writer (`write_entry`) and the
publication (`publish_entry`), so both write the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jobs.data.entry import (
    _PAIR_ARRAYS,
    _SPLIT_ARRAYS,
    Concatenated,
    SourcePart,
    TokenizedPairs,
    TokenizedSplit,
    _pair_counts,
    _PairWriter,
    _SplitWriter,
)
from jobs.data.pairs import DROP_EMPTY, DROP_IDENTICAL, Pair, tokenize_pairs_iter
from jobs.data.records import PAIR_FIELDS, PAIRS, SFT, record_kind
from jobs.data.sources import dataset_dir_files, datasets_rows, first_record_format, is_hub, read_jsonl, read_records
from jobs.data.tokenizing import tokenize_iter
from jobs.data.verify import DIGEST, BadEntry, check_contents, check_files, file_records, read_meta
from jobs.errors import SpecError
from jobs.run.build_once import build_once, set_aside
from jobs.spec import JobSpec, one_line, path_problem
from jobs.spec.online import offline_only

log = logging.getLogger("rayft")

CACHE_FORMAT = 3  # bump when the cache's files or the tokenization change meaning


# ---- content hashes and the key ---------------------------------------------------------------

_HASHES: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    st = path.stat()
    memo = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if memo in _HASHES:  # a checkpoint every few steps hashes the data again: once is enough
        return _HASHES[memo]
    h = hashlib.sha256()
    with open(path, "rb") as f:  # in blocks: hashlib.file_digest is Python 3.11+, rayft supports 3.10
        while block := f.read(1 << 20):
            h.update(block)
    digest = h.hexdigest()
    # A file modified within the filesystem's timestamp granularity of now could change again
    # without changing (size, mtime): remember only hashes of files that have been still a while.
    if time.time() - st.st_mtime > 2:
        _HASHES[memo] = digest
    return digest


def source_hash(path: str, hf_token_env: str | None = None) -> str:
    """sha256 of a data source's content: a file's bytes, every file of a `save_to_disk`
    directory and every file its descriptions name (names and bytes), or a hub dataset's
    fingerprint (datasets' hash of its files)."""
    if is_hub(path):
        return "hf:" + datasets_rows(path, "data.path", hf_token_env)._fingerprint
    p = Path(path)
    if not p.is_dir():
        problem = path_problem(p)  # never open a FIFO or a device to hash it
        if problem:
            raise SpecError(f"data.path: {problem}")
    if p.is_dir():
        # Every regular file below it, and every file its descriptions name (also one below a
        # linked directory, which rglob does not enter); a name outside it is refused there.
        files = {q for q in p.rglob("*") if q.is_file()} | set(dataset_dir_files(p))
        h = hashlib.sha256()
        for f in sorted(files):
            h.update(f"{f.relative_to(p)}\0{file_sha256(f)}\0".encode())
        return h.hexdigest()
    return file_sha256(p)


def content_hash(spec: JobSpec) -> str:
    """One hash of everything `data.path` and `data.eval_path` hold (a mixture: every source's
    path and eval_path, in order): it changes exactly when the data under the same paths changes
    (the checkpoint's resume key records it)."""
    h = hashlib.sha256()
    for _, p in spec.data.source_files():
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


def data_kind(spec: JobSpec) -> str:
    """The kind of record the objective trains on (its spec class says): `PAIRS` for a preference
    objective (its samples are `Pair`s), else `SFT`."""
    offline_only(spec, "data cache")  # GRPO reads its prompts itself (`jobs.data.prompts`)
    kind = spec.objective.records
    assert kind in (SFT, PAIRS)
    return kind


def cache_key(spec: JobSpec, tokenizer) -> str:
    d = spec.data
    parts = {
        "format": CACHE_FORMAT,
        "content": content_hash(spec),
        "tokenizer": tokenizer_hash(tokenizer),
        "max_seq_len": d.max_seq_len,
        "fields": d.fields,
        "train_on": d.train_on,
        "n_sources": len(d.path),
        "eval_path": bool(d.eval_path),
        "eval_fraction": d.eval_fraction,
        "split_seed": spec.run.seed if d.eval_fraction > 0 and not d.eval_path else None,
    }
    if data_kind(spec) == PAIRS:  # only then: an SFT entry keeps the key it always had
        parts["kind"] = PAIRS
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def data_cache_dir(spec: JobSpec, key: str) -> Path:
    """`data.cache_dir/<key>`, by default `<parent of run.output_dir>/.rayft-data/<key>`: storage
    every worker of a run sees (the output directory's volume, shared on Kubernetes), and every
    run, resume and Tune trial writing next to it reuses the same tokenized data."""
    if spec.data.cache_dir:
        return Path(spec.data.cache_dir).resolve() / key
    return spec.output_path.resolve().parent / ".rayft-data" / key


# ---- the spec's data --------------------------------------------------------------------------


@dataclass
class Dataset:
    train: TokenizedSplit | TokenizedPairs | Concatenated  # memory-mapped from the cache entry (a mixture's: entries)
    eval: TokenizedSplit | TokenizedPairs | Concatenated
    dropped: int  # records with no label token left after truncation (pairs: the two counts below)
    content_hash: str = ""  # `content_hash(spec)`: what the checkpoint's resume key records
    cache_dir: Path | None = None
    kind: str = SFT  # `SFT`: `train`/`eval` hold Examples; `PAIRS`: they hold Pairs
    dropped_empty: int = 0  # pairs with an empty prompt or response
    dropped_identical: int = 0  # pairs whose responses are identical after tokenization and truncation
    sources: list[SourcePart] = field(default_factory=list)  # a mixture's sources (`data.mix`); [] for one


def count_checked_records(spec: JobSpec) -> int:
    """Check every record of `data.path` and `data.eval_path` (nothing is kept: the memory of one
    record) and return the number of training records. The driver calls this before anything
    is created. A success is remembered in an existing cache root (`checked-<hash>.json`, keyed
    by the content hash, `data.fields` and the kind of data), so a later start on the same data
    skips the pass. The records are checked against the objective too: pairs for a preference
    objective, SFT records otherwise (`jobs.data.sources.read_jsonl`). A mixture's sources are
    checked one by one (each remembered on its own), after `check_mixture_kinds`."""
    if spec.data.mix is not None:
        check_mixture_kinds(spec)
        total = 0
        for i in range(len(spec.data.mix)):
            with source_keys(i):
                total += count_checked_records(spec.for_source(i))
        return total
    d = spec.data
    memo: Path | None = None
    try:
        checked = [content_hash(spec), d.fields] + ([PAIRS] if data_kind(spec) == PAIRS else [])
        key = hashlib.sha256(json.dumps(checked).encode()).hexdigest()[:24]
        memo = data_cache_dir(spec, f"checked-{key}.json")
        return int(json.loads(memo.read_text())["train_records"])
    except SpecError:  # a source that cannot be hashed: the pass below names the problem
        memo = None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    n_train = 0
    for i, p in enumerate(d.path):
        n_train += len(
            read_jsonl(
                p,
                "data.path" if len(d.path) == 1 else f"data.path.{i}",
                max_chars=0,
                fields=d.fields,
                hf_token_env=d.hf_token_env,
                objective=spec.objective.name,
            )
        )
    if d.eval_path:
        read_jsonl(
            d.eval_path,
            "data.eval_path",
            max_chars=0,
            fields=d.fields,
            hf_token_env=d.hf_token_env,
            objective=spec.objective.name,
        )
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


_KINDS_SHOWN = {PAIRS: "pairs", SFT: "SFT records"}


def check_mixture_kinds(spec: JobSpec) -> None:
    """Every source of a mixture holds the one kind of record its objective trains on (pairs for a
    preference objective, SFT records otherwise), judged by each source's first record; a source
    of the other kind is one SpecError naming it, a source of the right kind, and the objective."""
    assert spec.data.mix is not None
    pairs, want = spec.objective.is_preference, data_kind(spec)
    kinds = []
    for i in range(len(spec.data.mix)):
        sub = spec.for_source(i).data
        with source_keys(i):
            fmt = first_record_format(sub.path[0], "data.path", sub.fields, sub.hf_token_env, pairs)
        kinds.append(record_kind(fmt))
    for i, kind in enumerate(kinds):
        if kind == want:
            continue
        other = next((j for j, k in enumerate(kinds) if k == want), None)
        beside = f" and data.mix.{other}.path {_KINDS_SHOWN[want]}" if other is not None else ""
        raise SpecError(
            f"data.mix.{i}.path: {one_line(spec.data.mix[i].path)} holds {_KINDS_SHOWN[kind]}{beside}: every "
            f"source of a mixture holds the records objective.name={spec.objective.name} trains on "
            f"({_KINDS_SHOWN[want]})"
        )


@contextlib.contextmanager
def source_keys(i: int) -> Iterator[None]:
    """Within it, a SpecError about `data.path` / `data.eval_path` (how a mixture source is read:
    `JobSpec.for_source`) names the source's own keys, `data.mix.I.path` / `data.mix.I.eval_path`."""
    try:
        yield
    except SpecError as e:
        text = str(e)
        for ours in ("data.path", "data.eval_path"):
            if text.startswith(ours):
                raise SpecError(f"data.mix.{i}.{ours.removeprefix('data.')}{text[len(ours) :]}") from None
        raise


def load_dataset(spec: JobSpec, tokenizer) -> Dataset:
    """The spec's data, tokenized once into the shared cache (`data_cache_dir`) and memory-mapped.

    The first process to need a cache entry reads and tokenizes the data under a lock and
    publishes the entry by atomic rename (`jobs.run.build_once.build_once`); every other process, now or
    in a later run, maps the published files. Bad data raises a SpecError and leaves no entry.
    A mixture (`data.mix`) is each source's own entry (`load_mixture`)."""
    if spec.data.mix is not None:
        data = load_mixture(spec, tokenizer)
    else:
        data = load_entry(spec, tokenizer)
    check_enough_records(spec, len(data.train), data.dropped)
    return data


def load_mixture(spec: JobSpec, tokenizer) -> Dataset:
    """A mixture: each source tokenized into its own entry (`JobSpec.for_source`: the key of a
    source is the key it has as a job's only data, so adding a source to a mixture tokenizes only
    that one, and a mixture shares entries with one-source runs), then the entries side by side
    (`Concatenated`, nothing copied), `sources` saying where each one lies."""
    assert spec.data.mix is not None
    entries = []
    for i in range(len(spec.data.mix)):
        with source_keys(i):
            entries.append(load_entry(spec.for_source(i), tokenizer))
    parts, train_at, eval_at = [], 0, 0
    for src, e in zip(spec.data.mix, entries, strict=True):
        if not len(e.train):
            raise SpecError(
                f"data.mix: source {src.shown_name!r} ({one_line(src.path)}) has no usable training records"
            )
        parts.append(
            SourcePart(src.shown_name, src.weight, train_at, len(e.train), eval_at, len(e.eval), e.cache_dir, e.dropped)
        )
        train_at, eval_at = train_at + len(e.train), eval_at + len(e.eval)
    names = "\0".join(e.cache_dir.name for e in entries if e.cache_dir is not None)
    return Dataset(
        Concatenated([e.train for e in entries]),
        Concatenated([e.eval for e in entries]),
        dropped=sum(e.dropped for e in entries),
        content_hash=content_hash(spec),
        # Named by its sources' entries (in order): what a precomputed reference beside it is keyed by.
        cache_dir=data_cache_dir(spec, "mix-" + hashlib.sha256(names.encode()).hexdigest()[:24]),
        kind=entries[0].kind,
        dropped_empty=sum(e.dropped_empty for e in entries),
        dropped_identical=sum(e.dropped_identical for e in entries),
        sources=parts,
    )


def load_entry(spec: JobSpec, tokenizer) -> Dataset:
    """The one cache entry of a spec's `data.path` (built if missing), verified (`_verified`) and
    memory-mapped. An entry that fails verification is set aside and built again, once."""
    h = content_hash(spec)
    final = data_cache_dir(spec, cache_key(spec, tokenizer))
    expected = {"content_hash": h, "kind": data_kind(spec)}
    meta = _verified_or_rebuilt(final, lambda tmp: _build(tmp, spec, tokenizer, h), expected, vocab_size(tokenizer))
    split = TokenizedPairs if meta.get("kind") == PAIRS else TokenizedSplit
    train = split.open(final, "train", meta["train"]["n_tokens"])
    evals = split.open(final, "eval", meta["eval"]["n_tokens"])
    return Dataset(
        train,
        evals,
        dropped=meta["dropped"],
        content_hash=h,
        cache_dir=final,
        kind=meta.get("kind", SFT),
        dropped_empty=meta.get("dropped_empty", 0),
        dropped_identical=meta.get("dropped_identical", 0),
    )


# ---- checking an entry before it is used ------------------------------------------------------


def vocab_size(tokenizer) -> int:
    """One more than the largest id the tokenizer can give (its length, or past it where its ids
    have holes): the bound of an entry's token ids."""
    return max(len(tokenizer), 1 + max(tokenizer.get_vocab().values(), default=-1))


def _verified_or_rebuilt(final: Path, build: Callable[[Path], None], expected: dict, vocab_size: int) -> dict:
    """The entry `final`, published (`publish_entry`) and verified: its meta.json (`expected`: the
    content hash and kind of data it must hold). A bad entry
    is set aside as `<entry>.bad-<time>` (never deleted, never followed if a link) and built again,
    with one warning line; a SpecError naming the file where it cannot be set aside, or where the
    rebuilt entry is bad too."""
    seen = _published(final, build)
    try:
        return _verified(final, expected, vocab_size)
    except BadEntry as e:
        set_aside_bad(final, seen, e)
    _published(final, build)
    try:
        return _verified(final, expected, vocab_size)
    except BadEntry as e:
        raise SpecError(f"data cache: {e}, also after it was built again") from None


def verified_if_published(final: Path, expected: dict, vocab_size: int) -> bool:
    """True when an entry is published at `final` and passes the checks a job's open applies
    (`_verified`); a bad one is set aside as `_verified_or_rebuilt` does (one warning line) and
    False, as when there is none: the caller builds it (`rayft data prepare`)."""
    if not (final.exists() or final.is_symlink()):
        return False
    seen = os.lstat(final)
    try:
        _verified(final, expected, vocab_size)
        return True
    except BadEntry as e:
        set_aside_bad(final, seen, e)
        return False


def set_aside_bad(final: Path, seen: os.stat_result, bad: BadEntry, what: str = "data cache") -> None:
    """Take the bad entry `final` (as `seen` by its reader) out of the way to be built again, with
    one warning line; a SpecError naming it where it cannot be moved. `what` names the entry's kind
    in both (the precomputed reference's entries go through here too)."""
    # time, process and a random part: two entries set aside by one process within a second keep both
    suffix = time.strftime(".bad-%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        aside = set_aside(final, seen, suffix)
    except OSError as e:
        raise SpecError(
            f"{what}: {bad}; it cannot be set aside to be built again ({e.strerror or e}): "
            f"remove {final} or set data.cache_dir to a writable directory"
        ) from None
    where = f"set aside as {aside.name}" if aside is not None else "replaced by another process"
    log.warning("%s: %s; %s and rebuilt", what, bad, where)


def _published(final: Path, build: Callable[[Path], None]) -> os.stat_result:
    """`publish_entry(final, build)`, and the entry's `lstat` (what `set_aside` compares). A link
    where the entry belongs is neither followed nor built over: `_verified` refuses it."""
    if not final.is_symlink():
        publish_entry(final, build)
    return os.lstat(final)


def _verified(final: Path, expected: dict, vocab_size: int) -> dict:
    """meta.json of the entry `final` once its files pass `jobs.data.verify`'s checks and the
    layout's (`_check_layout`); a BadEntry naming the first file that does not."""
    meta_path = final / "meta.json"
    meta = read_meta(final)
    problem = _meta_problem(meta, expected)
    if problem:
        raise BadEntry(meta_path, problem)
    names = entry_files(meta.get("kind", SFT))
    stats = check_files(final, meta["files"], ["meta.json", *names])
    _check_layout(final, meta)
    check_contents(final, meta["files"], stats, vocab_size)
    return meta


def entry_files(kind: str) -> list[str]:
    """Every file an entry of `kind` (`SFT` or `PAIRS`) holds besides meta.json, in sorted order."""
    if kind == PAIRS:
        per = (
            [f"{f}.bin" for f in PAIR_FIELDS]
            + [f"{f}.offsets.npy" for f in PAIR_FIELDS]
            + [f"{a}.npy" for a in _PAIR_ARRAYS]
        )
    else:
        per = ["input_ids.bin", "targets.bin"] + [f"{a}.npy" for a in _SPLIT_ARRAYS]
    return sorted(f"{split}.{f}" for split in ("train", "eval") for f in per)


def _meta_problem(meta: Any, expected: dict) -> str | None:
    """What is wrong with an entry's parsed meta.json (None: nothing), before any file is read:
    `expected` is its content hash and kind of data (`SFT`, `PAIRS`)."""
    if not isinstance(meta, dict):
        return "is not a JSON object"
    if meta.get("content_hash") != expected["content_hash"]:
        return "belongs to other data (its content hash is not that of data.path)"
    kind = meta.get("kind", SFT)
    if kind != expected["kind"]:
        return f"holds {one_line(str(kind))[:40]!r} data, not {expected['kind']!r}"
    files = meta.get("files")
    if not isinstance(files, dict) or sorted(files) != entry_files(kind):
        return "does not list the entry's files (an older or damaged entry)"
    for rec in files.values():
        if not (isinstance(rec, dict) and _count(rec.get("size")) and isinstance(rec.get(DIGEST), str)):
            return "lists a file without its size and digest"
    for split in ("train", "eval"):
        s = meta.get(split)
        sizes = s.get("n_tokens") if isinstance(s, dict) else None
        sizes_ok = (
            all(_count(sizes.get(f)) for f in PAIR_FIELDS) if kind == PAIRS and isinstance(sizes, dict) else False
        )
        if not (isinstance(s, dict) and _count(s.get("n")) and (sizes_ok if kind == PAIRS else _count(sizes))):
            return f"gives no valid size of split {split!r}"
    if not all(_count(meta.get(k, 0)) for k in ("dropped", "dropped_empty", "dropped_identical")):
        return "gives no valid count of dropped records"
    return None


def _count(x: Any) -> bool:
    """A non-negative integer (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_layout(final: Path, meta: dict) -> None:
    """Each split's arrays have the dtypes and shapes `meta.json` implies: the token files 4 bytes a
    token, offsets int64 from 0 rising to `n_tokens`, the per-sample int32 counts of length `n`
    and consistent with the offsets. O(samples): the small arrays only, never the tokens."""
    pairs = meta.get("kind") == PAIRS
    for split in ("train", "eval"):
        n, n_tokens = meta[split]["n"], meta[split]["n_tokens"]
        fields = PAIR_FIELDS if pairs else ("input_ids", "targets")
        offsets = {}
        for f in fields:
            size = n_tokens[f] if pairs else n_tokens
            tokens = final / f"{split}.{f}.bin"
            if meta["files"][tokens.name]["size"] != 4 * size:
                raise BadEntry(tokens, f"is not 4 bytes for each of the {size} tokens meta.json records")
            if pairs or f == "input_ids":
                name = f"{split}.{f}.offsets.npy" if pairs else f"{split}.offsets.npy"
                offsets[f] = _offsets(final / name, n, size)
        counts = _pair_counts(offsets) if pairs else (np.diff(offsets["input_ids"]),)
        for a, want in zip(_PAIR_ARRAYS if pairs else ("lengths",), counts, strict=True):
            got = _array(final / f"{split}.{a}.npy", np.int32, n)
            if not np.array_equal(got, want):
                raise BadEntry(final / f"{split}.{a}.npy", "does not match the offsets")
        if not pairs:
            labels = _array(final / f"{split}.label_tokens.npy", np.int32, n)
            if n and (labels.min() < 0 or np.any(labels > counts[0])):
                raise BadEntry(final / f"{split}.label_tokens.npy", "counts more labels than tokens")


def _offsets(path: Path, n: int, n_tokens: int) -> np.ndarray:
    offsets = _array(path, np.int64, n + 1)
    if offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) < 0):
        raise BadEntry(path, f"are not offsets rising from 0 to the {n_tokens} tokens meta.json records")
    return offsets


def _array(path: Path, dtype: type, n: int) -> np.ndarray:
    """The .npy array at `path`, memory-mapped (never a pickle), if it is 1-d of `dtype` and length `n`."""
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BadEntry(path, f"is no .npy array ({one_line(str(e))[:200]})") from None
    if a.dtype != dtype or a.shape != (n,):
        raise BadEntry(path, f"holds {a.dtype} {a.shape}, not {np.dtype(dtype)} ({n},) as meta.json implies")
    return a


def check_enough_records(spec: JobSpec, n_train: int, dropped: int) -> None:
    """At least `batch.global_batch_size` usable training records, else one SpecError line.
    `_build` calls it before an entry is published when nothing at all is usable, so data that
    can never train leaves no entry (a mixture's source may be smaller than one global batch: the
    mixture as a whole is checked by `load_dataset`)."""
    if n_train >= spec.batch.global_batch_size:
        return
    why = (
        f" ({dropped} records dropped, nothing left to learn in them: a prompt longer than data.max_seq_len, "
        "a chat whose only assistant message opens it, an empty or identical pair)"
        if dropped
        else ""
    )
    key = "data.mix" if spec.data.mix is not None else "data.path"
    raise SpecError(
        f"{key}: {n_train} usable training records, fewer than "
        f"batch.global_batch_size={spec.batch.global_batch_size}{why}"
    )


def publish_entry(final: Path, build: Callable[[Path], None]) -> Path:
    """`build_once` for the cache entry `final` (`build` writes its files into a temporary
    directory, published by atomic rename); bad data (a SpecError) leaves nothing behind. The one
    way an entry is published: by a job (`load_dataset`) and by `rayft data prepare`."""
    try:
        return build_once(final, build, "the tokenized data")
    except SpecError:
        _remove_if_unused(final)
        raise


def _build(tmp: Path, spec: JobSpec, tokenizer, content: str) -> None:
    """Read and tokenize the spec's data into a cache entry's files under `tmp`."""
    records, eval_records = read_records(spec, tokenizer)
    splits = {
        name: (len(recs), tokenized(spec, tokenizer, recs))
        for name, recs in (("train", records), ("eval", eval_records))
    }
    write_entry(tmp, spec, content, splits)


def tokenized(spec: JobSpec, tokenizer, records: Sequence[dict]) -> Iterable[Any]:
    """What an entry holds of each record, in record order: an `Example` or None (SFT), a `Pair`
    or its drop reason (preference). The one per-record rule of every build: each record's result
    depends on that record only, so any partition of the records gives the same results."""
    d = spec.data
    if data_kind(spec) == PAIRS:
        return tokenize_pairs_iter(records, tokenizer, d.max_seq_len, spec.model.name)
    return tokenize_iter(records, tokenizer, d.max_seq_len, d.train_on, spec.model.name)


def write_entry(tmp: Path, spec: JobSpec, content: str, splits: Mapping[str, tuple[int, Iterable[Any]]]) -> None:
    """Write an entry's files under `tmp` from `splits`: for "train" then "eval", the split's
    record count and what `tokenized` yields for its records, in order. Each split's iterable is
    consumed to its end before the next is read (so both may draw from one stream). The one
    writer of every build: the same results give the same bytes, `meta.json` included."""
    meta: dict[str, Any] = {"content_hash": content, "records": splits["train"][0], "eval_records": splits["eval"][0]}
    if data_kind(spec) == PAIRS:
        return _write_pairs(tmp, spec, meta, splits)
    kept = 0
    for name in ("train", "eval"):
        w = _SplitWriter(tmp, name)
        for ex in splits[name][1]:
            if ex is not None:
                w.add(ex)
        meta[name] = w.close()
        kept += meta[name]["n"]
    meta["dropped"] = meta["records"] + meta["eval_records"] - kept
    if not meta["train"]["n"]:  # a mixture's source may hold less than a global batch, never nothing
        check_enough_records(spec, 0, meta["dropped"])
    _write_meta(tmp, meta)


def _write_pairs(tmp: Path, spec: JobSpec, meta: dict, splits: Mapping[str, tuple[int, Iterable[Any]]]) -> None:
    meta["kind"] = PAIRS
    dropped = {DROP_EMPTY: 0, DROP_IDENTICAL: 0}
    for name in ("train", "eval"):
        w = _PairWriter(tmp, name)
        for x in splits[name][1]:
            if isinstance(x, Pair):
                w.add(x)
            else:
                dropped[x] += 1
        meta[name] = w.close()
    meta["dropped"] = dropped[DROP_EMPTY] + dropped[DROP_IDENTICAL]
    meta["dropped_empty"], meta["dropped_identical"] = dropped[DROP_EMPTY], dropped[DROP_IDENTICAL]
    if not meta["train"]["n"]:
        check_enough_records(spec, 0, meta["dropped"])
    _write_meta(tmp, meta)


def _write_meta(tmp: Path, meta: dict) -> None:
    """`meta.json`, last: with every other file's size and sha256 (what `_verified` checks)."""
    meta["files"] = file_records(tmp, entry_files(meta.get("kind", SFT)))
    (tmp / "meta.json").write_text(json.dumps(meta))


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
