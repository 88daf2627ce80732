"""The next optimizer step's batch, built on a background thread while the current step computes.

`Prefetch(build, steps)` runs `build(k)` for the steps of `steps` in order, one step ahead of the
training thread, which takes each result with `get(k)`. The invariants:

* **Deterministic.** `build(k)` must be a pure function of k (the loop's is: the samples of step k
  are `jobs.data.GlobalBatches`'s, or a mixture's `MixtureBatches`', the layout a function of
  them; the sampler is used only on this thread). The thread changes only *when*
  a window is built, never what it holds, so resume and the split-equivalence oracles see the
  same windows with and without it; `get` takes the steps in order and refuses any other.
* **Bounded.** One window is built ahead, no more: step k+1 is started when step k is taken
  (a failed build starts nothing after it).
  (The memory of one extra window of micro-batches; on CUDA its pinned host copies.)
* **Exceptions reach the training thread.** An exception raised by `build(k)` is raised again by
  `get(k)` -- the same object, so a `SpecError` stays a `SpecError` with its one-line message --
  and never for a step nobody asked for (a run that stops early ignores a failed build beyond it).
* **The thread never outlives the block.** Leaving the `with` (the last step, an early stop, an
  exception in the step) waits for the build in flight (one window) and joins the thread.

Why a thread: the host work is numpy and torch copies, which release the GIL, and the training
thread spends a GPU step waiting on the device; a process would have to ship the tensors back.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetch(Generic[T]):
    """`build(k)` for each k of `steps`, one ahead of `get` (see the module docstring)."""

    def __init__(self, build: Callable[[int], T], steps: range):
        self.build, self.steps = build, steps
        self._pool: ThreadPoolExecutor | None = None
        self._next: Future[T] | None = None
        self._at = 0  # the position in `steps` that `_next` builds

    def __enter__(self) -> Prefetch[T]:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayft-prefetch")
        self._start(0)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._pool is not None
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool, self._next = None, None

    def get(self, step: int) -> T:
        """The result of `build(step)` (waiting for it if it is still being built); starts the next step's."""
        assert self._pool is not None, "Prefetch.get outside its with block"
        expected = self.steps[self._at] if self._at < len(self.steps) else None
        if step != expected:
            raise RuntimeError(f"Prefetch.get({step}): the next step is {expected}")
        assert self._next is not None
        value = self._next.result()  # re-raises build's exception, the same object
        self._start(self._at + 1)
        return value

    def _start(self, at: int) -> None:
        assert self._pool is not None
        self._at = at
        if at < len(self.steps):
            self._next = self._pool.submit(self.build, self.steps[at])
