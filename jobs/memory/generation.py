"""Generation's memory (online RL, `rollout.engine: hf`): what `jobs.rollout.engine.HFEngine`
holds beyond the static memory while it samples one generation batch, and the generation batch
the plan chooses.

Invariant: generation never runs beside the backward. A step samples its completions first
(`GRPO.with_rollouts`, under `no_grad`: nothing is saved for backward), frees the KV cache, then
computes the old log-probabilities (`num_iterations` > 1, also under `no_grad`), and only then
runs the window's forwards and backwards. So generation's peak (and the old-log-prob forward's)
is weighed against the training peak -- the total takes the larger -- never added to it
(`components.BEFORE_FORWARD_COMPONENTS`).

One generation batch of g rows, left-padded to P prompt tokens, sampling C tokens, holds:

* the KV cache: 2 (keys, values) x layers x kv_heads x head_dim x positions x g x the compute
  dtype's bytes, at P positions after the prefill and P + C - 1 at the last step (the last
  sampled token is never fed back);
* at the prefill (the first P - 1 tokens of the d distinct prompts among the g rows through one
  no-grad forward -- a GRPO group's rows share their prompt's, `HFEngine._shared_prefill`): the
  residual stream's [N, hidden] tensors, per-row RoPE tables (fp32, and their compute-dtype copies
  under autocast), the [d, 1, P - 1, P - 1] boolean padding mask, and the widest of a layer's MLP
  (gate, up and their product, one more with an adapter on `up_proj`) or its attention (GQA: k and
  v repeated to every head, as transformers does with a mask); then that cache copied to the g
  rows, both alive at once;
* at a decode step: the cache's concatenation (the old and the new tensor of one layer at once),
  k and v repeated to every head (GQA, where transformers repeats them for a single query token:
  `decode_repeats_kv`), or the sampler's scores over the vocabulary -- the
  logits in the compute dtype, their fp32 copy, the warped scores, the Gumbel noise and the
  scores of this step and the last (`SAMPLER_FP32_COPIES`, more with top-k / top-p) -- and the
  growing ids and mask;
* under autocast, the compute-dtype copies of the LoRA weights (autocast caches the cast of
  every leaf that requires grad until the region ends: all of them by the last step).

Arithmetic on a `ModelShape` (no I/O, no torch) and one probe of the installed transformers.
Checked on CPU against the live storages of `HFEngine.generate` (tests/unit/memory/test_generation_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobs.memory.shapes import FP32_BYTES, INDEX_BYTES, ModelShape, count_base_params, count_lora_params, round_up

# [g, V] fp32 tensors alive at the sampler's widest point without top-k / top-p: the fp32 copy
# of the logits, the warped scores, the stacked Gumbel noise, this step's scores and the last
# step's (freed only when the name is rebound).
SAMPLER_FP32_COPIES = 5
# [g, V] fp32 tensors of the last step's sampler still alive through a decode step's forward (the
# names `generate` rebinds only after it): measured at the cache's last concatenation, where a
# decode step peaks when k and v are not repeated to every head (`decode_repeats_kv`).
SAMPLER_LEFTOVER_FP32 = 4
# Bytes a logit beyond those: top-k's boolean mask (its masked copy replaces the warped scores);
# top-p's sort (values and int64 order), softmax, cumulative sum, the probability above each
# token and its boolean masks, alive inside the warp (measured on CPU: 21 bytes a logit).
TOP_K_BYTES = 1
TOP_P_BYTES = 21
# Completions per forward of the trainer's old-log-probability pass (`num_iterations` > 1;
# `jobs.objectives.grpo_batch.old_logps`).
OLD_LOGPROBS_ROWS = 16


# vLLM's KV cache is paged in blocks of this many tokens (its default `--block-size`).
VLLM_BLOCK_TOKENS = 16
# The linear modules vLLM's LoRA slot holds weights for, whatever the adapter targets (it
# pre-allocates every supported projection at `--max-lora-rank`).
VLLM_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Engine:
    """The vLLM server rank 0 starts (`rollout.engine: vllm` without `rollout.vllm_url`), as the
    estimate reads it: `sequences` completions at once of up to `max_len` tokens, an explicit KV
    cache (`rollout.vllm_kv_cache_gib`, bytes) or None, and its LoRA slot's rank (`--max-lora-rank`)."""

    sequences: int
    max_len: int
    lora_rank: int
    kv_cache_bytes: int | None = None
    colocated: bool = True  # on rank 0's device (`rollout.vllm_placement`); else on devices of its own
    devices: int = 1  # a separate engine's GPUs (tensor parallel), 1 on CPUs: the total is split over them
    sleeps: bool = False  # `rollout.vllm_sleep`: asleep while the trainer steps


def engine_terms(shape: ModelShape, engine: Engine, act_bytes: int, context_bytes: int) -> dict[str, int]:
    """The server's memory beside the trainer's, in bytes: the base's weights in the run's dtype
    (loaded once), one adapter slot at `--max-lora-rank` over every projection vLLM adapts
    (`--max-loras=1`), the KV cache (`kv_cache_bytes`: vLLM's `--kv-cache-memory-bytes`; by default
    `sequences` x `max_len` tokens, in whole blocks) and, on a GPU, the process's own CUDA context.
    Not counted: vLLM's activation workspace for a forward (not measured on a GPU)."""
    weights = sum(count_base_params(shape).values()) * act_bytes
    modules = [m for m in VLLM_LORA_MODULES if m in shape.linear_shapes()] or list(shape.linear_shapes())
    lora = count_lora_params(shape, engine.lora_rank, modules) * act_bytes
    kv = engine.kv_cache_bytes
    if kv is None:
        kv = kv_cache_bytes(shape, engine.sequences, round_up(engine.max_len, VLLM_BLOCK_TOKENS), act_bytes)
    total = weights + lora + kv + context_bytes
    terms = {"weights": weights, "lora_slot": lora, "kv_cache": kv, "context": context_bytes, "total": total}
    # a separate engine's own devices: each holds its share of the weights and cache, and a context
    per_device = (weights + lora + kv) // engine.devices + context_bytes
    # asleep (vLLM's level 1): weights offloaded, cache dropped; its context and, counted to be safe,
    # its LoRA slot stay (not yet measured on a GPU)
    asleep = lora + context_bytes if engine.sleeps else total
    where = {"colocated": int(engine.colocated), "devices": engine.devices, "per_device": per_device}
    return terms | where | {"sleeps": int(engine.sleeps), "asleep": asleep}


@dataclass(frozen=True)
class Rollout:
    """What a GRPO spec's rollouts are, as the estimate reads them (`spec_estimate.spec_rollout`):
    prompts of up to `prompt_tokens`, completions of up to `completion_tokens`, this worker's
    `share` of the step's completions, the generation batch the spec fixes (`batch_size`, None:
    the plan chooses it), whether the policy generates in-process (`rollout.engine: hf`) and
    whether the trainer computes log-probabilities of the sampled ids (`objective.num_iterations`
    > 1: the old ones; `rollout.engine: vllm`: beside the engine's own)."""

    prompt_tokens: int
    completion_tokens: int
    share: int
    batch_size: int | None = None
    top_k: bool = False
    top_p: bool = False
    in_process: bool = True
    old_logprobs: bool = False
    engine: Engine | None = None  # the vLLM server rank 0 starts beside its training (none: hf, vllm_url)

    num_generations: int = 1  # rows that share one prompt (consecutive: a group)

    def batch(self, rows: int) -> Generation:
        # `rows` consecutive completions of groups of G: at most ceil((rows - 1) / G) + 1 prompts
        prompts = min(rows, -(-(rows - 1) // self.num_generations) + 1)
        return Generation(rows, self.prompt_tokens, self.completion_tokens, self.top_k, self.top_p, prompts)

    @property
    def old_logprobs_rows(self) -> int:
        return min(OLD_LOGPROBS_ROWS, self.share)


@dataclass(frozen=True)
class Generation:
    """One generation batch's shape: `rows` completions at once, each `prompt_tokens` of prompt
    (left-padded to the longest) and up to `completion_tokens` sampled."""

    rows: int
    prompt_tokens: int
    completion_tokens: int
    top_k: bool = False  # rollout.top_k > 0
    top_p: bool = False  # rollout.top_p < 1
    prompts: int | None = None  # distinct prompts among the rows (None: every row its own)

    @property
    def prefilled(self) -> int:
        """Rows of the prefill's forward: one per distinct prompt."""
        return min(self.rows, self.prompts or self.rows)

    @property
    def positions(self) -> int:
        """Positions in the KV cache at the last step: the last sampled token is never fed back."""
        return self.prompt_tokens + self.completion_tokens - 1


@dataclass(frozen=True)
class GenerationTerms:
    """The parts of one generation batch's peak, in bytes (`peak_bytes` is what the plan weighs)."""

    kv_cache: int  # at the last step
    prefill: int  # the prefill's widest moment, its KV cache included
    decode: int  # a decode step's widest moment, the whole KV cache included
    sampler: int  # the sampler's scores over the vocabulary (inside `decode`)
    lora_copies: int  # compute-dtype copies of the LoRA weights (autocast)

    @property
    def peak_bytes(self) -> int:
        return self.lora_copies + max(self.prefill, self.decode)

    def as_dict(self) -> dict[str, int]:
        return {**self.__dict__, "peak_bytes": self.peak_bytes}


def kv_cache_bytes(shape: ModelShape, rows: int, positions: int, act_bytes: int) -> int:
    """2 (keys, values) x layers x kv_heads x head_dim x positions x rows x the dtype's bytes."""
    return 2 * shape.layers * shape.kv_dim * positions * rows * act_bytes


def generation_terms(
    shape: ModelShape, gen: Generation, act_bytes: int, autocast: bool, lora_params: int, up_adapted: bool
) -> GenerationTerms:
    """The parts of one generation batch's peak (module doc)."""
    kv = kv_cache_bytes(shape, gen.rows, gen.positions, act_bytes)
    sampler = sampler_bytes(shape, gen, act_bytes)
    leftover = SAMPLER_LEFTOVER_FP32 * gen.rows * shape.vocab * FP32_BYTES
    return GenerationTerms(
        kv_cache=kv,
        prefill=prefill_bytes(shape, gen, act_bytes, autocast, up_adapted),
        decode=kv + ids_bytes(gen) + max(sampler, decode_layer_bytes(shape, gen, act_bytes) + leftover),
        sampler=sampler,
        lora_copies=lora_params * act_bytes if autocast else 0,
    )


def prefill_bytes(shape: ModelShape, gen: Generation, act_bytes: int, autocast: bool, up_adapted: bool) -> int:
    """The prefill's widest moment: its forward over the distinct prompts' first P - 1 tokens (their
    cache, the residual stream, RoPE tables, the padding mask, the widest of a layer's MLP and
    attention), or that cache beside its copy to every row."""
    d, P, a = gen.prefilled, max(2, gen.prompt_tokens) - 1, act_bytes
    N = d * P
    stream = (4 if shape.layers > 1 else 3) * N * shape.hidden * a
    rope = 2 * N * (shape.rotary_dims or shape.head_dim) * (FP32_BYTES + (a if autocast else 0))
    mask = d * P * P + 3 * N * INDEX_BYTES  # the boolean mask; the ids, position ids and their copy
    mlp = ((3 if shape.family == "llama" else 2) + up_adapted) * N * shape.intermediate * a
    attention = N * (shape.q_dim + 2 * shape.heads * shape.head_dim + shape.q_dim) * a
    forward = kv_cache_bytes(shape, d, P, a) + stream + rope + mask + max(mlp, attention)
    return max(forward, kv_cache_bytes(shape, d + gen.rows, P, a))


def decode_layer_bytes(shape: ModelShape, gen: Generation, act_bytes: int) -> int:
    """A decode step's widest moment in a layer beyond the cache: the concatenation's old tensor
    beside the new one, or (GQA) k and v repeated to every head."""
    old = gen.rows * shape.kv_dim * (gen.positions - 1) * act_bytes
    repeated = 2 * gen.rows * shape.q_dim * gen.positions * act_bytes
    return max(old, repeated if shape.heads != shape.kv_heads and decode_repeats_kv() else 0)


def decode_repeats_kv() -> bool:
    """Whether transformers' SDPA attention repeats k and v to every head for one query token under
    a padding mask: releases without `pack_gqa` do (the GPU machine's 5.17); 5.25 packs the query
    onto the key/value heads instead."""
    from transformers.integrations import sdpa_attention

    return not hasattr(sdpa_attention, "pack_gqa")


def sampler_bytes(shape: ModelShape, gen: Generation, act_bytes: int) -> int:
    """[g, V]: the logits in the compute dtype and `SAMPLER_FP32_COPIES` fp32 tensors (module doc)."""
    per_logit = act_bytes + SAMPLER_FP32_COPIES * FP32_BYTES
    per_logit += (TOP_K_BYTES if gen.top_k else 0) + (TOP_P_BYTES if gen.top_p else 0)
    return gen.rows * shape.vocab * per_logit


def ids_bytes(gen: Generation) -> int:
    """The ids and the attention mask (int64), each grown by a concatenation every step."""
    return 4 * gen.rows * (gen.positions + 1) * INDEX_BYTES


def choose_generation_batch(peak_of: Callable[[int], int], limit_bytes: int, most: int) -> int:
    """The largest generation batch in 1..`most` whose peak (`peak_of(g)`, static memory included)
    stays within `limit_bytes` -- the training peak, so that generation reuses the memory training
    needs anyway and never raises the plan's total; 1 when even one completion at a time does not
    (the total is then generation's). Peaks grow with g: a bisection."""
    low, high = 1, max(1, most)
    while low < high:
        mid = (low + high + 1) // 2
        if peak_of(mid) <= limit_bytes:
            low = mid
        else:
            high = mid - 1
    return low
