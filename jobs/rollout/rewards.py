"""Reward functions for online RL (`reward.functions`): resolved once, called as TRL calls them,
their values checked and summed with their weights.

Invariant: every completion of a batch gets one row of values, one per function, each a finite
float or NaN (the function returned None: not applicable); the reward is their weighted sum over
the values that are not NaN (TRL's nansum), NaN where every function returned None. Anything else a
function does (raises, returns another count, NaN, infinity, a non-number) is one line naming the
function and the record (`RewardError`, exit 2); a call longer than `reward.timeout_s` is
`RewardTimeout` (exit 1). Nothing here imports torch.

A function is called on a batch of completions as TRL's `GRPOTrainer` calls one:
`fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns)`, where `columns`
holds each of the records' other columns as a list aligned with the completions (TRL's
`trainer_state`, `log_extra` and `log_metric` are not passed). It returns a list of float | None.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.errors import RewardError, RewardTimeout, SpecError
from jobs.spec import RewardSpec, is_reward_file, one_line, path_problem, user_function

SHOWN_CHARS = 60  # of a prompt or a value quoted in an error line


@dataclass(frozen=True)
class RewardFunction:
    """One resolved reward function: its metric name, weight, what it is, and the callable."""

    label: str
    weight: float
    where: str  # `reward.functions.<i>` and what it is, for error lines
    call: Callable[..., Any]
    column: str | None = None  # the data column a built-in reads (must exist in the data)


def resolve(reward: RewardSpec) -> list[RewardFunction]:
    """Every function of `reward.functions`, built or imported; a file, module or name that does
    not exist is one line (SpecError, exit 2)."""
    out = []
    for i, (f, label) in enumerate(zip(reward.functions, reward.labels, strict=True)):
        key = f"reward.functions.{i}"
        if f.name == "exact_match":
            assert f.column is not None  # the spec requires it
            call, what = exact_match(f.column, f.case_sensitive), f"exact_match on {f.column}"
        elif f.name == "regex":
            assert f.pattern is not None
            call, what = regex(f.pattern), f"regex {f.pattern!r}"
        else:
            assert f.fn is not None
            call, what = load_user_function(f.fn, f"{key}.fn"), f.fn
        out.append(RewardFunction(label, f.weight, one_line(f"{key} ({what})"), call, f.column))
    return out


def check_columns(functions: Sequence[RewardFunction], columns: Sequence[str]) -> None:
    """Each built-in's column is one of the data's `columns` (SpecError naming both otherwise)."""
    for f in functions:
        if f.column is not None and f.column not in columns:
            raise SpecError(f"{f.where}: the data has no column {f.column!r} (it has: {', '.join(map(repr, columns))})")


# ---- built-ins --------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """A completion as text: itself, or a conversational completion's last message's content."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def normalized(text: str, case_sensitive: bool) -> str:
    """Leading and trailing whitespace stripped, every inner run of whitespace one space, and
    case-folded unless `case_sensitive`: what `exact_match` compares."""
    joined = " ".join(text.split())
    return joined if case_sensitive else joined.casefold()


def exact_match(column: str, case_sensitive: bool) -> Callable[..., list[float | None]]:
    """1.0 where the completion equals the record's `column` (both `normalized`), else 0.0; None
    where the column is null."""

    def reward(completions: list, **columns: list) -> list[float | None]:
        answers = columns[column]
        return [
            None
            if want is None
            else float(normalized(completion_text(c), case_sensitive) == normalized(str(want), case_sensitive))
            for c, want in zip(completions, answers, strict=True)
        ]

    reward.__name__ = "exact_match"
    return reward


def regex(pattern: str) -> Callable[..., list[float | None]]:
    """1.0 where `pattern` matches the whole completion (`re.fullmatch`, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list, **_: Any) -> list[float | None]:
        return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]

    reward.__name__ = "regex"
    return reward


# ---- user functions -----------------------------------------------------------------------------


def load_user_function(text: str, key: str) -> Callable[..., Any]:
    """`FILE.py:NAME` (FILE as the spec resolved it) or `package.module:NAME`, imported; SpecError
    naming `key` where the file, module or name is missing, or importing it raises."""
    where, name = user_function(text)
    module = _file_module(where, key) if is_reward_file(where) else _import_module(where, key)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        what = "is not a function" if hasattr(module, name) else "has no function"
        raise SpecError(f"{key}: {one_line(where)} {what} {name!r} (its functions: {', '.join(defined) or 'none'})")
    return fn


def _file_module(path: str, key: str) -> Any:
    problem = path_problem(path)
    if problem:
        raise SpecError(f"{key}: {problem}")
    name = "rayft_reward_" + hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"{key}: {one_line(path)} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: whatever it raises is theirs to fix
        raise SpecError(f"{key}: importing {one_line(path)} raised {type(e).__name__}: {one_line(str(e))}") from None
    return module


def _import_module(module: str, key: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise SpecError(f"{key}: no module named {e.name or module!r} (is it installed on the workers?)") from None
    except Exception as e:
        raise SpecError(f"{key}: importing {module} raised {type(e).__name__}: {one_line(str(e))}") from None


# ---- calling them ---------------------------------------------------------------------------------


def completions_as_trl(tokenizer, completion_ids: Sequence[Sequence[int]], conversational: bool) -> list:
    """What a reward function receives as `completions`, as TRL builds it: each completion's ids
    decoded with the special tokens (EOS) left out; for a conversational prompt, one assistant
    message `[{"role": "assistant", "content": text}]`. The ids trained on stay the sampled ones."""
    texts = tokenizer.batch_decode([list(ids) for ids in completion_ids], skip_special_tokens=True)
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


@dataclass(frozen=True)
class Batch:
    """The completions to score, one entry per completion: its prompt, completion (text or
    messages), sampled ids, the index of its record in the data, and the record's other columns."""

    prompts: list
    completions: list
    completion_ids: list[list[int]]
    records: list[int]
    columns: dict[str, list]


def score(functions: Sequence[RewardFunction], batch: Batch, timeout_s: float) -> tuple[list[list[float]], list[float]]:
    """(values [completion][function], reward [completion]) for `batch` (module doc's invariant)."""
    per_function = [values_of(f, batch, timeout_s) for f in functions]
    values = [list(row) for row in zip(*per_function, strict=True)] if per_function else []
    return values, [weighted(row, functions) for row in values]


def weighted(row: Sequence[float], functions: Sequence[RewardFunction]) -> float:
    """sum of weight x value over the values that are not NaN; NaN when all are."""
    kept = [f.weight * v for v, f in zip(row, functions, strict=True) if not math.isnan(v)]
    return math.fsum(kept) if kept else math.nan


def values_of(f: RewardFunction, batch: Batch, timeout_s: float) -> list[float]:
    """`f`'s checked values on `batch`: a finite float or NaN (None) per completion."""
    got = call_within(f, batch, timeout_s)
    if isinstance(got, (str, bytes)) or not hasattr(got, "__len__"):
        raise RewardError(f"{f.where} returned {type(got).__name__}, not a list of numbers (one per completion)")
    if len(got) != len(batch.completions):
        raise RewardError(f"{f.where} returned {len(got)} values for {len(batch.completions)} completions")
    return [as_value(v, f, batch, i) for i, v in enumerate(got)]


def as_value(v: Any, f: RewardFunction, batch: Batch, i: int) -> float:
    """One returned value as a float (NaN for None), or RewardError naming the record."""
    if v is None:
        return math.nan
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # a numpy or torch scalar
        v = v.item()
    if not isinstance(v, numbers.Real):
        raise RewardError(f"{f.where} returned {_shown(v)} ({type(v).__name__}, not a number) {record_of(batch, i)}")
    if not math.isfinite(float(v)):
        raise RewardError(f"{f.where} returned {float(v)} {record_of(batch, i)} (None means not applicable)")
    return float(v)


def record_of(batch: Batch, i: int) -> str:
    """`for record R (prompt '...')`: where completion `i` came from, for an error line."""
    return f"for record {batch.records[i]} (prompt {_shown(batch.prompts[i])})"


def _shown(v: Any) -> str:
    text = repr(v)
    return one_line(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")


def call_within(f: RewardFunction, batch: Batch, timeout_s: float) -> Any:
    """`f` on the whole batch, TRL's keywords; what it raises is a RewardError naming the first
    record whose completions alone make it raise (the batch when none does alone)."""
    try:
        return _bounded(f, batch, timeout_s)
    except RewardTimeout:
        raise
    except Exception as e:
        raise RewardError(f"{f.where} raised {type(e).__name__}: {one_line(str(e))} {culprit(f, batch)}") from None


def culprit(f: RewardFunction, batch: Batch) -> str:
    """Which record makes `f` raise: each completion alone, in order (bounded by the batch)."""
    for i in range(len(batch.completions)):
        try:
            f.call(**_keywords(_one(batch, i)))
        except Exception:
            return record_of(batch, i)
    return f"on a batch of {len(batch.completions)} completions (records {sorted(set(batch.records))[:8]})"


def _one(batch: Batch, i: int) -> Batch:
    return Batch(
        [batch.prompts[i]],
        [batch.completions[i]],
        [batch.completion_ids[i]],
        [batch.records[i]],
        {k: [v[i]] for k, v in batch.columns.items()},
    )


def _keywords(batch: Batch) -> dict[str, Any]:
    return {
        "prompts": batch.prompts,
        "completions": batch.completions,
        "completion_ids": batch.completion_ids,
        **batch.columns,
    }


def _bounded(f: RewardFunction, batch: Batch, timeout_s: float) -> Any:
    """`f`'s result within `timeout_s` seconds (RewardTimeout after; the call is left running in a
    daemon thread, which the failing run does not wait for)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = f.call(**_keywords(batch))
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=f"reward {f.label}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(
            f"{f.where} ran longer than reward.timeout_s={timeout_s:g} s on {len(batch.completions)} completions"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]
