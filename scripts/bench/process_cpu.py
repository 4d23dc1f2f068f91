"""Where a command's CPU goes, by process: runs the command, reads its processes' CPU times from /proc each interval
while it runs, and prints the CPU-seconds of the command and every process it started, grouped by kind (Triton's
stubs by model, tritonserver, pytest's workers, the tiny models' exports, the OpenAI front, ...). Linux only.

    python -m scripts.bench.process_cpu -- make test
    python -m scripts.bench.process_cpu --interval 0.5 -- make test PYTEST_ARGS='-m "not server"'

A process is read last at the sample before it exits, so each loses up to one interval of its CPU time, and a process
that lives less than an interval may be missed (and with it, children it left running): the totals are lower
bounds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

from scripts.launcher.processes import stat_fields

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# (what the command line contains, the kind), the first that matches
KINDS = [
    ("bin/tritonserver", "tritonserver"),
    ("exec(eval(sys.stdin", "pytest's workers (in-process tests)"),
    ("import json, sys, traceback", "the tiny models' exports (tests.helpers.export_tinies)"),
    ("scripts.launcher.openai_server", "the OpenAI front"),
    ("scripts.prepare.quantize", "quantize runs"),
    ("scripts.prepare.export_onnx", "export runs"),
    ("ray::", "Ray"),
    ("/ray/", "Ray"),
    (".venv-eval", "lm-eval and PEFT (.venv-eval)"),
    (".venv-clients", "client libraries (.venv-clients)"),
    ("locust", "locust"),
]


def kind_of(command_line: str) -> str:
    words = command_line.split()
    if "triton_python_backend_stub" in command_line:
        model = Path(words[1]).parent.parent.name if len(words) > 1 else "?"
        return f"Python stubs of `{model}`"
    return next((kind for part, kind in KINDS if part in command_line), "other")


def snapshot() -> dict[tuple[int, int], tuple[int, str, float]]:
    """(pid, start time) -> (parent pid, command line, CPU-seconds so far) of every process readable now."""
    seen = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = stat_fields(Path(f"/proc/{pid}/stat").read_text())
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        parent, user, system, start = int(fields[1]), int(fields[11]), int(fields[12]), int(fields[19])
        seen[(int(pid), start)] = (parent, command.strip(), (user + system) / TICKS_PER_S)
    return seen


def sample(command: list[str], interval_s: float) -> tuple[int, float, dict[tuple[int, int], tuple[str, float]]]:
    """Runs the command; returns its exit status, its wall time and the last reading of the command's process and of
    every process it started (a process whose parent was one of them when it was first seen)."""
    started = time.monotonic()
    process = subprocess.Popen(command)
    last: dict[tuple[int, int], tuple[str, float]] = {}
    while process.poll() is None:
        readings = snapshot()
        live = {pid: (pid, start) for pid, start in readings}
        for key, (parent, line, cpu) in sorted(readings.items(), key=lambda item: item[0][1]):  # parents first
            if key in last or key[0] == process.pid or live.get(parent) in last:
                last[key] = (line or last.get(key, ("", 0.0))[0], cpu)
        time.sleep(interval_s)
    return process.returncode, time.monotonic() - started, last


def by_kind(processes: dict[tuple[int, int], tuple[str, float]]) -> list[tuple[str, float, int]]:
    cpu, count = Counter(), Counter()
    for line, seconds in processes.values():
        kind = kind_of(line)
        cpu[kind] += seconds
        count[kind] += 1
    return [(kind, seconds, count[kind]) for kind, seconds in cpu.most_common()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between readings (default: 1)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the command to run after --")
    status, wall, processes = sample(command, args.interval)
    rows = by_kind(processes)
    total = sum(seconds for _, seconds, _ in rows)
    print(f"\n{' '.join(command)}: exit {status}, {wall:.0f} s; {total:.0f} CPU-s in the {len(processes)} processes "
          "it started")
    print("| processes | CPU-s | how many |\n| --- | --- | --- |")
    for kind, seconds, count in rows:
        print(f"| {kind} | {seconds:.1f} | {count} |")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
