"""Prompt records for online RL (`objective.name: grpo`): read, checked, tokenized in memory.

A record is `{"prompt": TEXT}` or `{"prompt": [messages ending with a user turn]}` (TRL's standard
and conversational prompt forms; `data.fields` renames columns first); its other columns go to the
reward functions unchanged. A text prompt is encoded as `rayft eval` encodes one (`encode_prompt`:
BOS + text), a conversation through the model's chat template with the generation prompt
(`chat_prompt_ids`). A prompt longer than `data.max_seq_len - rollout.max_completion_length`
tokens is dropped and counted (`PromptSet.dropped`), never cut: a prompt cut from either end asks
another question than the record does.

Held-out prompts are `data.eval_path`'s, or `data.eval_fraction` of `data.path`'s records chosen as
`jobs.data.read_records` chooses SFT's. A mixture (`data.mix`) is its sources' prompts side by side,
source i's training prompts at `[offset_i, offset_i + n_i)` (`jobs.data.SourcePart`, with no
cache entry), each source split into training and held-out prompts as it would be as a run's
only data (its own `eval_path`, or `data.eval_fraction` of its records); the rollout batches draw
prompts from the sources by weight (`jobs.data.mixture.MixtureBatches`, the rule SFT's mixtures
use). Prompts are few and short beside SFT corpora, so they are not written to the token cache:
every rank reads and tokenizes the same records in the same order (a pure function of the files,
the spec and the tokenizer), which is what makes step k's prompts the same on every rank.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jobs.data.chat import chat_prompt_ids
from jobs.data.entry import SourcePart
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

    def extend(self, other: PromptSet) -> None:
        """`other`'s prompts after these (a mixture's next source); one prompt form across both."""
        if self.where and other.where and other.conversational != self.conversational:
            form = "a conversation" if other.conversational else "text"
            raise SpecError(
                f'{other.where[0]}: "prompt" is {form}, unlike the first record ({self.where[0]}); use one form '
                "in every source (a reward function receives one form)"
            )
        if not self.where:
            self.conversational = other.conversational
        self.ids += other.ids
        self.prompts += other.prompts
        self.columns += other.columns
        self.where += other.where
        self.dropped += other.dropped


@dataclass
class PromptData:
    """An online-RL run's data, as the loop holds a dataset's (`jobs.data.Dataset`): the training
    and held-out prompts, and what was dropped."""

    train: PromptSet
    eval: PromptSet
    dropped: int
    content_hash: str = ""  # `content_hash(spec)`: what the checkpoint's resume key records
    kind: str = "prompts"
    sources: list[SourcePart] = field(default_factory=list)  # a mixture's sources; [] for one


def prompt_records(spec: JobSpec, held_out: bool = False) -> Iterator[tuple[str, dict]]:
    """(where, checked record) of every training record (with `held_out`, of every held-out
    file), in order: `data.path`'s or `data.eval_path`'s, or for a mixture each source's in turn."""
    sources = range(len(spec.data.mix)) if spec.data.mix is not None else [None]
    for i in sources:
        yield from source_records(spec, i, held_out)


def source_records(spec: JobSpec, i: int | None, held_out: bool = False) -> Iterator[tuple[str, dict]]:
    """(where, checked record) of mixture source `i`'s training (or held-out) file, read with its
    own `fields` and named by its own key (`data.mix.I.path`); `i` None: the spec's one source."""
    d = spec.data
    if i is None:
        held = [("data.eval_path", d.eval_path)] if d.eval_path is not None else []
        one = len(d.path) == 1
        paths = held if held_out else [("data.path" if one else f"data.path.{k}", p) for k, p in enumerate(d.path)]
        fields = d.fields
    else:
        assert d.mix is not None
        src = d.mix[i]
        path = src.eval_path if held_out else src.path
        paths = [(f"data.mix.{i}.{'eval_path' if held_out else 'path'}", path)] if path is not None else []
        fields = d.fields if src.fields is None else src.fields
    for key, p in paths:
        for where, rec in _rows(p, key, d.hf_token_env):
            yield where, check_prompt_record(rec, where, fields)


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
    """(training prompts, held-out prompts) of every source (`read_prompt_data`)."""
    train, held, _ = read_prompt_data(spec, tokenizer)
    return train, held


def read_prompt_data(spec: JobSpec, tokenizer) -> tuple[PromptSet, PromptSet, list[SourcePart]]:
    """(training prompts, held-out prompts, the mixture's sources): one source's split
    (`split_source`), or a mixture's sources' splits side by side (module doc)."""
    if spec.data.mix is None:
        return (*split_source(spec, tokenizer, None), [])
    train, held, sources = PromptSet(), PromptSet(), []
    for i, src in enumerate(spec.data.mix):
        t, h = split_source(spec, tokenizer, i)
        if not len(t):
            raise SpecError(
                f"data.mix.{i}: source {src.shown_name!r} ({one_line(src.path)}) has no usable training prompts"
                + (f" ({t.dropped} longer than data.max_seq_len - rollout.max_completion_length)" if t.dropped else "")
            )
        at = (len(train), len(t), len(held), len(h))
        sources.append(SourcePart(src.shown_name, src.weight, *at, dropped=t.dropped + h.dropped))
        train.extend(t)
        held.extend(h)
    return train, held, sources


def split_source(spec: JobSpec, tokenizer, i: int | None) -> tuple[PromptSet, PromptSet]:
    """(training prompts, held-out prompts) of source `i` (`source_records`): its held-out file's,
    else `data.eval_fraction` of its records (the same seeded choice `jobs.data.read_records`
    makes), else none."""
    records = list(source_records(spec, i))
    if _eval_file(spec, i) is not None:
        return read_prompts(spec, tokenizer, records), read_prompts(
            spec, tokenizer, list(source_records(spec, i, True))
        )
    held: set[int] = set()
    if spec.data.eval_fraction > 0:
        order = list(range(len(records)))
        random.Random(spec.run.seed).shuffle(order)
        held = set(order[: max(1, int(round(len(records) * spec.data.eval_fraction)))])
    train = [r for k, r in enumerate(records) if k not in held]
    return read_prompts(spec, tokenizer, train), read_prompts(spec, tokenizer, [records[k] for k in sorted(held)])


def _eval_file(spec: JobSpec, i: int | None) -> str | None:
    """Source `i`'s held-out file (`data.mix.I.eval_path`; `i` None: `data.eval_path`), if it has one."""
    return spec.data.eval_path if i is None or spec.data.mix is None else spec.data.mix[i].eval_path


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
