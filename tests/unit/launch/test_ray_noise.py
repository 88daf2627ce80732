"""What Ray prints beside rayft's verdict (`jobs.launch.on_ray._TracebackFilter`): a worker's
traceback is cut to its exception line, and known noise lines are dropped while every other line
(rayft's own, the user's prints) is kept."""

from __future__ import annotations

from jobs.launch.on_ray import _TracebackFilter

GCS_AFTER_NODE_LOSS = (
    "[2026-12-05 10:00:00,000 E 123 456] gcs_placement_group_scheduler.cc:300: Failed to remove 1 bundle(s) "
    "for placement group 0123abcd, max retry count is reached."
)


def _kept(lines: list[str]) -> list[str]:
    printed: list[dict] = []
    _TracebackFilter(printed.append)({"pid": "gcs_server", "is_err": True, "lines": lines})
    return [ln for batch in printed for ln in batch["lines"]]


def test_known_noise_is_dropped_and_every_other_line_kept():
    lines = ["step 1 loss 2.0", GCS_AFTER_NODE_LOSS, "Failed to remove my temp file (the user's print)"]
    assert _kept(lines) == [lines[0], lines[2]]


def test_a_traceback_is_cut_to_its_exception_line():
    lines = ["Traceback (most recent call last):", '  File "x.py", line 1, in f', "    f()", "ValueError: boom"]
    assert _kept(lines) == ["ValueError: boom"]
