"""Shared pieces of the GRPO step oracles (importable by spawned ranks): a model that ends its
completions at varied lengths, the trainer's log-probs of a completion by one plain forward, a
saved tiny base (`rollout.engine: vllm` specs serve a saved model), and `OffEngine`: a rollout
engine that returns its own log-probs, as vLLM does, deliberately 0.3-1.5 nats off the trainer's."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch

# The small GRPO run of the step oracles: tiny-llama, 4 prompts x 4 completions a step, the reward
# of `rewards_tiny.ids_mod_5` (it differs between one prompt's completions).
SMALL = [
    "resources.num_workers=1",
    "rollout.max_completion_length=12",
    "data.max_seq_len=96",
    "lora.r=4",
    "lora.alpha=8",
    "rollout.num_generations=4",
    "batch.global_batch_size=16",
    f"reward.functions=[{{fn: '{Path(__file__).resolve().parent / 'rewards_tiny.py'}:ids_mod_5'}}]",
]


def likely_eos(job) -> None:
    """The frozen head's EOS row made a copy of the row of the token the model likes most after a
    prompt, so completions end at EOS at varied lengths (the random tiny-llama almost never ends one)."""
    head = job.model.get_output_embeddings()
    with torch.no_grad():
        ids = torch.tensor([job.data.train.ids[0]])
        liked = int(job.model(input_ids=ids).logits[0, -1].argmax())
        head.weight[job.tokenizer.eos_token_id] = head.weight[liked]


def completion_logps(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """[C] log p(completion token | everything before it), from one plain forward of one row."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids).view(-1, 1)).view(-1)


def save_tiny_base(out: Path) -> Path:
    """The built-in tiny Llama (random, seeded) saved with its byte tokenizer: a model directory."""
    from transformers import LlamaForCausalLM

    from jobs.model.loading import byte_tokenizer, tiny_llama_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def offsets(seed: int, n: int) -> list[float]:
    """n offsets in +-[0.3, 1.5] nats, signs mixed, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    size = 0.3 + 1.2 * torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (size * sign).tolist()


class OffEngine:
    """The in-process engine's completions, each with engine log-probs: the policy's own (a plain
    eval forward) plus `offsets` drawn from the completion's seed -- what an engine whose numerics
    are far off the trainer's would return."""

    returns_logprobs = True

    def __init__(self, inner, model):
        self.inner, self.model = inner, model

    def generate(self, requests: Sequence, sampling) -> list:
        done = self.inner.generate(requests, sampling)
        return [dataclasses.replace(c, logprobs=self.logprobs(r, c)) for r, c in zip(requests, done, strict=True)]

    @torch.no_grad()
    def logprobs(self, request, completion) -> tuple[float, ...]:
        was_training = self.model.training
        self.model.eval()
        own = completion_logps(self.model, list(request.prompt_ids), list(completion.ids)).tolist()
        self.model.train(was_training)
        return tuple(o + d for o, d in zip(own, offsets(request.seed, len(own)), strict=True))


def off_rollout_engine(self, spec, ctx, job, engine, step):
    """`GRPO.rollout_engine` as `use_off_engine` sets it: an `OffEngine` over the in-process engine."""
    from jobs.objectives import grpo_batch
    from jobs.rollout.engine import HFEngine

    hf = HFEngine(job.model, grpo_batch.eos_ids(job), job.tokenizer.pad_token_id, synced=job.strategy == "fsdp")
    return OffEngine(grpo_batch.InLossForward(hf, engine), job.model)


def use_off_engine(monkeypatch) -> None:
    """`GRPO.rollout_engine` returns an `OffEngine`, undone after the test (pytest's `monkeypatch`)."""
    from jobs.objectives import grpo

    monkeypatch.setattr(grpo.GRPO, "rollout_engine", off_rollout_engine)


def off_engine_run(rank: int, world: int, spec_path: str, overrides: list, out: str) -> None:
    """`gradtools.reference_run` with the rollouts of `OffEngine`, in this process or a gloo rank.
    The engine is put back after the run: the process (pytest's, or a pooled rank that runs later
    tests) trains with the real `GRPO.rollout_engine` again -- a patch left behind once made later
    tests in the same process sample with `OffEngine` and pass or fail by test order."""
    from gradtools import reference_run

    from jobs.objectives import grpo

    real = grpo.GRPO.rollout_engine
    grpo.GRPO.rollout_engine = off_rollout_engine  # type: ignore[method-assign]
    try:
        reference_run(rank, world, spec_path, overrides, out)
    finally:
        grpo.GRPO.rollout_engine = real  # type: ignore[method-assign]


def assert_same_rollouts(got: str, want: str, rel: float = 1e-5) -> None:
    """Two rollouts/step-N.jsonl texts hold the same completions: every id, reward, position and
    count equal, and every log-probability (a float: computed in fp32 by forwards whose batch
    shape and thread count differ between splits) to `rel` (SFT's fp32 oracle)."""
    got_lines = [json.loads(line) for line in got.splitlines()]
    want_lines = [json.loads(line) for line in want.splitlines()]
    assert len(got_lines) == len(want_lines)
    for a, b in zip(got_lines, want_lines, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == _floats_to(b[key], rel), (key, a[key], b[key])


def _floats_to(value, rel: float):
    """`value` with each float replaced by a pytest.approx of it (ints, strings and lists kept)."""
    import pytest

    if isinstance(value, float):
        return pytest.approx(value, rel=rel, abs=1e-6)
    if isinstance(value, list):
        return [_floats_to(v, rel) for v in value]
    if isinstance(value, dict):
        return {k: _floats_to(v, rel) for k, v in value.items()}
    return value
