"""What an adapter directory or a merged export must be before `rayft export` / `rayft generate`
load anything from it: a run directory is a file other processes and people can edit, so it is
checked like user input.

Invariants: every check here reads only small files (JSON configs, safetensors headers) and
builds the base on the meta device (no storage), so a damaged directory is refused in one
`UserError` line before a byte of weights is allocated:

* `adapter_config.json` is a regular file of at most `MAX_CONFIG_BYTES`, a JSON object; `r` an
  integer (not a boolean) in 1..min(in, out) of every targeted layer; `lora_alpha` finite;
  `target_modules` names layers the base has (linear or embedding layers);
* `base_model_name_or_path` is a hub id (`org/name`, no `..`) or an existing model directory
  outside the system trees, named without a `..` component; a hub id's shapes are checked
  wherever its config is in the local Hugging Face cache (no download);
* every tensor in the weights file has the shape the config and the base imply (a LoRA `A` is
  r x in, `B` out x r; a merged model's tensors are the config's), and no tensor is missing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from jobs.errors import UserError

MAX_CONFIG_BYTES = 1 << 20
# A Hugging Face hub id: `name` or `org/name` (letters, digits, '-', '_', '.'), never `..`.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")


# The files of an adapter directory PEFT reads (`PeftModel.from_pretrained` / `load_adapter`): other
# files there, however named, change nothing it loads.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def adapter_digest(path: str | None) -> str | None:
    """An adapter directory's identity: the SHA-256 of each file PEFT reads, streamed in blocks (a
    junk `adapter_model.old` of a gigabyte beside it is neither read nor hashed). What the
    precomputed reference and the resume key compare of `model.adapter`."""
    if not path:
        return None
    from jobs.data.cache import file_sha256

    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(f"{name}\0{file_sha256(f)}\0".encode())
    return h.hexdigest()


def read_json_config(path: Path) -> dict[str, Any]:
    """The JSON object in `path`: a regular file (never a FIFO or device: opened without blocking),
    at most MAX_CONFIG_BYTES, else a one-line UserError naming it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: is not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise UserError(f"{path}: {info.st_size} bytes, more than a config has ({MAX_CONFIG_BYTES})")
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    try:
        cfg = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: is not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: is not a JSON object")
    return cfg


def check_base_name(base: Any, where: str) -> str:
    """`base_model_name_or_path` as a loadable name: a hub id or an existing model directory."""
    from jobs.run.outputs import SYSTEM_TREES

    if not isinstance(base, str) or not base.strip():
        raise UserError(f"{where}: base_model_name_or_path must name the base model (a directory or hub id)")
    if "\x00" in base or len(base) > 4096:
        raise UserError(f"{where}: base_model_name_or_path is not a path or hub id")
    if ".." in Path(base).parts:
        raise UserError(f"{where}: base_model_name_or_path {base[:200]!r} climbs out with '..': name the base directly")
    if os.path.isabs(base) or os.path.isdir(base):
        real = Path(os.path.realpath(base))
        if any(real == Path(t) or real.is_relative_to(t) for t in SYSTEM_TREES) or str(real) == "/":
            raise UserError(f"{where}: base_model_name_or_path {base[:200]!r} is a system directory, not a model")
        if not (real / "config.json").is_file():
            raise UserError(
                f"{where}: base_model_name_or_path {base[:200]!r} is not a model directory (no config.json)"
            )
        return base
    if not HUB_ID.fullmatch(base):
        raise UserError(f"{where}: base_model_name_or_path {base[:200]!r} is neither a model directory nor a hub id")
    return base


def meta_model(config_source: str | Path | dict, where: str):
    """The model a config describes, on the meta device (shapes only, no storage)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if isinstance(config_source, dict):
            kind = str(config_source.get("model_type"))
            config = AutoConfig.for_model(kind, **{k: v for k, v in config_source.items() if k != "model_type"})
        else:
            config = AutoConfig.from_pretrained(str(config_source))
        check_config_sizes(config, where)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except UserError:
        raise
    except Exception as e:  # a config transformers cannot build a model from
        raise UserError(
            f"{where}: not a model config transformers can build ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})"
        ) from None


# A config dimension above this is not a model anyone loads on one host (and only allocates).
MAX_DIM = 1 << 20


def check_config_sizes(config, where: str) -> None:
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        v = getattr(config, name, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_DIM:
            raise UserError(f"{where}: {name}={str(v)[:40]} is not a positive size up to {MAX_DIM}")


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header alone; a one-line UserError when the
    file is not one (cut short, a header that is not JSON, offsets past the end)."""
    try:
        info = os.lstat(path)
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{path}: is not a regular file")
    size = info.st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: is not a safetensors file (shorter than its header)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, 100 << 20):
            raise UserError(f"{path}: is not a safetensors file (header of {n} bytes in a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path}: is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: is not a safetensors file (its header is not a JSON object)")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = (
            isinstance(info, dict)
            and isinstance(info.get("shape"), list)
            and isinstance(info.get("data_offsets"), list)
        )
        if ok:
            start, end = (info["data_offsets"] + [None, None])[:2]
            ok = isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size - 8 - n
        if not ok or not all(isinstance(d, int) and d >= 0 for d in info["shape"]):
            raise UserError(f"{path}: tensor {name[:100]!r} has a broken entry in the header")
        shapes[name] = tuple(info["shape"])
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if max(ends, default=0) != size - 8 - n:  # safetensors refuses bytes no tensor covers
        raise UserError(
            f"{path}: is not a safetensors file ({size - 8 - n - max(ends, default=0)} bytes past its tensors)"
        )
    return shapes


def _targets(cfg: dict, model, where: str) -> dict[str, Any]:
    """{module name: module} of the base's layers `target_modules` names, as PEFT matches them (a
    list: names or name suffixes; a string: a regular expression the whole name matches)."""
    targets = cfg.get("target_modules")
    modules = dict(model.named_modules())
    if isinstance(targets, str):
        if targets == "all-linear":
            return {n: m for n, m in modules.items() if _dims(m) and not n.endswith("lm_head")}
        try:
            rx = re.compile(targets)
        except re.error:
            raise UserError(f"{where}: target_modules {targets[:100]!r} is not a regular expression") from None
        return {n: m for n, m in modules.items() if rx.fullmatch(n)}
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise UserError(f"{where}: target_modules must be a non-empty list of layer names")
    found: dict[str, Any] = {}
    for t in targets:
        hits = {n: m for n, m in modules.items() if n == t or n.endswith("." + t)}
        if not hits:
            raise UserError(f"{where}: target_modules names {t[:100]!r}, which is no layer of the base model")
        found.update(hits)
    return found


def _dims(module) -> tuple[int, int] | None:
    """(in, out) of a layer LoRA can adapt (linear or embedding), else None."""
    for a, b in (("in_features", "out_features"), ("num_embeddings", "embedding_dim")):
        if isinstance(getattr(module, a, None), int) and isinstance(getattr(module, b, None), int):
            return getattr(module, a), getattr(module, b)
    return None


def check_lora_config(cfg: dict, where: str) -> int:
    """The rank, after the config's own values are checked (types and ranges)."""
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_DIM:
        raise UserError(f"{where}: r={str(r)[:40]} is not a LoRA rank (an integer from 1)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise UserError(f"{where}: lora_alpha={str(alpha)[:40]} is not a finite number")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{where}: peft_type={str(cfg.get('peft_type'))[:40]} is not LORA")
    return r


def check_adapter(adapter_dir: Path) -> str:
    """Check `adapter_dir` (see the module's invariants); returns the base it names."""
    adapter_dir = Path(adapter_dir)
    where = f"{adapter_dir}/adapter_config.json"
    cfg = read_json_config(adapter_dir / "adapter_config.json")
    r = check_lora_config(cfg, where)
    base = check_base_name(cfg.get("base_model_name_or_path"), where)
    if os.path.isdir(base):
        model = check_model_dir(Path(base), weights=False)
    elif (cached := cached_hub_config(base)) is not None:
        model = meta_model(read_json_config(cached), str(cached))
    else:  # a hub id not downloaded yet: its shapes come with the download (from_pretrained refuses a mismatch)
        return base
    targets = _targets(cfg, model, where)
    hidden = getattr(model.config, "hidden_size", None)
    if isinstance(hidden, int) and r > hidden:  # the rule `rayft run` applies (jobs.finetune.check_lora_rank)
        raise UserError(f"{where}: r={r} exceeds the base's hidden size {hidden}: not an adapter of this base")
    weights = adapter_dir / "adapter_model.safetensors"
    targets = _transformed(targets, cfg.get("layers_to_transform"), where)
    # complete: PEFT loads an adapter missing a layer's A or B with that tensor at its fresh init (a
    # zero B: the layer unadapted), without a word; an export or generation from it would be wrong.
    _check_lora_weights(safetensors_shapes(weights), targets, r, not cfg.get("rank_pattern"), weights, complete=True)
    return base


# The names PEFT's `layers_pattern` defaults to: the block list whose index `layers_to_transform` picks.
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|block|blocks|layer)\.(\d+)\.")


def _transformed(targets: dict, layers: Any, where: str) -> dict:
    """The layers of `targets` PEFT adapts given `layers_to_transform` (an index or a list of
    them; None: every layer)."""
    if layers is None:
        return targets
    picked = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(picked, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in picked):
        raise UserError(f"{where}: layers_to_transform={str(layers)[:40]} is not a layer index or a list of them")
    return {n: m for n, m in targets.items() if (k := _LAYER_INDEX.search(n)) and int(k.group(1)) in picked}


def cached_hub_config(hub_id: str) -> Path | None:
    """The `config.json` of the hub model `hub_id` in the local Hugging Face cache (no download,
    no network), or None where it was never downloaded: what the adapter's shapes are checked
    against when its base is named by a hub id."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(hub_id, "config.json")
    except ValueError:  # not a repository id huggingface_hub takes
        return None
    return Path(found) if isinstance(found, str) else None


def check_starting_weights(shapes: dict, cfg: dict, model, path: Path) -> None:
    """The tensors `shapes` of a starting adapter's weights file `path` (its config `cfg`, checked
    against `lora.*`) as training takes them over onto `model`, the base on the meta device: each of
    the shape `r` and its layer give, and both A and B of every layer `target_modules` names (PEFT
    leaves a missing one at its fresh init -- a zero B -- without a word)."""
    where = f"{path.parent}/adapter_config.json"
    r = check_lora_config(cfg, where)
    _check_lora_weights(shapes, _targets(cfg, model, where), r, not cfg.get("rank_pattern"), path, complete=True)


_LORA_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_(A|B|embedding_A|embedding_B)(?:\.weight)?")


def _check_lora_weights(
    shapes: dict, targets: dict, r: int, uniform: bool, path: Path, *, complete: bool = False
) -> None:
    """Each LoRA tensor of `shapes` belongs to a layer of `targets` and has the shape `r` (every
    tensor's, when `uniform`) and that layer give; with `complete`, every targeted layer has both."""
    found: set[tuple[str, bool]] = set()
    for key, shape in shapes.items():
        m = _LORA_KEY.fullmatch(key)
        if m is None:
            continue
        name, part = m.group(1), m.group(2)
        module = targets.get(name)
        dims = _dims(module) if module is not None else None
        if dims is None:
            raise UserError(f"{path}: tensor {key[:120]!r} belongs to no layer that target_modules names")
        a_kind = part in ("A", "embedding_A")  # A: rank x in; B: out x rank
        rank = (shape[0] if a_kind else shape[1]) if len(shape) == 2 else -1
        want = (rank, dims[0]) if a_kind else (dims[1], rank)
        if len(shape) != 2 or rank < 1 or (uniform and rank != r) or shape != want:
            raise UserError(
                f"{path}: tensor {key[:120]!r} has shape {list(shape)}, not what r={r} and the base's layer "
                f"({dims[0]} -> {dims[1]}) give"
            )
        found.add((name, a_kind))
    if not found:
        raise UserError(f"{path}: holds no LoRA weights")
    if complete:
        _check_complete(found, targets, path)


def _check_complete(found: set[tuple[str, bool]], targets: dict, path: Path) -> None:
    """Both LoRA tensors (A, B) of every layer of `targets` LoRA can adapt are among `found`."""
    for name in (n for n, m in targets.items() if _dims(m) is not None):
        for a_kind, part in ((True, "A"), (False, "B")):
            if (name, a_kind) not in found:
                raise UserError(f"{path}: holds no LoRA {part} of layer {name[:120]!r}, which target_modules names")


def check_model_dir(model_dir: Path, *, weights: bool = True):
    """The meta-device model of a model directory (a base, a merged export), its config and (with
    `weights`) its safetensors files' shapes checked against each other."""
    where = str(model_dir / "config.json")
    cfg = read_json_config(model_dir / "config.json")
    model = meta_model(cfg, where)
    if not weights:
        return model
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors weights")
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for f in files:
        for key, shape in safetensors_shapes(f).items():
            if key in want and want[key] != shape:
                raise UserError(
                    f"{f}: tensor {key[:120]!r} has shape {list(shape)}, config.json gives {list(want[key])}"
                )
            if key not in want:
                raise UserError(f"{f}: tensor {key[:120]!r} is not a weight of the model config.json describes")
    return model
