"""Reading user input safely: a spec file's YAML, YAML override values, and the paths it names.

User YAML is read through `load_yaml_text` only: plain data (PyYAML's safe loader without implicit
timestamps), bounded in size (`MAX_SPEC_BYTES`), in what aliases expand to (`MAX_YAML_NODES`: no
"billion laughs") and in depth (`MAX_YAML_DEPTH`), with no alias cycles and no duplicate keys.
Every refusal is one SpecError line naming the file or override and the line. What the data
*means* is the typed schema's business (`jobs.spec`); this module only makes it safe to build.

`one_line` and `path_problem` live here because reading needs them first; the schema, the data
sources and every message about user input use the same two.
"""

from __future__ import annotations

import copy
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from jobs import secrets
from jobs.errors import SpecError

# Bounds on reading a spec: a real one is a few KB and a few hundred YAML nodes. Aliases may
# repeat a piece of it, never blow it up (a "billion laughs" document expands exponentially).
MAX_SPEC_BYTES = 1 << 20
MAX_YAML_NODES = 10_000
MAX_YAML_DEPTH = 64
# Characters that end a line for str.splitlines(): escaped wherever user text enters a message,
# so an error stays one line whatever a key, value or path holds.
_LINE_BREAKS = {c: repr(chr(c))[1:-1] for c in (0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x85, 0x2028, 0x2029)}


def one_line(text: str) -> str:
    """`text` with every character that would end a line escaped (`\n` -> `\\n`)."""
    return text.translate(_LINE_BREAKS)


def path_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a regular file ("file not found", "is a directory", "is a
    FIFO (named pipe)", ...), or None when it can. Only stats: a FIFO is never opened (that
    would block until someone writes to it)."""
    shown = one_line(str(path))
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return f"file not found: {shown}"
    except PermissionError:
        return f"{shown}: permission denied"
    except (OSError, ValueError) as e:
        return f"{shown}: cannot be read ({getattr(e, 'strerror', None) or e})"
    if stat.S_ISREG(mode):
        return None if os.access(path, os.R_OK) else f"{shown}: permission denied"
    kind = (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    return f"{shown} is {kind}, not a regular file"


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader without implicit timestamps: `name: 2024-01-01` is a string, as every
    field of a spec that could hold it is (a date object is not plain data)."""


_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _yaml_children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_yaml_graph(root: yaml.Node, where: str) -> None:
    """Refuse, before anything is built from it, a YAML node graph that aliases expand past
    `MAX_YAML_NODES`, that nests deeper than `MAX_YAML_DEPTH`, whose aliases form a cycle, or
    with a mapping that repeats a key. Linear in the document: expanded sizes are summed once
    per node (memoized), never by expanding."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, finished = stack.pop()
        nid, line = id(node), node.start_mark.line + 1
        if finished:
            on_path.discard(nid)
            size[nid] = 1 + sum(size[id(c)] for c in _yaml_children(node))
            if size[nid] > MAX_YAML_NODES:
                raise SpecError(
                    f"{where}: line {line}: aliases expand this value to more than {MAX_YAML_NODES} "
                    "YAML nodes; a spec is far smaller: write it out without the aliases"
                )
            continue
        if nid in size:
            continue
        if nid in on_path:
            raise SpecError(f"{where}: line {line}: this value contains an alias to itself (a cycle)")
        if depth > MAX_YAML_DEPTH:
            raise SpecError(f"{where}: line {line}: nested deeper than {MAX_YAML_DEPTH} levels")
        if isinstance(node, yaml.MappingNode):
            _check_unique_keys(node, where)
        on_path.add(nid)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in _yaml_children(node))


def _check_unique_keys(node: yaml.MappingNode, where: str) -> None:
    first_line: dict[tuple, int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *base` merges; an explicit key after it overrides, as YAML intends
        ident = (key.tag, key.value)
        if ident in first_line:
            raise SpecError(
                f"{where}: line {key.start_mark.line + 1}: duplicate key {one_line(repr(key.value))} "
                f"(first at line {first_line[ident]})"
            )
        first_line[ident] = key.start_mark.line + 1


def load_yaml_text(text: str, where: str) -> Any:
    """Parse user YAML safely: no Python objects, no dates, no alias bombs, cycles, duplicate
    keys or runaway nesting (each refused with one line naming `where` and the line).
    YAML syntax errors are raised as `yaml.YAMLError` for the caller to word."""
    loader = _SpecLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise SpecError(f"{where}: nested too deeply to be a spec") from None
        if node is None:
            return None
        _check_yaml_graph(node, where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.field=value`` -> (["section", "field"], value coerced by YAML rules)."""
    shown = one_line(secrets.redact(repr(item)))
    if "=" not in item:
        raise SpecError(f"override {shown}: expected section.field=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise SpecError(
            f"override {shown}: {one_line(secrets.redact(repr(key)))} is not a field path like section.field"
        )
    try:
        value = load_yaml_text(raw, f"override {key}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # let the field's type decide; a string is the honest reading
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    out = copy.deepcopy(data)  # any plain data YAML gives; validation judges the types
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise SpecError(
                    f"override {one_line(secrets.redact(repr(item)))}: {'.'.join(path[: i + 1])} is not a section"
                )
            node = nxt
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict:
    """A spec file as plain data, read through `load_yaml_text`; every problem is one SpecError
    line naming the file (and the line where there is one)."""
    p = Path(path)
    where = one_line(str(p))
    problem = path_problem(p)
    if problem:
        raise SpecError(
            f"{where}: spec file not found" if problem.startswith("file not found") else f"spec file {problem}"
        )
    if p.stat().st_size > MAX_SPEC_BYTES:
        raise SpecError(f"{where}: {p.stat().st_size} bytes, larger than any spec ({MAX_SPEC_BYTES} bytes at most)")
    try:
        data = load_yaml_text(p.read_text(encoding="utf-8"), where)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(one_line(f"{where}: not valid YAML{at}: {problem}")) from None
    except UnicodeDecodeError:
        raise SpecError(f"{where}: not a text file") from None
    except OSError as e:
        raise SpecError(f"{where}: cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{where}: the spec must be a YAML mapping of sections, got {type(data).__name__}")
    return data
