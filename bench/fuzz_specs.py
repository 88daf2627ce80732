"""Run the spec/YAML/JSONL fuzzer of tests/hostile/test_fuzz.py for longer than CI does.

    python bench/fuzz_specs.py [--examples N] [--seconds S] [--out bench/results]

Same strategies, same checks (every case exits 0 or 2 with one line, never a traceback, and a
refused case creates no output directory), but random (not derandomized), without shrinking,
and collecting every failure instead of stopping at the first. Writes
`<out>/fuzz-specs-<date>.json`: the cases tried per target, the seconds spent, and each failure
(target, exception type, first line of its message, the case, shortened). Exits 1 when any
case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "helpers"), str(ROOT / "tests" / "hostile")]

import test_fuzz  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

TARGETS = {
    "overrides": (test_fuzz.overrides_cases, test_fuzz.check_overrides),
    "yaml_documents": (test_fuzz.yaml_documents(), test_fuzz.check_yaml),
    "jsonl_records": (test_fuzz.jsonl_files, test_fuzz.check_jsonl),
}
SHOWN_CASE_CHARS = 600


def fuzz(name: str, examples: int, deadline_s: float) -> dict:
    """Up to `examples` random cases of one target (fewer when `deadline_s` passes first)."""
    strategy, check = TARGETS[name]
    result = run_cases(name, strategy, check, examples, deadline_s)
    del result["outcomes"]  # every check here returns None
    return result


def run_cases(name: str, strategy, check, examples: int, deadline_s: float) -> dict:
    """Up to `examples` cases of `strategy` through `check` (fewer when `deadline_s` passes first):
    cases tried, seconds, each failure (an exception out of `check`; the run goes on), and a count
    of what `check` returned. Shared with bench/fuzz_files.py."""
    tried, outcomes, failures, start = 0, Counter(), [], time.monotonic()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(case):
        nonlocal tried
        if time.monotonic() - start > deadline_s:
            return
        tried += 1
        try:
            outcomes[str(check(case))] += 1
        except Exception as e:  # noqa: BLE001 - every failure is recorded, the run goes on
            failures.append(
                {
                    "target": name,
                    "error": type(e).__name__,
                    "message": (str(e).strip().splitlines() or [""])[0][:300],
                    "where": traceback.extract_tb(e.__traceback__)[-1].filename.replace(str(ROOT) + "/", ""),
                    "case": repr(case)[:SHOWN_CASE_CHARS],
                }
            )

    run()
    return {
        "tried": tried,
        "outcomes": dict(outcomes),
        "seconds": round(time.monotonic() - start, 1),
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000, help="cases per target (default 2000)")
    ap.add_argument("--seconds", type=float, default=600.0, help="time limit per target (default 600)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a model hub
    results = {name: fuzz(name, args.examples, args.seconds) for name in TARGETS}
    failures = [f for r in results.values() for f in r.pop("failures")]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "examples_per_target": args.examples,
        "tried": {k: v["tried"] for k, v in results.items()},
        "seconds": {k: v["seconds"] for k, v in results.items()},
        "tried_total": sum(r["tried"] for r in results.values()),
        "failures": failures,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fuzz-specs-{report['date']}.json"
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(f"{report['tried_total']} cases, {len(failures)} failures -> {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
