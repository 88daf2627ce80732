"""The code layout's rules, checked on the source: imports flow `orchestrator -> tune -> jobs`,
the training loop core never imports Ray, and no module imports another that imports it back
(directly or around a longer circle), counting imports inside functions too -- a lazy import is
still a dependency, and the circles this catches were lazy ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jobs", "tune", "orchestrator")
# The loop core runs without Ray (GPU benchmarks use it on machines that have no Ray). A name
# here is a module, or a package standing for all its submodules; each must exist.
RAY_FREE = (
    "jobs.train.loop",
    "jobs.train.step",
    "jobs.train.context",
    "jobs.train.early_stopping",
    "jobs.train.fsdp",
    "jobs.train.faults",
    "jobs.train.prefetch",
    "jobs.objectives",
    "jobs.data",
    "jobs.model",
    "jobs.memory",
    "jobs.spec",
    "jobs.run",
    "jobs.errors",
    "jobs.finetune",
)
# Modules inside those packages that run on Ray by design (never on the loop's path).
RAY_BY_DESIGN = {"jobs.data.prepare": "`rayft data prepare`: tokenizes on Ray Data tasks from the driver"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}


def ray_importers(listed: tuple[str, ...], mods: dict[str, Path]) -> dict[str, list[str]]:
    """For each listed name: its modules (the module itself, or the package and every module
    under it) that import Ray; a name that matches no module at all maps to ["(no such module)"]."""
    out: dict[str, list[str]] = {}
    for name in listed:
        covered = [m for m in mods if m == name or m.startswith(name + ".")]
        bad = [
            m
            for m in covered
            if m not in RAY_BY_DESIGN and any(i.split(".")[0] == "ray" for i in imports_of(m, mods[m]))
        ]
        if not covered or bad:
            out[name] = bad or ["(no such module)"]
    return out


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
    bad = {
        n: sorted(m for m in imports_of(n, p) if m == upper or m.startswith(upper + "."))
        for n, p in modules().items()
        if n == lower or n.startswith(lower + ".")
    }
    assert not {n: m for n, m in bad.items() if m}, f"{lower} must not import {upper}"


def test_jobs_never_imports_kubernetes_and_the_loop_core_never_imports_ray():
    mods = modules()
    for name, path in mods.items():
        if name.startswith("jobs"):
            assert not any(m.split(".")[0] == "kubernetes" for m in imports_of(name, path)), name
    assert ray_importers(RAY_FREE, mods) == {}, "these must not import ray (or were renamed: update RAY_FREE)"


def test_the_ray_free_check_covers_packages_and_fails_on_a_missing_module(tmp_path):
    # The oracle itself: a Ray import deep in a listed package is found; a renamed module is no pass.
    (tmp_path / "jobs" / "memory").mkdir(parents=True)
    (tmp_path / "jobs" / "__init__.py").write_text("")
    (tmp_path / "jobs" / "memory" / "__init__.py").write_text("from .plan import x\n")
    (tmp_path / "jobs" / "memory" / "plan.py").write_text("def f():\n    import ray.train\n")
    (tmp_path / "jobs" / "loop.py").write_text("import torch\n")
    mods = modules(tmp_path)
    assert ray_importers(("jobs.loop",), mods) == {}
    assert ray_importers(("jobs.memory", "jobs.loop"), mods) == {"jobs.memory": ["jobs.memory.plan"]}
    assert ray_importers(("jobs.renamed",), mods) == {"jobs.renamed": ["(no such module)"]}
    assert ray_importers(("jobs.mem",), mods) == {"jobs.mem": ["(no such module)"]}  # a prefix is no package


def find_cycle(graph: dict[str, set[str]]):
    """One import circle as a list of modules, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
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
