"""What verifying a tokenized cache entry costs when it is opened (`jobs.data.verify`), at 25M and
250M tokens: a benchmark (not a test) behind the choice of what runs on every open and what runs
once per node.

Each entry is an SFT entry of the real layout: random int32 ids (vocabulary 32,000), targets
with every other example's first half IGNORE, examples of 100..1,900 tokens, 1% of it held out.
The arrays are generated with numpy and written in the entry's files directly; `meta.json` is
written by the writers' own `_write_meta` (so the recorded sizes and sha256 are those of a real
build). Timed, wall clock, best of `--repeats`, files in the page cache (a first read from
shared storage adds that storage's read time to the digest pass):

- structural: `check_files` + `_check_layout` (lstat, sizes, dtypes/shapes, offsets, counts):
  what every open pays;
- id_range: the range check alone, over the memory-mapped token files;
- digest: sha256 alone over every file; digest_range: the digest pass as `check_contents` runs
  it (sha256 and the id range in one read); blake2b: the same bytes hashed with blake2b, for the
  choice of digest;
- open_marked: a whole `_verified` with a matching marker (what every later open on a node pays);
- open_first: a whole `_verified` with no marker (the first open on a node).

    .venv/bin/python bench/cache_verify.py [--tokens 25000000 250000000] [--repeats 3] [--dir /tmp]

writes bench/results/cache-verify-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import jobs.data.cache as data_mod
import jobs.data.entry as entry_mod
import jobs.data.verify as verify_mod
from jobs.data.tokenizing import IGNORE

VOCAB = 32_000


def write_entry(directory: Path, n_tokens: int, rng: np.random.Generator) -> dict:
    """An SFT entry of about `n_tokens` tokens under `directory`; what `_verified` expects of it."""
    lengths = rng.integers(100, 1900, size=n_tokens // 1000 + 1, dtype=np.int64)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), n_tokens)) + 1]
    n_eval = max(1, len(lengths) // 100)
    meta: dict = {"content_hash": "bench", "records": len(lengths) - n_eval, "eval_records": n_eval, "dropped": 0}
    for name, lens in (("train", lengths[n_eval:]), ("eval", lengths[:n_eval])):
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        total = int(offsets[-1])
        ids = rng.integers(0, VOCAB, size=total, dtype=np.int32)
        ids.tofile(directory / f"{name}.input_ids.bin")
        targets = ids.copy()
        for i in range(0, len(lens), 2):
            targets[offsets[i] : offsets[i] + lens[i] // 2] = IGNORE
        targets.tofile(directory / f"{name}.targets.bin")
        labels = entry_mod._segment_counts(targets != IGNORE, offsets)
        for f, a in zip(entry_mod._SPLIT_ARRAYS, (offsets, lens.astype(np.int32), labels), strict=True):
            np.save(directory / f"{name}.{f}.npy", a)
        meta[name] = {"n": len(lens), "n_tokens": total}
        del ids, targets
    data_mod._write_meta(directory, meta)
    return {"content_hash": "bench", "kind": data_mod.SFT}


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(min(times), 4)


def hash_all(entry: Path, names: list[str], algo: str) -> None:
    for n in names:
        h = hashlib.new(algo)
        with open(entry / n, "rb") as f:
            while block := f.read(verify_mod.BLOCK_BYTES):
                h.update(block)


def range_all(entry: Path, meta: dict) -> None:
    for split in ("train", "eval"):
        for f, rule in (("input_ids", "ids"), ("targets", "targets")):
            a = np.memmap(entry / f"{split}.{f}.bin", dtype=np.int32, mode="r")
            for i in range(0, len(a), verify_mod.BLOCK_BYTES // 4):
                assert verify_mod._ids_in_range(a[i : i + verify_mod.BLOCK_BYTES // 4].tobytes(), VOCAB, rule)


def measure(root: Path, n_tokens: int, repeats: int) -> dict:
    entry = root / f"entry-{n_tokens}"
    entry.mkdir()
    t = time.perf_counter()
    content = write_entry(entry, n_tokens, np.random.default_rng(0))
    write_s = time.perf_counter() - t
    meta = json.loads((entry / "meta.json").read_text())
    names = data_mod.entry_files(data_mod.SFT)
    n_bytes = sum(meta["files"][n]["size"] for n in names)
    data_mod._verified(entry, content, VOCAB)  # warms the page cache, writes this node's marker

    def structural():
        verify_mod.check_files(entry, meta["files"], ["meta.json", *names])
        data_mod._check_layout(entry, meta)

    def digest_range():
        for n in names:
            verify_mod.digest(entry / n, VOCAB)

    def open_first():
        marker = verify_mod.marker_path(entry)
        if marker is not None:
            marker.unlink(missing_ok=True)
        data_mod._verified(entry, content, VOCAB)

    row = {
        "n_tokens": int(meta["train"]["n_tokens"] + meta["eval"]["n_tokens"]),
        "n_samples": int(meta["train"]["n"] + meta["eval"]["n"]),
        "entry_bytes": int(n_bytes),
        "build_and_record_s": round(write_s, 2),
        "structural_s": best(structural, repeats),
        "id_range_s": best(lambda: range_all(entry, meta), repeats),
        "digest_sha256_s": best(lambda: hash_all(entry, names, "sha256"), repeats),
        "digest_blake2b_s": best(lambda: hash_all(entry, names, "blake2b"), repeats),
        "digest_range_s": best(digest_range, repeats),
        "open_first_s": best(open_first, repeats),
        "open_marked_s": best(lambda: data_mod._verified(entry, content, VOCAB), repeats),
    }
    for k in ("digest_sha256", "digest_blake2b", "digest_range"):
        row[k + "_gb_s"] = round(n_bytes / row[k + "_s"] / 1e9, 3)
    shutil.rmtree(entry)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[25_000_000, 250_000_000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows = [measure(Path(d), n, args.repeats) for n in args.tokens]
    out = Path(__file__).parent / "results" / f"cache-verify-{datetime.date.today().isoformat()}.json"
    host = {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version()}
    out.write_text(json.dumps({"host": host, "repeats": args.repeats, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
