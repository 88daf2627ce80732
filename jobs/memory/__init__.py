"""Per-GPU training memory of LoRA fine-tuning, estimated from the model's shape alone, and the
one memory plan built on it.

No GPU, no model is built, no weight is read. Tune, the driver and
`memory.gradient_checkpointing: auto` call it before anything is launched, so it must be
cheap and must not need the weights.

What it models is what rayft actually runs (`jobs.model.loading` + `jobs.train.loop`): frozen base weights
in the compute dtype (or quantized by bitsandbytes: nf4, int8), LoRA weights in fp32 (PEFT),
autocast for bf16/fp16, HF non-reentrant checkpointing of whole decoder layers, and
`CausalLMLoss` (LM head + fp32 cross-entropy on the label positions only, optionally in
checkpointed chunks), under DDP or FSDP2 (`jobs.train.fsdp`: every parameter sharded per rank, the
units in flight gathered). `plan_for_spec` is the one place that picks the strategy and the
checkpointing (`choose_plan`).

The modules, one role each, each importing only those above it:

    shapes         the shape algebra: ModelShape, parameter counts and shapes, quantized and sharded bytes
    replay         the op-by-op replay of a decoder layer's forward (`Walk`): the saved activations
    generation     online RL's generation (`HFEngine`): the KV cache, prefill, sampler; the generation batch
    components     `estimate()`: the named components of one micro-step (MemoryEstimate)
    config_io      the I/O boundary: `config_from_spec` reads a model config from disk or the hub
    choices        the plan's rules: strategy choices, checkpointing, `choose_plan`
    spec_estimate  a JobSpec's estimate under given choices, and `SpecEstimator`, the one cached estimator
    plan           MemoryPlan, `plan_for_spec`, `estimate_for_spec`
    tables         the report tables: `plan_table`, `strategy_table`, `feasible_pairs`, `smallest_budget_gib`

shapes, replay, generation, components, choices and spec_estimate are pure: they compute from a config
object already in memory and do no I/O. Only `config_io` reads (a local directory, the hub with
the token `model.hf_token_env` names, or a GGUF file's metadata); the entry points that take a
spec (`plan_for_spec`, `estimate_for_spec`, the tables) call it when their caller passes no
`config=`. Nothing here imports ray.

Checked on CPU by tests/unit/memory/test_memory.py (saved bytes to 1%, the forward+backward peak of
op-allocated storages to 10%) and on an H200 against `torch.cuda.max_memory_allocated` by
bench/gpu_memory.py and bench/gpu_compare.py (bench/results/gpu-2026-12-04-nvidia-h200/: 31
combinations and 5 eager training rows of the 1B and 8B shapes, bf16 and nf4, within 0.04%;
tests/unit/memory/test_memory_gpu_results.py recomputes them). Generation (online RL) is checked on
CPU against `HFEngine.generate` (tests/unit/memory/test_generation_memory.py: the KV cache exactly,
the peak to -0.4% .. +6.4%), not yet on a GPU. `framework_overhead` (CUDA context,
allocator slack) is a documented constant, not measured by either.
"""

from jobs.memory.choices import (
    CHOICE_DDP,
    CHOICE_FSDP,
    CHOICE_FSDP_KEEP,
    CHOICES,
    checkpointing_candidates,
    checkpointing_str,
    choose_checkpointing_every,
    choose_plan,
    strategy_choices,
    strategy_str,
)
from jobs.memory.components import (
    ALLOCATOR_SLACK_FRACTION,
    BEFORE_FORWARD_COMPONENTS,
    COMPONENT_ORDER,
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    GENERATION_COMPONENTS,
    NCCL_BUFFER_BYTES,
    REFERENCE_COMPONENTS,
    REFERENCES,
    STRATEGIES,
    TRANSIENT_COMPONENTS,
    MemoryEstimate,
    estimate,
)
from jobs.memory.config_io import config_from_spec
from jobs.memory.generation import (
    OLD_LOGPROBS_ROWS,
    Generation,
    GenerationTerms,
    Rollout,
    choose_generation_batch,
    generation_terms,
    kv_cache_bytes,
)
from jobs.memory.plan import MemoryPlan, estimate_for_spec, plan_budget_gib, plan_for_spec
from jobs.memory.shapes import (
    DTYPE_BYTES,
    FP32_BYTES,
    GIB,
    INDEX_BYTES,
    LLAMA_FAMILY,
    MIB,
    NF4_BLOCK,
    NF4_CODE_BYTES,
    NF4_CONST_BLOCK,
    NF4_CONST_CODE_BYTES,
    QUANTIZATIONS,
    ModelShape,
    base_param_shapes,
    count_base_params,
    count_lora_params,
    fsdp_unit_shapes,
    lora_param_shapes,
    model_shape,
    quantized_bytes,
)
from jobs.memory.spec_estimate import (
    SpecEstimator,
    spec_grad_accum_steps,
    spec_objective,
    spec_precision,
    spec_rollout,
    spec_seq_len,
)
from jobs.memory.tables import choose_plan_from_table, feasible_pairs, plan_table, smallest_budget_gib, strategy_table

__all__ = [
    "ALLOCATOR_SLACK_FRACTION",
    "BEFORE_FORWARD_COMPONENTS",
    "CHOICE_DDP",
    "CHOICE_FSDP",
    "CHOICE_FSDP_KEEP",
    "CHOICES",
    "COMPONENT_ORDER",
    "CUBLAS_WORKSPACE_BYTES",
    "CUDA_CONTEXT_BYTES",
    "DTYPE_BYTES",
    "FP32_BYTES",
    "GENERATION_COMPONENTS",
    "GIB",
    "INDEX_BYTES",
    "LLAMA_FAMILY",
    "MIB",
    "NCCL_BUFFER_BYTES",
    "OLD_LOGPROBS_ROWS",
    "NF4_BLOCK",
    "NF4_CODE_BYTES",
    "NF4_CONST_BLOCK",
    "NF4_CONST_CODE_BYTES",
    "QUANTIZATIONS",
    "REFERENCES",
    "REFERENCE_COMPONENTS",
    "STRATEGIES",
    "TRANSIENT_COMPONENTS",
    "Generation",
    "GenerationTerms",
    "MemoryEstimate",
    "MemoryPlan",
    "ModelShape",
    "Rollout",
    "SpecEstimator",
    "base_param_shapes",
    "checkpointing_candidates",
    "checkpointing_str",
    "choose_checkpointing_every",
    "choose_generation_batch",
    "choose_plan",
    "choose_plan_from_table",
    "config_from_spec",
    "count_base_params",
    "count_lora_params",
    "estimate",
    "estimate_for_spec",
    "feasible_pairs",
    "fsdp_unit_shapes",
    "generation_terms",
    "kv_cache_bytes",
    "lora_param_shapes",
    "model_shape",
    "plan_budget_gib",
    "plan_for_spec",
    "plan_table",
    "quantized_bytes",
    "smallest_budget_gib",
    "spec_grad_accum_steps",
    "spec_objective",
    "spec_precision",
    "spec_rollout",
    "spec_seq_len",
    "strategy_choices",
    "strategy_str",
    "strategy_table",
]
