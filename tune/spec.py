"""The search spec: a job spec plus a `search` section.

Validated exactly like a job spec (`jobs.spec.validate`: pydantic v2, `extra="forbid"`, a
docstring per field, one-line errors that name the field path, exit code 2). Everything
outside `search` is the base job every trial starts from; a trial overrides only the batch
split, the learning rate and its scaling rule, checkpointing and the step/eval cadence.

A trial of a preference objective may also carry its own `objective.beta` (`search.beta`: a
grid dimension beside the batch split and the lr rule), and trials are compared on
`search.metric`: the eval loss (lowest wins) or TRL's held-out preference accuracy
`eval_rewards/accuracies` (highest wins). Eval losses at different beta are not comparable (every
preference loss changes with beta), so a search over several betas must compare on accuracy.

Two modes:

* `fixed_global_batch`: `batch.global_batch_size` stays; each `grad_accum_steps` choice
  derives micro_batch_size = global / (accumulation x workers), which must divide exactly
  (choices that do not are skipped, with the reason). rayft's accumulation is exact, so
  these trials differ in memory and speed, not in the math.
* `fixed_micro_batch`: the micro-batch stays (`search.micro_batch_size` choices, default
  `batch.micro_batch_size`) and the global batch grows with accumulation:
  global = micro x accumulation x workers. `optim.reference_batch_size` is pinned to the
  base job's global batch, so `lr_scaling` (none, linear, sqrt) decides each trial's lr.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from jobs.errors import SpecError
from jobs.spec import Beta, JobSpec, SpecSection, apply_overrides, check_files, read_yaml, validate

Rule = Literal["none", "linear", "sqrt"]
Metric = Literal["eval_loss", "eval_rewards/accuracies"]
# How trials compare on each metric: the lowest eval loss wins, the highest preference accuracy.
METRIC_MODES = {"eval_loss": "min", "eval_rewards/accuracies": "max"}


class _Section(SpecSection):
    """The job spec's guards (`jobs.spec.SpecSection`): no NaN or infinity, no boolean for a number."""


class LrRange(_Section):
    low: float = Field(gt=0)
    """Smallest base learning rate (at `optim.reference_batch_size`); sampled log-uniformly."""
    high: float = Field(gt=0)
    """Largest base learning rate; equal to `low` means a fixed learning rate."""

    @model_validator(mode="after")
    def _ordered(self) -> LrRange:
        if self.high < self.low:
            raise ValueError(f"search.lr.high={self.high:g} is below search.lr.low={self.low:g}")
        return self


class AshaSpec(_Section):
    reduction_factor: int = Field(2, ge=2)
    """ASHA keeps the best 1/reduction_factor of the trials at each rung; rungs sit at
    grace_samples x reduction_factor^k samples (an integer, so rungs fall on report points)."""
    grace_samples: int | None = Field(None, gt=0)
    """Training samples every trial sees before ASHA may stop it; default `search.eval_every_samples`.
    Must be a multiple of `search.eval_every_samples` (rungs sit where every trial reports)."""


class SearchSection(_Section):
    mode: Literal["fixed_global_batch", "fixed_micro_batch"] = "fixed_global_batch"
    """`fixed_global_batch`: micro-batch derived = global / (accumulation x workers); `fixed_micro_batch`:
    global batch = micro x accumulation x workers grows with accumulation, the lr rule then matters."""
    grad_accum_steps: list[int]
    """Accumulation steps to try."""
    micro_batch_size: list[int] | None = None
    """`fixed_micro_batch` only: micro-batch sizes to try (default: `batch.micro_batch_size`)."""
    lr_scaling: list[Rule] = Field(default_factory=lambda: list[Rule](["none"]))
    """LR scaling rules to try: lr = base x f(global / reference) with f = 1 (`none`), x (`linear`), sqrt(x)."""
    lr: LrRange | None = None
    """Base learning-rate range, sampled log-uniformly; default: `optim.lr`, fixed."""
    num_samples: int = Field(1, gt=0)
    """Learning rates sampled per (micro-batch, accumulation, rule) point."""
    budget_gib: float | None = Field(None, gt=0)
    """Per-device memory budget in GiB (default `memory.budget_gib`). Configurations whose estimate
    (jobs.memory, for the device the trials run on) exceeds it are never launched."""
    samples_per_trial: int = Field(gt=0)
    """Training samples (sequences) every trial sees: the equal token budget. max_steps = this / global batch."""
    eval_every_samples: int | None = Field(None, gt=0)
    """Evaluate and report every N training samples; default: the least common multiple of the searched
    global batches, so every trial reports at the same sample counts."""
    scheduler: Literal["asha", "fifo"] = "asha"
    """`asha`: stop trials early on `search.metric` at equal samples seen; `fifo`: run every trial to the end."""
    asha: AshaSpec = Field(default_factory=AshaSpec)
    """ASHA settings (time attribute: training samples seen)."""
    max_concurrent_trials: int | None = Field(None, gt=0)
    """Trials at once; default (and upper bound): what the cluster holds, each trial taking one CPU for
    the trial function plus its workers' CPUs (and GPUs)."""
    seed: int | None = None
    """Seed of the learning-rate sampler; default `run.seed`."""
    beta: list[Beta] | None = None  # each within objective.beta's own bounds (`jobs.spec.Beta`)
    """Preference objectives with a beta (dpo, ipo, simpo, orpo) only: `objective.beta` values to try, a grid
    dimension beside accumulation and the lr rule (default: the base job's `objective.beta`). More than
    one needs `search.metric: eval_rewards/accuracies` (eval losses at different beta are not comparable)."""
    metric: Metric = "eval_loss"
    """What trials are compared on (ASHA's rungs and the best trial): `eval_loss` (lowest wins) or, for a
    preference objective, TRL's `eval_rewards/accuracies`, the held-out fraction of pairs whose chosen
    response gets the higher reward (highest wins; it does not depend on beta)."""

    @field_validator("grad_accum_steps", "micro_batch_size")
    @classmethod
    def _positive_unique(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must list at least one value")
        bad = [x for x in v if x < 1]
        if bad:
            raise ValueError(f"values must be >= 1 (got {bad[0]})")
        if len(set(v)) != len(v):
            raise ValueError(f"values must be unique (got {v})")
        return v

    @field_validator("beta")
    @classmethod
    def _betas(cls, v: list[float] | None) -> list[float] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must list at least one value")
        if len(set(v)) != len(v):
            raise ValueError(f"values must be unique (got {v})")
        return v

    @property
    def mode_of_metric(self) -> str:
        """ "min" or "max": how trials compare on `metric`."""
        return METRIC_MODES[self.metric]

    @field_validator("lr_scaling")
    @classmethod
    def _rules(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must list at least one rule (none, linear, sqrt)")
        if len(set(v)) != len(v):
            raise ValueError(f"rules must be unique (got {v})")
        return v


class SearchSpec(JobSpec):
    """A rayft search: the base job (every JobSpec field) plus `search`."""

    search: SearchSection
    """What to search and under which memory budget (see tune/spec.py)."""

    @model_validator(mode="after")
    def _search_consistent(self) -> SearchSpec:
        s = self.search
        if s.budget_gib is None and self.memory.budget_gib is None:
            raise ValueError(
                "search.budget_gib: required (or set memory.budget_gib): the search only launches "
                "configurations whose memory estimate fits the budget"
            )
        if s.micro_batch_size is not None and s.mode != "fixed_micro_batch":
            raise ValueError(
                "search.micro_batch_size: only for search.mode=fixed_micro_batch (in fixed_global_batch "
                "mode the micro-batch is derived: global / (accumulation x workers))"
            )
        held_out = self.data.eval_path or any(src.eval_path for src in self.data.mix or [])
        if not held_out and self.data.eval_fraction <= 0:
            raise ValueError(
                "data.eval_path: the search compares trials on eval loss: set data.eval_path or data.eval_fraction"
            )
        if self.run.epochs is not None or self.run.max_steps is not None:
            raise ValueError(
                "run.max_steps: not used by a search (every trial runs search.samples_per_trial "
                "samples); remove run.max_steps / run.epochs"
            )
        self._objective_consistent()
        g = s.asha.grace_samples
        if g is not None and s.eval_every_samples is not None and g % s.eval_every_samples:
            raise ValueError(
                f"search.asha.grace_samples={g} is not a multiple of search.eval_every_samples={s.eval_every_samples}"
            )
        if s.eval_every_samples is not None and s.samples_per_trial % s.eval_every_samples:
            raise ValueError(
                f"search.samples_per_trial={s.samples_per_trial} is not a multiple of "
                f"search.eval_every_samples={s.eval_every_samples}"
            )
        return self

    def _objective_consistent(self) -> None:
        """`search.beta` and `search.metric` against the base job's objective."""
        s, obj = self.search, self.objective
        if s.beta is not None and obj.value("beta") is None:
            raise ValueError(
                f"search.beta: objective.name={obj.name} has no beta (search it with dpo, ipo, simpo or orpo)"
            )
        if s.metric != "eval_loss" and not obj.is_preference:
            raise ValueError(
                f"search.metric={s.metric}: only for preference objectives (objective.name={obj.name} "
                "reports eval_loss)"
            )
        if s.beta is not None and len(s.beta) > 1 and s.metric == "eval_loss":
            raise ValueError(
                "search.beta: eval losses at different beta are not comparable (the preference loss "
                "changes with beta); compare the trials on search.metric=eval_rewards/accuracies"
            )

    @property
    def budget(self) -> float:
        budget = self.search.budget_gib if self.search.budget_gib is not None else self.memory.budget_gib
        assert budget is not None  # the validator requires one of the two
        return float(budget)

    def job_dict(self) -> dict:
        """The base job spec as plain data: everything but `search`."""
        d = self.model_dump(mode="json")
        d.pop("search", None)
        return d

    def job(self) -> JobSpec:
        return JobSpec.model_validate(self.job_dict())


def load_search_spec(
    path=None, overrides: list[str] | None = None, *, data: dict | None = None, files: bool = True
) -> SearchSpec:
    """Read, override (`search.lr.low=1e-4` works like any override), validate, check files."""
    where = str(path) if path is not None else "spec"
    raw = read_yaml(path) if data is None else data
    raw = apply_overrides(raw, overrides or [])
    if "search" not in raw:
        raise SpecError(
            f"{where}: search: required key is missing (a search spec is a job spec plus a "
            "`search` section; see examples/tune-accum.yaml)"
        )
    spec = validate(raw, where, model=SearchSpec)
    if files:
        check_files(spec, where)
    return spec


__all__ = ["SearchSpec", "SearchSection", "LrRange", "AshaSpec", "load_search_spec", "Rule", "Metric", "METRIC_MODES"]
