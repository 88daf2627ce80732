"""The one interface every training objective implements, and the resolution of a spec's
`objective` section into one (`Objective.of`).

What the loop relies on, whatever the objective (`jobs.train.loop` module doc):

* The samples of optimizer step k are chosen by the loop (`jobs.train.loop.micro_batches_of`); the
  objective only collates them (`batch`) and says what the step's loss is a mean over (`count`:
  label tokens for SFT, pairs for a preference objective), counted over the whole global batch.
* The loss module's output for one micro-batch is a *sum* over that unit: a scalar, or
  (summed loss, float64 vector of summed statistics in `stat_names` order). The loop scales it by
  world_size / count, so the step is independent of workers x accumulation x micro-batch.
* `held_out` runs the same number of forwards on every rank (under FSDP each is a collective) and
  one all-reduce.

An objective is one module (this interface) plus one spec class (`jobs.spec`), which lists its
settings, their defaults and their documentation once; the module names the spec classes it
implements (`specs`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import nn

from jobs.data import equal_micro_batches


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def all_reduce_sum(t: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(t)
    return t


def summed(out: Any) -> torch.Tensor:
    """A loss module's output as one float64 vector: [summed loss, *summed statistics]."""
    if isinstance(out, tuple):
        return torch.cat([out[0].double().view(1), out[1]])
    return out.double().view(1)


class Objective(ABC):
    """A training objective: what differs between SFT, the preference objectives and the next.

    `Objective(name, *settings)` builds the implementation registered for `name` (as
    `pathlib.Path()` builds a `PosixPath`), `Objective()` the SFT one; `Objective.of(spec)` the
    one a spec's `objective` section describes, its values resolved (defaults applied)."""

    specs: ClassVar[tuple[type[BaseModel], ...]] = ()  # the `jobs.spec` objective classes this implements
    _by_name: ClassVar[dict[str, type[Objective]]] = {}
    name: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for spec_class in cls.specs:
            Objective._by_name[spec_class.model_fields["name"].default] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> Objective:
        if cls is Objective:
            name = args[0] if args else kwargs.get("name", "sft")
            if name not in Objective._by_name:
                raise ValueError(f"no objective named {name!r} (known: {', '.join(Objective._by_name)})")
            cls = Objective._by_name[name]
        return super().__new__(cls)

    @classmethod
    def of(cls, spec) -> Objective:
        """The objective `spec.objective` describes, with the values it trains with."""
        section = spec.objective
        return Objective._by_name[section.name].from_section(section)

    @classmethod
    @abstractmethod
    def from_section(cls, section) -> Objective:
        """This objective from its validated spec section."""

    # ---- what the loop asks ---------------------------------------------------------------------

    @property
    def stat_names(self) -> tuple[str, ...]:
        """The statistics the loss module sums per micro-batch, after the loss, in this order."""
        return ()

    @property
    def unit(self) -> str:
        """What `batch.global_batch_size` counts, as the start line words it after the number."""
        return ""

    @abstractmethod
    def loss_module(self, model: nn.Module, chunk_tokens: int, compiled_head: bool) -> nn.Module:
        """The module one micro-step calls on a `batch`: its summed loss (see module doc). With
        `compiled_head`, the LM head and loss may run as one compiled graph (`model.compile`)."""

    @abstractmethod
    def batch(
        self, spec, job, split: str, indices: Sequence[int] | np.ndarray, device: torch.device, pin: bool
    ) -> dict:
        """The collated host tensors of the samples `indices` of `split` ("train" or "eval")."""

    @abstractmethod
    def count(self, samples, indices: Sequence[int] | np.ndarray) -> int:
        """What a loss over the samples `indices` is a mean over (label tokens, pairs, ...)."""

    @abstractmethod
    def plot_labels(self, spec) -> dict[str, str]:
        """`jobs.run.outputs.plot_loss`'s title and axis labels for this objective's loss curve."""

    def prepare(self, spec, ctx, job, engine) -> None:  # noqa: B027 (most objectives prepare nothing)
        """Before the first step, on every rank, once the engine exists (a precomputed reference)."""

    def step_values(self, sums: torch.Tensor, denominator: int) -> tuple[float, dict]:
        """(the step's loss, its statistics as means) from the window's all-reduced sums: one host read."""
        values = sums.reshape(-1).tolist()
        stats = {k: v / denominator for k, v in zip(self.stat_names, values[1:], strict=True)}
        return values[0] / denominator, stats

    @torch.no_grad()
    def held_out(self, engine, job, spec, ctx) -> tuple[float | None, dict]:
        """The held-out loss (a mean over `count`'s unit) and its statistics (`eval_` in front),
        sharded over ranks; for a mixture also per source with a held-out split (`eval_loss/NAME`),
        from the same sums. (None, {}) without held-out samples."""
        parts = held_out_parts(job)
        if not parts:
            return None, {}
        module = engine.unwrapped
        sums = torch.zeros(len(parts), 2 + len(self.stat_names), device=engine.device, dtype=torch.float64)
        module.eval()
        for row, (_, offset, n) in enumerate(parts):
            for idx, counted in equal_micro_batches(n, ctx.rank, ctx.world_size, spec.batch.micro_batch_size):
                at = offset + np.asarray(idx, dtype=np.int64)  # into the sources side by side
                with engine.autocast():
                    got = summed(
                        module(**to_device(self.batch(spec, job, "eval", at, engine.device, False), engine.device))
                    )
                if counted:
                    sums[row, :-1] += got
                    sums[row, -1] += self.count(job.data.eval, at)
        module.train()
        totals = all_reduce_sum(sums, ctx.world_size).tolist()
        whole = [sum(col) for col in zip(*totals, strict=True)]
        out = {f"eval_loss/{name}": t[0] / t[-1] for (name, _, _), t in zip(parts, totals, strict=True) if name}
        out.update({f"eval_{k}": v / whole[-1] for k, v in zip(self.stat_names, whole[1:-1], strict=True)})
        return whole[0] / whole[-1], out


def held_out_parts(job) -> list[tuple[str | None, int, int]]:
    """(source name, offset, count) of each held-out part: a mixture's sources with a held-out
    split, by name, else the whole held-out split, unnamed; [] without held-out samples."""
    if job.data.sources:
        return [(p.name, p.eval_offset, p.n_eval) for p in job.data.sources if p.n_eval]
    n = len(job.data.eval)
    return [(None, 0, n)] if n else []
