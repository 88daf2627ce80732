"""Property-based fuzzing of what a user hands rayft before a run starts: spec overrides, whole
YAML documents and JSONL data files, with wrong types, huge and non-finite numbers, unicode,
nesting and empty values.

Each case drives `rayft spec check` (load + validate + print) and the preparation of
`rayft run --local ... run.max_steps=1` (`jobs.finetune.prepare`, then tokenizing the data
with the built-in tokenizer) in-process. Property: every case ends in exit 0 or exit 2 with a
one-line message, never a traceback, and a refused case creates no output directory.

`bench/fuzz_specs.py` runs the same strategies and checks for longer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from filefuzz import exit_code
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "tiny.jsonl"
# A valid small job the fuzzer starts from; overrides and mutations then break it.
BASE = {
    "name": "fuzz",
    "data": {"path": str(DATA), "max_seq_len": 32},
    "lora": {"r": 4, "alpha": 8},
    "batch": {"global_batch_size": 8, "micro_batch_size": 2},
    "run": {"max_steps": 1},
}
FIELDS = [
    "name",
    "precision",
    "model.attn_implementation",
    "model.sync_batchnorm",
    "model.hf_token_env",
    "model.compile",
    "model.gguf_file",
    "data.path",
    "data.eval_path",
    "data.eval_fraction",
    "data.max_seq_len",
    "data.group_by_length",
    "data.packing",
    "lora.r",
    "lora.alpha",
    "lora.dropout",
    "lora.target_modules",
    "batch.global_batch_size",
    "batch.micro_batch_size",
    "batch.grad_accum_steps",
    "optim.name",
    "optim.lr",
    "optim.reference_batch_size",
    "optim.lr_scaling",
    "optim.warmup_steps",
    "optim.schedule",
    "optim.min_lr_ratio",
    "optim.max_grad_norm",
    "optim.weight_decay",
    "optim.betas",
    "optim.momentum",
    "optim.fused",
    "memory.gradient_checkpointing",
    "memory.budget_gib",
    "memory.loss_chunk_tokens",
    "resources.num_workers",
    "resources.use_gpu",
    "resources.accelerator_type",
    "resources.cpus_per_worker",
    "run.max_steps",
    "run.epochs",
    "run.seed",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.eval_every",
    "run.max_failures",
    "run.env",
    "run.env.SOME_VAR",
    "run.trackers",
    "model",
    "data",
    "run",
    "unknown",
    "optim.unknown",
    "lora.r.deeper",
]
# Values a careless or hostile user types, as YAML text.
NASTY_TEXT = [
    ".inf",
    "-.inf",
    ".nan",
    "NaN",
    "null",
    "~",
    "",
    " ",
    "true",
    "no",
    "yes",
    "[]",
    "{}",
    "[1, 2",
    "{a: 1",
    "*a",
    "&a x",
    "!!python/object/apply:os.system ['true']",
    "!!binary aGk=",
    "!!set {a, b}",
    "!!timestamp 2024-01-01",
    "2024-01-01",
    "0x1F",
    "0o17",
    "1e26",
    "1e8",
    "100000000",
    "-1",
    "0",
    "1_000",
    "99999999999999999999999999999",
    "'ok\\n'",
    '"ok\\n"',
    '"\\u0000"',
    '"\\ud800"',
    "é",
    "名前",
    "🙂",
    "a: b",
    "- a",
    "[[[[[[[[[[[]]]]]]]]]]]",
    "\t",
    "&a [*a]",
    "{a: &a [x, x], b: [*a, *a, *a]}",
    "hf_" + "aB3xY7kQ9mZ2" * 3,
    "Bearer " + "aB3xY7kQ9mZ2" * 2,
    "https://u:" + "pw12" * 3 + "@h/x",
    "pkg:json",
    "pkg:os.path",
    "./no-such-model",
    "tiny-llama",
]
# run.output_dir values: the refused ones, and relative names (inside the fuzz's own working
# directory, so nothing lands anywhere else).
OUTPUT_DIRS = ["", " ", "/", "/etc", "/usr", "/proc/self", "/dev", ".", "..", "~"]
# model.name values that never reach a model hub (the fuzz runs without a network).
MODEL_NAMES = [
    "tiny-llama",
    "",
    " ",
    "./missing-model",
    "/nonexistent/model",
    "pkg:json",
    "pkg:a.b",
    "pkg:",
    "pkg:no_such_package_xyz",
    ".",
    "pkg:" + "x" * 300,
]

finite_or_not = st.floats(allow_nan=True, allow_infinity=True)
plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | finite_or_not
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _yaml_text(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True)
        .strip()
        .removesuffix("...")
        .strip()
    )


value_text = st.one_of(st.sampled_from(NASTY_TEXT), plain.map(_yaml_text), st.text(max_size=40))
override = st.one_of(
    st.tuples(st.sampled_from(FIELDS), value_text).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.tuples(st.just("model.name"), st.sampled_from(MODEL_NAMES)).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.tuples(
        st.just("run.output_dir"),
        st.sampled_from(OUTPUT_DIRS)
        | st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), max_size=12),
    ).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=30),  # anything at all, "=" or not
)
overrides_cases = st.lists(override, max_size=5)


def _mutated_spec(draw) -> dict:
    spec = json.loads(json.dumps(BASE))
    for _ in range(draw(st.integers(0, 4))):
        path = draw(st.sampled_from(FIELDS)).split(".")
        node = spec
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = draw(plain | st.sampled_from(NASTY_TEXT))
    return spec


@st.composite
def yaml_documents(draw) -> str:
    """A spec file's text: a mutated valid spec, random plain data, or YAML-ish noise."""
    kind = draw(st.sampled_from(["mutated", "plain", "noise", "anchors"]))
    if kind == "mutated":
        return yaml.safe_dump(_mutated_spec(draw), allow_unicode=draw(st.booleans()), sort_keys=False)
    if kind == "plain":
        return yaml.safe_dump(draw(plain), allow_unicode=True)
    if kind == "anchors":
        depth, width = draw(st.integers(1, 12)), draw(st.integers(1, 12))
        lines = ["name: fuzz", f"data: {{path: {DATA}}}", "l0: &l0 [x]"]
        lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, depth)]
        return "\n".join(lines) + "\n"
    alphabet = st.sampled_from(list("ab:-[]{}&*!|>'\",#\n\t ?%@`") + ["name", "data", "path", "\u2028", "é"])
    return "".join(draw(st.lists(alphabet, max_size=60)))


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
record = st.one_of(
    st.fixed_dictionaries({"text": st.text(max_size=80)}),
    st.fixed_dictionaries({"prompt": st.text(max_size=40), "completion": st.text(max_size=40)}),
    st.fixed_dictionaries({"text": json_value}),
    st.fixed_dictionaries({"prompt": json_value, "completion": st.text(max_size=10)}),
    json_value,
)
record_line = st.one_of(
    record.map(lambda r: json.dumps(r, ensure_ascii=False)),
    record.map(json.dumps),
    st.text(max_size=40).filter(lambda t: "\n" not in t and "\r" not in t),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 3000).map(lambda n: '{"text": ' + "[" * n),
    st.sampled_from(
        [
            '{"text": NaN}',
            '{"text": "\\ud800"}',
            '{"text": "a", "n": ' + "9" * 5000 + "}",
            "\ufeff{}",
            '{"text": "x"}{"text": "y"}',
            '"just a string"',
            "{}",
        ]
    ),
)
valid_line = st.one_of(
    st.fixed_dictionaries({"text": st.text(max_size=200)}),
    st.fixed_dictionaries({"prompt": st.text(max_size=60), "completion": st.text(max_size=60)}),
).map(lambda r: json.dumps(r, ensure_ascii=False))
# Files of well-shaped records only (so tokenizing is reached), or of anything.
jsonl_files = st.tuples(
    st.lists(valid_line, min_size=1, max_size=12) | st.lists(record_line, max_size=12),
    st.sampled_from(["\n", "\r\n"]),
    st.integers(1, 4),
)


# ---- the property ----------------------------------------------------------------------------


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    """A fresh working directory for one case; relative paths a case names land inside it."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="rayft-fuzz-") as d:
        os.chdir(d)
        try:
            yield Path(d)
        finally:
            os.chdir(cwd)


def _spec_check_then_prepare(spec_path: Path, overrides: list[str], out: Path) -> None:
    from jobs.finetune import prepare
    from jobs.spec import load_spec

    check = exit_code(lambda: load_spec(spec_path, overrides).to_yaml())  # rayft spec check
    assert check in (0, 2)
    before = sorted(os.listdir(spec_path.parent))
    run = exit_code(
        lambda: prepare(str(spec_path), [*overrides, "run.max_steps=1", "run.epochs=null"], fresh=False, local=True)
    )
    assert run in (0, 2)
    if run:  # refused: no output directory, here (relative ones) or at the default
        assert not out.exists() and sorted(os.listdir(spec_path.parent)) == before, "a refused run created files"


def check_overrides(overrides: list[str]) -> None:
    with _workdir() as d:
        spec_path = d / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(BASE))
        out = d / "out"
        # The default output_dir first: a case's own run.output_dir (relative, or one that is
        # refused) comes after it and wins.
        _spec_check_then_prepare(spec_path, [f"run.output_dir={out}", *overrides], out)


def check_yaml(text: str) -> None:
    with _workdir() as d:
        spec_path = d / "spec.yaml"
        spec_path.write_text(text, encoding="utf-8", errors="surrogatepass")
        out = d / "out"
        _spec_check_then_prepare(spec_path, [f"run.output_dir={out}"], out)


def check_jsonl(case: tuple[list[str], str, int]) -> None:
    from jobs.data import load_dataset
    from jobs.finetune import prepare
    from jobs.spec import load_spec

    lines, newline, batch = case
    with _workdir() as d:
        data = d / "d.jsonl"
        data.write_text(newline.join(lines) + newline, encoding="utf-8", errors="surrogatepass")
        spec_path = d / "spec.yaml"
        spec_path.write_text(
            yaml.safe_dump(
                dict(
                    BASE,
                    data={"path": str(data), "max_seq_len": 16},
                    batch={"global_batch_size": batch, "micro_batch_size": 1},
                )
            )
        )
        out = d / "out"
        code = exit_code(lambda: prepare(str(spec_path), [f"run.output_dir={out}"], fresh=False, local=True))
        assert code in (0, 2)
        if code:
            assert not out.exists()
            return
        # what the worker does next with the data (the built-in byte tokenizer: no download)
        spec = load_spec(spec_path, [f"run.output_dir={out}"])
        assert exit_code(lambda: load_dataset(spec, _tokenizer())) in (0, 2)


_TOKENIZER: list = []


def _tokenizer():
    """The built-in byte tokenizer (no download), built once."""
    if not _TOKENIZER:
        from jobs.model.loading import byte_tokenizer

        _TOKENIZER.append(byte_tokenizer())
    return _TOKENIZER[0]


# How many cases, and which: the hypothesis profile conftest loads. CI ("ci"): 150 per test,
# derandomized (the same cases every run); `make test-all` ("long"): 3000 new random ones.


@given(overrides_cases)
def test_fuzz_overrides(overrides):
    check_overrides(overrides)


@given(yaml_documents())
def test_fuzz_yaml_documents(text):
    check_yaml(text)


@given(jsonl_files)
def test_fuzz_jsonl_records(case):
    check_jsonl(case)


def test_the_fuzzer_reaches_both_outcomes():
    """A fuzzer that only ever hits refusals (or only successes) tests little: the base case
    prepares, and a known-bad override is refused."""
    with _workdir() as d:
        spec_path = d / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(BASE))
        from jobs.finetune import prepare

        assert exit_code(lambda: prepare(str(spec_path), [f"run.output_dir={d / 'a'}"], False, local=True)) == 0
        assert (
            exit_code(
                lambda: prepare(str(spec_path), [f"run.output_dir={d / 'b'}", "optim.lr=.inf"], False, local=True)
            )
            == 2
        )
        assert (d / "a").is_dir() and not (d / "b").exists()
    assert math.isnan(yaml.safe_load(_yaml_text(math.nan)))
