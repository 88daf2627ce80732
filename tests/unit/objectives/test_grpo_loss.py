"""GRPO-family loss oracles (`jobs.objectives.grpo_losses`), in fp64 on a fixed batch of rollouts
with ragged completion lengths: for every loss type x importance level, with and without the KL
term, with old log-probabilities that differ from the current ones (the ratio is not 1 and
clipping is active, as at a second iteration), the gradient accumulated over any split of the
global batch into ranks x micro-batches (1x1xN, 2x2xk, 4xkx1; ranks averaged as DDP does) equals
the big-batch gradient of a reference written here, independently, one completion and one token
at a time. TRL's `bnpo` per-micro-batch normalization fails the same oracle, so it can fail."""

from __future__ import annotations

import math

import pytest
import torch

from jobs.objectives.grpo_losses import (
    LOSS_TYPES,
    global_denominator,
    group_advantages,
    micro_batch_numerator,
    per_token_loss,
)

PROMPTS, G, T, V, D = 4, 4, 6, 5, 3
N = PROMPTS * G
MAX_COMPLETION = T
EPS, EPS_HIGH = 0.2, 0.28
SPLITS = [(1, 1, N), (2, 2, N // 4), (4, N // 4, 1)]  # ranks x micro-batches per rank x completions each


def _rollouts():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, T, D, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (N, T), generator=g)
    lengths = torch.tensor([1 + (i * 5) % T for i in range(N)])  # 1..6, ragged within every split
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    rewards = torch.randint(0, 3, (N,), generator=g).double() / 2
    theta = torch.randn(D, V, generator=g, dtype=torch.float64)
    old = theta + 0.6 * torch.randn(D, V, generator=g, dtype=torch.float64)  # ratio far from 1: clipping
    ref = theta + 0.3 * torch.randn(D, V, generator=g, dtype=torch.float64)
    return x, tokens, lengths, mask, rewards, theta, old, ref


X, TOKENS, LENGTHS, MASK, REWARDS, THETA, OLD, REF = _rollouts()


def logps(theta: torch.Tensor, rows: slice | list[int] = slice(None)) -> torch.Tensor:
    logits = X[rows] @ theta
    return torch.log_softmax(logits, -1).gather(-1, TOKENS[rows].unsqueeze(-1)).squeeze(-1)


# ---- the reference: scalar formulas, one completion and one token at a time -----------------


def reference_advantages(scale: str) -> list[float]:
    r = REWARDS.tolist()
    all_mean = sum(r) / N
    batch_std = math.sqrt(sum((v - all_mean) ** 2 for v in r) / (N - 1))
    out = []
    for p in range(PROMPTS):
        group = r[p * G : (p + 1) * G]
        mean = sum(group) / G
        std = math.sqrt(sum((v - mean) ** 2 for v in group) / (G - 1))
        div = {"group": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        out += [(v - mean) / div for v in group]
    return out


def reference_loss(theta, loss_type, level, beta, scale):
    lp, old, ref = logps(theta), logps(OLD).detach(), logps(REF).detach()
    adv = reference_advantages(scale)
    per_completion = []
    for i in range(N):
        n = int(LENGTHS[i])
        seq_log_w = sum(lp[i, t] - old[i, t] for t in range(n)) / n
        terms = []
        for t in range(n):
            w = torch.exp(lp[i, t] - old[i, t] if level == "token" else seq_log_w)
            clipped = torch.clamp(w, 1 - EPS, 1 + EPS_HIGH)
            term = -torch.minimum(w * adv[i], clipped * adv[i])
            d = ref[i, t] - lp[i, t]
            terms.append(term + beta * (torch.exp(d) - d - 1))
        per_completion.append((sum(terms), n))
    if loss_type == "dapo":
        return sum(s for s, _ in per_completion) / sum(n for _, n in per_completion)
    if loss_type == "grpo":
        return sum(s / n for s, n in per_completion) / N
    return sum(s for s, _ in per_completion) / (N * MAX_COMPLETION)


def reference_grad(loss_type, level, beta, scale):
    theta = THETA.clone().requires_grad_()
    (grad,) = torch.autograd.grad(reference_loss(theta, loss_type, level, beta, scale), theta)
    return grad


# ---- rayft's way: numerators per micro-batch, one global denominator, ranks averaged ---------


def _micro_loss(theta, rows, adv, loss_type, level, beta):
    per_tok = per_token_loss(
        logps(theta, rows),
        logps(OLD, rows),
        adv[rows],
        MASK[rows],
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        beta=beta,
        ref_logps=logps(REF, rows),
        level=level,
    )
    return per_tok, micro_batch_numerator(per_tok, MASK[rows], loss_type)


def split_grad(split, loss_type, level, beta, scale, normalization="global"):
    ranks, micro, k = split
    adv = group_advantages(REWARDS, G, scale)  # once, over whole groups, whatever the split
    den = global_denominator(int(MASK.sum()), N, loss_type, MAX_COMPLETION)
    per_rank = []
    for r in range(ranks):
        theta = THETA.clone().requires_grad_()
        total = torch.zeros((), dtype=torch.float64)
        for j in range(micro):
            rows = list(range((r * micro + j) * k, (r * micro + j + 1) * k))
            per_tok, numerator = _micro_loss(theta, rows, adv, loss_type, level, beta)
            if normalization == "global":
                total = total + numerator * ranks / den  # DDP averages over ranks: x ranks
            else:  # TRL's bnpo: each micro-batch by its own token count, then the mean over steps
                total = total + (per_tok * MASK[rows]).sum() / MASK[rows].sum() / micro
        per_rank.append(torch.autograd.grad(total, theta)[0])
    return sum(per_rank) / ranks


CASES = [
    (loss_type, level, beta, scale)
    for loss_type in LOSS_TYPES
    for level in ("token", "sequence")
    for beta in (0.0, 0.04)
    for scale in ("group",)
] + [("dapo", "token", 0.0, "batch"), ("grpo", "token", 0.04, "none")]


@pytest.mark.parametrize("loss_type,level,beta,scale", CASES)
def test_every_split_gives_the_big_batch_gradient(loss_type, level, beta, scale):
    want = reference_grad(loss_type, level, beta, scale)
    assert want.abs().max() > 1e-3  # a real gradient
    for split in SPLITS:
        got = split_grad(split, loss_type, level, beta, scale)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (split, (got - want).abs().max())


def test_clipping_is_active_in_the_oracle():
    """The oracle covers the clipped branch: on some tokens min() picks the clipped term."""
    w = torch.exp(logps(THETA) - logps(OLD))
    adv = group_advantages(REWARDS, G).unsqueeze(-1)
    clipped = torch.clamp(w, 1 - EPS, 1 + EPS_HIGH) * adv
    chosen = (clipped < w * adv) & (MASK > 0)
    assert int(chosen.sum()) >= 5


def test_bnpo_per_micro_batch_normalization_fails_the_oracle():
    """TRL's documented `bnpo` (a micro-batch's mean over its own tokens, averaged over the
    accumulation steps): the same as dapo in one piece, another step once the batch is split."""
    want = reference_grad("dapo", "token", 0.0, "group")
    assert torch.allclose(split_grad((1, 1, N), "dapo", "token", 0.0, "group", "bnpo"), want, rtol=1e-10)
    got = split_grad((2, 2, N // 4), "dapo", "token", 0.0, "group", "bnpo")
    assert (got - want).norm() / want.norm() > 1e-2


def test_advantages_follow_trl():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    adv = group_advantages(rewards, 4)
    assert torch.allclose(adv[4:], torch.zeros(4, dtype=torch.float64))  # equal rewards: no signal, no NaN
    first = rewards[:4]
    assert torch.allclose(adv[:4], (first - first.mean()) / (first.std() + 1e-4))
    assert torch.allclose(group_advantages(rewards, 4, "none"), torch.cat([first - first.mean(), torch.zeros(4)]))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 4, "groups")


def test_denominators_count_the_global_batch():
    assert global_denominator(37, 8, "dapo", 16) == 37
    assert global_denominator(37, 8, "grpo", 16) == 8
    assert global_denominator(37, 8, "dr_grpo", 16) == 128
    assert global_denominator(0, 8, "dapo", 16) == 1  # every completion empty: 0 / 1
    with pytest.raises(ValueError, match="loss_type"):
        global_denominator(1, 1, "bnpo", 1)  # type: ignore[arg-type]


def test_the_sampling_correction_is_a_truncated_weight_on_the_policy_gradient_term_only():
    """min(exp(trainer - engine), cap) per token, a constant (no gradient), multiplying
    -min(w A, clip(w) A) and not the KL term (TRL's order)."""
    from jobs.objectives.grpo_losses import truncated_importance_weights

    trainer = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    engine = torch.tensor([[-2.5, -1.5, -0.5]], dtype=torch.float64)
    w = truncated_importance_weights(trainer, engine, 3.0)
    assert w[0].tolist() == pytest.approx([3.0, math.exp(-0.5), 1.0]) and not w.requires_grad
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref, adv, mask = torch.full((1, 3), -1.2, dtype=torch.float64), torch.tensor([0.7], dtype=torch.float64), None
    plain = per_token_loss(logp, logp.detach(), adv, mask, beta=0.1, ref_logps=ref)
    weighted = per_token_loss(logp, logp.detach(), adv, mask, beta=0.1, ref_logps=ref, sampling_weights=w)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    assert torch.allclose(weighted, (plain - 0.1 * kl) * w + 0.1 * kl)
