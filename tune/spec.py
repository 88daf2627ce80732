"""The search spec: a job spec plus a `search` section.

Validated exactly like a job spec (`jobs.spec.validate`: pydantic v2, `extra="forbid"`, a
docstring per field, one-line errors that name the field path, exit code 2). Everything
outside `search` is the base job every trial starts from; a trial overrides only the batch
split, the learning rate and its scaling rule, checkpointing and the step/eval cadence.

A trial of a preference objective or of `grpo` may also carry its own `objective.beta`
(`search.beta`: a grid dimension beside the batch split and the lr rule), a `grpo` trial its own
`rollout.num_generations` (`search.num_generations`), and trials are compared on `search.metric`,
a held-out number the objective reports (default: the objective's own): the eval loss (lowest
wins), TRL's held-out preference accuracy `eval_rewards/accuracies` (highest wins), or GRPO's
held-out mean reward `eval_reward` (highest wins). Eval losses at different beta are not comparable
(every preference loss changes with beta), so a search over several betas must compare on accuracy.

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

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from jobs.errors import SpecError
from jobs.spec import JobSpec, SpecSection, apply_overrides, check_files, read_yaml, rewards_beside, validate

Rule = Literal["none", "linear", "sqrt"]
Metric = Literal["eval_loss", "eval_rewards/accuracies", "eval_reward"]
# How trials compare on each metric: the lowest eval loss wins, the highest preference accuracy,
# the highest held-out mean reward (GRPO).
METRIC_MODES = {"eval_loss": "min", "eval_rewards/accuracies": "max", "eval_reward": "max"}


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
    upload_every_s: float = Field(60.0, gt=0, le=86_400)
    """A search whose `run.output_dir` is a bucket: seconds between uploads, while it runs, of what
    changed in its staging directory (the trials' checkpoints and metrics, Tune's state), so a search
    killed outright leaves the bucket at most this far behind; results.json is written once, last,
    when the search returns."""
    max_concurrent_trials: int | None = Field(None, gt=0)
    """Trials at once; default (and upper bound): what the cluster holds, each trial taking one CPU for
    the trial function plus its workers' CPUs (and GPUs)."""
    seed: int | None = None
    """Seed of the learning-rate sampler; default `run.seed`."""
    beta: list[float] | None = None  # each within objective.beta's own bounds (checked by SearchSpec)
    """Objectives with a beta (dpo, ipo, simpo, orpo: > 0; grpo: the KL coefficient, >= 0, 0 = no
    reference forward): `objective.beta` values to try, a grid dimension beside accumulation and the lr
    rule (default: the base job's `objective.beta`). For a preference objective more than one needs
    `search.metric: eval_rewards/accuracies` (eval losses at different beta are not comparable)."""
    num_generations: list[int] | None = None  # each within rollout.num_generations' bounds (>= 2)
    """`grpo` only: `rollout.num_generations` values to try (completions per prompt), a grid dimension
    beside beta; a value that does not divide a point's global batch (completions) skips that point,
    saying why (default: the base job's `rollout.num_generations`)."""
    metric: Metric | None = None
    """What trials are compared on (ASHA's rungs and the best trial), a held-out number the objective
    reports; default the objective's own: `eval_loss` (lowest wins) for sft and the preference objectives,
    `eval_reward` (GRPO's held-out mean reward of one greedy completion per prompt, highest wins) for
    grpo. A preference objective may compare on TRL's `eval_rewards/accuracies`, the held-out fraction of
    pairs whose chosen response gets the higher reward (highest wins; it does not depend on beta)."""

    @field_validator("grad_accum_steps", "micro_batch_size", "num_generations")
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
        return METRIC_MODES[self.metric_name]

    @property
    def metric_name(self) -> str:
        """`metric`, resolved (SearchSpec sets the objective's own where it was left out)."""
        return self.metric or "eval_loss"

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
                "data.eval_path: the search compares trials on held-out data: set data.eval_path or data.eval_fraction"
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
        """`search.beta`, `search.num_generations` and `search.metric` against the base job's objective."""
        s, obj = self.search, self.objective
        if s.metric is None:  # the objective's own held-out metric; dumped resolved (the resume fingerprint)
            object.__setattr__(s, "metric", obj.held_out_metric)
        if s.metric not in obj.held_out_metrics:
            raise ValueError(
                f"search.metric={s.metric}: objective.name={obj.name} reports "
                f"{' or '.join(obj.held_out_metrics)} on held-out data"
            )
        self._betas_apply()
        self._generations_apply()

    def _betas_apply(self) -> None:
        """`search.beta`: the objective takes a beta, each value within its bounds, comparable metric."""
        s, obj = self.search, self.objective
        if s.beta is None:
            return
        if obj.value("beta") is None:
            raise ValueError(
                f"search.beta: objective.name={obj.name} has no beta (search it with dpo, ipo, simpo, orpo or grpo)"
            )
        _each_valid(obj, "beta", s.beta, "search.beta")
        if len(s.beta) > 1 and s.metric == "eval_loss":
            raise ValueError(
                "search.beta: eval losses at different beta are not comparable (the preference loss "
                "changes with beta); compare the trials on search.metric=eval_rewards/accuracies"
            )

    def _generations_apply(self) -> None:
        """`search.num_generations`: grpo only, each value a valid `rollout.num_generations`."""
        s = self.search
        if s.num_generations is None:
            return
        if self.rollout is None:
            raise ValueError(
                f"search.num_generations: objective.name={self.objective.name} samples no completions "
                "(search it with grpo)"
            )
        _each_valid(self.rollout, "num_generations", s.num_generations, "search.num_generations")

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


def _each_valid(section: BaseModel, key: str, values: list, path: str) -> None:
    """Each of `values` as `section`'s `key` passes that section's own validation (its bounds), or one
    ValueError naming `path.i`."""
    for i, v in enumerate(values):
        try:
            type(section).model_validate(section.model_dump() | {key: v})
        except ValidationError as e:
            raise ValueError(f"{path}.{i}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None


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
    if path is not None:  # a reward file `FILE.py:NAME` is beside the spec file, as for a job spec
        spec = rewards_beside(spec, Path(path).parent)
    if files:
        check_files(spec, where)
    return spec


__all__ = ["SearchSpec", "SearchSection", "LrRange", "AshaSpec", "load_search_spec", "Rule", "Metric", "METRIC_MODES"]
