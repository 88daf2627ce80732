"""Data sources (`data.path`, `data.eval_path`, a mixture's sources): reading their rows as checked records.

A `.jsonl` file (or any file `datasets` has no reader for) is read line by line, each line
checked as it is read; JSON, Parquet and CSV files, a `Dataset.save_to_disk` directory and a hub
dataset `hf:ORG/NAME[:SPLIT]` go through the `datasets` library (Arrow, memory-mapped from its
cache). Every problem is one SpecError naming the spec key, the source and the line or row.

Across a source's records (`_SourceCheck`, as they are read, before any cut): one kind only (pairs
or SFT records, `records.record_kind`); with the job's objective given, the kind it trains on (so
a job's sources agree too); and not every pair with chosen == rejected (nothing to prefer: most
often a `data.fields` mapping that names one column twice). `first_record_format` reads only a
source's first record: how a mixture's sources are compared before any is read whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobs.data.records import (
    MESSAGES,
    PAIR,
    PAIRS,
    PROMPT_COMPLETION,
    SFT,
    TEXT,
    char_bound,
    check_record,
    cut_record,
    record_format,
    record_kind,
)
from jobs.errors import SpecError
from jobs.spec import OBJECTIVE_BY_NAME, JobSpec, one_line, path_problem

DATASETS_SUFFIXES = {".json": "json", ".parquet": "parquet", ".csv": "csv"}


def is_hub(path: str) -> bool:
    return str(path).startswith("hf:")


def read_jsonl(
    path: str,
    key: str = "data.path",
    max_chars: int | None = None,
    fields: dict | None = None,
    hf_token_env: str | None = None,
    objective: str | None = None,
) -> list[dict]:
    """The records of one data source, each checked for shape (after renaming `fields`, ours ->
    theirs); a problem is one SpecError naming `key`, the source and the line or row. A `.jsonl`
    (or any file `datasets` has no reader for) is read line by line; `.json`, `.parquet`, `.csv`,
    a `save_to_disk` directory and `hf:ORG/NAME[:SPLIT]` go through `datasets`. With `max_chars`,
    each record's texts are cut to that many characters as soon as it is read (see `char_bound`).
    The records are all pairs or all SFT records; with `objective` (`objective.name`), the kind
    that objective trains on (see `_SourceCheck`)."""
    shown = one_line(str(path))
    checks = _SourceCheck(key, shown, objective)
    if is_hub(path) or os.path.isdir(path) or Path(path).suffix.lower() in DATASETS_SUFFIXES:
        rows = datasets_rows(str(path), key, hf_token_env)
        records = [
            cut_record(checks.check(dict(row), f"{key}: {shown} row {i}", fields), max_chars)
            for i, row in enumerate(rows)
        ]
    else:
        records = _read_lines(path, key, max_chars, fields, checks)
    if not records:
        raise SpecError(f"{key}: {shown}: no records")
    checks.done()
    return records


PREFERENCE_NAMES = "|".join(name for name, c in OBJECTIVE_BY_NAME.items() if c.records == PAIRS)
_DESCRIBED = {
    PAIR: "a pair",
    MESSAGES: 'a chat ("messages") record',
    TEXT: "a text record",
    PROMPT_COMPLETION: "a prompt/completion record",
}
_KINDS = {PAIRS: "pairs", SFT: "SFT records"}


class _SourceCheck:
    """The checks across one source's records, fed each record as it is read (before any cut):
    one kind (the first record's, or the one `objective` trains on), and some pair with chosen !=
    rejected. Each refusal names the first record that breaks the rule."""

    def __init__(self, key: str, shown: str, objective: str | None):
        self.key, self.shown, self.objective = key, shown, objective
        self.pairs = objective is not None and objective != "sft"
        self.first: tuple[str, str] | None = None  # (kind, where) of the first record
        self.some_pair_differs = False

    def check(self, rec, where: str, fields: dict | None) -> dict:
        rec = check_record(rec, where, fields, self.pairs)
        fmt = record_format(rec)
        assert fmt is not None  # check_record refused a record of none of the formats
        kind = record_kind(fmt)
        if self.first is None:
            if self.objective is not None and kind != (PAIRS if self.pairs else SFT):
                if self.pairs:
                    raise SpecError(
                        f'{where}: objective.name={self.objective} trains on pairs {{"prompt", '
                        f'"chosen", "rejected"}}; this is {_DESCRIBED[fmt]}'
                    )
                raise SpecError(f"{where}: pair records need a preference objective: objective.name={PREFERENCE_NAMES}")
            self.first = (kind, where)
        elif kind != self.first[0]:
            raise SpecError(
                f"{where}: {_DESCRIBED[fmt]} among {_KINDS[self.first[0]]} (the first is "
                f"{self.first[1].removeprefix(self.key + ': ')}); one job's data is all pairs or "
                "all SFT records"
            )
        if fmt == PAIR and rec["chosen"] != rec["rejected"]:
            self.some_pair_differs = True
        return rec

    def done(self) -> None:
        if self.first is not None and self.first[0] == PAIRS and not self.some_pair_differs:
            raise SpecError(
                f"{self.key}: {self.shown}: chosen equals rejected in every pair: nothing to prefer "
                "(does data.fields name one column twice?)"
            )


def first_record_format(path: str, key: str, fields: dict | None, hf_token_env: str | None, pairs: bool) -> str | None:
    """The format (`records.record_format`) of a source's first record, read and checked as a job
    reads it (`pairs`: a preference job), without reading the rest: how a mixture's sources are
    compared before each is read whole. A source without records is refused as `read_jsonl` does."""
    shown = one_line(str(path))
    if is_hub(path) or os.path.isdir(path) or Path(path).suffix.lower() in DATASETS_SUFFIXES:
        rows = datasets_rows(str(path), key, hf_token_env)
        if not len(rows):
            raise SpecError(f"{key}: {shown}: no records")
        return record_format(check_record(dict(rows[0]), f"{key}: {shown} row 0", fields, pairs), pairs)
    for where, value in json_lines(path, key):
        return record_format(check_record(value, where, fields, pairs), pairs)
    raise SpecError(f"{key}: {shown}: no records")


def read_records(spec: JobSpec, tokenizer) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) of the spec, texts cut to what max_seq_len can use."""
    cut = char_bound(tokenizer, spec.data.max_seq_len)
    d = spec.data
    records: list[dict] = []
    for i, p in enumerate(d.path):
        records += read_jsonl(
            p,
            "data.path" if len(d.path) == 1 else f"data.path.{i}",
            max_chars=cut,
            fields=d.fields,
            hf_token_env=d.hf_token_env,
            objective=spec.objective.name,
        )
    eval_records: list[dict] = []
    if d.eval_path:
        eval_records = read_jsonl(
            d.eval_path,
            "data.eval_path",
            max_chars=cut,
            fields=d.fields,
            hf_token_env=d.hf_token_env,
            objective=spec.objective.name,
        )
    elif d.eval_fraction > 0:
        order = list(range(len(records)))
        random.Random(spec.run.seed).shuffle(order)
        n_eval = max(1, int(round(len(records) * d.eval_fraction)))
        held = set(order[:n_eval])
        eval_records = [r for i, r in enumerate(records) if i in held]
        records = [r for i, r in enumerate(records) if i not in held]
    return records, eval_records


def _read_lines(path: str, key: str, max_chars: int | None, fields: dict | None, checks: _SourceCheck) -> list[dict]:
    return [cut_record(checks.check(value, where, fields), max_chars) for where, value in json_lines(path, key)]


def json_lines(path: str, key: str) -> Iterator[tuple[str, Any]]:
    """(where, parsed value) of each non-blank line of a JSONL file, read line by line; the file
    not readable, not UTF-8, or a line that is not a usable JSON value is one SpecError naming
    `key`, the file and the line. Every JSONL reader of rayft's data goes through here. Within
    `read_once`, a file read to its end is parsed only that once (see there)."""
    shown = one_line(str(path))
    problem = path_problem(path)
    if problem:
        raise SpecError(f"{key}: {problem}")
    ident = _identity(path)
    if ident is not None and _kept is not None and ident in _kept:
        yield from ((f"{key}: {shown} line {i}", value) for i, value in _kept.pop(ident))
        return
    lines: list[tuple[int, Any]] = []  # kept when `ident` is not None
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    where = f"{key}: {shown} line {i}"
                    value = _json_value(line, where)
                    if ident is not None:
                        lines.append((i, value))
                    yield where, value
    except UnicodeDecodeError:
        raise SpecError(f"{key}: {shown}: not UTF-8 text") from None
    except OSError as e:
        raise SpecError(f"{key}: {shown}: cannot be read ({e.strerror or e})") from None
    if ident is not None and _kept is not None:  # read to its end, every line a JSON value
        _kept[ident] = lines


# ---- each file parsed once per driver start ----------------------------------------------------

# On the driver, the data are read twice in a row: the count pass checks every record before
# anything is created (`count_checked_records`, GRPO's `check_records`), then the build tokenizes
# them (`jobs.finetune.build_data`). Within `read_once`, the count pass keeps each JSONL file's
# parsed lines (keyed by the file's identity: path, size, modification time, inode) and the build
# takes them instead of reading and parsing the file again; the build is the last reader
# (`drop_kept`). A file over KEEP_MAX_BYTES is read each time: its parsed lines would hold several
# times its size in memory. Taken once (a second reader reads the file), dropped when the block ends.
KEEP_MAX_BYTES = 512 * 2**20
_kept: dict[tuple, list[tuple[int, Any]]] | None = None


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Within it, a JSONL file read to its end is parsed once for the next reader of the same file."""
    global _kept
    outer, _kept = _kept, {}
    try:
        yield
    finally:
        _kept = outer


def drop_kept() -> None:
    """What `read_once` keeps is dropped, and nothing more is kept in this block: the last reader is done."""
    global _kept
    _kept = None


def _identity(path: str) -> tuple | None:
    """The file's identity while `read_once` keeps lines and the file is small enough, else None."""
    if _kept is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None  # the read names the problem
    if st.st_size > KEEP_MAX_BYTES:
        return None
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)


def _json_value(line: str, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise SpecError(f"{where}: nested too deeply to be a record") from None
    except ValueError as e:  # e.g. an integer longer than Python converts
        raise SpecError(f"{where}: not a usable JSON value ({one_line(str(e))[:100]})") from None


def datasets_rows(path: str, key: str, hf_token_env: str | None):
    """A `datasets.Dataset` (Arrow, memory-mapped from datasets' cache) for a non-JSONL source."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    shown = one_line(path)
    try:
        if is_hub(path):
            name, _, split = path[3:].partition(":")
            token = os.environ.get(hf_token_env) if hf_token_env else None
            ds = datasets.load_dataset(name, split=split or "train", token=token)
        elif os.path.isdir(path):
            ds = _load_from_disk(path, key, shown)
        else:
            problem = path_problem(path)
            if problem:
                raise SpecError(f"{key}: {problem}")
            builder = DATASETS_SUFFIXES[Path(path).suffix.lower()]
            # CSV has no types: every cell is text ("4" stays "4", an empty cell is "", not NaN)
            kw = {"features": _csv_text_features(path), "keep_default_na": False} if builder == "csv" else {}
            ds = datasets.load_dataset(builder, data_files=str(Path(path).resolve()), split="train", **kw)
    except SpecError:
        raise
    except Exception as e:  # pyarrow/datasets errors: one line, the first line of their message
        msg = one_line(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)[:200]
        raise SpecError(f"{key}: {shown}: cannot be read as a dataset ({msg})") from None
    return ds


def _load_from_disk(path: str, key: str, shown: str):
    """A `save_to_disk` directory's dataset (a DatasetDict's `train` split), once every file its
    descriptions name has been checked (`dataset_dir_files`)."""
    import datasets

    dataset_dir_files(path, key)
    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError:
        raise SpecError(
            f"{key}: {shown} is a directory that is not a dataset (expected one written by Dataset.save_to_disk)"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise SpecError(f"{key}: {shown}: a DatasetDict without a 'train' split (has {', '.join(sorted(ds))})")
        ds = ds["train"]
    return ds


# The descriptions `datasets.load_from_disk` reads in a `save_to_disk` directory.
DATASET_DICT_JSON, DATASET_STATE_JSON, DATASET_INFO_JSON = "dataset_dict.json", "state.json", "dataset_info.json"


def dataset_dir_files(path: str | Path, key: str = "data.path") -> list[Path]:
    """Every file `datasets.load_from_disk(path)` opens: a Dataset's `state.json`, its
    `dataset_info.json` and the Arrow files `state.json` names; for a DatasetDict, its
    `dataset_dict.json` and the same for every split it names (all are loaded, not only `train`).

    `datasets` joins the names it reads to the directory as given, so a name that is absolute or
    climbs out with `..` would be read from anywhere: refused, as is a description that is not
    one and any of these files that is not a regular file (`path_problem`: a FIFO is never
    opened). Each refusal is one SpecError naming `key` and the file. The content hash covers
    every file returned (`jobs.data.cache.source_hash`)."""
    root = Path(path)
    is_dataset = all(os.path.lexists(root / f) for f in (DATASET_STATE_JSON, DATASET_INFO_JSON))
    if not is_dataset and os.path.lexists(root / DATASET_DICT_JSON):  # as `datasets.load_from_disk` decides
        files = [_regular(root / DATASET_DICT_JSON, key)]
        splits = _description(root / DATASET_DICT_JSON, key).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise SpecError(f"{key}: {one_line(str(root / DATASET_DICT_JSON))}: no list of split names")
        for split in splits:
            files += _dataset_files(_inside(root, split, root / DATASET_DICT_JSON, key), key)
        return files
    return _dataset_files(root, key)


def _dataset_files(directory: Path, key: str) -> list[Path]:
    """`dataset_dir_files` of one Dataset directory."""
    state_path = directory / DATASET_STATE_JSON
    if not all(os.path.lexists(directory / f) for f in (DATASET_STATE_JSON, DATASET_INFO_JSON)):
        raise SpecError(
            f"{key}: {one_line(str(directory))} is a directory that is not a dataset (expected one written by "
            "Dataset.save_to_disk)"
        )
    files = [_regular(state_path, key), _regular(directory / DATASET_INFO_JSON, key)]
    named = _description(state_path, key).get("_data_files")
    if not isinstance(named, list) or not all(
        isinstance(f, dict) and isinstance(f.get("filename"), str) for f in named
    ):
        raise SpecError(f"{key}: {one_line(str(state_path))}: no list of data files (_data_files)")
    return files + [_regular(_inside(directory, f["filename"], state_path, key), key) for f in named]


def _inside(directory: Path, name: str, described_in: Path, key: str) -> Path:
    """`directory / name`, where `name` (from the description `described_in`) stays inside `directory`."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts or "\0" in name:
        raise SpecError(
            f"{key}: {one_line(str(described_in))} names {one_line(repr(name))[:120]}, outside its directory: a "
            "dataset's files must lie in its own directory"
        )
    return directory / name


def _regular(path: Path, key: str) -> Path:
    problem = path_problem(path)
    if problem:
        raise SpecError(f"{key}: {problem}")
    return path


def _description(path: Path, key: str) -> dict:
    """A `save_to_disk` description (`state.json`, `dataset_dict.json`) as a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8
        raise SpecError(
            f"{key}: {one_line(str(path))}: not a readable dataset description ({type(e).__name__})"
        ) from None
    if not isinstance(data, dict):
        raise SpecError(f"{key}: {one_line(str(path))}: not a dataset description (not a JSON object)")
    return data


def _csv_text_features(path: str):
    import csv

    import datasets

    with open(path, encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})
