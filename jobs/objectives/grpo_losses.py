"""The GRPO family's loss, pure functions of log-probabilities (issue 45; not wired into training
yet: no spec names it). TRL's names: `loss_type` dapo | grpo | dr_grpo, `epsilon` /
`epsilon_high`, `beta`, `scale_rewards` group | batch | none, `importance_sampling_level` token |
sequence (GSPO).

Invariant (what makes the step independent of the split): a loss type is a numerator summed over
the step's micro-batches and ranks, divided by ONE denominator counted over the whole global batch
before the window (`global_denominator`), exactly as SFT's label tokens and DPO's pairs
(`jobs.train.loop` module doc). The advantages are computed once per rollout batch over whole
groups (`group_advantages`), never per micro-batch. What each type is a mean over:

* dapo (default): every completion token of the global batch;
* grpo: each completion's token mean, then the mean over the global batch's completions;
* dr_grpo: the token sum over completions x `max_completion_length` (Dr. GRPO: no length bias).

TRL's `bnpo` (each micro-batch divided by its own token count, then averaged over accumulation
steps) is not one of them: its step depends on how the batch is split (tests show it)."""

from __future__ import annotations

from typing import Literal

import torch

LossType = Literal["dapo", "grpo", "dr_grpo"]
LOSS_TYPES: tuple[LossType, ...] = ("dapo", "grpo", "dr_grpo")
ADVANTAGE_EPS = 1e-4  # TRL: advantages / (std + 1e-4), so a group of equal rewards gives 0, not NaN


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """[completions] advantages of `rewards` ([prompts x num_generations], each prompt's group
    contiguous): the reward minus its group's mean, divided by the group's std (`group`), the
    whole batch's std (`batch`) or nothing (`none`); std with Bessel's correction, as TRL."""
    grouped = rewards.view(-1, num_generations)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    elif scale_rewards == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        raise ValueError(f"scale_rewards: {scale_rewards!r} is not group, batch or none")
    return centred / (std + ADVANTAGE_EPS)


def importance_log_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """log(pi / pi_old) per token (`token`), or each completion's token mean of it broadcast over
    its tokens (`sequence`, GSPO)."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        per_seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.unsqueeze(-1).expand_as(log_ratio)
    raise ValueError(f"importance_sampling_level: {level!r} is not token or sequence")


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    level: str = "token",
) -> torch.Tensor:
    """[completions, tokens] -min(w A, clip(w, 1-epsilon, 1+epsilon_high) A) + beta KL, where w is
    the importance weight and KL the k3 estimator exp(ref - logp) - (ref - logp) - 1 (Schulman);
    padding positions are whatever they are: the aggregations mask them."""
    high = epsilon if epsilon_high is None else epsilon_high
    weight = torch.exp(importance_log_weights(logps, old_logps, mask, level))
    adv = advantages.unsqueeze(-1)
    loss = -torch.min(weight * adv, torch.clamp(weight, 1 - epsilon, 1 + high) * adv)
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probabilities")
        delta = ref_logps - logps
        loss = loss + beta * (torch.exp(delta) - delta - 1)
    return loss


def micro_batch_numerator(per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType) -> torch.Tensor:
    """This micro-batch's share of the step's loss before the one global division: the masked
    token sum (dapo, dr_grpo) or the sum of each completion's token mean (grpo)."""
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type in ("dapo", "dr_grpo"):
        return masked.sum()
    raise ValueError(f"loss_type: {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")


def global_denominator(
    completion_tokens: int, completions: int, loss_type: LossType, max_completion_length: int
) -> float:
    """What the step's loss is a mean over, counted over the whole global batch (every rank's
    every micro-batch) before the window: tokens (dapo), completions (grpo) or completions x
    `max_completion_length` (dr_grpo). At least 1 (a batch of empty completions adds 0 / 1)."""
    by_type = {
        "dapo": completion_tokens,
        "grpo": completions,
        "dr_grpo": completions * max_completion_length,
    }
    if loss_type not in by_type:
        raise ValueError(f"loss_type: {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    return float(max(by_type[loss_type], 1))
