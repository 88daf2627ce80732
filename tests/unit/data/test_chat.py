"""Chat records: rendered with the model's chat template, loss exactly on assistant turns.

Expected sequences are written out by hand from the byte tokenizer's definition (a byte is its
own id; <s> = 257, </s> = 258), for the built-in template and a Llama-3 style one defined here."""

from __future__ import annotations

import json

import pytest

from jobs.data import IGNORE, chat_prompt_ids, read_jsonl, tokenize
from jobs.errors import SpecError
from jobs.model.loading import byte_tokenizer

BOS, EOS = 257, 258
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "more?"},
    {"role": "assistant", "content": "ok"},
]


def B(s: str) -> list[int]:
    return list(s.encode())


def expected(parts: list[tuple[list[int], bool]], max_seq_len: int = 10_000) -> tuple[tuple, tuple]:
    """(input_ids, targets) of a sequence given as (ids, carries loss) pieces, truncated and shifted."""
    seq = [t for ids, _ in parts for t in ids]
    labels = [t if on else IGNORE for ids, on in parts for t in ids]
    seq, labels = seq[:max_seq_len], labels[:max_seq_len]
    return tuple(seq[:-1]), tuple(labels[1:])


def tok_with(template: str | None = None):
    t = byte_tokenizer()
    if template is not None:
        t.chat_template = template
    return t


def got(tok, records, max_seq_len=10_000, train_on="assistant"):
    return [(e.input_ids, e.targets) for e in tokenize(records, tok, max_seq_len, train_on, "test-model")]


def tiny_parts(train_last_only=False):
    return [
        ([BOS], False),
        (B("<|system|>\nBe brief.") + [EOS], False),
        (B("<|user|>\nhi") + [EOS], False),
        (B("<|assistant|>\n"), False),
        (B("yo") + [EOS], not train_last_only),
        (B("<|user|>\nmore?") + [EOS], False),
        (B("<|assistant|>\n"), False),
        (B("ok") + [EOS], True),
    ]


def llama3_parts(train_last_only=False):
    def head(role):
        return B(f"<|start_header_id|>{role}<|end_header_id|>\n\n")

    return [
        ([BOS], False),
        (head("system") + B("Be brief.<|eot_id|>"), False),
        (head("user") + B("hi<|eot_id|>"), False),
        (head("assistant"), False),
        (B("yo<|eot_id|>"), not train_last_only),
        (head("user") + B("more?<|eot_id|>"), False),
        (head("assistant"), False),
        (B("ok<|eot_id|>"), True),
    ]


@pytest.mark.parametrize("template,parts", [(None, tiny_parts), (LLAMA3, llama3_parts)], ids=["built-in", "llama3"])
def test_loss_on_every_assistant_turn_and_nothing_else(template, parts):
    tok = tok_with(template)
    assert got(tok, [{"messages": CONVO}]) == [expected(parts())]
    assert got(tok, [{"messages": CONVO}], train_on="last_assistant") == [expected(parts(True))]


@pytest.mark.parametrize("template,parts", [(None, tiny_parts), (LLAMA3, llama3_parts)], ids=["built-in", "llama3"])
def test_truncation_that_cuts_an_assistant_turn(template, parts):
    tok = tok_with(template)
    whole = sum(len(ids) for ids, _ in parts())
    cut = whole - 3  # inside the last assistant turn: its first tokens keep their labels
    assert got(tok, [{"messages": CONVO}], max_seq_len=cut) == [expected(parts(), cut)]
    # Cut before the last turn's content, last_assistant leaves no label: the record is dropped.
    before_last = whole - len(parts()[-1][0])
    assert got(tok, [{"messages": CONVO}], max_seq_len=before_last, train_on="last_assistant") == []


def test_eval_prompts_are_the_training_prefix():
    """`rayft eval` prompts with the template's generation prompt: exactly the tokens before the
    first label of that turn in training, so training and evaluation see the same format."""
    for template in (None, LLAMA3):
        tok = tok_with(template)
        ids, targets = got(tok, [{"messages": CONVO[:3]}])[0]
        first_label = next(i for i, t in enumerate(targets) if t != IGNORE)
        assert chat_prompt_ids(tok, CONVO[:2]) == list(ids[: first_label + 1])


def test_a_template_that_is_not_prefix_stable_is_refused():
    tok = tok_with(
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['role'] + ':' + m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(SpecError) as e:
        tokenize([{"messages": CONVO}], tok, 256, "assistant", "my/model")
    assert "my/model" in str(e.value) and "prefix-stable" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "messages,needle",
    [
        ([{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}], "unknown role 'bot'"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}], '"content" must be a string'),
        ([{"role": "user", "content": "q"}], "without an assistant turn"),
        ("not a list", '"messages" must be a non-empty list'),
        ([{"role": "user"}], 'must be an object with "role" and "content"'),
    ],
)
def test_bad_conversations_are_one_line(tmp_path, messages, needle):
    p = tmp_path / "c.jsonl"
    p.write_text(
        json.dumps({"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "k"}]})
        + "\n"
        + json.dumps({"messages": messages})
        + "\n"
    )
    with pytest.raises(SpecError) as e:
        read_jsonl(str(p))
    assert needle in str(e.value) and "c.jsonl line 2" in str(e.value) and "\n" not in str(e.value)


def test_fields_map_a_conversations_column(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"conversations": CONVO, "id": 7}) + "\n")
    assert read_jsonl(str(p), fields={"messages": "conversations"}) == [{"messages": CONVO}]
    with pytest.raises(SpecError, match="no field 'dialog' \\(data.fields.messages names it\\)"):
        read_jsonl(str(p), fields={"messages": "dialog"})


def test_rayft_eval_prompts_chat_records_through_the_template(tmp_path, monkeypatch):
    """`evaluate` on chat records: each prompt is the template's rendering up to the last
    assistant turn (with the generation prompt), the reference is that turn's content."""
    import jobs.after.evaluate as ev
    from jobs.spec import load_spec

    held = tmp_path / "eval.jsonl"
    held.write_text("".join(json.dumps({"messages": CONVO[: 3 + 2 * k]}) + "\n" for k in range(2)))
    spec = load_spec(
        data={
            "name": "chat-eval",
            "data": {"path": str(held), "eval_path": str(held)},
            "run": {"output_dir": str(tmp_path / "out")},
        }
    )
    seen = []

    def fake_generate(model, tok, prompts, max_new_tokens, batch_size=8):
        seen.extend(prompts)
        return ["yo", "nope"]

    monkeypatch.setattr(ev, "generate", fake_generate)
    result = ev.evaluate(spec, max_new_tokens=2)
    tok = byte_tokenizer()
    assert seen == [chat_prompt_ids(tok, CONVO[:2]), chat_prompt_ids(tok, CONVO[:4])]
    assert seen[1] == [BOS] + B("<|system|>\nBe brief.") + [EOS] + B("<|user|>\nhi") + [EOS] + B(
        "<|assistant|>\nyo"
    ) + [EOS] + B("<|user|>\nmore?") + [EOS] + B("<|assistant|>\n")
    assert result["records"] == 2 and result["base_exact_match"] == 0.5  # "yo" right, "nope" != "ok"


def test_the_tiny_chat_example_trains_on_exactly_its_assistant_turns(tmp_path):
    """examples/tiny-chat.yaml end to end: through the spec and the cache, the labels of every
    conversation are its two answers, each with the template's end of turn, and nothing else;
    then two optimizer steps run."""
    import contextlib
    import io
    from pathlib import Path

    from jobs.data import load_dataset, read_jsonl
    from jobs.finetune import main as finetune_main
    from jobs.spec import load_spec

    root = Path(__file__).resolve().parents[3]
    example = str(root / "examples" / "tiny-chat.yaml")
    spec = load_spec(example, [f"run.output_dir={tmp_path / 'out'}", "data.eval_fraction=0"], files=False)
    spec = spec.model_copy(
        update={"data": spec.data.model_copy(update={"path": [str(root / p) for p in spec.data.path]})}
    )
    data = load_dataset(spec, byte_tokenizer())
    records = read_jsonl(spec.data.path[0])
    assert len(data.train) == len(records) == 64
    for ex, rec in zip(data.train, records, strict=True):
        answers = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert [t for t in ex.targets if t != IGNORE] == B(answers[0]) + [EOS] + B(answers[1]) + [EOS]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = finetune_main(
            [example, f"run.output_dir={tmp_path / 'run'}", "run.max_steps=2", "run.eval_every=2", "--local"]
        )
    assert rc == 0, err.getvalue()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dropped_records"] == 0
