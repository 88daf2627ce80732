"""CPU time by kind of process while a command runs: where a test suite's (or any command's) CPU goes.

    python bench/ci_cpu.py --out bench/results -- bash .ci/run

Every `--period-s` it reads each process's user + system time from /proc, and the kind its command
line names: a Ray actor or task by its title (`ray::TrainController`), a Ray cluster process (raylet,
gcs_server, the dashboard, its modules and agent, the log monitor), rayft's commands, pytest and its
xdist workers, vLLM, the compiler inductor runs, pip, mypy. Only the command's own processes count:
its descendants (this script is their subreaper, so a daemon that outlives its parent, as Ray's
processes do, stays one of them, and is reaped here once it ends). A process that lives less than a
period can be missed. Linux only. Writes ci-cpu-<date>-<label>.json into --out (the command, its
exit code, its wall time, and per kind the CPU-seconds and the number of processes), prints the
table, and exits with the command's exit code."""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# (part of the first arguments, kind), the first match wins; Ray's titles (`ray::Name`) come before.
KINDS = (
    ("import sys;exec(eval(sys.stdin.readline()))", "pytest xdist worker"),
    ("-m pytest", "pytest"),
    ("bin/pytest", "pytest"),
    ("bin/rayft run", "rayft run"),
    ("bin/rayft tune", "rayft tune"),
    ("bin/rayft queue", "rayft queue"),
    ("bin/rayft", "rayft (other commands)"),
    ("jobs.finetune", "python -m jobs.finetune"),
    ("default_worker.py", "ray worker (starting)"),
    ("gcs_server", "ray gcs_server"),
    ("raylet", "ray raylet"),
    ("ray-dashboard-", "ray dashboard module"),
    ("multiprocessing.forkserver", "ray dashboard forkserver"),
    ("dashboard/dashboard.py", "ray dashboard"),
    ("dashboard/agent.py", "ray dashboard agent"),
    ("runtime_env/agent", "ray runtime_env agent"),
    ("log_monitor", "ray log_monitor"),
    ("ray.util.client.server", "ray client server"),
    ("bin/ray ", "ray cli"),
    ("vllm", "vllm"),
    ("cc1plus", "c++ compiler"),
    ("bin/mypy", "mypy"),
    (" -m pip", "pip"),
    ("bench/", "bench scripts"),
)


def kind_of(cmdline: str, comm: str) -> str:
    """The kind of a process from its command line (arguments joined by spaces) or, for a kernel
    thread (no command line), its name."""
    if not cmdline:
        return f"kernel: {comm}"
    first = cmdline.split()[0]
    if first.startswith("ray::"):
        return first.split(".")[0]
    head = " ".join(cmdline.split()[:6])
    for part, kind in KINDS:
        if part in head:
            return kind
    return f"other: {Path(first).name}"


def read_processes() -> dict[tuple[int, str], tuple[str, float, int]]:
    """(pid, start time) -> (kind, CPU-seconds so far, parent pid) of every process /proc shows now."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # it ended between listdir and the read
        comm, fields = stat.split("(", 1)[1].rsplit(")", 1)
        values = fields.split()
        cpu_s = (int(values[11]) + int(values[12])) / ticks
        out[(int(pid), values[19])] = (kind_of(cmdline, comm), cpu_s, int(values[1]))
    return out


def descendants(processes: dict[tuple[int, str], tuple[str, float, int]], root: int) -> set[tuple[int, str]]:
    """The keys of `processes` whose chain of parents reaches `root`."""
    parent = {pid: ppid for (pid, _), (_, _, ppid) in processes.items()}

    def under_root(pid: int) -> bool:
        for _ in range(len(parent) + 1):  # a chain is never longer than the table
            pid = parent.get(pid, 0)
            if pid == root:
                return True
            if pid <= 1:
                return False
        return False

    return {key for key in processes if under_root(key[0])}


def become_subreaper() -> None:
    """Orphaned descendants are reparented to this process instead of init (prctl
    PR_SET_CHILD_SUBREAPER), so they stay in its tree."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def newer_kind(old: str, new: str) -> str:
    """What a process seen as `old` and now as `new` counts as: what it shows now (a Ray worker takes
    its actor's title, a dashboard module forked from the forkserver its own), except Ray's idle
    title after an actor's or task's (it is counted as what it ran) and an empty command line (a
    process that has ended shows none: it stays what it was)."""
    if (new == "ray::IDLE" and old.startswith("ray::")) or new.startswith("kernel: "):
        return old
    return new


class Tally:
    """Each descendant's kind (`newer_kind`) and the CPU it spent so far."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, str], tuple[str, float]] = {}

    def sample(self) -> None:
        processes = read_processes()
        for key in descendants(processes, os.getpid()):
            kind, cpu, _ = processes[key]
            old = self.seen.get(key)
            self.seen[key] = (newer_kind(old[0], kind) if old else kind, cpu)

    def by_kind(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for kind, cpu in self.seen.values():
            if cpu > 0:
                row = out.setdefault(kind, {"cpu_s": 0.0, "processes": 0})
                row["cpu_s"] += cpu
                row["processes"] += 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu_s"]))


def reap_orphans(keep: int, tally: Tally) -> None:
    """Reap the descendants that ended after being reparented here (init would have), all but `keep`
    (the command, which Popen waits for); `tally` reads their final CPU first."""
    sampled = False
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == keep:
            return
        if not sampled:
            tally.sample()
            sampled = True
        os.waitpid(info.si_pid, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the result file")
    ap.add_argument("--label", default="run", help="the result file's name: ci-cpu-<date>-<label>.json")
    ap.add_argument("--period-s", type=float, default=1.0, help="seconds between two reads of /proc")
    ap.add_argument("command", nargs="+", help="the command to run, after --")
    args = ap.parse_args(argv)
    if not args.period_s > 0:
        ap.error(f"--period-s must be above 0 seconds, got {args.period_s}")
    become_subreaper()
    tally, start = Tally(), time.monotonic()
    try:
        proc = subprocess.Popen(args.command)
    except OSError as e:
        print(f"ci_cpu: cannot start {args.command[0]!r}: {e.strerror}", file=sys.stderr)
        return 2
    while proc.poll() is None:
        tally.sample()
        reap_orphans(proc.pid, tally)
        time.sleep(args.period_s)
    tally.sample()
    wall_s, kinds = time.monotonic() - start, tally.by_kind()
    result = {
        "benchmark": "ci-cpu",
        "label": args.label,
        "command": args.command,
        "exit_code": proc.returncode,
        "wall_s": round(wall_s, 1),
        "period_s": args.period_s,
        "cpu_s_total": round(sum(r["cpu_s"] for r in kinds.values()), 2),
        "kinds": {k: {"cpu_s": round(r["cpu_s"], 2), "processes": r["processes"]} for k, r in kinds.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ci-cpu-{datetime.date.today().isoformat()}-{args.label}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['cpu_s_total']:9.1f} CPU-s in {result['wall_s']} s, all kinds  ({path})")
    for kind, row in result["kinds"].items():
        print(f"{row['cpu_s']:9.1f} {row['processes']:5d}  {kind}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
