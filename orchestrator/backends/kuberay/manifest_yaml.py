"""Rendered manifests as the YAML `rayft k8s render` prints: multi-document, in apply order, a
multi-line string (the spec in its ConfigMap) as a literal block."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

Obj = dict[str, Any]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the spec in the ConfigMap) as literal blocks."""


def _str_representer(dumper: yaml.SafeDumper, s: str):
    if "\n" in s:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", s)


_Dumper.add_representer(str, _str_representer)


def to_yaml(objs: Iterable[Obj], header: str | None = None) -> str:
    """Multi-document YAML, in order (the ConfigMap before the RayJob that mounts it, then its PDB)."""
    docs = [yaml.dump(o, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100) for o in objs]
    text = "---\n".join(docs)
    if header:
        text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + "---\n" + text
    return text
