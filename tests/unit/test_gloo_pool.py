"""The pool of gloo ranks the distributed oracles run on (tests/helpers/gloo_pool.py): real separate
processes in one gloo group, each call seeing what a freshly spawned rank would, and a failed
call leaving no trace in the next one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gloo_pool import RankFailed, RankKilled, run_on_ranks


def _whoami(rank: int, world: int, marker: str) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # a real collective between the processes
    return {
        "pid": os.getpid(),
        "rank": rank,
        "world": world,
        "backend": dist.get_backend(),
        "sum": float(t),
        "env": (os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("GLOO_POOL_TEST")),
        "cwd": os.getcwd(),
        "draw": float(torch.rand(1)),
        "marker": marker,
    }


def _change_things(rank: int, world: int) -> None:
    import torch

    os.environ["GLOO_POOL_TEST"] = "left behind"
    os.chdir("/")
    torch.rand(100)  # moves the RNG on


def _fail_on(rank: int, world: int, bad_rank: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == bad_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    dist.all_reduce(torch.zeros(1))  # the other rank waits here for ever


def _segfault_once(rank: int, world: int, marker: str) -> int:
    """Rank 1 dies of SIGSEGV the first time it is called (the marker file tells; every time when
    `marker` is empty), as a crash in native code would end it; then a collective to return."""
    import signal

    import torch
    import torch.distributed as dist

    if rank == 1 and not (marker and os.path.exists(marker)):
        if marker:
            Path(marker).touch()
        os.kill(os.getpid(), signal.SIGSEGV)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return int(t)


def test_the_ranks_are_separate_processes_in_one_gloo_group_and_start_each_call_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_POOL_TEST", "from the caller")
    monkeypatch.chdir(tmp_path)
    first = run_on_ranks(_whoami, 2, tmp_path / "a", "one")
    assert [r["rank"] for r in first] == [0, 1] and {r["world"] for r in first} == {2}
    assert len({r["pid"] for r in first} | {os.getpid()}) == 3
    assert all(r["backend"] == "gloo" and r["sum"] == 3.0 for r in first)
    assert [r["env"] for r in first] == [("0", "2", "from the caller"), ("1", "2", "from the caller")]
    assert all(Path(r["cwd"]) == tmp_path for r in first)

    run_on_ranks(_change_things, 2, tmp_path / "b")
    monkeypatch.delenv("GLOO_POOL_TEST")
    again = run_on_ranks(_whoami, 2, tmp_path / "c", "two")
    assert [r["pid"] for r in again] == [r["pid"] for r in first]  # the same processes
    assert all(r["env"][2] is None and Path(r["cwd"]) == tmp_path for r in again)
    assert [r["draw"] for r in again] == [r["draw"] for r in first]  # torch's initial RNG state


def test_a_failing_rank_is_reported_and_the_next_call_gets_a_new_pool(tmp_path):
    before = run_on_ranks(_whoami, 2, tmp_path / "a", "before")
    with pytest.raises(RankFailed, match=r"rank 1 raised:(.|\n)*ValueError: rank 1 fails on purpose"):
        run_on_ranks(_fail_on, 2, tmp_path / "b", 1)
    after = run_on_ranks(_whoami, 2, tmp_path / "c", "after")
    assert not {r["pid"] for r in after} & {r["pid"] for r in before}
    assert [r["sum"] for r in after] == [3.0, 3.0]


def test_a_rank_killed_by_a_signal_is_called_again_once_on_new_ranks(tmp_path, capsys):
    """A crash in native code (a signal, not a Python exception) gets one more call on new ranks; a
    second crash fails like any other rank failure."""
    before = run_on_ranks(_whoami, 2, tmp_path / "a", "before")
    marker = tmp_path / "crashed-once"
    assert run_on_ranks(_segfault_once, 2, tmp_path / "b", str(marker)) == [3, 3]
    assert marker.exists() and "rank 1 died (exit code -11); calling again on new ranks" in capsys.readouterr().err
    after = run_on_ranks(_whoami, 2, tmp_path / "c", "after")
    assert not {r["pid"] for r in after} & {r["pid"] for r in before}
    # Every call crashes: the second is not retried.
    with pytest.raises(RankKilled, match=r"rank 1 died \(exit code -11\)"):
        run_on_ranks(_segfault_once, 2, tmp_path / "d", "")


def test_each_world_size_keeps_its_own_ranks_across_calls(tmp_path):
    """A 4-rank call and a 2-rank call between two 4-rank calls: each size's ranks are started once."""
    four = run_on_ranks(_whoami, 4, tmp_path / "a", "four")
    two = run_on_ranks(_whoami, 2, tmp_path / "b", "two")
    again = run_on_ranks(_whoami, 4, tmp_path / "c", "again")
    assert [r["pid"] for r in again] == [r["pid"] for r in four] and [r["sum"] for r in again] == [10.0] * 4
    assert not {r["pid"] for r in two} & {r["pid"] for r in four}
