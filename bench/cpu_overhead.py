"""rayft's per-optimizer-step overhead against a plain PyTorch loop, on CPU (a benchmark, not a test).

Same process, same model (tiny-llama, LoRA r=16 on all seven linear layers, fp32, no
checkpointing), same data (fixed-length synthetic text, so every micro-batch has the same
shape), same split (global batch 32 = 8 accumulation steps x micro-batch 4), same loss
(`jobs.train.loop.CausalLMLoss`, summed token loss scaled by 1 / label tokens of the window), same
optimizer (AdamW, constant lr, clipping at 1.0). The loops alternate over several repeats
(rayft, plain, bare, then bare, plain, rayft, ...); the figure is the median seconds per
optimizer step over all timed steps, and the ratio rayft / plain. Goal: <= 1.05.

What each side includes, per optimizer step
--------------------------------------------
* rayft: `jobs.train.loop.train(spec, LocalContext)`, the real loop, timed as the interval between
  consecutive `Context.progress` calls (one per optimizer step, after the warmup steps). So one
  step is everything `train()` does per step: the lr schedule and setting it, the sampler
  (`GlobalBatches.index_array`), counting label/input tokens, `split_window`, `collate_at` of
  every micro-batch (these on `jobs.train.prefetch.Prefetch`'s thread, one step ahead: CPU time counts
  every thread of the process, so they are in the figure), the fault-injection hook,
  `train_window` (forward + backward of all micro-batches), `optimizer_step` (GradScaler calls,
  grad-norm clipping, AdamW, zero_grad), the step's single `.item()` of the loss and of the grad
  norm, peak-memory reading, the metrics record, its line in metrics.jsonl (flushed) and the
  progress callback. Model building, data loading, and the end of the run (checkpoint, adapter,
  plot, summary) are outside the timed steps; `train_wall_s` reports the whole call.
* plain: a hand-written loop over the *same micro-batches, collated beforehand* (outside the
  timing): for each micro-batch forward, `(summed_loss * (1 / label_tokens)).backward()`, then
  `clip_grad_norm_(params, 1.0)`, `optimizer.step()`, `zero_grad(set_to_none=True)`, and one
  `.item()` of the window's loss. Same math as rayft (its per-step losses are compared).
* bare: the plain loop without clipping -- the irreducible minimum (rayft always computes the
  grad norm, to log it).

Timing is the interval between consecutive end-of-step timestamps for all three. The CPU
machine is shared (other processes may run); the load average before and after is recorded,
and torch runs on `--threads` threads (default 1, the least sensitive to other load).

    python bench/cpu_overhead.py                     # writes bench/results/cpu-overhead-<date>.json
    python bench/cpu_overhead.py --quick --out /tmp  # a few seconds: checks the script
    python bench/cpu_overhead.py --profile           # plus cProfile of rayft's step (top functions)
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import io
import json
import logging
import os
import platform
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobs.data import GlobalBatches, collate_at, count_inputs, count_labels, load_dataset, split_window  # noqa: E402
from jobs.model.loading import add_lora, load_base_model  # noqa: E402
from jobs.spec import load_spec  # noqa: E402
from jobs.train.context import LocalContext  # noqa: E402
from jobs.train.loop import CausalLMLoss, train  # noqa: E402

GOAL = 1.05
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_data(path: Path, n: int, chars: int, seed: int = 0) -> None:
    """`n` records of exactly `chars` ASCII letters: with the byte tokenizer, <s> + chars + </s>."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": "".join(rng.choice(letters) for _ in range(chars))}) + "\n")


def make_spec(args, data_path: Path, out_dir: Path):
    return load_spec(
        data={
            "name": "cpu-overhead",
            "model": {"name": "tiny-llama"},
            "data": {"path": [str(data_path)], "max_seq_len": args.seq + 1},
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": TARGETS},
            "batch": {"global_batch_size": args.global_batch, "micro_batch_size": args.micro_batch},
            "optim": {"name": "adamw", "lr": 1e-3, "schedule": "constant", "warmup_steps": 0, "max_grad_norm": 1.0},
            "precision": "fp32",
            "memory": {"gradient_checkpointing": False},
            "resources": {"num_workers": 1, "use_gpu": False},
            "run": {"max_steps": args.warmup + args.steps, "seed": 0, "output_dir": str(out_dir)},
        }
    )


def now() -> tuple[float, float]:
    """(wall, CPU time of this process): the machine may be shared, so both are kept."""
    return time.perf_counter(), time.process_time()


def intervals(ends: list[tuple[float, float]], warmup: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of each optimizer step after the warmup steps."""
    pairs = list(zip(ends[warmup - 1 :], ends[warmup:], strict=False))  # consecutive ends
    return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


# ---- the two loops ------------------------------------------------------------------------------


def run_rayft(args, data_path: Path, workdir: Path, rep: int) -> dict:
    out = workdir / f"rayft-{rep}"
    spec = make_spec(args, data_path, out)
    ends: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    train(spec, LocalContext(on_progress=lambda m: ends.append(now())), resume=False)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step_s, cpu_s = intervals(ends, args.warmup)
    return {
        "step_s": step_s,
        "cpu_s": cpu_s,
        "inner_step_s": [r["step_time_s"] for r in records[args.warmup :]],
        "losses": [r["loss"] for r in records],
        "train_wall_s": wall,
    }


class PlainLoop:
    """The same model, data order, micro-batches, loss and optimizer as `train()`, hand-written."""

    def __init__(self, args, data_path: Path, workdir: Path):
        self.args = args
        self.spec = make_spec(args, data_path, workdir / "plain-unused")
        spec = self.spec
        data_model, tok = load_base_model(spec, "fp32")
        data = load_dataset(spec, tok)
        del data_model
        batches = GlobalBatches(len(data.train), spec.batch.global_batch_size, spec.run.seed)
        self.data, self.batches, self.pad_id = data, batches, tok.pad_token_id
        self.windows = []
        for step in range(args.warmup + args.steps):
            idx = batches.index_array(step)
            mbs = split_window(idx, 0, 1, spec.batch.micro_batch_size, spec.grad_accum_steps)
            self.windows.append(
                ([collate_at(data.train, mb, tok.pad_token_id) for mb in mbs], count_labels(data.train, idx))
            )

    def host_work(self, repeats: int = 5) -> list[float]:
        """CPU seconds per step of the host-side data work `train()` does and the plain loop
        does not (it gets its batches collated beforehand): sampler, token counts, split, collate."""
        spec, out = self.spec, []
        n = self.args.warmup + self.args.steps
        for _ in range(repeats):
            t = time.process_time()
            for step in range(n):
                idx = self.batches.index_array(step)
                count_labels(self.data.train, idx)
                count_inputs(self.data.train, idx)
                mbs = split_window(idx, 0, 1, spec.batch.micro_batch_size, spec.grad_accum_steps)
                [collate_at(self.data.train, mb, self.pad_id) for mb in mbs]
            out.append((time.process_time() - t) / n)
        return out

    def run(self, clip: bool) -> dict:
        spec = self.spec
        model, _ = load_base_model(spec, "fp32")  # what train() builds: same seed, same weights
        model = add_lora(model, spec)
        model.train()
        torch.manual_seed(spec.run.seed * 7919)  # as train() does before its loop (rank 0)
        random.seed(spec.run.seed * 7919)
        module = CausalLMLoss(model)
        params = [p for p in model.parameters() if p.requires_grad]
        o = spec.optim
        opt = torch.optim.AdamW(params, lr=spec.effective_lr, betas=o.betas, weight_decay=o.weight_decay, fused=False)
        ends, losses = [], []
        for micro_batches, n_labels in self.windows:
            scale = 1.0 / n_labels
            loss_sum = torch.zeros(())
            for mb in micro_batches:
                summed = module(**mb)
                (summed * scale).backward()
                loss_sum += summed.detach()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss_sum.item() / n_labels)
            ends.append(now())
        step_s, cpu_s = intervals(ends, self.args.warmup)
        return {"step_s": step_s, "cpu_s": cpu_s, "losses": losses}


# ---- statistics and output ----------------------------------------------------------------------


def stats(xs: list[float]) -> dict:
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {
        "n": len(s),
        "median_s": statistics.median(s),
        "mean_s": statistics.fmean(s),
        "p10_s": q(0.1),
        "p90_s": q(0.9),
        "min_s": s[0],
    }


def machine() -> dict:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": model or platform.processor(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def versions() -> dict:
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def profile_rayft(args, data_path: Path, workdir: Path, top: int = 30) -> dict:
    """cProfile over one `train()`: the functions of rayft's own step machinery and where the time goes."""
    prof = cProfile.Profile()
    prof.enable()
    res = run_rayft(args, data_path, workdir, rep=999)
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    # Stats.stats is the raw table print_stats reads; typeshed's pstats stub leaves it out.
    for (file, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        if "/jobs/" in file:
            rows.append(
                {
                    "function": f"jobs/{file.split('/jobs/')[-1]}:{line}({fn})",
                    "calls": nc,
                    "tottime_s": round(tt, 4),
                    "cumtime_s": round(ct, 4),
                }
            )
    rows.sort(key=lambda r: -r["cumtime_s"])
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return {
        "jobs_functions_by_cumtime": rows[:top],
        "top_by_tottime": buf.getvalue(),
        "steps": args.warmup + args.steps,
        "train_wall_s": res["train_wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats x (1 warmup + 4 timed steps): checks the script")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per repeat and loop")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128, help="input tokens per sequence (all sequences this long)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--profile", action="store_true", help="also cProfile one rayft run and print where time goes")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.steps = 2, 1, 4
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        ap.error("--warmup, --steps and --repeats must be >= 1")
    logging.getLogger("rayft").setLevel(logging.ERROR)  # the per-job banner, once per repeat
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    started = time.perf_counter()
    load_before = os.getloadavg()
    names = ("rayft", "plain", "bare")
    per = {clock: {n: [] for n in names} for clock in ("cpu", "wall")}
    inner, walls, losses = [], [], {}
    with tempfile.TemporaryDirectory(prefix="rayft-cpu-overhead-") as tmp:
        workdir = Path(tmp)
        data_path = workdir / "data.jsonl"
        # <s> + (seq - 1) characters + </s> = seq + 1 tokens = max_seq_len: `seq` inputs each.
        write_data(data_path, args.global_batch * (args.warmup + args.steps), args.seq - 1)
        plain = PlainLoop(args, data_path, workdir)
        for rep in range(args.repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                if name == "rayft":
                    res = run_rayft(args, data_path, workdir, rep)
                    inner.append(res["inner_step_s"])
                    walls.append(res["train_wall_s"])
                else:
                    res = plain.run(clip=name == "plain")
                per["wall"][name].append(res["step_s"])
                per["cpu"][name].append(res["cpu_s"])
                losses.setdefault(name, res["losses"])
            print(
                f"# repeat {rep + 1}/{args.repeats}, median CPU (wall) ms per step: "
                + ", ".join(
                    f"{n} {statistics.median(per['cpu'][n][-1]) * 1e3:.2f} "
                    f"({statistics.median(per['wall'][n][-1]) * 1e3:.2f})"
                    for n in names
                )
                + f"; load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        host = plain.host_work()
        profile = profile_rayft(args, data_path, workdir) if args.profile else None
    load_after = os.getloadavg()

    results, ratios = {}, {}
    for clock in ("cpu", "wall"):
        res = {}
        for n in names:
            res[n] = stats([x for rep in per[clock][n] for x in rep])
            res[n]["per_repeat_median_s"] = [statistics.median(r) for r in per[clock][n]]
        med = {n: res[n]["median_s"] for n in names}
        rep_med = {n: statistics.median(res[n]["per_repeat_median_s"]) for n in names}
        results[clock] = res
        ratios[clock] = {
            "rayft_over_plain": med["rayft"] / med["plain"],
            "rayft_over_plain_per_repeat_medians": rep_med["rayft"] / rep_med["plain"],
            "rayft_over_bare": med["rayft"] / med["bare"],
            "overhead_ms_per_step": (med["rayft"] - med["plain"]) * 1e3,
        }
    results["wall"]["rayft_inner"] = stats([x for rep in inner for x in rep])
    ratio = ratios["cpu"]["rayft_over_plain"]
    loss_diff = max(abs(a - b) for a, b in zip(losses["rayft"], losses["plain"], strict=True))
    today = _dt.date.today().isoformat()
    result = {
        "benchmark": "cpu-overhead",
        "date": today,
        "versions": versions(),
        "machine": machine(),
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "config": {
            "model": "tiny-llama (hidden 64, 2 layers, 4 heads / 2 kv, intermediate 176, vocab 259)",
            "lora": "r=16, alpha=32, all 7 linear layers, fp32",
            "precision": "fp32",
            "gradient_checkpointing": False,
            "seq_len": args.seq,
            "global_batch_size": args.global_batch,
            "micro_batch_size": args.micro_batch,
            "grad_accum_steps": args.global_batch // args.micro_batch,
            "optimizer": "AdamW (not fused), lr 1e-3 constant",
            "max_grad_norm": 1.0,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
            "quick": args.quick,
        },
        "definitions": {
            "rayft": "interval between consecutive Context.progress calls of jobs.train.loop.train (one per optimizer "
            "step): lr schedule, sampler, token counts, split, collate, fault hook, train_window, "
            "optimizer_step (scaler no-ops, clip_grad_norm_, AdamW, zero_grad), .item() of loss and grad "
            "norm, peak-memory read, metrics record + metrics.jsonl line (flushed), progress callback",
            "rayft_inner": "(wall only) metrics.jsonl step_time_s, train()'s own timer: from the lr set to after "
            "the loss .item() (excludes grad_norm.item(), metrics write, progress)",
            "plain": "hand-written loop over the same pre-collated micro-batches (collated outside the timing): "
            "forward (CausalLMLoss), (summed * 1/label_tokens).backward(), clip_grad_norm_(1.0), "
            "AdamW step, zero_grad(set_to_none=True), one .item()",
            "bare": "plain without clip_grad_norm_",
            "rayft_host_data": "CPU time per step of the data work only train() does per step (sampler indices, "
            "label/input token counts, split_window, collate_at of every micro-batch), measured "
            "alone: the part of rayft's overhead that does not depend on noise (in train() it runs on "
            "the prefetch thread, one step ahead)",
            "clocks": "cpu: time.process_time() of this process per step (the headline: a shared machine "
            "runs other work, which inflates wall time at random); wall: time.perf_counter()",
            "statistic": "median seconds per optimizer step over all timed steps of all repeats; loops alternate "
            "per repeat (rayft, plain, bare / bare, plain, rayft)",
        },
        "results": results,
        "ratios": ratios,
        "ratio_rayft_over_plain": ratio,
        "goal": GOAL,
        "met": ratio <= GOAL,
        "rayft_host_data_cpu_ms_per_step": statistics.median(host) * 1e3,
        "rayft_host_data_fraction_of_plain_step": statistics.median(host) / results["cpu"]["plain"]["median_s"],
        "same_math_max_loss_diff": loss_diff,
        "losses_first_steps": {n: v[:3] for n, v in losses.items()},
        "rayft_train_wall_s": walls,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if profile:
        result["profile"] = {k: v for k, v in profile.items() if k != "top_by_tottime"}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu-overhead-{today}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")

    for clock in ("cpu", "wall"):
        print(f"\n{clock + ' time':12} {'median ms':>10} {'mean ms':>9} {'p10 ms':>8} {'p90 ms':>8} {'n':>4}")
        for n in [*names, "rayft_inner"]:
            s = results[clock].get(n)
            if s:
                print(
                    f"{n:12} {s['median_s'] * 1e3:10.2f} {s['mean_s'] * 1e3:9.2f} {s['p10_s'] * 1e3:8.2f} "
                    f"{s['p90_s'] * 1e3:8.2f} {s['n']:4d}"
                )
        r = ratios[clock]
        print(
            f"rayft / plain = {r['rayft_over_plain']:.3f} "
            f"(per-repeat medians {r['rayft_over_plain_per_repeat_medians']:.3f}; "
            f"rayft / bare {r['rayft_over_bare']:.3f}); overhead {r['overhead_ms_per_step']:+.2f} ms/step"
        )
    print(f"\nheadline (CPU time): rayft / plain = {ratio:.3f}; goal <= {GOAL}: {'met' if result['met'] else 'MISSED'}")
    print(
        f"rayft's per-step host data work alone (sampler, counts, split, collate): "
        f"{result['rayft_host_data_cpu_ms_per_step']:.2f} ms CPU = "
        f"{result['rayft_host_data_fraction_of_plain_step']:.1%} of a plain step"
    )
    print(
        f"same math: max |loss rayft - loss plain| = {loss_diff:.2e}; load average {load_before[0]:.2f} -> "
        f"{load_after[0]:.2f} on {result['machine']['cpu_count']} CPUs"
    )
    if profile:
        print("\nrayft functions by cumulative time (one train() call):")
        for r in profile["jobs_functions_by_cumtime"]:
            print(f"  {r['cumtime_s']:8.3f}s {r['tottime_s']:8.3f}s {r['calls']:6d}  {r['function']}")
        print(profile["top_by_tottime"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
