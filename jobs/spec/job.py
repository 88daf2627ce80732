"""The job spec, `JobSpec`: every section, the rules that join sections, and the compute precision."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from jobs import secrets
from jobs.spec.fields import DNS1123, OWN_SECRET_CHECK, SURROGATE
from jobs.spec.objective import GRPOObjective, ObjectiveSpec, SFTObjective
from jobs.spec.online import RewardSpec, RolloutSpec, grpo_problem
from jobs.spec.sections import BatchSpec, DataSpec, LoraSpec, MemorySpec, ModelSpec, OptimSpec, ResourcesSpec, RunSpec
from jobs.spec.yaml_file import one_line


class OnlineRL(NamedTuple):
    """An online-RL spec's own sections, typed (`JobSpec.online`)."""

    objective: GRPOObjective
    rollout: RolloutSpec
    reward: RewardSpec


class JobSpec(BaseModel):
    """A rayft fine-tuning job."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=False, use_attribute_docstrings=True, allow_inf_nan=False
    )

    name: str
    """Job name, DNS-1123 label (lowercase letters, digits, '-'): it becomes a Ray submission id / k8s name."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec
    lora: LoraSpec = Field(default_factory=LoraSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """`auto`: bf16 on GPU, fp32 on CPU. `fp16` uses a GradScaler."""
    memory: MemorySpec = Field(default_factory=MemorySpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    objective: ObjectiveSpec = Field(default_factory=SFTObjective)
    """The training objective, chosen by `objective.name`: SFT (default), a preference objective
    on chosen/rejected pairs, or online RL (`grpo`); each takes only its own keys."""
    rollout: RolloutSpec | None = None
    """`objective.name: grpo` only: how completions are sampled (defaults where not given)."""
    reward: RewardSpec | None = None
    """`objective.name: grpo` only (and required there): the reward functions."""

    @model_validator(mode="before")
    @classmethod
    def _no_credentials_or_unusable_text(cls, data: Any) -> Any:
        """No string anywhere in a spec is a credential (a spec travels in runtime_env, ConfigMaps
        and logs), holds a NUL, or is not encodable Unicode (a lone surrogate): file systems and
        tokenizers refuse those with tracebacks, so the spec refuses them first, by field path."""
        for path, text in secrets.walk_strings(data):
            if path.startswith(OWN_SECRET_CHECK):
                continue
            what = secrets.describe(text)
            if what:
                raise ValueError(
                    f"{one_line(path)}: holds {what}: a spec never carries a credential (it would "
                    "travel in runtime_env, manifests and logs); put it in an environment variable "
                    "on the workers and name that variable (model.hf_token_env)"
                )
            if "\x00" in text:
                raise ValueError(f"{one_line(path)}: contains a NUL character")
            if SURROGATE.search(text):
                raise ValueError(f"{one_line(path)}: is not valid Unicode (an unpaired surrogate)")
        return data

    @field_validator("name")
    @classmethod
    def _dns1123(cls, v: str) -> str:
        if not DNS1123.fullmatch(v):
            raise ValueError(
                f"{one_line(repr(v))} is not a DNS-1123 label (lowercase letters, digits and '-', "
                "starting and ending with a letter or digit, at most 63 characters)"
            )
        return v

    @model_validator(mode="after")
    def _derive_accumulation(self) -> JobSpec:
        b, w = self.batch, self.resources.num_workers
        per_step = b.micro_batch_size * w
        if b.global_batch_size % per_step:
            raise ValueError(
                f"batch.global_batch_size={b.global_batch_size} is not divisible by "
                f"batch.micro_batch_size={b.micro_batch_size} x resources.num_workers={w} = {per_step}"
            )
        derived = b.global_batch_size // per_step
        if b.grad_accum_steps is not None and b.grad_accum_steps != derived:
            raise ValueError(
                f"batch.grad_accum_steps={b.grad_accum_steps} disagrees with batch.global_batch_size / "
                f"(batch.micro_batch_size x resources.num_workers) = {b.global_batch_size} / "
                f"({b.micro_batch_size} x {w}) = {derived}"
            )
        # Bypass validate_assignment: the value was just checked.
        object.__setattr__(b, "grad_accum_steps", derived)
        return self

    @model_validator(mode="after")
    def _combinations(self) -> JobSpec:
        """Combinations of fields that cannot run, refused before anything starts, naming both."""
        r = self.resources
        if r.strategy == "fsdp" and r.num_workers < 2:
            raise ValueError(
                f"resources.strategy=fsdp shards the base over the workers and needs "
                f"resources.num_workers >= 2 (got {r.num_workers}); use strategy ddp or auto"
            )
        if r.fsdp_reshard_after_forward is not None and r.strategy == "ddp":
            raise ValueError(
                "resources.fsdp_reshard_after_forward is set but resources.strategy=ddp "
                "(it only applies to fsdp or auto)"
            )
        if r.strategy == "fsdp" and self.model.quantization == "int8":
            # bitsandbytes' Int8Params lose their row scales under fully_shard (the first forward
            # fails: 'Parameter' object has no attribute 'CB'); nf4 shards and trains exactly.
            raise ValueError(
                "resources.strategy=fsdp cannot shard an int8 base (model.quantization=int8): "
                "use model.quantization nf4 with fsdp, or strategy ddp or auto"
            )
        if self.lora.init in ("pissa", "olora") and self.model.quantization != "none":
            # PEFT refuses PiSSA on a quantized base; OLoRA re-quantizes the residual, so its
            # adapter fits neither the 4-bit nor the plain base (logits 0.55-0.69 off, tiny-llama).
            raise ValueError(
                f"lora.init={self.lora.init} moves part of the base weights into the adapter and "
                f"needs an unquantized base (model.quantization={self.model.quantization}); "
                "use lora.init default or gaussian"
            )
        if self.model.adapter and self.lora.init != "default":
            raise ValueError(
                f"lora.init={self.lora.init} initialises a new adapter, but model.adapter starts from a "
                "saved one; leave lora.init at default"
            )
        if self.model.attn_implementation == "flex_attention" and not r.use_gpu:
            raise ValueError(
                "model.attn_implementation=flex_attention needs resources.use_gpu=true: torch has no "
                "FlexAttention backward on CPU; use sdpa"
            )
        if self.objective.is_preference and self.data.packing:
            raise ValueError(
                f"data.packing is not available with objective.name={self.objective.name} (a pair's "
                "chosen and rejected rows are padded side by side); set data.packing=false"
            )
        problem = self.data.mixture_problem() or self._online_rl_problem() or self._early_stopping_problem()
        if problem:
            raise ValueError(problem)
        if r.gpus_per_worker > 1 and not r.use_gpu:
            raise ValueError(f"resources.gpus_per_worker={r.gpus_per_worker} needs resources.use_gpu=true")
        if r.num_workers % r.gpus_per_worker:
            raise ValueError(
                f"resources.num_workers={r.num_workers} is not a multiple of "
                f"resources.gpus_per_worker={r.gpus_per_worker} (workers are packed "
                f"{r.gpus_per_worker} to a pod)"
            )
        return self

    @property
    def online(self) -> OnlineRL:
        """This GRPO spec's objective, rollout and reward sections, typed: validation gives a
        `grpo` spec all three (`_online_rl_problem`); asking another objective's is a bug."""
        objective, rollout, reward = self.objective, self.rollout, self.reward
        assert isinstance(objective, GRPOObjective) and rollout is not None and reward is not None, objective.name
        return OnlineRL(objective, rollout, reward)

    def _online_rl_problem(self) -> str | None:
        """Why the `rollout`/`reward` sections cannot run with this objective; None when they can.
        With `grpo` a missing `rollout` section takes its defaults."""
        if not isinstance(self.objective, GRPOObjective):
            given = [k for k in ("rollout", "reward") if getattr(self, k) is not None]
            given += ["run.log_rollouts_every"] if self.run.log_rollouts_every is not None else []
            if given:
                return f"{given[0]} applies to objective.name=grpo only (got objective.name={self.objective.name})"
            return None
        if self.rollout is None:
            object.__setattr__(self, "rollout", RolloutSpec())
        assert self.rollout is not None
        return grpo_problem(self, self.rollout)

    def _early_stopping_problem(self) -> str | None:
        """A `run.early_stopping.metric` the objective's held-out evaluation does not report."""
        es, obj = self.run.early_stopping, self.objective
        if es is None or es.metric is None or es.metric in obj.held_out_metrics:
            return None
        return (
            f"run.early_stopping.metric={es.metric}: objective.name={obj.name} reports "
            f"{' or '.join(obj.held_out_metrics)} on held-out data"
        )

    # ---- derived quantities, kept in one place -------------------------------------------
    @property
    def grad_accum_steps(self) -> int:
        steps = self.batch.grad_accum_steps
        assert steps is not None  # set by the validator
        return steps

    @property
    def reference_batch_size(self) -> int:
        return self.optim.reference_batch_size or self.batch.global_batch_size

    @property
    def lr_scale(self) -> float:
        """f(global_batch / reference_batch) for the configured rule."""
        x = self.batch.global_batch_size / self.reference_batch_size
        return {"none": 1.0, "linear": x, "sqrt": math.sqrt(x)}[self.optim.lr_scaling]

    @property
    def effective_lr(self) -> float:
        return self.optim.lr * self.lr_scale

    @property
    def planned_device(self) -> str:
        """The device kind the workers train on: "cuda" with `resources.use_gpu`, else "cpu"."""
        return "cuda" if self.resources.use_gpu else "cpu"

    @property
    def output_location(self) -> str:
        """`run.output_dir` with `{name}` filled in: a local path or an object-store URI."""
        return self.run.output_dir.replace("{name}", self.name)

    @property
    def output_path(self) -> Path:
        """The local directory the run writes into: `run.output_dir` itself, or for an object-store
        URI its staging directory (`jobs.run.storage.staging_dir`), whose files are uploaded there."""
        from jobs.run.storage import is_uri, staging_dir

        where = self.output_location
        return staging_dir(where) if is_uri(where) else Path(where)

    @property
    def is_mixture(self) -> bool:
        return self.data.mix is not None

    def for_source(self, i: int) -> JobSpec:
        """This spec with mixture source `i` as its only data (`DataSpec.of_source`): how that
        source is read, checked and tokenized into its own cache entry."""
        return self.model_copy(update={"data": self.data.of_source(i)})

    def to_dict(self) -> dict:
        """The spec as JSON data; the online-RL sections only where they are set (a spec of another
        objective reads, and hashes, as it did before they existed)."""
        unset: dict = {k: True for k in ("rollout", "reward") if getattr(self, k) is None}
        if self.run.log_rollouts_every is None:
            unset["run"] = {"log_rollouts_every"}
        return self.model_dump(mode="json", exclude=unset)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def spec_hash(self, length: int = 10) -> str:
        """Stable hash of the full validated spec (defaults included)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:length]


def compute_precision(precision: str, device_kind: str) -> str:
    """`auto` is bf16 on a GPU and fp32 on a CPU (no fast bf16 matmuls there); the others are
    what they say. The loop, the memory model and every estimate decide through here."""
    if precision == "auto":
        return "bf16" if device_kind == "cuda" else "fp32"
    return precision
