"""Processes the launcher starts: free loopback ports, and stopping a server with the Python stubs it leaves behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> "Ports":
        sockets = [socket.socket() for _ in range(3)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        for s in sockets:
            s.close()
        return cls(*ports)


def stop(process: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM, then SIGKILL after timeout_s. A killed tritonserver can leave its Python stubs running (seen: an
    orphaned llm stub holding 600 MB) and their shared memory behind: both are removed."""
    if process.poll() is None:
        stubs = stub_processes(process.pid)
        terminate(process, timeout_s)
        for pid, regions in stubs.items():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            for region in regions:
                Path("/dev/shm", region).unlink(missing_ok=True)


def terminate(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after timeout_s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stub_processes(server_pid: int) -> dict[int, list[str]]:
    """A server's Python stub processes -> their shared-memory regions (each stub's command line names its own)."""
    stubs = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            status = (cmdline.parent / "status").read_text()
        except OSError:
            continue
        parent = next((line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "")
        if parent == str(server_pid) and args and args[0].endswith(b"triton_python_backend_stub"):
            stubs[int(cmdline.parent.name)] = [a.decode() for a in args
                                                if a.startswith(b"triton_python_backend_shm_region")]
    return stubs

