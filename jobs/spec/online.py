"""The online-RL sections (`objective.name: grpo`): how completions are sampled (`rollout`) and
scored (`reward`), and the rules that join them with the rest of a spec (`grpo_problem`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from jobs.spec.fields import SpecSection
from jobs.spec.yaml_file import one_line

# ---- online RL: rollout and reward sections (objective.name: grpo) ----------------------------

# What the rollout engine is: `hf` generates in-process (`model.generate`, the training weights);
# `vllm` asks a vLLM server across a process boundary (`jobs.rollout.vllm_engine`). Each is one
# implementation of `jobs.rollout.engine.RolloutEngine`.
ROLLOUT_ENGINES = ("hf", "vllm")
REWARD_BUILTINS = ("exact_match", "regex")
_USER_FN = re.compile(r"(?P<where>[^:]+):(?P<fn>[A-Za-z_][A-Za-z0-9_]*)")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_REGEX_CHARS = 1000


class RolloutSpec(SpecSection):
    engine: Literal["hf", "vllm"] = "hf"
    """What generates the completions: `hf` in-process with the policy being trained (base +
    adapter, dropout off, a KV cache); `vllm` a vLLM OpenAI-compatible server that holds the base
    once and gets only the adapter after each step (`rollout.vllm_url`, or one rank 0 starts from
    the environment `make vllm-env` builds)."""
    vllm_url: str | None = None
    """`engine: vllm`: the URL of a vLLM OpenAI-compatible server the user runs (started with
    `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, the same base, and a view of rank
    0's disk, where the adapters are written); unset: rayft starts one (`vllm_placement`)."""
    vllm_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """`engine: vllm`: seconds one request (a completion, an adapter load) may wait for the engine."""
    vllm_start_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """`engine: vllm` without `vllm_url`: seconds the server rank 0 starts may take to answer."""
    vllm_kv_cache_gib: float | None = Field(None, gt=0, le=1_000_000)
    """`engine: vllm` without `vllm_url`: the KV cache of the server rank 0 starts, GiB (vLLM's
    `--kv-cache-memory-bytes`, on a GPU and on a CPU). Unset: what every completion of a step needs
    at once, `batch.global_batch_size` sequences of `data.max_seq_len` tokens. The memory plan
    counts the server beside rank 0's training (`vllm_engine`: the base's weights in the run's
    precision, one adapter slot and this cache), so vLLM never takes its default 90% of the device."""
    vllm_placement: Literal["colocate", "separate"] = "colocate"
    """`engine: vllm` without `vllm_url`, on Ray: where the engine rayft starts runs, as a Ray actor.
    `colocate`: on rank 0's node, sharing its device (rank 0's GPU on a GPU cluster), its memory
    counted in that device's total by the memory plan. `separate`: on resources of its own
    (`vllm_num_gpus`, `vllm_num_cpus`), wherever Ray finds them, its memory counted against its own
    device. Either way the adapter reaches it as bytes through Ray (never a shared disk) and only
    the run's ranks hold its API key. A run without Ray (`--local`) starts the server as a
    subprocess of rank 0 (`colocate` only)."""
    vllm_num_gpus: int | None = Field(None, ge=0, le=64)
    """`vllm_placement: separate`: the engine's own GPUs (vLLM's tensor-parallel size when above 1).
    Unset: 1 with `resources.use_gpu`, else 0 (a CPU engine)."""
    vllm_num_cpus: float = Field(1.0, gt=0, le=1024)
    """`vllm_placement: separate`: the engine's own logical CPUs (a colocated engine holds none: it
    shares rank 0's)."""
    vllm_sleep: bool = False
    """`vllm_placement: colocate` on GPUs: the engine sleeps while the trainer steps (vLLM's sleep
    mode, level 1: its weights offloaded to host memory, its KV cache dropped) and wakes before the
    next rollouts' adapter is loaded. The memory plan then counts the device's peak as the larger of
    training beside the sleeping engine (its CUDA context and LoRA slot) and generation (the whole
    engine beside the trainer's static memory). vLLM serves its sleep routes among its unauthenticated
    development routes, so rayft serves them on loopback only: every rank must run on rank 0's node.
    Not yet measured on a GPU."""
    num_generations: int = Field(8, le=1024)
    """Completions sampled per prompt (the group its advantages are normalized over), at least 2;
    `batch.global_batch_size` (completions) must be a multiple of it."""
    max_completion_length: int = Field(128, gt=0, le=1_000_000)
    """Tokens a completion may have: it ends at its first EOS (kept) or here (flagged truncated).
    Prompt and completion together fit `data.max_seq_len` (default 256): hence 128 by default
    (TRL's is 512, beside its own prompt length)."""
    temperature: float = Field(1.0, ge=0, le=100)
    """Sampling temperature; 0 (greedy) is refused: a prompt's completions would all be the same."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: off)."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens only (0: off)."""
    generation_batch_size: int | None = Field(None, ge=1, le=1_000_000)
    """`engine: hf`: completions one worker generates at once (one `model.generate` call, one KV
    cache). Unset: the memory plan chooses it, the largest whose generation peak (KV cache, prefill,
    sampler) stays within the training step's peak, at most the worker's share of the step's
    completions (`rayft estimate` prints it). It changes speed and memory, not which completions are drawn:
    each is drawn from its own seed, whatever batch computes it (up to the floating point of the
    batch's logits: the same ids at every batch size on CPU in fp32, tested), so a resume may
    change it."""
    importance_correction: bool = False
    """`engine: vllm`: truncated importance sampling (TRL's `vllm_importance_sampling_correction`,
    token-level truncate): each completion token's policy-gradient loss is multiplied by
    min(exp(trainer log-prob - engine log-prob), `importance_correction_cap`), the trainer's being
    the old policy's, so what the engine's numerics sampled more often than the trained policy
    would is weighed down. Off: the loss is the trainer's alone (the gap is still measured:
    `engine_logprob_gap/mean|max`)."""
    importance_correction_cap: float = Field(3.0, ge=1, le=1e6)
    """The largest weight `importance_correction` gives a token (TRL's `vllm_importance_sampling_cap`)."""

    @field_validator("vllm_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", v):
            raise ValueError(f"{one_line(repr(v))} is not an http(s)://HOST:PORT URL")
        return v.rstrip("/") if v is not None else v

    @field_validator("num_generations")
    @classmethod
    def _a_group(cls, v: int) -> int:
        if v < 2:
            raise ValueError(
                f"must be at least 2 (got {v}): an advantage is a completion's reward against the other "
                "completions of its prompt"
            )
        return v


class RewardFunctionSpec(SpecSection):
    """One reward function: a built-in (`name`) or the user's (`fn`), and its weight."""

    name: Literal["exact_match", "regex"] | None = None
    """A built-in: `exact_match` is 1.0 when the completion equals the record's `column` after both
    are stripped of leading and trailing whitespace, every run of inner whitespace made one space,
    and (unless `case_sensitive`) case-folded; else 0.0 (None, not applicable, where the column is
    null). `regex` is 1.0 when `pattern` matches the whole completion (`re.fullmatch`, `.` also
    matching newlines), else 0.0. A conversational completion is judged on its last message's content."""
    fn: str | None = None
    """A user function `FILE.py:NAME` (a Python file, relative to the spec file) or `package.module:NAME`
    (importable on the workers), called as TRL calls one: `NAME(prompts=..., completions=...,
    completion_ids=..., **the records' other columns) -> list[float | None]` (None: not applicable)."""
    column: str | None = None
    """`exact_match`: the data column holding the expected answer."""
    case_sensitive: bool = False
    """`exact_match`: compare case as well (default: case-folded)."""
    pattern: str | None = None
    """`regex`: the pattern a completion must match in full."""
    weight: float = Field(1.0, ge=-1e6, le=1e6)
    """The reward is the weighted sum over functions of their values (None counts as no term, TRL's
    nansum); a completion for which every function returned None gets no advantage."""

    @model_validator(mode="after")
    def _one_function(self) -> RewardFunctionSpec:
        if (self.name is None) == (self.fn is None):
            raise ValueError(
                "give a built-in `name` (exact_match or regex) or a user `fn` (FILE.py:NAME or "
                "package.module:NAME), one of them"
            )
        wanted = {"exact_match": {"column"}, "regex": {"pattern"}}.get(self.name or "", set())
        for key in ("column", "pattern"):
            if key in wanted and getattr(self, key) is None:
                raise ValueError(f"{self.name} needs `{key}`")
            if key not in wanted and getattr(self, key) is not None:
                raise ValueError(f"`{key}` does not apply to {self.name or 'a user fn'}")
        if self.case_sensitive and self.name != "exact_match":
            raise ValueError(f"`case_sensitive` does not apply to {self.name or 'a user fn'}")
        if self.pattern is not None:
            _compiled(self.pattern)
        if self.fn is not None:
            user_function(self.fn)
        return self

    @property
    def label(self) -> str:
        """The name its metrics carry (`rewards/<label>/mean`): the built-in's, or the function's."""
        return self.name or user_function(self.fn or "")[1]


def _compiled(pattern: str) -> re.Pattern:
    if len(pattern) > MAX_REGEX_CHARS:
        raise ValueError(f"pattern: {len(pattern)} characters, more than {MAX_REGEX_CHARS}")
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"pattern: not a regular expression ({e})") from None


def user_function(text: str) -> tuple[str, str]:
    """(file or module, function name) of a user reward `FILE.py:NAME` / `package.module:NAME`."""
    m = _USER_FN.fullmatch(text)
    if not m:
        raise ValueError(f"fn: {one_line(repr(text))} is not FILE.py:NAME or package.module:NAME")
    where = m["where"]
    if not is_reward_file(where) and not _MODULE.fullmatch(where):
        raise ValueError(f"fn: {one_line(repr(where))} is neither a .py file nor a dotted module name")
    return where, m["fn"]


def is_reward_file(where: str) -> bool:
    """A user reward's `where` names a Python file (rather than a module)."""
    return where.endswith(".py") or "/" in where


class RewardSpec(SpecSection):
    functions: list[RewardFunctionSpec] = Field(min_length=1, max_length=64)
    """The reward functions, summed with their weights (TRL's `reward_funcs` and `reward_weights`)."""
    timeout_s: float = Field(60.0, gt=0, le=86_400)
    """Seconds one call of a user function may take on one batch of completions."""

    @property
    def labels(self) -> list[str]:
        """Each function's metric name, made unique in order (`regex`, `regex_2`)."""
        out: list[str] = []
        for f in self.functions:
            base, n = f.label, 2
            label = base
            while label in out:
                label, n = f"{base}_{n}", n + 1
            out.append(label)
        return out


def grpo_problem(spec: Any, rollout: RolloutSpec) -> str | None:
    """Why a `grpo` spec cannot run (one line naming the fields); None when it can."""
    n, g = rollout.num_generations, spec.batch.global_batch_size
    if spec.reward is None:
        return "reward.functions: objective.name=grpo needs at least one reward function (reward: {functions: [...]})"
    if g % n:
        return (
            f"batch.global_batch_size={g} is not a multiple of rollout.num_generations={n} "
            "(it counts completions; every prompt's group is whole in one step)"
        )
    if rollout.temperature == 0:
        return (
            f"rollout.temperature=0 samples greedily: the {n} completions of a prompt would be the same "
            "(every advantage 0); use a temperature > 0"
        )
    if rollout.max_completion_length >= spec.data.max_seq_len:
        return (
            f"rollout.max_completion_length={rollout.max_completion_length} leaves no room for a prompt in "
            f"data.max_seq_len={spec.data.max_seq_len} (prompt + completion)"
        )
    if spec.data.packing:
        return (
            "data.packing is not available with objective.name=grpo (completions are sampled, not "
            "packed); set data.packing=false"
        )
    return _vllm_problem(spec, rollout)


def _vllm_problem(spec: Any, rollout: RolloutSpec) -> str | None:
    """What `rollout.engine: vllm` cannot serve: a base that is not a saved model, or a policy that
    is not the saved base plus a plain LoRA adapter."""
    if rollout.engine != "vllm":
        return _vllm_only(rollout)
    if spec.model.name == "tiny-llama":
        return (
            "rollout.engine=vllm serves a saved model: the built-in tiny-llama is none (and its head size, 16, "
            "is below vLLM's 32); set model.name to a model directory"
        )
    if spec.model.quantization != "none":
        return (
            f"rollout.engine=vllm serves the saved base as it is: model.quantization={spec.model.quantization} "
            "is not supported with it; use rollout.engine=hf"
        )
    if spec.lora.use_dora or spec.lora.init in ("pissa", "olora"):
        what = "lora.use_dora" if spec.lora.use_dora else f"lora.init={spec.lora.init} (it rewrites the base)"
        return f"rollout.engine=vllm serves a plain LoRA adapter on the saved base: {what} is not one"
    if rollout.vllm_sleep and not spec.resources.use_gpu:
        return (
            "rollout.vllm_sleep is vLLM's GPU sleep mode (CUDA memory offloaded and dropped): with "
            "resources.use_gpu=false there is no device memory to free; leave it unset"
        )
    return _placement_problem(rollout)


def _placement_problem(rollout: RolloutSpec) -> str | None:
    """Settings of the engine rayft starts given beside `rollout.vllm_url`, or a separate
    engine's size given to a colocated one."""
    placed = [k for k in ("vllm_kv_cache_gib", "vllm_num_gpus") if getattr(rollout, k) is not None]
    placed += ["vllm_placement"] if rollout.vllm_placement != "colocate" else []
    placed += ["vllm_num_cpus"] if rollout.vllm_num_cpus != 1.0 else []
    if rollout.vllm_url and placed:
        return (
            f"rollout.{placed[0]} applies to the engine rayft starts: the engine at rollout.vllm_url "
            "is placed and sized by whoever started it; leave one of the two unset"
        )
    if rollout.vllm_sleep and (rollout.vllm_url or rollout.vllm_placement != "colocate"):
        return (
            "rollout.vllm_sleep frees the device a colocated engine shares with the trainer: with "
            + (
                "rollout.vllm_url the engine is the user's"
                if rollout.vllm_url
                else "vllm_placement=separate it has its own"
            )
            + "; leave rollout.vllm_sleep unset"
        )
    sized = [k for k in ("vllm_num_gpus", "vllm_num_cpus") if k in placed]
    if rollout.vllm_placement == "colocate" and sized:
        return (
            f"rollout.{sized[0]} sizes an engine of its own: with rollout.vllm_placement=colocate it shares "
            "rank 0's device; set rollout.vllm_placement=separate or leave it unset"
        )
    return None


def _vllm_only(rollout: RolloutSpec) -> str | None:
    """A setting of `rollout.engine: vllm` given with `engine: hf`."""
    if rollout.importance_correction:
        return (
            "rollout.importance_correction applies to rollout.engine=vllm: with engine=hf the completions "
            "are sampled by the trained policy itself (no engine log-probs, nothing to correct)"
        )
    for key in ("vllm_kv_cache_gib", "vllm_num_gpus"):
        if getattr(rollout, key) is not None:
            return f"rollout.{key} applies to rollout.engine=vllm (the engine rayft starts)"
    if rollout.vllm_sleep:
        return "rollout.vllm_sleep applies to rollout.engine=vllm (the engine rayft starts)"
    if rollout.vllm_placement != "colocate" or rollout.vllm_num_cpus != 1.0:
        return "rollout.vllm_placement and rollout.vllm_num_cpus apply to rollout.engine=vllm (the engine rayft starts)"
    return "rollout.vllm_url applies to rollout.engine=vllm" if rollout.vllm_url else None


def offline_only(spec: Any, what: str) -> None:
    """Refuses in one line (SpecError, exit 2), before anything is created, `what` (a command that
    reads a token cache or held-out pairs) for a spec whose records are prompts (`grpo`)."""
    if spec.objective.records == "prompts":
        from jobs.errors import SpecError

        raise SpecError(
            f"objective.name=grpo has no {what}: its prompts are short and read by the run itself "
            "(`rayft run`; `rayft data preview` shows them), not tokenized into a cache"
        )
