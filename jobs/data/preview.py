"""What a job trains on, before it runs (`rayft data preview`): the first training samples as the
model sees them and the statistics of the whole set, as one JSON-able document.

Read-only: records are read and tokenized by the functions that build the tokenized cache
(`read_records`, then `tokenize_iter_truncated` or `tokenize_pairs_iter_truncated`, the
iterators behind `tokenize_iter` / `tokenize_pairs_iter`, called with the arguments
`jobs.data.cache._build` passes), in memory; no cache entry, lock or memo is written. So sample i
of the preview is sample i of the cache entry the job builds, token for token and label for label
(tests/unit/data/test_preview.py compares them).

A sample is shown as the sequence the loss sees: an SFT `Example` as its input ids plus the last
target when that is a label (the one token that is only predicted), each token marked `label`
when the loss is computed on predicting it; a `Pair` as its prompt (no label) and each response
(every token a label). Each token carries the text it adds to the decoded sequence
(`token_texts`), so the texts joined are the decoded text.

Statistics are kept per source and split (`SplitStats`) and summed over the sources. A spec's
sources (`spec_sources`) are `data.path` (one or several files, concatenated into one cache
entry), or each source of a mixture (`data.mix`), read and tokenized as its own cache entry is
(`JobSpec.for_source`: its own fields and train_on) and named as its metrics are.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from jobs.data.cache import check_mixture_kinds, data_kind, source_keys
from jobs.data.pairs import DROP_EMPTY, DROP_IDENTICAL, Pair, tokenize_pairs_iter_truncated
from jobs.data.records import PAIR_FIELDS, PAIRS
from jobs.data.sources import read_records
from jobs.data.tokenizing import IGNORE, Example, tokenize_iter_truncated
from jobs.spec import JobSpec

HISTOGRAM_BINS = 10  # at most; bins are equal ranges of sequence length ending at max_seq_len
DROP_NO_LABEL = "no_label"  # an SFT record left without a label token after truncation
DROP_TOO_LONG = "too_long"  # a prompt leaving no room for a completion (`jobs.data.prompts`)
PROMPTS = "prompts"  # the records of online RL (`ObjectiveSection.records`)
DROP_REASONS = {PAIRS: (DROP_EMPTY, DROP_IDENTICAL), PROMPTS: (DROP_TOO_LONG,)}


@dataclass(frozen=True)
class Source:
    """One source of training data and its checked records (texts cut as the cache's build cuts
    them), split into training and held-out records."""

    name: str  # how the spec names it: "data.path", or a mixture source's name (`samples/NAME`)
    paths: tuple[str, ...]
    train: Sequence[dict]
    eval: Sequence[dict]
    spec: JobSpec  # the spec its records are tokenized by (a mixture source's: `JobSpec.for_source`)


def spec_sources(spec: JobSpec, tokenizer) -> list[Source]:
    """The spec's sources, read (and split) exactly as the cache's build reads them: `data.path`
    with all its files, which the job tokenizes into one cache entry, or each source of a mixture,
    which the job tokenizes into its own entry (`load_mixture`)."""
    if spec.data.mix is None:
        train, held = read_records(spec, tokenizer)
        return [Source("data.path", tuple(spec.data.path), train, held, spec)]
    check_mixture_kinds(spec)
    out = []
    for i, src in enumerate(spec.data.mix):
        one = spec.for_source(i)
        with source_keys(i):
            train, held = read_records(one, tokenizer)
        out.append(Source(src.shown_name, (src.path,), train, held, one))
    return out


def samples(spec: JobSpec, tokenizer, records: Sequence[dict]) -> Iterator[tuple[Example | Pair | str | None, bool]]:
    """Per record, in order: what the cache's build makes of it (an `Example` or a `Pair`; None or
    a drop reason where it keeps nothing) and whether truncation cut it."""
    d = spec.data
    if data_kind(spec) == PAIRS:
        return tokenize_pairs_iter_truncated(records, tokenizer, d.max_seq_len, spec.model.name)
    return tokenize_iter_truncated(records, tokenizer, d.max_seq_len, d.train_on, spec.model.name)


def seq_len(sample: Example | Pair) -> int:
    """The tokens of a sample that `data.max_seq_len` bounds: an Example's sequence before the
    shift (inputs + 1), a Pair's prompt plus its longer response."""
    return sample.length + 1


@dataclass
class SplitStats:
    """Counts over one split of one source. `tokens` and `label_tokens` are what training counts
    (`n_inputs`, `n_labels`: a pair counts both of its rows); `truncated` counts kept samples that
    truncation cut; `histogram[k]` counts kept samples whose `seq_len` falls in bin k
    (`bin_edges`)."""

    max_seq_len: int
    records: int = 0
    kept: int = 0
    truncated: int = 0
    tokens: int = 0
    label_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    field_tokens: dict[str, int] = field(default_factory=dict)  # pairs: prompt, chosen, rejected
    seq_len_min: int | None = None
    seq_len_max: int | None = None
    seq_len_sum: int = 0
    histogram: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.histogram = self.histogram or [0] * len(bin_edges(self.max_seq_len))

    def add(self, sample: Example | Pair | str | None, truncated: bool) -> None:
        self.records += 1
        if not isinstance(sample, (Example, Pair)):
            reason = DROP_NO_LABEL if sample is None else sample
            self.dropped[reason] = self.dropped.get(reason, 0) + 1
            return
        n = seq_len(sample)
        self.kept += 1
        self.truncated += truncated
        self.tokens += sample.n_inputs
        self.label_tokens += sample.n_labels
        if isinstance(sample, Pair):
            for f in PAIR_FIELDS:
                self.field_tokens[f] = self.field_tokens.get(f, 0) + len(getattr(sample, f))
        self._length(n)

    def add_prompt(self, n_tokens: int) -> None:
        """A kept online-RL prompt of `n_tokens`: context generation starts from, no label."""
        self.records += 1
        self.kept += 1
        self.tokens += n_tokens
        self._length(n_tokens)

    def _length(self, n: int) -> None:
        self.seq_len_min = n if self.seq_len_min is None else min(self.seq_len_min, n)
        self.seq_len_max = n if self.seq_len_max is None else max(self.seq_len_max, n)
        self.seq_len_sum += n
        self.histogram[_bin(n, self.max_seq_len)] += 1

    def merge(self, other: SplitStats) -> SplitStats:
        """The counts of both (two sources' splits of one kind)."""
        lows = [x for x in (self.seq_len_min, other.seq_len_min) if x is not None]
        highs = [x for x in (self.seq_len_max, other.seq_len_max) if x is not None]
        return SplitStats(
            self.max_seq_len,
            self.records + other.records,
            self.kept + other.kept,
            self.truncated + other.truncated,
            self.tokens + other.tokens,
            self.label_tokens + other.label_tokens,
            _add_counts(self.dropped, other.dropped),
            _add_counts(self.field_tokens, other.field_tokens),
            min(lows) if lows else None,
            max(highs) if highs else None,
            self.seq_len_sum + other.seq_len_sum,
            [a + b for a, b in zip(self.histogram, other.histogram, strict=True)],
        )

    def to_dict(self, kind: str) -> dict:
        reasons = DROP_REASONS.get(kind, (DROP_NO_LABEL,))
        out = {
            "records": self.records,
            "kept": self.kept,
            "dropped": sum(self.dropped.values()),
            "dropped_by_reason": {r: self.dropped.get(r, 0) for r in reasons},
            "truncated": self.truncated,
            "tokens": self.tokens,
            "label_tokens": self.label_tokens,
            "label_fraction": self.label_tokens / self.tokens if self.tokens else None,
            "seq_len": {
                "min": self.seq_len_min,
                "mean": self.seq_len_sum / self.kept if self.kept else None,
                "max": self.seq_len_max,
            },
            "histogram": [
                {"lo": lo, "hi": hi, "count": c}
                for (lo, hi), c in zip(bin_edges(self.max_seq_len), self.histogram, strict=True)
            ],
        }
        if kind == PAIRS:
            out["field_tokens"] = {f: self.field_tokens.get(f, 0) for f in PAIR_FIELDS}
        return out


def bin_edges(max_seq_len: int) -> list[tuple[int, int]]:
    """(lo, hi) of each histogram bin, inclusive: equal widths over 1..max_seq_len, the last one
    ending at max_seq_len (where the truncated samples are)."""
    width = _bin_width(max_seq_len)
    return [(lo, min(lo + width - 1, max_seq_len)) for lo in range(1, max_seq_len + 1, width)]


def _bin_width(max_seq_len: int) -> int:
    return math.ceil(max_seq_len / min(HISTOGRAM_BINS, max_seq_len))


def _bin(n: int, max_seq_len: int) -> int:
    return (n - 1) // _bin_width(max_seq_len)


def _add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


# ---- one sample as the model sees it ----------------------------------------------------------


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """The text each token adds to the decoded sequence ("" for a token that only begins a
    character the next ones complete, a byte of a multi-byte character). Decoded incrementally
    over a window of the last tokens, as streaming detokenizers do, so a tokenizer that decodes
    a token differently at the start of a text (SentencePiece's leading space) still adds up:
    joined, the texts are the decoded text."""
    ids = list(ids)
    texts: list[str] = []
    prefix = read = 0  # ids[prefix:read] is the context already turned into text

    def dec(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for j in range(len(ids)):
        before, now = dec(ids[prefix:read]), dec(ids[prefix : j + 1])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            texts.append(now[len(before) :])
            prefix, read = read, j + 1
        else:
            texts.append("")
    if read < len(ids):  # an incomplete character at the end: its replacement goes to the last token
        texts[-1] = dec(ids[prefix:])[len(dec(ids[prefix:read])) :]
    return texts


def _tokens(tokenizer, ids: Sequence[int], texts: Sequence[str], labels: Sequence[bool]) -> list[dict]:
    special = set(tokenizer.all_special_ids)
    return [
        {"id": int(i), "text": t, "label": bool(lab), "special": int(i) in special}
        for i, t, lab in zip(ids, texts, labels, strict=True)
    ]


def example_view(tokenizer, ex: Example) -> dict:
    """An Example as the sequence the loss sees: its inputs, plus its last target when that is a
    label; token j > 0 is a label exactly where `targets[j - 1]` is (then it equals that target)."""
    ids = list(ex.input_ids)
    if ex.targets and ex.targets[-1] != IGNORE:
        ids.append(ex.targets[-1])
    labels = [False] + [t != IGNORE for t in ex.targets[: len(ids) - 1]]
    return {
        "tokens": _tokens(tokenizer, ids, token_texts(tokenizer, ids), labels),
        "n_tokens": ex.n_inputs,
        "n_labels": ex.n_labels,
    }


def pair_view(tokenizer, pair: Pair) -> dict:
    """A Pair as its prompt (no label) and its two responses (every token a label), each response's
    texts decoded after the prompt, as its row P + response runs."""
    p = list(pair.prompt)
    out: dict = {"n_tokens": pair.n_inputs, "n_labels": pair.n_labels}
    for f in ("chosen", "rejected"):
        ids = p + list(getattr(pair, f))
        texts = token_texts(tokenizer, ids)
        if f == "chosen":
            out["prompt"] = {"tokens": _tokens(tokenizer, p, texts[: len(p)], [False] * len(p))}
        out[f] = {"tokens": _tokens(tokenizer, ids[len(p) :], texts[len(p) :], [True] * (len(ids) - len(p)))}
    return out


# ---- the document -----------------------------------------------------------------------------


def data_preview(spec: JobSpec, tokenizer, n: int) -> dict:
    """The first `n` kept training samples (over the sources in order) as the model sees them,
    and the statistics of every source's training and held-out split and of all sources together.
    Reads and tokenizes the whole set once, in memory; writes nothing."""
    kind = data_kind(spec)
    shown: list[dict] = []
    per_source: list[tuple[Source, dict[str, SplitStats]]] = []
    for src in spec_sources(spec, tokenizer):
        stats = {"train": SplitStats(spec.data.max_seq_len), "eval": SplitStats(spec.data.max_seq_len)}
        for i, (sample, truncated) in enumerate(samples(src.spec, tokenizer, src.train)):
            stats["train"].add(sample, truncated)
            if len(shown) < n and isinstance(sample, (Example, Pair)):
                view = pair_view(tokenizer, sample) if isinstance(sample, Pair) else example_view(tokenizer, sample)
                where = {"source": src.name, "record": i, "example": stats["train"].kept - 1, "truncated": truncated}
                shown.append({**where, **view})
        for sample, truncated in samples(src.spec, tokenizer, src.eval):
            stats["eval"].add(sample, truncated)
        per_source.append((src, stats))
    total = {s: _sum([stats[s] for _, stats in per_source], spec.data.max_seq_len) for s in ("train", "eval")}
    return {
        "name": spec.name,
        "model": spec.model.name,
        "objective": spec.objective.name,
        "kind": kind,
        "max_seq_len": spec.data.max_seq_len,
        "n": n,
        "samples": shown,
        "sources": [
            {"name": src.name, "paths": list(src.paths), **{s: st.to_dict(kind) for s, st in stats.items()}}
            for src, stats in per_source
        ],
        **{s: st.to_dict(kind) for s, st in total.items()},
    }


def _sum(parts: list[SplitStats], max_seq_len: int) -> SplitStats:
    out = SplitStats(max_seq_len)
    for p in parts:
        out = out.merge(p)
    return out
