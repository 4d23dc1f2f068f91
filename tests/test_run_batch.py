"""The batch runner (scripts/clients/run_batch.py): bad lines, ordering, resuming, retries and concurrency against a
local stub HTTP server; then, against the real front (marker `server`), answers equal to live ones, an interrupted
run resumed, and bad lines beside good ones."""

import contextlib
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from scripts.clients import run_batch
from scripts.clients.run_batch import BatchLine, order_key, parse_lines, read_done
from scripts.paths import PROJECT_ROOT
from tests.helpers import http_stub, wait_for


def batch_line(custom_id: str, content: str, system: str = "Be brief.", **body) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": messages, **body}}


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_text().splitlines()] if path.exists() else []


def ids(*paths: Path) -> list:
    return [record["custom_id"] for path in paths for record in records(path)]


# --- lines, order, resume: no server ---

def test_each_bad_line_is_an_error_record_with_its_line_number_and_the_good_lines_parse():
    raw = [b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
           b"not json", b"[1, 2]", b"", b'{"method": "POST", "url": "/v1/completions", "body": {}}',
           b'{"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}',
           b'{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}}',
           b'{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": "hi"}',
           b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y"}}',
           b'{"custom_id": "e", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}',
           b'{"custom_id": "f", "method": "POST", "url": "/v1/completions", "body": {"stream": true}}',
           b'\xff{"custom_id": "g"}']
    lines, errors = parse_lines(raw)
    assert [(line.number, line.custom_id) for line in lines] == [(1, "a"), (10, "e")]
    assert lines[0] == BatchLine(1, "a", "/v1/completions", {"prompt": "x"})
    assert [(e["custom_id"], e["error"]["code"], e["error"]["message"].split(":")[0]) for e in errors] == [
        (None, "invalid_line", "line 2"), (None, "invalid_line", "line 3"), (None, "invalid_line", "line 5"),
        ("b", "invalid_line", "line 6"), ("c", "invalid_line", "line 7"), ("d", "invalid_line", "line 8"),
        # the duplicate's record has no custom_id: "a" names the first line's result alone
        (None, "duplicate_custom_id", "line 9"), ("f", "invalid_line", "line 11"), (None, "invalid_line", "line 12")]
    assert "first on line 1" in errors[6]["error"]["message"]
    assert all(e["response"] is None and e["id"].startswith("batch_req_") and len(e["id"]) == 34 for e in errors)


def test_lines_sharing_a_system_message_run_together_and_equal_keys_keep_file_order():
    lines = [BatchLine(n, f"id{n}", "/v1/chat/completions", body) for n, body in enumerate([
        batch_line("", "b question", system="System B")["body"],
        batch_line("", "a question", system="System A")["body"],
        batch_line("", "b question", system="System B", max_tokens=1)["body"],
        batch_line("", "a question", system="System A", max_tokens=2)["body"],
        batch_line("", "another a", system="System A")["body"],
        {"messages": [{"role": "user", "content": "no system"}]}])]
    completions = [BatchLine(10 + n, f"c{n}", "/v1/completions", {"prompt": p}) for n, p in enumerate(["z", "y", "z"])]
    ordered = sorted(lines + completions, key=order_key)
    assert [line.custom_id for line in ordered] == ["id5", "id1", "id3", "id4", "id0", "id2", "c1", "c0", "c2"]


def test_resume_reading_cuts_off_a_last_line_cut_short_and_finds_ids_and_bad_line_numbers(tmp_path):
    path = tmp_path / "out.errors.jsonl"
    whole = (json.dumps({"custom_id": "a", "response": {}}) + "\n"
             + json.dumps({"custom_id": None, "error": {"code": "invalid_line", "message": "line 7: not JSON"}}) + "\n")
    path.write_text(whole + '{"custom_id": "b", "respo')
    assert read_done(path) == {"a", 7}
    assert path.read_text() == whole
    assert read_done(tmp_path / "absent.jsonl") == set()


def test_the_errors_file_sits_next_to_the_output():
    assert run_batch.errors_path(Path("x/out.jsonl")) == Path("x/out.errors.jsonl")
    assert run_batch.errors_path(Path("results")) == Path("results.errors.jsonl")


# --- against a stub HTTP server ---

class Stub:
    """A local HTTP server in a thread: GET /v1/models gives a card with max_batch_size; each POST is answered by
    `answer(body, seen)` -> (status, JSON), where seen counts earlier POSTs with the same body; a POST is in flight
    until its answer is made."""

    def __init__(self, answer, max_batch_size: int | None = None):
        self.answer, self.posts, self.in_flight, self.most_in_flight = answer, [], 0, 0
        self.card = {"id": "m", "object": "model", **({"max_batch_size": max_batch_size} if max_batch_size else {})}
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.reply(200, {"object": "list", "data": [stub.card]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with stub.lock:
                    seen = sum(post["body"] == body for post in stub.posts)
                    stub.posts.append({"path": self.path, "body": body, "time": time.monotonic(),
                                       "authorization": self.headers.get("authorization")})
                    stub.in_flight += 1
                    stub.most_in_flight = max(stub.most_in_flight, stub.in_flight)
                status, answer = stub.answer(body, seen)
                with stub.lock:
                    stub.in_flight -= 1
                self.reply(status, answer)

            def reply(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("x-request-id", f"req-{len(stub.posts)}")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._serving = contextlib.ExitStack()
        self.url = f"http://127.0.0.1:{self._serving.enter_context(http_stub(Handler)).server_address[1]}"

    def close(self):
        self._serving.close()  # a second close does nothing


def completion(text: str = "ok", tokens: int = 3) -> tuple[int, dict]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    return 200, {"object": "chat.completion", "choices": [choice],
                 "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}}


def openai_error(status: int, message: str) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


def by_content(body: dict, seen: int) -> tuple[int, dict]:
    """busy: 503 twice, then 200; refuse: 400; crash: 500 always; anything else: 200."""
    content = body["messages"][-1]["content"]
    if content == "busy" and seen < 2:
        return openai_error(503, "the server is busy")
    if content == "refuse":
        return openai_error(400, "bad field")
    if content == "crash":
        return openai_error(500, "boom")
    return completion(f"answer to {content}")


@pytest.fixture
def stub():
    stubs = []

    def start(answer=by_content, **kwargs) -> Stub:
        stubs.append(Stub(answer, **kwargs))
        return stubs[-1]

    yield start
    for started in stubs:
        started.close()


def test_a_503_is_retried_with_growing_backoff_and_the_answer_written_once(stub, tmp_path, monkeypatch):
    server = stub()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    source = write_lines(tmp_path / "in.jsonl", [batch_line("t1", "busy"), batch_line("t2", "hi")])
    assert run_batch.main(["-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--url", server.url]) == 0
    busy = [post["time"] for post in server.posts if post["body"]["messages"][-1]["content"] == "busy"]
    assert len(busy) == 3
    assert 0.25 <= busy[1] - busy[0] and 0.5 <= busy[2] - busy[1] <= 2.0  # 0.5 s then 1 s, each jittered to 50-100 %
    assert {post["authorization"] for post in server.posts} == {"Bearer sk-env"}
    output = {record["custom_id"]: record for record in records(tmp_path / "out.jsonl")}
    assert sorted(output) == ["t1", "t2"] and not (tmp_path / "out.errors.jsonl").exists()
    assert output["t1"]["response"]["status_code"] == 200 and output["t1"]["error"] is None
    assert output["t1"]["response"]["body"]["choices"][0]["message"]["content"] == "answer to busy"
    assert output["t1"]["response"]["request_id"].startswith("req-")


def test_batch_lines_carry_priority_1_unless_they_set_their_own(stub, tmp_path):
    server = stub()
    source = write_lines(tmp_path / "in.jsonl", [batch_line("t1", "a"), batch_line("t2", "b", priority=0)])
    assert run_batch.main(["-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--url", server.url]) == 0
    assert {p["body"]["messages"][-1]["content"]: p["body"]["priority"] for p in server.posts} == {"a": 1, "b": 0}
    assert {post["authorization"] for post in server.posts} == {None}


def test_refused_and_crashing_requests_are_error_lines_and_each_custom_id_appears_once(stub, tmp_path):
    server = stub()
    lines = [batch_line("ok", "hi"), batch_line("refused", "refuse"), batch_line("crash", "crash"), "not json",
             batch_line("ok", "again")]
    out = tmp_path / "out.jsonl"
    assert run_batch.main(["-i", str(write_lines(tmp_path / "in.jsonl", lines)), "-o", str(out),
                           "--url", server.url]) == 0
    errors = records(tmp_path / "out.errors.jsonl")
    assert ids(out) == ["ok"]
    bad = [(e["custom_id"], e["error"]["code"], e["error"]["message"][:7]) for e in errors if e["response"] is None]
    assert bad == [(None, "invalid_line", "line 4:"), (None, "duplicate_custom_id", "line 5:")]
    refused = {e["custom_id"]: e["response"] for e in errors if e["response"] is not None}
    assert sorted(refused) == ["crash", "refused"]
    assert refused["refused"]["status_code"] == 400 and refused["refused"]["body"]["error"]["message"] == "bad field"
    assert refused["crash"]["status_code"] == 500
    assert sum(post["body"]["messages"][-1]["content"] == "crash" for post in server.posts) == 3  # 2 retries
    assert sum(post["body"]["messages"][-1]["content"] == "refuse" for post in server.posts) == 1


def test_a_line_gives_up_after_max_retry_s_on_503_and_on_connection_errors(stub, tmp_path):
    server = stub(lambda body, seen: openai_error(503, "busy"))
    source = write_lines(tmp_path / "in.jsonl", [batch_line("t1", "x")])
    started = time.monotonic()
    assert run_batch.main(["-i", str(source), "-o", str(tmp_path / "a.jsonl"), "--url", server.url,
                           "--max-retry-s", "1"]) == 0
    # Gave up after about 1 s, not after the default 600 s: the bound tells those apart on any machine's speed.
    assert time.monotonic() - started < 60
    [error] = records(tmp_path / "a.errors.jsonl")
    assert error["custom_id"] == "t1" and error["response"]["status_code"] == 503 and len(server.posts) >= 2
    dead = server.url
    server.close()
    assert run_batch.main(["-i", str(source), "-o", str(tmp_path / "b.jsonl"), "--url", dead, "--concurrency", "1",
                           "--max-retry-s", "1"]) == 0
    [error] = records(tmp_path / "b.errors.jsonl")
    assert error["custom_id"] == "t1" and error["error"]["code"] == "connection_error"


def test_no_server_or_a_refused_key_stops_the_run_without_writing_a_line(stub, tmp_path, capsys):
    server = stub(lambda body, seen: openai_error(401, "Invalid API key"))
    source = write_lines(tmp_path / "in.jsonl", [batch_line(f"t{i}", "x") for i in range(5)])
    assert run_batch.main(["-i", str(source), "-o", str(tmp_path / "a.jsonl"), "--url", server.url,
                           "--api-key", "sk-secret-key"]) == 1
    assert records(tmp_path / "a.jsonl") == [] and records(tmp_path / "a.errors.jsonl") == []
    assert "401" in capsys.readouterr().err
    server.close()
    assert run_batch.main(["-i", str(source), "-o", str(tmp_path / "b.jsonl"), "--url", server.url,
                           "--api-key", "sk-secret-key"]) == 1
    captured = capsys.readouterr()
    assert "no server answers" in captured.err and "sk-secret-key" not in captured.out + captured.err


def test_an_existing_output_is_not_overwritten_without_resume_or_overwrite(stub, tmp_path):
    server = stub()
    source = write_lines(tmp_path / "in.jsonl", [batch_line("t1", "x")])
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    assert run_batch.main(["-i", str(source), "-o", str(out), "--url", server.url]) == 2
    assert out.read_text() == "precious\n" and server.posts == []
    assert run_batch.main(["-i", str(source), "-o", str(out), "--url", server.url, "--overwrite"]) == 0
    assert ids(out) == ["t1"]


def test_concurrency_defaults_to_the_model_cards_max_batch_size(stub, tmp_path):
    """Every request is held until three are in flight at once, so that they overlap however fast the machine (a
    timeout, once, only bounds a run that never gets there)."""
    three_at_once = threading.Event()

    def once_three_are_in_flight(body, seen):
        if server.in_flight >= 3:
            three_at_once.set()
        if not three_at_once.wait(30):
            three_at_once.set()
        return completion()

    server = stub(once_three_are_in_flight, max_batch_size=3)
    source = write_lines(tmp_path / "in.jsonl", [batch_line(f"t{i}", f"x{i}") for i in range(9)])
    assert run_batch.main(["-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--url", server.url]) == 0
    assert server.most_in_flight == 3 and len(ids(tmp_path / "out.jsonl")) == 9


def test_lines_sharing_a_prefix_are_sent_together(stub, tmp_path):
    server = stub()
    lines = [batch_line("1", "q1", system="B"), batch_line("2", "q1", system="A"), batch_line("3", "q2", system="B"),
             batch_line("4", "q2", system="A")]
    source = write_lines(tmp_path / "in.jsonl", lines)
    assert run_batch.main(["-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--url", server.url,
                           "--concurrency", "1"]) == 0
    assert [[m["content"] for m in post["body"]["messages"]] for post in server.posts] == [
        ["A", "q1"], ["A", "q2"], ["B", "q1"], ["B", "q2"]]


def test_each_result_is_on_disk_before_the_next_one_arrives(stub, tmp_path):
    release = threading.Event()

    def hold_the_second(body, seen):
        if body["messages"][-1]["content"] == "second":
            release.wait(30)
        return completion()

    server = stub(hold_the_second)
    source = write_lines(tmp_path / "in.jsonl", [batch_line("t1", "first"), batch_line("t2", "second")])
    out = tmp_path / "out.jsonl"
    process = run_batch_process(source, out, server.url, "--concurrency", "1")
    try:
        wait_for_lines(process, out, 1, timeout_s=20)
    finally:
        release.set()
    assert process.wait(timeout=30) == 0 and ids(out) == ["t1", "t2"]


def run_batch_process(source: Path, out: Path, url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "scripts.run_batch", "-i", str(source), "-o", str(out),
                             "--url", url, *args], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for_lines(process: subprocess.Popen, out: Path, lines: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len(records(out)) < lines:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)


def test_a_run_stopped_by_sigterm_exits_143_and_resume_finishes_it_with_each_custom_id_once(stub, tmp_path):
    """The stub answers three lines and holds the rest until the test releases them, so the SIGTERM lands with three
    lines written and two in flight, however fast the machine: those two alone are sent again."""
    release, answered = threading.Event(), itertools.count(1)

    def three_then_hold(body, seen):
        if next(answered) > 3:
            release.wait(60)
        return completion()

    server = stub(three_then_hold)
    source = write_lines(tmp_path / "in.jsonl", [batch_line(f"t{i:02d}", f"x{i}") for i in range(30)] + ["bad"])
    out = tmp_path / "out.jsonl"
    first = run_batch_process(source, out, server.url, "--concurrency", "2")
    try:
        wait_for_lines(first, out, 3)
        wait_for(lambda: len(server.posts) == 5, 60, message="two more lines in flight")
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=30)  # the two lines in flight are cancelled, not waited for
    finally:
        release.set()
    assert first.returncode == 143, stderr
    assert "done" in stdout and "--resume" in stderr
    assert len(records(out)) == 3
    with open(out, "a") as file:
        file.write('{"custom_id": "t29", "resp')  # a kill in the middle of a write
    second = run_batch_process(source, out, server.url, "--resume")
    stdout, stderr = second.communicate(timeout=60)
    assert second.returncode == 0, stderr
    assert sorted(ids(out)) == [f"t{i:02d}" for i in range(30)]
    assert ids(tmp_path / "out.errors.jsonl") == [None]  # the bad line, reported once
    assert "27 done, 0 failed, 4 skipped (resumed)" in stdout
    assert len(server.posts) == 30 + 2, "only the two lines in flight at the interrupt were sent twice"


# --- against the real front ---

@pytest.fixture(scope="module")
def api(service):
    """The session's OpenAI front (tests/conftest.py: `service`), as a URL."""
    return f"http://127.0.0.1:{service}"


QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello.",
             "What do bees make?", "Name a planet."]


@pytest.mark.server
def test_batch_answers_equal_the_same_requests_sent_live_one_by_one(api, model, tmp_path):
    from openai import OpenAI

    lines = [batch_line(f"q{i:02d}", question, system=system, model=model, max_tokens=8, temperature=0)
             for i, (system, question) in enumerate((s, q) for s in ("Be brief.", "Answer like a pirate.")
                                                     for q in QUESTIONS)]
    out = tmp_path / "out.jsonl"
    assert run_batch.main(["-i", str(write_lines(tmp_path / "in.jsonl", lines)), "-o", str(out), "--url", api]) == 0
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in records(out)}
    assert sorted(answers) == [line["custom_id"] for line in lines]
    client = OpenAI(base_url=f"{api}/v1", api_key="unused")
    live = {line["custom_id"]: client.chat.completions.create(**line["body"]).choices[0].message.content
            for line in lines}
    assert answers == live


@pytest.mark.server
def test_an_evaluation_line_scores_its_prompts_as_live(api, model, tokenizer, tmp_path):
    """lm-eval's request as a batch line: token-id prompts, echo, logprobs, max_tokens 0 (score only)."""
    from openai import OpenAI

    body = {"model": model, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0,
            "prompt": [tokenizer.encode(p, apply_chat_template=False) for p in ("Bees make honey", "Bees make cars")]}
    lines = [{"custom_id": "eval", "method": "POST", "url": "/v1/completions", "body": body}]
    out = tmp_path / "out.jsonl"
    assert run_batch.main(["-i", str(write_lines(tmp_path / "in.jsonl", lines)), "-o", str(out), "--url", api]) == 0
    [record] = records(out)
    choices = record["response"]["body"]["choices"]
    live = OpenAI(base_url=f"{api}/v1", api_key="unused").completions.create(**body).choices
    for batched, alone in zip(choices, live):  # as live, up to the fp32 export's rounding in another batch
        assert batched["logprobs"]["token_logprobs"][0] is None
        assert batched["logprobs"]["token_logprobs"][1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-5)
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [len(p) for p in body["prompt"]]
    assert sum(choices[0]["logprobs"]["token_logprobs"][1:]) > sum(choices[1]["logprobs"]["token_logprobs"][1:])


@pytest.mark.server
def test_a_run_interrupted_on_the_real_front_resumes_with_each_custom_id_once(api, model, tmp_path):
    lines = [batch_line(f"t{i:02d}", f"Count from {i} to {i + 9}.", model=model, max_tokens=16, temperature=0)
             for i in range(40)]
    source, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    first = run_batch_process(source, out, api, "--concurrency", "2")
    wait_for_lines(first, out, 3, timeout_s=120)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 130, stderr
    assert len(records(out)) < 40
    second = run_batch_process(source, out, api, "--resume")
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    assert sorted(ids(out, tmp_path / "out.errors.jsonl")) == [line["custom_id"] for line in lines]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] > 0 for r in records(out))


@pytest.mark.server
def test_a_bad_line_and_an_unknown_model_are_error_lines_and_the_rest_completes(api, model, tmp_path):
    lines = [batch_line("good1", "Say hi.", model=model, max_tokens=4), "{not json",
             batch_line("unknown", "Say hi.", model="no-such-model", max_tokens=4),
             batch_line("good2", "Say bye.", model=model, max_tokens=4)]
    out = tmp_path / "out.jsonl"
    assert run_batch.main(["-i", str(write_lines(tmp_path / "in.jsonl", lines)), "-o", str(out), "--url", api]) == 0
    assert sorted(ids(out)) == ["good1", "good2"]
    errors = {record["custom_id"]: record for record in records(tmp_path / "out.errors.jsonl")}
    assert sorted(errors, key=str) == [None, "unknown"]
    assert errors[None]["error"]["message"].startswith("line 2:")
    assert errors["unknown"]["response"]["status_code"] == 404
    assert "no-such-model" in errors["unknown"]["response"]["body"]["error"]["message"]
