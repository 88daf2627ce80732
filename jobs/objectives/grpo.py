"""Online RL, the GRPO family (`objective.name: grpo`), as the loop runs it: each optimizer step
samples `rollout.num_generations` completions for each of its prompts with the policy as it is,
scores them (`reward.functions`), and trains on the group-normalized advantages.

Invariants (what makes the step independent of workers x accumulation x micro-batch):

* Step k's prompts are the k-th global batch of a sampler over the prompts (`GlobalBatches`, or
  `MixtureBatches` by weight over a mixture's sources; P = `batch.global_batch_size /
  rollout.num_generations` a step); completion c of the step is sample
  c % G of prompt c // G, drawn from its own seed (`jobs.rollout.engine.sample_seed`): which rank
  or batch generates it does not change it (up to the floating point of the batch's logits).
* The completions are split over ranks and micro-batches as SFT's samples are (`split_window`
  over the completion positions); every rank then holds the whole batch's rewards, lengths and
  truncation flags (one all-reduce of a [completions, functions + 3] table), from which the
  advantages (`group_advantages`, over whole groups) and the step's ONE denominator
  (`grpo_losses.global_denominator`) are computed identically everywhere, before the window.
* The loss module returns each micro-batch's numerator (`grpo_losses.micro_batch_numerator`), and
  the loop scales it by world_size / denominator, as it does SFT's summed token loss.

`num_iterations` (TRL's mu): each rollout batch is trained on at mu consecutive optimizer steps.
With mu = 1 the importance ratio is exp(logp - logp.detach()) = 1 with the gradient of logp (the
old log-probabilities are the current ones, as TRL); with mu > 1 the trainer computes the old
log-probabilities once, when the batch is sampled, and a checkpoint between its steps holds the
batch whole (`grpo_batch`), so a resume continues it exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

from jobs.data import GlobalBatches, MixtureBatches, equal_micro_batches, split_window, total_steps
from jobs.data.mixture import Sampler, check_every_source_sampled
from jobs.data.prompts import PromptData, PromptSet, check_prompt_count, prompt_records, read_prompt_data
from jobs.errors import SpecError
from jobs.objectives import grpo_batch
from jobs.objectives import grpo_losses as losses
from jobs.objectives.base import Objective, Window, all_reduce_sum
from jobs.objectives.grpo_batch import collate_rollouts as collate_rollouts
from jobs.rollout import held_out, vllm_sync
from jobs.rollout.engine import HFEngine, RolloutEngine
from jobs.rollout.rewards import check_columns, resolve
from jobs.spec import GRPOObjective, JobSpec

ROLLOUT_FILE = "rollout.pt"  # in a checkpoint between the iterations of one rollout batch
# Completions generated at once where the plan chose none (a plan made without rollouts).
DEFAULT_GENERATION_BATCH = 16
LOG_EVERY_BATCH_BELOW_STEPS = 1000  # `run.log_rollouts_every`'s default: every batch below, every 10th from
log = logging.getLogger("rayft")

# What `GRPOLoss` sums per micro-batch after the numerator, in this order: TRL's metric names, each
# a sum over loss tokens (divided by the step's loss tokens when reported), then the loss tokens.
STATS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "loss_tokens")


@dataclass(frozen=True)
class GRPO(Objective):
    """The GRPO family's settings, resolved (`epsilon_high` defaults to `epsilon`); `batch.*` counts
    completions. `_run` holds what one run resolves once (the reward functions)."""

    specs: ClassVar[tuple[type[BaseModel], ...]] = (GRPOObjective,)
    name: str = "grpo"
    loss_type: losses.LossType = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    scale_rewards: str = "group"
    importance_sampling_level: str = "token"
    mask_truncated_completions: bool = False
    _run: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_section(cls, section) -> GRPO:
        return cls(
            loss_type=section.loss_type,
            beta=section.beta,
            epsilon=section.epsilon,
            epsilon_high=section.clip_high,
            scale_rewards=section.scale_rewards,
            importance_sampling_level=section.importance_sampling_level,
            mask_truncated_completions=section.mask_truncated_completions,
        )

    @property
    def stat_names(self) -> tuple[str, ...]:
        return STATS

    @property
    def unit(self) -> str:
        return " completions"

    def loss_module(self, model: nn.Module, chunk_tokens: int, compiled_head: bool) -> nn.Module:
        from jobs.objectives.preference import REFERENCE_ADAPTER

        reference = REFERENCE_ADAPTER if REFERENCE_ADAPTER in getattr(model, "peft_config", {}) else None
        return GRPOLoss(model, self, reference)

    def plot_labels(self, spec: JobSpec) -> dict[str, str]:
        return {
            "title": f"{spec.name}: {spec.batch.global_batch_size} completions/step ({self.loss_type})",
            "ylabel": "GRPO loss",
            "train_label": f"train loss ({self.loss_type})",
        }

    def step_values(self, sums: torch.Tensor, denominator: int) -> tuple[float, dict]:
        """The loss over the step's denominator; the clip ratios and the KL per loss token (TRL's)."""
        values = sums.reshape(-1).tolist()
        tokens = max(values[-1], 1.0)
        stats = {k: v / tokens for k, v in zip(STATS[:3], values[1:4], strict=True)}
        if self.beta:
            stats["kl"] = values[4] / tokens
        return values[0] / denominator, stats

    # ---- data: prompts, read by every rank ------------------------------------------------------

    def check_records(self, spec: JobSpec) -> None:
        """Every record a prompt, every built-in reward's column in every record, the user reward
        functions importable, and one step's prompts (before tokenizing: it can only drop some)."""
        functions = resolve(spec.online.reward)
        n = 0
        for where, rec in prompt_records(spec):
            try:
                check_columns(functions, list(rec))
            except SpecError as e:
                raise SpecError(f"{where}: {e}") from None
            n += 1
        check_prompt_count(spec, PromptSet(ids=[[]] * n))

    def build_data(self, spec: JobSpec, tokenizer) -> None:
        self.load_data(spec, tokenizer)  # every refusal `load_data` makes, before the run's directory

    def preview(self, spec: JobSpec, tokenizer, n: int) -> dict:
        """The first `n` training prompts as generation starts from them, with the columns the
        reward functions receive (`jobs.data.preview_prompts`)."""
        from jobs.data.preview_prompts import prompt_preview

        return prompt_preview(spec, tokenizer, n)

    def load_data(self, spec: JobSpec, tokenizer) -> tuple[Any, Any, int]:
        from jobs.data import content_hash

        prompts, evaluated, sources = read_prompt_data(spec, tokenizer)
        check_prompt_count(spec, prompts)
        g = spec.online.rollout.num_generations
        data = PromptData(prompts, evaluated, prompts.dropped + evaluated.dropped, content_hash(spec), sources=sources)
        mu = spec.online.objective.num_iterations
        batches = RolloutBatches(prompt_sampler(spec, data), mu)
        # `run.epochs` counts passes over the prompts; each rollout batch is num_iterations steps
        steps = spec.run.max_steps if spec.run.max_steps is not None else mu * total_steps(spec, len(prompts) * g)
        check_every_source_sampled(batches.inner, data.sources, batches.rollout_batches(steps))
        return data, batches, steps

    def plan_window(self, spec: JobSpec, ctx, job, step: int) -> Window:
        """This rank's completion positions of step `step`, by micro-batch (`split_window` over
        0..global_batch_size-1); the completions themselves are sampled in `with_rollouts`."""
        positions = np.arange(spec.batch.global_batch_size, dtype=np.int64)
        mine = split_window(positions, ctx.rank, ctx.world_size, spec.batch.micro_batch_size, spec.grad_accum_steps)
        return Window(list(mine), 0, 0, 0)

    @torch.no_grad()
    def held_out(self, engine, job, spec: JobSpec, ctx) -> tuple[float | None, dict]:
        """(None, `eval_reward` and `eval_rewards/<name>/mean`): one greedy completion per held-out
        prompt (`jobs.rollout.held_out`), sharded over ranks; every rank generates the same number
        of batches (a rank whose share ran out repeats one, unscored), one all-reduce."""
        prompts = job.data.eval
        if not len(prompts):
            return None, {}
        functions, sources = self.functions(spec), job.data.sources
        hf = HFEngine(job.model, grpo_batch.eos_ids(job), job.tokenizer.pad_token_id, synced=job.strategy == "fsdp")
        in_loss = grpo_batch.InLossForward(hf, engine)  # FSDP: through the root's forward
        # rows: per function, the weighted reward, then the reward per mixture source; (sum, count)
        sums = torch.zeros(len(functions) + 1 + len(sources), 2, dtype=torch.float64)
        for idx, counted in equal_micro_batches(len(prompts), ctx.rank, ctx.world_size, spec.batch.micro_batch_size):
            done = held_out.greedy(in_loss, prompts, idx, spec.online.rollout.max_completion_length)
            if counted:
                timeout_s = spec.online.reward.timeout_s
                values, rewards, _ = held_out.scored(functions, prompts, idx, done, job.tokenizer, timeout_s)
                sums[: len(functions) + 1] += held_out.sums_of(values, rewards, len(functions))
                sums[len(functions) + 1 :] += held_out.source_sums(rewards, idx, [s.eval_offset for s in sources])
        totals = all_reduce_sum(sums.to(engine.device), ctx.world_size).cpu()
        out = held_out.means(totals[: len(functions) + 1], spec.online.reward.labels)
        out |= {f"reward/{s.name}": held_out.mean_of(*totals[len(functions) + 1 + i]) for i, s in enumerate(sources)}
        return None, {f"eval_{k}": v for k, v in out.items()}

    # ---- the step's rollouts ----------------------------------------------------------------------

    def with_rollouts(self, spec: JobSpec, ctx, job, engine, step: int, window: Window) -> Window:
        """This rank's micro-batches of step `step`: from the rollout batch step // num_iterations,
        sampled at its first step (`grpo_batch.sample`) and trained on at each of its steps."""
        index = step // spec.online.objective.num_iterations
        batch = self._run.get("rollout")
        if batch is None or batch.index != index:
            logged = index % rollouts_every(spec, job.steps) == 0
            positions = np.concatenate(window.micro_batches)
            batch = grpo_batch.sample(self, spec, ctx, job, engine, index, positions, logged)
            self._run["rollout"] = batch
        prompts = job.data.train
        cap = spec.online.rollout.importance_correction_cap if spec.online.rollout.importance_correction else None
        micro = batch.micro_batches(prompts, job.tokenizer.pad_token_id, window.micro_batches, self.scale_rewards, cap)
        return Window(
            micro,
            batch.denominator(self, spec.online.rollout.max_completion_length),
            int(batch.lengths.sum()),
            batch.input_tokens(prompts),
            batch.metrics(spec.online.reward.labels) | source_metrics(job.batches, job.data, batch),
        )

    def prepare(self, spec: JobSpec, ctx, job, engine) -> None:
        """Rank 0 says how often the run writes its rollouts (`rollouts_every`), when not every batch."""
        every = rollouts_every(spec, job.steps)
        if ctx.is_main and every > 1:
            log.warning(
                "rollouts/step-NNNNNN.jsonl every %d rollout batches (run.log_rollouts_every; %d steps)",
                every,
                job.steps,
            )

    def rollout_engine(self, spec: JobSpec, ctx, job, engine, step: int) -> RolloutEngine:
        """What samples optimizer step `step`'s completions (`rollout.engine`): the policy in-process,
        or the run's vLLM engine (started or reached once per run) serving step `step`'s adapter."""
        eos = grpo_batch.eos_ids(job)
        if spec.online.rollout.engine == "vllm":
            if "vllm" not in self._run:
                self._run["vllm"] = vllm_sync.connect(spec, ctx, job, eos)
            return self._run["vllm"].at_step(job.model, ctx, step)
        batch = job.plan.generation_batch_size or DEFAULT_GENERATION_BATCH  # `rollout.generation_batch_size`
        hf = HFEngine(job.model, eos, job.tokenizer.pad_token_id, batch_size=batch, synced=job.strategy == "fsdp")
        return grpo_batch.InLossForward(hf, engine)

    def rollouts_generated(self, ctx) -> None:
        """Every rank's completions of a rollout batch are in: a sleeping vLLM engine goes to sleep
        while the trainer steps (`rollout.vllm_sleep`)."""
        rollout = self._run.get("vllm")
        if rollout is not None:
            rollout.rest(ctx)

    def release(self) -> None:
        """The run's vLLM engine let go (`VLLMRollout.close`: a server rayft started is stopped)."""
        rollout = self._run.pop("vllm", None)
        if rollout is not None:
            rollout.close()

    def functions(self, spec: JobSpec) -> list:
        """The reward functions, resolved once per run (a user file is imported once)."""
        if "functions" not in self._run:
            self._run["functions"] = resolve(spec.online.reward)
        return self._run["functions"]

    # ---- a checkpoint between the iterations of one rollout batch --------------------------------

    def checkpoint_files(self, rank: int) -> dict[str, Any]:
        """Rank 0, with num_iterations > 1: the current rollout batch, whole (`grpo_batch` doc)."""
        batch = self._run.get("rollout")
        if rank != 0 or batch is None or batch.old_logps is None:
            return {}
        return {ROLLOUT_FILE: batch.state()}

    def restored(self, directory: Path) -> None:
        """The rollout batch a checkpoint holds becomes the current one (a resume continues it)."""
        path = directory / ROLLOUT_FILE
        if path.exists():
            self._run["rollout"] = grpo_batch.RolloutBatch.from_state(torch.load(path, weights_only=True))


def rollouts_every(spec: JobSpec, steps: int) -> int:
    """`run.log_rollouts_every`, or its default: every rollout batch under 1,000 steps, else every 10th."""
    if spec.run.log_rollouts_every is not None:
        return spec.run.log_rollouts_every
    return 1 if steps < LOG_EVERY_BATCH_BELOW_STEPS else 10


def prompt_sampler(spec: JobSpec, data: PromptData) -> Sampler:
    """Rollout batch b -> its P = global_batch_size / num_generations prompts: `GlobalBatches` over
    the prompts, or by weight over a mixture's sources (`MixtureBatches`, SFT's rule, counting
    prompts: each source's share of the batch's groups)."""
    per_batch = spec.batch.global_batch_size // spec.online.rollout.num_generations
    if data.sources:
        sizes, weights = [s.n_train for s in data.sources], [s.weight for s in data.sources]
        return MixtureBatches(sizes, weights, per_batch, spec.run.seed)
    return GlobalBatches(len(data.train), per_batch, spec.run.seed)


def source_metrics(batches: RolloutBatches, data: PromptData, batch: grpo_batch.RolloutBatch) -> dict[str, float]:
    """A mixture's per-source values of a rollout batch (over the whole batch: every rank holds its
    rewards): `samples/NAME` (completions), `reward/NAME` (their mean reward), `epoch/NAME`
    (passes over the source's prompts after this batch); {} for one source."""
    if not data.sources:
        return {}
    assert isinstance(batches.inner, MixtureBatches)
    g = batch.num_generations
    source = np.searchsorted(np.asarray(batches.inner.offsets), np.repeat(batch.prompt_indices, g), side="right") - 1
    rewards = batch.rewards.numpy()
    out: dict[str, float] = {}
    epochs = batches.inner.source_epochs(batch.index + 1)
    for s, (part, epoch) in enumerate(zip(data.sources, epochs, strict=True)):
        mine = rewards[source == s]
        out[f"samples/{part.name}"] = len(mine)
        if len(mine):  # a source may give no prompt to a batch: no mean to report
            out[f"reward/{part.name}"] = float(mine.mean())
        out[f"epoch/{part.name}"] = epoch
    return out


class RolloutBatches:
    """Optimizer step k -> its prompts: the rollout batch k // num_iterations of `inner`
    (`prompt_sampler`)."""

    def __init__(self, inner: Sampler, num_iterations: int):
        self.inner, self.mu = inner, num_iterations

    def rollout_batches(self, steps: int) -> int:
        """How many rollout batches `steps` optimizer steps sample."""
        return -(-steps // self.mu)

    def index_array(self, step: int) -> np.ndarray:
        return self.inner.index_array(step // self.mu)

    def indices(self, step: int) -> list[int]:
        return self.index_array(step).tolist()

    def epoch_of(self, step: int) -> float:
        """Passes over the prompts after `step` optimizer steps (a rollout batch counts at its first)."""
        return self.inner.epoch_of(-(-step // self.mu))


class GRPOLoss(nn.Module):
    """One micro-batch's share of the step's numerator (`grpo_losses.micro_batch_numerator`) and its
    statistics summed (`STATS`). The loop divides by the step's ONE denominator. The old
    log-probabilities are the rollout batch's frozen ones (num_iterations > 1), else the current
    ones, detached (the ratio is 1, its gradient that of logp). With `beta` > 0 the reference
    forward runs first (eval mode, no grad, the adapters off -- or the frozen starting adapter
    active). `sampling_weights` (`rollout.importance_correction`) scale each token's
    policy-gradient term (`grpo_losses.truncated_importance_weights`)."""

    model: Any  # a peft PeftModel (peft ships no types)

    def __init__(self, model: nn.Module, objective: GRPO, reference_adapter: str | None = None):
        super().__init__()
        self.model, self.objective, self.reference_adapter = model, objective, reference_adapter

    def token_logps(self, input_ids, attention_mask, label_pos, label_ids, slot, completion_mask) -> torch.Tensor:
        """[B, C] log-probability of each completion token (0 outside the mask), in float64."""
        lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        h = hidden.last_hidden_state.flatten(0, 1).index_select(0, label_pos)  # the head on these rows only
        logits = lm.get_output_embeddings()(h).float()
        token = -F.cross_entropy(logits, label_ids, reduction="none").double()
        grid = completion_mask.new_zeros(completion_mask.numel(), dtype=torch.float64)
        return grid.index_put((slot,), token).view(completion_mask.shape)

    @torch.no_grad()
    def reference_logps(self, *tensors) -> torch.Tensor:
        from jobs.objectives.preference import active_adapter, adapters_off

        was_training = self.model.training
        self.model.eval()
        try:
            off = (
                active_adapter(self.model, self.reference_adapter)
                if self.reference_adapter
                else adapters_off(self.model)
            )
            with off:
                return self.token_logps(*tensors)
        finally:
            self.model.train(was_training)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        label_pos=None,
        label_ids=None,
        slot=None,
        completion_mask=None,
        advantages=None,
        truncated=None,
        old_logps=None,
        sampling_weights=None,
        *,
        call=None,
    ):
        """(numerator, statistics) of one micro-batch; with `call`, `call(self)`'s result instead:
        generation and the old log-probs run through here, the root's forward, so FSDP's hooks
        gather what they need (a sub-module's own forward first would be refused)."""
        if call is not None:
            return call(self)
        o = self.objective
        tensors = (input_ids, attention_mask, label_pos, label_ids, slot, completion_mask)
        ref = self.reference_logps(*tensors) if o.beta else None
        logps = self.token_logps(*tensors)
        old = logps.detach() if old_logps is None else old_logps
        mask = losses.loss_mask(completion_mask.double(), truncated, o.mask_truncated_completions)
        adv = advantages.double()
        low, high, level = o.epsilon, o.epsilon_high, o.importance_sampling_level
        per_token = losses.per_token_loss(
            logps,
            old,
            adv,
            mask,
            epsilon=low,
            epsilon_high=high,
            beta=o.beta,
            ref_logps=ref,
            level=level,
            sampling_weights=sampling_weights,
        )
        counts = losses.clip_counts(logps.detach(), old, adv, mask, epsilon=low, epsilon_high=high, level=level)
        kl = (losses.k3_kl(logps.detach(), ref) * mask).sum() if ref is not None else mask.new_zeros(())
        stats = torch.cat([counts.double(), kl.view(1), mask.sum().view(1)])
        return losses.micro_batch_numerator(per_token, mask, o.loss_type), stats
