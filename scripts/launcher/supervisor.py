"""Keeps a tritonserver serving: readiness that sees dead model processes, and recovery without a person.

Triton's own ``/v2/health/ready`` keeps answering 200 after a Python model's process dies, and Triton restarts no
decoupled model by itself. The supervisor runs tritonserver in explicit model-control mode and reads the heartbeats
the models write (python_backend/serving/heartbeat.py) every ``check_interval_s``:

- the ``llm`` model's process died or its engine stalled: reload ``llm`` through Triton's repository API (a new
  process; a stalled one is killed first; the front model fails the requests that were in flight when it sees the
  process gone);
- a front model's process died, the llm reload failed, or tritonserver exited: restart tritonserver (measured: the
  requests in flight through a dead front process never end, and reloading it does not end them; a restart closes
  their connections; the stopped server's leftover stub processes and shared memory are removed);
- the OpenAI-compatible API's process (when the supervisor keeps one, as `make serve` does) exited: start it again
  (its Batch API resumes the batches it was running from its store).

``GET /health/ready`` on ``health_port`` answers 200 only while tritonserver is ready, every model process is
alive and making progress, and the OpenAI API (when kept) answers, else 503; ``GET /health/live`` answers 200 while
the supervisor runs; both return JSON with each instance's state and the recoveries so far."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from python_backend.serving.heartbeat import STALE_S, STALL_S, InstanceHealth, process_alive, read_health, runtime_dir
from scripts.launcher.model_control import reload_llm
from scripts.launcher.processes import remove_regions, stop, stub_regions, terminate

API_STOP_S = 10  # SIGTERM, then SIGKILL: uvicorn gives open streams a few seconds
MAX_API_BACKOFF_S = 60
LOAD_FAILURE_GRACE_S = 5.0  # how long a failed load's server is given to show it was exiting
RELOADABLE = "llm"  # the one model whose death the front model survives (it fails its requests itself)


@dataclass
class Recovery:
    reason: str
    action: str  # "reload llm", "restart tritonserver" or "restart the OpenAI API"
    started: float
    took_s: float | None = None
    ok: bool | None = None
    error: str | None = None  # why the action failed, when it did (then a tritonserver restart followed, or none)


def python_models(model_repository: Path) -> list[str]:
    """The repository's Python-backend models: each writes a heartbeat."""
    return sorted(path.parent.name for path in model_repository.glob("*/config.pbtxt")
                  if 'backend: "python"' in path.read_text())


@dataclass
class Supervisor:
    start_server: Callable[[], subprocess.Popen]  # starts tritonserver in explicit mode with every model loaded
    http_url: str  # host:port of tritonserver's HTTP endpoint
    models: list[str]
    check_interval_s: float = 0.5
    ready_timeout_s: float = 300.0
    recovery_timeout_s: float = 60.0
    stale_s: float = STALE_S  # heartbeat.py says what they mean
    stall_s: float = STALL_S
    restart_grace_s: float = 3.0  # SIGTERM, then SIGKILL after this long
    log: Callable[[str], None] = lambda line: print(f"[supervisor] {line}", flush=True)
    recoveries: list[Recovery] = field(default_factory=list)
    start_api: Callable[[], subprocess.Popen] | None = None  # the OpenAI-compatible API, kept running beside it
    api_url: str | None = None  # host:port of that API (its /health/live says it answers)

    def __post_init__(self):
        self.process: subprocess.Popen | None = None
        self._heartbeat_dir: Path | None = None
        # Each model process's shared-memory regions, read while it runs: Triton leaves a killed stub's region in
        # /dev/shm (1 MB or more each time), and once the process is gone its command line no longer names it.
        # Filled by whoever reads the instances (the health endpoint's threads too), hence its own lock.
        self._stub_regions: dict[int, list[str]] = {}
        self._regions_lock = threading.Lock()
        self.api: subprocess.Popen | None = None
        self._api_failures = 0  # restarts of the API in a row that failed: the next waits 2^n s (at most a minute)
        self._api_retry_at = 0.0
        self._stopping = threading.Event()
        self._recovering = False
        self._lock = threading.Lock()

    # --- state ---

    def heartbeat_dir(self) -> Path | None:
        """The current server's folder, named when it was started (its pid alone may come round again)."""
        return self._heartbeat_dir

    def instances(self) -> list[InstanceHealth]:
        folder = self.heartbeat_dir()
        if folder is None or not folder.is_dir():
            return []
        instances = read_health(folder, stale_s=self.stale_s, stall_s=self.stall_s)
        with self._regions_lock:
            for h in instances:
                if h.ok and h.pid not in self._stub_regions:
                    self._stub_regions[h.pid] = stub_regions(h.pid)
        return instances

    def server_ready(self) -> bool:
        return _runs_and_answers(self.process, f"http://{self.http_url}/v2/health/ready")

    def api_answers(self) -> bool:
        """Whether the kept OpenAI API's process runs and answers (True when none is kept)."""
        return self.start_api is None or _runs_and_answers(self.api, f"http://{self.api_url}/health/live")

    def health(self) -> dict:
        instances = self.instances()
        missing = [m for m in self.models if not any(_model_of(h.instance) == m for h in instances)]
        server_ready, api_ready = self.server_ready(), self.api_answers()
        ready = server_ready and api_ready and not self._recovering and not missing and all(h.ok for h in instances)
        return {
            "ready": ready,
            "server_ready": server_ready,
            "api_ready": api_ready,
            "recovering": self._recovering,
            "server_pid": self.process.pid if self.process else None,
            "api_pid": self.api.pid if self.api else None,
            "instances": {h.instance: {"pid": h.pid, "state": h.state, "reason": h.reason} for h in instances},
            "missing_models": missing,
            "recoveries": [asdict(r) for r in self.recoveries],
        }

    # --- actions ---

    def start(self) -> None:
        with self._lock:  # a stop() that comes meanwhile waits for the process to exist, then stops it
            if self._stopping.is_set():
                return
            if self.start_api is not None:
                self.api = self.start_api()  # it waits for no server: it starts while tritonserver loads
            self._start_server()
        self._wait_ready(self.ready_timeout_s)

    def stop(self) -> int:
        self._stopping.set()
        with self._lock:
            if self.api is not None and self.api.poll() is None:
                terminate(self.api, API_STOP_S)
            code = _stop_process(self.process) if self.process else 0
            self._clean_up_after_server()
            return code

    def check(self) -> None:
        """One look; recovers what it finds broken."""
        with self._lock:
            if self._stopping.is_set():
                return
            if self.process.poll() is not None:
                self._recover(f"tritonserver exited with code {self.process.returncode}", "restart tritonserver",
                              self._restart)
                return
            if self.api is not None and self.api.poll() is not None:
                if time.monotonic() >= self._api_retry_at:  # an API that cannot start is not started every look
                    self._recover(f"the OpenAI API exited with code {self.api.returncode}", "restart the OpenAI API",
                                  self._restart_api, restart_if_it_fails=False)
                return
            bad = [h for h in self.instances() if not h.ok]
            if not bad:
                return
            reason = "; ".join(f"{h.instance} {h.state}: {h.reason}" for h in bad)
            if all(_model_of(h.instance) == RELOADABLE for h in bad):
                self._recover(reason, "reload llm", self._reload_llm)
            else:
                self._recover(reason, "restart tritonserver", self._restart)

    def run(self) -> None:
        while not self._stopping.wait(self.check_interval_s):
            try:
                self.check()
            except Exception as error:  # noqa: BLE001 - the supervisor must outlive one failed check
                self.log(f"check failed: {type(error).__name__}: {error}")

    def _recover(self, reason: str, name: str, action: Callable[[], None], restart_if_it_fails: bool = True) -> None:
        """action; when it fails, a tritonserver restart, or nothing (the next look tries again)."""
        recovery = Recovery(reason, name, time.time())
        self.recoveries.append(recovery)
        self._recovering = True
        self.log(f"{reason}: {name}")
        try:
            action()
            recovery.ok = True
        except Exception as error:  # noqa: BLE001
            recovery.error = f"{type(error).__name__}: {error}"
            if not restart_if_it_fails:
                self.log(f"{name} failed ({type(error).__name__}: {error})")
                recovery.ok = False
                return
            self.log(f"{name} failed ({type(error).__name__}: {error}); restarting tritonserver")
            recovery.action = f"{name}, then restart tritonserver"
            self._restart()
            recovery.ok = True
        finally:
            recovery.took_s = round(time.time() - recovery.started, 2)
            self._recovering = False
        self.log(f"recovered in {recovery.took_s} s ({recovery.action})")

    def _reload_llm(self) -> None:
        dead = {h.pid for h in self.instances() if _model_of(h.instance) == RELOADABLE}
        for pid in dead:
            # A stalled process is killed first: it would go on writing the heartbeat file that the new one writes,
            # and the front model fails its requests in flight when it sees the process gone (before the reload
            # ends: loading a model takes seconds, the front looks every 0.25 s).
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
            with self._regions_lock:
                remove_regions(self._stub_regions.pop(pid, []))
        # A load of an unchanged model is a no-op in Triton: a changed parameter makes it a real reload. It runs on a
        # thread of its own while the server is watched: a tritonserver that dies during the load (seen: Triton's
        # Python backend aborting on a lock the killed stub held) never answers it. The load is given as long as a
        # server's start (a big model, a busy machine), the new instance's first heartbeats as long as a recovery.
        load = _in_background(lambda: reload_llm(self.http_url, timeout_s=self.ready_timeout_s,
                                                 supervisor_generation=len(self.recoveries)))
        deadline = time.monotonic() + self.ready_timeout_s + self.recovery_timeout_s
        while time.monotonic() < deadline:
            if problem := self._server_problem():
                raise RuntimeError(f"{problem} while llm was reloaded")
            if load.done():
                if load.exception() is not None and _exits_within(self.process, LOAD_FAILURE_GRACE_S):
                    # A dying server drops the load's connection before it has exited (an abort writes its core).
                    raise RuntimeError(f"tritonserver exited with code {self.process.returncode} while llm was "
                                       f"reloaded ({load.exception()})")
                load.result()  # the load's own error, if it failed
                llm = [h for h in self.instances() if _model_of(h.instance) == RELOADABLE]
                if llm and all(h.ok and h.pid not in dead for h in llm) and self.server_ready():
                    return
            time.sleep(0.1)
        raise TimeoutError(f"llm was not serving again within {self.ready_timeout_s + self.recovery_timeout_s:.0f} s")

    def _server_problem(self) -> str | None:
        """What a reload of llm cannot mend: tritonserver gone, or another model's process not ok."""
        if self.process.poll() is not None:
            return f"tritonserver exited with code {self.process.returncode}"
        others = [h for h in self.instances() if _model_of(h.instance) != RELOADABLE and not h.ok]
        return "; ".join(f"{h.instance} {h.state}: {h.reason}" for h in others) or None

    def _restart_api(self) -> None:
        self.api = self.start_api()
        deadline = time.monotonic() + self.recovery_timeout_s
        while not self.api_answers():
            problem = (f"the OpenAI API exited with code {self.api.returncode} as it started"
                       if self.api.poll() is not None else None)
            if problem is None and time.monotonic() > deadline:
                problem = f"the OpenAI API did not answer within {self.recovery_timeout_s:.0f} s"
                self.api.kill()  # the next look starts another
            if problem:
                self._api_failures += 1
                self._api_retry_at = time.monotonic() + min(2 ** self._api_failures, MAX_API_BACKOFF_S)
                raise RuntimeError(problem)
            time.sleep(0.1)
        self._api_failures = 0

    def _restart(self) -> None:
        if self.process is not None:
            # Short grace: requests through a dead process never finish, and a graceful stop would wait on them.
            _stop_process(self.process, timeout_s=self.restart_grace_s)
            self._clean_up_after_server()
        self._start_server()
        self._wait_ready(self.ready_timeout_s)

    def _clean_up_after_server(self) -> None:
        """The stopped server's dead processes' regions (stop() removes the running ones') and its heartbeat folder
        (stop() cannot name it once the server has been reaped)."""
        with self._regions_lock:
            remove_regions([region for regions in self._stub_regions.values() for region in regions])
            self._stub_regions.clear()
        if self._heartbeat_dir is not None:
            shutil.rmtree(self._heartbeat_dir, ignore_errors=True)

    def _start_server(self) -> None:
        self.process = self.start_server()
        self._heartbeat_dir = runtime_dir(self.process.pid)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._stopping.is_set():  # stop() sets this before it signals the server: an expected exit
                    return
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready")
            if self.server_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver was not ready within {timeout_s:.0f} s")


def _exits_within(process: subprocess.Popen, timeout_s: float) -> bool:
    try:
        process.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def _in_background(call: Callable[[], object]) -> Future:
    """call() on a daemon thread (one that hangs is left behind, not waited on); its result or error in the Future."""
    future: Future = Future()

    def run():
        try:
            future.set_result(call())
        except BaseException as error:  # noqa: BLE001 - handed to whoever reads the Future
            future.set_exception(error)

    threading.Thread(target=run, name="background", daemon=True).start()
    return future


def _runs_and_answers(process: subprocess.Popen | None, url: str) -> bool:
    """Whether the process is running and the URL answers 200."""
    if process is None or process.poll() is not None:
        return False
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _model_of(instance: str) -> str:
    """llm_0_0 -> llm (Triton names instances <model>_<group>_<index>)."""
    return instance.rsplit("_", 2)[0]


def _stop_process(process: subprocess.Popen, timeout_s: float = 20) -> int:
    stop(process, timeout_s)
    return process.returncode


def health_metrics(state: dict) -> bytes:
    """The supervisor's view in Prometheus' text format, for alerts on what Triton's own metrics cannot show (a dead
    model process leaves Triton's /metrics answering)."""

    class HealthCollector:
        def collect(self):
            yield GaugeMetricFamily("triton_llm_ready", "1 while tritonserver is ready and every model process is "
                                    "alive and making progress (what /health/ready answers 200 for)",
                                    value=state["ready"])
            yield GaugeMetricFamily("triton_llm_recovering", "1 while the supervisor reloads a model or restarts "
                                    "tritonserver", value=state["recovering"])
            yield CounterMetricFamily("triton_llm_recoveries", "Reloads and restarts so far",
                                      value=len(state["recoveries"]))

    registry = CollectorRegistry()
    registry.register(HealthCollector())
    return generate_latest(registry)


def serve_health(supervisor: Supervisor, address: str, port: int) -> ThreadingHTTPServer:
    """GET /health/ready (200 or 503) and /health/live (200), each with the supervisor's JSON, and /metrics (the
    same in Prometheus' format), on a thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the name http.server calls
            if self.path == "/metrics":
                self._send(200, "text/plain; version=0.0.4", health_metrics(supervisor.health()))
                return
            if self.path not in ("/health/ready", "/health/live", "/health"):
                self.send_error(404, "try /health/ready, /health/live or /metrics")
                return
            state = supervisor.health()
            status = 200 if self.path != "/health/ready" or state["ready"] else 503
            self._send(status, "application/json", json.dumps(state).encode())

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # probes every few seconds: keep the log for events
            pass

    server = ThreadingHTTPServer((address, port), Handler)
    threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
    return server
