"""Liveness of the Python-backend model processes, seen from outside them.

Triton does not notice when a Python stub process dies: its own readiness endpoints keep answering 200, and
requests in flight through a dead stub never end. So each of this project's model instances writes a small
heartbeat file (its pid, the time, and the engine's progress for the llm model) every half second, into a folder
that belongs to one tritonserver process. The front model reads the llm model's heartbeat to fail its own requests
at once when the llm process is gone; the supervisor (scripts/launcher/supervisor.py) reads all of them for readiness
and recovery.

A process that is gone (or a zombie) is dead at once; a heartbeat that stopped for ``stale_s`` although the process
exists (stopped, or starved) and an engine that has work but made no progress for ``stall_s`` count as stalled."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from python_backend.serving.periodic import Periodic

RUNTIME_DIR_ENV = "TRITON_LLM_RUNTIME_DIR"
HEARTBEAT_INTERVAL_S = 0.5
# The thresholds every reader judges by (the supervisor and the front model alike), so that both call the same
# process stalled at the same time.
STALE_S = 10.0  # a heartbeat older than this, from a live process: stalled (stopped or starved)
STALL_S = 120.0  # an engine with work and no finished step for this long: stalled


def runtime_dir(server_pid: int | None = None) -> Path:
    """The heartbeat folder of one tritonserver. Inside a stub, the server is the parent process.

    Named by the server's pid and its start time: pids come round again (32768 of them here; a test run wraps), and a
    new server must not read the heartbeats an earlier one with its pid left behind."""
    pid = os.getppid() if server_pid is None else server_pid
    base = os.environ.get(RUNTIME_DIR_ENV) or tempfile.gettempdir()
    started = process_start_ticks(pid)
    return Path(base) / (f"triton-llm-{pid}" if started is None else f"triton-llm-{pid}-{started}")


def process_start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat's 22nd field); None if it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the 3rd (the state) on, after the command's name, which may hold spaces; None
    once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def process_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a killed stub stays a zombie until Triton reaps it)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


class Heartbeat:
    """Writes ``{instance}.json`` every interval from a thread of its own: {"pid", "time", **status()}."""

    def __init__(self, instance: str, status: Callable[[], dict] = dict, folder: Path | None = None,
                 interval_s: float = HEARTBEAT_INTERVAL_S):
        self.path = (folder or runtime_dir()) / f"{instance}.json"
        self.status = status
        self.started = time.time()
        self._writer = Periodic("heartbeat", interval_s, self.beat)

    def beat(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._replaced():
            return
        record = {"pid": os.getpid(), "time": time.time(), "started": self.started, **self.status()}
        temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(record))
        os.replace(temporary, self.path)  # readers never see half a file

    def _replaced(self) -> bool:
        """Whether a newer live process of the same instance name writes this file: a model reloaded by Triton
        starts the new version before it unloads the old one, whose last beats must not hide the new one's (the
        front would see the old process gone and fail the requests the new one serves)."""
        try:
            current = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        pid = int(current.get("pid", 0))
        return pid != os.getpid() and current.get("started", 0) > self.started and process_alive(pid)

    def start(self) -> None:
        self.beat()
        self._writer.start()

    def stop(self) -> None:
        self._writer.stop()


@dataclass(frozen=True)
class InstanceHealth:
    instance: str
    pid: int
    state: str  # "ok", "dead" or "stalled"
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.state == "ok"


def judge(instance: str, record: dict, now: float, stale_s: float, stall_s: float,
          alive: Callable[[int], bool] = process_alive) -> InstanceHealth:
    pid = int(record["pid"])
    if not alive(pid):
        return InstanceHealth(instance, pid, "dead", f"process {pid} is gone")
    if now - record["time"] > stale_s:
        return InstanceHealth(instance, pid, "stalled", f"no heartbeat for {now - record['time']:.0f} s")
    if record.get("engine_alive") is False:
        return InstanceHealth(instance, pid, "stalled", "the engine thread has stopped")
    progress = record.get("last_progress")
    if record.get("has_work") and progress is not None and now - progress > stall_s:
        return InstanceHealth(instance, pid, "stalled", f"the engine made no progress for {now - progress:.0f} s")
    return InstanceHealth(instance, pid, "ok")


def read_health(folder: Path, model: str | None = None, stale_s: float = STALE_S, stall_s: float = STALL_S,
                now: float | None = None) -> list[InstanceHealth]:
    """Health of every instance that wrote a heartbeat here (of one model: instance names start with it)."""
    now = time.time() if now is None else now
    health = []
    for path in sorted(folder.glob("*.json")):
        instance = path.stem
        if model is not None and not _instance_of(instance, model):
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced while read
        health.append(judge(instance, record, now, stale_s, stall_s))
    return health


def _instance_of(instance: str, model: str) -> bool:
    """Triton names instances <model>_<group>_<index>, e.g. llm_0_0."""
    prefix, _, rest = instance.rpartition("_")
    return rest.isdigit() and prefix.rpartition("_")[0] == model


class PeerLiveness:
    """Whether another model's processes are alive, for code that waits on them (cached for ``cache_s``).

    No heartbeat at all means unknown (not loaded yet, or run by another tool): treated as alive."""

    def __init__(self, model: str, folder: Path | None = None, cache_s: float = 0.25, stale_s: float = STALE_S,
                 stall_s: float = STALL_S):
        self.model, self.folder = model, folder or runtime_dir()
        self.cache_s, self.stale_s, self.stall_s = cache_s, stale_s, stall_s
        self._checked_at = 0.0
        self._problem: str | None = None
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        """None while every instance is ok; else why not. Only "ok" is cached: a problem is looked at again at
        every call, so that the first request after a recovery is not refused."""
        with self._lock:
            now = time.monotonic()
            if self._problem is not None or now - self._checked_at >= self.cache_s:
                bad = [h for h in read_health(self.folder, self.model, self.stale_s, self.stall_s) if not h.ok]
                self._problem = "; ".join(f"{h.instance}: {h.reason}" for h in bad) or None
                self._checked_at = now
            return self._problem
