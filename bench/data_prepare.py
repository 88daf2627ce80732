"""`rayft data prepare` throughput: the cache entry built by Ray Data tasks on a local Ray of 1 and 2
CPUs, against the job's own single-process build, on the generated set of bench/data_scale.py.

Generates `--records` text records of `--chars` characters (bench/data_scale.py's generator;
tiny-llama's byte tokenizer: a token per character plus BOS and EOS), then runs each case in a
fresh process:

- single_process: `load_dataset` building the entry (read, tokenize, write in one process);
- blocks_in_process: what the Ray tasks compute (`_tokenize_block`: unpickle, tokenize, build
  the Arrow columns) and the driver's decoding, block after block in one process without Ray;
- ray_1cpu, ray_2cpu: `jobs.data.prepare` on a local Ray with that many logical CPUs: `read_s` (the
  driver's `read_records`), `ray_start_s`, `build_s` (tokenize on Ray + write on the driver,
  streamed), and within it `driver_write_s` (the time the driver spends in the entry's writers;
  the rest is waiting for tokenized blocks and decoding them). tokens/s = tokens / (read_s + build_s), Ray's
  start not counted (a cluster is already up).

Each Ray case's entry is compared with the single-process one, file for file (sha256). The load
average of the machine (shared) is recorded before and after each case.

    .venv/bin/python bench/data_prepare.py [--records 200000] [--chars 250]

Writes bench/results/data-prepare-<date>.json. The generated data and the entries are removed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def entry_digest(cache: Path) -> dict[str, str]:
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(entry.iterdir())}


def case(kind: str, data: str, cache: str, max_seq_len: int, num_cpus: int) -> dict:
    """One measurement, in this (fresh) process."""
    from jobs.data import load_dataset
    from jobs.data import prepare as P
    from jobs.model.loading import byte_tokenizer
    from jobs.spec import load_spec

    tok = byte_tokenizer()
    spec = load_spec(  # bench/data_scale.py's spec, the entry under `cache`
        data={
            "name": "bench",
            "data": {"path": data, "max_seq_len": max_seq_len, "cache_dir": cache},
            "batch": {"global_batch_size": 16, "micro_batch_size": 4},
            "resources": {"num_workers": 1},
            "run": {"output_dir": str(Path(cache) / "out")},
        }
    )
    if kind == "single_process":
        t0 = time.perf_counter()
        train = load_dataset(spec, tok).train
        return {"build_s": round(time.perf_counter() - t0, 2), "tokens": int(train.offsets[-1]) + len(train)}
    (entry,) = P.spec_entries(spec, tok)
    t0 = time.perf_counter()
    records, held = P.read_records(spec, tok)
    read_s = time.perf_counter() - t0
    if kind == "blocks_in_process":
        return blocks_in_process(P, spec, tok, [*records, *held], read_s)
    t0 = time.perf_counter()
    P.connect(None, num_cpus)
    ray_start_s = time.perf_counter() - t0
    waits = [0.0]
    real = P.tokenize_on_ray

    def timed(*a, **k):
        it = iter(real(*a, **k))
        while True:
            t = time.perf_counter()
            try:
                x = next(it)
            except StopIteration:
                return
            finally:
                waits[0] += time.perf_counter() - t
            yield x

    P.tokenize_on_ray = timed
    t0 = time.perf_counter()
    P.prepare_entry(entry, tok, records, held)
    build_s = time.perf_counter() - t0
    meta = json.loads((entry.final / "meta.json").read_text())
    tokens = meta["train"]["n_tokens"] + meta["train"]["n"] + meta["eval"]["n_tokens"] + meta["eval"]["n"]
    return {
        "read_s": round(read_s, 2),
        "ray_start_s": round(ray_start_s, 2),
        "build_s": round(build_s, 2),
        "driver_write_s": round(build_s - waits[0], 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / (read_s + build_s)),
    }


def blocks_in_process(P, spec, tok, records: list, read_s: float) -> dict:
    """The Ray tasks' work and the driver's decoding, block after block in this one process, no
    Ray: what prepare computes, without Ray's scheduling, transfers and worker processes."""
    import pyarrow as pa

    from jobs.data.cache import data_kind

    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(records), P.BLOCK_RECORDS):
        rows = [P.pickle.dumps(r) for r in records[i : i + P.BLOCK_RECORDS]]
        out = P._tokenize_block(pa.table({"record": pa.array(rows, pa.binary())}), spec, tok)
        n += sum(1 for _ in P._decode_block(out, data_kind(spec)))
    return {"read_s": round(read_s, 2), "blocks_s": round(time.perf_counter() - t0, 2), "results": n}


def run_case(kind: str, data: Path, cache: Path, max_seq_len: int, num_cpus: int = 0) -> dict:
    load0 = os.getloadavg()
    cmd = [sys.executable, __file__, "--case", kind, "--data", str(data), "--cache", str(cache)]
    cmd += ["--max-seq-len", str(max_seq_len), "--num-cpus", str(num_cpus)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"{kind} failed: {p.stderr[-2000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["loadavg_1m_before_after"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--chars", type=int, default=250)
    ap.add_argument("--case", choices=["single_process", "blocks_in_process", "ray"])
    ap.add_argument("--data")
    ap.add_argument("--cache")
    ap.add_argument("--max-seq-len", type=int, default=0)
    ap.add_argument("--num-cpus", type=int, default=0)
    a = ap.parse_args()
    if a.case:
        print(json.dumps(case(a.case, a.data, a.cache, a.max_seq_len, a.num_cpus)))
        return
    from data_scale import generate

    work = Path("/tmp/rayft-data-prepare")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "data.jsonl"
    max_seq_len = a.chars + 8
    try:
        generate(data, a.records, a.chars)
        result: dict = {
            "what": "rayft data prepare (Ray Data tokenization, local Ray) vs the job's single-process cache build",
            "command": f"python bench/data_prepare.py --records {a.records} --chars {a.chars}",
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only, shared with other work (loadavg)",
            "model": "tiny-llama (byte tokenizer)",
            "records": a.records,
            "chars_per_record": a.chars,
            "max_seq_len": max_seq_len,
        }
        single = run_case("single_process", data, work / "one", max_seq_len)
        single["tokens_per_s"] = round(single["tokens"] / single["build_s"])
        result["single_process"] = single
        reference = entry_digest(work / "one")
        result["blocks_in_process"] = run_case("blocks_in_process", data, work / "blocks", max_seq_len)
        for n in (1, 2):
            r = run_case("ray", data, work / f"ray{n}", max_seq_len, n)
            r["byte_identical_to_single_process"] = entry_digest(work / f"ray{n}") == reference
            result[f"ray_{n}cpu"] = r
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = ROOT / "bench" / "results" / f"data-prepare-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
