"""The code layout's rules, checked on the source: imports flow `orchestrator -> tune -> jobs`,
the training loop core never imports Ray, and no module imports another that imports it back
(directly or around a longer circle), counting imports inside functions too -- a lazy import is
still a dependency, and the circles this catches were lazy ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jobs", "tune", "orchestrator")
# The loop core runs without Ray (GPU benchmarks use it on machines that have no Ray).
RAY_FREE = ("jobs.loop", "jobs.data", "jobs.model", "jobs.memory", "jobs.spec", "jobs.checkpoint",
            "jobs.context", "jobs.outputs", "jobs.errors", "jobs.finetune", "jobs.cache", "jobs.early_stopping")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path) -> set[str]:
    """Every module `name` imports, anywhere in its body (absolute names, relative ones resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def internal_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m in imports_of(name, path) if m in mods and m != name} for name, path in mods.items()}


def test_the_checks_see_imports_inside_functions_and_relative_ones(tmp_path):
    # The oracle itself: a lazy relative import inside a function is found and resolved.
    f = tmp_path / "mod.py"
    f.write_text("import os\ndef g():\n    from .model import x\n    from . import checkpoint as c\n")
    found = imports_of("jobs.spec", f)
    assert {"os", "jobs.model", "jobs.checkpoint"} <= found


@pytest.mark.parametrize("lower,upper", [("jobs", "tune"), ("jobs", "orchestrator"), ("tune", "orchestrator")])
def test_imports_flow_orchestrator_to_tune_to_jobs(lower, upper):
    bad = {n: sorted(m for m in imports_of(n, p) if m == upper or m.startswith(upper + "."))
           for n, p in modules().items() if n == lower or n.startswith(lower + ".")}
    assert not {n: m for n, m in bad.items() if m}, f"{lower} must not import {upper}"


def test_jobs_never_imports_kubernetes_and_the_loop_core_never_imports_ray():
    mods = modules()
    for name, path in mods.items():
        if name.startswith("jobs"):
            assert not any(m.split(".")[0] == "kubernetes" for m in imports_of(name, path)), name
    for name in RAY_FREE:
        if name in mods:
            assert not any(m.split(".")[0] == "ray" for m in imports_of(name, mods[name])), name


def find_cycle(graph: dict[str, set[str]]):
    """One import circle as a list of modules, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if state.get(n) is None:
            found = visit(n)
            if found:
                return found
    return None


def test_find_cycle_finds_a_circle_and_only_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circles():
    graph = internal_graph()
    # A package's __init__ importing its own modules is how packages work, not a circle.
    for name in list(graph):
        if modules()[name].name == "__init__.py":
            graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    for name in graph:
        # `from pkg import x` names the package too; that edge is the package, not a circle.
        graph[name] = {m for m in graph[name] if not (modules()[m].name == "__init__.py" and name.startswith(m + "."))}
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"
