"""The step's host path: per-sample count arrays in the cache, numpy grouping / counting /
splitting, collation by array copies, and the background prefetch of the next window.

Oracle: the per-example Python path the loop ran before, kept verbatim in bench/host_path.py
(`before_*`: sorting on `Example.length`, counts summed over `Example` / `Pair` properties, list
slicing, `collate` / `collate_pairs` from tuples). The array path must agree with it exactly --
the same samples in the same micro-batches, the same tensors bit for bit (dtype included), the
same label counts (the loss normalization) -- on random data, packed and not, for Examples and
Pairs, from a cache entry on disk and from lists in memory."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bench_scripts import load_bench
from gradtools import tiny_spec
from hypothesis import given
from hypothesis import strategies as st

import jobs.data.cache as cache_mod
import jobs.train.loop as loop_mod
from jobs.data import (
    IGNORE,
    Example,
    GlobalBatches,
    Pair,
    TokenizedPairs,
    TokenizedSplit,
    collate,
    collate_at,
    collate_pairs,
    collate_pairs_at,
    count_inputs,
    count_labels,
    group_by_length,
    load_dataset,
    split_window,
)
from jobs.data.entry import _PairWriter, _SplitWriter
from jobs.errors import SpecError
from jobs.model.loading import byte_tokenizer
from jobs.objectives import Objective
from jobs.train.context import LocalContext
from jobs.train.loop import micro_batches_of
from jobs.train.prefetch import Prefetch

OLD = load_bench("host_path")  # the path before, as it was (see the module docstring)


def same(a: dict, b: dict) -> bool:
    """The same fields, in the same order, each tensor equal with the same dtype and shape."""
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _on_disk(directory: Path, samples: list, writer) -> dict:
    w = writer(directory, "train")
    for s in samples:
        w.add(s)
    return w.close()


def splits(examples: list[Example], directory: Path) -> list[TokenizedSplit]:
    """The examples as a cache entry's split (written, memory-mapped) and in memory."""
    meta = _on_disk(directory, examples, _SplitWriter)
    return [TokenizedSplit.open(directory, "train", meta["n_tokens"]), TokenizedSplit.of(examples)]


def pair_splits(pairs: list[Pair], directory: Path) -> list[TokenizedPairs]:
    meta = _on_disk(directory, pairs, _PairWriter)
    return [TokenizedPairs.open(directory, "train", meta["n_tokens"]), TokenizedPairs.of(pairs)]


tokens = st.integers(0, 300)


@st.composite
def examples(draw) -> Example:
    n = draw(st.integers(1, 40))
    ids = draw(st.lists(tokens, min_size=n, max_size=n))
    labels = draw(st.lists(tokens, min_size=n, max_size=n))
    labelled = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    targets = [t if keep else IGNORE for t, keep in zip(labels, labelled, strict=True)]
    return Example(tuple(ids), tuple(targets))


nonempty = st.lists(tokens, min_size=1, max_size=20).map(tuple)
pairs = st.builds(Pair, nonempty, nonempty, nonempty)


@st.composite
def window(draw, samples):
    """(samples, the global batch's indices -- repeats allowed, as across an epoch boundary --,
    world size, micro-batch, accumulation)."""
    items = draw(st.lists(samples, min_size=1, max_size=24))
    world, micro, accum = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    size = world * micro * accum
    idx = draw(st.lists(st.integers(0, len(items) - 1), min_size=size, max_size=size))
    return items, idx, world, micro, accum


def _old_group(samples, idx):
    return sorted(idx, key=lambda i: (samples[i].length, i))


@given(window(examples()), st.sampled_from([0, 16, 48]), st.sampled_from([1, 16]), st.booleans())
def test_sft_counts_grouping_split_and_collation_are_the_old_paths_exactly(case, pack_tokens, multiple, grouped):
    items, idx, world, micro, accum = case
    with tempfile.TemporaryDirectory() as tmp:
        for split in splits(items, Path(tmp)):
            assert split.lengths.dtype == split.label_tokens.dtype == np.int32
            assert count_labels(split, idx) == OLD.before_count_labels(items, idx)
            assert count_inputs(split, idx) == OLD.before_count_inputs(items, idx)
            order = group_by_length(split, idx) if grouped else np.asarray(idx)
            assert order.tolist() == (_old_group(items, idx) if grouped else idx)
            for rank in range(world):
                new = split_window(order, rank, world, micro, accum)
                old = OLD.before_split_window(order.tolist(), rank, world, micro, accum)
                assert new.tolist() == old
                for mb in new:
                    kw = {"pack_tokens": pack_tokens, "row_multiple": multiple}
                    want = OLD.before_collate([items[i] for i in mb], 7, **kw)
                    assert same(collate_at(split, mb, 7, **kw), want)
                    assert same(collate([items[i] for i in mb], 7, **kw), want)


@given(window(pairs), st.booleans())
def test_pair_counts_grouping_split_and_collation_are_the_old_paths_exactly(case, grouped):
    items, idx, world, micro, accum = case
    with tempfile.TemporaryDirectory() as tmp:
        for split in pair_splits(items, Path(tmp)):
            assert count_labels(split, idx) == OLD.before_count_labels(items, idx)
            assert count_inputs(split, idx) == OLD.before_count_inputs(items, idx)
            assert split.lengths.tolist() == [p.length for p in items]
            order = group_by_length(split, idx) if grouped else np.asarray(idx)
            assert order.tolist() == (_old_group(items, idx) if grouped else idx)
            for mb in split_window(order, world - 1, world, micro, accum):
                want = OLD.before_collate_pairs([items[i] for i in mb], 5)
                assert same(collate_pairs_at(split, mb, 5), want)
                assert same(collate_pairs([items[i] for i in mb], 5), want)


@given(st.integers(1, 50), st.integers(1, 60), st.integers(0, 5), st.integers(0, 12))
def test_global_batch_indices_are_the_old_paths_exactly(n, g, seed, step):
    old = OLD.BeforeGlobalBatches(n, g, seed)
    new = GlobalBatches(n, g, seed)
    for k in range(step, step + 3):  # steps advance, across epoch ends (and g > n: several per step)
        assert new.indices(k) == old.indices(k) == new.index_array(k).tolist()


def test_lists_count_as_the_cache_does():
    """Plain lists (tests, `rayft eval`) go through the same functions: their properties summed."""
    ex = [Example((1, 2, 3), (IGNORE, 2, 3)), Example((4,), (5,))]
    assert count_labels(ex, [0, 1, 0]) == 5 and count_inputs(ex, [1, 1]) == 2
    assert group_by_length(ex, [0, 1, 0]).tolist() == [1, 0, 0]


# ---- the cache entry's count arrays ---------------------------------------------------------


def _spec(tmp_path: Path, *overrides: str):
    return tiny_spec(f"run.output_dir={tmp_path / 'out'}", *overrides)


def test_an_entry_stores_each_samples_counts_with_its_tokens(tmp_path):
    tok = byte_tokenizer()
    data = load_dataset(_spec(tmp_path, "data.eval_fraction=0.25"), tok)
    for split in (data.train, data.eval):
        assert isinstance(split, TokenizedSplit) and len(split) > 0
        assert split.lengths.tolist() == [e.length for e in split]
        assert split.label_tokens.tolist() == [e.n_labels for e in split]
    files = {p.name for p in data.cache_dir.iterdir()}
    assert {"train.lengths.npy", "train.label_tokens.npy", "eval.lengths.npy", "eval.label_tokens.npy"} <= files


def test_an_entry_of_the_old_format_is_left_alone_and_the_data_built_again(tmp_path, monkeypatch):
    """A cache entry written before the count arrays (format 1: no lengths / label_tokens files)
    is never read as the new format: the key differs, so the data is tokenized again into a new
    entry, and the old entry is left as it was."""
    tok = byte_tokenizer()
    spec = _spec(tmp_path)
    monkeypatch.setattr(cache_mod, "CACHE_FORMAT", 1)
    old = load_dataset(spec, tok).cache_dir
    for p in old.glob("*.npy"):
        if not p.name.endswith(".offsets.npy"):  # what format 1 did not write
            p.unlink()
    before = sorted(p.name for p in old.iterdir())
    monkeypatch.undo()
    built = []
    real = cache_mod.tokenize_iter
    monkeypatch.setattr(cache_mod, "tokenize_iter", lambda *a, **k: built.append(1) or real(*a, **k))
    new = load_dataset(spec, tok)
    assert built and new.cache_dir != old and new.cache_dir.parent == old.parent
    assert sorted(p.name for p in old.iterdir()) == before
    assert new.train.label_tokens.tolist() == [e.n_labels for e in new.train]


# ---- prefetch --------------------------------------------------------------------------------


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rayft-prefetch")]


def _stand_ins(tmp_path: Path, *overrides: str):
    """(spec, ctx, job) enough for `micro_batches_of` on the tiny data, rank 0 of 2."""
    spec = _spec(tmp_path, "resources.num_workers=2", "batch.global_batch_size=8", *overrides)
    data = load_dataset(spec, byte_tokenizer())
    ctx = SimpleNamespace(rank=0, world_size=2, device=torch.device("cpu"))
    job = SimpleNamespace(
        batches=GlobalBatches(len(data.train), spec.batch.global_batch_size, spec.run.seed),
        data=data,
        tokenizer=SimpleNamespace(pad_token_id=byte_tokenizer().pad_token_id),
        objective=Objective(),
    )
    return spec, ctx, job


@pytest.mark.parametrize("packing", [False, True])
def test_prefetched_windows_are_the_windows_and_a_resume_sees_the_same(tmp_path, packing):
    spec, ctx, job = _stand_ins(tmp_path, f"data.packing={str(packing).lower()}")
    direct = [micro_batches_of(spec, ctx, job, k) for k in range(6)]
    for steps in (range(0, 6), range(3, 6)):  # a fresh run, and one resumed at step 3
        with Prefetch(lambda k: micro_batches_of(spec, ctx, job, k), steps) as ahead:
            got = [ahead.get(k) for k in steps]
        for w, want in zip(got, direct[steps.start :], strict=True):
            assert (w.denominator, w.n_labels, w.n_inputs) == (want.denominator, want.n_labels, want.n_inputs)
            assert all(same(a, b) for a, b in zip(w.micro_batches, want.micro_batches, strict=True))
    assert not prefetch_threads()


def test_steps_are_built_in_order_one_ahead_on_one_thread():
    calls: list[tuple[int, str]] = []
    taken = []

    def build(k):
        calls.append((k, threading.current_thread().name))
        return k * 10

    with Prefetch(build, range(2, 7)) as ahead:
        for k in range(2, 7):
            taken.append(ahead.get(k))
            time.sleep(0.01)
            assert len(calls) <= k - 2 + 2  # the step taken and at most one ahead
        with pytest.raises(RuntimeError, match="the next step is None"):
            ahead.get(7)
    assert taken == [20, 30, 40, 50, 60] and [k for k, _ in calls] == [2, 3, 4, 5, 6]
    assert {name for _, name in calls} == {calls[0][1]} != {threading.current_thread().name}
    assert not prefetch_threads()


def test_an_exception_in_the_build_reaches_the_caller_at_its_step_as_the_same_exception():
    error = SpecError("data.path: record 3 is not what it should be")

    def build(k):
        if k == 3:
            raise error
        return k

    with pytest.raises(SpecError) as caught:
        with Prefetch(build, range(10)) as ahead:
            assert [ahead.get(k) for k in range(3)] == [0, 1, 2]
            ahead.get(3)
    assert caught.value is error and str(caught.value) == "data.path: record 3 is not what it should be"
    assert not prefetch_threads()


def test_the_thread_ends_with_the_block_on_an_early_stop_and_on_an_error_in_the_step():
    started = threading.Event()

    def slow(k):
        started.set()
        time.sleep(0.2)
        return k

    with Prefetch(slow, range(100)) as ahead:
        ahead.get(0)
        started.wait()  # step 1 is being built when the loop stops
    assert not prefetch_threads()
    with pytest.raises(ZeroDivisionError):
        with Prefetch(slow, range(100)) as ahead:
            ahead.get(0)
            1 / 0  # noqa: B018
    assert not prefetch_threads()


def test_an_error_building_a_window_stops_train_with_that_error_and_no_thread_left(tmp_path, monkeypatch):
    real = loop_mod.micro_batches_of

    def failing(spec, ctx, job, step):
        if step == 1:
            raise SpecError("data: the cache entry cannot be read")
        return real(spec, ctx, job, step)

    monkeypatch.setattr(loop_mod, "micro_batches_of", failing)
    spec = _spec(tmp_path, "run.max_steps=3", "run.eval_every=0")
    with pytest.raises(SpecError, match="^data: the cache entry cannot be read$"):
        loop_mod.train(spec, LocalContext(on_progress=lambda m: None), resume=False)
    lines = (spec.output_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # step 0 trained; step 1's window failed
    assert not prefetch_threads()
