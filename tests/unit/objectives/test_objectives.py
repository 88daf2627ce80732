"""The preference objectives' per-pair losses and TRL's reward metrics (`jobs.objectives`), against
scalar formulas written independently here from the papers (python `math`, one pair at a time),
and the spec's `objective` section: defaults, and keys refused where they do not apply."""

from __future__ import annotations

import math

import pytest
import torch

from jobs.errors import SpecError
from jobs.objectives import Objective, pair_losses, summed_stats
from jobs.spec import load_spec

DEMO = "examples/tiny-lora.yaml"


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def reference_loss(
    name: str,
    beta: float,
    pw: float,
    pl: float,
    nw: int,
    nl: int,
    rw: float,
    rl: float,
    eps: float = 0.0,
    gamma: float = 0.5,
    alpha: float = 0.0,
) -> float:
    if name == "dpo":
        h = (pw - rw) - (pl - rl)
        return -(1 - eps) * logsig(beta * h) - eps * logsig(-beta * h) + alpha * (-pw / nw)
    if name == "ipo":
        h = (pw - rw) - (pl - rl)
        return (h - 1 / (2 * beta)) ** 2
    aw, al = pw / nw, pl / nl
    if name == "simpo":
        return -logsig(beta * (aw - al) - gamma)
    odds = (aw - math.log(1 - math.exp(aw))) - (al - math.log(1 - math.exp(al)))
    return -aw - beta * logsig(odds)


PAIRS = [  # (pi_w, pi_l, n_w, n_l, ref_w, ref_l): summed log-probs and response lengths
    (-12.0, -15.5, 6, 7, -13.0, -14.0),
    (-3.25, -2.5, 2, 3, -3.0, -2.75),
    (-40.0, -41.0, 20, 9, -39.5, -42.0),
    (-0.7, -9.0, 1, 4, -0.9, -8.0),
]


def tensors():
    cols = list(zip(*PAIRS, strict=True))
    return [torch.tensor(c, dtype=torch.float64) for c in cols]


@pytest.mark.parametrize(
    "name,kw",
    [
        ("dpo", {}),
        ("dpo", {"label_smoothing": 0.2}),
        ("dpo", {"rpo_alpha": 0.5}),
        ("dpo", {"rpo_alpha": 2.0, "label_smoothing": 0.1}),
        ("ipo", {}),
        ("simpo", {"simpo_gamma": 0.5}),
        ("simpo", {"simpo_gamma": 1.5}),
        ("orpo", {}),
    ],
)
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_each_objective_matches_its_formula_pair_by_pair(name, kw, beta):
    obj = Objective(
        name,
        beta,
        kw.get("simpo_gamma"),
        kw.get("label_smoothing"),
        "adapter_off" if name in ("dpo", "ipo") else None,
        kw.get("rpo_alpha"),
    )
    pw, pl, nw, nl, rw, rl = tensors()
    loss, stats = pair_losses(obj, pw, pl, nw, nl, rw, rl)
    want = [
        reference_loss(
            name,
            beta,
            *p,
            eps=kw.get("label_smoothing", 0.0),
            gamma=kw.get("simpo_gamma", 0.5),
            alpha=kw.get("rpo_alpha", 0.0),
        )
        for p in PAIRS
    ]
    assert loss.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    if name in ("dpo", "ipo"):
        chosen = [beta * (p[0] - p[4]) for p in PAIRS]
        rejected = [beta * (p[1] - p[5]) for p in PAIRS]
    else:
        chosen = [beta * p[0] / p[2] for p in PAIRS]
        rejected = [beta * p[1] / p[3] for p in PAIRS]
    assert stats["rewards/chosen"].tolist() == pytest.approx(chosen)
    assert stats["rewards/rejected"].tolist() == pytest.approx(rejected)
    assert stats["rewards/margins"].tolist() == pytest.approx([c - r for c, r in zip(chosen, rejected, strict=True)])
    assert stats["rewards/accuracies"].tolist() == [float(c > r) for c, r in zip(chosen, rejected, strict=True)]
    assert 0 < sum(stats["rewards/accuracies"].tolist()) < len(PAIRS)  # the data has both outcomes
    if kw.get("rpo_alpha"):
        assert stats["nll_loss"].tolist() == pytest.approx([-p[0] / p[2] for p in PAIRS])
    sums = summed_stats(obj, stats)
    assert sums[obj.stat_names.index("rewards/margins")].item() == pytest.approx(sum(chosen) - sum(rejected))


def test_dpo_at_the_reference_is_log_2_and_its_gradient_favours_the_chosen_response():
    obj = Objective("dpo", 0.1, None, 0.0, "adapter_off")
    pw = torch.tensor([-5.0], dtype=torch.float64, requires_grad=True)
    pl = torch.tensor([-5.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-5.0], dtype=torch.float64)
    loss, _ = pair_losses(obj, pw, pl, torch.ones(1), torch.ones(1), ref, ref)
    assert loss.item() == pytest.approx(math.log(2))
    loss.sum().backward()
    assert pw.grad.item() == pytest.approx(-0.05) and pl.grad.item() == pytest.approx(0.05)  # -beta/2, +beta/2


def test_orpo_stays_finite_when_the_chosen_response_is_certain():
    obj = Objective("orpo", 0.1)
    z = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    loss, _ = pair_losses(obj, z, torch.tensor([-3.0], dtype=torch.float64), torch.ones(1), torch.ones(1))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(z.grad).all()


def test_a_reference_objective_without_reference_log_probs_is_refused():
    with pytest.raises(ValueError, match="needs the reference"):
        pair_losses(Objective("dpo", 0.1, None, 0.0, "adapter_off"), *tensors()[:4])


def test_the_spec_applies_defaults_only_to_the_keys_an_objective_reads():
    assert Objective.of(load_spec(DEMO, files=False)) == Objective("sft")
    dpo = Objective.of(load_spec(DEMO, ["objective.name=dpo"], files=False))
    assert dpo == Objective("dpo", 0.1, None, 0.0, "adapter_off", 0.0)
    rpo = Objective.of(load_spec(DEMO, ["objective.name=dpo", "objective.rpo_alpha=1"], files=False))
    assert rpo.with_nll and rpo.stat_names[-1] == "nll_loss" and not dpo.with_nll
    simpo = Objective.of(load_spec(DEMO, ["objective.name=simpo", "objective.beta=2.5"], files=False))
    assert simpo == Objective("simpo", 2.5, 0.5, None, None)
    assert Objective.of(load_spec(DEMO, ["objective.name=orpo"], files=False)) == Objective("orpo", 0.1)


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["objective.beta=0.2"], "beta does not apply to objective.name=sft"),
        (
            ["objective.name=simpo", "objective.reference=precomputed"],
            "reference does not apply to objective.name=simpo",
        ),
        (["objective.name=orpo", "objective.reference=adapter_off"], "reference does not apply to objective.name=orpo"),
        (
            ["objective.name=ipo", "objective.label_smoothing=0.1"],
            "label_smoothing does not apply to objective.name=ipo",
        ),
        (["objective.name=dpo", "objective.simpo_gamma=1"], "simpo_gamma does not apply to objective.name=dpo"),
        (["objective.name=ipo", "objective.rpo_alpha=1"], "rpo_alpha does not apply to objective.name=ipo"),
        (["objective.name=dpo", "objective.rpo_alpha=-1"], "objective.rpo_alpha"),
        (["objective.name=dpo", "objective.label_smoothing=0.5"], "objective.label_smoothing"),
        (["objective.name=dpo", "objective.beta=0"], "objective.beta"),
        (["objective.name=kto"], "objective.name"),
        (["objective.name=dpo", "data.packing=true"], "data.packing is not available with objective.name=dpo"),
    ],
)
def test_keys_that_do_not_apply_are_refused_in_one_line(overrides, says):
    with pytest.raises(SpecError) as e:
        load_spec(DEMO, overrides, files=False)
    assert says in str(e.value) and "\n" not in str(e.value)
