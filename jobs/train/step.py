"""One optimizer step: the engine it touches (`Engine`), the window of micro-steps with the
gradient sync only on the last (`train_window`), and the update (`optimizer_step`), with the
learning-rate schedule and the optimizer. Why the loss is scaled by world_size / denominator (the
step does not depend on the split) is the `jobs.train.loop` module doc."""

from __future__ import annotations

import contextlib
import math
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from jobs.objectives.base import to_device
from jobs.spec import JobSpec
from jobs.train import fsdp


@dataclass
class Engine:
    """Everything one optimizer step touches."""

    # the objective's loss module; wrapped in DDP or sharded by FSDP2 (`jobs.train.fsdp`) when world > 1
    module: nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    precision: str
    world_size: int

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    @property
    def is_ddp(self) -> bool:
        return isinstance(self.module, nn.parallel.DistributedDataParallel)

    @property
    def unwrapped(self) -> nn.Module:
        """`module` without DDP's wrapper (held-out passes run it directly: no gradient sync)."""
        m = self.module
        return m.module if isinstance(m, nn.parallel.DistributedDataParallel) else m

    def sync_gate(self, last: bool) -> contextlib.AbstractContextManager:
        """Forward and backward of one micro-step run inside this: gradients are reduced across
        ranks only when `last` (the window's last micro-step); before it each rank accumulates
        its own. DDP decides in forward whether to reduce, so forward must be inside too."""
        if fsdp.is_fsdp(self.module):
            return fsdp.gradient_sync(self.module, last)
        if last or not self.is_ddp:
            return contextlib.nullcontext()
        return cast(nn.parallel.DistributedDataParallel, self.module).no_sync()


def train_window(
    engine: Engine,
    micro_batches: Sequence[dict],
    denominator: int,
    after_micro_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Forward/backward over one rank's micro-batches of one global batch.

    `denominator` is what the step's loss is a mean over, counted over the whole global batch
    (`Objective.count`: label tokens, pairs, ...). Returns this rank's sums (a device tensor: no
    host sync here): the summed loss (a scalar) or, where the loss module also returns statistics,
    the vector [summed loss, *summed statistics in `Objective.stat_names` order] (float64).
    `after_micro_step(j)` is an observer (tests, profilers) called after each backward.
    """
    scale = engine.world_size / denominator  # DDP divides by world_size; see module doc
    sums: torch.Tensor | None = None
    last = len(micro_batches) - 1
    for j, mb in enumerate(micro_batches):
        with engine.sync_gate(j == last):
            with engine.autocast():
                out = engine.module(**to_device(mb, engine.device))
            summed, stats = out if isinstance(out, tuple) else (out, None)
            engine.scaler.scale(summed * scale).backward()
        part = summed.detach().float() if stats is None else torch.cat([summed.detach().double().view(1), stats])
        sums = part if sums is None else sums + part
        if after_micro_step is not None:
            after_micro_step(j)
    return sums if sums is not None else torch.zeros((), device=engine.device)


def optimizer_step(engine: Engine, max_grad_norm: float | None) -> tuple[torch.Tensor, float | None]:
    """Unscale once, clip, step, update. Returns (grad norm tensor, scale before or None)."""
    scale_before = engine.scaler.get_scale() if engine.scaler.is_enabled() else None
    engine.scaler.unscale_(engine.optimizer)  # exactly once per window, before clipping
    grad_norm = fsdp.clip_grad_norm(engine.params, max_grad_norm if max_grad_norm else float("inf"))
    engine.scaler.step(engine.optimizer)  # skips the update if any gradient is inf/nan
    engine.scaler.update()
    engine.optimizer.zero_grad(set_to_none=True)
    return grad_norm, scale_before


def lr_at(step: int, total: int, spec: JobSpec) -> float:
    """The scaled lr for optimizer step `step` (0-based): linear warmup, then cosine or constant."""
    peak = spec.effective_lr
    o = spec.optim
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return peak
    span = max(1, total - o.warmup_steps - 1)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return peak * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(spec: JobSpec, params: list, device: torch.device) -> torch.optim.Optimizer:
    o = spec.optim
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=spec.effective_lr, momentum=o.momentum, weight_decay=o.weight_decay)
    fused = o.fused == "on" or (o.fused == "auto" and device.type == "cuda")
    return torch.optim.AdamW(params, lr=spec.effective_lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_max_rss"
