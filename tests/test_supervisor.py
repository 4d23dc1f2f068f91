"""The supervisor's start/stop without a real server (a stand-in process): a stop that comes while the server is
still starting is an orderly stop, not a failure, and leaves no process behind. The serve command runs the
OpenAI-compatible API beside the server, pointed at it, and stops it with the server."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from scripts.launcher.supervisor import Supervisor, python_models
from scripts.launcher.processes import Ports
from scripts.launcher.triton_server import build_parser, openai_command
from scripts.paths import MODEL_REPOSITORY, PROJECT_ROOT


def stand_in(started: list):
    def start():
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        started.append(process)
        return process

    return start


def test_a_stop_during_start_is_orderly_and_stops_the_process():
    started, errors = [], []
    supervisor = Supervisor(stand_in(started), f"127.0.0.1:{Ports.free().http}", ["llm"], ready_timeout_s=120)

    def run():
        try:
            supervisor.start()
        except Exception as error:  # noqa: BLE001 - the test looks at it
            errors.append(error)

    runner = threading.Thread(target=run)
    runner.start()
    while not started:  # the stand-in is running, never ready (nothing answers its health URL)
        runner.join(0.05)
    supervisor.stop()
    runner.join(60)
    assert not runner.is_alive() and errors == []
    assert started[0].poll() is not None, "the process was stopped"


def test_a_stop_before_start_starts_nothing():
    started = []
    supervisor = Supervisor(stand_in(started), "127.0.0.1:9", ["llm"])
    supervisor.stop()
    supervisor.start()
    assert started == []


def test_the_python_models_of_the_repository_are_watched():
    assert python_models(MODEL_REPOSITORY) == ["ensemble", "ensemble_unary", "llm"]


def stand_in_api(tmp_path, port: int, started: list):
    """Starts a process that answers 200 to any GET on the port, as the OpenAI API's /health/live does."""
    path = tmp_path / "api.py"
    path.write_text("import http.server, sys\n"
                    "class H(http.server.BaseHTTPRequestHandler):\n"
                    "    def do_GET(self):\n"
                    "        self.send_response(200); self.end_headers()\n"
                    f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")

    def start():
        started.append(subprocess.Popen([sys.executable, str(path)]))
        return started[-1]

    return start


def test_a_dead_openai_api_is_started_again_and_counted_as_a_recovery(tmp_path):
    servers, apis, port = [], [], Ports.free().http
    supervisor = Supervisor(stand_in(servers), "127.0.0.1:9", ["llm"], start_api=stand_in_api(tmp_path, port, apis),
                            api_url=f"127.0.0.1:{port}")
    supervisor.process, supervisor.api = stand_in(servers)(), stand_in_api(tmp_path, port, apis)()
    try:
        deadline = time.monotonic() + 60
        while not supervisor.api_answers():
            assert time.monotonic() < deadline, "the stand-in API did not answer"
            time.sleep(0.05)
        apis[0].kill()
        apis[0].wait()
        assert not supervisor.api_answers() and not supervisor.health()["api_ready"]
        supervisor.check()
        assert [(r.action, r.ok) for r in supervisor.recoveries] == [("restart the OpenAI API", True)]
        assert len(apis) == 2 and supervisor.health()["api_pid"] == apis[1].pid and supervisor.api_answers()
    finally:
        supervisor.stop()
    assert all(p.poll() is not None for p in servers + apis), "stop() stops the API with the server"


def test_an_openai_api_that_cannot_start_is_tried_again_later_not_at_every_look():
    servers, apis = [], []

    def failing_api():
        apis.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]))
        return apis[-1]

    supervisor = Supervisor(stand_in(servers), "127.0.0.1:9", ["llm"], start_api=failing_api,
                            api_url=f"127.0.0.1:{Ports.free().http}")
    supervisor.process, supervisor.api = stand_in(servers)(), failing_api()
    try:
        apis[0].wait()
        supervisor.check()
        supervisor.check()
        supervisor.check()
        assert len(apis) == 2, "one restart, then a wait before the next"
        assert [(r.action, r.ok) for r in supervisor.recoveries] == [("restart the OpenAI API", False)]
    finally:
        supervisor.stop()


# --- the OpenAI-compatible API that `make serve` runs beside the server, with a stand-in tritonserver ---

def stand_in_tritonserver(tmp_path) -> str:
    """An executable that takes tritonserver's flags and serves nothing until it is stopped."""
    path = tmp_path / "tritonserver"
    path.write_text(f"#!{sys.executable}\nimport signal, sys, time\n"
                    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\ntime.sleep(300)\n")
    path.chmod(0o755)
    return str(path)


def get(url: str) -> tuple[int | None, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except OSError:
        return None, {}


@pytest.mark.parametrize("supervised", [False, True])
def test_the_serve_command_runs_the_openai_api_beside_the_server_and_stops_it(tmp_path, supervised):
    ports, health_port, api_port = Ports.free(), Ports.free().http, Ports.free().http
    command = [sys.executable, "-m", "scripts.launcher.triton_server",
               "--tritonserver", stand_in_tritonserver(tmp_path), "--http-port", str(ports.http),
               "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
               "--health-port", str(health_port), "--openai-port", str(api_port)]
    # A session of its own: whatever the command leaves behind is killed at the end, after the checks.
    process = subprocess.Popen(command + ([] if supervised else ["--no-supervise"]), cwd=PROJECT_ROOT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while get(f"http://127.0.0.1:{api_port}/health/live")[0] != 200:
            assert process.poll() is None and time.monotonic() < deadline, "the API did not come up"
            time.sleep(0.05)
        status, body = get(f"http://127.0.0.1:{api_port}/health/ready")
        # Not ready: nothing serves gRPC. Its reasons name the server's gRPC port, and, supervised, the health URL.
        assert status == 503 and f"127.0.0.1:{ports.grpc}" in body["reason"]
        assert (f"127.0.0.1:{health_port}/health/ready" in body["reason"]) == supervised
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert get(f"http://127.0.0.1:{api_port}/health/live")[0] is None, "the API stopped with the server"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def test_the_api_is_pointed_at_the_servers_grpc_port_and_the_supervisors_readiness():
    args = build_parser().parse_args(["--no-openai"])
    assert args.no_openai and args.openai_port == 9000
    command = openai_command(build_parser().parse_args(["--address", "0.0.0.0", "--grpc-port", "7001"]))
    assert command[command.index("--triton-url") + 1] == "127.0.0.1:7001"
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert command[command.index("--health-url") + 1] == "http://127.0.0.1:8003/health/ready"


def test_a_server_that_dies_while_llm_reloads_is_found_without_waiting_on_the_load(tmp_path, monkeypatch):
    """Seen in a run: Triton's Python backend aborted as the supervisor killed a stalled llm stub (a lock of theirs
    the stopped stub held), and its answer to the load never came; the supervisor waited on it for the client's
    5 minutes. Here a stand-in server holds the load unanswered while a front model's process dies: the reload ends
    naming the dead front (the caller then restarts tritonserver), whatever the load's timeout."""
    import socket

    from python_backend.serving.heartbeat import RUNTIME_DIR_ENV

    held = []
    listener = socket.create_server(("127.0.0.1", 0))

    def hold_every_connection():  # accepted, never answered, until the listener is closed
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept())

    threading.Thread(target=hold_every_connection, daemon=True).start()
    servers, front = [], subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    supervisor = Supervisor(stand_in(servers), f"127.0.0.1:{listener.getsockname()[1]}", ["llm", "ensemble"],
                            recovery_timeout_s=600)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    try:
        supervisor._start_server()
        folder = supervisor.heartbeat_dir()
        folder.mkdir()
        for instance, pid in (("llm_0_0", gone.pid), ("ensemble_0_0", front.pid)):
            (folder / f"{instance}.json").write_text(json.dumps({"pid": pid, "time": time.time() + 600}))
        errors = []
        reloading = threading.Thread(target=lambda: errors.append(_raised(supervisor._reload_llm)), daemon=True)
        reloading.start()
        while not held:  # the load reached the server, which holds it
            assert reloading.is_alive(), errors
            time.sleep(0.02)
        front.kill()
        reloading.join(120)
        assert not reloading.is_alive(), "the reload waited on a load the server never answers"
        assert isinstance(errors[0], RuntimeError) and "ensemble_0_0 dead" in str(errors[0]), errors
    finally:
        front.kill()
        supervisor.stop()
        listener.close()


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - the test looks at it
        return error
    return None


def test_a_load_that_fails_as_the_server_dies_is_named_as_the_servers_exit(tmp_path, monkeypatch):
    """A dying tritonserver drops the load's connection before its process has exited (an abort writes its core):
    the reload's error names the server's exit, not the dropped connection, so /health says why it restarted."""
    from python_backend.serving.heartbeat import RUNTIME_DIR_ENV

    port = Ports.free().http
    dying = ("import os, socket, time\n"
             f"listener = socket.create_server(('127.0.0.1', {port}))\n"
             "print('listening', flush=True)\n"
             "connection, _ = listener.accept()\n"
             "connection.close()\n"
             "listener.close()\n"  # a client that connects again is refused
             "time.sleep(3)\n"  # well within the supervisor's grace (5 s), long after the load has failed
             "os._exit(134)\n")
    started = []

    def start():
        started.append(subprocess.Popen([sys.executable, "-c", dying], stdout=subprocess.PIPE, text=True))
        return started[-1]

    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    supervisor = Supervisor(start, f"127.0.0.1:{port}", ["llm"])
    try:
        supervisor._start_server()
        assert started[0].stdout.readline() == "listening\n"
        folder = supervisor.heartbeat_dir()
        folder.mkdir()
        (folder / "llm_0_0.json").write_text(json.dumps({"pid": gone.pid, "time": time.time() + 600}))
        error = _raised(supervisor._reload_llm)
        assert isinstance(error, RuntimeError) and "tritonserver exited with code 134" in str(error), error
    finally:
        supervisor.stop()
