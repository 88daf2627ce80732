"""`rayft data preview` of an online-RL spec (`objective.name: grpo`): the first training prompts
as generation starts from them, the columns each hands the reward functions, and the statistics
of both splits, as one JSON-able document of `jobs.data.preview.data_preview`'s shape.

Read-only, and read as the run reads: the prompts come from `jobs.data.prompts.split_source` (the
same files, split, chat template and drop rule; a mixture's sources in order), so prompt i of the
preview is prompt i of the run's prompt set, token for token (tests/unit/data/test_preview_prompts.py
compares them). Prompts longer than `data.max_seq_len - rollout.max_completion_length` are counted
as dropped (`too_long`), as the run drops them; nothing is truncated.
"""

from __future__ import annotations

from jobs.data.preview import DROP_TOO_LONG, PROMPTS, SplitStats, _tokens, token_texts
from jobs.data.prompts import PromptSet, split_source
from jobs.spec import JobSpec


def prompt_preview(spec: JobSpec, tokenizer, n: int) -> dict:
    """The first `n` training prompts and the statistics of each source's splits and of all
    together (module doc). Writes nothing."""
    assert spec.rollout is not None  # a grpo spec has one
    train, held, names, sources = PromptSet(), PromptSet(), [], []
    for name, paths, (t, h) in _split_sources(spec, tokenizer):
        train.extend(t)
        held.extend(h)
        names += [name] * len(t)
        sources.append({"name": name, "paths": paths, **_stats(t, h, spec.data.max_seq_len)})
    stats = _stats(train, held, spec.data.max_seq_len)
    return {
        "name": spec.name,
        "model": spec.model.name,
        "objective": spec.objective.name,
        "kind": PROMPTS,
        "max_seq_len": spec.data.max_seq_len,
        "prompt_budget": spec.data.max_seq_len - spec.rollout.max_completion_length,
        "conversational": train.conversational,
        "n": n,
        "samples": [prompt_view(tokenizer, train, i, names[i]) for i in range(min(n, len(train)))],
        "sources": sources,
        **stats,
    }


def _split_sources(spec: JobSpec, tokenizer) -> list[tuple[str, list[str], tuple[PromptSet, PromptSet]]]:
    """(name, paths, (training prompts, held-out prompts)) of each source, in order."""
    if spec.data.mix is None:
        return [("data.path", list(spec.data.path), split_source(spec, tokenizer, None))]
    return [(s.shown_name, [s.path], split_source(spec, tokenizer, i)) for i, s in enumerate(spec.data.mix)]


def _stats(train: PromptSet, held: PromptSet, max_seq_len: int) -> dict:
    return {"train": prompt_stats(train, max_seq_len), "eval": prompt_stats(held, max_seq_len)}


def prompt_view(tokenizer, prompts: PromptSet, i: int, source: str = "data.path") -> dict:
    """Kept prompt `i` (of `source`): its tokens (none is a label: completions are what the loss
    sees), the prompt as a reward function receives it, and its other columns."""
    ids = prompts.ids[i]
    return {
        "source": source,
        "where": prompts.where[i],
        "example": i,
        "truncated": False,
        "tokens": _tokens(tokenizer, ids, token_texts(tokenizer, ids), [False] * len(ids)),
        "n_tokens": len(ids),
        "n_labels": 0,
        "prompt": prompts.prompts[i],
        "columns": prompts.columns[i],
    }


def prompt_stats(prompts: PromptSet, max_seq_len: int) -> dict:
    """One split's counts: the kept prompts' lengths, and the records dropped as too long."""
    stats = SplitStats(max_seq_len)
    for ids in prompts.ids:
        stats.add_prompt(len(ids))
    stats.records += prompts.dropped
    stats.dropped[DROP_TOO_LONG] = prompts.dropped
    return stats.to_dict(PROMPTS)
