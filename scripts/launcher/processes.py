"""Processes the launcher starts: free loopback ports, stopping a server with the Python stubs it leaves behind, and
finding a stub that died (and what its server's log says of it)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from python_backend.serving.heartbeat import runtime_dir

SHM_REGION_PREFIX = b"triton_python_backend_shm_region"
# Free ports are picked at random from here up to the kernel's ephemeral range, from which bind(0) and every outgoing
# connection take theirs: a port found free there and released may be taken by another process before the server
# binds it (seen once in CI, 2026-12-07: tritonserver's "Socket '127.0.0.1:46873' already in use", a shared server of
# the suite lost). Below the range only another pick can take it; from 20000 up, above Ray's worker ports (10002-19999).
PICKED_PORTS_FROM = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_picks = random.SystemRandom()  # not the random module's state, which a test or a seeded caller may have fixed


def ephemeral_ports_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_loopback_port() -> int:
    """A loopback port nothing listens on, below the ephemeral range; the kernel's own choice where no room is left
    below it (the range set to start low)."""
    start = ephemeral_ports_start()
    for _ in range(1000 if start - PICKED_PORTS_FROM >= 1000 else 0):
        port = _picks.randrange(PICKED_PORTS_FROM, start)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> "Ports":
        ports: list[int] = []
        while len(ports) < 3:  # a port drawn twice is drawn again
            if (port := free_loopback_port()) not in ports:
                ports.append(port)
        return cls(*ports)


def stop(process: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM, then SIGKILL after timeout_s; then the Python stubs that name this server (and their shared memory)
    are removed, and its runtime folder (heartbeats, cancel sockets). A killed tritonserver's stubs see it gone within
    a second and exit, but a stub whose own thread is stuck does not (seen: an orphaned llm stub holding 600 MB, and
    after test runs an llm stub whose server had exited), and nor does one listed by its parent only, once that
    parent has died."""
    # The folder is named by the process's start time, readable until it is reaped (after that its pid may be
    # another process's: a server reaped before this leaves its folder).
    folder = runtime_dir(process.pid) if process.returncode is None else None
    if process.poll() is None:
        stubs = stub_processes(process.pid)
        terminate(process, timeout_s)
    else:
        stubs = {}
    stubs |= stub_processes(process.pid)
    for pid, regions in stubs.items():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        remove_regions(regions)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def terminate(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after timeout_s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stub_processes(server_pid: int) -> dict[int, list[str]]:
    """A server's Python stub processes -> their shared-memory regions. A stub is the server's child, or, once the
    server is gone, names it: its command line is the model file, its region, two sizes, then the server's pid."""
    stubs = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            status = (cmdline.parent / "status").read_text()
        except OSError:
            continue
        if not (args and args[0].endswith(b"triton_python_backend_stub")) or "State:\tZ" in status:
            continue
        regions = [i for i, a in enumerate(args) if a.startswith(SHM_REGION_PREFIX)]
        parent = next((line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "")
        names_server = bool(regions) and len(args) > regions[0] + 3 and args[regions[0] + 3] == str(server_pid).encode()
        if parent == str(server_pid) or names_server:
            stubs[int(cmdline.parent.name)] = [args[i].decode() for i in regions]
    return stubs


def stub_regions(pid: int) -> list[str]:
    """The shared-memory regions a running stub names on its command line (none once it is gone: read it before)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []
    return [a.decode() for a in args if a.startswith(SHM_REGION_PREFIX)]


def remove_regions(regions: list[str]) -> None:
    """Unlinks these regions from /dev/shm: a process that still maps one keeps its memory until it unmaps it."""
    for region in regions:
        Path("/dev/shm", region).unlink(missing_ok=True)


def process_with_argument(argument: str) -> int | None:
    """The pid of a process with this argument on its command line (the first found), or None."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if argument.encode() in cmdline.read_bytes().split(b"\0"):
                return int(cmdline.parent.name)
        except OSError:
            continue
    return None


def stat_fields(stat: str) -> list[str]:
    """The fields of a /proc/<pid>/stat text after the command's name (which may hold spaces and parentheses): state,
    parent pid, ... (proc(5)'s fields from the third on)."""
    return stat.rsplit(")", 1)[1].split()


# glibc's fatal messages, which precede faulthandler's "Fatal Python error" in a server's log (LIBC_FATAL_STDERR_)
GLIBC_FATAL = ("malloc", "free(", "double free", "corrupted", "munmap_chunk", "realloc(")


def last_crash(log_text: str, max_lines: int = 40) -> str:
    """A server log's account of its last crashed stub: glibc's message, if any, then faulthandler's stacks (the
    crashing thread's first); empty when the log has none."""
    lines = log_text.splitlines()
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if not fatal:
        return ""
    start = fatal[-1] - 1 if fatal[-1] > 0 and lines[fatal[-1] - 1].startswith(GLIBC_FATAL) else fatal[-1]
    return "\n".join(lines[start:start + max_lines])


def zombie_children(pid: int) -> dict[int, str]:
    """The children of process pid that died unreaped -> how each ended (its status stays in /proc until reaped)."""
    return zombie_children_of([pid]).get(pid, {})


def zombie_children_of(pids) -> dict[int, dict[int, str]]:
    """zombie_children of each of these processes that has any, from one read of /proc."""
    parents = {str(pid) for pid in pids}
    zombies: dict[int, dict[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_fields(stat.read_text())
        except (OSError, ValueError):
            continue
        if fields[1] in parents and fields[0] == "Z":
            status = int(fields[-1])  # waitpid's status word
            zombies.setdefault(int(fields[1]), {})[int(stat.parent.name)] = (
                f"killed by signal {status & 0x7F}" if status & 0x7F else f"exited with code {status >> 8}")
    return zombies
