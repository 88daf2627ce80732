"""The GRPO family's loss, pure functions of log-probabilities. TRL's names: `loss_type` dapo |
grpo | dr_grpo, `epsilon` / `epsilon_high`, `beta`, `scale_rewards` group | batch | none,
`importance_sampling_level` token | sequence (GSPO); `rollout.importance_correction` is TRL's
`vllm_importance_sampling_correction` (token-level truncate: `truncated_importance_weights`).

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


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The Bessel-corrected standard deviation of the values that are not NaN (TRL's `nanstd`);
    NaN with fewer than two."""
    keep = ~torch.isnan(x)
    count = keep.sum(dim=dim) if dim is not None else keep.sum()
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    variance = torch.nanmean((x - mean) ** 2, dim=dim) * count / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, float("nan"))).sqrt()


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """[completions] advantages of the WHOLE global batch's `rewards` ([prompts x num_generations],
    each prompt's group contiguous): the reward minus its group's mean, divided by (std + 1e-4) of
    its group (`group`) or of the batch (`batch`), or not divided (`none`); std with Bessel's
    correction, as TRL. A NaN reward (no reward function applied) is left out of every mean and
    std and gets advantage 0; a group with one scored completion has std 0 here (TRL's NaN would
    poison the batch)."""
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards: {scale_rewards!r} is not group, batch or none")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1, keepdim=True).nan_to_num(0.0)
    centred = (grouped - mean).reshape(-1)
    if scale_rewards == "none":
        return centred.nan_to_num(0.0)
    if scale_rewards == "group":
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = nanstd(rewards).expand_as(rewards)
    return (centred / (std.nan_to_num(0.0) + ADVANTAGE_EPS)).nan_to_num(0.0)


def loss_mask(completion_mask: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The tokens that carry loss [B, T]: the completion's tokens; none of a truncated
    completion's with `mask_truncated_completions` (DAPO's overlong filtering)."""
    if not mask_truncated:
        return completion_mask
    return completion_mask * (~truncated.bool()).to(completion_mask.dtype).unsqueeze(1)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - pi) - (ref - pi) - 1 (>= 0; Schulman)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


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
    sampling_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """[completions, tokens] -s min(w A, clip(w, 1-epsilon, 1+epsilon_high) A) + beta KL, where w is
    the importance weight, s the sampling correction (`truncated_importance_weights`; 1 without
    one: it multiplies the policy-gradient term only, as TRL's) and KL the k3 estimator
    exp(ref - logp) - (ref - logp) - 1 (Schulman); padding positions are whatever they are: the
    aggregations mask them."""
    high = epsilon if epsilon_high is None else epsilon_high
    weight = torch.exp(importance_log_weights(logps, old_logps, mask, level))
    adv = advantages.unsqueeze(-1)
    loss = -torch.min(weight * adv, torch.clamp(weight, 1 - epsilon, 1 + high) * adv)
    if sampling_weights is not None:
        loss = loss * sampling_weights
    if beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probabilities")
        loss = loss + beta * k3_kl(logps, ref_logps)
    return loss


@torch.no_grad()
def truncated_importance_weights(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_trainer / pi_engine, cap) per sampled token (TRL's token-level truncate): how much
    more likely the trainer's old policy finds the token than the engine that sampled it did, so
    the policy gradient of tokens an engine's numerics over-sampled is scaled down, and the few it
    under-sampled are scaled up at most `cap` times. A constant of the loss (no gradient)."""
    return torch.clamp(torch.exp(trainer_logps - engine_logps), max=cap)


@torch.no_grad()
def clip_counts(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    level: str,
) -> torch.Tensor:
    """[low, high, region]: the loss tokens whose ratio the clip holds (TRL's `clip_ratio/*`
    before dividing by the step's loss tokens): low w < 1 - epsilon with A < 0, high
    w > 1 + epsilon_high with A > 0, region either."""
    w = torch.exp(importance_log_weights(logps, old_logps, mask, level))
    a = advantages.unsqueeze(-1)
    low = (w < 1 - epsilon) & (a < 0)
    high = (w > 1 + epsilon_high) & (a > 0)
    return torch.stack([(m * mask).sum() for m in (low, high, low | high)])


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
