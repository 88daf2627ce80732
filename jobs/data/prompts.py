"""Prompt records for online RL (`objective.name: grpo`): read, checked, tokenized in memory.

A record is `{"prompt": TEXT}` or `{"prompt": [messages ending with a user turn]}` (TRL's standard
and conversational prompt forms; `data.fields` renames columns first); its other columns go to the
reward functions unchanged. A text prompt is encoded as `rayft eval` encodes one (`encode_prompt`:
BOS + text), a conversation through the model's chat template with the generation prompt
(`chat_prompt_ids`). A prompt longer than `data.max_seq_len - rollout.max_completion_length`
tokens is dropped and counted (`PromptSet.dropped`), never cut: a prompt cut from either end asks
another question than the record does.

Held-out prompts are `data.eval_path`'s, or `data.eval_fraction` of `data.path`'s records chosen as
`jobs.data.read_records` chooses SFT's. Prompts are few and short beside SFT corpora, so they are
not written to the token cache: every rank reads and tokenizes the same records in the same order
(a pure function of the files, the spec and the tokenizer), which is what makes step k's prompts
the same on every rank.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jobs.data.chat import chat_prompt_ids
from jobs.data.records import ROLES, _check_message_list, _rename
from jobs.data.sources import DATASETS_SUFFIXES, datasets_rows, is_hub, json_lines
from jobs.data.tokenizing import encode_prompt
from jobs.errors import SpecError
from jobs.spec import JobSpec, one_line

PROMPT = "prompt"


@dataclass
class PromptSet:
    """One split's prompts: token ids, the prompt as the record gives it (text or messages, what
    a reward function receives as `prompts`), and the record's other columns."""

    ids: list[list[int]] = field(default_factory=list)
    prompts: list = field(default_factory=list)
    columns: list[dict] = field(default_factory=list)
    conversational: bool = False
    dropped: int = 0  # records whose prompt leaves no room for a completion
    where: list[str] = field(default_factory=list)  # the file and line (or row) of each kept prompt

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class PromptData:
    """An online-RL run's data, as the loop holds a dataset's (`jobs.data.Dataset`): the training
    and held-out prompts, and what was dropped."""

    train: PromptSet
    eval: PromptSet
    dropped: int
    content_hash: str = ""  # `content_hash(spec)`: what the checkpoint's resume key records
    kind: str = "prompts"
    sources: list = field(default_factory=list)  # no mixture of prompt sources yet


def prompt_records(spec: JobSpec, held_out: bool = False) -> Iterator[tuple[str, dict]]:
    """(where, checked record) of every record of `data.path` (with `held_out`, of
    `data.eval_path`), in order."""
    held = [("data.eval_path", spec.data.eval_path)] if spec.data.eval_path is not None else []
    paths = held if held_out else _train_paths(spec)
    for key, path in paths:
        for where, rec in _rows(path, key, spec.data.hf_token_env):
            yield where, check_prompt_record(rec, where, spec.data.fields)


def _train_paths(spec: JobSpec) -> list[tuple[str, str]]:
    one = len(spec.data.path) == 1
    return [("data.path" if one else f"data.path.{i}", p) for i, p in enumerate(spec.data.path)]


def _rows(path: str, key: str, hf_token_env: str | None) -> Iterator[tuple[str, object]]:
    """(where, raw record) of one source: `datasets`' rows, else the JSONL file's lines."""
    if is_hub(path) or os.path.isdir(path) or Path(path).suffix.lower() in DATASETS_SUFFIXES:
        shown = one_line(str(path))
        for i, row in enumerate(datasets_rows(str(path), key, hf_token_env)):
            yield f"{key}: {shown} row {i}", dict(row)
        return
    yield from json_lines(path, key)


def check_prompt_record(rec: object, where: str, fields: dict | None) -> dict:
    """`rec` renamed by `data.fields`, with a `prompt` that is text or a conversation ending with a
    user turn; SpecError naming `where` otherwise."""
    if not isinstance(rec, dict):
        raise SpecError(f"{where}: expected a JSON object")
    rec = _rename(rec, where, fields)
    if PROMPT not in rec:
        raise SpecError(
            f'{where}: objective.name=grpo trains on prompts: expected {{"prompt": ...}} '
            "(data.fields maps another column name onto it)"
        )
    prompt = rec[PROMPT]
    if isinstance(prompt, list):
        _check_message_list(prompt, where, PROMPT)
        if prompt[-1]["role"] != "user":
            raise SpecError(f'{where}: "prompt" must end with a user turn (it ends with {prompt[-1]["role"]})')
    elif not isinstance(prompt, str) or not prompt:
        raise SpecError(f'{where}: "prompt" must be a non-empty string or a list of messages ({", ".join(ROLES)})')
    return rec


def read_prompt_splits(spec: JobSpec, tokenizer) -> tuple[PromptSet, PromptSet]:
    """(training prompts, held-out prompts): `data.eval_path`'s, else `data.eval_fraction` of
    `data.path`'s records (the same seeded choice `jobs.data.read_records` makes), else none."""
    records = list(prompt_records(spec))
    if spec.data.eval_path is not None:
        return read_prompts(spec, tokenizer, records), read_prompts(spec, tokenizer, list(prompt_records(spec, True)))
    held: set[int] = set()
    if spec.data.eval_fraction > 0:
        order = list(range(len(records)))
        random.Random(spec.run.seed).shuffle(order)
        held = set(order[: max(1, int(round(len(records) * spec.data.eval_fraction)))])
    train = [r for i, r in enumerate(records) if i not in held]
    return read_prompts(spec, tokenizer, train), read_prompts(spec, tokenizer, [records[i] for i in sorted(held)])


def read_prompts(spec: JobSpec, tokenizer, records: list[tuple[str, dict]] | None = None) -> PromptSet:
    """`records` (default: every training record of the spec), tokenized (module doc); a mix of
    text and conversational prompts is refused (a reward function receives one form)."""
    assert spec.rollout is not None  # a grpo spec has one (`JobSpec._online_rl_problem`)
    budget = spec.data.max_seq_len - spec.rollout.max_completion_length
    out, first = PromptSet(), None
    for where, rec in prompt_records(spec) if records is None else records:
        conversational = isinstance(rec[PROMPT], list)
        if first is None:
            first, out.conversational = where, conversational
        elif conversational != out.conversational:
            form = "a conversation" if conversational else "text"
            raise SpecError(f'{where}: "prompt" is {form}, unlike the first record ({first}); use one form')
        ids = _prompt_ids(tokenizer, rec[PROMPT], spec.model.name)
        if len(ids) > budget:
            out.dropped += 1
            continue
        out.ids.append(ids)
        out.prompts.append(rec[PROMPT])
        out.columns.append({k: v for k, v in rec.items() if k != PROMPT})
        out.where.append(where)
    return out


def _prompt_ids(tokenizer, prompt, model_name: str) -> list[int]:
    if isinstance(prompt, list):
        return chat_prompt_ids(tokenizer, prompt, model_name)
    return encode_prompt(tokenizer, prompt)


def check_prompt_count(spec: JobSpec, prompts: PromptSet) -> None:
    """At least one step's prompts (`batch.global_batch_size / rollout.num_generations`) remain."""
    assert spec.rollout is not None
    per_step = spec.batch.global_batch_size // spec.rollout.num_generations
    if len(prompts) < per_step:
        dropped = (
            f" ({prompts.dropped} dropped: longer than data.max_seq_len - rollout.max_completion_length = "
            f"{spec.data.max_seq_len - spec.rollout.max_completion_length} tokens)"
            if prompts.dropped
            else ""
        )
        raise SpecError(
            f"data.path: {len(prompts)} prompts{dropped}, fewer than one step's batch.global_batch_size / "
            f"rollout.num_generations = {per_step}"
        )
