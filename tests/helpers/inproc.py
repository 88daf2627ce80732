"""`rayft ...` in this process, answered as a fresh process would answer it: for checks of an exit
code and the lines a command prints, which do not need a new interpreter that imports torch, Ray and
pydantic again (seconds per call). tests/hostile/test_spec_errors.py keeps one check through the installed
console script in a fresh process, so the entry point itself stays covered.

What a fresh `rayft` process shows, and this shows too: stdout, stderr, the log records it prints
on stderr (`logging.basicConfig(level=WARNING, format="%(message)s")` in `orchestrator.cli.main`,
which in this process finds pytest's handlers in place and installs none), and the exit code,
returned or raised (argparse exits with 2)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _environment(env: dict | None):
    """os.environ replaced by `env` for the call (as a subprocess's `env=`), then restored."""
    if env is None:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def rayft_in_process(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`rayft *args` through `orchestrator.cli.main`, in `cwd`, with `env` as the whole environment
    when given; the result has the fields of a finished subprocess."""
    from orchestrator.cli import main

    out, err = io.StringIO(), io.StringIO()
    printed = logging.StreamHandler(err)
    printed.setFormatter(logging.Formatter("%(message)s"))
    printed.setLevel(logging.WARNING)
    root = logging.getLogger()
    here = os.getcwd()
    with _environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        root.addHandler(printed)
        os.chdir(cwd)
        try:
            code = main(list(args))
        except SystemExit as e:  # as the interpreter turns it into an exit status
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=err)
        finally:
            os.chdir(here)
            root.removeHandler(printed)
    return subprocess.CompletedProcess(["rayft", *args], code, out.getvalue(), err.getvalue())
