"""The memory package's one I/O boundary: reading a model's config from disk or the hub.

Everything else in `jobs.memory` is arithmetic on a config object already in memory; the
entry points that take a spec (`plan_for_spec`, `estimate_for_spec`, the tables) call
`config_from_spec` here when their caller passes no `config=`, and callers that ask several
questions of one spec read the config once and pass it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobs.spec import JobSpec


def config_is_local(spec: JobSpec) -> bool:
    """Whether `spec.model`'s config is here to read without a download (tiny-llama, a package or
    a directory; not a hub id)."""
    name = spec.model.name
    return name == "tiny-llama" or name.startswith(("pkg:", ".", "/")) or os.path.isdir(name)


def config_from_spec(spec: JobSpec):
    """The transformers config of `spec.model`, without loading any weights.

    `tiny-llama` is built in; a directory (or hub id) is read with AutoConfig, with the token
    named by `model.hf_token_env`; a GGUF file is read from its metadata (transformers does
    this with the `gguf` package; no tensor is de-quantized). Problems raise `SpecError`
    naming `model.name` / `model.gguf_file`.
    """
    from transformers import AutoConfig

    from jobs.errors import SpecError
    from jobs.spec import resolve_model_dir

    m = spec.model
    if m.name == "tiny-llama":
        from jobs.model.tiny import tiny_llama_config

        return tiny_llama_config(attn_implementation=m.attn_implementation)

    src = resolve_model_dir(m.name)  # `pkg:NAME` -> the package's directory
    try:
        if m.gguf_file:
            return AutoConfig.from_pretrained(src, gguf_file=m.gguf_file)
        token = os.environ.get(m.hf_token_env) if m.hf_token_env else None
        return AutoConfig.from_pretrained(src, token=token)
    except ImportError as e:
        raise SpecError(f"model.gguf_file: reading GGUF metadata needs the `gguf` package ({e})") from None
    except (OSError, ValueError) as e:
        key = "model.gguf_file" if m.gguf_file else "model.name"
        what = f"{m.name}/{m.gguf_file}" if m.gguf_file else m.name
        raise SpecError(
            f"{key}: cannot read the model config of {what!r} for the memory estimate: {str(e).splitlines()[0]}"
        ) from None
