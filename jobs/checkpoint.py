"""Checkpoints: LoRA weights, optimizer, GradScaler, step, data position, RNG of every rank.

Layout (this module owns every file name): ``<output_dir>/checkpoints/step-00000010/`` holding
``adapter.safetensors``, ``optimizer.pt``, ``scaler.pt``, ``state.json``, ``rng-rank{r}.pt`` and
one ``manifest-rank{r}.json`` per rank listing the size and SHA-256 of that rank's files.
`rank_files` assembles what a rank writes, `restore` loads it back.

A checkpoint counts only when every rank's manifest is present and every file matches it,
so a copy cut off at any point (by a crash, or by a Ray upload that died) is never loaded;
the previous complete one is used instead. Without Ray the directory is also written under a
temporary name and renamed, so the final name only ever appears complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import torch

from .spec import JobSpec, SpecError

STEP_PREFIX = "step-"
# The files of one checkpoint. Rank 0 writes the shared ones; every rank writes its RNG state.
ADAPTER_FILE = "adapter.safetensors"   # the trainable (LoRA) parameters, by name
OPTIMIZER_FILE = "optimizer.pt"
SCALER_FILE = "scaler.pt"              # fp16 only
STATE_FILE = "state.json"              # step (= the next global batch), counters, world size, resume key


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def manifest_file(rank: int) -> str:
    return f"manifest-rank{rank}.json"
# Spec fields that must not change between a checkpoint and the run that resumes from it:
# they change the model, the adapter's shape, or which samples form optimizer step k.
RESUME_KEYS = ("model.name", "model.gguf_file", "lora.r", "lora.alpha", "lora.target_modules",
               "batch.global_batch_size", "run.seed", "data.path", "data.max_seq_len", "optim.name")


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rank_files(directory: Path, rank: int, files: dict[str, object]) -> None:
    """Write this rank's files, then its manifest (last: the manifest vouches for the rest)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, obj in files.items():
        path = directory / name
        if name.endswith(".safetensors"):
            save_file({k: v.detach().cpu().contiguous() for k, v in obj.items()}, str(path))
        elif name.endswith(".json"):
            path.write_text(json.dumps(obj, indent=1, sort_keys=True))
        else:
            torch.save(obj, path)
        manifest[name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    tmp = directory / f".{manifest_file(rank)}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    with open(tmp) as f:
        os.fsync(f.fileno())
    tmp.rename(directory / manifest_file(rank))


def is_complete(directory: Path) -> bool:
    try:
        state = json.loads((directory / STATE_FILE).read_text())
        world = int(state["world_size"])
        for r in range(world):
            manifest = json.loads((directory / manifest_file(r)).read_text())
            for name, meta in manifest.items():
                p = directory / name
                if p.stat().st_size != meta["bytes"] or _sha256(p) != meta["sha256"]:
                    return False
        return True
    except (OSError, ValueError, KeyError):
        return False


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)), key=lambda p: p.name)


def newest_complete(root: Path) -> Optional[Path]:
    """The newest checkpoint that verifies; incomplete ones are skipped (never deleted here)."""
    for p in reversed(list_checkpoints(root)):
        if is_complete(p):
            return p
    return None


def publish(tmp: Path, root: Path, step: int, keep: int) -> Path:
    """Rename the finished temp dir to its final name, then prune to the newest `keep`."""
    final = root / step_dir_name(step)
    if final.exists():  # a previous attempt at this step (e.g. before a crash): replace it
        shutil.rmtree(final)
    tmp.rename(final)
    prune(root, keep)
    return final


def prune(root: Path, keep: int) -> None:
    complete = [p for p in list_checkpoints(root) if is_complete(p)]
    for p in complete[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def load_state(directory: Path) -> dict:
    return json.loads((directory / STATE_FILE).read_text())


def load_adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / ADAPTER_FILE))


def rank_files(rank: int, state: dict, model=None, optimizer=None, scaler=None) -> dict[str, object]:
    """What rank `rank` writes into a checkpoint: its RNG state; rank 0 (the caller passes the
    model, optimizer and scaler there only) also the adapter, optimizer, scaler and `state`."""
    files: dict[str, object] = {rng_file(rank): rng_state()}
    if model is not None:
        files[ADAPTER_FILE] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        files[OPTIMIZER_FILE] = optimizer.state_dict()
        files[STATE_FILE] = state
        if scaler is not None and scaler.is_enabled():
            files[SCALER_FILE] = scaler.state_dict()
    return files


def restore(directory: Path, spec: JobSpec, rank: int, world_size: int, model, optimizer, scaler) -> dict:
    """Load a complete checkpoint into the model's trainable parameters, the optimizer, the scaler
    and (same world size only: the RNG streams are per rank) this rank's RNG. Returns its state.
    Refuses, with a SpecError, a checkpoint whose spec differs in what resuming depends on."""
    state = load_state(directory)
    check_resumable(state["resume_key"], spec, str(directory))
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in load_adapter(directory).items():
            named[name].copy_(tensor)
    optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=False))
    if scaler.is_enabled() and (directory / SCALER_FILE).exists():
        scaler.load_state_dict(torch.load(directory / SCALER_FILE, weights_only=False))
    if state["world_size"] == world_size and (directory / rng_file(rank)).exists():
        set_rng_state(torch.load(directory / rng_file(rank), weights_only=False))
    return state


def resume_key(spec: JobSpec) -> dict:
    d = spec.to_dict()
    out = {}
    for key in RESUME_KEYS:
        node = d
        for part in key.split("."):
            node = node[part]
        out[key] = node
    return out


def check_resumable(saved: dict, spec: JobSpec, where: str) -> None:
    now = resume_key(spec)
    diffs = [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k]]
    if diffs:
        raise SpecError(
            f"{where}: cannot resume, the spec changed in a way that breaks resuming ({'; '.join(diffs)}); "
            "use --fresh to start over"
        )
