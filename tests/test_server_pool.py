"""The suite's shared servers (tests/conftest.py's ServerPool): a stub that dies mid-request fails the test waiting on
it within seconds, not after its client's 600-s timeout, and every later test says why."""

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from scripts.clients.llm_client import GrpcStreamClient
from scripts.launcher.processes import remove_regions, stub_processes, stub_regions
from tests.conftest import ServerPool
from tests.helpers import long_request, metrics, variant_folder, wait_for

pytestmark = pytest.mark.server


class QuickPool(ServerPool):
    WATCH_INTERVAL_S = 0.5


def stub_of(server_pid: int, model: str) -> int:
    for pid in stub_processes(server_pid):
        if f"/{model}/1/model.py".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no stub of {model} under tritonserver {server_pid}")


def test_a_stub_that_dies_mid_request_stops_its_server_and_the_waiting_request_fails_at_once(tmp_path_factory,
                                                                                             model_dir):
    pool = QuickPool(tmp_path_factory)  # a server of its own: the session's shared ones are not to be stopped
    waiting, regions = ThreadPoolExecutor(1), []
    try:
        ports = pool.get(variant_folder(model_dir, "fp32"))
        answer = waiting.submit(GrpcStreamClient(f"127.0.0.1:{ports.grpc}", timeout_s=600).complete, long_request())
        wait_for(lambda: metrics(ports).get("llm_output_tokens_total", 0) > 0, timeout_s=120, interval_s=0.2,
                 message="the long request never started")
        stub = stub_of(pool.pid(ports), "ensemble")
        regions = stub_regions(stub)  # Triton leaves a dead stub's shared memory behind
        os.kill(stub, signal.SIGKILL)
        # 120 s: far beyond the watch's 1.5 s, far below the client's 600 s
        assert answer.exception(timeout=120) is not None, "the request was answered by a dead stub"
        with pytest.raises(pytest.fail.Exception, match="died .*killed by signal 9"):
            pool.check_alive()
        assert list(pool.deaths) == [ports]
    finally:
        pool.close()  # a request still waiting ends with its server
        waiting.shutdown()
        remove_regions(regions)
