"""Data sources (`data.path`, `data.eval_path`): reading their rows as checked records.

A `.jsonl` file (or any file `datasets` has no reader for) is read line by line, each line
checked as it is read; JSON, Parquet and CSV files, a `Dataset.save_to_disk` directory and a hub
dataset `hf:ORG/NAME[:SPLIT]` go through the `datasets` library (Arrow, memory-mapped from its
cache). Every problem is one SpecError naming the spec key, the source and the line or row.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Optional

from ..errors import SpecError
from ..spec import JobSpec, one_line, path_problem
from .records import char_bound, check_record, cut_record

DATASETS_SUFFIXES = {".json": "json", ".parquet": "parquet", ".csv": "csv"}


def is_hub(path: str) -> bool:
    return str(path).startswith("hf:")


def read_jsonl(path: str, key: str = "data.path", max_chars: Optional[int] = None,
               fields: Optional[dict] = None, hf_token_env: Optional[str] = None) -> list[dict]:
    """The records of one data source, each checked for shape (after renaming `fields`, ours ->
    theirs); a problem is one SpecError naming `key`, the source and the line or row. A `.jsonl`
    (or any file `datasets` has no reader for) is read line by line; `.json`, `.parquet`, `.csv`,
    a `save_to_disk` directory and `hf:ORG/NAME[:SPLIT]` go through `datasets`. With `max_chars`,
    each record's texts are cut to that many characters as soon as it is read (see `char_bound`)."""
    shown = one_line(str(path))
    if is_hub(path) or os.path.isdir(path) or Path(path).suffix.lower() in DATASETS_SUFFIXES:
        rows = datasets_rows(str(path), key, hf_token_env)
        records = [cut_record(check_record(dict(row), f"{key}: {shown} row {i}", fields), max_chars)
                   for i, row in enumerate(rows)]
    else:
        records = _read_lines(path, key, max_chars, fields)
    if not records:
        raise SpecError(f"{key}: {shown}: no records")
    return records


def read_records(spec: JobSpec, tokenizer) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) of the spec, texts cut to what max_seq_len can use."""
    cut = char_bound(tokenizer, spec.data.max_seq_len)
    d = spec.data
    records: list[dict] = []
    for i, p in enumerate(d.path):
        records += read_jsonl(p, "data.path" if len(d.path) == 1 else f"data.path.{i}", max_chars=cut,
                              fields=d.fields, hf_token_env=d.hf_token_env)
    eval_records: list[dict] = []
    if d.eval_path:
        eval_records = read_jsonl(d.eval_path, "data.eval_path", max_chars=cut, fields=d.fields,
                                  hf_token_env=d.hf_token_env)
    elif d.eval_fraction > 0:
        order = list(range(len(records)))
        random.Random(spec.run.seed).shuffle(order)
        n_eval = max(1, int(round(len(records) * d.eval_fraction)))
        held = set(order[:n_eval])
        eval_records = [r for i, r in enumerate(records) if i in held]
        records = [r for i, r in enumerate(records) if i not in held]
    return records, eval_records


def _read_lines(path: str, key: str, max_chars: Optional[int], fields: Optional[dict]) -> list[dict]:
    records = []
    shown = one_line(str(path))
    problem = path_problem(path)
    if problem:
        raise SpecError(f"{key}: {problem}")
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                records.append(cut_record(_parse_record(line, f"{key}: {shown} line {i}", fields), max_chars))
    except UnicodeDecodeError:
        raise SpecError(f"{key}: {shown}: not UTF-8 text") from None
    except OSError as e:
        raise SpecError(f"{key}: {shown}: cannot be read ({e.strerror or e})") from None
    return records


def _parse_record(line: str, where: str, fields: Optional[dict] = None) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise SpecError(f"{where}: nested too deeply to be a record") from None
    except ValueError as e:  # e.g. an integer longer than Python converts
        raise SpecError(f"{where}: not a usable JSON value ({one_line(str(e))[:100]})") from None
    return check_record(rec, where, fields)


def datasets_rows(path: str, key: str, hf_token_env: Optional[str]):
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
    """A `save_to_disk` directory's dataset (a DatasetDict's `train` split)."""
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError:
        raise SpecError(f"{key}: {shown} is a directory that is not a dataset "
                        "(expected one written by Dataset.save_to_disk)") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise SpecError(f"{key}: {shown}: a DatasetDict without a 'train' split "
                            f"(has {', '.join(sorted(ds))})")
        ds = ds["train"]
    return ds


def _csv_text_features(path: str):
    import csv

    import datasets

    with open(path, encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})
