"""`rayft`: the user-facing command line (console script `rayft = "orchestrator.cli:main"`).

Each command family lives in a module with `register(subparsers)`; heavy imports (ray, torch,
kubernetes) happen inside the command functions, so `rayft --help` is fast:

    run      rayft run | eval | spec
    k8s      rayft k8s render
    tune     rayft estimate | tune
    jobs     rayft submit | status | logs | stop | list      (any backend, one code path)
    queue    rayft queue add | run | status | retry | cancel
    data     rayft data preview | prepare

`main` is the one place where errors become exit codes: every `jobs.errors.RayftError` is printed
as ``rayft: error: <message>`` (one line on stderr, never a traceback) and the process exits with
its class's `exit_code` (2 for the user's input and for a cluster that cannot be reached or
authenticated against, 1 for a cluster that refused and for a run that failed, `RunError`).
Commands validate everything before they start anything. Every line printed passes the one
redaction (`jobs.secrets.redact`), so a password in a URL or a token never reaches the terminal.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from jobs.errors import RayftError, UserError, error_line

EXIT_INTERRUPTED = 130
COMMAND_MODULES: tuple[str, ...] = (
    "orchestrator.cli.run",
    "orchestrator.cli.k8s",
    "orchestrator.cli.tune",
    "orchestrator.cli.jobs",
    "orchestrator.cli.queue",
    "orchestrator.cli.export",
    "orchestrator.cli.data",
)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake as one line and exit code `UserError.exit_code` (argparse's
    default prints the whole usage too)."""

    def error(self, message: str):
        self.exit(UserError.exit_code, f"{self.prog}: error: {error_line(message)}\n")


def int_in(lo: int, hi: int, what: str = "an integer"):
    """An argparse `type`: an integer from `lo` to `hi` (a 30-digit --priority or job id would
    overflow SQLite's 64-bit integers, and no one means one)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{error_line(repr(text))} is not {what}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{error_line(text)} is out of range ({lo} to {hi})")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="rayft", description="LoRA fine-tuning on Ray, with exact gradient accumulation.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Every line this prints, and every log record, passes `jobs.secrets.redact` on its way out
    (`redacted_output`): no credential is echoed, whichever flag, variable or answer it came from."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from jobs.secrets import redacted_output

    with redacted_output():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from jobs.finetune import parse_with_overrides

    args = parse_with_overrides(build_parser(), argv)
    try:
        return args.fn(args)
    except RayftError as e:
        print(f"rayft: error: {error_line(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("rayft: interrupted (checkpoints on disk are kept; rerun to resume)", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
