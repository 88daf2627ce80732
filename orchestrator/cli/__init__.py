"""`rayft`: the user-facing command line (console script `rayft = "orchestrator.cli:main"`).

Each command family lives in a module with `register(subparsers)`; heavy imports (ray, torch,
kubernetes) happen inside the command functions, so `rayft --help` is fast:

    run      rayft run | eval | spec
    k8s      rayft k8s render
    tune     rayft estimate | tune
    jobs     rayft submit | status | logs | stop | list      (any backend, one code path)
    queue    rayft queue add | run | status | retry | cancel
    data     rayft data preview

`main` is the one place where errors become exit codes: every `jobs.errors.RayftError` is printed
as ``rayft: error: <message>`` (one line on stderr, never a traceback) and the process exits with
its class's `exit_code` (2 for the user's input and for a cluster that cannot be reached or
authenticated against, 1 for a cluster that refused and for a run that failed, `RunError`).
Commands validate everything before they start anything.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from jobs.errors import RayftError, UserError

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
        self.exit(UserError.exit_code, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="rayft", description="LoRA fine-tuning on Ray, with exact gradient accumulation.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from jobs.finetune import parse_with_overrides

    args = parse_with_overrides(build_parser(), argv)
    try:
        return args.fn(args)
    except RayftError as e:
        print(f"rayft: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("rayft: interrupted (checkpoints on disk are kept; rerun to resume)", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
