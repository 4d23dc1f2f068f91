"""Stopping a server removes the Python stubs that name it and their shared memory, also once the server itself is
gone (a stub whose own thread is stuck outlives it); plain processes stand in for tritonserver and its stubs. The
test suite's look for a shared server's dead stub (tests/conftest.py) finds unreaped children and says how they
ended."""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from python_backend.serving.heartbeat import RUNTIME_DIR_ENV, runtime_dir
from scripts.launcher.processes import stop, stub_processes
from scripts.launcher.processes import last_crash, process_with_argument, zombie_children
from tests.helpers import wait_for


@pytest.fixture
def fake_server():
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def region():
    path = Path("/dev/shm", f"triton_python_backend_shm_region_test-{uuid.uuid4().hex}")
    path.write_bytes(b"\0" * 16)
    yield path
    path.unlink(missing_ok=True)


def fake_stub(folder: Path, server_pid: int, region: Path) -> subprocess.Popen:
    """A process whose command line reads as a stub's: the stub's name, then its region, two sizes and the pid of the
    server that started it (a real stub has its model file before the region)."""
    script = "import time; time.sleep(600)"
    stub = subprocess.Popen(["bash", "-c", f'exec -a {folder}/triton_python_backend_stub {sys.executable} -c '
                                           f'"{script}" {region.name} 1048576 1048576 {server_pid}'])
    wait_for(lambda: stub.pid in stub_processes(server_pid), 30, message="the fake stub never showed up")
    return stub


def test_a_stub_that_outlives_its_killed_server_is_removed_with_its_memory(fake_server, region, tmp_path):
    stub = fake_stub(tmp_path, fake_server.pid, region)
    assert stub_processes(fake_server.pid)[stub.pid] == [region.name]
    fake_server.kill()
    fake_server.wait()
    stop(fake_server)
    assert stub.wait(timeout=30) == -9
    assert not region.exists()


def test_stopping_a_running_server_removes_its_stubs_and_leaves_another_servers(fake_server, region, tmp_path):
    other = fake_stub(tmp_path, fake_server.pid + 100_000, region)  # names a pid that no process here has
    mine = fake_stub(tmp_path, fake_server.pid, region)
    stop(fake_server, timeout_s=10)
    assert fake_server.returncode is not None and mine.wait(timeout=30) == -9
    assert other.poll() is None, "a stub of another server is left alone"
    other.kill()
    other.wait()


def test_children_that_died_unreaped_are_found_with_how_they_ended():
    marker = f"--marker={uuid.uuid4().hex}"
    crashed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    running = subprocess.Popen(["sleep", "600"])
    try:
        assert process_with_argument(marker) == crashed.pid
        os.kill(crashed.pid, signal.SIGABRT)
        wait_for(lambda: {crashed.pid, exited.pid} <= set(zombie_children(os.getpid())), 60,
                 message="the two children never showed up as zombies")
        dead = zombie_children(os.getpid())
        assert dead[crashed.pid] == "killed by signal 6" and dead[exited.pid] == "exited with code 3"
        assert running.pid not in dead
        crashed.wait(), exited.wait()  # reaped: no longer zombies
        assert not {crashed.pid, exited.pid} & set(zombie_children(os.getpid()))
    finally:
        for process in (crashed, exited, running):
            process.kill()
            process.wait()


def test_the_last_crash_in_a_server_log_is_quoted_with_glibc_s_message_before_it():
    log = "\n".join([
        "Fatal Python error: Segmentation fault", "", "Current thread 0x1 (most recent call first):",
        "  <no Python frame>", "I1207 server.cc] model reloaded",
        "malloc(): unaligned fastbin chunk detected", "Fatal Python error: Aborted", "",
        "Current thread 0x2 (most recent call first):", '  File "model.py", line 136 in _llm_stream',
    ])
    assert last_crash(log).splitlines() == [
        "malloc(): unaligned fastbin chunk detected", "Fatal Python error: Aborted", "",
        "Current thread 0x2 (most recent call first):", '  File "model.py", line 136 in _llm_stream']
    assert last_crash(log, max_lines=2).splitlines() == ["malloc(): unaligned fastbin chunk detected",
                                                         "Fatal Python error: Aborted"]
    assert last_crash("I1207 ready\nI1207 stopped") == ""


def test_stopping_a_server_removes_its_runtime_folder_and_leaves_another_servers(fake_server, tmp_path, monkeypatch):
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    other = subprocess.Popen(["sleep", "600"])
    try:
        for server in (fake_server, other):
            runtime_dir(server.pid).mkdir()
            (runtime_dir(server.pid) / "llm_0_0.json").write_text("{}")
        mine = runtime_dir(fake_server.pid)
        stop(fake_server, timeout_s=10)
        assert not mine.exists(), "its heartbeats would be read by a later server given the same pid"
        assert (runtime_dir(other.pid) / "llm_0_0.json").exists()
    finally:
        other.kill()
        other.wait()



def test_free_ports_lie_below_the_ephemeral_range_where_no_client_connection_takes_them(monkeypatch, tmp_path):
    """The launcher's ports come from below the kernel's ephemeral range (outgoing connections take theirs from it: a
    port released there was once taken before tritonserver bound it), three distinct ones, a port in use skipped;
    with no room below the range, the kernel picks."""
    import socket

    from scripts.launcher import processes

    start = processes.ephemeral_ports_start()
    ports = processes.Ports.free()
    picked = [ports.http, ports.grpc, ports.metrics]
    assert len(set(picked)) == 3 and all(processes.PICKED_PORTS_FROM <= p < start for p in picked), (picked, start)
    with socket.socket() as held:
        held.bind(("127.0.0.1", processes.free_loopback_port()))
        held.listen()
        draws = iter([held.getsockname()[1], picked[0], picked[0], picked[1], picked[2]])
        monkeypatch.setattr(processes._picks, "randrange", lambda low, high: next(draws))
        assert processes.Ports.free() == ports, "the port in use and the repeated one were skipped"

    def no_draw(low, high):
        raise AssertionError("drew a port where the range leaves no room below it")

    monkeypatch.setattr(processes._picks, "randrange", no_draw)
    (tmp_path / "ip_local_port_range").write_text("1024\t65535\n")
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE", tmp_path / "ip_local_port_range")
    assert processes.ephemeral_ports_start() == 1024 and processes.free_loopback_port() >= 1024
