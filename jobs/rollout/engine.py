"""Rollouts for online RL (`rollout.*`): completions sampled from the current policy, kept as the
exact token ids that will be trained on.

Invariant: completion j of prompt p at step s depends on the policy, the prompt's ids and
`sample_seed(run.seed, s, p, j)` only (up to the floating point of the batch that computes its
logits): its sampling noise comes from its own generator, never from a global RNG, so which
worker or batch generates it does not change the draw, and a resumed run regenerates the same
completions on the same layout. Sampling is Gumbel-max on the warped logits (temperature, then
top-k, then top-p): argmax(logits / T + Gumbel noise) is a draw from softmax(logits / T) over the
kept tokens. A completion ends at its first EOS (kept) or after `max_completion_length` tokens
(`truncated`). Ids are never decoded and re-encoded.

The seam for another engine: a `RolloutEngine` takes `Request`s and returns `Completion`s. `HFEngine`
generates in-process with `model.generate` (a KV cache, left-padded batches, dropout off);
`jobs.rollout.vllm_engine.VLLMEngine` asks a vLLM server across a process boundary, each request
with its own seed (vLLM's sampler, not the Gumbel draw below: the same seed gives the same
completion on the same engine, not the one `HFEngine` draws).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (`rollout.*`, validated by the spec); temperature 0 is greedy
    (held-out evaluation only: the spec refuses it for training)."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def of(cls, rollout) -> Sampling:
        return cls(rollout.max_completion_length, rollout.temperature, rollout.top_p, rollout.top_k)


@dataclass(frozen=True)
class Request:
    """One completion to sample: sample `sample_index` of the prompt at `prompt_index` in the data."""

    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    seed: int


@dataclass(frozen=True)
class Completion:
    """The sampled ids (up to and including the first EOS), whether the length cut it, and, from an
    engine across a process boundary, the engine's own log-probability of each sampled id (never
    trained on: the trainer computes its own; kept to measure the gap)."""

    prompt_index: int
    sample_index: int
    ids: tuple[int, ...]
    truncated: bool
    logprobs: tuple[float, ...] | None = None


class RolloutEngine(Protocol):
    """What generates completions: `HFEngine` in-process, `VLLMEngine` across a process boundary.
    `returns_logprobs`: its completions carry the engine's own log-probs (`Completion.logprobs`),
    which the trainer measures its own against (the same on every rank: it decides a forward)."""

    returns_logprobs: bool

    def generate(self, requests: Sequence[Request], sampling: Sampling) -> list[Completion]: ...


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one completion's draw: a 63-bit hash of the four numbers (no two collide by
    arithmetic, as `run_seed * K + step` would)."""
    digest = hashlib.sha256(struct.pack("<4Q", run_seed, step, prompt_index, sample_index)).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def requests_for(
    prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int], run_seed: int, step: int, num_generations: int
) -> list[Request]:
    """`num_generations` requests per prompt, grouped by prompt (the group order of `group_advantages`)."""
    return [
        Request(p, j, tuple(ids), sample_seed(run_seed, step, p, j))
        for ids, p in zip(prompts, prompt_indices, strict=True)
        for j in range(num_generations)
    ]


def warped(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """logits [B, V] / temperature, with the tokens outside top-k and outside the top-p nucleus
    (the smallest set of most likely tokens whose probability reaches top_p) at -inf."""
    out = logits.float() / sampling.temperature
    if 0 < sampling.top_k < out.shape[-1]:
        kth = torch.topk(out, sampling.top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= sampling.top_p)
        out = out.masked_fill(drop, float("-inf"))
    return out


def gumbel(generator: torch.Generator, size: int) -> torch.Tensor:
    """Standard Gumbel noise drawn on the CPU (the same on every device)."""
    u = torch.rand(size, generator=generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    return (-torch.log(-torch.log(u))).float()


class SeededSampler:
    """A `model.generate` logits processor (with `do_sample=False`): each row's scores become its
    warped logits plus Gumbel noise from the row's own generator, so greedy decoding draws each
    row's sample independently of the batch."""

    def __init__(self, seeds: Sequence[int], sampling: Sampling):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.sampling = sampling

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.FloatTensor:
        noise = torch.stack([gumbel(g, scores.shape[-1]) for g in self.generators]).to(scores.device)
        return warped(scores, self.sampling) + noise  # type: ignore[return-value]


def cut_at_eos(new_ids: Sequence[int], eos_ids: Sequence[int], max_len: int) -> tuple[tuple[int, ...], bool]:
    """(ids up to and including the first EOS, truncated): without an EOS in the first `max_len`
    ids, those ids and True."""
    for i, t in enumerate(new_ids[:max_len]):
        if t in eos_ids:
            return tuple(new_ids[: i + 1]), False
    return tuple(new_ids[:max_len]), True


class HFEngine:
    """In-process generation with the policy being trained (`rollout.engine: hf`): left-padded
    batches of `batch_size` requests through `model.generate` with a KV cache prefilled once per
    distinct prompt (`_shared_prefill`), in eval mode (dropout off; the mode is restored after).
    Its log-probs would be the trainer's own: none returned."""

    returns_logprobs = False

    def __init__(
        self, model, eos_token_ids: Sequence[int], pad_token_id: int, batch_size: int = 16, synced: bool = False
    ):
        self.model, self.eos, self.pad, self.batch_size = model, tuple(eos_token_ids), pad_token_id, batch_size
        # Under FSDP every forward is a collective: with `synced` (transformers' `synced_gpus`) a rank
        # whose completions all ended keeps stepping until every rank's have, so the counts match.
        self.synced = synced

    def generate(self, requests: Sequence[Request], sampling: Sampling) -> list[Completion]:
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[Completion] = []
            for start in range(0, len(requests), self.batch_size):
                out += self._batch(requests[start : start + self.batch_size], sampling)
            return out
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def _batch(self, requests: Sequence[Request], sampling: Sampling) -> list[Completion]:
        from transformers import GenerationConfig, LogitsProcessorList

        device = next(self.model.parameters()).device
        prompts = [r.prompt_ids for r in requests]
        # at least 2 wide: the shared prefill takes all but the last position
        ids, mask = (t.to(device) for t in left_padded(prompts, self.pad, min_width=2))
        config = GenerationConfig(
            max_new_tokens=sampling.max_completion_length,
            do_sample=False,
            eos_token_id=list(self.eos),
            pad_token_id=self.pad,
        )
        # temperature 0: greedy (held-out evaluation); else each row's draw from its own seed
        processors = [] if sampling.temperature == 0 else [SeededSampler([r.seed for r in requests], sampling)]
        gen = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            logits_processor=LogitsProcessorList(processors),
            synced_gpus=self.synced,
            **{cache_keyword(self.model): self._shared_prefill(prompts, ids, mask)},
        )
        rows = gen[:, ids.shape[1] :].tolist()
        cut = [cut_at_eos(row, self.eos, sampling.max_completion_length) for row in rows]
        return [Completion(r.prompt_index, r.sample_index, c, t) for r, (c, t) in zip(requests, cut, strict=True)]

    def _shared_prefill(self, prompts: list[tuple[int, ...]], ids: torch.Tensor, mask: torch.Tensor):
        """The KV cache of every row's prompt but its last token, computed once per distinct prompt
        (a GRPO group's `num_generations` rows share one: a step's prefill shrinks that many times)
        and copied to each row; `generate` then feeds the last prompt token and samples. Its values
        are a plain prefill's up to the floating point of the forward's batch shape. One forward
        whatever the prompts (under FSDP every rank must run as many)."""
        from transformers import DynamicCache

        distinct = list(dict.fromkeys(prompts))
        first = torch.tensor([prompts.index(p) for p in distinct], device=ids.device)
        head_mask = mask[first, :-1]
        cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=ids[first, :-1],
            attention_mask=head_mask,
            position_ids=(head_mask.cumsum(-1) - 1).masked_fill(head_mask == 0, 1),  # as `generate` numbers them
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword(self.model): cache},
        )
        rows = torch.tensor([distinct.index(p) for p in prompts], device=ids.device)
        cache.reorder_cache(rows)  # type: ignore[arg-type]  # an int64 tensor: the LongTensor asked for
        return cache


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, min_width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) [B, W] of the prompts left-padded to the longest, W at least `min_width`."""
    width = max(min_width, *(len(p) for p in prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def cache_keyword(model) -> str:
    """The keyword transformers takes a KV cache by: `cache` from the release that deprecated
    `past_key_values` (5.2x), `past_key_values` before (the GPU machine's 5.17)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"
