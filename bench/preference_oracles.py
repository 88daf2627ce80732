"""The preference objectives' exactness oracles, as numbers: bench/results/preference-oracles-<date>.json.

tests/unit/objectives/test_preference.py asserts bounds (the relative gradient error of every split against the
big-batch gradient <= 1e-5, ...); this script runs the same oracles (it imports them from tests/)
and records the errors themselves, per objective, split and strategy:

  .venv/bin/python bench/preference_oracles.py            # ~5 minutes on 2 cores

Each row: the objective, the split (workers x accumulation x micro-batch, 8 pairs in the global
batch), the strategy (ddp / fsdp), checkpointing, precision, the relative error of the reduced LoRA
gradient against the independent big-batch gradient (each pair's two sequences alone, the full
logits' log_softmax, the paper's formula, the mean over the 8 pairs), the relative loss error, and
the bound the test asserts."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "helpers"), str(ROOT / "tests" / "unit" / "objectives")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--quick", action="store_true", help="DPO on one split only: checks the script")
    args = ap.parse_args(argv)

    import torch
    from gloo_pool import shutdown
    from gradtools import rel_err
    from test_preference import OBJECTIVES, SPLITS, _run_split, independent_grads, objective_overrides, pref_spec

    cases = []  # (objective, workers, micro, strategy, gc, precision, extra overrides, bound)
    for name in ["dpo"] if args.quick else OBJECTIVES:
        for w, m in SPLITS[1:2] if args.quick else SPLITS:
            cases.append((name, w, m, "ddp", False, "fp32", (), 1e-5))
    if not args.quick:
        for name in ("dpo", "orpo"):
            for gc, strategy in ((True, "ddp"), (False, "fsdp"), (True, "fsdp")):
                cases.append((name, 2, 2, strategy, gc, "fp32", (), 1e-5))
        cases.append(("dpo", 2, 2, "ddp", True, "bf16", ("model.quantization=nf4",), 2e-2))
        cases.append(("dpo", 2, 2, "ddp", False, "fp16", (), 2e-2))

    started = time.perf_counter()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="rayft-pref-oracles-") as tmp:
            for i, (name, w, m, strategy, gc, precision, extra, bound) in enumerate(cases):
                over = (
                    *objective_overrides(name),
                    f"resources.num_workers={w}",
                    f"batch.micro_batch_size={m}",
                    *extra,
                )
                ref, ref_loss = independent_grads(pref_spec(*over), precision=precision)
                got, loss = _run_split(Path(tmp) / str(i), w, over, gc=gc, precision=precision, strategy=strategy)
                row = {
                    "objective": name,
                    "split": f"{w} x {8 // (w * m)} x {m}",
                    "strategy": strategy,
                    "gradient_checkpointing": gc,
                    "precision": precision,
                    "base": "nf4" if extra else "fp32",
                    "grad_rel_err": rel_err(got, ref),
                    "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
                    "bound": bound,
                }
                rows.append(row)
                print(
                    f"{name:6} {row['split']:10} {strategy:5} gc={'on' if gc else 'off':3} {precision:5} "
                    f"{row['base']:5} grad {row['grad_rel_err']:.2e} loss {row['loss_rel_err']:.2e} (bound {bound:g})",
                    flush=True,
                )
    finally:
        shutdown()
    today = _dt.date.today().isoformat()
    result = {
        "benchmark": "preference-oracles",
        "date": today,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "quick": args.quick,
        "rows": rows,
        "all_within_bounds": all(r["grad_rel_err"] <= r["bound"] for r in rows),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"preference-oracles-{today}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if result["all_within_bounds"] else 1


if __name__ == "__main__":
    sys.exit(main())
