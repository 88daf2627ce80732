"""What commands print. What a script wants (an id, `--json`) goes to stdout; messages for
people (progress, warnings, what happened) go to stderr, one line each."""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def say(msg: str) -> None:
    """One line for people, on stderr, prefixed `rayft: `."""
    print(f"rayft: {msg}", file=sys.stderr, flush=True)


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def console():
    """A rich console on stderr (tables and progress for people)."""
    from rich.console import Console

    return Console(stderr=True)


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A table on stdout; when stdout is not a terminal, as wide as the content (no folding), so it greps."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    Console(width=None if sys.stdout.isatty() else 1000).print(t)


def fmt_time(epoch_s: float | None) -> str:
    """Seconds since the epoch as local time, "-" when unknown."""
    if not epoch_s:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_s))
