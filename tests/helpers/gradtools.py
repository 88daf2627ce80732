"""Shared pieces for the gradient-accumulation oracles (importable by spawned ranks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from jobs.data import GlobalBatches, collate, count_labels, load_dataset, split_window
from jobs.model.loading import add_lora, enable_checkpointing, load_base_model
from jobs.spec import JobSpec, absolutize, load_spec
from jobs.train.loop import CausalLMLoss
from jobs.train.step import Engine, make_optimizer, optimizer_step, train_window

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "tiny.jsonl"
DEMO = "examples/tiny-lora.yaml"
# The Ray runs that lose a worker, a node or their driver: 8 steps, a checkpoint every 2, a global
# batch of 8 (2 workers x micro-batch 2 x 2 accumulation steps: DDP and accumulation both stay in
# play at a quarter of the demo's compute; what these tests check is the resume, not the batch).
RAY_STEPS = [
    "run.max_steps=8",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=4",
    "run.eval_every=0",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
]


def tiny_spec(*overrides: str, **sections) -> JobSpec:
    data = {
        "name": "t",
        "data": {"path": str(DATA), "max_seq_len": 96},
        "lora": {"r": 4, "alpha": 8},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2},
        "run": {"max_steps": 2},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v) if isinstance(v, dict) else data.__setitem__(k, v)
    return load_spec(data=data, overrides=list(overrides))


def perturb_lora_b(model: nn.Module) -> nn.Module:
    """LoRA's B moved off zero (seeded), so every LoRA parameter gets a gradient."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(99)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def build_engine(
    spec: JobSpec, *, world_size: int = 1, gc: bool = False, precision: str = "fp32", optimizer: bool = True
) -> tuple[Engine, nn.Module, object]:
    """Model + LoRA with B perturbed away from zero, so every LoRA parameter gets a gradient."""
    model, tok = load_base_model(spec, precision)
    model = perturb_lora_b(add_lora(model, spec, precision))
    if gc:
        enable_checkpointing(model)
    model.train()
    module: nn.Module = CausalLMLoss(model)
    if world_size > 1:
        module = nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(spec, params, torch.device("cpu")) if optimizer else torch.optim.SGD(params, lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    return Engine(module, params, opt, scaler, torch.device("cpu"), precision, world_size), model, tok


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def rel_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def final_adapter(out: Path) -> dict[str, torch.Tensor]:
    """The LoRA weights of a run's newest complete checkpoint."""
    from jobs.run.checkpoint import load_adapter, newest_complete

    return load_adapter(newest_complete(Path(out) / "checkpoints"))


def window_inputs(spec: JobSpec, tok, rank: int, world: int, step: int = 0):
    data = load_dataset(spec, tok)
    idx = GlobalBatches(len(data.train), spec.batch.global_batch_size, spec.run.seed).indices(step)
    mine = split_window(idx, rank, world, spec.batch.micro_batch_size, spec.grad_accum_steps)
    layout = {"pack_tokens": spec.data.max_seq_len} if spec.data.packing else {}
    mbs = [collate([data.train[i] for i in mb], tok.pad_token_id, **layout) for mb in mine]
    return mbs, count_labels(data.train, idx), idx, data


def reference_grads(spec: JobSpec, *, gc: bool = False, precision: str = "fp32") -> dict[str, torch.Tensor]:
    """The whole global batch as one piece on one process: sum of token losses / tokens."""
    one = spec.model_copy(deep=True)
    engine, model, tok = build_engine(one, gc=gc, precision=precision)
    _, n_labels, idx, data = window_inputs(spec, tok, 0, spec.resources.num_workers)
    batch = collate([data.train[i] for i in idx], tok.pad_token_id)
    with engine.autocast():
        loss = engine.module(**batch)
    (loss / n_labels).backward()
    return grads(model)


# ---- multi-process helpers (gloo on CPU) --------------------------------------------------


def spawn(fn: Callable, world_size: int, tmp: Path, *args) -> list:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks (separate processes, the
    session's persistent pool of that size: tests/helpers/gloo_pool.py); returns each rank's result."""
    from gloo_pool import run_on_ranks

    return run_on_ranks(fn, world_size, tmp, *args)


def reference_run(rank: int, world: int, spec_path: str, overrides: list, out: str) -> None:
    """An uninterrupted run of the same split, without Ray (one process per rank)."""
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    spec = absolutize(load_spec(spec_path, overrides + [f"run.output_dir={out}"]))
    train(spec, LocalContext(on_progress=lambda r: None), resume=False)


def accumulated_grads(rank: int, world: int, overrides: tuple, gc: bool, precision: str):
    """One window through `train_window` (DDP when world > 1); returns this rank's grads."""
    spec = tiny_spec(*overrides)
    engine, model, tok = build_engine(spec, world_size=world, gc=gc, precision=precision)
    mbs, n_labels, _, _ = window_inputs(spec, tok, rank, world)
    train_window(engine, mbs, n_labels)
    if engine.scaler.is_enabled():
        engine.scaler.unscale_(engine.optimizer)
    return grads(model)


def sgd_update(rank: int, world: int, overrides: tuple, precision: str):
    """One full optimizer step with SGD(lr=1), no clipping: -delta(param) is the gradient used."""
    spec = tiny_spec(*overrides, "optim.name=sgd", "optim.lr=1.0", "optim.max_grad_norm=0")
    engine, model, tok = build_engine(spec, world_size=world, precision=precision)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    mbs, n_labels, _, _ = window_inputs(spec, tok, rank, world)
    train_window(engine, mbs, n_labels)
    _, scale_before = optimizer_step(engine, None)
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {n: before[n] - after[n] for n in before}, scale_before
