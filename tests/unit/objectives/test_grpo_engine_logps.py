"""The engine's log-probs beside the trainer's, and `rollout.importance_correction`, as the loop
runs them (`with_rollouts` -> `train_window`), with an engine that returns log-probs deliberately
0.3-1.5 nats off the trainer's (`grpo_rollouts.OffEngine`: vLLM's place, without vLLM):

* the split oracle: accumulation x micro-batch 1x16, 4x4 and 16x1 give the gradient of a big-batch
  loss written here, each token's policy-gradient term times min(exp(trainer - engine), cap) (the
  trainer's log-probs recomputed by a plain forward, the engine's read back from the rollouts
  file); the same reference without the weights is off, so the oracle can fail;
* `engine_logprob_gap/mean|max` is |trainer - engine| over every completion token of the global
  batch (a token mean, not of completions' or ranks' means), each completion's in its rollouts line;
  on two gloo ranks too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from gradtools import ROOT, grads, perturb_lora_b, rel_err, spawn
from grpo_rollouts import SMALL as GRPO_SMALL
from grpo_rollouts import completion_logps, likely_eos, off_engine_run, save_tiny_base, use_off_engine

from jobs.spec import load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import make_engine, set_up
from jobs.train.step import train_window

SPEC = ROOT / "examples" / "tiny-grpo.yaml"
CAP = 3.0
SMALL = [
    *GRPO_SMALL,
    "rollout.engine=vllm",
    "rollout.vllm_url=http://127.0.0.1:9",  # never asked: `use_off_engine` answers instead
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny_base(tmp_path_factory.mktemp("tiny-base"))


def overrides(base: Path, *more: str) -> list[str]:
    return [*SMALL, f"model.name={base}", *more]


def step_grads(base: Path, tmp: Path, *more: str):
    """(LoRA grads of step 0's window, the job, the window, the spec) with `OffEngine`'s rollouts."""
    spec = load_spec(SPEC, [*overrides(base, *more), f"run.output_dir={tmp}"])
    ctx = LocalContext(on_progress=lambda r: None)
    torch.manual_seed(0)
    job = set_up(spec, ctx)
    perturb_lora_b(job.model)  # B off zero: the policy is not the base, the KL term is not 0
    likely_eos(job)
    engine = make_engine(spec, ctx, job)
    window = job.objective.with_rollouts(spec, ctx, job, engine, 0, job.objective.plan_window(spec, ctx, job, 0))
    train_window(engine, window.micro_batches, window.denominator)
    return grads(job.model), job, window, spec


def rollout_lines(out: Path, step: int = 1) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines()]


def pairs(line: dict):
    """(trainer, engine) log-prob of each token of a rollouts line."""
    return zip(line["trainer_logprobs"], line["engine_logprobs"], strict=True)


def reference_loss(job, lines: list[dict], beta: float, weighted: bool = True) -> torch.Tensor:
    """dapo over the whole batch, one completion at a time, in float64: per token
    -A exp(logp - logp.detach()) * min(exp(trainer - engine), CAP) + beta k3 KL, the trainer's
    log-prob recomputed here (eval mode; lora.dropout is 0) and the engine's from the rollouts file."""
    from jobs.objectives.preference import adapters_off

    model = job.model
    model.eval()
    terms = []
    for line in lines:
        logp = completion_logps(model, line["prompt_ids"], line["completion_ids"])
        engine = torch.tensor(line["engine_logprobs"], dtype=torch.float64)
        weight = torch.clamp(torch.exp(logp.detach() - engine), max=CAP) if weighted else 1.0
        per_token = -line["advantage"] * torch.exp(logp - logp.detach()) * weight
        if beta:
            with torch.no_grad(), adapters_off(model):
                ref = completion_logps(model, line["prompt_ids"], line["completion_ids"])
            per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        terms.append(per_token)
    model.train()
    return sum(t.sum() for t in terms) / sum(len(t) for t in terms)


def reference_grads(job, lines, beta, weighted=True) -> dict:
    job.model.zero_grad(set_to_none=True)
    reference_loss(job, lines, beta, weighted).backward()
    return grads(job.model)


def independent_gaps(job, lines: list[dict]) -> list[list[float]]:
    """|trainer - engine| per token, the trainer's log-probs recomputed here."""
    job.model.eval()
    with torch.no_grad():
        own = [completion_logps(job.model, ln["prompt_ids"], ln["completion_ids"]).tolist() for ln in lines]
    job.model.train()
    pairs = zip(own, lines, strict=True)
    return [[abs(t - e) for t, e in zip(o, ln["engine_logprobs"], strict=True)] for o, ln in pairs]


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_every_split_with_the_importance_correction_is_the_big_batch_gradient(base, tmp_path, monkeypatch, beta):
    use_off_engine(monkeypatch)
    got, lines = {}, {}
    for micro in (16, 4, 1):
        more = [f"batch.micro_batch_size={micro}", f"objective.beta={beta}", "rollout.importance_correction=true"]
        got[micro], job, window, spec = step_grads(base, tmp_path / f"m{micro}", *more)
        lines[micro] = rollout_lines(spec.output_path)
    assert lines[16] == lines[4] == lines[1]  # the same completions and engine log-probs, whatever the split
    rows = lines[1]
    assert any(line["advantage"] != 0 for line in rows) and len({len(ln["completion_ids"]) for ln in rows}) > 1
    gaps = [g for row in independent_gaps(job, rows) for g in row]
    assert 0.3 - 1e-5 < min(gaps) and max(gaps) < 1.5 + 1e-5  # the engine is as far off as it was made
    weights = [math.exp(t - e) for ln in rows for t, e in pairs(ln)]
    assert max(weights) > CAP and min(weights) < 1  # the cap truncates some tokens, others weigh less
    want = reference_grads(job, rows, beta)
    for micro, g in got.items():
        assert rel_err(g, want) < 1e-5, (micro, rel_err(g, want))
    # the known wrong one: the same loss without the weights
    assert rel_err(got[1], reference_grads(job, rows, beta, weighted=False)) > 1e-2


def test_without_the_correction_the_loss_is_the_trainers_alone(base, tmp_path, monkeypatch):
    use_off_engine(monkeypatch)
    g, job, _, spec = step_grads(base, tmp_path, "batch.micro_batch_size=4")
    rows = rollout_lines(spec.output_path)
    assert rel_err(g, reference_grads(job, rows, 0.0, weighted=False)) < 1e-5
    assert rel_err(g, reference_grads(job, rows, 0.0)) > 1e-2


def test_the_gap_is_a_mean_over_the_batchs_completion_tokens_and_each_completions_is_in_its_line(
    base, tmp_path, monkeypatch
):
    use_off_engine(monkeypatch)
    _, job, window, spec = step_grads(base, tmp_path, "batch.micro_batch_size=4")
    rows = rollout_lines(spec.output_path)
    gaps = independent_gaps(job, rows)
    flat = [g for row in gaps for g in row]
    # fp32: the trainer's batched forward and the one-row recompute here agree to ~1e-6
    assert window.metrics["engine_logprob_gap/mean"] == pytest.approx(sum(flat) / len(flat), abs=1e-5)
    assert window.metrics["engine_logprob_gap/max"] == pytest.approx(max(flat), abs=1e-5)
    recorded = [abs(t - e) for ln in rows for t, e in pairs(ln)]  # the trainer's own, as the file holds them
    assert window.metrics["engine_logprob_gap/mean"] == pytest.approx(math.fsum(recorded) / len(recorded), rel=1e-12)
    for line, row in zip(rows, gaps, strict=True):
        assert len(line["trainer_logprobs"]) == len(line["engine_logprobs"]) == len(line["completion_ids"])
        assert line["engine_logprob_gap"]["mean"] == pytest.approx(sum(row) / len(row), abs=1e-5)
        assert line["engine_logprob_gap"]["max"] == pytest.approx(max(row), abs=1e-5)


REAL_ENGINE = "GRPO.rollout_engine"


def rollout_engine_name(rank: int, world: int) -> str:
    """The qualified name of the `GRPO.rollout_engine` this process trains with."""
    from jobs.objectives.grpo import GRPO

    return GRPO.rollout_engine.__qualname__


def test_on_two_gloo_ranks_the_gap_is_the_whole_batchs(base, tmp_path, monkeypatch):
    """2 workers x 2 accumulation x 4: each rank holds half the completions; the step's gap is the
    token mean over both halves (as the rollouts file, every rank's lines, gives it), and the same
    run on one worker trains the same completions to the same gap (fp32: 1e-6). Both processes
    that ran `off_engine_run` (pytest's own, and the pooled gloo ranks that run later tests) have
    the real `GRPO.rollout_engine` back after it."""
    monkeypatch.chdir(ROOT)
    runs = {}
    for w in (1, 2):
        out = tmp_path / f"W{w}"
        more = overrides(base, f"resources.num_workers={w}", "batch.micro_batch_size=4", "run.max_steps=1")
        more += ["run.checkpoint_every=0", "rollout.importance_correction=true"]
        spawn(off_engine_run, w, tmp_path / "spawn", str(SPEC), more, str(out)) if w > 1 else off_engine_run(
            0, 1, str(SPEC), more, str(out)
        )
        metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        runs[w] = (metrics, rollout_lines(out))
    assert rollout_engine_name(0, 1) == spawn(rollout_engine_name, 2, tmp_path / "spawn")[1] == REAL_ENGINE
    for metrics, rows in runs.values():
        flat = [abs(t - e) for ln in rows for t, e in pairs(ln)]
        assert metrics["engine_logprob_gap/mean"] == pytest.approx(math.fsum(flat) / len(flat), rel=1e-12)
        assert metrics["engine_logprob_gap/max"] == max(flat)
    (one, one_rows), (two, two_rows) = runs[1], runs[2]
    assert [ln["completion_ids"] for ln in one_rows] == [ln["completion_ids"] for ln in two_rows]
    assert two["engine_logprob_gap/mean"] == pytest.approx(one["engine_logprob_gap/mean"], abs=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
