"""The preference objectives' per-pair loss (DPO, IPO, SimPO, ORPO) and the reward metrics TRL
reports, as pure functions of per-sequence log-probabilities (`jobs.objectives.preference` is the
objective around them).

For pair i (prompt x, chosen y_w, rejected y_l) the loop provides, as [P] tensors:

* `pi_w`, `pi_l`: the policy's *summed* log-probability of the chosen / rejected response tokens
  given the prompt, log pi(y|x) = sum_t log pi(y_t | x, y_<t);
* `ref_w`, `ref_l`: the same under the reference (DPO and IPO only): the base with the adapter
  off, the frozen starting adapter, or the precomputed values from the data cache;
* `n_w`, `n_l`: the number of response tokens (SimPO and ORPO length-normalize).

Each objective returns the loss of every pair. The loss of an optimizer step is the *mean over
all pairs of the global batch*: the loop sums per-pair losses over its micro-batches and scales by
world_size / pairs_in_the_global_batch (`jobs.train.step.train_window`), so the step does not depend on
how the global batch is split into workers x accumulation x micro-batch.

The definitions (docs/training.md writes them out):

* DPO (Rafailov et al. 2023; label smoothing as in cDPO / TRL's `sigmoid` loss):
  h = (pi_w - ref_w) - (pi_l - ref_l);  loss = -(1 - eps) log s(beta h) - eps log s(-beta h);
  with `rpo_alpha` alpha > 0 (RPO, Pang et al. 2024) plus alpha (-pi_w / n_w), the chosen
  response's per-token NLL, per pair (TRL averages it over the batch's chosen tokens).
* IPO (Azar et al. 2023, eq. 17): loss = (h - 1 / (2 beta))^2, h from *summed* log-probs as in
  the paper (TRL's `ipo` averages them over tokens instead).
* SimPO (Meng et al. 2024): a = pi / n (length-normalized);
  loss = -log s(beta (a_w - a_l) - gamma). No reference, no SFT term.
* ORPO (Hong et al. 2024): a = pi / n; log odds(y) = a - log(1 - exp(a));
  loss = -a_w - beta log s(log odds(y_w) - log odds(y_l)): the chosen response's per-token NLL
  plus beta (the paper's lambda) times the odds-ratio term, both per pair. (TRL's ORPOTrainer
  averages the NLL over the batch's tokens instead of per pair.)

Rewards, as TRL names and defines them: `rewards/chosen` = beta (pi_w - ref_w) for DPO/IPO,
beta a_w for SimPO/ORPO (likewise rejected); `rewards/margins` = chosen - rejected;
`rewards/accuracies` = the fraction of pairs with chosen > rejected.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

# The per-pair statistics summed over a window (then divided by its pair count): TRL's metric
# names, plus the objective's own terms.
STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
ORPO_STATS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


class PairSettings(Protocol):
    """What the losses read of a preference objective (`jobs.objectives.preference.PairObjective`):
    its resolved settings, None where it does not take one."""

    @property
    def name(self) -> str: ...
    @property
    def beta(self) -> float | None: ...
    @property
    def simpo_gamma(self) -> float | None: ...
    @property
    def label_smoothing(self) -> float | None: ...
    @property
    def rpo_alpha(self) -> float | None: ...
    @property
    def needs_reference(self) -> bool: ...
    @property
    def with_nll(self) -> bool: ...
    @property
    def stat_names(self) -> tuple[str, ...]: ...


def log1m_exp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a < 0, stable near 0 (log(-expm1(a))); a mean log-probability of
    exactly 0 (a certain response) is held a hair below it so the log odds stay finite."""
    return torch.log(-torch.expm1(a.clamp(max=-1e-7)))


def pair_losses(
    obj: PairSettings,
    pi_w: torch.Tensor,
    pi_l: torch.Tensor,
    n_w: torch.Tensor,
    n_l: torch.Tensor,
    ref_w: torch.Tensor | None = None,
    ref_l: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss of every pair [P], per-pair statistics {name: [P]}) for objective `obj`."""
    if obj.beta is None:
        raise ValueError(f"objective {obj.name} has no beta")
    beta = float(obj.beta)
    if obj.needs_reference:
        if ref_w is None or ref_l is None:
            raise ValueError(f"objective {obj.name} needs the reference log-probabilities")
        h = (pi_w - ref_w) - (pi_l - ref_l)
        if obj.name == "dpo":
            eps = obj.label_smoothing or 0.0
            loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
        else:  # ipo
            loss = (h - 1 / (2 * beta)) ** 2
        reward_w, reward_l = beta * (pi_w - ref_w), beta * (pi_l - ref_l)
        extra: dict[str, torch.Tensor] = {}
        if obj.with_nll:
            nll = -pi_w / n_w
            loss = loss + float(obj.rpo_alpha or 0.0) * nll
            extra = {"nll_loss": nll}
    else:
        a_w, a_l = pi_w / n_w, pi_l / n_l
        reward_w, reward_l = beta * a_w, beta * a_l
        extra = {}
        if obj.name == "simpo":
            if obj.simpo_gamma is None:
                raise ValueError("objective simpo has no simpo_gamma")
            loss = -F.logsigmoid(beta * (a_w - a_l) - float(obj.simpo_gamma))
        elif obj.name == "orpo":
            log_odds = (a_w - a_l) - (log1m_exp(a_w) - log1m_exp(a_l))
            ratio = F.logsigmoid(log_odds)
            loss = -a_w - beta * ratio
            extra = {"nll_loss": -a_w, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
        else:
            raise ValueError(f"not a preference objective: {obj.name}")
    stats = {
        "rewards/chosen": reward_w,
        "rewards/rejected": reward_l,
        "rewards/margins": reward_w - reward_l,
        "rewards/accuracies": (reward_w > reward_l).to(reward_w.dtype),
        "logps/chosen": pi_w,
        "logps/rejected": pi_l,
        **extra,
    }
    return loss, {k: v.detach() for k, v in stats.items()}


def summed_stats(obj: PairSettings, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-pair statistics summed over the pairs, as one float64 vector in `obj.stat_names`
    order (accumulated over a window's micro-batches, then all-reduced once with the loss)."""
    return torch.stack([stats[k].double().sum() for k in obj.stat_names])
