"""The plan's rules: which strategy and which checkpointing, each decided in one function.

Pure functions of estimates (given as callables or as a stored table), so that the plan made
from a spec (`plan.plan_for_spec`) and queue admission, which keeps only the estimates it stored
at `queue add` (`tables.choose_plan_from_table`), apply the very same rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

# A strategy choice as one string, so that a table of estimates by choice is plain JSON (queue
# admission stores one): "ddp", "fsdp" (reshard after forward) or "fsdp-keep" (layers stay gathered).
CHOICE_DDP, CHOICE_FSDP, CHOICE_FSDP_KEEP = "ddp", "fsdp", "fsdp-keep"
CHOICES = {CHOICE_DDP: ("ddp", None), CHOICE_FSDP: ("fsdp", True), CHOICE_FSDP_KEEP: ("fsdp", False)}


def strategy_choices(
    strategy: str, reshard_after_forward: bool | None, num_workers: int, quantization: str = "none"
) -> list[str]:
    """The choices `resources.strategy` / `resources.fsdp_reshard_after_forward` leave, in the
    order the plan tries them: DDP first (nothing to gather: fastest), then FSDP keeping the
    layers gathered from forward to backward (no second all-gather), then FSDP resharding after
    forward (least memory). One worker has nothing to shard over: DDP only. An nf4 base (QLoRA)
    is sharded like any other when DDP does not fit: FSDP2 shards its packed 4-bit weights
    (tests/integration/test_qlora.py trains it). An int8 base is not chosen for FSDP by `auto`: bitsandbytes'
    `Int8Params` lose their row scales and int8 codes under `fully_shard` (measured with
    bitsandbytes 0.50: the first forward fails with "'Parameter' object has no attribute 'CB'")."""
    if strategy == "ddp" or (strategy == "auto" and (num_workers < 2 or quantization == "int8")):
        return [CHOICE_DDP]
    fsdp = {None: [CHOICE_FSDP_KEEP, CHOICE_FSDP], True: [CHOICE_FSDP], False: [CHOICE_FSDP_KEEP]}[
        reshard_after_forward
    ]
    return fsdp if strategy == "fsdp" else [CHOICE_DDP, *fsdp]


def fixed_choice(strategy: str, reshard_after_forward: bool | None) -> str | None:
    """The choice `resources.strategy` / `resources.fsdp_reshard_after_forward` fix on their own:
    DDP, or FSDP with its resharding set; None where the plan decides (`auto`, or FSDP with the
    resharding left open)."""
    if strategy == "ddp":
        return CHOICE_DDP
    if strategy == "auto" or reshard_after_forward is None:
        return None
    return CHOICE_FSDP if reshard_after_forward else CHOICE_FSDP_KEEP


def strategy_str(strategy: str, reshard_after_forward: bool | None) -> str:
    """ "ddp", "fsdp" or "fsdp (layers kept gathered)", as people read it."""
    return "fsdp (layers kept gathered)" if strategy == "fsdp" and reshard_after_forward is False else strategy


def checkpointing_str(every: int | None) -> str:
    """0 -> off, 1 -> on, k -> "every 2nd layer" (None: not decided)."""
    if every is None:
        return "-"
    if every in (0, 1):
        return ("off", "on")[every]
    suffix = "th" if 10 <= every % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(every % 10, "th")
    return f"every {every}{suffix} layer"


def checkpointing_candidates(num_layers: int) -> list[int]:
    """Every checkpointing choice `auto` may make, in the order it tries them: off (0), then
    every k-th decoder layer from the sparsest (k = num_layers: the first layer only) down to
    every layer (1). Sparser is faster (fewer layers recomputed), so the first that fits wins."""
    return [0, *range(num_layers, 1, -1), 1]


def choose_checkpointing_every(
    mode: Any, gib_of: Callable[[int], float], num_layers: int, budget_gib: float | None
) -> int:
    """The checkpointing rule, once: `mode` is `memory.gradient_checkpointing` (True, False or
    "auto"); `gib_of(k)` the estimated GiB with checkpointing every k-th layer (0 = off).

    True -> every layer; False -> off; "auto" -> off when it fits `budget_gib` (or there is no
    budget), else the first of `checkpointing_candidates` that fits, else every layer (the
    least memory there is; the plan then says it does not fit). Queue admission applies this
    same function to estimates it stored at `queue add` (it does not rebuild the spec)."""
    if mode is True or str(mode).lower() == "true":
        return 1
    if mode is False or str(mode).lower() == "false":
        return 0
    if budget_gib is None:
        return 0
    for every in checkpointing_candidates(num_layers):
        if gib_of(every) <= budget_gib:
            return every
    return 1


def choose_plan(
    choices: Sequence[str], mode: Any, gib_of: Callable[[str, int], float], num_layers: int, budget_gib: float | None
) -> tuple[str, int]:
    """The strategy and checkpointing rule, once: (choice, checkpoint every k-th layer).

    `gib_of(choice, k)` is the estimated GiB per GPU. Each choice in order gets its checkpointing
    from `choose_checkpointing_every`; the first whose estimate then fits `budget_gib` (or any,
    without a budget) wins; when none fits, the last (the least memory; the plan then says it does
    not fit). So `auto` runs DDP when DDP fits, else FSDP, keeping layers gathered only when that
    fits too. Queue admission applies this same function to the estimates it stored at `queue add`."""
    for choice in choices:
        every = choose_checkpointing_every(mode, functools.partial(gib_of, choice), num_layers, budget_gib)
        if budget_gib is None or gib_of(choice, every) <= budget_gib:
            return choice, every
    return choice, every
