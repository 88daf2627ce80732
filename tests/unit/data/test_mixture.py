"""Weighted mixtures (`data.mix`): the sampling rule, per-source epochs, the cache entry per source,
the oracles SFT has (split equivalence, bitwise resume), per-source metrics, and the refusals."""

from __future__ import annotations

import heapq
import json
import math
import random
import tempfile
from collections import Counter
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from gradtools import ROOT, final_adapter, reference_run, rel_err, spawn
from hypothesis import given
from hypothesis import strategies as st
from runs import metric_lines

from jobs.data import (
    IGNORE,
    Concatenated,
    Example,
    MixtureBatches,
    Pair,
    TokenizedPairs,
    TokenizedSplit,
    batches_for,
    collate,
    collate_at,
    collate_pairs,
    collate_pairs_at,
    count_inputs,
    count_labels,
    group_by_length,
    load_dataset,
    split_window,
    step_metrics,
)
from jobs.data.entry import _PairWriter, _SplitWriter
from jobs.data.mixture import integer_weights
from jobs.objectives import Objective
from jobs.spec import load_spec
from jobs.train.loop import micro_batches_of
from jobs.train.prefetch import Prefetch

MIX = "examples/tiny-mix.yaml"
DATA = ROOT / "examples" / "data"


def brute_force_slots(weights, total: int) -> list[int]:
    """The source of each of the first `total` slots, by merging every source's slot times
    (j + 1/2) / w_s in (time, source) order with a heap: the rule as the docstring states it."""
    w = [Fraction(x) for x in weights]
    heap = [(Fraction(1, 2) / w[s], s, 0) for s in range(len(w))]
    heapq.heapify(heap)
    out = []
    while len(out) < total:
        _, s, j = heapq.heappop(heap)
        out.append(s)
        heapq.heappush(heap, ((j + Fraction(3, 2)) / w[s], s, j + 1))
    return out


WEIGHTS = [[0.6, 0.3, 0.1], [3, 1], [1, 1, 1], [0.05, 0.95], [1e-3, 2.5, 0.7, 0.7], [7]]


@pytest.mark.parametrize("weights", WEIGHTS, ids=[str(w) for w in WEIGHTS])
def test_the_slot_counts_are_the_merge_of_the_sources_slot_times(weights):
    """`counts(T)` (computed from T alone) and the batches' slots agree with merging the slot times one
    by one, for every T up to 40 batches of 8; and every prefix stays within (1 + S p_s) / 2 of its share."""
    b = MixtureBatches([50] * len(weights), weights, 8, seed=0)
    seq = brute_force_slots(weights, 8 * 40)
    p = [Fraction(x) / sum(Fraction(y) for y in weights) for x in weights]
    for t in range(len(seq) + 1):
        want = [seq[:t].count(s) for s in range(len(weights))]
        assert b.counts(t) == want, t
        for s, n in enumerate(want):
            assert abs(n - t * p[s]) <= (1 + len(weights) * p[s]) / 2, (t, s, n)
    assert [s for k in range(40) for s, _ in b.slots(k)] == seq


def test_integer_weights_keep_the_exact_ratios():
    ints = integer_weights([0.6, 0.3, 0.1])
    assert math.gcd(*ints) == 1
    assert Fraction(ints[0], ints[1]) == Fraction(0.6) / Fraction(0.3)
    assert Fraction(ints[1], ints[2]) == Fraction(0.3) / Fraction(0.1)
    assert integer_weights([3, 1]) == [3, 1] and integer_weights([0.5, 0.25]) == [2, 1]


def test_proportions_over_100_steps_match_the_weights():
    """The example's sources (sizes as tokenized, weights 0.6 / 0.3 / 0.1, global batch 16): over
    100 steps each source's samples are its share of the 1600 to within the rule's bound."""
    sizes, weights, g = [256, 58, 115], [0.6, 0.3, 0.1], 16
    b = MixtureBatches(sizes, weights, g, seed=0)
    got = Counter(b.source_of(i) for k in range(100) for i in b.indices(k))
    for s, w in enumerate(weights):
        assert abs(got[s] - 100 * g * w) <= (1 + 3 * w) / 2, (s, got[s])
    # Every single step too: within one sample of its share (the prefix bound at both ends).
    for k in range(100):
        per = Counter(s for s, _ in b.slots(k))
        for s, w in enumerate(weights):
            assert abs(per[s] - g * w) <= 1 + 3 * w, (k, s, per[s])


def test_each_source_has_its_own_epochs():
    """A small source repeats, each of its epochs a permutation of its samples; a large source's
    samples do not repeat before its epoch is over; the epochs logged are samples drawn / size."""
    sizes, weights, g = [10, 400], [1, 1], 8
    b = MixtureBatches(sizes, weights, g, seed=3)
    stream: dict[int, list[int]] = {0: [], 1: []}
    for k in range(25):
        for i in b.indices(k):
            stream[b.source_of(i)].append(i)
    small, large = stream[0], stream[1]
    assert len(small) == len(large) == 100  # equal weights: 4 + 4 per batch
    for e in range(10):  # ten epochs of the small source, each a new permutation of 0..9
        assert sorted(small[10 * e : 10 * e + 10]) == list(range(10))
    assert len({tuple(small[10 * e : 10 * e + 10]) for e in range(10)}) > 1
    assert len(set(large)) == 100 and all(10 <= i < 410 for i in large)
    assert b.source_epochs(25) == [10.0, 0.25]
    assert b.epoch_of(25) == 25 * 8 / 410


def test_indices_depend_only_on_seed_and_step():
    """Any order of asking, any fresh sampler: the same batches (resume asks for step k first)."""
    args = ([37, 120, 5], [0.2, 0.5, 0.3], 12)
    seq = [MixtureBatches(*args, seed=1).indices(k) for k in range(30)]
    fresh = MixtureBatches(*args, seed=1)
    order = list(range(30))
    random.Random(0).shuffle(order)
    assert all(fresh.indices(k) == seq[k] for k in order)
    assert MixtureBatches(*args, seed=2).indices(0) != seq[0]
    assert all(len(s) == 12 for s in seq)


# ---- the sources side by side: the host path's arrays ---------------------------------------


def same(a: dict, b: dict) -> bool:
    """The same fields, in the same order, each tensor equal with the same dtype and shape."""
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _part(samples: list, directory: Path, name: str, on_disk: bool):
    """`samples` as a cache entry's split, written and memory-mapped (`on_disk`) or in memory."""
    pairs = isinstance(samples[0], Pair)
    if not on_disk:
        return (TokenizedPairs if pairs else TokenizedSplit).of(samples)
    w = (_PairWriter if pairs else _SplitWriter)(directory, name)
    for x in samples:
        w.add(x)
    meta = w.close()
    return (TokenizedPairs if pairs else TokenizedSplit).open(directory, name, meta["n_tokens"])


def _joined(parts: list[list], on_disk: list[bool], directory: Path) -> Concatenated:
    return Concatenated([_part(p, directory, f"s{i}", d) for i, (p, d) in enumerate(zip(parts, on_disk, strict=True))])


tokens = st.integers(0, 300)


@st.composite
def examples(draw) -> Example:
    n = draw(st.integers(1, 30))
    ids = draw(st.lists(tokens, min_size=n, max_size=n))
    labelled = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return Example(tuple(ids), tuple(t if keep else IGNORE for t, keep in zip(ids, labelled, strict=True)))


nonempty = st.lists(tokens, min_size=1, max_size=16).map(tuple)
pairs = st.builds(Pair, nonempty, nonempty, nonempty)


@st.composite
def sources(draw, sample):
    """(1 to 3 sources of samples, each on disk or in memory; 1 to 24 indices into them all)."""
    parts = draw(st.lists(st.lists(sample, min_size=1, max_size=10), min_size=1, max_size=3))
    on_disk = draw(st.lists(st.booleans(), min_size=len(parts), max_size=len(parts)))
    n = sum(map(len, parts))
    return parts, on_disk, draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=24))


@given(sources(examples()), st.sampled_from([0, 16, 48]), st.integers(1, 4))
def test_sources_side_by_side_count_group_and_collate_as_one_list(case, pack_tokens, micro):
    """A mixture's `Concatenated` training split through the host path (counts, length grouping,
    `collate_at` with and without packing) gives what the same samples give as one list: each
    sample is read from its own source's arrays at its global index."""
    parts, on_disk, idx = case
    flat = [x for p in parts for x in p]
    with tempfile.TemporaryDirectory() as tmp:
        joined = _joined(parts, on_disk, Path(tmp))
        assert len(joined) == len(flat) and [joined[i] for i in range(len(flat))] == flat
        assert joined.lengths.tolist() == [e.length for e in flat]
        assert count_labels(joined, idx) == count_labels(flat, idx)
        assert count_inputs(joined, idx) == count_inputs(flat, idx)
        order = group_by_length(joined, idx)
        assert order.tolist() == group_by_length(flat, idx).tolist()
        for s in range(0, len(order), micro):
            mb = order[s : s + micro]
            kw = {"pack_tokens": pack_tokens, "row_multiple": 16}
            assert same(collate_at(joined, mb, 7, **kw), collate([flat[i] for i in mb], 7, **kw))
        with pytest.raises(IndexError):
            joined.segments("ids", np.asarray([len(flat)]))


@given(sources(pairs))
def test_pair_sources_side_by_side_collate_as_one_list(case):
    parts, on_disk, idx = case
    flat = [x for p in parts for x in p]
    with tempfile.TemporaryDirectory() as tmp:
        joined = _joined(parts, on_disk, Path(tmp))
        assert count_labels(joined, idx) == count_labels(flat, idx)
        assert count_inputs(joined, idx) == count_inputs(flat, idx)
        assert joined.lengths.tolist() == [p.length for p in flat]
        assert same(collate_pairs_at(joined, idx, 5), collate_pairs([flat[i] for i in idx], 5))


def test_mixture_windows_go_through_the_array_path_and_prefetch(tmp_path, monkeypatch):
    """`micro_batches_of` on a mixture: the sampler's index array, grouped and split as for one
    source, every micro-batch the collation of its samples as a list, the per-source counts adding
    up to the window's; the prefetched windows, fresh and resumed at step 3, are the same."""
    monkeypatch.chdir(ROOT)
    from jobs.model.loading import load_base_model

    spec = mix_spec(tmp_path, "resources.num_workers=2", "batch.global_batch_size=8", "batch.micro_batch_size=2")
    _, tok = load_base_model(spec, "fp32")
    data = load_dataset(spec, tok)
    assert isinstance(data.train, Concatenated)
    job = SimpleNamespace(
        batches=batches_for(spec, data), data=data, tokenizer=tok, objective=Objective(), reference=None
    )
    ctx = SimpleNamespace(rank=1, world_size=2, device=torch.device("cpu"))
    assert isinstance(job.batches, MixtureBatches)
    direct = [micro_batches_of(spec, ctx, job, k) for k in range(6)]
    for k, w in enumerate(direct):
        idx = group_by_length(data.train, job.batches.index_array(k))
        mine = split_window(idx, 1, 2, 2, spec.grad_accum_steps)
        want = [collate([data.train[i] for i in mb], tok.pad_token_id) for mb in mine]
        assert all(same(a, b) for a, b in zip(w.micro_batches, want, strict=True))
        assert w.metrics == step_metrics(job.batches, data, k) and w.n_labels == count_labels(data.train, idx)
        assert sum(v for key, v in w.metrics.items() if key.startswith("label_tokens/")) == w.n_labels
    for steps in (range(0, 6), range(3, 6)):
        with Prefetch(lambda k: micro_batches_of(spec, ctx, job, k), steps) as ahead:
            got = [ahead.get(k) for k in steps]
        for w, want_w in zip(got, direct[steps.start :], strict=True):
            assert (w.n_labels, w.n_inputs, w.metrics) == (want_w.n_labels, want_w.n_inputs, want_w.metrics)
            assert all(same(a, b) for a, b in zip(w.micro_batches, want_w.micro_batches, strict=True))


# ---- the spec, the cache --------------------------------------------------------------------


def mix_spec(tmp: Path, *overrides: str, files: bool = True):
    return load_spec(ROOT / MIX, [f"run.output_dir={tmp / 'out'}", *overrides], files=files)


def test_a_mixture_is_read_per_source_and_concatenated(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    from jobs.model.loading import load_base_model

    spec = mix_spec(tmp_path)
    _, tok = load_base_model(spec, "fp32")
    data = load_dataset(spec, tok)
    assert [p.name for p in data.sources] == ["tiny", "tiny-chat", "tiny-text"]
    # tiny.jsonl: 256 records and its own eval file; the others hold 10% out (data.eval_fraction).
    assert [(p.n_train, p.n_eval) for p in data.sources] == [(256, 32), (58, 6), (115, 13)]
    assert len(data.train) == 256 + 58 + 115 and len(data.eval) == 32 + 6 + 13
    # Each source is the entry it would be as a job's only data (shared with one-source runs).
    for i, part in enumerate(data.sources):
        alone = load_dataset(spec.for_source(i), tok)
        assert part.cache_dir == alone.cache_dir
        assert [data.train[part.train_offset + j] for j in (0, part.n_train - 1)] == [
            alone.train[0],
            alone.train[part.n_train - 1],
        ]


def test_adding_a_source_tokenizes_only_that_source(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    import jobs.data.cache as cache
    from jobs.model.loading import load_base_model

    built: list[str] = []
    real = cache._build

    def counted(tmp, spec, tokenizer, content):
        built.append(Path(spec.data.path[0]).name)
        return real(tmp, spec, tokenizer, content)

    monkeypatch.setattr(cache, "_build", counted)
    two = [{"path": str(DATA / "tiny.jsonl"), "weight": 2}, {"path": str(DATA / "tiny-text.jsonl"), "weight": 1}]
    three = two + [{"path": str(DATA / "tiny-chat.jsonl"), "weight": 1}]
    spec = mix_spec(tmp_path, f"data.mix={json.dumps(two)}")
    _, tok = load_base_model(spec, "fp32")
    first = load_dataset(spec, tok)
    assert built == ["tiny.jsonl", "tiny-text.jsonl"]
    stamps = [(p.cache_dir / "meta.json").stat().st_mtime_ns for p in first.sources]
    second = load_dataset(mix_spec(tmp_path, f"data.mix={json.dumps(three)}"), tok)
    assert built == ["tiny.jsonl", "tiny-text.jsonl", "tiny-chat.jsonl"]  # only the new one
    assert [p.cache_dir for p in second.sources[:2]] == [p.cache_dir for p in first.sources]
    assert [(p.cache_dir / "meta.json").stat().st_mtime_ns for p in second.sources[:2]] == stamps
    # A changed weight (or order) is a new mixture of the same entries: nothing tokenized.
    load_dataset(mix_spec(tmp_path, f"data.mix={json.dumps(three[::-1])}"), tok)
    assert len(built) == 3


def test_the_preview_of_a_mixture_is_each_sources_cache_entry(tmp_path, monkeypatch):
    """`rayft data preview` of a mixture: one table per source, named as its metrics are, whose
    counts are those of the source's own cache entry (its fields and train_on), and the sum."""
    monkeypatch.chdir(ROOT)
    from jobs.data.preview import data_preview
    from jobs.model.loading import load_base_model

    spec = mix_spec(tmp_path)
    _, tok = load_base_model(spec, "fp32")
    data = load_dataset(spec, tok)
    doc = data_preview(spec, tok, 1)
    assert [s["name"] for s in doc["sources"]] == [p.name for p in data.sources]
    for src, part in zip(doc["sources"], data.sources, strict=True):
        assert (src["train"]["kept"], src["eval"]["kept"]) == (part.n_train, part.n_eval)
        mine = np.arange(part.train_offset, part.train_offset + part.n_train)
        assert src["train"]["label_tokens"] == count_labels(data.train, mine)
        assert src["train"]["tokens"] == count_inputs(data.train, mine)
    assert doc["train"]["kept"] == len(data.train) and doc["eval"]["kept"] == len(data.eval)
    first = data.train[0]
    assert [t["id"] for t in doc["samples"][0]["tokens"]] == [*first.input_ids, first.targets[-1]]


# ---- refusals: one line, exit 2, nothing created (the real CLI path) -------------------------


def _mix(*entries, **data) -> dict:
    return {
        "name": "bad-mix",
        "data": {"mix": [dict(e) for e in entries], **data},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "run": {"max_steps": 1},
    }


A = {"path": str(DATA / "tiny.jsonl"), "weight": 1}
B = {"path": str(DATA / "tiny-text.jsonl"), "weight": 1}
PAIRS = {"path": str(DATA / "tiny-pairs.jsonl"), "weight": 1}
DPO = {"objective": {"name": "dpo"}}

REFUSED = [
    ("weight-zero", _mix(A, dict(B, weight=0)), "data.mix.1.weight: Input should be greater than 0"),
    ("weight-negative", _mix(dict(A, weight=-1), B), "data.mix.0.weight: Input should be greater than 0"),
    ("weight-inf", _mix(A, dict(B, weight=float("inf"))), "data.mix.1.weight: Input should be a finite number"),
    ("weight-nan", _mix(A, dict(B, weight=float("nan"))), "data.mix.1.weight: Input should be a finite number"),
    ("weight-missing", _mix(A, {"path": B["path"]}), "data.mix.1.weight: required key is missing"),
    ("weight-text", _mix(A, dict(B, weight="much")), "data.mix.1.weight: must be a number, not a string"),
    ("path-and-mix", _mix(A, B, path=A["path"]), "give data.path (one or more sources, concatenated) or data.mix"),
    ("listed-twice", _mix(A, B, dict(A, weight=3)), "data.mix.2.path: "),
    ("listed-twice-spelled-apart", _mix(A, dict(A, path=A["path"].replace("/data/", "/data/./"))), "listed twice"),
    ("empty-mix", _mix(), "data.mix: must name at least one source"),
    ("eval-path-with-mix", _mix(A, B, eval_path=A["path"]), "data.eval_path: not used with data.mix"),
    ("names-collide", _mix(A, dict(B, name="tiny")), "two sources are named 'tiny'"),
    ("name-not-a-metric-name", _mix(A, dict(B, name="a b")), "data.mix.1.name: 'a b' is not a source name"),
    ("pairs-in-an-sft-mixture", _mix(A, PAIRS), "data.mix.1.path: "),
    ("sft-in-a-dpo-mixture", dict(_mix(PAIRS, A), **DPO), "data.mix.1.path: "),
    ("source-missing", _mix(A, dict(B, path="gone.jsonl")), "data.mix.1.path: file not found: gone.jsonl"),
]
KIND_MESSAGES = {
    "pairs-in-an-sft-mixture": "holds pairs and data.mix.0.path SFT records: every source of a mixture holds the "
    "records objective.name=sft trains on (SFT records)",
    "sft-in-a-dpo-mixture": "holds SFT records and data.mix.0.path pairs: every source of a mixture holds the "
    "records objective.name=dpo trains on (pairs)",
    "listed-twice": "is listed twice (also data.mix.0.path)",
}


@pytest.mark.parametrize("name,spec,fragment", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_mixtures_are_refused_in_one_line(name, spec, fragment, tmp_path, capsys):
    from orchestrator.cli import main

    spec = json.loads(json.dumps(spec))  # a copy, with inf / nan as YAML writes them below
    spec["run"]["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    rc = main(["run", str(path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("rayft: error: ") and fragment in lines[0], lines[0]
    assert KIND_MESSAGES.get(name, "") in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".rayft-data/*")), "nothing tokenized for a refused spec"


def test_a_source_named_twice_through_a_link_is_refused(tmp_path, capsys):
    from orchestrator.cli import main

    link = tmp_path / "again.jsonl"
    link.symlink_to(DATA / "tiny.jsonl")
    spec = _mix(A, B, dict(A, path=str(link), name="again"))
    spec["run"]["output_dir"] = str(tmp_path / "out")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["run", str(tmp_path / "spec.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.mix.2.path:" in err[0] and "data.mix.0.path names too" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_mixture_spec_written_out_reads_back_the_same(tmp_path):
    """`rayft spec check` prints `path: []` beside `mix`: that output is a valid spec of the same job."""
    spec = mix_spec(tmp_path, files=False)
    assert spec.data.path == [] and spec.is_mixture
    again = load_spec(data=yaml.safe_load(spec.to_yaml()), files=False)
    assert again == spec and again.spec_hash() == spec.spec_hash()


# ---- training: the oracles SFT has ------------------------------------------------------------

# (workers, micro-batch) at global batch 8: 1 x 1 x 8, 2 x 2 x 2, 4 x 2 x 1 (workers x accumulation x micro).
SPLITS = [(1, 8), (2, 2), (4, 1)]
SHORT = ["batch.global_batch_size=8", "run.max_steps=3", "run.eval_every=3", "optim.schedule=constant"]
PAIR_MIX = [
    {"path": str(DATA / "tiny-pairs.jsonl"), "weight": 2, "eval_path": str(DATA / "tiny-pairs-eval.jsonl")},
    {
        "path": str(DATA / "capitals-pairs-train.jsonl"),
        "weight": 1,
        "eval_path": str(DATA / "capitals-pairs-eval.jsonl"),
    },
]
DPO_MIX = [f"data.mix={json.dumps(PAIR_MIX)}", "objective.name=dpo", "data.eval_fraction=0"]


def _split_run(tmp: Path, w: int, m: int, *extra: str) -> tuple[list[dict], dict]:
    out = tmp / f"W{w}m{m}"
    overrides = [f"resources.num_workers={w}", f"batch.micro_batch_size={m}", *SHORT, *extra]
    if w == 1:
        reference_run(0, 1, MIX, overrides, str(out))
    else:
        spawn(reference_run, w, tmp / f"spawn-{w}", MIX, overrides, str(out))
    return metric_lines(out), final_adapter(out)


def _per_source(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.split("/")[0] in ("samples", "label_tokens", "epoch")}


@pytest.mark.slow  # six short runs, two of them on 4 gloo ranks
@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_every_split_of_a_mixture_trains_the_same_steps(objective, tmp_path, monkeypatch):
    """1 x 1 x 8, 2 x 2 x 2 and 4 x 2 x 1: the same samples per source in every step, the same losses
    and per-source held-out losses (fp32 CPU: 1e-5, as SFT's gradient oracle), the same adapter to
    1e-4, the bound of the two-worker run in tests/integration/test_train.py: AdamW divides each update by
    sqrt(v), so the summation order of near-zero gradient components shows in the weights (2.8e-5
    seen at 4 x 2 x 1 after 3 steps) though not in the losses."""
    monkeypatch.chdir(ROOT)
    extra = DPO_MIX if objective == "dpo" else []
    runs = {(w, m): _split_run(tmp_path, w, m, *extra) for w, m in SPLITS}
    base_metrics, base_adapter = runs[SPLITS[0]]
    assert len(base_metrics) == 3 and base_adapter
    for split, (metrics, adapter) in runs.items():
        for a, b in zip(metrics, base_metrics, strict=True):
            assert _per_source(a) == _per_source(b), split
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (split, a["step"])
        evals = [k for k in base_metrics[-1] if k.startswith("eval_loss")]
        sources = [k for k in base_metrics[-1] if k.startswith("samples/")]
        assert len(evals) == 1 + len(sources) == (4 if objective == "sft" else 3)  # the whole, each source
        for k in evals:
            assert metrics[-1][k] == pytest.approx(base_metrics[-1][k], rel=1e-5), (split, k)
        assert rel_err(adapter, base_adapter) <= 1e-4, split
    for r in base_metrics:  # the per-source numbers add up to the step's
        assert sum(v for k, v in r.items() if k.startswith("samples/")) == 8
        assert sum(v for k, v in r.items() if k.startswith("label_tokens/")) == r["label_tokens"]


def test_held_out_loss_of_a_mixture_is_the_whole_and_per_source(tmp_path, monkeypatch):
    """eval_loss is the token-weighted mean over every source's held-out split, eval_loss/NAME each
    source's own; the per-source metrics reach TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jobs.model.loading import load_base_model
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    monkeypatch.chdir(ROOT)
    spec = mix_spec(tmp_path, "resources.num_workers=1", *SHORT, "run.trackers=[tensorboard]")
    train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    last = metric_lines(spec.output_path)[-1]
    _, tok = load_base_model(spec, "fp32")
    data = load_dataset(spec, tok)
    tokens = {p.name: sum(data.eval[p.eval_offset + i].n_labels for i in range(p.n_eval)) for p in data.sources}
    whole = sum(last[f"eval_loss/{n}"] * t for n, t in tokens.items()) / sum(tokens.values())
    assert last["eval_loss"] == pytest.approx(whole, rel=1e-9)
    assert len({last[f"eval_loss/{n}"] for n in tokens}) == 3  # three different sources, three losses
    events = EventAccumulator(str(spec.output_path / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"samples/tiny", "label_tokens/tiny-chat", "epoch/tiny-text", "eval_loss/tiny"} <= tags
    assert [e.step for e in events.Scalars("eval_loss/tiny")] == [3]  # only where it was measured


def _train_steps(out: Path, steps: int, *extra: str) -> None:
    from jobs.spec import absolutize
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    spec = absolutize(
        load_spec(
            MIX,
            [
                f"run.output_dir={out}",
                "resources.num_workers=1",
                "batch.global_batch_size=8",
                "batch.micro_batch_size=4",
                "optim.schedule=constant",
                "run.checkpoint_every=2",
                "run.keep_checkpoints=4",
                "run.eval_every=2",
                f"run.max_steps={steps}",
                *extra,
            ],
        )
    )
    train(spec, LocalContext(on_progress=lambda r: None), resume=True)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_mixture_run_resumes_bitwise(objective, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    extra = DPO_MIX if objective == "dpo" else []
    _train_steps(tmp_path / "straight", 4, *extra)
    _train_steps(tmp_path / "resumed", 2, *extra)
    _train_steps(tmp_path / "resumed", 4, *extra)
    a, b = final_adapter(tmp_path / "straight"), final_adapter(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    straight, resumed = metric_lines(tmp_path / "straight"), metric_lines(tmp_path / "resumed")
    drop = ("tokens_per_s", "step_time_s", "peak_mem_gib")
    assert [{k: v for k, v in r.items() if k not in drop} for r in straight] == [
        {k: v for k, v in r.items() if k not in drop} for r in resumed
    ]
    assert straight[-1]["epoch/tiny-chat" if objective == "sft" else "epoch/tiny-pairs"] > 0


def test_a_changed_mixture_refuses_to_resume(tmp_path, monkeypatch, capsys):
    from jobs.finetune import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    base = [MIX, "--local", f"run.output_dir={out}", "resources.num_workers=1", "batch.global_batch_size=8"]
    assert main(base + ["run.max_steps=1", "run.checkpoint_every=1"]) == 0
    capsys.readouterr()
    spec = yaml.safe_load((ROOT / MIX).read_text())
    reweighted = [dict(src, weight=1) for src in spec["data"]["mix"]]
    assert main(base + ["run.max_steps=2", f"data.mix={json.dumps(reweighted)}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cannot resume" in lines[0] and "data.mix:" in lines[0], lines
    assert len(metric_lines(out)) == 1  # nothing ran


def test_estimate_of_a_mixture_is_that_of_its_longest_source(tmp_path, capsys):
    """One `data.max_seq_len` bounds every source: the plan assumes rows of its longest input,
    the same for the mixture as for any of its sources alone; `rayft estimate` reads the mixture."""
    from jobs.memory import plan_for_spec
    from orchestrator.cli import main

    spec = mix_spec(tmp_path, files=False)
    plan = plan_for_spec(spec, device="cpu")
    assert plan.seq_len == spec.data.max_seq_len - 1
    for i in range(3):
        assert plan_for_spec(spec.for_source(i), device="cpu").estimate == plan.estimate
    assert main(["estimate", str(ROOT / MIX), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["seq_len"] == 255


def test_a_dpo_mixture_with_a_precomputed_reference_trains_the_same_steps(tmp_path, monkeypatch):
    """The reference log-probabilities of a mixture's pairs, stored once beside its entries, give
    the steps and per-source held-out losses of the live reference forward (to fp32 rounding, as
    for one source in tests/unit/objectives/test_preference.py)."""
    monkeypatch.chdir(ROOT)
    _train_steps(tmp_path / "live", 2, *DPO_MIX)
    _train_steps(tmp_path / "pre", 2, *DPO_MIX, "objective.reference=precomputed")
    live, pre = metric_lines(tmp_path / "live"), metric_lines(tmp_path / "pre")
    assert list(tmp_path.glob(".rayft-data/mix-*.reference-*"))
    for a, b in zip(live, pre, strict=True):
        assert _per_source(a) == _per_source(b)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
    for key in ("eval_loss", "eval_loss/tiny-pairs", "eval_loss/capitals-pairs-train"):
        assert pre[-1][key] == pytest.approx(live[-1][key], rel=1e-5), key


def test_a_source_whose_weight_gets_it_no_sample_is_refused(tmp_path):
    """A weight so small that the source's share of the run's samples rounds to zero was accepted:
    the source was tokenized and listed, and never trained on."""
    from jobs.errors import SpecError

    mix = yaml_mix_with_weights(0.6, 0.3, 1e-6)
    with pytest.raises(SpecError, match=r"data.mix: source 'tiny-text' \(weight 1e-06\) gets no sample"):
        _train_steps(tmp_path / "run", 2, f"data.mix={mix}")
    _train_steps(tmp_path / "ok", 2, f"data.mix={yaml_mix_with_weights(0.6, 0.3, 0.1)}")  # the shipped weights run


def test_a_source_that_never_gets_a_sample_is_refused_before_the_run_directory_exists(tmp_path, monkeypatch):
    """`rayft run`'s preparation refuses it on the driver, with nothing created where the run would
    write (it was refused only on rank 0, after the run directory and its lock existed)."""
    from jobs.errors import SpecError
    from jobs.finetune import prepare

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    overrides = [f"run.output_dir={out}", "run.max_steps=2", f"data.mix={yaml_mix_with_weights(0.6, 0.3, 1e-6)}"]
    with pytest.raises(SpecError, match=r"data.mix: source 'tiny-text' \(weight 1e-06\) gets no sample"):
        prepare(MIX, [*overrides, "resources.num_workers=1"], fresh=False, local=True)
    assert not out.exists()


def yaml_mix_with_weights(*weights: float) -> str:
    """examples/tiny-mix.yaml's three sources with other weights, as one override."""
    import yaml

    spec = yaml.safe_load((ROOT / MIX).read_text())
    sources = spec["data"]["mix"]
    for src, w in zip(sources, weights, strict=True):
        src["weight"] = w
    return yaml.safe_dump(sources, default_flow_style=True).strip()
