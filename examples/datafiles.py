"""Shared by the example data generators: write the files, or `--check` the committed ones."""

from __future__ import annotations

import argparse
from pathlib import Path

HERE = Path(__file__).parent / "data"


def write_or_check(files: dict[str, str], generator: str) -> None:
    ap = argparse.ArgumentParser(description=f"generate examples/data files ({generator})")
    ap.add_argument("--check", action="store_true", help="fail if the committed files differ")
    args = ap.parse_args()
    HERE.mkdir(exist_ok=True)
    for name, content in files.items():
        path = HERE / name
        if args.check:
            if path.read_text() != content:
                raise SystemExit(f"{path} differs from what {generator} generates")
        else:
            path.write_text(content)
            print(f"wrote {path} ({content.count(chr(10))} records)")
