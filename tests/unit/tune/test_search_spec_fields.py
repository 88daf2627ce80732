"""The search spec's fields take the job spec's guards: every number field of the `search`
section refuses a boolean, NaN and infinity in one line naming the field (it took `true` as 1,
and `.inf` passed `--plan` to fail later with a traceback)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from jobs.errors import SpecError
from tune.spec import SearchSection, load_search_spec

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "examples" / "tune-accum.yaml"


def _number_fields(model: type[BaseModel], prefix: str = "search") -> list[tuple[str, str]]:
    """(dotted path, "int" or "float") of every number field of `model`, nested sections too."""
    out = []
    for name, field in model.model_fields.items():
        text, path = str(field.annotation), f"{prefix}.{name}"
        sub = next((a for a in getattr(field.annotation, "__args__", (field.annotation,)) if _is_model(a)), None)
        if sub is not None:
            out += _number_fields(sub, path)
        elif "int" in text or "float" in text:
            out.append((path, "int" if "int" in text else "float"))
    return out


def _is_model(a: Any) -> bool:
    return isinstance(a, type) and issubclass(a, BaseModel)


FIELDS = _number_fields(SearchSection)


def _override(path: str, value: Any) -> list[str]:
    """`search.lr.high=.inf` needs its section whole: a number override of a nested field sets the
    section to a valid one around it."""
    text = {True: "true", False: "false"}.get(value) if isinstance(value, bool) else repr(value)
    text = {"inf": ".inf", "-inf": "-.inf", "nan": ".nan"}.get(text, text)
    if path.startswith("search.lr."):
        other = "high" if path.endswith("low") else "low"
        return [f"search.lr={{{path.rsplit('.', 1)[1]}: {text}, {other}: 0.001}}"]
    return [f"{path}={text}"]


def test_the_search_section_has_number_fields_nested_too():
    names = {p for p, _ in FIELDS}
    assert {"search.budget_gib", "search.samples_per_trial", "search.lr.low", "search.lr.high"} <= names


@given(field=st.sampled_from(FIELDS), value=st.sampled_from([True, False, math.inf, -math.inf, math.nan]))
def test_every_number_field_refuses_booleans_nan_and_infinity(field, value):
    path, kind = field
    if kind == "int" and isinstance(value, float):
        value = True  # an integer field refuses a float anyway: test it with what lax mode let in
    with pytest.raises(SpecError) as got:
        load_search_spec(SPEC, _override(path, value), files=False)
    message = str(got.value)
    assert "\n" not in message and path in message, message
