"""Base model, tokenizer and LoRA adapters.

`tiny-llama` is a small random-init Llama built deterministically from the seed, with a
byte-level tokenizer made by the `tokenizers` library: no download, so tests and the demo
run anywhere. Anything else loads through `AutoModelForCausalLM` / `AutoTokenizer` from a
local directory or the hub, or from a GGUF file (de-quantized once, then cached as safetensors).
With `model.quantization` (nf4, int8) the frozen base is quantized by bitsandbytes as it loads
(QLoRA); the adapters on top of it are the same LoRA as on an unquantized base.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from jobs.errors import SpecError
from jobs.model.gguf import gguf_cache, gguf_cache_dir
from jobs.model.tiny import TINY_LLAMA as TINY_LLAMA  # re-exported: callers read them from here
from jobs.model.tiny import tiny_llama_config as tiny_llama_config
from jobs.spec import JobSpec, ModelSpec, one_line, path_problem, resolve_model_dir

log = logging.getLogger("rayft")

# The built-in model (`jobs.model.tiny`): Llama architecture with GQA, small enough for 2 CPU cores.
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# tiny-llama's chat template: BOS, then per message `<|role|>` + newline + content + EOS; the
# generation prompt is `<|assistant|>` + newline. Prefix-stable (each rendering extends the
# previous), and an assistant turn ends in EOS, where generation stops.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@contextlib.contextmanager
def without_peft_alias_notice() -> Iterator[None]:
    """PEFT, wrapping a model, probes transformers' deprecated `is_gradient_checkpointing` alias
    and transformers warns: not the user's to fix, and it was the first line `rayft eval` printed.
    Every place rayft wraps a model in PEFT goes through this."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


@contextlib.contextmanager
def no_save_progress_bar() -> Iterator[None]:
    """transformers draws a progress bar when it writes a model ("Writing model shards"): not one of
    rayft's lines, and it landed among the run's last ones. Off while rayft saves a model (the base
    beside a tiny-llama adapter, a merged export); as it was after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def byte_tokenizer():
    """Byte-level tokenizer: ids 0..255 are the bytes, then <pad>, <s>, </s>; chat template
    `TINY_CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    for i, special in enumerate((PAD, BOS, EOS)):
        vocab[special] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=TINY_CHAT_TEMPLATE
    )


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-unicode map, which the ByteLevel pre-tokenizer uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def base_dtype(precision: str) -> torch.dtype:
    """Frozen base weights live in the compute dtype; LoRA weights stay fp32 (PEFT keeps them so)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def quantization_config(quantization: str, precision: str):
    """`model.quantization` as transformers' `BitsAndBytesConfig`, or None for `none`.

    nf4 is QLoRA's recipe: 4-bit NormalFloat codes, double-quantized block constants, and the
    de-quantized weights computed in the run's compute dtype (bf16, fp16 or fp32; all three run
    forward and backward on CPU with bitsandbytes 0.50). int8 is LLM.int8() with its default
    outlier threshold (bitsandbytes casts the matmul inputs to fp16 itself). transformers keeps
    the LM head (the output embeddings) and the input embeddings unquantized."""
    if quantization == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise SpecError(
            f"model.quantization={quantization} needs bitsandbytes on the worker (pip install 'rayft[qlora]')"
        ) from None
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=base_dtype(precision),
        )
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise SpecError(f"model.quantization: must be none, nf4 or int8, got {quantization!r}")


def _load_device(spec: JobSpec):
    """Where a quantized base is built: bitsandbytes quantizes on the device the weights land on,
    so they land on this worker's GPU (the current CUDA device, which the context has set)
    rather than being quantized on the CPU and moved."""
    if spec.resources.use_gpu and torch.cuda.is_available():
        return torch.cuda.current_device()
    return "cpu"


# bitsandbytes' CPU backend warns at import that an optional kernel package is missing.
BITSANDBYTES_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


def quiet_unused_bitsandbytes(quantizing: bool) -> None:
    """PEFT imports bitsandbytes whenever it is installed (the `qlora` extra is part of the dev
    install), and on CPU bitsandbytes then warns "Failed to load CPU gemm_4bit_forward from
    kernels-community" -- about kernels only a quantized base uses. Without quantization that line
    is noise on the first screen, so its logger shows errors only; with quantization it stays."""
    logging.getLogger(BITSANDBYTES_CPU_LOGGER).setLevel(logging.WARNING if quantizing else logging.ERROR)


def hide_unused_bitsandbytes(quantization: str) -> None:
    """In a process that runs one job and nothing after it (a Ray Train worker), with no
    `model.quantization` ("none"): make bitsandbytes unimportable, before anything imports PEFT.

    PEFT imports bitsandbytes whenever it is installed (`peft/helpers.py`), and bitsandbytes
    wraps its kernels in `torch.compile` as it is imported, which imports dynamo: `import peft`
    in a process that has already imported what a worker has (jobs.train.loop, transformers'
    activations and masking) took 1.7-2.0 CPU-seconds with bitsandbytes and 0.44-0.64 without
    (this 2-core machine, 3 runs each), for layers a base that is not quantized never has. PEFT
    then sees no bitsandbytes (`is_bnb_available()` is False) and wraps `nn.Linear` layers exactly
    as before (the same adapter, bit for bit): its bitsandbytes dispatch only matches
    bitsandbytes layers. Never in a process that may quantize later (a test process, a persistent
    rank): PEFT decides what it supports once, at its import."""
    if quantization == "none":
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]  # `import` raises ImportError


def load_base_model(spec: JobSpec, precision: str, *, quantized: bool = True):
    """Returns (model, tokenizer) with the base weights frozen, in eval-free train mode.

    With `model.quantization` (and `quantized`, which callers turn off to get the plain base a
    finished adapter is published against) the linear layers of the decoder are quantized by
    bitsandbytes. transformers 5 quantizes only while `from_pretrained` loads weights (its
    quantizer hooks into weight loading; `from_config` takes no quantization config), and that
    path also marks the model as quantized, which PEFT needs to wrap the bitsandbytes layers and
    transformers needs to refuse casting them. So the built-in tiny-llama is saved to a temporary
    directory first and loaded back from there like any other base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    skip_packed_sequence_detection()
    dtype = base_dtype(precision)
    m = spec.model
    qcfg = quantization_config(m.quantization, precision) if quantized else None
    quiet_unused_bitsandbytes(qcfg is not None)
    quant = dict(quantization_config=qcfg, device_map={"": _load_device(spec)}) if qcfg is not None else {}
    model: PreTrainedModel
    if m.name == "tiny-llama":
        # Deterministic from the seed: every rank (and every later run) builds the same weights.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.run.seed)
            model = LlamaForCausalLM(tiny_llama_config(attn_implementation=m.attn_implementation))
        # transformers declares `to` through functools.wraps(nn.Module.to), which types the wrapper as
        # taking the module as its first argument.
        model.to(dtype)  # type: ignore[arg-type]
        if quant:
            import tempfile

            from safetensors.torch import save_model

            with tempfile.TemporaryDirectory(prefix="rayft-tiny-llama-") as tmp:
                # Not `save_pretrained`: under torch.distributed it writes on rank 0 only, and
                # every rank needs its own copy here.
                model.config.save_pretrained(tmp)
                save_model(model, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
                model = LlamaForCausalLM.from_pretrained(
                    tmp, dtype=dtype, attn_implementation=m.attn_implementation, **quant
                )
            # As built from the config: no name (PEFT would look the gone temporary directory up
            # when it saves the adapter).
            model.name_or_path = model.config._name_or_path = ""
        tokenizer = byte_tokenizer()
    else:
        token = os.environ.get(m.hf_token_env) if m.hf_token_env else None
        kwargs = dict(dtype=dtype, attn_implementation=m.attn_implementation, **quant)
        src: str | Path
        if m.gguf_file:
            src = gguf_cache(Path(resolve_model_dir(m.name)), m.gguf_file)
            model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(src)
        else:
            try:
                src = resolve_model_dir(m.name)
                model = AutoModelForCausalLM.from_pretrained(src, token=token, **kwargs)
                tokenizer = AutoTokenizer.from_pretrained(src, token=token)
            except OSError as e:
                raise SpecError(f"model.name: cannot load {m.name!r}: {str(e).splitlines()[0]}") from None
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    for p in model.parameters():
        p.requires_grad_(False)
    if quant:
        _no_cpu_weight_repacking(model)
    return model, tokenizer


def skip_packed_sequence_detection() -> None:
    """Replace transformers' packed-sequence detection by its "not packed" answer, for this process.

    Without a 2D attention mask and without a cache (a training forward), transformers 5 looks at
    the position ids of every forward for several sequences packed into one row
    (`masking_utils.find_packed_sequence_indices`), which ends in `bool(tensor.all())`: a host sync
    at the start of every micro-step's forward, so the CPU stops queueing work until the device has
    drained everything before it. rayft knows the answer without looking: its unpacked rows hold one
    sequence (HF's default position ids, never packed), its packed rows come with their own 4D mask
    (`jobs.objectives.sft.packed_attention_mask`), with which transformers never asks, and its generation
    passes a 2D mask. So every answer is the same and the sync is gone (`tests/unit/train/test_host_sync.py`).

    Installed by `load_base_model`, before any forward of a model rayft loads; installing again
    changes nothing. The original stays reachable as `__wrapped__` (`inspect.unwrap`). A no-op on
    transformers versions without the detection."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or original is _not_packed:
        return
    vars(_not_packed)["__wrapped__"] = original  # a function attribute (the type checker knows of none)
    masking_utils.find_packed_sequence_indices = _not_packed


def _not_packed(position_ids):
    return None


def _no_cpu_weight_repacking(model) -> None:
    """bitsandbytes 0.50 repacks a Linear4bit's weight in place for a CPU inference kernel the
    first time it runs in eval mode without grad on a CPU with AVX512-BF16 (held-out loss,
    generation). The repacking asserts output features divisible by 32 (tiny-llama's MLP has
    176) and changes the weight's storage under the model. Off, evaluation de-quantizes and
    multiplies exactly as training does."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def load_tokenizer(spec: JobSpec):
    """The tokenizer `load_base_model` returns for `spec`, without loading weights and without
    writing anything: a GGUF base's tokenizer comes from its de-quantized copy when one exists
    (what a job loads), else straight from the GGUF file (what that copy is saved from).
    `rayft data preview` tokenizes with it, so it shows what the job trains on."""
    from transformers import AutoTokenizer

    m = spec.model
    if m.name == "tiny-llama":
        return byte_tokenizer()
    try:
        if m.gguf_file:
            directory = Path(resolve_model_dir(m.name))
            cached = gguf_cache_dir(directory, m.gguf_file)
            if cached.is_dir():
                tokenizer = AutoTokenizer.from_pretrained(cached)
            else:
                tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=m.gguf_file)
        else:
            token = os.environ.get(m.hf_token_env) if m.hf_token_env else None
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(m.name), token=token)
    except OSError as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise SpecError(f"model.name: cannot load the tokenizer of {m.name!r}: {first}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def served_base(spec: JobSpec) -> str:
    """What an inference server (`rollout.engine: vllm`) loads as the base `load_base_model` loads:
    the model directory, a GGUF base's de-quantized copy (made once, as the job's own load makes
    it), or a hub id as given."""
    m = spec.model
    if m.gguf_file:
        return str(gguf_cache(Path(resolve_model_dir(m.name)), m.gguf_file))
    local = Path(resolve_model_dir(m.name))
    return str(local.resolve()) if local.is_dir() else m.name


# `lora.init` -> PEFT's `init_lora_weights`.
LORA_INIT: dict[str, bool | Literal["gaussian", "pissa", "olora"]] = {
    "default": True,
    "gaussian": "gaussian",
    "pissa": "pissa",
    "olora": "olora",
}


def add_lora(model, spec: JobSpec, precision: str = "fp32"):
    """Wrap with PEFT LoRA; adapter init is seeded so every rank starts identical.

    `precision` bf16/fp16 (autocast): see `keep_lora_inputs_in_compute_dtype`. With
    `model.adapter`, training starts from that saved adapter instead (`start_from_adapter`)."""
    from peft import LoraConfig

    cfg = LoraConfig(
        r=spec.lora.r,
        # PEFT declares lora_alpha an int, but any number scales (alpha / r) and lora.alpha may be fractional.
        lora_alpha=spec.lora.alpha,  # type: ignore[arg-type]
        lora_dropout=spec.lora.dropout,
        target_modules=list(spec.lora.target_modules),
        task_type="CAUSAL_LM",
        use_dora=spec.lora.use_dora,
        use_rslora=spec.lora.use_rslora,
        init_lora_weights=LORA_INIT[spec.lora.init],
    )
    with torch.random.fork_rng(devices=[]), without_peft_alias_notice():
        torch.manual_seed(spec.run.seed + 1)
        if spec.model.adapter:
            peft_model = start_from_adapter(model, spec)
        else:
            peft_model = _new_adapter(model, spec, cfg)
    return _finish_adapter(peft_model, spec, precision)


def _new_adapter(model, spec: JobSpec, cfg):
    from peft import get_peft_model

    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if isinstance(mod, nn.Linear)})
        raise SpecError(
            f"lora.target_modules: {list(spec.lora.target_modules)} do not match the model "
            f"(its linear modules are {linear}): {str(e).splitlines()[0]}"
        ) from None


def _finish_adapter(peft_model, spec: JobSpec, precision: str):
    # LoRA weights train in fp32 whatever the base dtype: the optimizer and GradScaler need it.
    for p in peft_model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    if precision in ("bf16", "fp16"):
        keep_lora_inputs_in_compute_dtype(peft_model)
    if spec.lora.init in ("pissa", "olora"):
        # PiSSA/OLoRA move the adapter's start out of the base weights (the base keeps the
        # residual), so an adapter saved as trained belongs to that residual, not to the base a
        # user loads. Keep the initial adapter and let every save convert to a plain LoRA of rank
        # 2r on the unmodified base (PEFT's `path_initial_model_for_weight_conversion`).
        import atexit
        import functools
        import shutil
        import tempfile

        init_dir = tempfile.mkdtemp(prefix="rayft-lora-init-")
        atexit.register(shutil.rmtree, init_dir, True)
        peft_model.save_pretrained(init_dir)
        peft_model.save_pretrained = functools.partial(
            peft_model.save_pretrained, path_initial_model_for_weight_conversion=init_dir
        )
    return peft_model


# The weights files PEFT reads from an adapter directory.
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# What `lora.*` must say about a starting adapter (`model.adapter`): spec field -> adapter_config key.
ADAPTER_CONFIG_KEYS = {
    "r": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "use_dora": "use_dora",
    "use_rslora": "use_rslora",
}
# PEFT's value of a key an adapter_config.json leaves out.
ADAPTER_CONFIG_DEFAULTS = {"lora_dropout": 0.0, "use_dora": False, "use_rslora": False}
# adapter_config keys that change what trains or how, and that `lora.*` has no setting for: a
# starting adapter must leave each unset (None, empty, "none" or false), or training would differ
# from what the spec, the memory plan and the resume key describe.
ADAPTER_CONFIG_UNSUPPORTED = (
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "bias",
    "exclude_modules",
    "trainable_token_indices",
    "lora_bias",
    "target_parameters",
    "use_qalora",
    "fan_in_fan_out",
    "layer_replication",
    "alora_invocation_tokens",
)


# `init_lora_weights` of a starting adapter that leave the base as it is while PEFT builds the layers
# the saved weights load into: PiSSA, OLoRA, LoftQ, EVA, CorDA (and any other) move or replace base
# weights there, so the file's weights would train on another base than the spec's.
ADAPTER_PLAIN_INITS = (True, False, "gaussian")


def starting_adapter_config(spec: JobSpec) -> dict:
    """`model.adapter`'s adapter_config.json, checked against `lora.*`: the adapter trains on as
    the spec describes it, and the memory plan, resume key and estimate read `lora.*`, so they
    must agree. A disagreement is refused in one line naming the key and both values. Then its
    weights are checked against the spec's base, built on the meta device (`_check_adapter_shapes`)."""
    assert spec.model.adapter is not None  # called for a spec with model.adapter
    adapter = Path(spec.model.adapter)
    cfg = _read_adapter_config(adapter)
    shapes = _check_adapter_weights(adapter)
    _check_adapter_keys(cfg, spec, adapter / "adapter_config.json")
    _check_adapter_shapes(spec, cfg, shapes, adapter / ADAPTER_WEIGHTS[0])
    return cfg


def _read_adapter_config(adapter: Path) -> dict:
    """The adapter's config, a LoRA one, once its files are regular files (a FIFO would block PEFT's read)."""
    import json

    path = adapter / "adapter_config.json"
    for f in (path, *(adapter / w for w in ADAPTER_WEIGHTS)):
        problem = path_problem(f) if f == path or os.path.lexists(f) else None
        if problem:
            raise SpecError(f"model.adapter: {problem}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecError(f"model.adapter: {path}: not a readable adapter config ({type(e).__name__})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise SpecError(f"model.adapter: {path}: not a LoRA adapter config")
    return cfg


def _check_adapter_keys(cfg: dict, spec: JobSpec, path: Path) -> None:
    """Every key of `cfg` that changes training either unset, a plain init, or what `lora.*` says."""
    for key in ADAPTER_CONFIG_UNSUPPORTED:
        if cfg.get(key) not in (None, [], {}, "none", False):
            raise SpecError(
                f"model.adapter: the adapter sets {key}={one_line(repr(cfg[key]))[:80]}, which changes training and "
                "which lora.* has no setting for; start from an adapter without it"
            )
    _check_adapter_init(cfg.get("init_lora_weights", True), path)
    for field, key in ADAPTER_CONFIG_KEYS.items():
        want = getattr(spec.lora, field)
        have = cfg.get(key, ADAPTER_CONFIG_DEFAULTS.get(key))
        if have != want:
            raise SpecError(
                f"model.adapter: the adapter has {key}={have!r} but lora.{field}={want!r}; set "
                f"lora.{field}={have} (lora.* must describe the starting adapter)"
            )
    targets = cfg.get("target_modules")
    targets = sorted([targets] if isinstance(targets, str) else targets or [])
    if targets != sorted(spec.lora.target_modules):
        raise SpecError(
            f"model.adapter: the adapter targets {targets} but lora.target_modules="
            f"{sorted(spec.lora.target_modules)}; set lora.target_modules to the adapter's"
        )


def _check_adapter_init(init: Any, path: Path) -> None:
    """`init_lora_weights` one of `ADAPTER_PLAIN_INITS` (a bool as a bool: JSON's 1 is no init)."""
    if not any(init is v if isinstance(v, bool) else init == v for v in ADAPTER_PLAIN_INITS):
        raise SpecError(
            f"model.adapter: {path}: init_lora_weights={one_line(repr(init))[:80]} changes the base weights as "
            "PEFT loads the adapter; start from an adapter of a plain LoRA init (true, false or gaussian)"
        )


def _check_adapter_weights(adapter: Path) -> dict[str, tuple[int, ...]]:
    """The weights PEFT will load are a whole safetensors file (its header read alone: cut short,
    bytes past its tensors, a broken entry are one line); a pickle (`adapter_model.bin`) alone is
    refused: loading one runs code, and rayft writes and reads safetensors only. Returns the
    tensors' shapes."""
    from jobs.errors import UserError
    from jobs.model.adapter_check import safetensors_shapes

    weights = adapter / ADAPTER_WEIGHTS[0]
    if not os.path.lexists(weights):
        pickle_only = os.path.lexists(adapter / ADAPTER_WEIGHTS[1])
        raise SpecError(
            f"model.adapter: {adapter} holds "
            + ("adapter_model.bin only (a pickle): convert it to safetensors" if pickle_only else "no adapter weights")
        )
    try:
        return safetensors_shapes(weights)
    except UserError as e:
        raise SpecError(f"model.adapter: {e}") from None


def _check_adapter_shapes(spec: JobSpec, cfg: dict, shapes: dict, weights: Path) -> None:
    """The adapter's tensors have the shapes its rank and the spec's base give, and every targeted
    layer has both A and B (`jobs.model.adapter_check.check_starting_weights`), the base built on
    the meta device where its config is here to read (a hub base: PEFT refuses shapes that do
    not fit as it loads)."""
    from jobs.errors import UserError
    from jobs.memory.config_io import config_from_spec, config_is_local
    from jobs.model.adapter_check import check_starting_weights

    if not config_is_local(spec):
        return
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config_from_spec(spec))
    try:
        check_starting_weights(shapes, cfg, base, weights)
    except UserError as e:
        raise SpecError(f"model.adapter: {e}") from None


def start_from_adapter(model, spec: JobSpec):
    """The base with `model.adapter` loaded as the trainable adapter (PEFT's `default`); for an
    objective with a reference (DPO, IPO, GRPO with beta > 0) also a second, frozen copy of it
    named `jobs.objectives.preference.REFERENCE_ADAPTER`, the reference those objectives compare
    against (the starting policy): the base is held once, the adapter weights twice."""
    from peft import PeftModel

    from jobs.objectives.preference import REFERENCE_ADAPTER

    starting_adapter_config(spec)
    assert spec.model.adapter is not None  # checked by starting_adapter_config
    try:
        peft_model = PeftModel.from_pretrained(model, spec.model.adapter, is_trainable=True)
        if spec.objective.has_reference:
            peft_model.load_adapter(spec.model.adapter, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
            peft_model.set_adapter("default")  # the trainable one stays active (and trainable)
    except (RuntimeError, ValueError, OSError) as e:  # shapes that do not fit the base, unreadable weights
        raise SpecError(
            f"model.adapter: {spec.model.adapter} does not load on model.name={spec.model.name} "
            f"({one_line(str(e))[:200]})"
        ) from None
    return peft_model


def keep_lora_inputs_in_compute_dtype(peft_model) -> None:
    """Under autocast, let the adapters read their input in the compute dtype.

    PEFT casts each adapted module's input to the dtype of the LoRA weights (fp32), and
    autocast casts it straight back to bf16/fp16 for the matmul: a lossless round trip (with
    `lora.dropout` 0 the gradients are bitwise the same, tests/integration/test_train.py; with dropout, the
    mask now scales the bf16 input rather than its fp32 copy) that costs two full-size copies
    per adapted module and keeps one bf16 copy per module for backward (q, k and v: three copies
    of the same tensor). Without it the adapters of q, k, v (and of gate, up) share their saved
    input. Only for autocast: in fp32 there is nothing to cast."""
    for module in peft_model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


def check_packing(config) -> None:
    """`data.packing` builds its own block-diagonal causal mask, which replaces HF's masks in
    every layer: refuse models whose layers also need a sliding-window mask."""
    types = getattr(config, "layer_types", None) or []
    sliding = any("sliding" in str(t) for t in types) or (
        not types
        and getattr(config, "sliding_window", None) is not None
        and getattr(config, "use_sliding_window", True)
    )
    if sliding:
        raise SpecError(
            f"data.packing: not supported for {getattr(config, 'model_type', 'this model')!r}: its "
            f"sliding-window attention needs its own mask (set data.packing=false)"
        )


def check_batchnorm(model: nn.Module, sync: bool, world_size: int) -> nn.Module:
    """Accumulation changes BatchNorm statistics (they are per micro-batch): say so loudly."""
    bns = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model
    if sync and world_size > 1:
        log.warning("converting %d BatchNorm layers to SyncBatchNorm", len(bns))
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    warnings.warn(
        f"model has {len(bns)} BatchNorm layer(s) (e.g. {bns[0]}): their statistics are computed per "
        "micro-batch, so results depend on batch.micro_batch_size, not only on the global batch; "
        "set model.sync_batchnorm=true to at least share them across workers",
        stacklevel=2,
    )
    return model


def compile_wanted(m: ModelSpec, device_type: str) -> bool:
    """Whether a job compiles its decoder layers (`ModelSpec.compiles_on`: `auto` is on for a CUDA
    device with an unquantized base, measured to pay off: 1.38x and 1.55x the eager step at the
    1B and 8B shapes on an H200)."""
    return m.compiles_on(device_type)


def compile_layers(model) -> int:
    """`torch.compile` every decoder layer in place; returns how many. Regional compilation:
    the layers have the same code, and with inlined nn.Modules (torch >= 2.5) dynamo compiles
    it once and reuses it for every layer. Runs after checkpointing is enabled (HF's
    checkpointing wraps the layer call, so the recomputation in backward runs compiled code)
    and before DDP wraps the model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(base.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise SpecError(
            f"model.compile: cannot find the decoder layers of {type(base).__name__} "
            "(expected a `layers` list under its base model)"
        )
    # transformers 5.25 wraps attention's forward in the `kernels` package's `use_kernelized_func`,
    # which sets a context variable around each call: under checkpointing dynamo refuses that side
    # effect and compiles nothing (a graph break, then eager). The variable only picks the kernel,
    # which the traced graph has already fixed, so the recomputation in backward need not replay it.
    from torch._dynamo import config as dynamo_config

    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        layer.compile()
    return len(layers)


def enable_checkpointing(model, every_n_layers: int = 1) -> None:
    """Non-reentrant activation checkpointing: works with PEFT (frozen inputs) and with DDP."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
        return
    # Older transformers: the deprecated name, with `every_n_layers` where it exists.
    if "every_n_layers" in inspect.signature(base.gradient_checkpointing_enable).parameters:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers)
        return
    if every_n_layers != 1:
        warnings.warn(
            f"this transformers cannot checkpoint every {every_n_layers}th layer only: "
            "checkpointing every layer (more recompute, less memory than estimated)",
            stacklevel=2,
        )
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
