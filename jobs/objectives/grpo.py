"""Online RL, the GRPO family (`objective.name: grpo`), as the loop runs it: each optimizer step
samples `rollout.num_generations` completions for each of its prompts with the policy as it is,
scores them (`reward.functions`), and trains on the group-normalized advantages.

Invariants (what makes the step independent of workers x accumulation x micro-batch):

* Step k's prompts are the k-th global batch of a sampler over the prompts (`GlobalBatches`, P =
  `batch.global_batch_size / rollout.num_generations` a step); completion c of the step is sample
  c % G of prompt c // G, drawn from its own seed (`jobs.rollout.engine.sample_seed`): which rank
  or batch generates it does not change it (up to the floating point of the batch's logits).
* The completions are split over ranks and micro-batches as SFT's samples are (`split_window`
  over the completion positions); every rank then holds the whole batch's rewards, lengths and
  truncation flags (one all-reduce of a [completions, functions + 3] table), from which the
  advantages (`group_advantages`, over whole groups) and the step's ONE denominator
  (`grpo_losses.global_denominator`) are computed identically everywhere, before the window.
* The loss module returns each micro-batch's numerator (`grpo_losses.micro_batch_numerator`), and
  the loop scales it by world_size / denominator, as it does SFT's summed token loss.

`num_iterations` (TRL's mu) is 1: each rollout batch is trained on once, so the importance ratio
is exp(logp - logp.detach()) = 1 with the gradient of logp (the old log-probabilities are the
current ones). More iterations per rollout batch need the batch and its old log-probabilities in
the checkpoint to resume exactly; the spec refuses them until they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

from jobs.data import GlobalBatches, split_window, total_steps
from jobs.data.prompts import PromptData, PromptSet, check_prompt_count, prompt_records, read_prompts
from jobs.errors import SpecError
from jobs.objectives import grpo_losses as losses
from jobs.objectives.base import Objective, Window, all_reduce_sum
from jobs.rollout.engine import Completion, HFEngine, Request, Sampling, sample_seed
from jobs.rollout.record import length_metrics, reward_metrics, rollout_lines, write_rollouts
from jobs.rollout.rewards import Batch, check_columns, completions_as_trl, resolve, score
from jobs.spec import GRPOObjective

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

    def plot_labels(self, spec) -> dict[str, str]:
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

    def check_records(self, spec) -> None:
        """Every record a prompt, every built-in reward's column in every record, the user reward
        functions importable, and one step's prompts (before tokenizing: it can only drop some)."""
        functions = resolve(spec.reward)
        n = 0
        for where, rec in prompt_records(spec):
            try:
                check_columns(functions, list(rec))
            except SpecError as e:
                raise SpecError(f"{where}: {e}") from None
            n += 1
        check_prompt_count(spec, PromptSet(ids=[[]] * n))

    def build_data(self, spec, tokenizer) -> None:
        check_prompt_count(spec, read_prompts(spec, tokenizer))

    def load_data(self, spec, tokenizer) -> tuple[Any, Any, int]:
        from jobs.data import content_hash

        prompts = read_prompts(spec, tokenizer)
        check_prompt_count(spec, prompts)
        g = spec.rollout.num_generations
        data = PromptData(prompts, PromptSet(), prompts.dropped, content_hash(spec))
        return (
            data,
            GlobalBatches(len(prompts), spec.batch.global_batch_size // g, spec.run.seed),
            total_steps(spec, len(prompts) * g),
        )

    def plan_window(self, spec, ctx, job, step: int) -> Window:
        """This rank's completion positions of step `step`, by micro-batch (`split_window` over
        0..global_batch_size-1); the completions themselves are sampled in `with_rollouts`."""
        positions = np.arange(spec.batch.global_batch_size, dtype=np.int64)
        mine = split_window(positions, ctx.rank, ctx.world_size, spec.batch.micro_batch_size, spec.grad_accum_steps)
        return Window(list(mine), 0, 0, 0)

    @torch.no_grad()
    def held_out(self, engine, job, spec, ctx) -> tuple[float | None, dict]:
        return None, {}  # the spec refuses a held-out split for grpo (`jobs.spec.online`)

    # ---- the step's rollouts ----------------------------------------------------------------------

    def with_rollouts(self, spec, ctx, job, engine, step: int, window: Window) -> Window:
        """Sample, score and collate this rank's completions of step `step` (module doc)."""
        rollout = Rollout.of(spec, job, step)
        mine = np.concatenate(window.micro_batches)
        done = rollout.generate(job, mine)
        batch = rollout.scored(self.functions(spec), spec.reward.timeout_s, job, done, mine)
        table = all_reduce_sum(batch.table.to(engine.device), ctx.world_size).cpu()
        step_batch = StepBatch.of(self, spec, table)
        micro = [rollout.collate(job, done, mb, step_batch) for mb in window.micro_batches]
        lines = rollout.lines(job, done, mine, batch, step_batch, spec.reward.labels)
        write_rollout_lines(spec, ctx, step + 1, lines)
        return Window(
            micro,
            step_batch.denominator,
            step_batch.completion_tokens,
            step_batch.input_tokens(rollout, job),
            step_batch.metrics(spec, self.functions(spec)),
        )

    def functions(self, spec) -> list:
        """The reward functions, resolved once per run (a user file is imported once)."""
        if "functions" not in self._run:
            self._run["functions"] = resolve(spec.reward)
        return self._run["functions"]


@dataclass
class Rollout:
    """Step `step`'s prompts and how their completions are drawn."""

    step: int
    prompt_indices: np.ndarray  # [P] indices into the prompt set
    num_generations: int
    seed: int
    sampling: Sampling

    @classmethod
    def of(cls, spec, job, step: int) -> Rollout:
        return cls(
            step, job.batches.index_array(step), spec.rollout.num_generations, spec.run.seed, Sampling.of(spec.rollout)
        )

    def prompt_of(self, position: int) -> int:
        return int(self.prompt_indices[position // self.num_generations])

    def requests(self, job, positions: np.ndarray) -> list[Request]:
        out = []
        for pos in positions.tolist():
            p, j = self.prompt_of(pos), pos % self.num_generations
            out.append(Request(p, j, tuple(job.data.train.ids[p]), sample_seed(self.seed, self.step, p, j)))
        return out

    def generate(self, job, positions: np.ndarray) -> dict[int, Completion]:
        """position -> its completion, for this rank's `positions`."""
        tok = job.tokenizer
        engine = HFEngine(job.model, eos_ids(job), tok.pad_token_id)
        return dict(zip(positions.tolist(), engine.generate(self.requests(job, positions), self.sampling), strict=True))

    def scored(self, functions: list, timeout_s: float, job, done: dict[int, Completion], positions: np.ndarray):
        """This rank's completions scored, as rows of the global [completions, F + 3] table
        (values of each function, the weighted reward, length, truncated), zeros elsewhere."""
        prompts = job.data.train
        order = positions.tolist()
        ids = [list(done[pos].ids) for pos in order]
        records = [self.prompt_of(pos) for pos in order]
        keys = sorted({k for r in records for k in prompts.columns[r]})
        batch = Batch(
            [prompts.prompts[r] for r in records],
            completions_as_trl(job.tokenizer, ids, prompts.conversational),
            ids,
            records,
            {k: [prompts.columns[r].get(k) for r in records] for k in keys},
        )
        values, rewards = score(functions, batch, timeout_s)
        n_f = len(functions)
        table = torch.zeros(len(self.prompt_indices) * self.num_generations, n_f + 3, dtype=torch.float64)
        for i, pos in enumerate(order):
            c = done[pos]
            table[pos] = torch.tensor([*values[i], rewards[i], len(c.ids), float(c.truncated)], dtype=torch.float64)
        return Scored(batch, table)

    def collate(self, job, done: dict[int, Completion], positions: np.ndarray, step_batch) -> dict:
        """One micro-batch's tensors for `GRPOLoss.forward`."""
        pos = positions.tolist()
        prompts = [job.data.train.ids[self.prompt_of(p)] for p in pos]
        out = collate_rollouts(prompts, [done[p].ids for p in pos], job.tokenizer.pad_token_id)
        index = torch.as_tensor(positions)
        out["advantages"] = step_batch.advantages[index]
        out["truncated"] = step_batch.truncated[index]
        return out

    def lines(
        self, job, done: dict[int, Completion], mine: np.ndarray, scored: Scored, step_batch, labels: list[str]
    ) -> list[dict]:
        """This rank's lines of `rollouts/step-NNNNNN.jsonl` (`jobs.rollout.record.rollout_lines`)."""
        order = mine.tolist()
        b = scored.batch
        n_f = scored.table.shape[1] - 3
        return [
            dict(line, position=pos)
            for pos, line in zip(
                order,
                rollout_lines(
                    b.records,
                    b.prompts,
                    [job.data.train.ids[r] for r in b.records],
                    b.completions,
                    b.completion_ids,
                    [done[p].truncated for p in order],
                    [scored.table[p, :n_f].tolist() for p in order],
                    labels,
                    [float(scored.table[p, n_f]) for p in order],
                    [float(step_batch.advantages[p]) for p in order],
                ),
                strict=True,
            )
        ]


@dataclass
class Scored:
    batch: Batch  # this rank's completions as the reward functions saw them
    table: torch.Tensor  # [completions, F + 3]: this rank's rows filled


@dataclass
class StepBatch:
    """What every rank knows of the step's whole global batch after the all-reduce."""

    values: torch.Tensor  # [completions, F] each function's value (NaN: not applicable)
    rewards: torch.Tensor  # [completions] the weighted reward (NaN: no function applied)
    lengths: torch.Tensor  # [completions] completion tokens
    truncated: torch.Tensor  # [completions] 1.0 where the length cut the completion
    advantages: torch.Tensor  # [completions]
    denominator: int  # what the step's loss is a mean over (`grpo_losses.global_denominator`)
    completion_tokens: int

    @classmethod
    def of(cls, objective: GRPO, spec, table: torch.Tensor) -> StepBatch:
        n_f = table.shape[1] - 3
        rewards, lengths, truncated = table[:, n_f], table[:, n_f + 1], table[:, n_f + 2]
        kept = lengths * (1 - truncated) if objective.mask_truncated_completions else lengths
        counted = int((kept > 0).sum())
        denominator = losses.global_denominator(
            int(kept.sum()),
            counted,
            objective.loss_type,
            spec.rollout.max_completion_length,
        )
        advantages = losses.group_advantages(rewards, spec.rollout.num_generations, objective.scale_rewards)
        return cls(table[:, :n_f], rewards, lengths, truncated, advantages, int(denominator), int(lengths.sum()))

    def input_tokens(self, rollout: Rollout, job) -> int:
        n = len(self.lengths)
        prompt = sum(len(job.data.train.ids[rollout.prompt_of(c)]) for c in range(n))
        return prompt + self.completion_tokens

    def metrics(self, spec, functions: list) -> dict[str, float]:
        labels = [f.label for f in functions]
        rows = self.values.tolist()
        lengths = [int(n) for n in self.lengths.tolist()]
        truncated = [bool(t) for t in self.truncated.tolist()]
        return reward_metrics(rows, self.rewards.tolist(), labels, spec.rollout.num_generations) | length_metrics(
            lengths, truncated
        )


def eos_ids(job) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and the model's generation config's."""
    ids = {job.tokenizer.eos_token_id}
    config = getattr(job.model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list) else [extra])
    return sorted(i for i in ids if i is not None)


def write_rollout_lines(spec, ctx, step: int, lines: list[dict]) -> None:
    """Rank 0 writes the whole step's lines, in completion order (every rank's gathered)."""
    if ctx.world_size > 1:
        every: list = [None] * ctx.world_size
        dist.all_gather_object(every, lines)
        lines = [line for part in every for line in part]
    if ctx.is_main:
        write_rollouts(spec.output_path, step, sorted(lines, key=lambda line: line["position"]))


def collate_rollouts(prompts: list, completions: list, pad_id: int) -> dict:
    """One micro-batch of rollouts: rows prompt + completion, right-padded to the longest row (real
    tokens keep the positions of the unpadded row); the completion grid [B, C] (C the longest
    completion here) with `completion_mask`; `label_pos` (flat [B * L] position predicting each
    completion token), `label_ids`, and `slot` (its flat [B * C] place in the grid)."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    grid = max(1, max(len(c) for c in completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(prompts), width, dtype=torch.long)
    pos, labels, slot = [], [], []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor([*p, *c], dtype=torch.long)
        attention[i, : len(p) + len(c)] = 1
        pos += [i * width + len(p) + j - 1 for j in range(len(c))]
        labels += list(c)
        slot += [i * grid + j for j in range(len(c))]
    lengths = torch.tensor([len(c) for c in completions])
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "label_pos": torch.tensor(pos, dtype=torch.long),
        "label_ids": torch.tensor(labels, dtype=torch.long),
        "slot": torch.tensor(slot, dtype=torch.long),
        "completion_mask": (torch.arange(grid) < lengths.unsqueeze(1)).to(torch.float32),
    }


class GRPOLoss(nn.Module):
    """One micro-batch's share of the step's numerator (`grpo_losses.micro_batch_numerator`) and its
    statistics summed (`STATS`). The loop divides by the step's ONE denominator. The old
    log-probabilities are the current ones, detached (num_iterations 1: the ratio is 1, its
    gradient that of logp). With `beta` > 0 the reference forward runs first (eval mode, no grad,
    the adapters off -- or the frozen starting adapter active)."""

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

    def forward(self, input_ids, attention_mask, label_pos, label_ids, slot, completion_mask, advantages, truncated):
        o = self.objective
        tensors = (input_ids, attention_mask, label_pos, label_ids, slot, completion_mask)
        ref = self.reference_logps(*tensors) if o.beta else None
        logps = self.token_logps(*tensors)
        old = logps.detach()
        mask = losses.loss_mask(completion_mask.double(), truncated, o.mask_truncated_completions)
        adv = advantages.double()
        low, high, level = o.epsilon, o.epsilon_high, o.importance_sampling_level
        per_token = losses.per_token_loss(
            logps, old, adv, mask, epsilon=low, epsilon_high=high, beta=o.beta, ref_logps=ref, level=level
        )
        counts = losses.clip_counts(logps.detach(), old, adv, mask, epsilon=low, epsilon_high=high, level=level)
        kl = (losses.k3_kl(logps.detach(), ref) * mask).sum() if ref is not None else mask.new_zeros(())
        stats = torch.cat([counts.double(), kl.view(1), mask.sum().view(1)])
        return losses.micro_batch_numerator(per_token, mask, o.loss_type), stats
