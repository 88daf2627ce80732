"""Data: JSONL parsing, label masking, padding, and the split-independent global batches."""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest
from gradtools import DATA, tiny_spec

from jobs.data import IGNORE, GlobalBatches, collate, read_jsonl, split_window, tokenize
from jobs.model.loading import byte_tokenizer
from jobs.spec import SpecError


@pytest.mark.parametrize("workers,micro,accum", [(1, 32, 1), (1, 1, 32), (2, 4, 4), (4, 2, 4), (8, 1, 4), (2, 16, 1)])
def test_global_batch_is_independent_of_the_split(workers, micro, accum):
    g = workers * micro * accum
    assert g == 32
    batches = GlobalBatches(n_examples=100, global_batch_size=g, seed=7)
    for step in range(8):  # crosses epoch boundaries (100 / 32)
        want = batches.indices(step)
        got = [i for r in range(workers) for mb in split_window(want, r, workers, micro, accum) for i in mb]
        # every sample of the global batch is computed exactly once, by someone
        assert collections.Counter(got) == collections.Counter(want)


def test_global_batches_are_epoch_permutations_and_seeded():
    b = GlobalBatches(n_examples=48, global_batch_size=16, seed=3)
    epoch0 = [i for s in range(3) for i in b.indices(s)]
    epoch1 = [i for s in range(3, 6) for i in b.indices(s)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(48))
    assert epoch0 != epoch1  # reshuffled per epoch
    assert GlobalBatches(48, 16, seed=3).indices(4) == b.indices(4)  # a pure function of the step
    assert GlobalBatches(48, 16, seed=4).indices(0) != b.indices(0)


def test_prompt_completion_masks_the_prompt_and_padding():
    tok = byte_tokenizer()
    recs = [{"prompt": "ab", "completion": "cd"}, {"text": "hello world"}]
    ex = tokenize(recs, tok, max_seq_len=64)
    # BOS a b c d EOS, shifted: inputs BOS a b c d; labels only on the completion c d and EOS
    assert ex[0].input_ids == (257, ord("a"), ord("b"), ord("c"), ord("d"))
    assert ex[0].targets == (IGNORE, IGNORE, ord("c"), ord("d"), 258)
    assert ex[1].n_labels == len("hello world") + 1
    batch = collate(ex, tok.pad_token_id)
    assert batch["input_ids"].shape == (2, len("hello world") + 1)
    assert batch["input_ids"][0, 5:].eq(tok.pad_token_id).all()  # right padding
    assert not any(5 <= int(pos) < batch["input_ids"].shape[1] for pos in batch["label_pos"])  # pads carry no label
    assert batch["label_ids"].tolist()[:3] == [ord("c"), ord("d"), 258]
    assert len(batch["label_pos"]) == ex[0].n_labels + ex[1].n_labels


def test_padded_and_full_batches_carry_no_attention_mask():
    tok = byte_tokenizer()
    for texts in (["abcd", "wxyz"], ["ab", "wxyz"]):
        batch = collate(tokenize([{"text": t} for t in texts], tok, 64), tok.pad_token_id)
        assert set(batch) == {"input_ids", "label_pos", "label_ids"}


def test_truncation_and_records_without_labels_are_dropped():
    tok = byte_tokenizer()
    ex = tokenize([{"prompt": "x" * 50, "completion": "y"}, {"text": "z" * 50}], tok, max_seq_len=10)
    assert len(ex) == 1 and len(ex[0].input_ids) == 9


def test_example_data_is_strongly_ragged_and_reproducible():
    tok = byte_tokenizer()
    lengths = [len(e.input_ids) for e in tokenize(read_jsonl(str(DATA)), tok, 4096)]
    assert max(lengths) > 5 * min(lengths)
    subprocess.run([sys.executable, str(DATA.parents[1] / "make_data.py"), "--check"], check=True)


@pytest.mark.parametrize(
    "line,needle",
    [
        ("not json", "line 1: not valid JSON"),
        ("[1, 2]", "line 1: expected a JSON object"),
        ('{"foo": 1}', 'line 1: expected {"text"'),
        ('{"text": 5}', '"text" must be a string'),
        ('{"prompt": "a"}', 'line 1: expected {"text"'),
        ('{"prompt": "a", "completion": 3}', "must be strings"),
    ],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(SpecError, match="data.path: .*bad.jsonl") as e:
        read_jsonl(str(p))
    assert needle in str(e.value)


def test_fewer_records_than_a_global_batch_is_refused(tmp_path):
    from jobs.data import load_dataset

    p = tmp_path / "few.jsonl"
    p.write_text('{"text": "a"}\n' * 3)
    spec = tiny_spec(f"data.path={p}")
    with pytest.raises(SpecError, match="3 usable training records, fewer than batch.global_batch_size=8"):
        load_dataset(spec, byte_tokenizer())
