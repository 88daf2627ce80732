"""rayft's training loop vs HF Trainer + PEFT on one GPU: same model shape, data, global batch
and memory budget, run alternately in one process. Writes bench/results/<date>-<gpu>.json.

What runs
---------
* Models: random-init Llama shapes built from a `LlamaConfig` directly on the device in bf16
  (no download): `llama-1b` (hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192,
  vocab 128256, tied embeddings) and `llama-8b` (hidden 4096, 32 layers, 32/8 heads,
  intermediate 14336, vocab 128256, untied). sdpa attention, `use_cache=False`, frozen bf16
  base, LoRA r=16 (alpha 32, no dropout) on all seven linear layers, LoRA weights in fp32,
  bf16 autocast, AdamW (fused on GPU), constant lr 1e-4, grad-norm clipping at 1.0.
* Data: random token sequences, every sequence exactly `--seq` (2048) tokens, no padding, the
  same token ids for both loops. rayft reads them from a temporary JSONL through its own data
  path (a word-level tokenizer whose words are the token ids); HF gets a torch Dataset of
  `{input_ids, attention_mask (ones), labels = input_ids}`.
* Global batch: 32 sequences (65,536 tokens) per optimizer step at 1B, 16 (32,768 tokens) at
  8B; `--warmup` 2 + `--steps` 20 timed optimizer steps per rayft row (the median, the mean and
  the coefficient of variation are reported), `--hf-steps` 8 per HF row. Budgets 40 and 80 GiB.
  The first H200 run (2026-12-04) timed 4 steps per row.
* rayft: `jobs.train.loop.train(spec, LocalContext(use_gpu=True))`, the real loop, no Ray. Only the
  base-model loader is replaced (random init on the device instead of `from_pretrained`).
  Its configuration is chosen with the memory model: for every micro-batch that divides the
  global batch and every `memory.loss_chunk_tokens` in {0, 4, 2, 1, 1/2 x seq},
  `jobs.train.loop.memory_plan` (what `train()` itself runs, `gradient_checkpointing: auto`
  with `memory.budget_gib` = the budget) gives the checkpointing it would use and its estimate;
  among those whose estimate fits, the one with the least predicted time per token wins:
  (model FLOPs + recomputed FLOPs) / eff, recomputed = forward of the checkpointed layers +
  (chunked loss) the LM head forward, eff = t / (t + 512) with t the tokens of one micro-batch
  (a heuristic for small-GEMM inefficiency). If it still runs out of memory, the next one runs.
* HF: `transformers.Trainer` with `TrainingArguments(per_device_train_batch_size=micro,
  gradient_accumulation_steps=global/micro, bf16=True, activation/gradient checkpointing
  (non-reentrant) as needed, optim="adamw_torch_fused", lr_scheduler_type="constant",
  max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[])` on the PEFT model.
  Its configuration: the largest micro-batch that fits without checkpointing, else the
  largest with checkpointing, found by trying in descending order and catching out-of-memory
  (candidates that rayft's memory model, used as a proxy for HF's full-logits loss, puts
  above 1.1 x the budget are skipped without trying).
* The budget is enforced for both loops with `torch.cuda.set_per_process_memory_fraction`
  (budget / device memory), which caps the caching allocator's reserved memory. rayft's
  choice is stricter: its estimate *total* (allocator peak + 8% slack + 0.75 GiB CUDA context)
  must fit, as `memory.budget_gib` means in rayft.
* Order: the two loops alternate (rayft first, then HF first for the next budget, ...).
* Then, only if the time limit allows: one more rayft row per `--compile-shapes` shape
  (default: the first, llama-1b) at the first budget with `model.compile: true` (each decoder
  layer through torch.compile), the same configuration choice as the plain rayft row. Its
  compile time falls in the warmup steps (`row_wall_s` shows it); `compile_speedup` in the
  comparison is its tok/s over the plain row's: the number that decides `model.compile`'s default.
* Then, only if the time limit allows (or alone, with `--qlora-only`; like the compile rows it
  is left out, not recorded as skipped, when the time is up): one QLoRA row
  (`rayft-qlora`) per `--qlora-shapes` shape (default `llama-8b`; dry run `tiny`) at the first
  budget: the same loop with `model.quantization: nf4` (bitsandbytes 4-bit NormalFloat, double
  quantization, bf16 compute), so its base is *loaded* the way a job loads one (random-init
  bf16 weights written once to a temporary directory, then `jobs.model.loading.load_base_model`
  quantizes them onto the GPU as they load); its configuration is chosen as for the plain row,
  with the quantized memory estimate. The row has tok/s, `peak_alloc_gib` and the estimate
  beside it (`estimate_gib`, `estimate_rel_err`); `qlora_tok_s` in the comparison. It needs
  bitsandbytes on the GPU machine (carried as a wheel, below); without it the row says so (and
  the exit status does not count it).
* Rows chosen with `--loops` (every shape and budget, in the order given; default `rayft,hf`):
  besides those above, `rayft-liger` (the rayft row with Liger Kernel's Triton RMSNorm, SwiGLU
  and RoPE patched into the model; rayft's own loss, so no fused cross-entropy) and `hf-liger`
  (HF with what `TrainingArguments(use_liger_kernel=True)` applies: those three and the fused
  linear cross-entropy, which never materializes the logits). Liger patches `modeling_llama`'s
  globals; the row undoes that when it ends. Without liger-kernel the rows say so. Also:
  `hf-compile` (HF with `TrainingArguments(torch_compile=True)`: the whole model through
  torch.compile), `rayft-qlora-compile` (the QLoRA row with compiled layers), and `rayft-dpo`
  (rayft's DPO, `model.compile: auto` as a job has it: compiled on a GPU): global_batch / 2 pairs
  of two `seq`-token rows (random prompt of seq/2 - 1 words, chosen and rejected responses of
  seq/2), the same tokens per step as the SFT rows; the reference is the base with the adapter
  off; its model FLOPs per token add the reference forward (2N + the causal attention forward);
  its configuration is chosen with the preference estimate. `rayft-ragged`,
  `rayft-ragged-packed`, `rayft-ragged-packed-flex`: eager rayft on ragged data (the same number
  of sequences per step, each seq/8 to seq tokens), padded (length-grouped, the default), packed
  with SDPA's float bias, and packed with FlexAttention's BlockMask; their tok/s counts the input
  tokens the steps really had (`real_tokens`), not the padding.

Timing
------
Both loops are timed the same way: a host timestamp at the end of every optimizer step
(rayft: `Context.progress`, called after the step's single `.item()`; HF: a `TrainerCallback`
`on_step_end` with `torch.cuda.synchronize()`), and the timed steps are the intervals between
consecutive end-of-step timestamps after the warmup steps. Each interval therefore holds a
full iteration of the loop: data (rayft's sampler + collate + pinned copies; HF's dataloader
prefetch of the window), forward/backward of all micro-batches, clipping, the optimizer step,
and the per-step logging of the previous step. tok_s = global batch x seq / mean interval
(all tokens of full-length sequences). peak_alloc_gib = `torch.cuda.max_memory_allocated`
over the whole row (reset before it).

Model FLOPs
-----------
    FLOPs/token = 4 N + 6 L S d_q
N = the parameters of every matmul in the forward: the decoder layers' linear weights plus the
LM head (vocab x hidden, counted also when tied to the embeddings; the embedding lookup, norms
and LoRA adapters are not counted). 4N: forward (2N) + the input gradients of backward (2N);
the frozen base has no weight gradients. Attention, causal (half the S x S scores):
QK^T and PV are 2 x 2 S d_q FLOPs per token and layer for full attention, halved for causal
= 2 S d_q forward, and backward (dQ, dK, dV: 4 matmuls) is twice that, so 6 S d_q per token
and layer (L layers, d_q = heads x head_dim, S = sequence length). Recomputation
(checkpointing, chunked loss) is not counted: these are model FLOPs, not hardware FLOPs.
model_tflops = tok_s x FLOPs/token / 1e12, also as a fraction of the measured bf16
8192^3 matmul ceiling (mean of 10 products after 3 warm-ups, measured in the same run).

Needs torch, transformers, peft, accelerate and rayft's `jobs` package (pydantic, pyyaml) --
not Ray. The GPU machine has no pydantic, bitsandbytes or liger-kernel and an older
transformers (5.17, whose `gradient_checkpointing_enable` path in `jobs.model.loading` loses
`every_n_layers`): `bash bench/fetch_gpu_wheels.sh` fetches the wheels into .whl/ (git-ignored,
about 60 MB) and bench/gpu_all.sh installs them with `pip --target` first. Run:

    bash bench/gpu_all.sh $OUT                                  # every phase, one device call
    python bench/gpu_compare.py --out bench/results             # this script alone
    python bench/gpu_compare.py --dry-run --out /tmp/x          # tiny shapes on CPU, < 1 minute

bench/gpu_all.sh (carry [".whl"], timeout_s 560) ran on an H200 in 324 s plus the wheel install
(the memory phase, 30 s, came from an earlier call); its files are in
bench/results/gpu-2026-12-04-nvidia-h200/ and docs/benchmarks.md has the table. Each result file
is rewritten after every row, so a cut-off run still leaves its finished rows.

The dry run runs the whole pipeline on CPU (hidden 64, 2 layers, vocab 512, seq 64, budgets
0.0021 and 0.01 GiB of the CPU estimate; fp32, HF's configuration from the proxy estimate as
nothing can run out of memory there); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import importlib.util
import json
import logging
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.shapes import SHAPES  # noqa: E402  (one table for both GPU scripts)

GIB = 1024**3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA, LR = 16, 32.0, 1e-4
EFF_TOKENS = 512  # eff(t) = t / (t + EFF_TOKENS) in rayft's configuration choice
HF_PROXY_MARGIN = 1.10  # HF candidates whose proxy estimate exceeds budget x this are not tried
# Loops that need a package the GPU machine may lack (a loop whose name holds the key): without
# it the row says so and the exit status does not count it.
OPTIONAL = {"liger": ("liger_kernel", "liger-kernel"), "qlora": ("bitsandbytes", "bitsandbytes")}
LOOPS = (
    "rayft",
    "hf",
    "rayft-compile",
    "rayft-qlora",
    "rayft-qlora-compile",
    "rayft-liger",
    "hf-liger",
    "hf-compile",
    "rayft-dpo",
    "rayft-ragged",
    "rayft-ragged-packed",
    "rayft-ragged-packed-flex",
    "hf-liger-compile",
    "hf-liger-compile-bf16-lora",
    "rayft-compile-layers",
    "rayft-cudnn",
)
# Rows whose HF/rayft step counts differ: HF rows are the peer's speed (a few timed steps do), the
# rayft rows also carry the step-time spread (`--steps`, at least 20 on a GPU).


@contextlib.contextmanager
def liger_patched(model=None, fused_linear_cross_entropy: bool = False):
    """Liger Kernel's Triton RMSNorm, SwiGLU and RoPE (and, for HF, its fused linear
    cross-entropy) on the Llama modules, undone on exit: Liger patches `modeling_llama`'s
    globals, which would otherwise leak into every later row of this process."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    saved = dict(vars(modeling_llama))
    saved_forward = modeling_llama.LlamaForCausalLM.forward
    try:
        apply_liger_kernel_to_llama(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=fused_linear_cross_entropy,
            model=model,
        )
        yield
    finally:
        for k, v in saved.items():
            setattr(modeling_llama, k, v)
        modeling_llama.LlamaForCausalLM.forward = saved_forward


GLOBAL_BATCH = {"llama-1b": 32, "llama-8b": 16}
TINY_SHAPES = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
}
TINY_GLOBAL_BATCH = {"tiny": 8}


# ---- model, FLOPs, ceiling ------------------------------------------------------------------


def llama_config(shape: dict, seq: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        **shape,
        max_position_embeddings=max(8192, seq + 1),
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        attn_implementation="sdpa",
        use_cache=False,
        bos_token_id=shape["vocab_size"] - 3,
        eos_token_id=shape["vocab_size"] - 2,
        pad_token_id=shape["vocab_size"] - 1,
    )
    return cfg


def flops_per_token(config, seq: int) -> dict:
    """Model FLOPs per token (see the module docstring): 4N + 6 L S d_q."""
    h, i, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    dq = config.num_attention_heads * head_dim
    dkv = config.num_key_value_heads * head_dim
    layer_linear = h * dq + 2 * h * dkv + dq * h + 3 * h * i
    n_layers = L * layer_linear
    n_head = V * h
    n = n_layers + n_head
    attn = 6 * L * seq * dq
    return {
        "N": n,
        "N_layers": n_layers,
        "N_head": n_head,
        "attention": attn,
        "total": 4 * n + attn,
        "attn_fwd_per_layer": 2 * seq * dq,
        "layer_linear": layer_linear,
    }


def build_model(config, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Random init directly on the device; frozen."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def matmul_ceiling(device: torch.device, n: int, warmup: int = 3, reps: int = 10) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(warmup):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    dt = (time.perf_counter() - t) / reps
    del a, b
    return {
        "n": n,
        "dtype": str(dtype).replace("torch.", ""),
        "tflops": 2 * n**3 / dt / 1e12,
        "seconds_per_matmul": dt,
        "reps": reps,
        "warmup": warmup,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> float:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated(device) / GIB
    return 0.0


@contextlib.contextmanager
def memory_cap(device: torch.device, budget_gib: float):
    """Cap the caching allocator at the budget (CUDA); a no-op on CPU."""
    if device.type != "cuda":
        yield
        return
    free_memory(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gib * GIB / total), device.index or 0)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device.index or 0)


def fake_oom(key: str) -> None:
    """Test hook: GPU_COMPARE_FAKE_OOM="hf:8:0,rayft:8:0" makes those attempts (loop:micro:gc or
    loop:micro:chunk) run out of memory from inside the loop, so the dry run covers the retry path."""
    if key in os.environ.get("GPU_COMPARE_FAKE_OOM", "").split(","):
        raise torch.OutOfMemoryError(f"CUDA out of memory (simulated by GPU_COMPARE_FAKE_OOM for {key})")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


# ---- data -----------------------------------------------------------------------------------


def id_tokenizer(vocab: int):
    """Word-level tokenizer whose words are the decimal token ids; the last three ids are
    <s>, </s>, <pad>. A real `PreTrainedTokenizerFast`, so rayft's data path runs unchanged."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<s>": vocab - 3, "</s>": vocab - 2, "<pad>": vocab - 1}
    words = {str(i): i for i in range(vocab - 3)}
    words.update(specials)
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=1 << 30
    )


def make_sequences(vocab: int, n: int, seq: int, seed: int = 0) -> list[list[int]]:
    """n sequences of exactly `seq` input tokens: <s> then seq-1 random ids."""
    rng = random.Random(seed)
    bos = vocab - 3
    return [[bos] + [rng.randrange(vocab - 3) for _ in range(seq - 1)] for _ in range(n)]


def write_jsonl(seqs: list[list[int]], path: Path) -> None:
    """rayft tokenizes <s> + text + </s>, truncated to max_seq_len = seq + 1: inputs are the
    `seq` tokens of the sequence, labels the next tokens (the last one </s>)."""
    with open(path, "w") as f:
        for s in seqs:
            f.write(json.dumps({"text": " ".join(map(str, s[1:]))}) + "\n")


class SeqDataset(torch.utils.data.Dataset):
    def __init__(self, seqs: list[list[int]]):
        self.x = torch.tensor(seqs, dtype=torch.long)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> dict:
        ids = self.x[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


# ---- rayft ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    shape: str
    config: object
    seq: int
    global_batch: int
    budget_gib: float
    device: torch.device
    warmup: int
    steps: int
    workdir: Path
    data_path: Path
    model_dir: Path
    seqs: list
    objective: str = "sft"  # "dpo": `global_batch` counts pairs and `data_path` holds them (`for_dpo`)
    ragged: bool = False  # sequences of seq/8 to seq tokens (`for_ragged`); tok/s counts real tokens
    packing: bool = False  # data.packing
    attn: str = "sdpa"  # model.attn_implementation
    hf_steps: int = 0  # timed steps of the HF rows (0: `steps`)

    def for_dpo(self) -> Workload:
        """The same tokens per optimizer step as pairs: global_batch / 2 pairs of two rows of
        `seq` input tokens each (BOS + 1023-token prompt + 1024-token response + EOS at seq 2048),
        chosen and rejected random and different; written once per shape."""
        path = self.workdir / f"pairs-{self.shape}.jsonl"
        if not path.is_file():
            rng = random.Random(1)
            vocab = self.config.vocab_size - 3
            prompt_len = (self.seq - 1) // 2
            resp_len = self.seq - 1 - prompt_len
            with open(path, "w") as f:
                for _ in range(self.global_batch // 2 * self.total_steps):
                    prompt, chosen, rejected = (
                        " ".join(str(rng.randrange(vocab)) for _ in range(n)) for n in (prompt_len, resp_len, resp_len)
                    )
                    f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
        return dataclasses.replace(self, global_batch=self.global_batch // 2, data_path=path, objective="dpo")

    def for_ragged(self, packing: bool, attn: str) -> Workload:
        """The same number of sequences per step, each of a length drawn uniformly from
        [seq/8, seq] input tokens (seeded; written once per shape): data whose padding packing
        removes. `packing`/`attn`: data.packing and model.attn_implementation of the row."""
        path = self.workdir / f"ragged-{self.shape}.jsonl"
        if not path.is_file():
            rng = random.Random(2)
            bos = vocab = self.config.vocab_size - 3  # <s> is the first special id
            seqs = []
            for _ in range(self.global_batch * self.total_steps):
                n = rng.randint(self.seq // 8, self.seq) - 1  # + <s>: n + 1 input tokens
                seqs.append([bos] + [rng.randrange(vocab) for _ in range(n)])
            write_jsonl(seqs, path)
        return dataclasses.replace(self, data_path=path, ragged=True, packing=packing, attn=attn)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq * (2 if self.objective == "dpo" else 1)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def precision(self) -> str:
        return "bf16" if self.device.type == "cuda" else "fp32"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32


def weights_dir(w: Workload) -> Path:
    """A directory with the shape's random-init weights (bf16 on GPU) and the id tokenizer,
    written once per shape: a QLoRA row loads its base from it through `jobs.model.loading`, which
    quantizes while loading (transformers quantizes in `from_pretrained` only)."""
    out = w.workdir / f"weights-{w.shape}"
    if not (out / "config.json").is_file():
        model = build_model(w.config, w.device, w.dtype)
        model.save_pretrained(out)
        id_tokenizer(w.config.vocab_size).save_pretrained(out)
        del model
        free_memory(w.device)
    return out


def rayft_spec(
    w: Workload,
    micro: int,
    chunk: int,
    out_dir: Path,
    compile_layers: bool | str = False,
    quantization: str = "none",
):
    from jobs.spec import load_spec

    # The estimate reads the config only; a quantized base is really loaded, so it needs weights.
    model_dir = w.model_dir if quantization == "none" else w.workdir / f"weights-{w.shape}"
    data = {
        "name": f"bench-{w.shape}",
        "model": {
            "name": str(model_dir),
            "attn_implementation": w.attn,
            "compile": compile_layers,
            "quantization": quantization,
        },
        "data": {"path": [str(w.data_path)], "max_seq_len": w.seq + 1, "packing": w.packing},
        "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": TARGETS},
        "batch": {"global_batch_size": w.global_batch, "micro_batch_size": micro},
        "optim": {"name": "adamw", "lr": LR, "schedule": "constant", "warmup_steps": 0, "max_grad_norm": 1.0},
        "precision": w.precision,
        "memory": {"gradient_checkpointing": "auto", "budget_gib": w.budget_gib, "loss_chunk_tokens": chunk},
        "resources": {"num_workers": 1, "use_gpu": w.device.type == "cuda"},
        "run": {"max_steps": w.total_steps, "seed": 0, "output_dir": str(out_dir)},
        "objective": {"name": w.objective},
    }
    return load_spec(data=data)


def rayft_candidates(
    w: Workload, flops: dict, quantization: str = "none", compile_layers: bool | str = False
) -> list[dict]:
    """Every (micro-batch, loss chunk) with the checkpointing `train()` would pick for it and
    its estimate; `fits` and the predicted cost per token (lower is better). `compile_layers` as
    the row runs it: the plan of a compiled job counts what compiled layers and head keep."""
    from jobs import memory
    from jobs.train import loop

    L = w.config.num_hidden_layers
    kind = torch.device(w.device.type)
    chunks = [0] + [c for c in (4 * w.seq, 2 * w.seq, w.seq, w.seq // 2) if c > 0]
    rows = []
    for mb in divisors_desc(w.global_batch):
        tokens = mb * w.tokens_per_step // w.global_batch  # a DPO pair is two rows
        for chunk in chunks:
            if chunk and chunk >= tokens:
                continue  # CausalLMLoss does not chunk then: the same as 0
            spec = rayft_spec(w, mb, chunk, w.workdir / "unused", compile_layers, quantization=quantization)
            planned = loop.memory_plan(spec, kind)
            every, est_spec = planned.checkpoint_every_n_layers, planned.total_gib
            n_ckpt = 0 if every == 0 else len(range(0, L, every))
            recompute = n_ckpt * (2 * flops["layer_linear"] + flops["attn_fwd_per_layer"])
            recompute += 2 * flops["N_head"] if chunk else 0
            eff = tokens / (tokens + EFF_TOKENS)
            # The estimate of this very spec (for DPO: pairs, the reference forward), as the plan's.
            est = memory.estimate_for_spec(
                spec,
                micro_batch_size=mb,
                gradient_checkpointing=every > 0,
                checkpoint_every_n_layers=max(1, every),
                device=w.device.type,
                config=w.config,
                strategy="ddp",
            )
            rows.append(
                {
                    "micro_batch_size": mb,
                    "loss_chunk_tokens": chunk,
                    "checkpoint_every_n_layers": every,
                    "estimate_spec_gib": round(float(est_spec), 3),
                    "estimate_gib": round(est.peak_allocated_gib, 3),
                    "estimate_total_gib": round(est.total_gib, 3),
                    "fits": float(est_spec) <= w.budget_gib,
                    "cost": (flops["total"] + recompute) / eff / flops["total"],
                }
            )
    rows.sort(key=lambda r: (not r["fits"], r["cost"], -r["micro_batch_size"], -r["loss_chunk_tokens"]))
    return rows


def run_rayft(
    w: Workload,
    cand: dict,
    tokenizer,
    compile_layers: bool | str = False,
    quantization: str = "none",
    liger: bool = False,
    eager_head: bool = False,
    sdpa_priority: list[str] | None = None,
) -> dict:
    """One row: `jobs.train.loop.train` with a random-init base built on the device (quantized: loaded
    and quantized by `jobs.model.loading.load_base_model` from `weights_dir`). `eager_head`: compiled
    layers with the loss head eager (the default before the compiled head); `sdpa_priority`:
    SDPA's backends tried in this order (`torch.nn.attention.sdpa_kernel(..., set_priority=True)`)."""
    from jobs.objectives import sft  # CausalLMLoss and its head loss live there
    from jobs.train import loop
    from jobs.train.context import LocalContext

    out_dir = Path(tempfile.mkdtemp(prefix=f"rayft-{w.shape}-", dir=w.workdir))
    spec = rayft_spec(w, cand["micro_batch_size"], cand["loss_chunk_tokens"], out_dir, compile_layers, quantization)
    ends: list[float] = []

    def on_progress(metrics: dict) -> None:
        ends.append(time.perf_counter())  # after the step's .item(): the device is idle here

    original = loop.load_base_model

    quantized_layers = []

    def load_base_model(spec_, precision, **kwargs):
        if quantization != "none":
            model = original(spec_, precision, **kwargs)[0]
            quantized_layers.append(sum(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules()))
        else:
            model = build_model(w.config, w.device, w.dtype)
        if liger:  # the model's modules now run Liger's kernels; the globals are restored after the row
            stack.enter_context(liger_patched(model))
        fake_oom(f"rayft:{cand['micro_batch_size']}:{cand['loss_chunk_tokens']}")
        return model, tokenizer

    loop.load_base_model = load_base_model
    original_head = sft.compiled_head_loss
    if eager_head:
        sft.compiled_head_loss = lambda: sft._head_loss
    t0 = time.perf_counter()
    stack = contextlib.ExitStack()
    if sdpa_priority:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(sdpa_kernel([getattr(SDPBackend, b) for b in sdpa_priority], set_priority=True))
    try:
        with stack, memory_cap(w.device, w.budget_gib):
            summary = loop.train(
                spec, LocalContext(use_gpu=w.device.type == "cuda", on_progress=on_progress), resume=False
            )
            peak = torch.cuda.max_memory_allocated(w.device) / GIB if w.device.type == "cuda" else None
            device_state = device_readings(w.device)
    finally:
        loop.load_base_model = original
        sft.compiled_head_loss = original_head
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = [b - a for a, b in zip(ends[w.warmup - 1 :], ends[w.warmup :], strict=False)] if w.warmup else []
    inner = [r["step_time_s"] for r in records[w.warmup :]]
    real_tokens = [r["tokens"] for r in records[w.warmup :]]  # input tokens, padding not counted
    return {
        "micro_batch_size": summary["micro_batch_size"],
        "grad_accum_steps": summary["grad_accum_steps"],
        "gradient_checkpointing": bool(summary.get("gradient_checkpointing")),
        "checkpoint_every_n_layers": summary.get("checkpoint_every_n_layers"),
        "loss_chunk_tokens": cand["loss_chunk_tokens"],
        "step_s": timed,
        "inner_step_s": inner,
        "real_tokens": real_tokens,
        "peak_alloc_gib": peak,
        "estimate_gib": cand["estimate_gib"],
        "estimate_total_gib": cand["estimate_total_gib"],
        "estimate_spec_gib": summary.get("estimate_gib"),
        "quantization": quantization,
        "liger": liger,
        "compiled_layers": summary.get("compiled_layers"),
        "quantized_linear_layers": quantized_layers[0] if quantized_layers else 0,
        "final_loss": summary.get("final_loss"),
        "row_wall_s": wall,
        "eager_head": eager_head,
        "sdpa_priority": sdpa_priority,
        **device_state,
    }


def device_readings(device: torch.device) -> dict:
    """At the end of a row: the allocator's reserved peak and retries (a retry is a cudaFree of
    cached blocks to satisfy an allocation: slow, and a sign the cap is tight), the memory the
    device reports in use (context + reserved), and the SM / memory clocks, temperature and power
    nvidia-smi reads now (right after the last step: what the row ran at)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    out = {
        "max_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 3),
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "ooms": stats.get("num_ooms", 0),
        "device_used_gib": round((total - free) / GIB, 3),
    }
    query = "clocks.sm,clocks.mem,temperature.gpu,power.draw"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        got = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        out["nvidia_smi"] = dict(zip(query.split(","), [x.strip() for x in got.split(",")], strict=False))
    return out


# ---- HF Trainer + PEFT ----------------------------------------------------------------------


def training_arguments(w: Workload, micro: int, gc_on: bool, out_dir: Path, compile: bool = False):
    """`TrainingArguments` across transformers 5.x: `activation_checkpointing*` (5.2x) or the
    older `gradient_checkpointing*` names (5.17), whichever this version has."""
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    cuda = w.device.type == "cuda"
    kwargs = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=w.global_batch // micro,
        max_steps=w.total_steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=0,
        dataloader_num_workers=0,
        use_cpu=not cuda,
        torch_compile=compile,  # HF's own: torch.compile of the whole model (PEFT wrapper included)
        **{ckpt: gc_on, f"{ckpt}_kwargs": {"use_reentrant": False}},
    )
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise RuntimeError(f"TrainingArguments of transformers here lacks {unknown}")
    return TrainingArguments(**kwargs), ckpt


def hf_model(w: Workload, bf16_lora: bool = False):
    """The PEFT model; `bf16_lora`: the LoRA weights (and so AdamW's state) in the base's bf16,
    as `get_peft_model(..., autocast_adapter_dtype=False)` leaves them (a peer's faster, less
    exact option), else fp32 as rayft keeps them."""
    from peft import LoraConfig, get_peft_model

    model = build_model(w.config, w.device, w.dtype)
    model = get_peft_model(
        model,
        LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"),
        autocast_adapter_dtype=not bf16_lora,
    )
    for p in model.parameters():
        if p.requires_grad and p.dtype != (w.dtype if bf16_lora else torch.float32):
            p.data = p.data.to(w.dtype if bf16_lora else torch.float32)
    return model


def run_hf_once(w: Workload, model, micro: int, gc_on: bool, compile: bool = False) -> dict:
    from transformers import Trainer, TrainerCallback

    device = w.device
    ends: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            fake_oom(f"hf:{micro}:{int(gc_on)}")

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            ends.append(time.perf_counter())

    out_dir = Path(tempfile.mkdtemp(prefix=f"hf-{w.shape}-", dir=w.workdir))
    args, ckpt_name = training_arguments(w, micro, gc_on, out_dir, compile)
    trainer = Trainer(model=model, args=args, train_dataset=SeqDataset(w.seqs), callbacks=[StepTimer()])
    t0 = time.perf_counter()
    try:
        with memory_cap(device, w.budget_gib):
            result = trainer.train()
            peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    finally:
        with contextlib.suppress(Exception):
            trainer.accelerator.free_memory()
        del trainer
    timed = [b - a for a, b in zip(ends[w.warmup - 1 :], ends[w.warmup :], strict=False)] if w.warmup else []
    return {
        **device_readings(device),
        "micro_batch_size": micro,
        "grad_accum_steps": w.global_batch // micro,
        "gradient_checkpointing": gc_on,
        "step_s": timed,
        "peak_alloc_gib": peak,
        "final_loss": float(result.training_loss),
        "row_wall_s": time.perf_counter() - t0,
        "checkpointing_argument": ckpt_name,
    }


def unwrap_accelerate(model) -> None:
    """Undo accelerate's bf16 wrapping of `model.forward` (autocast + outputs to fp32), so the
    next Trainer on the same model wraps it once, not twice."""
    if "forward" in model.__dict__:
        del model.__dict__["forward"]
    model.__dict__.pop("_original_forward", None)


def run_hf(w: Workload, liger: bool = False, compile: bool = False, bf16_lora: bool = False) -> tuple[dict, list[dict]]:
    """Largest micro-batch that fits without checkpointing, else with it (descending, catching OOM).
    `liger`: the model runs Liger Kernel as `TrainingArguments(use_liger_kernel=True)` applies it
    (RMSNorm, SwiGLU, RoPE and the fused linear cross-entropy, which never materializes the logits;
    the proxy estimate then counts a loss chunked by sequence)."""
    from jobs import memory

    attempts: list[dict] = []
    model = hf_model(w, bf16_lora)
    stack = contextlib.ExitStack()
    if liger:
        stack.enter_context(liger_patched(model.get_base_model(), fused_linear_cross_entropy=True))
    try:
        for gc_on in (False, True):
            for micro in divisors_desc(w.global_batch):
                proxy = memory.estimate(
                    w.config,
                    micro_batch_size=micro,
                    seq_len=w.seq,
                    gradient_checkpointing=gc_on,
                    base_dtype=w.precision,
                    lora_r=LORA_R,
                    lora_target_modules=TARGETS,
                    loss_chunk_tokens=w.seq if liger else None,
                    device=w.device.type,
                )
                att = {
                    "micro_batch_size": micro,
                    "gradient_checkpointing": gc_on,
                    "proxy_estimate_gib": round(proxy.peak_allocated_gib, 3),
                }
                limit = w.budget_gib * (HF_PROXY_MARGIN if w.device.type == "cuda" else 1.0)
                if proxy.peak_allocated_gib > limit:
                    attempts.append({**att, "result": f"skipped: proxy estimate > {limit:.3g} GiB"})
                    continue
                failed = None
                try:
                    row = run_hf_once(w, model, micro, gc_on, compile)
                except Exception as e:  # noqa: BLE001 -- OOM is expected; anything else is re-raised below
                    failed = e
                if failed is None:
                    attempts.append({**att, "result": "ok"})
                    row["proxy_estimate_gib"] = att["proxy_estimate_gib"]
                    row["liger"], row["torch_compile"], row["bf16_lora"] = liger, compile, bf16_lora
                    return row, attempts
                if not is_oom(failed):
                    raise failed
                # Out of memory: drop what the failed step held, outside the `except` (whose
                # traceback keeps its tensors alive), and try the next candidate.
                failed = None
                model.zero_grad(set_to_none=True)
                unwrap_accelerate(model)
                attempts.append({**att, "result": "oom", "allocated_after_gib": round(free_memory(w.device), 3)})
                print(f"#   hf {w.shape} @{w.budget_gib:g} GiB: micro {micro} gc {gc_on}: out of memory", flush=True)
        raise RuntimeError("HF: nothing fits the budget")
    finally:
        stack.close()
        del model
        free_memory(w.device)


# ---- one row --------------------------------------------------------------------------------


def finish_row(base: dict, res: dict, flops: dict, ceiling: float) -> dict:
    steps = res.pop("step_s")
    mean = statistics.fmean(steps) if steps else float("nan")
    real = res.pop("real_tokens", None)
    if steps and base.get("ragged"):  # ragged rows: the input tokens the steps really had
        tok_s = sum(real) / sum(steps)
        base = {**base, "real_tokens": real}
    else:
        tok_s = base["tokens_per_step"] / mean if steps else None
    tflops = tok_s * flops["total"] / 1e12 if tok_s else None
    row = {**base, **res}
    row.update(
        {
            "tok_s": round(tok_s, 1) if tok_s else None,
            "model_tflops": float(f"{tflops:.4g}") if tflops else None,
            "fraction_of_matmul_ceiling": round(tflops / ceiling, 4) if tflops and ceiling else None,
            "step_s": [round(s, 4) for s in steps],
            "step_s_median": round(statistics.median(steps), 4) if steps else None,
            # the spread of the timed steps: coefficient of variation (stdev / mean), min and max
            "step_s_cv": round(statistics.stdev(steps) / mean, 4) if len(steps) > 1 else None,
            "step_s_min": round(min(steps), 4) if steps else None,
            "step_s_max": round(max(steps), 4) if steps else None,
            "peak_alloc_gib": round(res["peak_alloc_gib"], 3) if res.get("peak_alloc_gib") is not None else None,
        }
    )
    if row.get("estimate_gib") is not None and row.get("peak_alloc_gib"):
        row["estimate_rel_err"] = round((row["estimate_gib"] - row["peak_alloc_gib"]) / row["peak_alloc_gib"], 4)
    return row


CUDNN_FIRST = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]


def rayft_compile(loop_name: str) -> bool | str:
    """`model.compile` of a rayft row: `auto` (a job's default: compiled on a GPU) for DPO and the
    ragged rows, on for the compiled rows, off for the eager ones."""
    if loop_name == "rayft-dpo" or loop_name.startswith("rayft-ragged"):
        return "auto"
    return loop_name.endswith("-compile") or loop_name in ("rayft-compile-layers", "rayft-cudnn")


def run_row(loop_name: str, w: Workload, flops: dict, ceiling: float, tokenizer) -> dict:
    torch._dynamo.reset()  # each row compiles its own model: no earlier row's graphs or limits
    if loop_name.startswith("rayft-ragged"):
        w = w.for_ragged(packing="packed" in loop_name, attn="flex_attention" if loop_name.endswith("flex") else "sdpa")
    if loop_name == "rayft-dpo":
        # Model FLOPs of a DPO token: the policy's forward and backward, plus the reference
        # forward (the base with the adapter off): 2N + the causal attention forward again.
        w = w.for_dpo()
        layers = w.config.num_hidden_layers
        flops = {**flops, "total": flops["total"] + 2 * flops["N"] + layers * flops["attn_fwd_per_layer"]}
    base = {
        "shape": w.shape,
        "budget_gib": w.budget_gib,
        "loop": loop_name,
        "seq_len": w.seq,
        "global_batch_size": w.global_batch,
        "tokens_per_step": w.tokens_per_step,
        "objective": w.objective,
        "ragged": w.ragged,
        "packing": w.packing,
        "attn_implementation": w.attn,
        "warmup_steps": w.warmup,
        "timed_steps": w.steps,
        "micro_batch_size": None,
        "grad_accum_steps": None,
        "gradient_checkpointing": None,
        "tok_s": None,
        "model_tflops": None,
        "peak_alloc_gib": None,
        "estimate_gib": None,
    }
    start_alloc = free_memory(w.device)
    base["allocated_before_gib"] = round(start_alloc, 3)
    t0 = time.perf_counter()
    try:
        for part, (module, wheel) in OPTIONAL.items():
            if part in loop_name and importlib.util.find_spec(module) is None:
                return {**base, "status": f"skipped: {wheel} is not installed (carry its wheel, see the docstring)"}
        if loop_name.startswith("rayft"):
            quantization = "nf4" if loop_name.startswith("rayft-qlora") else "none"
            if quantization != "none":
                weights_dir(w)
            compiled = rayft_compile(loop_name)
            # rayft-compile-layers: the plan and head as they were before the compiled head (eager)
            cands = rayft_candidates(w, flops, quantization, compiled if loop_name != "rayft-compile-layers" else False)
            base["candidates"] = [c for c in cands if c["fits"]][:6]
            tried = []
            for cand in [c for c in cands if c["fits"]][:3]:
                failed = None
                try:
                    res = run_rayft(
                        w,
                        cand,
                        tokenizer,
                        # rayft-dpo: the default, `auto` (compiled on a GPU, eager on CPU)
                        compile_layers=compiled,
                        quantization=quantization,
                        liger=loop_name == "rayft-liger",
                        eager_head=loop_name == "rayft-compile-layers",
                        sdpa_priority=CUDNN_FIRST if loop_name == "rayft-cudnn" else None,
                    )
                except Exception as e:  # noqa: BLE001
                    failed = e
                if failed is None:
                    tried.append({**cand, "result": "ok"})
                    row = finish_row({**base, "attempts": tried, "status": "ok"}, res, flops, ceiling)
                    break
                if not is_oom(failed):
                    raise failed
                failed = None
                tried.append({**cand, "result": "oom (the estimate said it fits)"})
                free_memory(w.device)
                print(
                    f"#   rayft {w.shape} @{w.budget_gib:g} GiB: micro {cand['micro_batch_size']} chunk "
                    f"{cand['loss_chunk_tokens']}: out of memory although estimated to fit",
                    flush=True,
                )
            else:
                raise RuntimeError(
                    f"rayft: no configuration ran (tried {tried}; {sum(c['fits'] for c in cands)} estimated to fit)"
                )
        else:
            w = dataclasses.replace(w, steps=w.hf_steps or w.steps)  # the peer's speed: fewer timed steps do
            res, attempts = run_hf(
                w, liger="liger" in loop_name, compile="compile" in loop_name, bf16_lora=loop_name.endswith("bf16-lora")
            )
            row = finish_row({**base, "attempts": attempts, "status": "ok"}, res, flops, ceiling)
    except Exception as e:  # noqa: BLE001 -- a failed row is recorded; the run goes on
        traceback.print_exc()
        row = {**base, "status": f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
    row["row_seconds"] = round(time.perf_counter() - t0, 1)
    free_memory(w.device)
    return row


# ---- output ---------------------------------------------------------------------------------


def versions() -> dict:
    import accelerate
    import peft
    import transformers

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "accelerate": accelerate.__version__,
    }
    try:
        import pydantic

        out["pydantic"] = pydantic.__version__
    except ImportError:
        pass
    try:
        out["rayft_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "jobs"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        out["rayft_jobs_dirty"] = bool(dirty)
    except (OSError, subprocess.SubprocessError):
        out["rayft_commit"] = None
    return out


def environment_warnings() -> list[str]:
    """Things in this environment that make the comparison not what it claims to be."""
    out = []
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        out.append(
            "transformers has no activation_checkpointing_enable: jobs.model.loading.enable_checkpointing falls back "
            "to gradient_checkpointing_enable without every_n_layers, so rayft's selective checkpointing "
            "(every k-th layer) checkpoints every layer here; carry transformers>=5.24 "
            "(see this file's docstring)"
        )
    for w in out:
        print(f"# WARNING: {w}", flush=True)
    return out


def gpu_slug(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-dry-run"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def best_of_each(by: dict[str, dict]) -> dict:
    """The fastest full-length SFT row of each side (its loop named) and their ratio: each at its best."""
    out: dict = {}
    for side in ("rayft", "hf"):
        rows = [
            (r["tok_s"], name)
            for name, r in by.items()
            if name.split("-")[0] == side
            and r.get("tok_s")
            and r.get("objective", "sft") == "sft"
            and not r.get("ragged")
            and r.get("quantization", "none") == "none"
        ]
        best = max(rows, default=(None, None))
        out[f"best_{side}_tok_s"], out[f"best_{side}_loop"] = best
    ratio = out["best_rayft_tok_s"] / out["best_hf_tok_s"] if out["best_rayft_tok_s"] and out["best_hf_tok_s"] else None
    out["best_ratio"] = round(ratio, 3) if ratio else None
    return out


def comparisons(rows: list[dict], goal: float) -> list[dict]:
    out = []
    keys = sorted({(r["shape"], r["budget_gib"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for shape, budget in keys:
        by = {r["loop"]: r for r in rows if r["shape"] == shape and r["budget_gib"] == budget}
        a, b = by.get("rayft", {}).get("tok_s"), by.get("hf", {}).get("tok_s")
        ratio = a / b if a and b else None
        ray = by.get("rayft", {})
        compiled = by.get("rayft-compile", {}).get("tok_s")
        qlora = by.get("rayft-qlora", {})
        liger, hf_liger = by.get("rayft-liger", {}).get("tok_s"), by.get("hf-liger", {}).get("tok_s")
        out.append(
            {
                "shape": shape,
                "budget_gib": budget,
                "rayft_tok_s": a,
                "hf_tok_s": b,
                "rayft_compile_tok_s": compiled,
                "compile_speedup": round(compiled / a, 3) if compiled and a else None,
                "ratio": round(ratio, 3) if ratio else None,
                "goal": goal,
                "met": ratio >= goal if ratio else None,
                "rayft_fraction_of_matmul_ceiling": ray.get("fraction_of_matmul_ceiling"),
                "hf_fraction_of_matmul_ceiling": by.get("hf", {}).get("fraction_of_matmul_ceiling"),
                "rayft_estimate_rel_err": ray.get("estimate_rel_err"),
                "qlora_tok_s": qlora.get("tok_s"),
                "qlora_peak_alloc_gib": qlora.get("peak_alloc_gib"),
                "qlora_estimate_gib": qlora.get("estimate_gib"),
                "qlora_estimate_rel_err": qlora.get("estimate_rel_err"),
                "rayft_liger_tok_s": liger,
                "liger_speedup": round(liger / a, 3) if liger and a else None,
                "hf_liger_tok_s": hf_liger,
                "hf_liger_speedup": round(hf_liger / b, 3) if hf_liger and b else None,
                **best_of_each(by),
            }
        )
    return out


HEADER = (
    f"{'shape':9} {'budget':>6} {'loop':19} {'mb':>3} {'acc':>3} {'gc':>4} {'chunk':>5} {'tok/s':>9} "
    f"{'TFLOP/s':>8} {'%ceil':>6} {'peak':>7} {'est':>7} {'err':>6}  status"
)


def fmt_row(r: dict) -> str:
    def f(v, spec, width):
        return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{'-':>{width}}"

    gc_s = (
        "-"
        if r.get("gradient_checkpointing") is None
        else (
            "off"
            if not r["gradient_checkpointing"]
            else (f"/{r['checkpoint_every_n_layers']}" if (r.get("checkpoint_every_n_layers") or 1) > 1 else "on")
        )
    )
    frac = r.get("fraction_of_matmul_ceiling")
    return (
        f"{r['shape']:9} {r['budget_gib']:6g} {r['loop']:19} {f(r.get('micro_batch_size'), '3d', 3)} "
        f"{f(r.get('grad_accum_steps'), '3d', 3)} {gc_s:>4} {f(r.get('loss_chunk_tokens'), '5d', 5)} "
        f"{f(r.get('tok_s'), '9.0f', 9)} {f(r.get('model_tflops'), '8.1f', 8)} "
        f"{f(frac * 100 if frac is not None else None, '5.1f', 5)}% {f(r.get('peak_alloc_gib'), '7.2f', 7)} "
        f"{f(r.get('estimate_gib'), '7.2f', 7)} {f(r.get('estimate_rel_err'), '+6.1%', 6)}  {r.get('status', '')}"
    )


def print_best(result: dict) -> None:
    """Each side at its best, per shape and budget: the goal's ratio."""
    for c in result["comparisons"]:
        if c.get("best_ratio"):
            print(
                f"best {c['shape']} @{c['budget_gib']:g} GiB: {c['best_rayft_loop']} {c['best_rayft_tok_s']:.0f} tok/s"
                f" / {c['best_hf_loop']} {c['best_hf_tok_s']:.0f} tok/s = {c['best_ratio']:.3f}"
            )


def print_table(result: dict) -> None:
    print("\n" + HEADER)
    for r in result["rows"]:
        print(fmt_row(r))
    c = result["matmul_ceiling"]
    print(f"\nmatmul ceiling ({c['n']}^3 {c['dtype']}): {c['tflops']:.1f} TFLOP/s")
    goals = result["goals"]
    print(
        f"\ngoals: rayft/hf >= {goals['speedup_vs_hf']}; 8B rayft >= {goals['fraction_of_matmul_ceiling_8b']:.0%} "
        f"of the matmul ceiling; rayft estimate within +-{goals['estimate_rel_err']:.0%} of the measured peak"
    )
    print(
        f"{'shape':9} {'budget':>6} {'rayft tok/s':>12} {'hf tok/s':>10} {'rayft/hf':>9} {'speedup':>8} "
        f"{'rayft %ceil':>11} {'hf %ceil':>9} {'est err':>8} {'compile x':>9}"
    )
    for c in result["comparisons"]:

        def f(v, spec, width):
            return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{'-':>{width}}"

        met = "-" if c["met"] is None else ("met" if c["met"] else "MISSED")
        print(
            f"{c['shape']:9} {c['budget_gib']:6g} {f(c['rayft_tok_s'], '12.0f', 12)} {f(c['hf_tok_s'], '10.0f', 10)} "
            f"{f(c['ratio'], '9.3f', 9)} {met:>8} {f(c['rayft_fraction_of_matmul_ceiling'], '11.1%', 11)} "
            f"{f(c['hf_fraction_of_matmul_ceiling'], '9.1%', 9)} {f(c['rayft_estimate_rel_err'], '+8.1%', 8)} "
            f"{f(c['compile_speedup'], '9.3f', 9)}"
        )


# ---- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks the pipeline, < 1 minute")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="directory of the result file")
    ap.add_argument("--shapes", help="comma-separated subset of " + ", ".join(SHAPES))
    ap.add_argument("--budgets", help="comma-separated GiB (default 40,80; dry run 0.0021,0.01)")
    ap.add_argument("--seq", type=int, help="sequence length (default 2048; dry run 64)")
    ap.add_argument("--warmup", type=int, help="untimed optimizer steps per row (default 2; dry run 1)")
    ap.add_argument("--steps", type=int, help="timed optimizer steps per row (default 20; dry run 2)")
    ap.add_argument("--hf-steps", type=int, help="timed optimizer steps per HF row (default 8; dry run 2)")
    ap.add_argument(
        "--loops",
        default="rayft,hf",
        help="the rows run for every shape and budget, in this order, of: " + ", ".join(LOOPS) + " (default "
        "rayft,hf, alternating which goes first; '' for none)",
    )
    ap.add_argument(
        "--compile-shapes",
        default=None,
        help="shapes that get one more rayft row with model.compile=true at the first budget, "
        "after all main rows and only within the time limit (default: the first shape; "
        "'' for none)",
    )
    ap.add_argument(
        "--qlora-shapes",
        default=None,
        help="shapes that get one more rayft row with model.quantization=nf4 at the first budget, "
        "last and only within the time limit (default: llama-8b; dry run: tiny; '' for none)",
    )
    ap.add_argument(
        "--qlora-only", action="store_true", help="run only the QLoRA rows (no rayft/HF comparison, no compile rows)"
    )
    ap.add_argument(
        "--time-limit-s",
        type=float,
        default=390.0,
        help="start no new row after this many seconds (rows left are recorded as skipped)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # PEFT probes transformers' deprecated alias on every forward; not ours, and noisy.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

    loops = [x for x in args.loops.split(",") if x]
    if set(loops) - set(LOOPS):
        ap.error(f"--loops: unknown {sorted(set(loops) - set(LOOPS))}; known: {', '.join(LOOPS)}")
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU check", file=sys.stderr)
        return 2
    shapes = TINY_SHAPES if dry else SHAPES
    if args.shapes:
        shapes = {n: {**SHAPES, **TINY_SHAPES}[n] for n in args.shapes.split(",")}
    gbs = {**GLOBAL_BATCH, **TINY_GLOBAL_BATCH}
    budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else ([0.0021, 0.01] if dry else [40.0, 80.0])
    seq = args.seq or (64 if dry else 2048)
    warmup = args.warmup if args.warmup is not None else (1 if dry else 2)
    steps = args.steps or (2 if dry else 20)
    hf_steps = args.hf_steps or (2 if dry else 8)
    if warmup < 1 or steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the first timed interval starts at the end of a warmup step)")

    started = time.perf_counter()
    today = _dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{today}-{gpu_slug(device)}.json"
    ceiling = matmul_ceiling(device, 256 if dry else 8192, warmup=5, reps=10 if dry else 100)
    print(f"# matmul ceiling: {ceiling['tflops']:.1f} TFLOP/s ({ceiling['n']}^3 {ceiling['dtype']})", flush=True)
    result = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "date": today,
        "versions": versions(),
        "device_total_gib": (
            torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
        ),
        "dry_run": dry,
        "matmul_ceiling": ceiling,
        "goals": {"speedup_vs_hf": 1.3, "fraction_of_matmul_ceiling_8b": 0.65, "estimate_rel_err": 0.05},
        "method": {
            "flops_per_token": "4N + 6 L S d_q (N: decoder linear weights + LM head; causal attention; "
            "recomputation not counted)",
            "tok_s": "global_batch x seq / mean interval between consecutive end-of-step timestamps after warmup",
            "peak_alloc_gib": "torch.cuda.max_memory_allocated over the row (null on CPU)",
            "estimate_gib": "rayft rows: jobs.memory peak_allocated for the configuration and the bench's "
            "full-length data (compare with peak_alloc_gib); estimate_spec_gib: what train() "
            "logged (estimate total incl. CUDA context + slack). HF rows: null; "
            "proxy_estimate_gib is rayft's model for HF's micro-batch without loss chunking",
            "budget": "allocator capped with torch.cuda.set_per_process_memory_fraction; rayft also needs its "
            "estimate total <= budget",
            "rayft_choice": f"least (model+recompute FLOPs)/eff among configs whose estimate fits; "
            f"eff = t/(t+{EFF_TOKENS}), t = tokens per micro-batch",
            "hf_choice": "largest micro-batch without checkpointing that runs, else largest with it "
            f"(descending, catching OOM; proxy estimate > {HF_PROXY_MARGIN} x budget not tried)",
        },
        "warnings": environment_warnings(),
        "flops_per_token": {},
        "rows": [],
        "comparisons": [],
    }

    def save() -> None:
        result["comparisons"] = comparisons(result["rows"], result["goals"]["speedup_vs_hf"])
        result["wall_s"] = round(time.perf_counter() - started, 1)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, path)

    print(HEADER, flush=True)
    order_flip = 0
    at_first_budget: dict[str, tuple] = {}  # shape -> (workload, flops, tokenizer) for the compile rows
    with tempfile.TemporaryDirectory(prefix="rayft-gpu-compare-") as tmp:
        workdir = Path(tmp)
        for shape_name, shape in shapes.items():
            config = llama_config(shape, seq)
            flops = flops_per_token(config, seq)
            result["flops_per_token"][shape_name] = flops
            gb = gbs[shape_name]
            model_dir = workdir / f"model-{shape_name}"
            config.save_pretrained(model_dir)  # config only: rayft's estimate reads it; weights are random
            seqs = make_sequences(config.vocab_size, gb * (warmup + steps), seq)
            data_path = workdir / f"data-{shape_name}.jsonl"
            write_jsonl(seqs, data_path)
            tokenizer = id_tokenizer(config.vocab_size)
            for budget in budgets:
                w = Workload(
                    shape_name,
                    config,
                    seq,
                    gb,
                    budget,
                    device,
                    warmup,
                    steps,
                    workdir,
                    data_path,
                    model_dir,
                    seqs,
                    hf_steps=hf_steps,
                )
                at_first_budget.setdefault(shape_name, (w, flops, tokenizer))
                row_loops = loops
                if loops == ["rayft", "hf"]:  # alternate which goes first
                    row_loops = loops if order_flip % 2 == 0 else loops[::-1]
                order_flip += 1
                for loop_name in [] if args.qlora_only else row_loops:
                    if time.perf_counter() - started > args.time_limit_s:
                        row = {
                            "shape": shape_name,
                            "budget_gib": budget,
                            "loop": loop_name,
                            "seq_len": seq,
                            "global_batch_size": gb,
                            "micro_batch_size": None,
                            "grad_accum_steps": None,
                            "gradient_checkpointing": None,
                            "tok_s": None,
                            "model_tflops": None,
                            "peak_alloc_gib": None,
                            "estimate_gib": None,
                            "status": f"skipped: time limit {args.time_limit_s:g} s",
                        }
                    else:
                        row = run_row(loop_name, w, flops, ceiling["tflops"], tokenizer)
                    result["rows"].append(row)
                    print(fmt_row({**row, "budget_gib": budget}), flush=True)
                    save()
        # Optional extra rows: is torch.compile worth turning on? Last, so they never starve the
        # main comparison; same configuration choice as the plain rayft row.
        compile_shapes = (
            []
            if args.qlora_only
            else list(shapes)[:1]
            if args.compile_shapes is None
            else [n for n in args.compile_shapes.split(",") if n]
        )
        for shape_name in compile_shapes:
            if shape_name not in at_first_budget or time.perf_counter() - started > args.time_limit_s:
                continue
            w, flops, tokenizer = at_first_budget[shape_name]
            row = run_row("rayft-compile", w, flops, ceiling["tflops"], tokenizer)
            result["rows"].append(row)
            print(fmt_row(row), flush=True)
            save()
        # QLoRA rows: 4-bit base, same loop; last, for the same reason.
        qlora_shapes = (
            ["tiny" if dry else "llama-8b"]
            if args.qlora_shapes is None
            else [n for n in args.qlora_shapes.split(",") if n]
        )
        for shape_name in qlora_shapes:
            if shape_name not in at_first_budget or time.perf_counter() - started > args.time_limit_s:
                continue
            w, flops, tokenizer = at_first_budget[shape_name]
            row = run_row("rayft-qlora", w, flops, ceiling["tflops"], tokenizer)  # skipped without bitsandbytes
            result["rows"].append(row)
            print(fmt_row(row), flush=True)
            save()
    save()
    print_table(result)
    print_best(result)
    print(f"\n{result['wall_s']} s; wrote {path}")
    # A row skipped for want of an optional package (OPTIONAL) says so; it fails nothing else.
    return (
        0
        if all(
            r.get("status") == "ok"
            or (any(part in r["loop"] for part in OPTIONAL) and r["status"].startswith("skipped"))
            for r in result["rows"]
        )
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
