"""The objective section: a union tagged by `objective.name`, one class per objective with only its
own keys and real defaults (adding an objective means adding a class here and a module in
`jobs/objectives/`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from jobs.spec.fields import SpecSection
from jobs.spec.sections import Beta


class _ObjectiveSection(SpecSection):
    """What every objective's spec class shares. Each one lists its own settings, with their
    defaults and documentation, once: the loop's objective (`jobs.objectives`), the resume key
    (`jobs.run.checkpoint.resume_key`) and the JSON schema read them from here."""

    records: ClassVar[str] = "sft"
    """The kind of record it trains on: `jobs.data.records`' SFT ("sft") or PAIRS ("pairs"), or
    "prompts" (online RL: the completions are sampled, `jobs.data.prompts`)."""
    resume_free: ClassVar[tuple[str, ...]] = ()
    """Settings that change how a step is computed, not what: a resume may change them."""
    resolves: ClassVar[dict[str, str]] = {}
    """A setting whose default is another setting's value (`epsilon_high`: `epsilon`), by the name
    of the property that resolves it: the resume key stores what the run trains with, so a default
    written out explicitly is the same run."""
    held_out_metrics: ClassVar[dict[str, str]] = {"eval_loss": "min"}
    """The held-out numbers its evaluation reports (metrics.jsonl, summary.json), each with how a
    better value compares ("min": lower is better, "max": higher); the first is the one early
    stopping judges and a search compares on unless told otherwise."""

    @model_validator(mode="before")
    @classmethod
    def _keys_apply(cls, data: Any) -> Any:
        """A key another objective takes is refused naming the keys this one takes (an unknown
        key is refused by `extra="forbid"`)."""
        if isinstance(data, dict):
            taken = {k for c in OBJECTIVE_CLASSES for k in c.model_fields}
            for key in data:
                if key not in cls.model_fields and key in taken:
                    takes = ", ".join(k for k in cls.model_fields if k != "name") or "no other key"
                    name = cls.model_fields["name"].default
                    raise ValueError(f"{key} does not apply to objective.name={name} (it takes {takes})")
        return data

    def value(self, key: str) -> Any:
        """`key` as the objective trains with it; None where this objective does not take it."""
        return getattr(self, key) if key in type(self).model_fields else None

    def resolved(self, key: str) -> Any:
        """The setting `key` as the run trains with it: its `resolves` property where it has one."""
        return getattr(self, self.resolves.get(key, key))

    @property
    def held_out_metric(self) -> str:
        """The held-out number early stopping judges and a search compares on by default."""
        return next(iter(self.held_out_metrics))

    @property
    def is_preference(self) -> bool:
        """It trains on preference pairs (`batch.*` counts pairs)."""
        return self.records == "pairs"

    @property
    def has_reference(self) -> bool:
        """The loss compares the policy with a reference: the starting adapter `model.adapter`
        held frozen a second time (`jobs.model.loading.start_from_adapter`), else the base."""
        return "reference" in type(self).model_fields

    def memory_terms(self, adapter: bool) -> dict:
        """What it changes in the memory estimate (`jobs.memory.spec_estimate.spec_objective`):
        a micro-batch of pairs is two rows each; a reference forward (`reference: adapter_off`),
        with `model.adapter` (`adapter`) against the starting adapter held frozen a second time."""
        reference = self.value("reference")
        return {
            "pairs": self.is_preference,
            "reference": reference,
            "reference_adapter": adapter and reference == "adapter_off",
        }


class SFTObjective(_ObjectiveSection):
    name: Literal["sft"] = "sft"
    """`sft` (the default): next-token loss on the labelled tokens, a mean over the label tokens of
    the global batch. The other names train on `{prompt, chosen, rejected}` pairs (`batch.*` then
    counts pairs): `dpo`, `ipo` (against a reference), `simpo`, `orpo` (reference-free). Formulas
    in docs/training.md."""


class _PairObjective(_ObjectiveSection):
    records: ClassVar[str] = "pairs"
    # TRL's held-out preference accuracy: the fraction of pairs whose chosen response wins.
    held_out_metrics: ClassVar[dict[str, str]] = {"eval_loss": "min", "eval_rewards/accuracies": "max"}


class DPOObjective(_PairObjective):
    name: Literal["dpo"] = "dpo"
    """`dpo`: Direct Preference Optimization (Rafailov et al. 2023) on pairs, against a reference."""
    beta: Beta = 0.1
    """The inverse temperature of the implicit reward."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """The assumed probability that a pair's preference label is flipped (cDPO)."""
    rpo_alpha: float = Field(0.0, ge=0, le=1000)
    """The weight of the chosen response's per-token NLL added to each pair's loss (RPO, Pang et al.
    2024; TRL's `rpo_alpha`). It keeps the chosen response likely while the margin grows (plain DPO
    lowers both). 0: plain DPO."""
    reference: Literal["adapter_off", "precomputed"] = "adapter_off"
    """`adapter_off` runs the reference forward in every step (the base with the adapter off, or the
    frozen starting adapter `model.adapter`), no extra weights held; `precomputed` computes the
    reference log-probabilities once, stores them beside the data cache, and skips that forward."""
    resume_free: ClassVar[tuple[str, ...]] = ("reference",)


class IPOObjective(_PairObjective):
    name: Literal["ipo"] = "ipo"
    """`ipo`: Identity Preference Optimization (Azar et al. 2023) on pairs, against a reference."""
    beta: Beta = 0.1
    """The regularization strength: the target log-ratio margin is 1 / (2 beta)."""
    reference: Literal["adapter_off", "precomputed"] = "adapter_off"
    """As DPO's: `adapter_off` (a reference forward in every step) or `precomputed` (once, stored
    beside the data cache)."""
    resume_free: ClassVar[tuple[str, ...]] = ("reference",)


class SimPOObjective(_PairObjective):
    name: Literal["simpo"] = "simpo"
    """`simpo`: Simple Preference Optimization (Meng et al. 2024): length-normalized, no reference."""
    beta: Beta = 0.1
    """The scale of the length-normalized reward."""
    simpo_gamma: float = Field(0.5, ge=0, le=1000)
    """The target reward margin gamma."""


class ORPOObjective(_PairObjective):
    name: Literal["orpo"] = "orpo"
    """`orpo`: Odds Ratio Preference Optimization (Hong et al. 2024): the chosen response's NLL plus
    an odds-ratio term, no reference."""
    beta: Beta = 0.1
    """The weight (the paper's lambda) of the odds-ratio term."""


class GRPOObjective(_ObjectiveSection):
    name: Literal["grpo"] = "grpo"
    """`grpo`: online RL (the GRPO family, Shao et al. 2024; TRL's `GRPOTrainer` names): each step
    samples `rollout.num_generations` completions per prompt with the current policy, scores them
    with `reward.functions`, and trains on the group-normalized advantages. `batch.*` counts
    completions. Records are prompts (`{"prompt"}` or a conversation); other columns go to the
    reward functions. The loss is defined in `jobs.objectives.grpo_losses` (docs/spec.md)."""
    records: ClassVar[str] = "prompts"
    resolves: ClassVar[dict[str, str]] = {"epsilon_high": "clip_high"}
    # The mean weighted reward of one greedy completion per held-out prompt (no held-out loss).
    held_out_metrics: ClassVar[dict[str, str]] = {"eval_reward": "max"}
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    """How the per-token terms become the step's loss, each independent of the split: `dapo` (default)
    the mean over every completion token of the global batch; `grpo` each completion's token mean,
    then the mean over the global batch's completions; `dr_grpo` (Dr. GRPO, Liu et al. 2025) the
    token sum divided by completions x `rollout.max_completion_length`."""
    beta: float = Field(0.0, ge=0, le=1000)
    """The KL coefficient (k3 estimator) against the reference: the base with the adapter off, or
    the frozen starting adapter `model.adapter`. 0 (the default): no KL term, no reference forward."""
    epsilon: float = Field(0.2, gt=0, lt=1)
    """The lower clipping bound: the importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = Field(None, gt=0, le=1000)
    """The upper clipping bound (DAPO's clip-higher, e.g. 0.28); default: `epsilon`."""
    num_iterations: int = Field(1, ge=1, le=1000)
    """Optimizer steps on each rollout batch (TRL's mu). Above 1 the old log-probabilities are
    computed once per rollout batch, frozen, and the ratio moves away from 1."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """The advantage is the reward minus its group's mean, divided by the standard deviation
    (Bessel-corrected, as TRL's `nanstd`; + 1e-4) of its group (`group`), of the whole global batch
    (`batch`), or not divided (`none`, as Dr. GRPO recommends)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """`token`: one importance ratio per token; `sequence` (GSPO, Zheng et al. 2025): one per
    completion, the exponential of its token-mean log-ratio."""
    mask_truncated_completions: bool = False
    """Completions cut at `rollout.max_completion_length` (no EOS) are left out of the loss and of
    every denominator (DAPO's overlong filtering)."""

    @property
    def epsilon_low(self) -> float:
        """The lower clipping bound (TRL's name for `epsilon`)."""
        return self.epsilon

    @property
    def clip_high(self) -> float:
        """`epsilon_high`, resolved: `epsilon` where unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def has_reference(self) -> bool:
        """Only with a KL term (`beta` > 0)."""
        return self.beta > 0

    def memory_terms(self, adapter: bool) -> dict:
        """A reference forward only with `beta` > 0 (the adapter off, or the starting adapter held
        frozen a second time); generation and the old-log-prob forward come from `rollout.*`
        (`jobs.memory.spec_estimate.spec_rollout`)."""
        reference = "adapter_off" if self.beta > 0 else None
        return {"pairs": False, "reference": reference, "reference_adapter": adapter and reference is not None}


OBJECTIVE_CLASSES: tuple[type[_ObjectiveSection], ...] = (
    SFTObjective,
    DPOObjective,
    IPOObjective,
    SimPOObjective,
    ORPOObjective,
    GRPOObjective,
)

# Each objective's spec class by its `objective.name`, in the order the classes are listed.
OBJECTIVE_BY_NAME: dict[str, type[_ObjectiveSection]] = {c.model_fields["name"].default: c for c in OBJECTIVE_CLASSES}
OBJECTIVE_NAMES = tuple(OBJECTIVE_BY_NAME)


def _objective_tag(v: Any) -> str:
    """The objective union's tag: the section's `name`, `sft` where it gives none (or is no mapping:
    SFT's class then refuses it)."""
    name = v.get("name", "sft") if isinstance(v, dict) else getattr(v, "name", "sft")
    return name if isinstance(name, str) else repr(name)


# A union tagged by `_objective_tag` rather than by the field: every section's `name` goes through
# the before-validators (no booleans for numbers), which pydantic's field discriminator refuses.
if TYPE_CHECKING:
    ObjectiveSpec = SFTObjective | DPOObjective | IPOObjective | SimPOObjective | ORPOObjective | GRPOObjective
else:
    ObjectiveSpec = Annotated[
        Union[tuple(Annotated[c, Tag(name)] for name, c in OBJECTIVE_BY_NAME.items())],  # noqa: UP007
        Discriminator(_objective_tag),
    ]
