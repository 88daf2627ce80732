"""The working dir `rayft submit` uploads: where the project is, what Ray will package from it
(`plan_upload`, honouring `.gitignore` and the excludes) and whether Ray will accept it
(`check_upload`: Ray's gRPC message limit), checked before anything is submitted."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from jobs.errors import UserError

# Never uploaded (besides what .gitignore / .rayignore exclude): the venv, outputs, VCS data,
# caches and rayft's own state (the queue database).
DEFAULT_EXCLUDES = [".git", ".venv", "outputs", ".rayft", "__pycache__", "*.egg-info", ".pytest_cache"]


# ---- the working dir -------------------------------------------------------------------------


@dataclass
class UploadPlan:
    """What Ray will package from the working dir: file count and bytes (files are stored
    uncompressed, so the bytes are the package size), against Ray's limit."""

    root: Path
    files: int
    size_bytes: int
    limit_bytes: int
    excludes: list[str]


# Ray's limit on one runtime_env package, the gRPC message size its GCS accepts: 512 MiB unless the
# cluster sets RAY_max_grpc_message_size (tests/integration/test_submit.py holds it to Ray's own constant).
RAY_GRPC_MAX_MESSAGE_BYTES = 512 * 2**20


def ray_upload_limit() -> int:
    """Ray's limit on one runtime_env package (bytes)."""
    return int(os.environ.get("RAY_max_grpc_message_size", RAY_GRPC_MAX_MESSAGE_BYTES))


def _ignore_spec(lines: Iterable[str]):
    """gitignore-style patterns (a `pathspec.PathSpec`) as Ray reads its `excludes`, `.gitignore`
    and `.rayignore`: each line stripped of surrounding blanks; blank lines and comments match
    nothing, and so does a line git cannot read as a pattern (one ending in a lone backslash)."""
    import pathspec

    factory = pathspec.util.lookup_pattern("gitignore")
    patterns = []
    for line in lines:
        try:
            patterns.append(factory(line.strip()))
        except ValueError:
            continue
    return pathspec.PathSpec(patterns)


def _ignore_files(directory: Path, include_gitignore: bool) -> list:
    """(directory, its patterns) of the directory's own `.gitignore` and `.rayignore`."""
    out = []
    for name in ((".gitignore",) if include_gitignore else ()) + (".rayignore",):
        f = directory / name
        if f.is_file():
            out.append((directory, _ignore_spec(f.read_text().splitlines())))
    return out


def plan_upload(root: Path, excludes: list[str], limit_bytes: int | None = None) -> UploadPlan:
    """Walk `root` the way Ray packages a working_dir and add up what it would upload.

    Ray's documented rules (runtime_env `working_dir` / `excludes`): `excludes` are gitignore-style
    patterns relative to the working dir; every directory's `.gitignore` (unless
    RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1) and `.rayignore` apply below it, relative to it; files are
    zipped without compression (so their sizes add up to the package size) and symlinks are
    followed -- which is why one that points outside the project is refused here. The patterns are
    matched by `pathspec` as git matches them; the copy of pathspec Ray bundles (0.8) departs from
    git only for `**/` and `**/**`, which it takes to match nothing.
    """
    root = root.resolve()
    limit = ray_upload_limit() if limit_bytes is None else limit_bytes
    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    top = _ignore_spec(excludes)
    total, count = 0, 0

    def excluded(p: Path, matchers: list) -> bool:
        if top.match_file(str(p.relative_to(root))):
            return True
        for base, spec in matchers:
            if p != base and spec.match_file(str(p.relative_to(base))):
                return True
        return False

    def walk(d: Path, matchers: list) -> None:
        nonlocal total, count
        matchers = matchers + _ignore_files(d, include_gitignore)
        for p in sorted(d.iterdir()):
            if excluded(p, matchers):
                continue
            if p.is_symlink():
                target = p.resolve()
                if target != root and root not in target.parents:
                    raise UserError(
                        f"working dir {root}: {p.relative_to(root)} is a symlink to {target}, outside "
                        "the project; Ray would upload what it points to (exclude it in .rayignore)"
                    )
            if p.is_dir():
                walk(p, matchers)
            elif p.is_file():
                total += p.stat().st_size
                count += 1
                if total > limit:
                    break

    walk(root, [])
    return UploadPlan(root, count, total, limit, list(excludes))


def check_upload(plan: UploadPlan) -> None:
    if plan.size_bytes > plan.limit_bytes:
        raise UserError(
            f"working dir {plan.root}: would upload more than {plan.size_bytes / 2**20:.1f} MiB, over Ray's "
            f"limit of {plan.limit_bytes / 2**20:.1f} MiB for a runtime_env package; exclude large files "
            "in .gitignore or .rayignore (data and models belong on shared storage)"
        )


def find_project(working_dir: str | None) -> Path:
    """The project directory to upload: it must hold `jobs/finetune.py` (the entrypoint)."""
    wd = Path(working_dir or ".").resolve()
    if not wd.is_dir():
        raise UserError(f"--working-dir {wd}: not a directory")
    if not (wd / "jobs" / "finetune.py").is_file():
        raise UserError(
            f"working dir {wd} is not the rayft project (no jobs/finetune.py there): run from the "
            "project root or pass --working-dir"
        )
    return wd


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)
