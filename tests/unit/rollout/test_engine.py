"""The in-process rollout (`jobs.rollout.engine`, `rollout.engine: hf`): each completion is drawn from its
own seed (run seed, step, prompt, sample), so it does not depend on the batch that generates it
and a rerun draws the same ids; the draw is from softmax(logits / T) over the top-k / top-p tokens;
a completion ends at its first EOS (kept) or at max_completion_length (truncated); dropout is off
while generating and the training mode is restored."""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from jobs.model.loading import tiny_llama_config
from jobs.rollout.engine import (
    Completion,
    HFEngine,
    Request,
    Sampling,
    SeededSampler,
    cut_at_eos,
    requests_for,
    sample_seed,
    warped,
)

EOS, PAD = 258, 256
PROMPTS = [[257, 72, 105], [257, 80, 97, 114, 105, 115, 63, 32], [257, 1]]


@pytest.fixture(scope="module")
def model():
    """tiny-llama, random init, with the EOS logit raised (+4) so that some completions end."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny_llama_config(attn_implementation="eager"))
    bias = torch.zeros(259)
    bias[EOS] = 4.0
    m.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    return m


def engine(model, batch_size: int = 16) -> HFEngine:
    return HFEngine(model, [EOS], PAD, batch_size=batch_size)


SAMPLING = Sampling(max_completion_length=12, temperature=1.0)


def test_seeds_are_a_function_of_run_step_prompt_and_sample_only():
    seeds = {sample_seed(r, s, p, j) for r in (0, 1) for s in (0, 1) for p in (0, 1, 2) for j in (0, 1)}
    assert len(seeds) == 24 and sample_seed(0, 1, 2, 3) == sample_seed(0, 1, 2, 3)
    assert all(0 <= s < 2**63 for s in seeds)
    reqs = requests_for(PROMPTS[:2], [7, 9], run_seed=3, step=5, num_generations=2)
    assert [(r.prompt_index, r.sample_index) for r in reqs] == [(7, 0), (7, 1), (9, 0), (9, 1)]
    assert reqs[3].seed == sample_seed(3, 5, 9, 1) and reqs[0].prompt_ids == tuple(PROMPTS[0])


def test_a_completion_does_not_depend_on_the_batch_that_generates_it(model):
    reqs = requests_for(PROMPTS, [0, 1, 2], run_seed=0, step=0, num_generations=2)
    together = engine(model).generate(reqs, SAMPLING)
    alone = [c for r in reqs[2:5] for c in engine(model).generate([r], SAMPLING)]
    in_fours = engine(model, batch_size=4).generate(reqs, SAMPLING)
    assert together[2:5] == alone and together == in_fours
    assert engine(model).generate(reqs, SAMPLING) == together  # a rerun draws the same ids
    assert len({c.ids for c in together}) > len(PROMPTS)  # the samples of a prompt differ
    later = engine(model).generate(requests_for(PROMPTS, [0, 1, 2], 0, 1, 2), SAMPLING)
    assert [c.ids for c in later] != [c.ids for c in together]  # another step, another draw


def test_each_distinct_prompt_is_prefilled_once_and_the_draw_is_a_plain_generates(model, monkeypatch):
    """A GRPO group's rows share their prompt's prefill: a batch's first forward runs over its
    distinct prompts only (3 rows for 3 prompts x 4 samples, left-padded), every later one over all
    12 rows, and the completions are those `model.generate` draws prefilling every row itself."""
    reqs = requests_for(PROMPTS, [0, 1, 2], run_seed=0, step=0, num_generations=4)
    rows: list[int] = []
    forward = model.forward

    @functools.wraps(forward)  # `generate` reads the signature (`logits_to_keep`)
    def counted(*args, **kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    shared = engine(model).generate(reqs, SAMPLING)
    assert rows[0] == len(PROMPTS) and set(rows[1:]) == {len(reqs)}
    monkeypatch.setattr(HFEngine, "_shared_prefill", lambda self, prompts, ids, mask: None)  # generate's own
    rows.clear()
    plain = engine(model).generate(reqs, SAMPLING)
    assert set(rows) == {len(reqs)} and plain == shared


def test_a_completion_ends_at_its_first_eos_or_is_truncated(model):
    reqs = requests_for(PROMPTS, [0, 1, 2], run_seed=1, step=0, num_generations=8)
    got = engine(model).generate(reqs, SAMPLING)
    assert {c.truncated for c in got} == {True, False}  # both happen here
    for c in got:
        assert EOS not in c.ids[:-1] and PAD not in c.ids
        assert c.truncated == (c.ids[-1] != EOS) and (len(c.ids) == 12 if c.truncated else len(c.ids) <= 12)


def test_cut_at_eos_keeps_the_first_eos_and_flags_a_cut():
    assert cut_at_eos([5, 6, EOS, PAD, PAD], [EOS], 5) == ((5, 6, EOS), False)
    assert cut_at_eos([EOS, 7, EOS], [EOS, 7], 3) == ((EOS,), False)
    assert cut_at_eos([5, 6, 7, EOS], [EOS], 3) == ((5, 6, 7), True)
    assert cut_at_eos([5, 6], [EOS], 2) == ((5, 6), True)


def test_dropout_is_off_while_generating_and_the_mode_is_restored(model):
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda mod, inp: seen.append(mod.training))
    model.train()
    try:
        engine(model).generate(requests_for(PROMPTS[:1], [0], 0, 0, 2), SAMPLING)
    finally:
        hook.remove()
    assert seen and not any(seen) and model.training


@pytest.mark.parametrize(
    ("sampling", "kept"),
    [
        (Sampling(8, temperature=0.7), [0, 1, 2, 3, 4]),
        (Sampling(8, temperature=1.0, top_k=2), [3, 4]),
        (Sampling(8, temperature=1.0, top_p=0.9), [2, 3, 4]),
    ],
    ids=["temperature", "top_k", "top_p"],
)
def test_the_draw_is_softmax_over_the_kept_tokens(sampling, kept):
    """Gumbel-max on the warped logits: frequencies over 4000 seeds match softmax(logits / T)
    restricted to top-k / the top-p nucleus (0.64 + 0.23 < 0.9: the third token is in it)."""
    logits = torch.tensor([[-1.0, 0.0, 1.0, 2.0, 3.0]])
    n = 4000
    counts = collections.Counter(
        int(SeededSampler([seed], sampling)(torch.zeros(1, 1), logits).argmax()) for seed in range(n)
    )
    want = torch.softmax(logits[0, kept] / sampling.temperature, -1)
    assert set(counts) == set(kept)
    for token, p in zip(kept, want.tolist(), strict=True):
        assert counts[token] / n == pytest.approx(p, abs=0.03), token


def test_warping_keeps_the_most_likely_token_always():
    logits = torch.tensor([[0.0, 10.0, 1.0]])
    assert torch.isfinite(warped(logits, Sampling(4, top_p=0.01))).tolist() == [[False, True, False]]
    assert torch.isfinite(warped(logits, Sampling(4, top_k=1))).tolist() == [[False, True, False]]


def test_an_engine_is_what_the_rollout_seam_asks_for():
    from jobs.rollout.engine import RolloutEngine

    def takes(e: RolloutEngine) -> None:
        assert callable(e.generate)

    takes(HFEngine(None, [EOS], PAD))
    assert Completion(0, 0, (1,), False) == Completion(0, 0, (1,), False)
    assert Request(1, 2, (3,), 4).seed == 4
