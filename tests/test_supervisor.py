"""The supervisor's start/stop without a real server (a stand-in process): a stop that comes while the server is
still starting is an orderly stop, not a failure, and leaves no process behind."""

import subprocess
import sys
import threading

from scripts.supervisor import Supervisor, python_models
from scripts.triton_server import DEFAULT_MODEL_REPOSITORY, Ports


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
    assert python_models(DEFAULT_MODEL_REPOSITORY) == ["ensemble", "ensemble_unary", "llm"]
