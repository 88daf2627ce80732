"""Checkpoints: LoRA weights, optimizer, GradScaler, step, data position, RNG of every rank.

Layout (this module owns every file name): ``<output_dir>/checkpoints/step-00000010/`` holding
``adapter.safetensors``, ``optimizer.pt``, ``scaler.pt``, ``state.json``, ``rng-rank{r}.pt`` and
one ``manifest-rank{r}.json`` per rank listing the size and SHA-256 of that rank's files.
`rank_files` assembles what a rank writes, `restore` loads it back.

The adapter and optimizer state are the *full* ones, keyed by parameter name, whatever the
strategy: under FSDP they are gathered from the shards to rank 0 and scattered back on resume
through `torch.distributed.checkpoint.state_dict` (`jobs.train.fsdp`). So a checkpoint of a DDP run
resumes under FSDP and back, with any worker count. (DCP's own file format is not used: its
`.metadata` is a pickle, which the rule below forbids; LoRA state is small enough to gather.)

A checkpoint counts only when every rank's manifest is present and every file matches it,
so a copy cut off at any point (by a crash, or by a Ray upload that died) is never loaded;
the previous complete one is used instead, with a warning naming the one skipped. Without Ray
the directory is also written under a temporary name and renamed, so the final name only ever
appears complete.

The manifests prove integrity, not origin: anyone who can write the directory can write a
matching manifest. So nothing here unpickles Python objects: every `.pt` file is read with
`torch.load(weights_only=True)` (tensors and plain containers only), and a file that holds
anything else is refused with one line naming it, never executed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from jobs.run import save_check
from jobs.spec import JobSpec, SpecError, one_line, path_problem

log = logging.getLogger("rayft")

STEP_PREFIX = "step-"
# The files of one checkpoint. Rank 0 writes the shared ones; every rank writes its RNG state.
ADAPTER_FILE = "adapter.safetensors"  # the trainable (LoRA) parameters, by name
OPTIMIZER_FILE = "optimizer.pt"
SCALER_FILE = "scaler.pt"  # fp16 only
STATE_FILE = "state.json"  # step (= the next global batch), counters, world size, resume key


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def manifest_file(rank: int) -> str:
    return f"manifest-rank{rank}.json"


# Spec fields that must not change between a checkpoint and the run that resumes from it:
# they change the model, the adapter's shape, or which samples form optimizer step k.
RESUME_KEYS = (
    "model.name",
    "model.gguf_file",
    "model.quantization",
    "lora.r",
    "lora.alpha",
    "lora.target_modules",
    "lora.use_dora",
    "lora.use_rslora",
    "lora.init",
    "batch.global_batch_size",
    "run.seed",
    "data.path",
    "data.max_seq_len",
    "optim.name",
    "data.fields",
    "data.train_on",
    "model.adapter",
    "objective.*",  # the objective's settings (`objective_keys`)
    "data.mix",
    "data.eval_path",
    "data.eval_fraction",
)
# Of a mixture (`data.mix`), what decides the samples of step k: each source's path, weight, fields
# and train_on, in order (its name and held-out set do not).
MIX_RESUME_KEYS = ("path", "weight", "fields", "train_on")
# Keys whose spec field is older than the key: a checkpoint written before the key existed
# trained with a value it did not record (not necessarily the default), so that checkpoint is not
# compared on it; every checkpoint written since records it. (`data.eval_fraction` decides which
# records are held out, so which samples form step k: it is recorded as None where
# `data.eval_path` is set, since it decides nothing there.)
LATE_KEYS = ("data.eval_path", "data.eval_fraction")
# Not a spec field: the sha256 of what the data sources hold (`jobs.data.content_hash`), so data
# that changed under the same path refuses a resume (the batches of step k would differ).
DATA_HASH_KEY = "data.content_sha256"
# Not a spec field either: the starting adapter's bytes (`model.adapter`: the files PEFT reads), so
# an adapter replaced under the same path refuses a resume (the reference and the start differ).
# A checkpoint written before this key is not compared on it.
ADAPTER_HASH_KEY = "model.adapter_sha256"
REWARD_HASH_KEY = "reward.files_sha256"  # online RL: the user reward files' bytes (`reward_digest`)
HASH_KEYS = (DATA_HASH_KEY, ADAPTER_HASH_KEY, REWARD_HASH_KEY)
# `rollout.*` settings that change how completions are computed, not which (the generation batch),
# or say where the engine is and how long to wait for it, not what it samples: a resume may change
# them (a larger batch, a server rayft starts anew, a user's moved one).
ROLLOUT_RESUME_FREE = (
    "generation_batch_size",
    "vllm_url",
    "vllm_timeout_s",
    "vllm_start_timeout_s",
    "vllm_kv_cache_gib",
)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict:
    """This process's RNG states, in types `torch.load(weights_only=True)` reads back: Python's
    `random.getstate()` is a tuple of ints (and None), the torch states are byte tensors."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, where: str = "rng state") -> None:
    try:
        random.setstate(tuple(state["python"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise SpecError(
            f"checkpoint file {where}: not an RNG state ({one_line(str(e))[:120]}); use --fresh to start over"
        ) from None


def is_manifest(name: str) -> bool:
    """Whether file `name` of a checkpoint is a rank's manifest (what vouches for the others)."""
    return re.fullmatch(r"manifest-rank\d+\.json", name) is not None


def publication_order(names: list[str]) -> list[str]:
    """The order any copy of a checkpoint is written in: every other file before the manifests,
    which vouch for them (`write_rank_files` writes one rank's that way). A copy cut off at any
    point then lacks a manifest or a file one names: `why_incomplete` never passes it. Removing a
    copy goes in the reverse order, manifests first."""
    return sorted(names, key=lambda n: (is_manifest(n), n))


def write_rank_files(directory: Path, rank: int, files: dict[str, Any]) -> None:
    """Write this rank's files, then its manifest (last: the manifest vouches for the rest)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, obj in files.items():
        path = directory / name
        if name.endswith(".safetensors"):
            tensors = {k: v.detach().cpu().contiguous() for k, v in obj.items()}
            save_file(tensors, str(path))
            save_check.check_file(path, tensors)  # read back before the manifest vouches for it
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


def why_incomplete(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint (a missing state or manifest, a file that
    does not match its manifest), or None when it is one. Every file is stat-ed before it is
    opened (`path_problem`): a FIFO, a device or a link to one is a reason, never opened."""
    try:
        state = json.loads(_regular_text(directory / STATE_FILE))
        world = int(state["world_size"])
        if not 0 < world <= 100_000:
            return f"{STATE_FILE} gives world_size={world}"
        for r in range(world):
            manifest = json.loads(_regular_text(directory / manifest_file(r)))
            for name, meta in manifest.items():
                p = directory / name
                if Path(name).name != name:
                    return f"{manifest_file(r)} names a file outside the checkpoint"
                problem = path_problem(p)
                if problem:
                    return f"{manifest_file(r)} names {problem}"
                if p.stat().st_size != meta["bytes"] or _sha256(p) != meta["sha256"]:
                    return f"{name} does not match {manifest_file(r)}"
        return None
    except _NotRegular as e:
        return str(e.args[0])
    except FileNotFoundError as e:
        return f"{Path(e.filename).name if e.filename else 'a file'} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable ({type(e).__name__})"


class _NotRegular(OSError):
    """A checkpoint file that is not a regular file (`path_problem`'s words in `args[0]`)."""


def _regular_text(path: Path) -> str:
    """The text of `path`, a regular file (stat-ed first: a FIFO would block the read forever)."""
    problem = path_problem(path)
    if problem:
        raise _NotRegular(problem)
    return path.read_text()


def is_complete(directory: Path) -> bool:
    return why_incomplete(directory) is None


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)), key=lambda p: p.name)


def newest_complete(root: Path, *, warn: bool = True) -> Path | None:
    """The newest checkpoint that verifies; incomplete ones are skipped (never deleted here),
    each with a warning that names it and says why."""
    for p in reversed(list_checkpoints(root)):
        why = why_incomplete(p)
        if why is None:
            return p
        if warn:
            log.warning("skipping checkpoint %s: %s", p, why)
    return None


def resumable(root: Path) -> Path | None:
    """The checkpoint a rerun resumes from, checked before anything starts: the newest complete
    one, its state readable and its `.pt` files plain data (`check_loadable`); None when there
    is no checkpoint at all. When there are checkpoints but none is complete, a silent fresh
    start would throw the run away: refused, pointing at --fresh."""
    found = list_checkpoints(root)
    newest = newest_complete(root)
    if newest is None and found:
        raise SpecError(
            f"{one_line(str(root))}: all {len(found)} checkpoints are incomplete or corrupt "
            "(see the warnings above); use --fresh to start over (they are set aside, not deleted)"
        )
    if newest is not None:
        load_state(newest)
        check_loadable(newest)
    return newest


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
    """`state.json` of a complete checkpoint; one that lacks what resuming reads is refused."""
    path = directory / STATE_FILE
    try:
        state = json.loads(_regular_text(path))
    except _NotRegular as e:
        raise SpecError(f"checkpoint file {one_line(str(e.args[0]))}; use --fresh to start over") from None
    except (OSError, ValueError) as e:
        raise SpecError(
            f"checkpoint file {one_line(str(path))}: unreadable ({type(e).__name__}); use --fresh to start over"
        ) from None
    ok = (
        isinstance(state, dict)
        and isinstance(state.get("resume_key"), dict)
        and all(
            isinstance(state.get(k), int) and not isinstance(state.get(k), bool) and state[k] >= 0
            for k in ("step", "tokens_seen", "skipped_steps", "world_size")
        )
    )
    if not ok:
        raise SpecError(
            f"checkpoint file {one_line(str(path))}: not a rayft checkpoint state (needs step, "
            "tokens_seen, skipped_steps, world_size and resume_key); use --fresh to start over"
        )
    return state


def load_plain(path: Path) -> Any:
    """A `.pt` file's content, read as tensors and plain containers only
    (`torch.load(weights_only=True)`: no pickled class or function is ever resolved or called).
    Anything else, and a file that is not a regular one (a FIFO, a device: never opened), is
    refused as a SpecError naming the file."""
    problem = path_problem(path)
    if problem:
        raise SpecError(f"checkpoint file {one_line(problem)}; move that checkpoint away, or use --fresh to start over")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for foreign objects; others for damaged files
        found = re.search(r"GLOBAL (\S+)", str(e))
        detail = f"it refers to {found.group(1)}" if found else one_line(str(e).strip().splitlines()[0])[:120]
        raise SpecError(
            f"checkpoint file {one_line(str(path))}: refused to load: not plain tensor data "
            f"({detail}); move that checkpoint away, or use --fresh to start over"
        ) from None


def check_loadable(directory: Path) -> None:
    """Every `.pt` file of `directory` reads as plain data (see `load_plain`)."""
    for p in sorted(directory.glob("*.pt")):
        load_plain(p)


def load_adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = directory / ADAPTER_FILE
    problem = path_problem(path)
    if problem:
        raise SpecError(f"checkpoint file {one_line(problem)}; move that checkpoint away, or use --fresh to start over")
    return load_file(str(path))


def rank_files(
    rank: int, state: dict, adapter: dict | None = None, optim_state: dict | None = None, scaler=None
) -> dict[str, Any]:
    """What rank `rank` writes into a checkpoint: its RNG state; rank 0 (the caller passes them
    there only) also the adapter and optimizer state (full, by parameter name: `jobs.train.fsdp.adapter_state`),
    the scaler and `state`."""
    files: dict[str, Any] = {rng_file(rank): rng_state()}
    if adapter is not None:
        files[ADAPTER_FILE] = adapter
        files[OPTIMIZER_FILE] = optim_state
        files[STATE_FILE] = state
        if scaler is not None and scaler.is_enabled():
            files[SCALER_FILE] = scaler.state_dict()
    return files


def restore(directory: Path, spec: JobSpec, rank: int, world_size: int, model, optimizer, scaler) -> dict:
    """Load a complete checkpoint into the model's trainable parameters, the optimizer, the scaler
    and (same world size only: the RNG streams are per rank) this rank's RNG. Returns its state.
    Every rank calls it (under FSDP each takes its shards of the full state).
    Refuses, with a SpecError, a checkpoint whose spec differs in what resuming depends on."""
    from jobs.train.fsdp import load_adapter_state

    state = load_state(directory)
    check_resumable(state["resume_key"], spec, str(directory))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    adapter = load_adapter(directory)
    if set(adapter) != set(trainable):
        raise SpecError(
            f"checkpoint {one_line(str(directory))}: its adapter's parameters are not this model's "
            "LoRA parameters; use --fresh to start over"
        )
    path = directory / OPTIMIZER_FILE
    optim_state = by_name(load_plain(path), trainable)
    try:
        load_adapter_state(model, optimizer, adapter, optim_state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise SpecError(
            f"checkpoint file {one_line(str(path))}: does not fit this run "
            f"({one_line(str(e))[:120]}); use --fresh to start over"
        ) from None
    if scaler.is_enabled() and (directory / SCALER_FILE).exists():
        _load_into(scaler, directory / SCALER_FILE)
    if state["world_size"] == world_size and (directory / rng_file(rank)).exists():
        set_rng_state(load_plain(directory / rng_file(rank)), str(directory / rng_file(rank)))
    return state


def by_name(optim_state, names: list[str]):
    """An optimizer state keyed by parameter name. Checkpoints written before states were taken
    by name hold `optimizer.state_dict()`, keyed by position in the optimizer, whose parameters
    are the trainable ones in `named_parameters` order (`names`): renamed, they resume too."""
    if not isinstance(optim_state, dict) or not isinstance(optim_state.get("param_groups"), list):
        return optim_state  # refused by the loader, with the file named
    groups = optim_state["param_groups"]
    if not all(isinstance(i, int) for g in groups for i in g.get("params", [])):
        return optim_state
    try:
        return {
            "state": {names[i]: s for i, s in optim_state.get("state", {}).items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in groups],
        }
    except (IndexError, TypeError, AttributeError):
        return optim_state


def _load_into(target, path: Path) -> None:
    """`target.load_state_dict` from a plain-data file; a state that does not fit is one line."""
    state = load_plain(path)
    try:
        target.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise SpecError(
            f"checkpoint file {one_line(str(path))}: does not fit this run "
            f"({one_line(str(e))[:120]}); use --fresh to start over"
        ) from None


def objective_keys(spec: JobSpec) -> list[str]:
    """`objective.<setting>` for every setting of the spec's objective class (a new setting is in
    the key without being listed here), but those that change how a step is computed, not what
    (`resume_free`: `objective.reference`)."""
    section = type(spec.objective)
    return [f"objective.{k}" for k in section.model_fields if k not in section.resume_free]


def resume_key(spec: JobSpec) -> dict:
    d = spec.to_dict()
    out: dict[str, Any] = {}
    for key in (k for listed in RESUME_KEYS for k in (objective_keys(spec) if listed == "objective.*" else [listed])):
        node: Any = d
        for part in key.split("."):
            node = node[part]
        out[key] = node
    out.update(_resolved_objective(spec.objective))
    if out["data.mix"] is not None:
        out["data.mix"] = [{k: src[k] for k in MIX_RESUME_KEYS} for src in out["data.mix"]]
    if spec.data.eval_path:
        out["data.eval_fraction"] = None  # the held-out set is the file; no fraction of data.path is held out
    from jobs.data import content_hash
    from jobs.model.adapter_check import adapter_digest

    out[DATA_HASH_KEY] = content_hash(spec)
    out[ADAPTER_HASH_KEY] = adapter_digest(spec.model.adapter)
    if spec.reward is not None:  # online RL: how completions are drawn and scored is what is trained on
        out["rollout"], out["reward"] = _rollout_key(d["rollout"]), d["reward"]
        out[REWARD_HASH_KEY] = reward_digest(spec)
    return out


def _resolved_objective(objective) -> dict[str, Any]:
    """`objective.<setting>` -> the value the run trains with (`resolves`: `epsilon_high` unset is
    `epsilon`), as JSON, for each setting whose stored form is not already that value."""
    return {
        f"objective.{k}": json.loads(json.dumps(objective.resolved(k)))
        for k in objective.resolves
        if k not in objective.resume_free
    }


def _with_rollout_defaults(saved: dict) -> dict:
    """A checkpoint's `rollout` section with the settings it predates (`rollout.importance_correction`)
    at their defaults: what the run that wrote it sampled and trained with."""
    if not isinstance(saved.get("rollout"), dict):
        return saved
    from jobs.spec.online import RolloutSpec

    defaults = {k: f.default for k, f in RolloutSpec.model_fields.items()}
    return {**saved, "rollout": _rollout_key({**defaults, **saved["rollout"]})}


def _rollout_key(rollout: dict) -> dict:
    """The `rollout` section as the resume key holds it: what is sampled (`ROLLOUT_RESUME_FREE` out)."""
    return {k: v for k, v in rollout.items() if k not in ROLLOUT_RESUME_FREE}


def _resolved_saved_objective(saved: dict, spec: JobSpec) -> dict[str, Any]:
    """A checkpoint's objective settings with its Nones resolved as the run that wrote them
    resolved them: its own values through `spec`'s objective class (None -> the class default,
    then `resolves`). Values that class refuses are left to be reported as differences."""
    section = type(spec.objective)
    given = {k: v for k in section.model_fields if (v := saved.get(f"objective.{k}")) is not None}
    filled = {f"objective.{k}": _field_default(f"objective.{k}", spec) for k in section.model_fields}
    try:
        objective = section.model_validate({**given, "name": spec.objective.name})
    except ValueError:
        return {k: v for k, v in filled.items() if saved.get(k) is None}
    resolved = {**filled, **{f"objective.{k}": v for k, v in given.items()}, **_resolved_objective(objective)}
    return {k: v for k, v in resolved.items() if saved.get(k) is None}


def reward_digest(spec: JobSpec) -> str:
    """sha256 over the bytes of every user reward file (`FILE.py:NAME`), in order: a function
    edited under the same path changes what a resumed run would be rewarded for."""
    from jobs.spec.loading import reward_files

    h = hashlib.sha256()
    for _, file in reward_files(spec):
        h.update(Path(file).read_bytes() + b"\0")
    return h.hexdigest()


def _field_default(key: str, spec: JobSpec):
    """The default of the spec field `section.field`, as `resume_key` stores values (JSON); of
    `objective.*`, the default in `spec`'s objective class."""
    section, name = key.split(".")
    section_model = type(spec.objective) if section == "objective" else JobSpec.model_fields[section].annotation
    assert isinstance(section_model, type)  # every other section is one model class
    field = section_model.model_fields[name]
    if field.is_required():
        return None
    value = field.get_default(call_default_factory=True)
    return json.loads(json.dumps(value.model_dump(mode="json") if hasattr(value, "model_dump") else value))


def check_resumable(saved: dict, spec: JobSpec, where: str) -> None:
    if not isinstance(saved, dict):
        raise SpecError(f"{one_line(where)}: not a rayft checkpoint (no resume key); use --fresh to start over")
    now = resume_key(spec)
    # A key newer than the checkpoint is read as the field's default: that is what the run that
    # wrote it trained with (e.g. `model.quantization` "none" before quantization existed), except
    # for a field older than its key (`LATE_KEYS`), which such a checkpoint is not compared on.
    unrecorded = {k for k in (*LATE_KEYS, ADAPTER_HASH_KEY) if k not in saved}
    now = {k: v for k, v in now.items() if k not in unrecorded}
    saved = {
        **{k: _field_default(k, spec) for k in now if k not in saved and k not in HASH_KEYS and "." in k},
        **saved,
    }
    # Checkpoints written before the objective's settings had real defaults, or before they were
    # stored resolved, hold None for "the default": resolved here by the same class.
    saved.update(_resolved_saved_objective(saved, spec))
    saved = _with_rollout_defaults(saved)
    diffs = [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k] and k not in HASH_KEYS]
    if ADAPTER_HASH_KEY in now and saved.get(ADAPTER_HASH_KEY) != now[ADAPTER_HASH_KEY]:
        diffs.append("model.adapter: its files changed since the checkpoint (another starting adapter)")
    if REWARD_HASH_KEY in now and saved.get(REWARD_HASH_KEY) != now[REWARD_HASH_KEY]:
        diffs.append("reward.functions: a reward file changed since the checkpoint")
    if saved.get(DATA_HASH_KEY) != now[DATA_HASH_KEY]:
        diffs.append(
            "the data changed: its content no longer matches the checkpoint's (sha256 "
            f"{str(saved.get(DATA_HASH_KEY))[:12]} -> {now[DATA_HASH_KEY][:12]})"
        )
    if diffs:
        raise SpecError(
            f"{where}: cannot resume, the spec changed in a way that breaks resuming ({'; '.join(diffs)}); "
            "use --fresh to start over"
        )
