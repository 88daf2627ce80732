"""The loop runs every objective through one interface (`jobs.objectives.Objective`): its source
names no objective and tests no objective flag, and every objective a spec can name has an
implementation registered for its spec class."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from runs import objective_overrides

from jobs.objectives import Objective
from jobs.spec import OBJECTIVE_BY_NAME, load_spec

ROOT = Path(__file__).resolve().parents[3]
DEMO = "examples/tiny-lora.yaml"
# Written out here: the objectives there are today (a new one is caught by the spec's own list below).
NAMES = {"sft", "dpo", "ipo", "simpo", "orpo", "rpo", "kto", "grpo"} | set(OBJECTIVE_BY_NAME)
WORD = re.compile(r"[a-z0-9]+")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def code_words(source: str) -> set[str]:
    """The lowercase words of every identifier and string literal in `source`'s code (not its
    comments or docstrings): names, attributes, imported names, arguments, and the text of strings
    and f-strings."""
    tree = ast.parse(source)
    docs, words = _docstrings(tree), set()
    for node in ast.walk(tree):
        texts: list[str] = []
        if isinstance(node, ast.Name):
            texts = [node.id]
        elif isinstance(node, ast.Attribute):
            texts = [node.attr]
        elif isinstance(node, ast.alias):
            texts = [node.name, node.asname or ""]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            texts = [node.name]
        elif isinstance(node, ast.arg):
            texts = [node.arg]
        elif isinstance(node, ast.keyword):
            texts = [node.arg or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            texts = [node.value]
        for text in texts:
            words |= {text.lower()} | set(WORD.findall(text.lower()))
    return words


def test_the_loop_names_no_objective_and_tests_no_objective_flag():
    source = "\n".join((ROOT / "jobs" / "train" / f).read_text() for f in ("loop.py", "step.py"))
    assert "is_preference" not in source
    assert not code_words(source) & NAMES, sorted(code_words(source) & NAMES)


def test_the_check_sees_a_name_in_a_string_an_attribute_and_an_f_string():
    for code in ('x = "dpo"', "if o.is_dpo: pass", 'y = f"{n} SimPO pairs"', "from m import SFT"):
        assert code_words(code) & NAMES, code
    assert not code_words('"""An SFT docstring."""\n# a dpo comment\nx = 1') & NAMES


@pytest.mark.parametrize("name", sorted(OBJECTIVE_BY_NAME))
def test_every_objective_a_spec_names_has_an_implementation(name):
    spec = load_spec(DEMO, objective_overrides(name), files=False)
    objective = Objective.of(spec)
    assert type(spec.objective) in type(objective).specs and objective.name == name
    assert isinstance(objective, Objective) and Objective(name).name == name
