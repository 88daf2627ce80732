"""Fault injection for failure-path tests and drills, driven by the RAYFT_FAULT variable
(set it through `run.env`, which reaches every worker). Unset, it costs one dict lookup.

    RAYFT_FAULT="oom:micro_batch_gt=2"                 raise torch.OutOfMemoryError on the first
                                                       step when batch.micro_batch_size > 2
    RAYFT_FAULT="kill:step=5,rank=1,once=/tmp/marker"  SIGKILL rank 1's process before optimizer
                                                       step 5 (0-based), once: the marker file
                                                       records that it happened
    RAYFT_FAULT="sleep:step=5,seconds=60,once=/tmp/m"  stall every rank before step 5, once (for
                                                       tests that stop the driver mid-run); with
                                                       rank=1 only rank 1, while the others wait
                                                       for it in the step's all-reduce
Several directives are separated by ';'.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from jobs.errors import RunError


@dataclass
class Faults:
    directives: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def at_step(self, step: int, rank: int, micro_batch_size: int) -> None:
        for kind, args in self.directives:
            if kind == "oom" and micro_batch_size > int(args["micro_batch_gt"]):
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (injected by RAYFT_FAULT: micro_batch_size={micro_batch_size} "
                    f"> {args['micro_batch_gt']})"
                )
            if kind == "kill" and step == int(args["step"]) and rank == int(args.get("rank", 0)):
                if _first_time(args, f"killed rank {rank} at step {step}"):
                    os.kill(os.getpid(), signal.SIGKILL)
            if kind == "sleep" and step == int(args["step"]) and rank == int(args.get("rank", rank)):
                # The marker names the process (a test finds the node that stalled by its pid).
                what = f"slept at step {step}: rank {rank}, pid {os.getpid()}"
                if _first_time(args, what, mark=rank == int(args.get("rank", 0))):
                    time.sleep(float(args["seconds"]))


def _first_time(args: dict[str, str], what: str, mark: bool = True) -> bool:
    """True unless the `once` marker file exists; creates it (when `mark`) before acting."""
    marker = Path(args["once"]) if "once" in args else None
    if marker is None:
        return True
    if marker.exists():
        return False
    if mark:
        marker.write_text(what + "\n")
    return True


# Each fault's numeric arguments, all required but `rank` (default 0); `once` (a marker file) is optional.
_NUMBERS: dict[str, dict[str, type]] = {
    "oom": {"micro_batch_gt": int},
    "kill": {"step": int, "rank": int},
    "sleep": {"step": int, "seconds": float, "rank": int},
}
_OPTIONAL = {"rank"}


def from_env() -> Faults:
    """The directives of RAYFT_FAULT. A value that does not parse (a directive, an unknown fault, a
    missing or non-numeric argument) is a `RunError` (exit 1) before the first step: the variable
    is a setting of the test or drill that set it, not the user's spec."""
    text = os.environ.get("RAYFT_FAULT", "").strip()
    faults = Faults()
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, rest = part.partition(":")
        try:
            args = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        except ValueError:
            raise RunError(f"RAYFT_FAULT: cannot parse {part!r}") from None
        if kind not in _NUMBERS:
            raise RunError(f"RAYFT_FAULT: unknown fault {kind!r} (oom, kill, sleep)")
        for name, number in _NUMBERS[kind].items():
            if name not in args and name in _OPTIONAL:
                continue
            try:
                number(args[name])
            except (KeyError, ValueError):
                raise RunError(f"RAYFT_FAULT: {part!r} needs {name}=<{number.__name__}>") from None
        faults.directives.append((kind, args))
    return faults
