"""A pool of gloo ranks that outlives one test: W processes, started once (spawn), that join one
gloo process group and run test functions by reference, `fn(rank, world, *args)`.

Why: every distributed oracle used to start its ranks anew (`mp.spawn`), and each new rank paid
again for importing torch, transformers, peft and bitsandbytes and for loading tiny-llama. The
ranks here are still real separate processes talking over gloo, so what the oracles prove is
unchanged; only the start-up is shared.

Each call runs as a fresh rank would see it: the caller's working directory and environment
(as `mp.spawn` hands them to its children), torch's initial RNG state, and a default process
group (re-created when a function destroyed it). A call that raises or dies on any rank, or is
interrupted, tears the whole pool down (the other ranks may be stuck in a collective); the next
call starts a new one. A call whose rank was killed by a signal is made once more
(`KILLED_TRIES`). Results travel as `torch.save` files, as with `mp.spawn` before."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import NoReturn

CALL_TIMEOUT_S = 900.0  # pytest-timeout's limit: no call may outlast the test that makes it
START_TIMEOUT_S = 600.0  # importing torch & co. on a loaded 2-core machine


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its traceback or its log's tail."""


class RankKilled(RankFailed):
    """A rank ended by a signal (a crash in native code, not a Python exception)."""


def _rank_main(rank: int, world: int, rendezvous: str, log: str, conn) -> None:
    """A rank's loop: set up once, then run what the parent sends until told to stop."""
    out = open(log, "a", buffering=1)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    seed = torch.initial_seed()
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    conn.send(("ready", None))
    while True:
        msg = conn.recv_bytes()
        if not msg:
            break
        home_cwd, home_env = os.getcwd(), dict(os.environ)
        try:
            # Unpickled here, not by recv(): importing the function's test module may fail too.
            fn, args, result_path, cwd, env, task_rendezvous = pickle.loads(msg)
            os.environ.clear()
            os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world))
            os.chdir(cwd)
            torch.manual_seed(seed)
            if not dist.is_initialized():  # the previous function destroyed the group
                dist.init_process_group("gloo", init_method=f"file://{task_rendezvous}", rank=rank, world_size=world)
            torch.save(fn(rank, world, *args), result_path)
            reply = ("done", None)
        except BaseException:
            reply = ("error", traceback.format_exc())
        finally:
            os.chdir(home_cwd)
            os.environ.clear()
            os.environ.update(home_env)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(reply)
    # Leave without tearing down gloo: its background threads can abort() during interpreter
    # shutdown ("terminate called without an active exception").
    os._exit(0)


class GlooPool:
    """`world` ranks of one gloo group; `run` is one call on every rank, results by rank."""

    def __init__(self, world: int):
        import torch.multiprocessing as mp

        self.world = world
        self.dir = Path(tempfile.mkdtemp(prefix=f"gloo-pool-{world}-"))
        self.calls = 0
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                args=(rank, world, str(self.dir / "rendezvous"), str(self.log(rank)), child),
                daemon=True,
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect("ready", START_TIMEOUT_S, "starting the pool")

    def log(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.log"

    def run(self, fn: Callable, args: tuple, tmp: Path) -> list:
        self.calls += 1
        tmp.mkdir(parents=True, exist_ok=True)
        paths = [tmp / f"result-{r}.pt" for r in range(self.world)]
        rendezvous = str(self.dir / f"rendezvous-{self.calls}")
        try:
            for rank, conn in enumerate(self.conns):
                conn.send_bytes(pickle.dumps((fn, args, str(paths[rank]), os.getcwd(), dict(os.environ), rendezvous)))
            self._collect("done", CALL_TIMEOUT_S, f"{getattr(fn, '__qualname__', fn)}")
        except BaseException:
            # Interrupted (a test timeout, Ctrl-C) or failed: ranks may still be inside the call, and
            # their late answers must not be taken for the next call's. A new pool starts next time.
            self.close(force=True)
            raise
        import torch

        return [torch.load(p, weights_only=False) for p in paths]

    def _collect(self, want: str, timeout_s: float, what: str) -> None:
        """Wait for `want` from every rank; a rank's error, death or silence is a RankFailed."""
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(what, f"no answer within {timeout_s:g} s from ranks {sorted(pending)}", None)
            by_sentinel = {self.procs[r].sentinel: r for r in pending}
            for ready in wait(list(pending.values()) + list(by_sentinel), timeout=left):
                if ready in by_sentinel:
                    rank = by_sentinel[ready]
                    if pending.get(rank) is not None and pending[rank].poll():
                        continue  # its last message is still to be read
                    self._died(what, rank)
                rank = next(r for r, c in pending.items() if c is ready)
                try:
                    kind, detail = ready.recv()
                except EOFError:  # its pipe closed: the process ended, or is ending
                    self._died(what, rank)
                if kind == "error":
                    self._peer_died(what, pending, rank)
                    self._fail(what, f"rank {rank} raised:\n{detail}", rank)
                del pending[rank]

    def _peer_died(self, what: str, pending: dict, rank: int) -> None:
        """`rank` raised: when another pending rank's process has ended, that is the failure (the
        raise is its collective losing the peer, often read first: a segfaulted rank's RankKilled
        was reported as its peer's "Connection closed by peer" once in CI, and not called again)."""
        for other in pending:
            if other != rank:
                self.procs[other].join(timeout=2)  # a dead peer is reaped at once; a live one waits 2 s
                if self.procs[other].exitcode is not None:
                    self._died(what, other)

    def _died(self, what: str, rank: int) -> NoReturn:
        """A rank's process ended mid-call: RankKilled when a signal ended it (its exit code is
        read once it is reaped: its sentinel can be ready a moment before)."""
        p = self.procs[rank]
        p.join(timeout=10)
        why = f"rank {rank} died (exit code {p.exitcode})"
        if p.exitcode is not None and p.exitcode < 0:
            self._fail(what, why, rank, RankKilled)
        self._fail(what, why, rank)

    def _fail(self, what: str, why: str, rank: int | None, kind: type[RankFailed] = RankFailed) -> NoReturn:
        tail = ""
        if rank is not None and self.log(rank).exists():
            tail = "\n--- its log ---\n" + self.log(rank).read_text(errors="replace")[-4000:]
        self.close(force=True)
        raise kind(f"{what}: {why}{tail}")

    def close(self, force: bool = False) -> None:
        for conn, p in zip(self.conns, self.procs, strict=True):
            if not force and p.is_alive():
                try:
                    conn.send_bytes(b"")
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=0 if force else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=30)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)


# The persistent pools: one group of ranks per world size (2 and 4 in this suite), each started by
# the first call that needs it and kept for the session. Before, a 4-rank call started 4 new ranks
# (each importing torch, transformers and peft) and closed them: the 17 split oracles of
# test_preference.py and test_mixture.py (`-k every_split`, one process, cgroup cpuacct) took
# 146.6 core-seconds and 79 s; with a kept 4-rank pool 34 core-seconds and 23 s. An idle rank
# holds about 0.45 GB (RSS after a preference oracle's call).
_pools: dict[int, GlooPool] = {}

# Calls of one function when a rank is killed by a signal. In a cold `make test` on this machine
# (2026-12-07) a rank died of a segfault in torch's gloo thread (`pt_gloo_runloop`, a NULL read in
# libc, empty rank log) at the start of an FSDP oracle that passes on every other run: the call is
# made once more on new ranks, so such a crash does not fail the oracle. A rank that raises, or a
# crash that repeats, still fails it.
KILLED_TRIES = 2


def run_on_ranks(fn: Callable, world: int, tmp: Path, *args) -> list:
    """fn(rank, world, *args) on `world` gloo ranks; each rank's return value, by rank."""
    for attempt in range(KILLED_TRIES):
        pool = _pools.get(world)
        if pool is None or not pool.alive:  # never started, or torn down after a failure
            pool = _pools[world] = GlooPool(world)
        try:
            return pool.run(fn, args, tmp)
        except RankKilled as e:
            if attempt == KILLED_TRIES - 1:
                raise
            print(f"gloo_pool: {str(e).splitlines()[0]}; calling again on new ranks", file=sys.stderr)
    raise AssertionError("unreachable")


def shutdown() -> None:
    """Stop the persistent pools (conftest calls this when the session ends)."""
    while _pools:
        _pools.popitem()[1].close()
