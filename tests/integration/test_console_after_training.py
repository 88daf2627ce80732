"""The first screen of every command a user runs after training is rayft's own (issue 48 point 6).

Each command runs as a user runs it: the installed `rayft` console script in a fresh process, from
a shell without RAY_AUTH_MODE, with a HOME of its own. Its first lines on stdout and stderr are
rayft's, and none is a library notice: transformers' `is_gradient_checkpointing` FutureWarning
(raised when PEFT wraps a model), bitsandbytes' CPU missing-kernel notice (PEFT imports
bitsandbytes; nothing here is quantized), Ray's token-authentication notice. `rayft run`'s own
console is checked line by line in test_train.py (`unexpected_console_lines`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.spec import load_spec
from jobs.train.context import LocalContext
from jobs.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
RAYFT = Path(sys.executable).parent / "rayft"
ONE_SMALL_STEP = ("run.max_steps=1", "resources.num_workers=1", "batch.global_batch_size=4", "run.eval_every=0")
# Library notices that must never reach the console of these commands (each a substring of its line).
LIBRARY_NOTICES = (
    "is_gradient_checkpointing",
    "FutureWarning",
    "gemm_4bit_forward",
    "kernels-community",
    "Token authentication is enabled",
    "UserWarning",
    "DeprecationWarning",
)


def _as_a_user(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    return {**env, "HOME": str(tmp / "home"), "PYTHONPATH": str(ROOT)}


def _rayft(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([str(RAYFT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=_as_a_user(tmp))
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _notices(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in LIBRARY_NOTICES)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished tiny run (adapter, summary) trained in this process, as `rayft run` leaves one."""
    out = tmp_path_factory.mktemp("run") / "out"
    here = os.getcwd()
    os.chdir(ROOT)  # the example's data paths are relative to the repository
    try:
        spec = load_spec(ROOT / "examples/tiny-lora.yaml", [f"run.output_dir={out}", *ONE_SMALL_STEP])
        train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    finally:
        os.chdir(here)
    return out


def test_rayft_eval_prints_its_own_table_first(finished_run, tmp_path):
    p = _rayft(tmp_path, "eval", "examples/tiny-lora.yaml", f"run.output_dir={finished_run}", *ONE_SMALL_STEP)
    first = p.stderr.splitlines()[0].strip()  # its table is on stderr
    assert first.startswith("rayft eval tiny-lora: exact match on ")
    assert _notices(p.stdout + p.stderr) == []


def test_rayft_generate_prints_only_the_answer(finished_run, tmp_path):
    p = _rayft(tmp_path, "generate", str(finished_run), "hello", "--max-new-tokens", "4")
    assert p.stdout.strip(), "no answer"
    assert _notices(p.stdout + p.stderr) == []
    assert p.stderr.strip() == ""


def test_rayft_export_merge_then_generate_prints_only_rayft_lines(finished_run, tmp_path):
    merged = tmp_path / "merged"
    p = _rayft(tmp_path, "export", str(finished_run), "--merge", "--to", str(merged))
    assert p.stderr.splitlines()[0] == f"rayft: merged model exported to {merged}"
    assert all(line.startswith("rayft: ") for line in p.stderr.splitlines())
    assert _notices(p.stdout + p.stderr) == []
    g = _rayft(tmp_path, "generate", str(merged), "hello", "--max-new-tokens", "4")
    assert _notices(g.stdout + g.stderr) == [] and g.stderr.strip() == ""
