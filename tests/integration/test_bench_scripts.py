"""The benchmark scripts run end to end on CPU and write result files of the documented shape.

`bench/gpu_compare.py --dry-run` runs the whole GPU comparison pipeline (rayft's `train()` and
HF Trainer + PEFT, configuration choice under a budget, FLOPs, the result file) with tiny
shapes on CPU, once, inside the dry run of `bench/gpu_all.sh` (with bench/gpu_memory.py);
`bench/cpu_overhead.py --quick` the CPU overhead benchmark, `bench/host_path.py --quick` the step's host
path. One CPU run of each script. Their numbers are
not checked (timings on a shared 2-core machine mean nothing); the schema and the pipeline are.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]

ROW_KEYS = {
    "shape",
    "budget_gib",
    "loop",
    "micro_batch_size",
    "grad_accum_steps",
    "global_batch_size",
    "gradient_checkpointing",
    "tok_s",
    "model_tflops",
    "peak_alloc_gib",
    "estimate_gib",
}


def _run(script: str, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _only_json(out: Path) -> dict:
    files = sorted(out.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def _check_gpu_compare_dry_run(files: list[Path], stdout: str) -> None:
    """What bench/gpu_compare.py --dry-run must leave (`files`: the JSON files it wrote; `stdout`:
    what it printed), run with GPU_COMPARE_FAKE_OOM=hf:8:0,rayft:8:0: out of memory cannot happen
    on CPU, so it is simulated (from inside the loops) for HF's first candidate and rayft's first
    choice at the loose budget, to cover the retry path."""
    assert len(files) == 1 and files[0].name.endswith("-cpu-dry-run.json"), files
    result = json.loads(files[0].read_text())
    assert {"gpu", "date", "versions", "rows"} <= result.keys()
    assert {"torch", "transformers", "peft"} <= result["versions"].keys()
    assert result["dry_run"] is True and result["matmul_ceiling"]["tflops"] > 0

    compiled = [r for r in result["rows"] if r["loop"] == "rayft-compile"]
    qlora = [r for r in result["rows"] if r["loop"] == "rayft-qlora"]
    rows = [r for r in result["rows"] if r["loop"] not in ("rayft-compile", "rayft-qlora")]
    assert {r["loop"] for r in rows} == {"rayft", "hf"}
    budgets = {r["budget_gib"] for r in rows}
    assert len(budgets) == 2
    for r in rows:
        assert ROW_KEYS <= r.keys(), ROW_KEYS - r.keys()
        assert r["status"] == "ok", r
        assert r["tok_s"] > 0 and r["model_tflops"] > 0
        assert r["micro_batch_size"] * r["grad_accum_steps"] == r["global_batch_size"]
        assert isinstance(r["gradient_checkpointing"], bool)
        assert r["peak_alloc_gib"] is None  # no allocator counter on CPU
        if r["loop"] == "rayft":
            # chosen with the memory model: the estimate fits the budget it ran under
            assert r["estimate_gib"] > 0 and r["estimate_spec_gib"] <= r["budget_gib"]
        else:
            assert r["estimate_gib"] is None and r["proxy_estimate_gib"] <= r["budget_gib"]
            assert r["attempts"][-1]["result"] == "ok"

    # The tight budget forces HF into checkpointing (its proxy estimate without it is over
    # 2.1 MiB for every micro-batch); the loose one would run the whole batch at once, but
    # micro-batch 8 "ran out of memory", so the next one down ran.
    hf = {r["budget_gib"]: r for r in rows if r["loop"] == "hf"}
    tight, loose = sorted(hf)
    assert hf[tight]["gradient_checkpointing"] is True
    assert hf[loose]["gradient_checkpointing"] is False and hf[loose]["micro_batch_size"] == 4
    assert [a["result"] for a in hf[loose]["attempts"]] == ["oom", "ok"]
    ray = {r["budget_gib"]: r for r in rows if r["loop"] == "rayft"}
    first, second = ray[loose]["attempts"]
    assert first["result"].startswith("oom") and first["micro_batch_size"] == 8 and first["loss_chunk_tokens"] == 0
    assert second["result"] == "ok" and ray[loose]["loss_chunk_tokens"] == second["loss_chunk_tokens"]

    # one extra rayft row with model.compile, after the main rows, at the first budget, its
    # configuration chosen with the compiled estimate (which keeps less than the eager one: the
    # plain row's choice need not be its choice), within the budget
    assert len(compiled) == 1 and result["rows"][-2]["loop"] == "rayft-compile"
    c_row = compiled[0]
    assert c_row["status"] == "ok" and c_row["tok_s"] > 0 and c_row["budget_gib"] == tight
    assert c_row["compiled_layers"] is True and c_row["eager_head"] is False
    assert 0 < c_row["estimate_spec_gib"] <= c_row["budget_gib"]
    assert c_row["micro_batch_size"] * c_row["grad_accum_steps"] == c_row["global_batch_size"]

    # the QLoRA row, last: the same loop on a base jobs.model.loading loaded as nf4 (all 7 linear layers of
    # both decoder layers 4-bit), its configuration chosen with the quantized estimate
    assert len(qlora) == 1 and result["rows"][-1]["loop"] == "rayft-qlora"
    q_row = qlora[0]
    assert q_row["status"] == "ok" and q_row["tok_s"] > 0 and q_row["budget_gib"] == tight, q_row
    assert q_row["quantization"] == "nf4" and q_row["quantized_linear_layers"] == 7 * 2
    assert q_row["micro_batch_size"] * q_row["grad_accum_steps"] == q_row["global_batch_size"]
    assert 0 < q_row["estimate_spec_gib"] <= q_row["budget_gib"] and q_row["estimate_gib"] > 0
    assert ROW_KEYS <= q_row.keys()

    # one comparison per (shape, budget), with the ratio rayft / HF
    comps = result["comparisons"]
    assert len(comps) == 2
    for c in comps:
        assert math.isclose(c["ratio"], c["rayft_tok_s"] / c["hf_tok_s"], rel_tol=1e-2)
    by_budget = {c["budget_gib"]: c for c in comps}
    assert math.isclose(by_budget[tight]["compile_speedup"], c_row["tok_s"] / ray[tight]["tok_s"], rel_tol=1e-2)
    assert by_budget[loose]["compile_speedup"] is None
    assert by_budget[tight]["qlora_tok_s"] == q_row["tok_s"] and by_budget[loose]["qlora_tok_s"] is None

    # FLOPs per token: 4N + 6 L S d_q for the tiny shape (hidden 64, 2 layers, 4 heads, 2 kv, ff 176, vocab 512)
    f = result["flops_per_token"]["tiny"]
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 176
    assert f["N"] == 2 * layer + 512 * 64
    assert f["total"] == 4 * f["N"] + 6 * 2 * 64 * 64
    assert "rayft/hf" in stdout  # the printed table


def test_cpu_overhead_quick_writes_ratio(tmp_path):
    proc = _run("cpu_overhead.py", "--quick", "--out", str(tmp_path))
    result = _only_json(tmp_path)
    assert result["benchmark"] == "cpu-overhead"
    assert {"torch", "transformers", "peft"} <= result["versions"].keys()
    assert result["machine"]["cpu_count"] >= 1
    for clock in ("cpu", "wall"):
        for loop in ("rayft", "plain", "bare"):
            s = result["results"][clock][loop]
            assert s["n"] == 2 * 4 and s["median_s"] > 0
        r = result["ratios"][clock]
        res = result["results"][clock]
        assert math.isclose(r["rayft_over_plain"], res["rayft"]["median_s"] / res["plain"]["median_s"])
    assert result["ratio_rayft_over_plain"] == result["ratios"]["cpu"]["rayft_over_plain"]
    assert result["goal"] == 1.05 and isinstance(result["met"], bool)
    # both loops computed the same thing: the same per-step losses
    assert result["same_math_max_loss_diff"] < 1e-5
    assert set(result["definitions"]) >= {"rayft", "plain", "bare"}
    assert "rayft / plain" in proc.stdout


def test_preference_reference_quick_compares_the_two_references_on_the_same_losses(tmp_path):
    """bench/preference_reference.py --quick: DPO steps with the reference forward in the step
    (adapter_off) and with precomputed log-probabilities; the same per-step losses (the reference
    is the same numbers either way), a precompute pass timed only for the precomputed variant,
    and the speed-up the ratio of the two medians."""
    proc = _run("preference_reference.py", "--quick", "--out", str(tmp_path))
    result = _only_json(tmp_path)
    assert result["benchmark"] == "preference-reference" and result["config"]["quick"] is True
    rows = result["rows"]
    assert set(rows) == {"adapter_off", "precomputed"}
    assert rows["adapter_off"]["precompute_s"] is None
    assert len(rows["precomputed"]["precompute_s"]) == 1 and rows["precomputed"]["precompute_s"][0] > 0
    assert result["max_rel_loss_diff"] < 1e-5
    assert math.isclose(
        result["speedup_cpu_precomputed_vs_adapter_off"],
        rows["adapter_off"]["cpu_s_per_step_median"] / rows["precomputed"]["cpu_s_per_step_median"],
    )
    assert "precomputed:" in proc.stdout


def test_host_path_quick_writes_one_row_per_global_batch(tmp_path):
    """bench/host_path.py --quick: rows of exactly the issue's keys, one per global batch; the
    before path (the old per-example copy) built the same batches as the array path (the script
    asserts it before timing), and no prefetch thread is left when it ends."""
    proc = _run("host_path.py", "--quick", "--out", str(tmp_path), timeout=120)
    result = _only_json(tmp_path)
    assert result["benchmark"] == "host-path" and result["config"]["quick"] is True
    assert [(r["seqs"], r["seq_len"]) for r in result["rows"]] == [(64, 64), (128, 128)]
    for r in result["rows"]:
        assert set(r) == {"seqs", "seq_len", "host_ms_before", "host_ms_after", "wait_ms"}
        assert r["host_ms_before"] > 0 and r["host_ms_after"] > 0 and r["wait_ms"] >= 0
    assert "2ff3d57" in result["before"] and "faithful copy" in result["before"]
    assert result["met"] == {"host_ms_after_at_512x2048": None, "wait_ms": None}  # not the goal's shape, compute
    assert result["config"]["ranks"] == 8 and result["threads_left"] == []
    for d in result["detail"]:
        assert d["wait_busy_compute"]["n"] == 3 and d["rank0_micro_batches"] * 8 * 8 == d["seqs"]
    assert "before ms" in proc.stdout


@pytest.mark.slow  # the compiled variant compiles for ~40 s
def test_cpu_loop_options_quick_compares_layouts_on_the_same_math(tmp_path):
    proc = _run("cpu_loop_options.py", "--quick", "--out", str(tmp_path), timeout=600)
    result = _only_json(tmp_path)
    assert result["benchmark"] == "cpu-loop-options"
    rows = result["rows"]
    assert set(rows) == {"padded+mask", "padded", "grouped", "packed", "packed+grouped", "grouped+compile"}
    for name, r in rows.items():
        assert r["cpu_s_per_step_median"] > 0 and r["real_tok_s_cpu"] > 0, name
        assert r["max_loss_diff_vs_padded"] < 1e-4, name  # same samples, same math, every layout
    # Layout facts, not timings: the mask changes nothing about what is computed; grouping
    # and packing compute fewer positions than plain padding on this ragged data.
    assert rows["padded+mask"]["computed_positions_per_step"] == rows["padded"]["computed_positions_per_step"]
    for name in ("grouped", "packed", "packed+grouped"):
        assert rows[name]["padding_fraction"] < rows["padded"]["padding_fraction"], name
    assert rows["grouped+compile"]["computed_positions_per_step"] == rows["grouped"]["computed_positions_per_step"]
    assert "padded+mask" in proc.stdout


@pytest.mark.slow  # the dry run of every phase, ~3-6 minutes on 2 shared cores
@pytest.mark.timeout(1300)
def test_gpu_all_runs_every_gpu_phase_in_one_call(tmp_path):
    """bench/gpu_all.sh is the one command a lent GPU gets: its dry run must leave, per phase, a
    result file in its own folder, plus the log and the versions it ran with. It is also CI's one
    dry run of each GPU script: bench/gpu_compare.py's main phase is checked in full
    (_check_gpu_compare_dry_run), with two out-of-memory failures simulated."""
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_all.sh"), str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1300,
        env={**os.environ, "PYTHON": sys.executable, "DRY_RUN": "1", "GPU_COMPARE_FAKE_OOM": "hf:8:0,rayft:8:0"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"all.log", "main", "tests", "memory", "dpo", "qlora", "levers"}
    log = (tmp_path / "all.log").read_text()
    assert "peft" in log and "transformers" in log  # the versions it ran with
    # the GPU oracles' pipeline: pytest on tests/gpu/test_gpu.py (one test, on CPU here), a JUnit file
    junit = (tmp_path / "tests" / "junit.xml").read_text()
    assert 'tests="1"' in junit and 'failures="0"' in junit and 'skipped="0"' in junit, junit[:300]
    # at most 8 files: what one device call brings back
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8
    (memory_file,) = (tmp_path / "memory").glob("memory-*-cpu.json")
    assert all(r["status"] == "ok" for r in json.loads(memory_file.read_text())["rows"])
    _check_gpu_compare_dry_run(sorted((tmp_path / "main").glob("*.json")), proc.stdout)
    # DPO through rayft's own loop: pairs of two rows of `seq` input tokens, half the SFT rows'
    # global batch in pairs (the same tokens per step), its configuration from the preference
    # estimate (the reference forward included) within the budget
    (dpo,) = json.loads(_only_file(tmp_path / "dpo").read_text())["rows"]
    assert dpo["loop"] == "rayft-dpo" and dpo["status"] == "ok" and dpo["objective"] == "dpo", dpo
    assert dpo["global_batch_size"] == 4 and dpo["tokens_per_step"] == 4 * 2 * dpo["seq_len"]
    assert dpo["micro_batch_size"] * dpo["grad_accum_steps"] == 4
    assert 0 < dpo["estimate_spec_gib"] <= dpo["budget_gib"] and dpo["tok_s"] > 0
    assert dpo["final_loss"] == pytest.approx(math.log(2), abs=0.05)  # DPO starts at log 2
    (qlora,) = json.loads(_only_file(tmp_path / "qlora").read_text())["rows"]
    assert qlora["loop"] == "rayft-qlora" and qlora["status"] == "ok" and qlora["quantization"] == "nf4"
    # Liger's kernels are Triton's: on this CPU machine the rows say why they did not run, and
    # the phase still passes; on the GPU they ran (bench/results/gpu-2026-12-04-nvidia-h200/).
    levers = json.loads(_only_file(tmp_path / "levers").read_text())["rows"]
    assert [r["loop"] for r in levers] == ["rayft-ragged", "rayft-ragged-packed", "rayft-liger", "hf-liger"]
    # ragged data, padded and packed: the same sequences, so the same input tokens per step
    # (tok/s counts them, not the padding), and packing on only where asked
    ragged, packed = levers[0], levers[1]
    assert ragged["status"] == packed["status"] == "ok" and ragged["ragged"] and packed["ragged"]
    assert (ragged["packing"], packed["packing"]) == (False, True) and ragged["tok_s"] > 0 and packed["tok_s"] > 0
    assert ragged["real_tokens"] == packed["real_tokens"] and len(ragged["real_tokens"]) == ragged["timed_steps"]
    assert len(set(ragged["real_tokens"])) > 1  # lengths vary from step to step
    levers = levers[2:]
    if importlib.util.find_spec("liger_kernel") is None:
        assert all(r["status"].startswith("skipped: liger-kernel is not installed") for r in levers)
    assert "failed phases: 0" in proc.stdout
    for phase in ("main", "tests", "memory", "dpo", "qlora", "levers"):
        assert f"== {phase}: exit 0" in log, phase


def _only_file(folder: Path) -> Path:
    (path,) = folder.glob("*.json")
    return path


def test_gpu_compare_refuses_an_unknown_loop_in_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_compare.py"),
            "--dry-run",
            "--out",
            str(tmp_path),
            "--loops",
            "rayft,hf-fast",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--loops: unknown ['hf-fast']" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_ci_cpu_names_each_process_by_what_its_command_line_says():
    ci_cpu = load_bench("ci_cpu")
    kind_of, newer_kind = ci_cpu.kind_of, ci_cpu.newer_kind
    py = "/r/.venv/bin/python"
    assert kind_of("ray::TrainController.run", "ray::TrainCon") == "ray::TrainController"
    assert kind_of(f"{py} -u -c import sys;exec(eval(sys.stdin.readline()))", "python") == "pytest xdist worker"
    # a rayft command whose spec lies in a pytest temporary folder is rayft's, not pytest's
    assert kind_of(f"{py} /r/.venv/bin/rayft run /tmp/pytest-of-root/p0/t0/spec.yaml", "rayft") == "rayft run"
    assert kind_of(f"{py} -m pytest -q tests/gpu", "python") == "pytest"
    assert kind_of(f"{py} /r/.venv/lib/python3.11/site-packages/ray/_private/log_monitor.py", "python") == (
        "ray log_monitor"
    )
    assert kind_of("", "kdamond.0") == "kernel: kdamond.0"
    assert kind_of("/usr/bin/sleep 1", "sleep") == "other: sleep"
    fork = kind_of(f"{py} -B -c from multiprocessing.forkserver import main; main(8, 9)", "python")
    module = kind_of(f"ray-dashboard-NodeHead-0 ({py} -B -c from multiprocessing.forkserver import main)", "x")
    assert (fork, module) == ("ray dashboard forkserver", "ray dashboard module")
    assert newer_kind(fork, module) == module  # a module forked from the forkserver is counted as the module
    assert newer_kind("ray worker (starting)", "ray::IDLE") == "ray::IDLE"
    assert newer_kind("ray::TrainController", "ray::IDLE") == "ray::TrainController"  # the actor it ran
    assert newer_kind("ray log_monitor", "kernel: python") == "ray log_monitor"  # ended: no command line


def test_ci_cpu_counts_only_the_commands_processes_by_kind_and_keeps_the_exit_code(tmp_path):
    """A grandchild that spends about 1 CPU-second in a script named like Ray's log monitor is counted
    under that kind, also after its parent has exited (the script is the orphans' subreaper); a
    process that is not the command's (this test's own) is not; the command's exit code (3) is the
    script's and is in the result file."""
    burner = tmp_path / "log_monitor.py"
    done = tmp_path / "done"
    burner.write_text(
        "import pathlib, time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n"
        f"pathlib.Path({str(done)!r}).touch()\n"
    )
    # the command's python starts the burner and exits at once, so the burner is an orphan for its
    # whole second; the command (bash) ends once the burner has burnt it
    parent = f"import subprocess, sys; subprocess.Popen([sys.executable, {str(burner)!r}]); sys.exit(3)"
    wait = f"while [ ! -e {shlex.quote(str(done))} ]; do sleep 0.05; done"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ci_cpu.py"), "--out", str(tmp_path / "out"), "--period-s", "0.1"]
        + ["--", "bash", "-c", f"{sys.executable} -c {shlex.quote(parent)}; rc=$?; {wait}; exit $rc"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    result = _only_json(tmp_path / "out")
    assert result["benchmark"] == "ci-cpu" and result["exit_code"] == 3
    counted = result["kinds"]["ray log_monitor"]
    assert counted["processes"] == 1 and 0.9 <= counted["cpu_s"] <= result["cpu_s_total"], result
    assert "pytest xdist worker" not in result["kinds"] and "pytest" not in result["kinds"], result
    assert "ray log_monitor" in proc.stdout


@pytest.mark.parametrize(
    "args,says",
    [
        (["--period-s", "0", "--", "true"], "--period-s must be above 0 seconds, got 0.0"),
        (["--", "/nonexistent/command"], "ci_cpu: cannot start '/nonexistent/command': No such file or directory"),
    ],
)
def test_ci_cpu_refuses_a_bad_argument_in_one_line_exit_2(tmp_path, args, says):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ci_cpu.py"), "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # no result file
