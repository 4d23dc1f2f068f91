"""Fault injection on a running, supervised server (`make serve`'s command, with its OpenAI API): a model process,
or the OpenAI API's, is killed with SIGKILL (as the kernel's OOM killer would) while requests are in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from openai_api.batch.config import DATA_DIR_ENV
from python_backend.model_files import MODEL_DIR_ENV
from python_backend.serving.heartbeat import process_alive
from scripts.clients.llm_client import GrpcClient, GrpcStreamClient, RequestError
from scripts.launcher.processes import Ports, stub_regions
from scripts.launcher.triton_server import server_environment
from tests.helpers import long_request

pytestmark = pytest.mark.server

# Waits bound a hung server only: a recovery must happen, however long this machine takes.
RECOVERY_TIMEOUT_S = 300
PROMPT = {"apply_chat_template": True, "text_input": "What is the capital of France?", "max_tokens": 16}


class Supervised:
    def __init__(self, ports: Ports, health_port: int, api_port: int):
        self.ports, self.health_port, self.api_port = ports, health_port, api_port

    def health(self) -> tuple[int | None, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/health/ready", timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())
        except OSError as error:
            return None, {"error": str(error)}

    def wait_ready(self, timeout_s: float, unless_pid: int | None = None) -> dict:
        """Waits for 200 from /health/ready (with no instance of pid unless_pid); returns the health JSON."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = self.health()
            pids = {i["pid"] for i in body.get("instances", {}).values()}
            if status == 200 and unless_pid not in pids:
                return body
            time.sleep(0.05)
        raise AssertionError(f"not ready within {timeout_s} s: {self.health()}")

    def answer(self) -> str:
        return GrpcClient(f"127.0.0.1:{self.ports.grpc}", timeout_s=120).complete(PROMPT).text


@pytest.fixture(scope="module")
def supervised(model_dir, tmp_path_factory):
    ports, health_port, api_port = Ports.free(), Ports.free().http, Ports.free().http
    folder = tmp_path_factory.mktemp("supervised")
    log = open(folder / "server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "scripts.launcher.triton_server", "--http-port", str(ports.http), "--grpc-port",
         str(ports.grpc), "--metrics-port", str(ports.metrics), "--health-port", str(health_port), "--openai-port",
         str(api_port)],
        env={**server_environment(), MODEL_DIR_ENV: str(model_dir), DATA_DIR_ENV: str(folder / "batches")},
        stdout=log, stderr=subprocess.STDOUT)
    server = Supervised(ports, health_port, api_port)
    try:
        server.wait_ready(300)
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        print(f"server log: {log.name}")


def start_streams(server: Supervised, count: int):
    """count long streaming requests, each running (first text received) when this returns; their outcomes fill
    the returned dict: index -> (error message or None, seconds since `outcomes['killed_at']`)."""
    started = [threading.Event() for _ in range(count)]
    outcomes: dict = {}

    def one(index):
        try:
            for _ in GrpcStreamClient(f"127.0.0.1:{server.ports.grpc}", timeout_s=120).stream(long_request()):
                started[index].set()
            outcomes[index] = (None, time.monotonic() - outcomes["killed_at"])
        except RequestError as error:
            outcomes[index] = (str(error), time.monotonic() - outcomes.get("killed_at", time.monotonic()))
        finally:
            started[index].set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120), "a request did not start"
    return threads, outcomes


def instance_pids(body: dict) -> set[int]:
    return {i["pid"] for i in body["instances"].values()}


def watch_readiness(server: Supervised, until_pid_gone: int, timeout_s: float, pid_of=instance_pids
                    ) -> tuple[list, dict]:
    """Polls /health/ready until it is 200 again without the killed pid (among pid_of(the JSON): the model
    processes'); returns the statuses seen and the JSON."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = server.health()
        seen.append(status)
        if status == 200 and until_pid_gone not in pid_of(body):
            return seen, body
        time.sleep(0.05)
    raise AssertionError(f"not ready again within {timeout_s} s: {server.health()}")


@dataclass
class Fault:
    pid: int  # the process the signal went to
    server_pid: int  # tritonserver's, before the fault
    seen: list  # /health/ready statuses seen until it was ready again without that process
    health: dict  # the health JSON then
    errors: list  # per request in flight: (error message or None, seconds from the signal to its end)
    recovered_after: float


def signal_under_load(server: Supervised, instance: str, streams: int, signum: int, timeout_s: float) -> Fault:
    """Sends signum to a model process while `streams` requests stream, waits until the server is ready again
    without that process, and collects how each request ended."""
    _, health = server.health()
    pid, server_pid = health["instances"][instance]["pid"], health["server_pid"]
    threads, outcomes = start_streams(server, streams)
    outcomes["killed_at"] = time.monotonic()
    os.kill(pid, signum)
    seen, health = watch_readiness(server, pid, timeout_s)
    recovered_after = time.monotonic() - outcomes["killed_at"]
    for thread in threads:
        thread.join(60)
    return Fault(pid, server_pid, seen, health, [outcomes.get(i) for i in range(streams)], recovered_after)


def reloaded(recovery: dict, fault: Fault) -> bool:
    """Whether llm was reloaded; or whether tritonserver itself died during the reload and the restart that followed
    brought it back. Killing a stub may leave a lock of Triton's Python backend held (seen: tritonserver aborted with
    boost's lock_exception during the reload): a restart is the only mend then, and the supervisor's to make."""
    if recovery["action"] == "reload llm":
        return bool(recovery["ok"])
    return (recovery["action"] == "reload llm, then restart tritonserver" and bool(recovery["ok"])
            and "tritonserver exited" in (recovery["error"] or "") and fault.health["server_pid"] != fault.server_pid)


def test_a_killed_llm_process_fails_requests_in_flight_at_once_and_is_reloaded(supervised):
    before = supervised.answer()
    regions = stub_regions(supervised.health()[1]["instances"]["llm_0_0"]["pid"])
    assert regions and all(Path("/dev/shm", region).exists() for region in regions)
    fault = signal_under_load(supervised, "llm_0_0", 8, signal.SIGKILL, timeout_s=RECOVERY_TIMEOUT_S)
    errors = fault.errors
    assert all(e is not None and e[0] and "llm model is not running" in e[0] for e in errors), errors
    # At once: the front saw the process gone (a look every 0.25 s), rather than waiting for its heartbeat to go
    # stale (10 s) or for the client's deadline.
    assert all(f"process {fault.pid} is gone" in e[0] for e in errors), errors
    assert 503 in fault.seen, "readiness turned not-ready while the llm process was dead"
    assert reloaded(fault.health["recoveries"][-1], fault), fault.health["recoveries"]
    assert not any(Path("/dev/shm", region).exists() for region in regions), "Triton leaves a dead stub's memory"
    assert supervised.answer() == before, "the same prompt is served exactly again"
    print(f"llm killed: {len(errors)} requests failed within {max(e[1] for e in errors):.2f} s, "
          f"ready again after {fault.recovered_after:.1f} s")


def test_a_killed_front_process_restarts_the_server(supervised):
    before = supervised.answer()
    regions = stub_regions(supervised.health()[1]["instances"]["ensemble_0_0"]["pid"])
    fault = signal_under_load(supervised, "ensemble_0_0", 4, signal.SIGKILL, timeout_s=RECOVERY_TIMEOUT_S)
    errors = fault.errors
    assert all(e is not None and e[0] for e in errors), errors
    # Ended with the dead server, not left hanging until their deadline: before the new server was even ready.
    assert all(e[1] < fault.recovered_after for e in errors), (errors, fault.recovered_after)
    assert 503 in fault.seen or None in fault.seen, "readiness turned not-ready while the front process was dead"
    assert fault.health["server_pid"] != fault.server_pid
    assert fault.health["recoveries"][-1]["action"] == "restart tritonserver"
    assert regions and not any(Path("/dev/shm", region).exists() for region in regions), "the dead stub's memory"
    assert supervised.answer() == before
    print(f"front killed: {len(errors)} requests ended within {max(e[1] for e in errors):.2f} s "
          f"({errors[0][0][:80]}), ready again after {fault.recovered_after:.1f} s")


def test_a_frozen_llm_process_is_found_stalled_and_replaced(supervised):
    """SIGSTOP: the process exists but does nothing (as a process stuck in a kernel call, or starved)."""
    before = supervised.answer()
    fault = signal_under_load(supervised, "llm_0_0", 2, signal.SIGSTOP, timeout_s=RECOVERY_TIMEOUT_S)
    errors, health = fault.errors, fault.health
    recovery = health["recoveries"][-1]
    assert 503 in fault.seen and reloaded(recovery, fault), health["recoveries"]
    assert "stalled" in recovery["reason"]
    assert all(e is not None and e[0] and "llm model is not running" in e[0] for e in errors), errors
    assert supervised.answer() == before
    assert not process_alive(fault.pid), "the frozen process was killed, not left behind"
    print(f"llm frozen: requests failed after {max(e[1] for e in errors):.1f} s, "
          f"recovered in {recovery['took_s']} s after detection ({recovery['action']})")


def test_the_supervisor_reports_readiness_and_recoveries_as_prometheus_metrics(supervised):
    from prometheus_client.parser import text_string_to_metric_families

    health = supervised.wait_ready(RECOVERY_TIMEOUT_S)
    with urllib.request.urlopen(f"http://127.0.0.1:{supervised.health_port}/metrics", timeout=5) as response:
        samples = {s.name: s.value for family in text_string_to_metric_families(response.read().decode())
                   for s in family.samples}
    assert samples["triton_llm_ready"] == 1 and samples["triton_llm_recovering"] == 0
    assert samples["triton_llm_recoveries_total"] == len(health["recoveries"])


def test_a_killed_openai_api_is_started_again_and_its_batch_resumes(supervised):
    """`make serve`'s supervisor keeps the OpenAI API as it keeps the models: after a kill -9 with a batch running,
    readiness turns false, the API is started again, and the batch goes on to its end with every line once. Each
    line runs exactly 32 tokens (the end tokens banned), 30 at a time (the Batch API's default): once one is done,
    34 lines are at least 32 engine steps away on any machine."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{supervised.api_port}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "messages": [{"role": "user", "content": f"Write about the number {i}."}], "temperature": 0,
        "max_tokens": 32, "logit_bias": {"0": -100, "2": -100}}} for i in range(64)]
    upload = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while (batch := client.batches.retrieve(batch.id)).request_counts.completed < 1 and batch.status in (
            "validating", "in_progress"):
        assert time.monotonic() < deadline, f"no line done after {RECOVERY_TIMEOUT_S} s"
        time.sleep(0.05)
    assert batch.status == "in_progress", "the batch ended before the kill"
    _, health = supervised.health()
    killed = health["api_pid"]
    os.kill(killed, signal.SIGKILL)
    seen, health = watch_readiness(supervised, until_pid_gone=killed, timeout_s=RECOVERY_TIMEOUT_S,
                                   pid_of=lambda body: {body["api_pid"]})
    assert 503 in seen, "readiness turned not-ready while the OpenAI API was dead"
    assert health["recoveries"][-1]["action"] == "restart the OpenAI API" and health["recoveries"][-1]["ok"]
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while (batch := client.batches.retrieve(batch.id)).status in ("validating", "in_progress", "finalizing"):
        assert time.monotonic() < deadline, f"the batch is still {batch.status} after {RECOVERY_TIMEOUT_S} s"
        time.sleep(0.1)
    assert batch.status == "completed" and batch.request_counts.completed == len(lines)
    outputs = [json.loads(t) for t in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in outputs) == sorted(x["custom_id"] for x in lines)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 32 for o in outputs)
    print(f"OpenAI API killed: ready again after {health['recoveries'][-1]['took_s']} s")
