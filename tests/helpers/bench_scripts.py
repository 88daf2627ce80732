"""A script of bench/ loaded as a module, for the tests that call its functions: bench/ is not a
package (each script runs as `python bench/NAME.py`), so it is loaded from its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py, executed anew as the module `bench_NAME`, registered in sys.modules before it
    runs and left there, as an import would (its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, BENCH / f"{name}.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
