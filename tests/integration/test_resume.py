"""Checkpoints and exact resume: a run that dies loses at most the steps since its last
checkpoint and ends with exactly the adapter an uninterrupted run has (fp32 CPU: <= 1e-6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gradtools import DEMO, RAY_STEPS, ROOT, final_adapter, reference_run, rel_err
from polling import wait_group_gone, wait_until
from runs import metric_lines

from jobs.run import checkpoint as ckpt
from jobs.run.outputs import read_events

BIN = Path(sys.executable).parent


# ---- unit: what counts as a checkpoint ----------------------------------------------------


def _write(root: Path, step: int, world: int = 2) -> Path:
    d = root / ckpt.step_dir_name(step)
    for r in range(world):
        files = {f"rng-rank{r}.pt": ckpt.rng_state()}
        if r == 0:
            files.update(
                {
                    "adapter.safetensors": {"w": torch.full((4, 4), float(step))},
                    "state.json": {"step": step, "world_size": world},
                }
            )
        ckpt.write_rank_files(d, r, files)
    return d


def test_cut_off_checkpoints_are_never_loaded(tmp_path):
    root = tmp_path / "checkpoints"
    good = _write(root, 2)
    cut = _write(root, 4)
    assert ckpt.newest_complete(root) == cut
    # a copy cut off mid-file
    f = cut / "adapter.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    assert ckpt.newest_complete(root) == good
    # same size, different bytes (a torn write)
    cut2 = _write(root, 6)
    data = bytearray((cut2 / "adapter.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (cut2 / "adapter.safetensors").write_bytes(bytes(data))
    assert ckpt.newest_complete(root) == good
    # one rank's files never arrived
    cut3 = _write(root, 8)
    (cut3 / "manifest-rank1.json").unlink()
    assert ckpt.newest_complete(root) == good
    # no state at all (a directory created, nothing written)
    (root / ckpt.step_dir_name(10)).mkdir()
    assert ckpt.newest_complete(root) == good
    assert ckpt.load_adapter(good)["w"][0, 0] == 2.0


# ---- local (no Ray): the driver process dies, the same command resumes ---------------------


# 6 steps of 8 sequences (micro-batch 2: 4 accumulation steps), a checkpoint every 2.
LOCAL_STEPS = [
    "run.max_steps=6",
    "run.checkpoint_every=2",
    "run.keep_checkpoints=3",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
]


def _finetune_local(out: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        str(BIN / "python"),
        "-m",
        "jobs.finetune",
        DEMO,
        "--local",
        f"run.output_dir={out}",
        "resources.num_workers=1",
        *LOCAL_STEPS,
        *extra,
    ]
    # The reference runs in this process: the same intra-op thread count gives the same float
    # reduction order (under `make test` this process has 1 thread and a fresh one would take 2).
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.slow  # a reference run and two fresh `python -m jobs.finetune` processes: over 30 s on 2 cores
def test_local_crash_then_rerun_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    ref = tmp_path / "ref"
    reference_run(
        0,
        1,
        DEMO,
        ["resources.num_workers=1", *LOCAL_STEPS],
        str(ref),
    )
    out = tmp_path / "run"
    fault = f"run.env.RAYFT_FAULT=kill:step=5,rank=0,once={tmp_path / 'killed'}"
    p = _finetune_local(out, fault, check=False)
    assert p.returncode == -signal.SIGKILL  # died before optimizer step 5 (0-based)
    assert [r["step"] for r in metric_lines(out)] == [1, 2, 3, 4, 5]
    # The newest checkpoint (step 4) is torn as if the write was cut off: step 2 must be used.
    newest = out / "checkpoints" / ckpt.step_dir_name(4)
    (newest / "optimizer.pt").write_bytes((newest / "optimizer.pt").read_bytes()[:100])
    p = _finetune_local(out, fault)
    assert "resuming from" in p.stderr and "step-00000002" in p.stderr
    resumes = [e for e in read_events(out) if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [2]
    # metrics.jsonl continues from the checkpoint step: one line per step, no duplicates
    assert [r["step"] for r in metric_lines(out)] == [1, 2, 3, 4, 5, 6]
    assert rel_err(final_adapter(out), final_adapter(ref)) == 0.0  # bit for bit: equal threads
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2


def test_spec_change_that_breaks_resuming_is_refused_before_training(tmp_path, monkeypatch, capsys):
    from jobs.finetune import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    base = [DEMO, "--local", f"run.output_dir={out}", "resources.num_workers=1", "run.checkpoint_every=2"]
    assert main(base + ["run.max_steps=2"]) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    for change, field in (
        ("lora.r=8", "lora.r: 16 -> 8"),
        ("batch.global_batch_size=16", "batch.global_batch_size"),
        ("run.seed=1", "run.seed"),
    ):
        assert main(base + ["run.max_steps=4", change]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "cannot resume" in lines[0] and field in lines[0] and "--fresh" in lines[0]
        assert (out / "metrics.jsonl").read_text() == before  # nothing ran
    # --fresh starts over and keeps the old checkpoints (moved aside, never deleted)
    assert main(base + ["run.max_steps=2", "lora.r=8", "--fresh"]) == 0
    assert list(out.glob("checkpoints.set-aside-*/step-00000002"))
    assert [e["event"] for e in read_events(out)].count("start") == 2


def test_rerunning_a_finished_job_trains_nothing_and_reports_its_result(tmp_path, monkeypatch, capsys, caplog):
    """The same command again after the job finished (e.g. `make demo` twice): no step runs, no
    traceback, and the summary still gives the finished run's final loss."""
    from orchestrator.cli import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    args = [
        "run",
        DEMO,
        "--local",
        f"run.output_dir={out}",
        "resources.num_workers=1",
        "run.max_steps=2",
        "run.checkpoint_every=1",
    ]
    assert main(args) == 0
    first = json.loads((out / "summary.json").read_text())
    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    caplog.clear()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "already ran all 2 steps" in caplog.text
    again = json.loads((out / "summary.json").read_text())
    assert again["resumed_from_step"] == 2 and again["final_loss"] == first["final_loss"] is not None
    assert again["first_loss"] == first["first_loss"] and again["peak_mem_gib"] is not None
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing appended
    assert f"{first['final_loss']:.4f}" in err  # the summary table


# ---- Ray: a worker SIGKILLed mid-run, and the driver killed mid-run ------------------------


def _rayft_run(out: Path, *extra: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "rayft"), "run", DEMO, f"run.output_dir={out}", *RAY_STEPS, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.mark.ray
@pytest.mark.slow
def test_worker_sigkill_restarts_from_last_checkpoint(tmp_path, ray_reference, ray_head):
    """On the session's Ray head: restarting the workers is Ray Train's, on any cluster. (The test
    below needs its own embedded Ray, which dies with the driver.)"""
    out, marker = tmp_path / "run", tmp_path / "killed"
    p = _rayft_run(
        out,
        "run.max_failures=1",
        f"run.env.RAYFT_FAULT=kill:step=5,rank=1,once={marker}",
        "--address",
        ray_head.address,
        env=ray_head.env,
    )
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert marker.read_text().strip() == "killed rank 1 at step 5"
    resumes = [e for e in read_events(out) if e["event"] == "resume"]
    assert len(resumes) == 1
    redone = 5 - resumes[0]["step"]  # steps done before the kill minus the checkpoint's step
    assert 0 <= redone <= 2, resumes
    assert [r["step"] for r in metric_lines(out)] == list(range(1, 9))
    assert rel_err(final_adapter(out), ray_reference) <= 1e-6


@pytest.mark.ray
@pytest.mark.slow
def test_driver_killed_mid_run_then_same_command_resumes(tmp_path, ray_reference):
    out, marker = tmp_path / "run", tmp_path / "stalled"
    fault = f"run.env.RAYFT_FAULT=sleep:step=5,seconds=120,once={marker}"
    p = _rayft_run(out, fault, start_new_session=True)
    wait_until(lambda: marker.exists() and len(metric_lines(out)) >= 5, 300, "the run reached step 5", proc=p)
    os.killpg(p.pid, signal.SIGKILL)  # the driver and the embedded Ray with it
    p.wait(timeout=60)
    wait_group_gone(p.pid)  # the killed run's Ray workers must not write alongside the rerun
    p = _rayft_run(out, fault)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert "resuming from" in err and "step-00000004" in err
    assert [r["step"] for r in metric_lines(out)] == list(range(1, 9))
    assert rel_err(final_adapter(out), ray_reference) <= 1e-6
