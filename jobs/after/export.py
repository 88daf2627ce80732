"""What a user does with a finished run: export its adapter (as is, or merged into the base as
a standalone Hugging Face model) and generate text with it.

Invariants:

* Only a finished run is exported: `<output_dir>/adapter/` with its config and weights (written
  by the loop at the end). Anything else is one `UserError` line, and nothing is written.
* An export is built in a temporary sibling of its target and renamed into place at the end:
  the target is whole or absent, never half-written. An existing non-empty target is refused.
* A merged export is the base with `merge_and_unload()` applied in fp32, then cast to `dtype`:
  it loads with `AutoModelForCausalLM.from_pretrained` without peft, and its fp32 logits equal
  base + adapter logits up to float rounding.
* The base is the one the adapter names (`base_model_name_or_path` in `adapter_config.json`:
  tiny-llama's saved `base/`, a GGUF base's de-quantized copy, a local dir or a hub id).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from jobs.errors import UserError
from jobs.model.loading import no_save_progress_bar, quiet_unused_bitsandbytes, without_peft_alias_notice
from jobs.run import save_check

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def finished_adapter(output_dir: Path) -> Path:
    """`<output_dir>/adapter`, or a one-line UserError saying what is missing."""
    out = Path(output_dir)
    if not out.is_dir():
        raise UserError(f"{out}: no such run directory")
    adapter = out / "adapter"
    missing = [f for f in ADAPTER_FILES if not (adapter / f).is_file()]
    if missing:
        raise UserError(
            f"{out}: no finished adapter (adapter/{missing[0]} is missing); a run writes it when it "
            "ends: finish (or rerun to resume) the run first"
        )
    return adapter


def base_of(adapter_dir: Path) -> str:
    """The base `adapter_dir` names, after the whole directory is checked (`jobs.model.adapter_check`:
    its config against the base's shapes, before any weight is allocated)."""
    from jobs.model.adapter_check import check_adapter

    return check_adapter(Path(adapter_dir))


def _cannot_load(what: Path | str, e: Exception) -> UserError:
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    return UserError(f"{what}: cannot be loaded ({first})")


def _target(output_dir: Path, to: Path | None, merge: bool) -> Path:
    target = Path(to) if to else Path(output_dir) / ("merged" if merge else "adapter-export")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"--to {target}: exists and is not empty; name a new directory")
    return target


def _build_into(target: Path, build: Callable[[Path], None]) -> Path:
    """Build into `<target>.tmp-<pid>`, then rename: the target is whole or absent."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        if target.exists():
            target.rmdir()  # empty (checked in _target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _readme(base: str, adapter_dir: Path, merged: bool, dtype: str) -> str:
    if merged:
        return (
            f"# Merged model exported by rayft\n\nBase model: `{base}`\n\nLoRA adapter merged into it: "
            f"`{adapter_dir}` (PEFT `merge_and_unload`, in fp32, saved as {dtype}).\n\n"
            "Loads without peft:\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(THIS_DIR)\ntokenizer = AutoTokenizer.from_pretrained("
            "THIS_DIR)\n```\n"
        )
    return (
        f"# LoRA adapter exported by rayft\n\nThis adapter belongs to the base model `{base}` and is only "
        f"meaningful on top of it.\n\nSource: `{adapter_dir}`.\n\n```python\nfrom transformers import "
        f"AutoModelForCausalLM\nfrom peft import PeftModel\nbase = AutoModelForCausalLM.from_pretrained("
        f'"{base}")\nmodel = PeftModel.from_pretrained(base, THIS_DIR)\n```\n'
    )


def _quiet() -> None:
    """These commands print their own lines: no per-tensor loading bars, and no bitsandbytes notice
    about CPU kernels (PEFT imports bitsandbytes; nothing here loads a quantized base, so
    `quiet_unused_bitsandbytes(False)`). Called before PEFT is imported, where that notice comes.
    PEFT's alias notice: `without_peft_alias_notice` where the adapter is loaded."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    quiet_unused_bitsandbytes(False)


def load_adapted(adapter_dir: Path, dtype: torch.dtype = torch.float32):
    """(PeftModel over its base, tokenizer) for `adapter_dir`, in eval mode."""
    _quiet()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = base_of(adapter_dir)
    try:
        base_model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    except OSError as e:
        raise UserError(f"{adapter_dir}: cannot load its base model {base!r}: {str(e).splitlines()[0]}") from None
    except (ValueError, RuntimeError, KeyError, TypeError) as e:  # checked above; what remains is damage
        raise _cannot_load(base, e) from None
    try:
        with without_peft_alias_notice():
            model = PeftModel.from_pretrained(base_model, str(adapter_dir))
        tok = AutoTokenizer.from_pretrained(str(adapter_dir))
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise _cannot_load(adapter_dir, e) from None
    model.eval()
    return model, tok


def export(output_dir: Path, *, merge: bool = False, dtype: str = "fp32", to: Path | None = None) -> Path:
    """Export the run's adapter (copied, with a README naming its base) or, with `merge`, a
    standalone model. Returns the target directory."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    adapter = finished_adapter(output_dir)
    base = base_of(adapter)
    target = _target(output_dir, to, merge)

    def copy_adapter(tmp: Path) -> None:
        shutil.copytree(adapter, tmp, dirs_exist_ok=True)
        weights = "adapter_model.safetensors"
        save_check.check_file(tmp / weights, save_check.read_back(adapter / weights))
        (tmp / "README.md").write_text(_readme(base, adapter, False, dtype))

    def merged(tmp: Path) -> None:
        model, tok = load_adapted(adapter, torch.float32)
        plain = model.merge_and_unload()
        plain.to(DTYPES[dtype])
        plain.config.dtype = DTYPES[dtype]
        with no_save_progress_bar():
            plain.save_pretrained(tmp, max_shard_size="2GB")  # safetensors
        save_check.check_merged(tmp, plain)
        tok.save_pretrained(tmp)
        (tmp / "README.md").write_text(_readme(base, adapter, True, dtype))

    return _build_into(target, merged if merge else copy_adapter)


# ---- generation ------------------------------------------------------------------------------


def load_for_generation(path: Path):
    """(model, tokenizer) from a run directory (base + its adapter), an adapter directory, or a
    merged export (a plain Hugging Face model directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if (path / "adapter_config.json").is_file():
        return load_adapted(path)
    if (path / "config.json").is_file():
        from jobs.model.adapter_check import check_model_dir

        _quiet()
        check_model_dir(path)  # config against weights' shapes, before anything is allocated
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path))
            tok = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
            raise _cannot_load(path, e) from None
        model.eval()
        return model, tok
    return load_adapted(finished_adapter(path))


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt as the model saw prompts in training: BOS + prompt (`jobs.data.encode_prompt`),
    or with `chat`, one user turn rendered through the tokenizer's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat: this model's tokenizer has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    from jobs.data import encode_prompt

    return list(encode_prompt(tokenizer, prompt))


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompt: str,
    *,
    chat: bool = False,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    stream: bool = True,
    seed: int = 0,
) -> str:
    """The answer to `prompt` (greedy at temperature 0, else sampled with `seed`), streamed to
    stdout as it is produced when `stream`."""
    from transformers import TextStreamer

    ids = torch.tensor([prompt_ids(tokenizer, prompt, chat)])
    sampling = temperature > 0
    kwargs = dict(do_sample=True, temperature=temperature) if sampling else dict(do_sample=False)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            streamer=streamer,
            **kwargs,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def prompts_from(lines: Iterable[str]) -> Iterable[str]:
    """Interactive prompts: one per non-empty line, until EOF."""
    for line in lines:
        line = line.rstrip("\n")
        if line.strip():
            yield line
