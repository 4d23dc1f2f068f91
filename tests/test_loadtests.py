"""Load-test tooling: the workload, where the Locust users send their requests and what they record when one fails,
the perf_analyzer / genai-perf inputs (checked against the running server's own metadata), Locust itself against the
real server (and the OpenAI-compatible service when there is one), and the --quick sweep end to end."""

from __future__ import annotations

import csv
import json
import os
import queue
import random
import re
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from loadtests.endpoints import (EndpointError, RequestFailed, chat_deltas, error_text, grpc_url_from_host,
                                 http_error_text, openai_url_from_host, sse_events)
from loadtests.perf_inputs import (GENAI_PERF_FILE, PERF_ANALYZER_FILE, check_perf_analyzer_data,
                                   genai_perf_lines, main as perf_inputs_main)
from loadtests.workload import MaxTokens, Workload, chat_request, load_prompts
from scripts.launcher.processes import Ports, free_loopback_port
from scripts.paths import PROJECT_ROOT
from tests.helpers import wait_for

LOCUSTFILE = PROJECT_ROOT / "loadtests" / "locustfile.py"


def test_max_tokens_distributions():
    rng = random.Random(0)
    assert {MaxTokens.parse("choice:16,32").sample(rng) for _ in range(100)} == {16, 32}
    assert all(16 <= MaxTokens.parse("uniform:16:20").sample(rng) <= 20 for _ in range(100))
    assert MaxTokens.parse("fixed:64").sample(rng) == 64
    for bad in ("choice:", "uniform:5", "gauss:1,2", "fixed:0", "choice:a"):
        with pytest.raises(ValueError, match="bad max_tokens distribution"):
            MaxTokens.parse(bad)


def test_the_latency_throughput_curve_is_the_pareto_front():
    from dataclasses import replace

    from loadtests.sweep import Cell, pareto_front

    base = Cell("continuous", 1, 1, 6, 10, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "")
    cells = [replace(base, max_batch_size=b, output_tokens_per_s=tps, latency_p95_s=p95)
             for b, tps, p95 in [(1, 40, 1.5), (2, 60, 6.0), (4, 80, 4.0), (8, 80, 5.0), (16, 120, 9.0), (32, 100, 12)]]
    # (2: slower and later than 4), (8: as fast as 4 but later), (32: slower and later than 16) are dominated
    assert [c.max_batch_size for c in pareto_front(cells)] == [1, 4, 16]


def test_the_shipped_prompt_set_mixes_lengths_and_languages():
    rows = [json.loads(line) for line in (PROJECT_ROOT / "loadtests" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) >= 40 and {"en", "zh", "code", "emoji"} <= {r["lang"] for r in rows}
    lengths = [r["prompt_tokens"] for r in rows]
    assert min(lengths) <= 6 and max(lengths) >= 60
    request = Workload(load_prompts(), MaxTokens.parse("fixed:8"), seed=1).next_request()
    assert request["max_tokens"] == 8 and request["text_input"]


def test_the_workload_says_whether_to_apply_the_chat_template_and_speaks_openai():
    # the ensemble's default is the raw prompt: the workload must ask for the template, and say so when it does not
    prompts, eight = ["Hi"], MaxTokens.parse("fixed:8")
    assert Workload(prompts, eight).next_request()["apply_chat_template"] is True
    assert Workload(prompts, eight, apply_chat_template=False).next_request()["apply_chat_template"] is False
    assert chat_request({"text_input": "Hi", "max_tokens": 8, "apply_chat_template": True}, "smol") == {
        "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}}


def test_endpoints_are_derived_from_host():
    assert grpc_url_from_host("http://127.0.0.1:8000") == "127.0.0.1:8001"  # Triton's default ports
    assert grpc_url_from_host("http://127.0.0.1:18600") == "127.0.0.1:18601"  # the same convention elsewhere
    assert grpc_url_from_host("http://[::1]:9000/") == "[::1]:9001"
    assert grpc_url_from_host("gpu-box:8000") == "gpu-box:8001"
    with pytest.raises(EndpointError, match="names no port.*pass --grpc-url HOST:PORT"):
        grpc_url_from_host("http://localhost")
    with pytest.raises(EndpointError, match="pass --grpc-url"):
        grpc_url_from_host(None)
    assert openai_url_from_host("http://10.0.0.5:8000") == "http://10.0.0.5:9000"
    assert openai_url_from_host("http://localhost") == "http://localhost:9000"


def test_failures_carry_the_servers_message():
    from tritonclient.utils import InferenceServerException

    # built with keywords, as tritonclient.grpc does: its repr, which Locust records, was all a user saw
    refused = InferenceServerException(msg="failed to connect to all addresses", status="StatusCode.UNAVAILABLE",
                                       debug_details="details")
    assert repr(refused) == "InferenceServerException()"
    assert error_text(refused) == "UNAVAILABLE: failed to connect to all addresses"
    assert error_text(InferenceServerException(msg=None, debug_details="only details")) == "only details"
    assert error_text(InferenceServerException(msg=None)) == "InferenceServerException"
    assert error_text(RequestFailed("HTTP 400: bad max_tokens")) == "HTTP 400: bad max_tokens"
    assert error_text(KeyError("text_output")) == "KeyError: 'text_output'"
    assert error_text(queue.Empty()) == "Empty"
    assert http_error_text(400, b'{"error": "max_tokens must be >= 1"}') == "HTTP 400: max_tokens must be >= 1"
    assert http_error_text(400, b'data: {"error": "text_input is empty"}\n\n') == "HTTP 400: text_input is empty"
    assert http_error_text(503, b'{"error": {"message": "overloaded", "type": "server_error"}}') == \
        "HTTP 503: overloaded"
    assert http_error_text(502, b"<html>bad gateway</html>\n") == "HTTP 502: <html>bad gateway</html>"
    assert http_error_text(500, b"") == "HTTP 500"


def test_streamed_chat_chunks_count_one_token_each_and_add_up_to_the_usage():
    def delta(content=None, finish=None, usage=None):
        return {"choices": [{"index": 0, "delta": {} if content is None else {"content": content},
                             "finish_reason": finish}], "usage": usage}

    def sse(*chunks):
        events = [json.dumps(c) for c in chunks] + ["[DONE]", json.dumps(delta("never read"))]
        return [b": keep-alive\n"] + [f"data: {event}\n".encode() for event in events]

    usage_chunk = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}
    lines = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, delta("Hel"), delta("lo"),
                delta(" 世界"), delta(finish="stop"), usage_chunk)
    # three content chunks of one token each; the usage chunk carries what they did not (here the EOS token)
    assert list(chat_deltas(sse_events(lines))) == [("Hel", 1), ("lo", 1), (" 世界", 1), ("", 1)]
    # a server that reports usage on every chunk says how many tokens each carried
    lines = sse(delta("Hel", usage={"completion_tokens": 2}), delta("lo", usage={"completion_tokens": 3}),
                {"choices": [], "usage": {"completion_tokens": 3}})
    assert list(chat_deltas(sse_events(lines))) == [("Hel", 2), ("lo", 1)]
    with pytest.raises(RequestFailed, match="^the model is shutting down$"):
        list(sse_events(sse(delta("a"), {"error": {"message": "the model is shutting down", "code": 503}})))
    with pytest.raises(RequestFailed, match="^text_input is empty$"):  # Triton's generate_stream
        list(sse_events([b'data: {"error": "text_input is empty"}\n']))


@pytest.mark.server
def test_perf_inputs_follow_the_documented_formats_and_the_served_model(server, tmp_path):
    assert perf_inputs_main(["--output", str(tmp_path), "--count", "16"]) == 0
    data = json.loads((tmp_path / PERF_ANALYZER_FILE).read_text())
    metadata = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}").get_model_metadata("ensemble")
    config = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}").get_model_config("ensemble")
    optional = {i["name"] for i in config["input"] if i.get("optional")}
    inputs = [{**i, "optional": i["name"] in optional} for i in metadata["inputs"]]
    check_perf_analyzer_data(data, inputs)
    assert len(data["data"]) == 16 and all(e["stream"] == [True] for e in data["data"])
    with pytest.raises(ValueError, match="'prompt' is not an input"):
        check_perf_analyzer_data({"data": [{"prompt": ["x"]}]}, inputs)
    with pytest.raises(ValueError, match="missing required inputs"):
        check_perf_analyzer_data({"data": [{"text_input": ["x"]}]}, inputs)
    with pytest.raises(ValueError, match="must be INT32"):
        check_perf_analyzer_data({"data": [{"text_input": ["x"], "max_tokens": ["8"]}]}, inputs)
    lines = (tmp_path / GENAI_PERF_FILE).read_text().splitlines()
    assert lines == genai_perf_lines(load_prompts())
    assert all(list(json.loads(line)) == ["text_input"] for line in lines)


@pytest.fixture(scope="module")
def quick_sweep(tmp_path_factory, model_dir):
    output = tmp_path_factory.mktemp("sweep")
    # Answers of 8 or 16 tokens instead of up to 64: the checks below are of Locust's numbers and the engine's
    # batching, which shorter answers show as well (the 8 requests in flight at the end of a cell of max_batch_size 1
    # are drained one by one: 64-token answers took 8 s of each cell). Three seconds of new requests a cell: the
    # requests drained after them count (a clean-clone CI run of 9f45af1, 2026-12-03, had a cell whose 8 requests were
    # all in flight at the time limit and none counted: Locust's --csv files were not written again at the end,
    # which the locustfile now waits for).
    # The continuous strategy only: its two cells show max_batch_size's effect; the sweep does nothing else per
    # strategy than reload llm with it (static's own behaviour is test_strategies.py's), and each cell costs about
    # 20 s of the suite.
    result = subprocess.run([sys.executable, "-m", "loadtests.sweep", "--quick", "--strategies", "continuous",
                             "--duration", "3", "--max-tokens", "choice:8,16", "--output", str(output)],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_LLM_MODEL_DIR": str(model_dir)})
    assert result.returncode == 0, result.stderr[-3000:]
    return output


@pytest.mark.server
def test_quick_sweep_writes_sane_results_plots_and_report(quick_sweep):
    cells = json.loads((quick_sweep / "results.json").read_text())
    assert len(cells) == 2 and {c["strategy"] for c in cells} == {"continuous"}
    with open(quick_sweep / "results.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 2
    for cell in cells:
        assert cell["requests"] > 0 and cell["requests_per_s"] > 0 and cell["output_tokens_per_s"] > 0, cell
        assert 0 < cell["latency_p50_s"] <= cell["latency_p95_s"] <= cell["latency_p99_s"], cell
        assert 0 < cell["ttft_p50_s"] <= cell["ttft_p95_s"], cell
        assert cell["itl_p50_s"] > 0 and cell["engine_mean_batch_size"] >= 1, cell
        # the numbers are Locust's own
        with open(quick_sweep / cell["locust_csv"]) as handle:
            rows = {r["Name"]: r for r in csv.DictReader(handle)}
        main = rows["generate_stream"]
        assert cell["requests"] == int(main["Request Count"])
        assert cell["requests_per_s"] == float(main["Requests/s"])
        assert cell["latency_p95_s"] == float(main["95%"]) / 1000
        assert cell["latency_p99_s"] == float(main["99%"]) / 1000
        assert cell["ttft_p50_s"] == float(rows["generate_stream TTFT"]["50%"]) / 1000
    for name in ("latency_vs_batch_size.png", "throughput_vs_batch_size.png", "latency_throughput.png"):
        content = (quick_sweep / name).read_bytes()
        assert content[:8] == b"\x89PNG\r\n\x1a\n" and len(content) > 10_000, name
    report = (quick_sweep / "report.md").read_text()
    assert "| continuous | 8 | 8 |" in report and ("Best within the budget" in report or "No cell meets" in report)
    # with 8 users in flight, the engine batches them when allowed to, and cannot when max_batch_size is 1
    by = {(c["strategy"], c["max_batch_size"]): c for c in cells}
    assert by[("continuous", 1)]["engine_mean_batch_size"] == 1
    assert by[("continuous", 8)]["engine_mean_batch_size"] > 2


def _free_port_pair() -> int:
    """A loopback port P with P + 1 free too, for a server laid out as Triton's convention (gRPC = HTTP + 1)."""
    for _ in range(100):
        port = free_loopback_port()
        with socket.socket() as second, suppress(OSError):
            second.bind(("127.0.0.1", port + 1))
            return port
    raise RuntimeError("no two consecutive free ports")


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextmanager
def forwarding(routes: dict[int, int]):
    """Forwards loopback ports to others, byte for byte (HTTP/1.1 and gRPC's HTTP/2 alike), while the block runs.
    Yields cut(): closes the listeners and every connection, as a server that went away."""
    listeners = [socket.create_server(("127.0.0.1", port)) for port in routes]
    connections: list[socket.socket] = []

    def accept(listener, target):
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(("127.0.0.1", target))
            except OSError:
                return  # the listener was closed
            connections.extend((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def cut():
        for sock in listeners + connections:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    for listener, target in zip(listeners, routes.values()):
        threading.Thread(target=accept, args=(listener, target), daemon=True).start()
    try:
        yield cut
    finally:
        cut()


LOCUST_BOUND_S = 300  # -t: only a hung run reaches it; a run ends on its requests (--stop-after-requests)


def locust_command(users: list[str], options: list[str], csv_prefix: Path, count: int | None = None,
                   requests: int | None = 2, seconds: int = LOCUST_BOUND_S) -> list[str]:
    """Locust headless, one user of each class unless told, ended once each class has sent `requests` requests
    (answered or failed), or by the test or its `seconds` when None."""
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *users, "--headless", "--only-summary",
            "-u", str(count or len(users)), "-r", str(count or len(users)), "-t", f"{seconds}s",
            *(["--stop-after-requests", str(requests)] if requests else []),
            "--stop-timeout", "30", "--csv", str(csv_prefix), "--max-tokens", "fixed:8", "--loglevel", "WARNING",
            *options]


def stats_rows(csv_prefix: Path) -> dict[str, dict]:
    """The sweep's reading of Locust's stats file, or none where Locust wrote none (it stopped at start)."""
    from loadtests.sweep import locust_rows

    return locust_rows(csv_prefix) if Path(f"{csv_prefix}_stats.csv").exists() else {}


def failures_recorded(csv_prefix: Path) -> dict[str, int]:
    """Locust's failures file, error -> occurrences (rewritten every second during a run, flushed every few)."""
    failures = Path(f"{csv_prefix}_failures.csv")
    if not failures.exists():
        return {}
    with failures.open() as handle:
        return {row["Error"]: int(row["Occurrences"]) for row in csv.DictReader(handle) if row.get("Occurrences")}


def run_locust(users: list[str], options: list[str], csv_prefix: Path, count: int | None = None):
    """Locust run to its end (each class's requests sent); returns the process and its stats rows by name."""
    result = subprocess.run(locust_command(users, options, csv_prefix, count), cwd=PROJECT_ROOT, capture_output=True,
                            text=True, timeout=LOCUST_BOUND_S + 120)
    return result, stats_rows(csv_prefix)


@pytest.mark.server
def test_locust_needs_only_host_on_non_default_ports(server, tmp_path):
    # What a new user types: only --host. The server answers on non-default ports that follow Triton's convention
    # (gRPC = HTTP + 1, like 8000/8001), forwarded to the test server's own ports.
    port = _free_port_pair()
    with forwarding({port: server.http, port + 1: server.grpc}):
        result, rows = run_locust(["GenerateUser", "StreamUser", "GrpcStreamUser"],
                                  ["--host", f"http://127.0.0.1:{port}"], tmp_path / "locust")
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("generate", "generate_stream", "generate_stream TTFT", "grpc_stream", "grpc_stream TTFT"):
        assert int(rows[name]["Request Count"]) > 0 and rows[name]["Failure Count"] == "0", (name, rows.get(name))
    for name in ("generate", "generate_stream", "grpc_stream"):  # the content size is the output tokens
        assert 0 < float(rows[name]["Average Content Size"]) <= 8, rows[name]
    assert rows["Aggregated"]["Failure Count"] == "0"


@pytest.mark.server
def test_a_timed_runs_csv_counts_the_requests_drained_after_its_time(server, tmp_path):
    """The sweep's cells are timed runs read from Locust's CSV: the requests in flight at -t, drained within
    --stop-timeout, are in it as in Locust's final summary (Locust wrote its CSV once a second and not at the end:
    3-s runs of 8 users had 2 of 9 requests in it, 2026-12-07)."""
    prefix = tmp_path / "locust"
    result = subprocess.run(locust_command(["StreamUser"], ["--host", f"http://127.0.0.1:{server.http}"], prefix,
                                           count=4, requests=None, seconds=1),
                            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=LOCUST_BOUND_S)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = re.findall(r"SSE\s+generate_stream\s+(\d+)\s+0\(", result.stdout + result.stderr)
    assert summary, (result.stdout + result.stderr)[-3000:]
    assert int(stats_rows(prefix).get("generate_stream", {}).get("Request Count", 0)) == int(summary[-1]) >= 4


@pytest.mark.server
def test_each_failure_locust_records_carries_the_servers_message(server, tmp_path):
    prompts = tmp_path / "too_long.jsonl"
    prompts.write_text(json.dumps({"text_input": "x" * 70_000}) + "\n")
    result, _ = run_locust(["GenerateUser", "StreamUser", "GrpcStreamUser"],
                           ["--host", f"http://127.0.0.1:{server.http}", "--grpc-url", f"127.0.0.1:{server.grpc}",
                            "--prompts", str(prompts)], tmp_path / "locust")
    assert result.returncode == 1, result.stderr[-3000:]  # Locust's exit code when requests failed
    with open(tmp_path / "locust_failures.csv") as handle:
        failures = {row["Name"]: row["Error"] for row in csv.DictReader(handle)}
    assert set(failures) == {"generate", "generate_stream", "grpc_stream"}, failures
    expected = "text_input is 70000 bytes, more than the limit of 65536"
    assert f"HTTP 400: {expected}" in failures["generate"], failures  # recorded as CatchResponseError('...')
    assert failures["generate_stream"] == f"HTTP 400: {expected}" and failures["grpc_stream"] == expected, failures


def test_an_unreachable_grpc_endpoint_ends_locust_at_start(tmp_path):
    port = _free_port_pair()  # nothing listens on port + 1
    result, rows = run_locust(["GrpcStreamUser"], ["--host", f"http://127.0.0.1:{port}"], tmp_path / "locust")
    # At start: Locust's exit code for a failed start (a run whose requests fail exits 1), no request sent.
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"GrpcStreamUser: no Triton gRPC endpoint at 127.0.0.1:{port + 1}: UNAVAILABLE: " in result.stderr
    assert f"(derived from --host http://127.0.0.1:{port}: its port + 1; pass --grpc-url HOST:PORT)" in result.stderr
    assert int(rows.get("Aggregated", {}).get("Request Count", 0)) == 0


@pytest.mark.server
def test_chat_stream_user_against_the_openai_service(server, model_dir, tmp_path):
    pytest.importorskip("openai_api.app", reason="no OpenAI-compatible service (openai_api/app.py) to load-test")
    from loadtests.sweep import openai_service

    with openai_service(server.grpc, tmp_path / "openai.log", model_dir) as url:
        result, rows = run_locust(["ChatStreamUser"], ["--openai-url", url], tmp_path / "locust", count=2)
    assert result.returncode == 0, result.stderr[-3000:] + (tmp_path / "openai.log").read_text()[-2000:]
    for name in ("chat_stream", "chat_stream TTFT", "chat_stream ITL"):
        assert int(rows[name]["Request Count"]) > 0 and rows[name]["Failure Count"] == "0", (name, rows.get(name))
    assert 0 < float(rows["chat_stream"]["Average Content Size"]) <= 8  # usage.completion_tokens, max_tokens 8


@pytest.mark.server
def test_a_grpc_stream_broken_mid_run_reports_its_cause(server, tmp_path):
    # The server goes away under load: each failure says why, not the client's "the stream is no longer in valid
    # state" (all that 432 failures in a row said once the first one had broken the stream).
    stats = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}")

    def answered():
        return stats.get_inference_statistics("ensemble")["model_stats"][0]["inference_stats"]["success"]["count"]

    port, before, csv_prefix = Ports.free().grpc, answered(), tmp_path / "locust"
    with forwarding({port: server.grpc}) as cut, open(tmp_path / "locust.log", "w") as log:
        locust = subprocess.Popen(locust_command(["GrpcStreamUser"], ["--grpc-url", f"127.0.0.1:{port}"], csv_prefix,
                                                 count=2, requests=None),
                                  cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_for(lambda: answered() > before or locust.poll() is not None, timeout_s=120)
            cut()
            # the requests in flight, and those sent after the cut (each on a new stream)
            wait_for(lambda: sum(failures_recorded(csv_prefix).values()) > 2 or locust.poll() is not None,
                     timeout_s=120)
        finally:
            locust.terminate()  # Locust's SIGTERM: stops its users, writes its files, exits 1 if a request failed
            locust.wait(timeout=120)
    assert locust.returncode == 1, (tmp_path / "locust.log").read_text()[-3000:]
    errors = failures_recorded(csv_prefix)
    assert sum(errors.values()) > 2, errors
    for error in errors:
        assert re.match(r"[A-Z_]+: \S", error) and "no longer in valid state" not in error, errors


@pytest.mark.server
def test_distributed_locust_master_and_workers_as_the_compose_stack_runs_them(server, tmp_path):
    """The compose stack's Locust: a master and two workers (docker/compose.yaml's commands), here as processes. The
    workers are told the users too: a worker checks every user it may run at start, and there is no OpenAI service
    here for ChatStreamUser."""
    master_port = _free_port_pair()
    users = ["StreamUser", "GrpcStreamUser"]
    target = ["--host", f"http://127.0.0.1:{server.http}", "--grpc-url", f"127.0.0.1:{server.grpc}"]
    locust = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE)]
    workers = [subprocess.Popen([*locust, *users, "--worker", "--master-host", "127.0.0.1",
                                 "--master-port", str(master_port), *target, "--loglevel", "WARNING"],
                                cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        master = subprocess.run(locust_command(users, ["--master", "--master-bind-port", str(master_port),
                                                       "--expect-workers", "2", "--expect-workers-max-wait", "120",
                                                       *target], tmp_path / "locust", count=4),
                                cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=LOCUST_BOUND_S + 120)
    finally:
        for worker in workers:
            try:
                worker.wait(timeout=60)  # the master tells its workers to quit when it ends
            except subprocess.TimeoutExpired:
                worker.kill()
    assert master.returncode == 0, master.stderr[-3000:]
    rows = stats_rows(tmp_path / "locust")
    for name in ("generate_stream", "grpc_stream"):
        assert int(rows[name]["Request Count"]) > 0 and rows[name]["Failure Count"] == "0", (name, rows.get(name))
    assert all(worker.returncode == 0 for worker in workers), [w.stderr.read()[-2000:] for w in workers]
