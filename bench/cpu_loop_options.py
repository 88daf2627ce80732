"""The loop's throughput options on ragged data, on CPU: micro-batch layouts (padding with a
mask, padding without one, length grouping, packing) and `model.compile`. A benchmark (not a
test) behind the defaults of `data.group_by_length`, `data.packing` and `model.compile`.

Same process, same job (tiny-llama, LoRA r=16 on all seven linear layers, fp32, no
checkpointing, AdamW), same data (examples/data/tiny.jsonl: strongly ragged prompt/completion
records, max_seq_len 256), same global batches (32 sequences = 4 accumulation steps x
micro-batch 8, one process). Only the layout of each micro-batch changes:

* padded+mask: right padding with HF's attention mask -- what rayft did before (and what HF
  Trainer's collators do): SDPA gets a [B, 1, S, S] mask, the masked kernel, GQA repeated.
* padded: right padding, no mask (rayft's layout since: causal attention already keeps real
  tokens from seeing the pads after them).
* grouped: padded, micro-batches formed from sequences of similar length within the global
  batch (`data.group_by_length`, the default).
* packed: `data.packing` (first-fit-decreasing rows of up to max_seq_len tokens, positions
  restarting per sequence, a block-diagonal float mask), no grouping.
* packed+grouped: both.
* grouped+compile: grouped, with `model.compile` (each decoder layer through torch.compile).
  Its compile time falls in the warmup steps: `first_step_s` lists each repeat's first step
  (the first repeat compiles; later ones in the same process reuse dynamo's compiled code, and
  inductor's on-disk cache may already be warm from an earlier process).

Each variant is `jobs.train.loop.train(spec, LocalContext)`, timed as the interval between
consecutive `Context.progress` calls after the warmup steps (CPU time of the process, the
headline on a shared machine, and wall). Variants alternate over `--repeats`
(order reversed every other repeat). `collate_at` is wrapped to count the positions each layout
computes. tok_s counts real input tokens (no padding), the same for every layout, so it is
directly comparable. The losses of every step must agree across layouts (same samples, same
math): the max difference is recorded.

    python bench/cpu_loop_options.py                     # writes bench/results/cpu-loop-options-<date>.json
    python bench/cpu_loop_options.py --quick --out /tmp  # checks the script (the compile takes ~40 s)
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

import jobs.objectives.sft as sft  # noqa: E402  (where the SFT objective collates)
import jobs.train.loop as loop  # noqa: E402
from jobs.data import collate_at  # noqa: E402
from jobs.spec import load_spec  # noqa: E402
from jobs.train.context import LocalContext  # noqa: E402

VARIANTS = {  # name -> (group_by_length, packing, HF attention mask on padded batches, model.compile)
    "padded+mask": (False, False, True, False),
    "padded": (False, False, False, False),
    "grouped": (True, False, False, False),
    "packed": (False, True, False, False),
    "packed+grouped": (True, True, False, False),
    "grouped+compile": (True, False, False, True),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_spec(args, out: Path, group: bool, packing: bool, compile_layers: bool):
    return load_spec(
        data={
            "name": "cpu-loop-options",
            "model": {"name": "tiny-llama", "compile": compile_layers},
            "data": {
                "path": [str(args.data)],
                "max_seq_len": args.max_seq_len,
                "group_by_length": group,
                "packing": packing,
            },
            "lora": {"r": 16, "alpha": 32, "target_modules": TARGETS},
            "batch": {"global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch},
            "optim": {"name": "adamw", "lr": 1e-3, "schedule": "constant", "warmup_steps": 0},
            "precision": "fp32",
            "memory": {"gradient_checkpointing": False},
            "run": {"max_steps": args.warmup + args.steps, "seed": 0, "output_dir": str(out), "eval_every": 0},
        }
    )


def with_hf_mask(batch: dict, lengths: list[int]) -> dict:
    """The previous layout: an attention mask of the real tokens on every padded batch."""
    if min(lengths) == max(lengths):
        return batch
    mask = torch.zeros_like(batch["input_ids"])
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return dict(batch, attention_mask=mask)


def run_variant(args, name: str, workdir: Path, rep: int) -> dict:
    group, packing, hf_mask, compile_layers = VARIANTS[name]
    spec = make_spec(args, workdir / f"{name}-{rep}", group, packing, compile_layers)
    computed = []

    def counting_collate(split, indices, pad_id, pin_memory=False, **kw):
        batch = collate_at(split, indices, pad_id, pin_memory, **kw)
        if hf_mask:
            batch = with_hf_mask(batch, [int(split.lengths[i]) for i in indices])
        computed.append(batch["input_ids"].numel())
        return batch

    ends: list[tuple[float, float]] = []
    sft.collate_at, original = counting_collate, sft.collate_at
    try:
        loop.train(
            spec,
            LocalContext(on_progress=lambda m: ends.append((time.perf_counter(), time.process_time()))),
            resume=False,
        )
    finally:
        sft.collate_at = original
    records = [json.loads(x) for x in (spec.output_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    pairs = list(zip(ends[args.warmup - 1 :], ends[args.warmup :], strict=False))  # consecutive ends
    timed = records[args.warmup :]
    return {
        "wall_s": [b[0] - a[0] for a, b in pairs],
        "cpu_s": [b[1] - a[1] for a, b in pairs],
        "real_tokens": [r["tokens"] for r in timed],
        "losses": [r["loss"] for r in records],
        "first_step_s": records[0]["step_time_s"],
        # the timed steps' share of the computed positions (eval is off: all are training)
        "computed_positions": sum(computed) * len(timed) // max(1, len(records)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT / "examples" / "data" / "tiny.jsonl")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2 timed steps, 1 repeat: checks the script")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.warmup = 2, 1, 1
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("rayft").setLevel(logging.ERROR)
    started = time.perf_counter()
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {n: [] for n in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="rayft-layout-") as tmp:
        for rep in range(args.repeats):
            order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                runs[name].append(run_variant(args, name, Path(tmp), rep))
                print(f"repeat {rep} {name:15} done", flush=True)
    load_after = os.getloadavg()

    ref_losses = runs["padded"][0]["losses"]
    rows = {}
    for name, rs in runs.items():
        cpu = [x for r in rs for x in r["cpu_s"]]
        wall = [x for r in rs for x in r["wall_s"]]
        real = sum(sum(r["real_tokens"]) for r in rs)
        positions = sum(r["computed_positions"] for r in rs)
        tokens_per_step = statistics.mean(x for r in rs for x in r["real_tokens"])
        rows[name] = {
            "cpu_s_per_step_median": statistics.median(cpu),
            "wall_s_per_step_median": statistics.median(wall),
            "real_tok_s_cpu": tokens_per_step / statistics.median(cpu),
            "real_tok_s_wall": tokens_per_step / statistics.median(wall),
            "computed_positions_per_step": positions / max(1, len(cpu)),
            "padding_fraction": 1 - real / positions if positions else None,
            "max_loss_diff_vs_padded": max(
                abs(a - b) for r in rs for a, b in zip(r["losses"], ref_losses, strict=True)
            ),
            # the first repeat's first step: where the compile happens (later repeats in this
            # process reuse dynamo's compiled code, so their first steps are fast)
            "first_step_s": [r["first_step_s"] for r in rs],
        }
    base = rows["padded+mask"]["cpu_s_per_step_median"]
    for row in rows.values():
        row["speedup_cpu_vs_padded_mask"] = base / row["cpu_s_per_step_median"]
    today = _dt.date.today().isoformat()
    result = {
        "benchmark": "cpu-loop-options",
        "date": today,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "config": {
            "data": str(args.data.relative_to(ROOT)) if args.data.is_relative_to(ROOT) else str(args.data),
            "model": "tiny-llama",
            "lora": "r=16, all 7 linear layers",
            "precision": "fp32",
            "max_seq_len": args.max_seq_len,
            "global_batch_size": args.global_batch,
            "micro_batch_size": args.micro_batch,
            "grad_accum_steps": args.global_batch // args.micro_batch,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
            "quick": args.quick,
        },
        "definitions": {
            name: {"group_by_length": g, "packing": p, "hf_attention_mask": m, "compile": c}
            for name, (g, p, m, c) in VARIANTS.items()
        },
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu-loop-options-{today}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"\n{'layout':15} {'ms/step cpu':>11} {'real tok/s':>10} {'positions':>9} {'padding':>8} "
        f"{'vs padded+mask':>14} {'loss diff':>9} {'1st step s':>10}"
    )
    for name, r in rows.items():
        print(
            f"{name:15} {r['cpu_s_per_step_median'] * 1e3:11.1f} {r['real_tok_s_cpu']:10.0f} "
            f"{r['computed_positions_per_step']:9.0f} {r['padding_fraction']:8.1%} "
            f"{r['speedup_cpu_vs_padded_mask']:13.2f}x {r['max_loss_diff_vs_padded']:9.1e} "
            f"{r['first_step_s'][0]:10.2f}"
        )
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; {result['wall_s']} s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
