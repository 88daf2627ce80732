"""Waiting in tests: poll a condition until it holds or a deadline passes. The only sleeps in
the suite are the pauses between two looks at a condition, here."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    ready: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    every_s: float = 0.5,
    proc: subprocess.Popen | None = None,
) -> T:
    """Poll `ready()` every `every_s` until it returns something true, and return that. Fails
    (AssertionError naming `what`, or what `what()` says then) after `timeout_s`, or as soon as
    `proc` (the process under test, when given) has exited: then with the tail of its output."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = ready()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            out = proc.communicate()
            raise AssertionError(
                f"exited with {proc.returncode} before {_said(what)}:\n" + "".join(x or "" for x in out)[-3000:]
            )
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting until {_said(what)}"
        time.sleep(every_s)  # the pause between two looks at the condition


def _said(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


def group_alive(pgid: int) -> list[str]:
    """The pids of the live (non-zombie) processes of process group `pgid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue  # it just exited
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(stat.parent.name)
    return out


def wait_group_gone(pgid: int, timeout_s: float = 60.0) -> None:
    """Return once no live process of group `pgid` is left (a SIGKILLed driver's Ray with it)."""
    wait_until(lambda: not group_alive(pgid), timeout_s, f"the processes of group {pgid} are gone", every_s=0.05)
