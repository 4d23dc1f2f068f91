"""Heartbeats: written atomically by a thread, judged dead by the process, stalled by the clock or the engine."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from python_backend.serving.heartbeat import (RUNTIME_DIR_ENV, Heartbeat, PeerLiveness, judge, process_alive,
                                              process_start_ticks, read_health, runtime_dir)


def test_a_heartbeat_is_written_and_read_back_as_ok(tmp_path):
    beat = Heartbeat("llm_0_0", lambda: {"engine_alive": True, "has_work": False, "last_progress": time.time()},
                     folder=tmp_path)
    beat.start()
    beat.stop()
    record = json.loads((tmp_path / "llm_0_0.json").read_text())
    assert record["pid"] == os.getpid() and record["engine_alive"] is True
    [health] = read_health(tmp_path, "llm")
    assert health.ok and health.instance == "llm_0_0"
    assert read_health(tmp_path, "ensemble") == [], "instances are matched by model name"


def test_a_gone_process_is_dead_at_once(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid) and process_alive(os.getpid())
    (tmp_path / "llm_0_0.json").write_text(json.dumps({"pid": child.pid, "time": time.time()}))
    [health] = read_health(tmp_path, "llm")
    assert health.state == "dead" and str(child.pid) in health.reason
    assert "process" in PeerLiveness("llm", tmp_path).problem()


def test_a_zombie_is_dead():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert process_alive(child.pid)
        child.stdin.close()  # it exits
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # returns once it has exited, and leaves it unreaped
        state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        assert state == "Z", "exited and not reaped: a zombie"
        assert not process_alive(child.pid)
    finally:
        child.kill()
        child.wait()


def test_stale_heartbeats_and_stuck_engines_are_stalled():
    now = 1000.0
    alive = lambda pid: True  # noqa: E731
    assert judge("llm_0_0", {"pid": 1, "time": now - 11}, now, 10, 60, alive).state == "stalled"
    assert judge("llm_0_0", {"pid": 1, "time": now - 9}, now, 10, 60, alive).ok
    assert judge("llm_0_0", {"pid": 1, "time": now, "engine_alive": False}, now, 10, 60, alive).state == "stalled"
    busy = {"pid": 1, "time": now, "engine_alive": True, "has_work": True}
    assert judge("llm_0_0", {**busy, "last_progress": now - 61}, now, 10, 60, alive).state == "stalled"
    assert judge("llm_0_0", {**busy, "last_progress": now - 59}, now, 10, 60, alive).ok
    idle = {**busy, "has_work": False, "last_progress": now - 600}
    assert judge("llm_0_0", idle, now, 10, 60, alive).ok, "an idle engine makes no progress and is fine"


def test_no_heartbeat_means_unknown_which_is_not_a_problem(tmp_path):
    assert PeerLiveness("llm", tmp_path / "missing").problem() is None


def test_an_old_instance_does_not_overwrite_its_reloaded_successors_heartbeat(tmp_path):
    # Triton loads a model's new version before it unloads the old one, under the same instance name.
    old = Heartbeat("llm_0_0", folder=tmp_path)
    old.beat()
    successor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        newer = {"pid": successor.pid, "time": time.time(), "started": old.started + 1}
        (tmp_path / "llm_0_0.json").write_text(json.dumps(newer))
        old.beat()
        assert json.loads((tmp_path / "llm_0_0.json").read_text())["pid"] == successor.pid
    finally:
        successor.kill()
        successor.wait()
    old.beat()  # the successor is gone: the file is this instance's again
    assert json.loads((tmp_path / "llm_0_0.json").read_text())["pid"] == os.getpid()


def test_a_stub_and_its_server_name_the_same_folder_and_it_carries_the_servers_start(tmp_path, monkeypatch):
    """A stub names the folder by its parent, the supervisor by the process it started: the same folder. Its name
    carries the server's start as well as its pid: pids come round again, and an earlier server's heartbeats left
    under the same pid must not be read as this one's."""
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    stub = subprocess.run([sys.executable, "-c", "from python_backend.serving.heartbeat import runtime_dir; "
                           "print(runtime_dir())"], capture_output=True, text=True, check=True)
    assert Path(stub.stdout.strip()) == runtime_dir(os.getpid())
    started = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[-1].split()[19]
    assert runtime_dir(os.getpid()) == tmp_path / f"triton-llm-{os.getpid()}-{started}"
    assert process_start_ticks(-1) is None, "a pid no process has"
