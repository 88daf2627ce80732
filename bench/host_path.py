"""Host milliseconds per optimizer step of the step's data work, before and after the array path,
and how long the training thread waits for its batch with prefetch on (a benchmark, not a test).

The work measured is `jobs.train.loop.micro_batches_of` for one optimizer step on rank 0 of 8
simulated ranks: the global batch's indices (`GlobalBatches`), length grouping over the whole
global batch (`data.group_by_length`, on by default), the window's label and input token counts
over the whole global batch (every rank counts them locally), rank 0's split, and the collation
of rank 0's micro-batches (micro-batch 8: accumulation = seqs / 64). Packing off (a packed
variant of "after" is in each row's detail).

* before: the per-example Python path as it was at commit 2ff3d57, kept below as a faithful copy
  (`before_micro_batches_of` and the functions it called: the sampler's per-position loop, the
  sort keyed on `train[i].length`,
  `count_labels` / `count_inputs` over `Example` properties, list slicing, `collate` from
  `Example` tuples), run in the same process on the same memory-mapped split. Each step's batches
  are checked equal (every tensor, its dtype, bit for bit) to "after"'s before anything is timed,
  so both sides do the same work.
* after: `jobs.train.loop.micro_batches_of` itself (a stand-in context and job around the real split).
* wait: `jobs.train.prefetch.Prefetch` over `micro_batches_of`, as `jobs.train.loop.train` runs it; the
  training thread takes each step's window (`get`, timed: the wait) and then "computes" for
  `--compute-ms`, busy with the GIL released (`busy`: a loop of `time.sleep(0)`, as a training
  thread in torch ops or spinning in a device sync is). The first step has nothing to overlap
  with and is reported apart. The detail has the same with the compute a sleep
  (`wait_sleep_compute`: on this VM the first instructions after 100 ms idle cost 0.1 to 0.3 ms,
  which it counts as waiting) and a Python loop that holds the GIL (`wait_gil_held_compute`: the
  worst case for a thread).

Data: a cache split written by the real writer (`jobs.data.entry._SplitWriter`) and memory-mapped
(`TokenizedSplit.open`): 2 x seqs examples, input lengths uniform in [3/4 seq_len, seq_len], the
first quarter of each without labels (IGNORE), ids uniform in [0, 32000). Times are medians over
the timed steps (each a different global batch), after one untimed step (page cache warm); host
times are CPU time of the process (the headline on a shared machine: other load inflates wall
time at random; wall medians are in the detail), torch on one thread.

    python bench/host_path.py                     # writes bench/results/host-path-<date>.json
    python bench/host_path.py --quick --out /tmp  # seconds: checks the script
    python bench/host_path.py --device cuda       # on a GPU machine: the pinned path the loop runs there
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobs.data import IGNORE, Example, GlobalBatches, Pair, TokenizedSplit  # noqa: E402
from jobs.data.entry import _SplitWriter  # noqa: E402
from jobs.objectives import Objective  # noqa: E402
from jobs.spec import load_spec  # noqa: E402
from jobs.train.loop import layout_args, micro_batches_of  # noqa: E402
from jobs.train.prefetch import Prefetch  # noqa: E402

SHAPES = [(64, 512), (512, 2048), (2048, 4096)]
QUICK_SHAPES = [(64, 64), (128, 128)]
RANKS, MICRO = 8, 8
GOAL_HOST_MS, GOAL_SHAPE, GOAL_WAIT_MS, GOAL_COMPUTE_MS = 20.0, (512, 2048), 1.0, 100.0
PAD, VOCAB = 0, 32000
BEFORE_COMMIT = "2ff3d57"


# ---- before: the per-example Python path of jobs/ at 2ff3d57, copied as it was -----------------
# (jobs/train/loop.py micro_batches_of; jobs/data/batches.py GlobalBatches, count_labels, count_inputs,
# split_window, collate, collate_pairs, _rows_tensors, _packed_positions, pack_rows. `train[i]` is
# TokenizedSplit.__getitem__, unchanged since: an Example of Python tuples.) tests/unit/train/test_host_path.py
# checks the array path against these functions on random data.


class BeforeGlobalBatches:
    def __init__(self, n_examples: int, global_batch_size: int, seed: int):
        self.n = n_examples
        self.g = global_batch_size
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._perms = {epoch: order}  # keep one epoch: steps advance monotonically
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.g
        out = []
        for pos in range(start, start + self.g):
            epoch, i = divmod(pos, self.n)
            out.append(self._perm(epoch)[i])
        return out


def before_split_window(
    indices: Sequence[int], rank: int, world_size: int, micro_batch_size: int, grad_accum_steps: int
) -> list[list[int]]:
    assert len(indices) == world_size * micro_batch_size * grad_accum_steps, "split must cover the batch"
    out = []
    for j in range(grad_accum_steps):
        start = (j * world_size + rank) * micro_batch_size
        out.append(list(indices[start : start + micro_batch_size]))
    return out


def before_count_labels(examples: Sequence[Example | Pair], indices: Sequence[int]) -> int:
    return sum(examples[i].n_labels for i in indices)


def before_count_inputs(examples: Sequence[Example | Pair], indices: Sequence[int]) -> int:
    return sum(examples[i].n_inputs for i in indices)


def before_collate(
    examples: Sequence[Example], pad_id: int, pin_memory: bool = False, *, pack_tokens: int = 0, row_multiple: int = 1
) -> dict[str, torch.Tensor]:
    lengths = [len(e.input_ids) for e in examples]
    rows = before_pack_rows(lengths, pack_tokens) if pack_tokens else []
    packed = 0 < len(rows) < len(examples)
    if not packed:
        rows = [[i] for i in range(len(examples))]
    length = max(sum(lengths[i] for i in row) for row in rows)
    if packed:
        length = -(-length // row_multiple) * row_multiple
    input_ids, targets = _before_rows_tensors(examples, rows, lengths, length, pad_id)
    flat = targets.view(-1)
    label_pos = (flat != IGNORE).nonzero().squeeze(1)
    batch = {
        "input_ids": input_ids,
        "label_pos": label_pos,
        "label_ids": flat.index_select(0, label_pos),
    }
    if packed:
        batch["position_ids"], batch["seq_ids"] = _before_packed_positions(rows, lengths, length)
    if pin_memory:
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return batch


def before_collate_pairs(pairs: Sequence[Pair], pad_id: int, pin_memory: bool = False) -> dict[str, torch.Tensor]:
    rows = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    length = max(len(prompt) + len(resp) - 1 for prompt, resp in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, (prompt, resp) in enumerate(rows):
        n = len(prompt) + len(resp) - 1
        input_ids[r, :n] = torch.tensor((prompt + resp)[:-1])
        targets[r, len(prompt) - 1 : n] = torch.tensor(resp)
    flat = targets.view(-1)
    label_pos = (flat != IGNORE).nonzero().squeeze(1)
    batch = {
        "input_ids": input_ids,
        "label_pos": label_pos,
        "label_ids": flat.index_select(0, label_pos),
        "resp_len": torch.tensor([len(resp) for _, resp in rows], dtype=torch.long),
    }
    if pin_memory:
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return batch


def _before_rows_tensors(
    examples: Sequence[Example], rows: list[list[int]], lengths: Sequence[int], length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            e, n = examples[i], lengths[i]
            input_ids[r, at : at + n] = torch.tensor(e.input_ids)
            targets[r, at : at + n] = torch.tensor(e.targets)
            at += n
    return input_ids, targets


def _before_packed_positions(
    rows: list[list[int]], lengths: Sequence[int], length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    seq_ids = torch.zeros((len(rows), length), dtype=torch.int32)
    for r, row in enumerate(rows):
        at = 0
        for slot, i in enumerate(row):
            n = lengths[i]
            position_ids[r, at : at + n] = torch.arange(n)
            seq_ids[r, at : at + n] = slot
            at += n
        position_ids[r, at:] = torch.arange(length - at)
        seq_ids[r, at:] = len(row)
    return position_ids, seq_ids


def before_pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return [sorted(row) for row in rows]


def before_micro_batches_of(spec, ctx, job, step: int) -> tuple[list[dict], int, int]:
    """(micro-batches, label tokens, input tokens): `micro_batches_of` of an SFT run at 2ff3d57."""
    indices = job.before_batches.indices(step)
    train = job.data.train
    if spec.data.group_by_length:
        indices = sorted(indices, key=lambda i: (train[i].length, i))
    mine = before_split_window(indices, ctx.rank, ctx.world_size, spec.batch.micro_batch_size, spec.grad_accum_steps)
    n_labels, n_inputs = before_count_labels(train, indices), before_count_inputs(train, indices)
    layout = layout_args(spec, ctx.device)
    pad_id, pin = job.tokenizer.pad_token_id, ctx.device.type == "cuda"
    micro = [before_collate([train[i] for i in mb], pad_id, pin_memory=pin, **layout) for mb in mine]
    return micro, n_labels, n_inputs


# ---- the data and the stand-ins around it ------------------------------------------------------


def write_split(directory: Path, n: int, seq_len: int, seed: int = 0) -> TokenizedSplit:
    """`n` synthetic examples written by the cache's writer, memory-mapped back (see the docstring)."""
    rng = np.random.default_rng(seed)
    w = _SplitWriter(directory, "train")
    for length in rng.integers(max(2, seq_len * 3 // 4), seq_len + 1, size=n):
        ids = rng.integers(0, VOCAB, size=int(length), dtype=np.int32)
        targets = np.roll(ids, -1)
        targets[: int(length) // 4] = IGNORE
        w.add(Example(tuple(ids.tolist()), tuple(targets.tolist())))
    meta = w.close()
    return TokenizedSplit.open(directory, "train", meta["n_tokens"])


def stand_ins(split: TokenizedSplit, seqs: int, seq_len: int, packing: bool, device: str = "cpu"):
    """(spec, ctx, job) for `micro_batches_of`: rank 0 of RANKS, micro-batch MICRO, on `device`
    (cuda: pinned tensors and packed rows aligned to 16, as the loop does there)."""
    spec = load_spec(
        data={
            "name": "host-path",
            "data": {"path": ["unused.jsonl"], "max_seq_len": seq_len, "packing": packing},
            "batch": {"global_batch_size": seqs, "micro_batch_size": MICRO},
            "resources": {"num_workers": RANKS},
        },
        files=False,
    )
    ctx = SimpleNamespace(rank=0, world_size=RANKS, device=torch.device(device))
    job = SimpleNamespace(
        batches=GlobalBatches(len(split), seqs, seed=0),
        before_batches=BeforeGlobalBatches(len(split), seqs, seed=0),
        data=SimpleNamespace(train=split),
        tokenizer=SimpleNamespace(pad_token_id=PAD),
        objective=Objective(),
    )
    return spec, ctx, job


def same_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


# ---- measurements -------------------------------------------------------------------------------


def timed(fn: Callable[[int], object], steps: range) -> dict:
    """Median CPU and wall ms of `fn(step)` over `steps`."""
    cpu, wall = [], []
    for step in steps:
        c, w = time.process_time(), time.perf_counter()
        fn(step)
        cpu.append((time.process_time() - c) * 1e3)
        wall.append((time.perf_counter() - w) * 1e3)
    return {"cpu_ms": statistics.median(cpu), "wall_ms": statistics.median(wall), "n": len(cpu)}


def busy(seconds: float) -> None:
    """Busy for `seconds` with the GIL released most of the time (`time.sleep(0)` in a loop), as a
    training thread in torch ops or spinning in a device sync is: the CPU never idles, so the wait
    after it is not the wake-up of an idle CPU."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(0)


def spin(seconds: float) -> None:
    """A busy loop in Python: the GIL is held throughout, except at the interpreter's switches."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def waits(build: Callable[[int], object], steps: range, compute_s: float, compute: Callable[[float], None]) -> dict:
    """The training thread's wait for each window under `Prefetch`, computing `compute_s` per step."""
    out = []
    with Prefetch(build, steps) as ahead:
        for step in steps:
            t = time.perf_counter()
            ahead.get(step)
            out.append((time.perf_counter() - t) * 1e3)
            compute(compute_s)
    rest = out[1:]
    return {"first_ms": out[0], "mean_ms": statistics.fmean(rest), "max_ms": max(rest), "n": len(rest)}


def measure(seqs: int, seq_len: int, args, workdir: Path) -> tuple[dict, dict]:
    """One row (the result file's keys) and its detail."""
    directory = workdir / f"{seqs}x{seq_len}"
    directory.mkdir()
    split = write_split(directory, 2 * seqs, seq_len)
    spec, ctx, job = stand_ins(split, seqs, seq_len, packing=False, device=args.device)
    packed = stand_ins(split, seqs, seq_len, packing=True, device=args.device)
    reps = args.reps if seqs * seq_len < 2**22 else args.big_reps
    warm, steps = 0, range(1, 1 + reps)
    for s in (spec, packed[0]):  # untimed, and the check that both sides build the same batches
        after = micro_batches_of(s, ctx, job, warm)
        micro, n_labels, n_inputs = before_micro_batches_of(s, ctx, job, warm)
        assert same_batches(after.micro_batches, micro) and (after.n_labels, after.n_inputs) == (n_labels, n_inputs)
    before = timed(lambda k: before_micro_batches_of(spec, ctx, job, k), steps)
    after = timed(lambda k: micro_batches_of(spec, ctx, job, k), steps)
    after_packed = timed(lambda k: micro_batches_of(packed[0], ctx, job, k), steps)
    wait_steps = range(0, args.wait_steps)
    build = lambda k: micro_batches_of(spec, ctx, job, k)  # noqa: E731
    computing = waits(build, wait_steps, args.compute_ms / 1e3, busy)
    slept = waits(build, wait_steps, args.compute_ms / 1e3, time.sleep)
    held = waits(build, wait_steps, args.compute_ms / 1e3, spin)
    row = {
        "seqs": seqs,
        "seq_len": seq_len,
        "host_ms_before": round(before["cpu_ms"], 3),
        "host_ms_after": round(after["cpu_ms"], 3),
        "wait_ms": round(computing["mean_ms"], 3),
    }
    detail = {
        "seqs": seqs,
        "seq_len": seq_len,
        "rank0_micro_batches": spec.grad_accum_steps,
        "rank0_tokens": int(sum(mb["input_ids"].numel() for mb in micro_batches_of(spec, ctx, job, 1).micro_batches)),
        "before": before,
        "after": after,
        "after_packed": after_packed,
        "wait_busy_compute": computing,
        "wait_sleep_compute": slept,
        "wait_gil_held_compute": held,
    }
    print(
        f"{seqs:5d} x {seq_len:<5d} before {before['cpu_ms']:9.2f} ms  after {after['cpu_ms']:7.2f} ms "
        f"(packed {after_packed['cpu_ms']:6.2f})  wait {computing['mean_ms']:6.3f} ms (max {computing['max_ms']:.3f}; "
        f"sleep {slept['mean_ms']:.3f}, GIL held {held['mean_ms']:.3f}); load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    return row, detail


def versions() -> dict:
    return {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two small shapes, few steps: checks the script")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per side (shapes under 4M tokens)")
    ap.add_argument("--big-reps", type=int, default=3, help="timed steps per side for the largest shapes")
    ap.add_argument("--wait-steps", type=int, default=12, help="steps under prefetch (the first one apart)")
    ap.add_argument("--compute-ms", type=float, default=GOAL_COMPUTE_MS, help="the dummy compute per step")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine: pinned batches, as the loop")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.quick:
        args.reps, args.big_reps, args.wait_steps, args.compute_ms = 2, 2, 4, 20.0
    torch.set_num_threads(1)
    started, load_before = time.perf_counter(), os.getloadavg()
    rows, details = [], []
    with tempfile.TemporaryDirectory(prefix="rayft-host-path-") as tmp:
        for seqs, seq_len in shapes:
            row, detail = measure(seqs, seq_len, args, Path(tmp))
            rows.append(row)
            details.append(detail)
    goal_row = next((r for r in rows if (r["seqs"], r["seq_len"]) == GOAL_SHAPE), None)
    today = _dt.date.today().isoformat()
    result = {
        "benchmark": "host-path",
        "date": today,
        "rows": rows,
        "before": f"a faithful copy of the per-example Python path of jobs/ at commit {BEFORE_COMMIT} kept in "
        "bench/host_path.py (before_micro_batches_of), run in this process on the same split; its batches "
        "checked equal to after's (bit for bit, packed and not) before timing",
        "definitions": {
            "host_ms_before": "median CPU ms per optimizer step of before_micro_batches_of (rank 0 of 8)",
            "host_ms_after": "median CPU ms per optimizer step of jobs.train.loop.micro_batches_of (rank 0 of 8)",
            "wait_ms": f"mean wall ms the training thread waits in Prefetch.get per step (after the first), "
            f"computing {args.compute_ms:g} ms per step, busy with the GIL released (bench.host_path.busy); the "
            "detail has the same with the compute a sleep (wait_sleep_compute: it adds an idle CPU's wake-up) "
            "and a Python loop holding the GIL (wait_gil_held_compute: the worst case for a thread)",
            "work": "global batch indices, length grouping and label/input counts over the whole global batch, "
            f"rank 0's split, collation of rank 0's micro-batches (micro-batch {MICRO}, packing off)",
            "data": "2 x seqs examples written by jobs.data.entry._SplitWriter and memory-mapped; input lengths "
            "uniform in [3/4 seq_len, seq_len], the first quarter unlabelled",
        },
        "config": {
            "ranks": RANKS,
            "rank": 0,
            "micro_batch_size": MICRO,
            "group_by_length": True,
            "compute_ms": args.compute_ms,
            "reps": args.reps,
            "big_reps": args.big_reps,
            "wait_steps": args.wait_steps,
            "torch_threads": 1,
            "device": args.device,
            "quick": args.quick,
        },
        "goals": {
            "host_ms_after_at_512x2048": GOAL_HOST_MS,
            "wait_ms": GOAL_WAIT_MS,
            "wait_ms_compute_ms_at_least": GOAL_COMPUTE_MS,
        },
        "met": {
            "host_ms_after_at_512x2048": None if goal_row is None else goal_row["host_ms_after"] <= GOAL_HOST_MS,
            "wait_ms": all(r["wait_ms"] <= GOAL_WAIT_MS for r in rows) if args.compute_ms >= GOAL_COMPUTE_MS else None,
        },
        "detail": details,
        "versions": versions(),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        },
        "threads_left": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host-path-{today}{'' if args.device == 'cpu' else '-' + args.device}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'seqs x seq_len':>15} {'before ms':>10} {'after ms':>9} {'wait ms':>8}")
    for r in rows:
        print(
            f"{r['seqs']:>6} x {r['seq_len']:<6} {r['host_ms_before']:10.2f} {r['host_ms_after']:9.3f} "
            f"{r['wait_ms']:8.3f}"
        )
    print(f"goals: {result['met']}; load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
