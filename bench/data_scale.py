"""Data at scale: today's in-memory path (every worker reads and tokenizes all records into
Python tuples) against the tokenized cache (one build, then every worker memory-maps it).

Generates a JSONL of `--records` text records of `--chars` ASCII characters each (tiny-llama's
byte tokenizer: one token per character, plus BOS and EOS) under /tmp, then runs each case in a
fresh process and measures:

- in_memory: wall time of reading + tokenizing, and the process's RSS growth (VmRSS) due to
  the dataset; this is what every worker paid at every start before the cache;
- cache_first_run: wall time of `load_dataset` building the cache (tokenization, once), RSS growth;
- cache_second_run: with the cache built, time from `load_dataset` to the first collated
  micro-batch (`load_to_first_batch_s`; `start_to_first_batch_s` adds the process start and
  importing torch/transformers, `python_imports_s`), and RSS growth from before `load_dataset`
  to after that batch.

    .venv/bin/python bench/data_scale.py [--records 1000000] [--chars 250]

Writes bench/results/data-scale-<date>.json. The generated data and the cache are removed.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 1 << 30


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def generate(path: Path, n: int, chars: int) -> None:
    rng = random.Random(0)
    words = ["the", "data", "model", "token", "batch", "worker", "cache", "memory", "train", "lora", "ray", "step"]
    with open(path, "w") as f:
        for i in range(n):
            text = f"record {i}:"
            while len(text) < chars:
                text += " " + rng.choice(words)
            f.write(json.dumps({"text": text[:chars]}) + "\n")


def spec_for(path: str, out: str, max_seq_len: int):
    from jobs.spec import load_spec

    return load_spec(
        data={
            "name": "bench",
            "data": {"path": path, "max_seq_len": max_seq_len},
            "batch": {"global_batch_size": 16, "micro_batch_size": 4},
            "resources": {"num_workers": 1},
            "run": {"output_dir": out},
        }
    )


def case(kind: str, path: str, out: str, max_seq_len: int) -> dict:
    """One measurement, in this (fresh) process."""
    from jobs import data as D
    from jobs.model.loading import byte_tokenizer

    imports_s = time.perf_counter() - T_START
    tok = byte_tokenizer()
    spec = spec_for(path, out, max_seq_len)
    gc.collect()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    if kind == "in_memory":
        records, held = D.read_records(spec, tok)
        train = D.tokenize(records, tok, max_seq_len)
        del records, held
        gc.collect()
    else:
        train = D.load_dataset(spec, tok).train
    load_s = time.perf_counter() - t0
    batches = D.GlobalBatches(len(train), spec.batch.global_batch_size, spec.run.seed)
    first = D.split_window(batches.indices(0), 0, 1, spec.batch.micro_batch_size, spec.grad_accum_steps)[0]
    D.collate([train[i] for i in first], tok.pad_token_id)
    gc.collect()
    done = time.perf_counter()
    return {
        "load_s": round(load_s, 2),
        "load_to_first_batch_s": round(done - t0, 2),
        "start_to_first_batch_s": round(done - T_START, 2),
        "python_imports_s": round(imports_s, 2),
        "rss_growth_gib": round((rss_bytes() - rss0) / GIB, 3),
        "examples": len(train),
        # tokens per sequence = input ids + the last label (the shift drops one)
        "tokens": (int(train.offsets[-1]) if hasattr(train, "offsets") else sum(len(e.input_ids) for e in train))
        + len(train),
    }


def run_case(kind: str, path: Path, out: Path, max_seq_len: int) -> dict:
    p = subprocess.run(
        [
            sys.executable,
            __file__,
            "--case",
            kind,
            "--data",
            str(path),
            "--out",
            str(out),
            "--max-seq-len",
            str(max_seq_len),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if p.returncode:
        raise SystemExit(f"{kind} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--chars", type=int, default=250)
    ap.add_argument("--case", choices=["in_memory", "cache"])
    ap.add_argument("--data")
    ap.add_argument("--out")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--skip-in-memory", action="store_true", help="skip today's path (its RSS is the point, but slow)")
    a = ap.parse_args()
    if a.case:
        print(json.dumps(case(a.case, a.data, a.out, a.max_seq_len)))
        return
    work = Path("/tmp/rayft-data-scale")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "data.jsonl"
    try:
        t0 = time.perf_counter()
        generate(data, a.records, a.chars)
        gen_s = time.perf_counter() - t0
        max_seq_len = a.chars + 8
        result = {
            "what": "data loading: in-memory tokenization per worker vs the tokenized memory-mapped cache",
            "command": f"python bench/data_scale.py --records {a.records} --chars {a.chars}",
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
            "model": "tiny-llama (byte tokenizer)",
            "records": a.records,
            "chars_per_record": a.chars,
            "file_bytes": data.stat().st_size,
            "generate_s": round(gen_s, 1),
            "max_seq_len": max_seq_len,
        }
        if not a.skip_in_memory:
            result["in_memory"] = run_case("in_memory", data, work / "a" / "out", max_seq_len)
        result["cache_first_run"] = run_case("cache", data, work / "b" / "out", max_seq_len)
        result["cache_second_run"] = run_case("cache", data, work / "b" / "out", max_seq_len)
        result["tokens"] = result["cache_first_run"]["tokens"]
        cache = next((work / "b" / ".rayft-data").glob("*[!k]"))
        result["cache_bytes"] = sum(f.stat().st_size for f in cache.iterdir())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = ROOT / "bench" / "results" / f"data-scale-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
