"""Run the file fuzzer of tests/hostile/test_file_fuzz.py for longer than CI does.

    python bench/fuzz_files.py [--examples N] [--seconds S] [--out bench/results]

Same mutations, same targets (a tokenized cache entry, a checkpoint directory, an adapter
directory, a queue database, a precomputed reference entry, a starting adapter) and the same checks
(`tests/helpers/filefuzz.py`: exit 0 or 2 with one line, never a traceback or a hang, no silent
wrong result from a cache entry, a checkpoint, a reference entry or a starting adapter), but random
(not derandomized), without shrinking, and collecting every failure instead of stopping at the
first. Writes `<out>/fuzz-files-<date>.json`: the cases tried per target, the exit codes seen, the
seconds spent, and each failure (target, exception type, first line of its message, the mutation).
Exits 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "helpers"), str(ROOT / "tests" / "hostile")]


from filefuzz import TARGETS, check, mutations  # noqa: E402
from fuzz_specs import run_cases  # noqa: E402


def fuzz(target, examples: int, deadline_s: float) -> dict:
    """Up to `examples` random mutations of one built target (fewer when `deadline_s` passes first),
    with the count of each exit code."""
    result = run_cases(target.name, mutations, lambda m: check(target, m)[0], examples, deadline_s)
    result["exits"] = result.pop("outcomes")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000, help="cases per target (default 1000)")
    ap.add_argument("--seconds", type=float, default=300.0, help="time limit per target (default 300)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a model hub
    results = {}
    with tempfile.TemporaryDirectory(prefix="fuzz-files-") as tmp:
        for name, cls in TARGETS.items():
            target = cls()
            (Path(tmp) / name).mkdir()
            target.build(Path(tmp) / name)
            results[name] = fuzz(target, args.examples, args.seconds)
    failures = [f for r in results.values() for f in r.pop("failures")]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "examples_per_target": args.examples,
        "seconds_per_target": args.seconds,
        "tried": {k: v["tried"] for k, v in results.items()},
        "exits": {k: v["exits"] for k, v in results.items()},
        "seconds": {k: v["seconds"] for k, v in results.items()},
        "tried_total": sum(r["tried"] for r in results.values()),
        "failures": failures,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fuzz-files-{report['date']}.json"
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(f"{report['tried_total']} cases, {len(failures)} failures -> {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
