"""Check `jobs.memory.estimate` against `torch.cuda.max_memory_allocated` on a GPU.

Builds random-init Llama models of the Llama-3.2-1B shape (tied embeddings) and the
Llama-3.1-8B shape (untied), frozen in bf16 with fp32 LoRA r=16 on all seven linear
layers, as rayft trains them, and runs one forward + backward of rayft's loss (LM head +
fp32 cross-entropy on the label positions) for every sequence length x micro-batch x
checkpointing combination whose estimate fits under --max-gib. AdamW state and the LoRA
gradients are allocated beforehand (a steady-state micro-step), so the measured peak and
`MemoryEstimate.peak_allocated_bytes` cover the same things. Framework overhead (CUDA
context, allocator slack) is outside `max_memory_allocated`; it is reported, not compared.

Needs only torch, transformers and peft (no Ray). Writes
bench/results/memory-<date>-<gpu>.json (rewritten after every combination, so a cut-off run
keeps what it measured) and prints a table. On an H200 it measured 31 combinations in 30 s
(bench/results/gpu-2026-12-04-nvidia-h200/memory.json); `--time-limit-s` stops starting
combinations. `bash bench/gpu_all.sh $OUT` runs it with bench/gpu_compare.py in one device call
(see that script's docstring for the wheels).

    python bench/gpu_memory.py                      # the GPU run
    python bench/gpu_memory.py --dry-run            # tiny shapes on CPU, to check the script
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.shapes import SHAPES  # noqa: E402  (one table for both GPU scripts)
from jobs import memory  # noqa: E402  (pure python, no torch at import)
from jobs.spec import DEFAULT_TARGET_MODULES  # noqa: E402

GIB = 1024**3
TARGETS = list(DEFAULT_TARGET_MODULES)

TINY_SHAPES = {
    "tiny-gqa": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=160,
        vocab_size=300,
        tie_word_embeddings=False,
    ),
    "tiny-tied": dict(
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=500,
        tie_word_embeddings=True,
    ),
}


def llama_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        **shape, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, attn_implementation="sdpa"
    )


# ---- rayft's loss ------------------------------------------------------------------------------

try:  # the real thing when rayft's dependencies are installed
    from jobs.train.loop import CausalLMLoss
except ImportError:  # the GPU machine may only have torch/transformers/peft

    class CausalLMLoss(torch.nn.Module):
        """Same computation as jobs.train.loop.CausalLMLoss (chunk_tokens=0)."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, label_pos, label_ids):
            lm = self.model.get_base_model()
            hidden = lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
            h = hidden.flatten(0, 1).index_select(0, label_pos)
            return F.cross_entropy(lm.get_output_embeddings()(h).float(), label_ids, reduction="sum")


# ---- the model, as jobs.model.loading builds it ---------------------------------------------------------


def build(config, device: torch.device, lora_r: int):
    """Random init directly on the device in bf16; frozen base; fp32 LoRA on all linears that
    reads its input in bf16 (no PEFT cast to fp32), as jobs.model.loading builds it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(
        model,
        LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"),
    )
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    # As jobs.model.loading.keep_lora_inputs_in_compute_dtype: the adapters read the bf16 input as is.
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
    model.train()
    return model


def make_batch(vocab: int, micro_batch_size: int, seq_len: int, device: torch.device) -> dict:
    """Unpadded full-length sequences, every position a label (what the estimate assumes)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (micro_batch_size, seq_len), generator=g)
    flat = ids.view(-1)
    batch = {"input_ids": ids, "label_pos": torch.arange(flat.numel()), "label_ids": flat.roll(-1)}
    return {k: v.to(device) for k, v in batch.items()}


# ---- measuring -------------------------------------------------------------------------------


class CpuPeak(torch.utils._python_dispatch.TorchDispatchMode):
    """CPU stand-in for max_memory_allocated: peak bytes of storages allocated by ops (plus
    `base_bytes` of what existed before). Only for --dry-run; the GPU run uses CUDA's counter."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in existing}
        self.existing, self.base_bytes = set(storages), sum(storages.values())
        self.live: dict = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.existing:
                ref = self._ref(t.untyped_storage())
                old = self.live.get(ref.cdata)
                if old is not None and old[0].expired():
                    self.current -= self.live.pop(ref.cdata)[1]
                if ref.cdata not in self.live:
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
                    self.current += t.untyped_storage().nbytes()
        if self.current > self.peak:
            for k in [k for k, (r, _) in self.live.items() if r.expired()]:
                self.current -= self.live.pop(k)[1]
            self.peak = max(self.peak, self.current)
        return out


def step_peak_bytes(loss_fn, model, optimizer, batch: dict, device: torch.device) -> int:
    """Peak allocated bytes over one forward + backward, gradients and AdamW state resident."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        with autocast:
            loss = loss_fn(**batch)
        loss.backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        existing = [
            *model.parameters(),
            *model.buffers(),
            *batch.values(),
            *state,
            *(p.grad for p in model.parameters() if p.grad is not None),
        ]
        with CpuPeak(existing) as mode:
            with autocast:
                loss = loss_fn(**batch)
            loss.backward()
        peak = mode.base_bytes + mode.peak
    del loss
    optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated: a steady-state micro-step
    return peak


def warm_up(loss_fn, model, optimizer, vocab: int, device: torch.device) -> None:
    """One small step: creates the gradients and AdamW's state, loads kernels and cuBLAS workspaces."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = loss_fn(**make_batch(vocab, 1, 16, device))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def set_checkpointing(model, on: bool) -> None:
    base = model.get_base_model()
    if on:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.activation_checkpointing_disable()


def run_shape(name: str, shape: dict, args, device: torch.device, rows: list, save, started: float) -> None:
    """Measures `shape` into `rows`, calling `save()` after each row (a killed run keeps its rows)."""
    config = llama_config(shape)
    t0 = time.perf_counter()
    model = build(config, device, args.lora_r)
    loss_fn = CausalLMLoss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    warm_up(loss_fn, model, optimizer, config.vocab_size, device)
    print(f"# {name}: built in {time.perf_counter() - t0:.1f}s", flush=True)
    # Checkpointing off first: enabling it turns on input grads for the embeddings, which
    # disabling (for a model without PEFT's transformers integration) does not undo.
    for gc_on in (False, True):
        set_checkpointing(model, gc_on)
        for seq in args.seq_lens:
            for mb in args.micro_batches:
                est = memory.estimate(
                    config,
                    micro_batch_size=mb,
                    seq_len=seq,
                    gradient_checkpointing=gc_on,
                    base_dtype="bf16",
                    lora_r=args.lora_r,
                    lora_target_modules=TARGETS,
                    optimizer="adamw",
                    device=device.type,
                )
                row = {
                    "shape": name,
                    "seq_len": seq,
                    "micro_batch_size": mb,
                    "gradient_checkpointing": gc_on,
                    "measured_gib": None,
                    "estimate_gib": round(est.peak_allocated_gib, 4),
                    "estimate_total_gib": round(est.total_gib, 4),
                    "rel_err": None,
                    "components_gib": {k: round(v / GIB, 4) for k, v in est.components.items()},
                }
                if est.total_gib > args.max_gib:
                    rows.append({**row, "status": f"skipped: estimate {est.total_gib:.3g} GiB > {args.max_gib:g}"})
                    continue
                if time.perf_counter() - started > args.time_limit_s:
                    rows.append({**row, "status": f"skipped: time limit {args.time_limit_s:g} s"})
                    continue
                t = time.perf_counter()
                peak = None
                try:
                    peak = step_peak_bytes(
                        loss_fn, model, optimizer, make_batch(config.vocab_size, mb, seq, device), device
                    )
                except torch.cuda.OutOfMemoryError:
                    pass
                if peak is None:  # out of memory: free what the failed step held (outside `except`,
                    optimizer.zero_grad(set_to_none=False)  # whose traceback keeps its tensors alive)
                    gc.collect()
                    torch.cuda.empty_cache()
                    rows.append({**row, "status": "oom"})
                    print(_fmt(rows[-1]), flush=True)
                    save()
                    continue
                measured = peak / GIB
                rows.append(
                    {
                        **row,
                        "status": "ok",
                        "measured_gib": round(measured, 4),
                        "rel_err": round((est.peak_allocated_gib - measured) / measured, 4),
                        "seconds": round(time.perf_counter() - t, 2),
                    }
                )
                print(_fmt(rows[-1]), flush=True)
                save()
    del model, loss_fn, optimizer, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- output ----------------------------------------------------------------------------------

HEADER = f"{'shape':10} {'seq':>5} {'mb':>3} {'gc':>3} {'measured':>9} {'estimate':>9} {'rel_err':>8}  status"


def _fmt(r: dict) -> str:
    m = f"{r['measured_gib']:9.3f}" if r["measured_gib"] is not None else f"{'-':>9}"
    e = f"{r['rel_err']:+8.1%}" if r["rel_err"] is not None else f"{'-':>8}"
    return (
        f"{r['shape']:10} {r['seq_len']:5d} {r['micro_batch_size']:3d}"
        f" {'on' if r['gradient_checkpointing'] else 'off':>3}"
        f" {m} {r['estimate_gib']:9.3f} {e}  {r['status']}"
    )


def device_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (seconds on CPU)")
    ap.add_argument("--dry-run", action="store_true", help="= --device cpu --tiny, results to a temp dir")
    ap.add_argument("--shapes", help="comma-separated subset of " + ", ".join([*SHAPES, *TINY_SHAPES]))
    ap.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--max-gib", type=float, default=130.0, help="skip combinations estimated above this")
    ap.add_argument("--out-dir", type=Path, help="default: bench/results (a temp dir with --dry-run)")
    ap.add_argument(
        "--time-limit-s",
        type=float,
        default=float("inf"),
        help="measure no new combination after this many seconds (the rest: skipped)",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.tiny = "cpu", True
    tiny = args.tiny
    shapes = TINY_SHAPES if tiny else SHAPES
    if args.shapes:
        known = {**SHAPES, **TINY_SHAPES}
        shapes = {n: known[n] for n in args.shapes.split(",")}
    args.seq_lens = args.seq_lens or ([32, 64] if tiny else [512, 2048, 4096])
    args.micro_batches = args.micro_batches or ([1, 2] if tiny else [1, 4, 16])
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --dry-run for the CPU check", file=sys.stderr)
        return 2

    import peft
    import transformers

    started = time.perf_counter()
    today = _dt.date.today().isoformat()
    out_dir = args.out_dir or (
        Path(tempfile.mkdtemp(prefix="rayft-bench-")) if args.dry_run else ROOT / "bench" / "results"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"memory-{today}-{device_slug(device)}.json"
    meta = {
        "date": today,
        "device": device_slug(device),
        "device_total_gib": (
            torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
        ),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cuda": torch.version.cuda,
        "lora_r": args.lora_r,
        "lora_target_modules": TARGETS,
        "dtype": "bf16 base (autocast), fp32 LoRA, AdamW state and gradients resident",
        "measured": "torch.cuda.max_memory_allocated over forward+backward"
        if device.type == "cuda"
        else "CPU live-storage tracker (dry run)",
        "estimate": "MemoryEstimate.peak_allocated_bytes (total minus framework_overhead)",
    }
    rows: list[dict] = []

    def save() -> None:
        meta["wall_s"] = round(time.perf_counter() - started, 1)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        os.replace(tmp, path)

    print(HEADER)
    for name, shape in shapes.items():
        run_shape(name, shape, args, device, rows, save, started)
    save()
    print("\n" + HEADER)
    for r in rows:
        print(_fmt(r))
    ok = [abs(r["rel_err"]) for r in rows if r["rel_err"] is not None]
    if ok:
        print(
            f"\n{len(ok)} measured, |rel_err| max {max(ok):.1%}, mean {sum(ok) / len(ok):.1%}; "
            f"{len(rows) - len(ok)} skipped/oom; {meta['wall_s']}s"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
