"""One rollout batch of the GRPO family: sampled, scored and gathered so that every rank holds the
whole global batch (`RolloutBatch`), then cut into each rank's micro-batches of every optimizer
step that trains on it (`RolloutBatch.micro_batches`).

Why every rank holds it all: the advantages are normalized over whole groups and the loss's one
denominator counts the whole global batch, both before the window (`jobs.objectives.grpo` module
doc); and with `num_iterations` > 1 the same batch is trained on again at the next steps, and a
checkpoint taken between them must hold it whole, so a resume on any number of workers continues
with exactly these completions and their old log-probabilities (`state`, `from_state`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from jobs.errors import RunError
from jobs.memory.generation import OLD_LOGPROBS_ROWS
from jobs.objectives import grpo_losses as losses
from jobs.objectives.base import all_reduce_sum
from jobs.rollout.engine import Completion, HFEngine, Request, RolloutEngine, Sampling, sample_seed
from jobs.rollout.record import (
    length_metrics,
    logprob_fields,
    logprob_gap_metrics,
    reward_metrics,
    rollout_lines,
    write_rollouts,
)
from jobs.rollout.rewards import Batch, completions_as_trl, score

if TYPE_CHECKING:
    from jobs.spec import JobSpec


@dataclass
class RolloutBatch:
    """The global batch of completions of rollout batch `index` (completion c: sample c % G of
    prompt c // G), as every rank holds it after `sample`."""

    index: int  # the rollout batch: optimizer step // num_iterations
    prompt_indices: list[int]  # [P] into the prompt set
    num_generations: int
    ids: list[list[int]]  # [N] each completion's sampled ids (what is trained on)
    table: torch.Tensor  # [N, F + 3] float64: each function's value, the reward, length, truncated
    old_logps: list[list[float]] | None  # [N] per token, the policy's when sampled (num_iterations > 1)
    generation_s: float = 0.0  # this rank's time generating, scoring (rewards_s) and gathering
    rewards_s: float = 0.0
    engine_metrics: dict = field(default_factory=dict)  # an engine's own (vLLM: the adapter sync's)
    # [N] per token, where the engine returns its log-probs (vLLM): the engine's, and the trainer's
    # (the policy that sampled, eval mode; `old_logps` itself when num_iterations > 1)
    engine_logps: list[list[float]] | None = None
    trainer_logps: list[list[float]] | None = None

    def prompt_of(self, position: int) -> int:
        return self.prompt_indices[position // self.num_generations]

    @property
    def n_functions(self) -> int:
        return self.table.shape[1] - 3

    @property
    def rewards(self) -> torch.Tensor:
        return self.table[:, self.n_functions]

    @property
    def lengths(self) -> torch.Tensor:
        return self.table[:, self.n_functions + 1]

    @property
    def truncated(self) -> torch.Tensor:
        return self.table[:, self.n_functions + 2]

    def advantages(self, scale_rewards: str) -> torch.Tensor:
        return losses.group_advantages(self.rewards, self.num_generations, scale_rewards)

    def denominator(self, objective, max_completion_length: int) -> int:
        """What the step's loss is a mean over (`grpo_losses.global_denominator`): a completion
        whose every token is masked (`mask_truncated_completions`) counts in none."""
        kept = self.lengths * (1 - self.truncated) if objective.mask_truncated_completions else self.lengths
        counted = int((kept > 0).sum())
        return int(losses.global_denominator(int(kept.sum()), counted, objective.loss_type, max_completion_length))

    def input_tokens(self, prompts) -> int:
        """Input tokens of the whole batch: each completion with its prompt."""
        return sum(len(prompts.ids[self.prompt_of(c)]) for c in range(len(self.ids))) + int(self.lengths.sum())

    def metrics(self, labels: list[str]) -> dict[str, float]:
        """TRL's rollout metrics over the whole batch (`jobs.rollout.record`), and the time split."""
        n_f = self.n_functions
        rows = self.table[:, :n_f].tolist()
        lengths = [int(n) for n in self.lengths.tolist()]
        out = reward_metrics(rows, self.rewards.tolist(), labels, self.num_generations)
        out |= length_metrics(lengths, [bool(t) for t in self.truncated.tolist()])
        if self.engine_logps is not None and self.trainer_logps is not None:
            out |= logprob_gap_metrics(self.trainer_logps, self.engine_logps)
        return out | {"time/generation_s": self.generation_s, "time/rewards_s": self.rewards_s} | self.engine_metrics

    def micro_batches(
        self, prompts, pad_id: int, positions: list[np.ndarray], scale_rewards: str, cap: float | None = None
    ) -> list[dict]:
        """`GRPOLoss.forward`'s keyword tensors for each micro-batch of completion `positions`; with
        `cap` (`rollout.importance_correction`), each token's truncated importance weight."""
        advantages = self.advantages(scale_rewards)
        out = []
        for mb in positions:
            pos = [int(p) for p in mb]
            batch = collate_rollouts([prompts.ids[self.prompt_of(p)] for p in pos], [self.ids[p] for p in pos], pad_id)
            index = torch.as_tensor(pos)
            batch["advantages"], batch["truncated"] = advantages[index], self.truncated[index]
            if self.old_logps is not None:
                batch["old_logps"] = grid_of([self.old_logps[p] for p in pos], batch["completion_mask"].shape)
            if cap is not None:
                batch["sampling_weights"] = self.sampling_weights(pos, batch["completion_mask"].shape, cap)
            out.append(batch)
        return out

    def sampling_weights(self, positions: list[int], shape: torch.Size, cap: float) -> torch.Tensor:
        """[B, C] min(exp(trainer - engine log-prob), cap) of the completions at `positions`."""
        if self.engine_logps is None or self.trainer_logps is None:
            raise RunError("rollout.importance_correction: the rollout engine returned no log-probs to correct for")
        trainer = grid_of([self.trainer_logps[p] for p in positions], shape)
        engine = grid_of([self.engine_logps[p] for p in positions], shape)
        return losses.truncated_importance_weights(trainer, engine, cap)

    def state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (`torch.save`, read back with `weights_only`)."""
        return {
            "index": self.index,
            "prompt_indices": self.prompt_indices,
            "num_generations": self.num_generations,
            "ids": self.ids,
            "table": self.table,
            "old_logps": self.old_logps,
            "engine_logps": self.engine_logps,
            "trainer_logps": self.trainer_logps,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RolloutBatch:
        return cls(**state)


def grid_of(rows: list[list[float]], shape: torch.Size) -> torch.Tensor:
    """Per-token values of each completion on the [B, C] completion grid, 0 beyond each one."""
    out = torch.zeros(shape, dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return out


# ---- sampling one rollout batch -----------------------------------------------------------------


def sample(
    objective, spec: JobSpec, ctx, job, engine, index: int, positions: np.ndarray, logged: bool = True
) -> RolloutBatch:
    """Rollout batch `index`: this rank generates and scores the completions at `positions`, then
    every rank gathers the whole batch (one all-reduce of the table, one all-gather of the ids and,
    with num_iterations > 1 or an engine that returns log-probs, of the trainer's log-probabilities
    and the engine's: `whole_batch`), and rank 0 writes its rollouts file (when `logged`:
    `run.log_rollouts_every`)."""
    mu, g = spec.online.objective.num_iterations, spec.online.rollout.num_generations
    prompt_indices = [int(p) for p in job.batches.index_array(index * mu)]
    start = time.perf_counter()
    rollout = objective.rollout_engine(spec, ctx, job, engine, index * mu)
    done = generate(rollout, job, spec, index, prompt_indices, positions)
    scored_at = time.perf_counter()
    batch, values, rewards = scored(objective.functions(spec), spec, job, prompt_indices, positions, done)
    table = _rows(len(prompt_indices) * g, positions, done, values, rewards)
    rewards_s = time.perf_counter() - scored_at
    table = all_reduce_sum(table.to(engine.device), ctx.world_size).cpu()
    objective.rollouts_generated(ctx)  # every rank has generated (the all-reduce): the engine may rest
    trainer = mu > 1 or rollout.returns_logprobs  # the trainer's log-probs: old ones, or beside the engine's
    whole = whole_batch(ctx, engine, job, (prompt_indices, positions, g), done, trainer, rollout.returns_logprobs)
    old = whole["trainer"] if mu > 1 else None
    out = RolloutBatch(index, prompt_indices, g, whole["ids"], table, old, scored_at - start, rewards_s)
    out.engine_logps, out.trainer_logps = whole["engine"], whole["trainer"]
    out.engine_metrics = dict(getattr(rollout, "sync_metrics", {}))
    if logged:
        lines = _lines(
            out, batch, positions, out.advantages(objective.scale_rewards), spec.online.reward.labels, job.data.train
        )
        write_rollout_lines(spec, ctx, index * mu + 1, lines)
    return out


def _rows(n: int, positions: np.ndarray, done: list[Completion], values, rewards) -> torch.Tensor:
    """The global [n, F + 3] table with this rank's rows filled (each function's value, the reward,
    the length, truncated), zeros elsewhere: summed over ranks, every row is its owner's."""
    n_f = len(values[0]) if values else 0
    table = torch.zeros(n, n_f + 3, dtype=torch.float64)
    for i, pos in enumerate(positions.tolist()):
        c = done[i]
        table[pos] = torch.tensor([*values[i], rewards[i], len(c.ids), float(c.truncated)], dtype=torch.float64)
    return table


def generate(
    rollout: RolloutEngine, job, spec: JobSpec, index: int, prompt_indices: list[int], positions: np.ndarray
) -> list[Completion]:
    """This rank's completions, in `positions` order, each from its own seed (run seed, rollout
    batch, prompt, sample), from the objective's engine (`GRPO.rollout_engine`)."""
    g, seed = spec.online.rollout.num_generations, spec.run.seed
    requests = []
    for pos in positions.tolist():
        p, j = prompt_indices[pos // g], pos % g
        requests.append(Request(p, j, tuple(job.data.train.ids[p]), sample_seed(seed, index, p, j)))
    return rollout.generate(requests, Sampling.of(spec.online.rollout))


class InLossForward:
    """`HFEngine` run through the loss module's forward (`GRPOLoss.forward`'s `call`: under FSDP the
    root's hooks run first), without gradients: in-process rollouts as a `RolloutEngine`."""

    returns_logprobs = False

    def __init__(self, hf: HFEngine, engine):
        self.hf, self.engine = hf, engine

    def generate(self, requests: Sequence[Request], sampling: Sampling) -> list[Completion]:
        # Under the run's autocast, as the training forward: with bf16/fp16 the LoRA weights the
        # loop keeps in that dtype meet fp32 activations otherwise (a dtype error in the first step).
        with torch.no_grad(), self.engine.autocast():
            return self.engine.unwrapped(call=lambda _: self.hf.generate(requests, sampling))


def scored(
    functions: list, spec: JobSpec, job, prompt_indices: list[int], positions: np.ndarray, done: list[Completion]
):
    """(the Batch the reward functions saw, values [completion][function], rewards) of this rank's."""
    prompts, g = job.data.train, spec.online.rollout.num_generations
    records = [prompt_indices[pos // g] for pos in positions.tolist()]
    ids = [list(c.ids) for c in done]
    keys = sorted({k for r in records for k in prompts.columns[r]})
    batch = Batch(
        [prompts.prompts[r] for r in records],
        completions_as_trl(job.tokenizer, ids, prompts.conversational),
        ids,
        records,
        {k: [prompts.columns[r].get(k) for r in records] for k in keys},
    )
    values, rewards = score(functions, batch, spec.online.reward.timeout_s)
    return batch, values, rewards


@torch.no_grad()
def old_logps(engine, job, prompts, prompt_indices, positions, done, g: int) -> list[list[float]]:
    """The policy's per-token log-probabilities of this rank's completions as sampled, computed once
    by the trainer (eval mode: no dropout) and frozen for the rollout batch's later iterations."""
    module = engine.unwrapped
    was_training = job.model.training
    job.model.eval()
    out: list[list[float]] = []
    try:
        for s in range(0, len(done), OLD_LOGPROBS_ROWS):
            chunk = done[s : s + OLD_LOGPROBS_ROWS]
            pos = positions.tolist()[s : s + OLD_LOGPROBS_ROWS]
            batch = collate_rollouts([prompts.ids[prompt_indices[p // g]] for p in pos], [c.ids for c in chunk], 0)
            keys = ("input_ids", "attention_mask", "label_pos", "label_ids", "slot", "completion_mask")
            tensors = [batch[k].to(engine.device) for k in keys]
            with engine.autocast():
                grid = module(call=lambda loss, tensors=tensors: loss.token_logps(*tensors))
            out += [grid[i, : len(c.ids)].tolist() for i, c in enumerate(chunk)]
    finally:
        job.model.train(was_training)
    return out


def gathered(mine: dict, world_size: int) -> list[dict]:
    if world_size == 1:
        return [mine]
    every: list = [None] * world_size
    dist.all_gather_object(every, mine)
    return every


def whole_batch(ctx, engine, job, where: tuple, done: list[Completion], trainer: bool, with_engine: bool) -> dict:
    """Every rank's completions of the batch, by position: `ids`, and (else None) `trainer`, the
    trainer's log-probs of them (`old_logps`: one no-grad forward), and `engine`, the engine's own.
    `where` is (the batch's prompt indices, this rank's positions, num_generations)."""
    prompt_indices, positions, g = where
    mine = {
        "positions": positions.tolist(),
        "ids": [list(c.ids) for c in done],
        "trainer": old_logps(engine, job, job.data.train, prompt_indices, positions, done, g) if trainer else None,
        "engine": [list(c.logprobs or ()) for c in done] if with_engine else None,
    }
    parts = gathered(mine, ctx.world_size)
    return {key: _whole(parts, len(prompt_indices) * g, key) for key in ("ids", "trainer", "engine")}


def _whole(parts: list[dict], n: int, key: str) -> list | None:
    """Completion position -> its `key` value from the rank that holds it; None where not gathered."""
    if parts[0][key] is None:
        return None
    out: list = [None] * n
    for part in parts:
        for i, pos in enumerate(part["positions"]):
            out[pos] = part[key][i]
    return out


def _lines(out: RolloutBatch, batch: Batch, positions: np.ndarray, advantages, labels, prompts) -> list[dict]:
    """This rank's lines of the rollouts file (`jobs.rollout.record.rollout_lines`), each with its
    position in the batch (rank 0 orders them by it)."""
    order = positions.tolist()
    n_f = out.n_functions
    lines = rollout_lines(
        batch.records,
        batch.prompts,
        [prompts.ids[r] for r in batch.records],
        batch.completions,
        batch.completion_ids,
        [bool(out.truncated[p]) for p in order],
        [out.table[p, :n_f].tolist() for p in order],
        labels,
        [float(out.rewards[p]) for p in order],
        [float(advantages[p]) for p in order],
    )
    return [dict(line, **_logprob_fields(out, p), position=p) for p, line in zip(order, lines, strict=True)]


def _logprob_fields(out: RolloutBatch, position: int) -> dict:
    """The rollouts line's engine and trainer log-probs and their gap, where the engine returns some."""
    if out.engine_logps is None or out.trainer_logps is None:
        return {}
    return logprob_fields(out.trainer_logps[position], out.engine_logps[position])


def write_rollout_lines(spec: JobSpec, ctx, step: int, lines: list[dict]) -> None:
    """Rank 0 writes the whole batch's lines, in completion order (every rank's gathered), as
    `rollouts/step-NNNNNN.jsonl` of the first optimizer step that trains on them."""
    lines = [line for part in gathered({"lines": lines}, ctx.world_size) for line in part["lines"]]
    if ctx.is_main:
        write_rollouts(spec.output_path, step, sorted(lines, key=lambda line: line["position"]))


def eos_ids(job) -> list[int]:
    """The tokens that end a run's completions (`end_ids` of its tokenizer and model)."""
    return end_ids(job.tokenizer, job.model)


def end_ids(tokenizer, model) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and the model's generation config's
    (the one rule for training's rollouts, its held-out answers and `rayft eval`'s)."""
    ids = {tokenizer.eos_token_id}
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list) else [extra])
    return sorted(i for i in ids if i is not None)


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
