"""The one interface every training objective implements, and the resolution of a spec's
`objective` section into one (`Objective.of`).

What the loop relies on, whatever the objective (`jobs.train.loop` module doc):

* The objective builds each step's window (`plan_window`, host work the loop may run one step
  ahead; `with_rollouts`, in the training thread, where an online objective samples its
  completions) and says what the step's loss is a mean over (`Window.denominator`: label tokens
  for SFT, pairs for a preference objective, completion tokens or completions for GRPO), counted
  over the whole global batch. A dataset objective (`DatasetObjective`) draws step k's samples
  from the data by a sampler that does not depend on the split and only collates them (`batch`).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import nn

from jobs.data import (
    batches_for,
    check_every_source_sampled,
    count_inputs,
    count_labels,
    equal_micro_batches,
    group_by_length,
    load_dataset,
    split_window,
    step_metrics,
    total_steps,
)

if TYPE_CHECKING:
    from jobs.spec import JobSpec


@dataclass
class Window:
    """One rank's share of one global batch, and the counts over the whole global batch (known
    locally for a dataset objective: every rank holds the tokenized data; all-reduced after the
    rollouts for an online one)."""

    micro_batches: list  # this rank's micro-batches: the loss module's keyword tensors (collated)
    denominator: int  # what the step's loss is a mean over: label tokens (SFT), pairs, ...
    n_labels: int  # label tokens (for pairs: the tokens of both responses; online: completion tokens)
    n_inputs: int  # input tokens computed
    metrics: dict[str, float] = field(default_factory=dict)  # the step record's extra values: a
    # mixture's per-source counts (`step_metrics`), an online objective's rollout metrics; {} else


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
    def of(cls, spec: JobSpec) -> Objective:
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
    def plot_labels(self, spec: JobSpec) -> dict[str, str]:
        """`jobs.run.outputs.plot_loss`'s title and axis labels for this objective's loss curve."""

    def prepare(self, spec: JobSpec, ctx, job, engine) -> None:  # noqa: B027 (most objectives prepare nothing)
        """Before the first step, on every rank, once the engine exists (a precomputed reference)."""

    def step_values(self, sums: torch.Tensor, denominator: int) -> tuple[float, dict]:
        """(the step's loss, its statistics as means) from the window's all-reduced sums: one host read."""
        values = sums.reshape(-1).tolist()
        stats = {k: v / denominator for k, v in zip(self.stat_names, values[1:], strict=True)}
        return values[0] / denominator, stats

    # ---- where a step's samples come from -----------------------------------------------------

    @abstractmethod
    def check_records(self, spec: JobSpec) -> None:
        """On the driver, before anything is created: every record of the data checked for the
        kind this objective trains on, and enough of them for one step (one line otherwise)."""

    def preview(self, spec: JobSpec, tokenizer, n: int) -> dict:
        """`rayft data preview`'s document: the first `n` training samples as the model sees them
        and both splits' statistics (`jobs.data.preview`); read-only."""
        from jobs.data.preview import data_preview

        return data_preview(spec, tokenizer, n)

    @abstractmethod
    def build_data(self, spec: JobSpec, tokenizer) -> None:
        """On the driver, after the output directory is checked: the data tokenized where that can
        refuse it (a refusal is one line, and nothing is left half-written)."""

    @abstractmethod
    def load_data(self, spec: JobSpec, tokenizer) -> tuple[Any, Any, int]:
        """On every rank: (the data, the global-batch sampler, the run's optimizer steps)."""

    @abstractmethod
    def plan_window(self, spec: JobSpec, ctx, job, step: int) -> Window:
        """This rank's share of global batch `step`, from host data only: a pure function of the
        step, so the loop may build it one step ahead on a background thread."""

    def with_rollouts(self, spec: JobSpec, ctx, job, engine, step: int, window: Window) -> Window:
        """The window as the step trains it, in the training thread with the model as it is now:
        an online objective samples and scores its completions here; the others train what
        `plan_window` built."""
        return window

    def checkpoint_files(self, rank: int) -> dict[str, Any]:
        """Files of this objective's own state that rank `rank` adds to a checkpoint (GRPO: a rollout
        batch trained on again at the next steps); most objectives keep none."""
        return {}

    def restored(self, directory: Path) -> None:  # noqa: B027 (most objectives keep no state)
        """After the loop restored checkpoint `directory`: take back what `checkpoint_files` wrote."""

    def release(self) -> None:  # noqa: B027 (most objectives hold nothing outside the process)
        """When `train()` returns or raises, on every rank: what the objective started for the run
        and that outlives it otherwise (GRPO: the vLLM server rayft started) is let go."""

    @abstractmethod
    def held_out(self, engine, job, spec: JobSpec, ctx) -> tuple[float | None, dict]:
        """The held-out loss and its statistics (`eval_` in front); (None, {}) without held-out
        samples. Every rank runs the same number of forwards (under FSDP each is a collective)."""


class DatasetObjective(Objective):
    """An objective whose samples are records of the data set, tokenized once into the shared
    cache (`jobs.data.load_dataset`): SFT and the preference objectives. Step k's samples are
    `jobs.data.GlobalBatches` (or a mixture's) k-th global batch, independent of the split."""

    @abstractmethod
    def batch(
        self, spec, job, split: str, indices: Sequence[int] | np.ndarray, device: torch.device, pin: bool
    ) -> dict:
        """The collated host tensors of the samples `indices` of `split` ("train" or "eval")."""

    @abstractmethod
    def count(self, samples, indices: Sequence[int] | np.ndarray) -> int:
        """What a loss over the samples `indices` is a mean over (label tokens, pairs, ...)."""

    def check_records(self, spec: JobSpec) -> None:
        from jobs.data import count_checked_records
        from jobs.errors import SpecError

        n_train = count_checked_records(spec)
        if n_train < spec.batch.global_batch_size:  # tokenizing can only drop records, never add any
            key = "data.mix" if spec.is_mixture else "data.path"
            raise SpecError(
                f"{key}: {n_train} training records, fewer than batch.global_batch_size={spec.batch.global_batch_size}"
            )

    def build_data(self, spec: JobSpec, tokenizer) -> None:
        # The whole of `load_data`: what the sampler refuses (a mixture source that never gets a
        # sample) is refused here, on the driver, before the output directory is created.
        self.load_data(spec, tokenizer)

    def load_data(self, spec: JobSpec, tokenizer) -> tuple[Any, Any, int]:
        data = load_dataset(spec, tokenizer)
        batches, steps = batches_for(spec, data), total_steps(spec, len(data.train))
        check_every_source_sampled(batches, data.sources, steps)
        return data, batches, steps

    def plan_window(self, spec: JobSpec, ctx, job, step: int) -> Window:
        """This rank's micro-batches of global batch `step`, with the window's counts: numpy over
        the cache's per-sample arrays and array copies from its tokens (`jobs.data.batches`)."""
        indices = job.batches.index_array(step)
        train = job.data.train
        if spec.data.group_by_length:
            # Same samples, grouped so each micro-batch pads little (measured on the demo data:
            # 48% of computed tokens were padding, 11% grouped).
            indices = group_by_length(train, indices)  # a Pair: by its longer row
        mine = split_window(indices, ctx.rank, ctx.world_size, spec.batch.micro_batch_size, spec.grad_accum_steps)
        n_labels, n_inputs = count_labels(train, indices), count_inputs(train, indices)
        per_source = step_metrics(job.batches, job.data, step, indices)
        pin = ctx.device.type == "cuda"
        micro = [self.batch(spec, job, "train", mb, ctx.device, pin) for mb in mine]
        return Window(micro, self.count(train, indices), n_labels, n_inputs, per_source)

    @torch.no_grad()
    def held_out(self, engine, job, spec: JobSpec, ctx) -> tuple[float | None, dict]:
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
