"""The spec's building blocks: the base of every section (`SpecSection`: no NaN or infinity, no
boolean for a number, no credential in a string) and the field rules sections share."""

from __future__ import annotations

import re
from typing import Any, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)

from jobs import secrets

DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Fields whose own validators judge credentials (with a message that says what belongs there).
OWN_SECRET_CHECK = ("model.hf_token_env", "data.hf_token_env", "run.env")
# Seeds go to torch.manual_seed (after `seed * 7919 + rank`) and random.Random: keep them in
# the range every one of those takes.
MAX_SEED = 2**32 - 1
# A lone surrogate cannot be encoded: no text the spec stores may hold one.
SURROGATE = re.compile("[\ud800-\udfff]")
# An object-store location rayft writes a run to (`run.output_dir`): `s3://BUCKET[/PREFIX]` or
# `gs://BUCKET[/PREFIX]`, the bucket named as S3 and GCS name buckets (3-63 lowercase letters, digits,
# dots, hyphens), the prefix of plain path components (no empty, `.` or `..` one, no control or
# space character). Groups: scheme, bucket, prefix. The one rule for what counts as one
# (`jobs.run.storage` parses with it).
STORE_URI = re.compile(r"(s3|gs)://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])((?:/(?!\.{1,2}(?:/|$))[^/\s\x00-\x1f\x7f]+)*)/?")
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def env_var_name(v: str | None) -> str | None:
    """A `*_token_env` field: the NAME of an environment variable, never the token itself."""
    if v is not None and secrets.looks_like_token(v):
        raise ValueError(
            f"must be the NAME of an environment variable, not the token itself "
            f"({secrets.shown(v)}); secrets go by reference, never by value"
        )
    if v is not None and not ENV_NAME.fullmatch(v):
        raise ValueError("must be the NAME of an environment variable (secrets go by reference, never by value)")
    return v


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type takes a boolean: `bool` somewhere in it (`bool | Literal["auto"]`)."""
    if annotation is bool:
        return True
    return any(_admits_bool(a) for a in get_args(annotation) if not isinstance(a, (int, str, float)))


class SpecSection(BaseModel):
    # allow_inf_nan=False: no float field takes NaN or infinity (`.inf` lr trains NaN silently).
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """A boolean is never a number here: pydantic's lax mode reads `lora.r=true` as r=1."""
        if isinstance(v, bool) and info.field_name is not None:
            field = cls.model_fields[info.field_name]
            if not _admits_bool(field.annotation):
                raise ValueError(f"must be {_kind(field.annotation)}, not a boolean (got {v!r})")
        return v


# The guards every spec section has (no NaN or infinity, no boolean for a number, no unknown key):
# the search spec's sections (`tune.spec`) take them from here.


def _kind(annotation: Any) -> str:
    text = str(annotation)
    return "an integer" if "int" in text else "a number" if "float" in text else "a value of its type"


def true_false_or_auto(v: Any) -> Any:
    """A `bool | "auto"` field's value: a bool, `auto`, or the strings true/false; anything else
    gets one message (pydantic's union error would name each member's failure)."""
    if isinstance(v, bool) or v == "auto":
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise ValueError(f"must be true, false or auto (got {v!r})")
