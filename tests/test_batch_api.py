"""OpenAI's Files and Batch API on this front (openai_api/batch/), against the real tritonserver and model, driven by
the official `openai` client: a batch's greedy answers equal the same bodies sent live; structured outputs and tool
calls work in batch lines; each bad line ends in the error file with its code while the rest runs, and a file that
is no batch file is a 400 that says why; a batch survives `kill -9` of the front and a restart, each line done once;
a cancel stops it midway and keeps the lines done; with API keys, a request without a valid key is 401 and one key
never sees another's files and batches; and the front's metrics count batches, lines and their tokens."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openai_api.batch.store import Store
from scripts.launcher.openai_server import running_openai_api, start_openai_api
from scripts.launcher.processes import terminate
from tests.helpers import CITY, WEATHER, lazy_module, metrics, wait_for, wait_idle

openai = lazy_module("openai")

pytestmark = pytest.mark.server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDED = ("completed", "failed", "expired", "cancelled")
BATCH_TIMEOUT_S = 300
MAX_TOKENS = 6
# A long batch's lines each run exactly LONG_LINE_TOKENS tokens (the end tokens banned), 2 at a time: once a few are
# done, the rest is hundreds of engine steps away on any machine, so a cancel or a kill lands midway by count, not by
# timing. A cancelled batch runs only the lines before the cancel, so its many lines cost nothing on a slow machine.
LONG_LINE_TOKENS = 32
NO_END = {"0": -100, "2": -100}  # logit_bias: <|endoftext|> and <|im_end|> never chosen
LONG_BATCH = 100
KILLED_BATCH = 20  # every line runs, before the kill or after the restart: 12 lines (384 engine steps) past KILL_AFTER
TWO_IN_FLIGHT = ("--batch-concurrency", "2")
KILL_AFTER = 8  # lines done: then a restart that ran every line again would start 8 sequences too many
QUESTIONS = ["Name a primary color.", "What is the capital of France?", "Say hello.", "Count to three."]


# --- helpers ---

def chat_body(model: str, question: str, max_tokens: int = MAX_TOKENS, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": max_tokens, **fields}


def line(custom_id: str, body: dict, url: str = CHAT) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: list[dict | bytes]) -> bytes:
    return b"".join((raw if isinstance(raw, bytes) else json.dumps(raw).encode()) + b"\n" for raw in lines)


def long_batch(model: str, lines: int = LONG_BATCH) -> bytes:
    return jsonl([line(f"q{i}", chat_body(model, f"Write a sentence about the number {i}.",
                                          max_tokens=LONG_LINE_TOKENS, logit_bias=NO_END))
                  for i in range(lines)])


def ran_in_full(output: dict) -> bool:
    return output["response"]["body"]["usage"]["completion_tokens"] == LONG_LINE_TOKENS


def upload(client: openai.OpenAI, content: bytes) -> str:
    return client.files.create(file=("in.jsonl", content), purpose="batch").id


def create(client: openai.OpenAI, content: bytes, endpoint: str = CHAT):
    return client.batches.create(input_file_id=upload(client, content), endpoint=endpoint, completion_window="24h")


def wait_batch(client: openai.OpenAI, batch_id: str, until=ENDED, timeout_s: float = BATCH_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} is still {batch.status} after {timeout_s} s"
        time.sleep(0.1)


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()]


def run_batch(client: openai.OpenAI, content: bytes, endpoint: str = CHAT):
    """Runs a batch to its end: (the batch, its output lines, its error lines)."""
    batch = wait_batch(client, create(client, content, endpoint).id)
    return batch, records(client, batch.output_file_id), records(client, batch.error_file_id)


def by_id(lines: list[dict]) -> dict[str, dict]:
    ids = [record["custom_id"] for record in lines]
    assert len(ids) == len(set(ids)), f"a custom_id is in the file more than once: {sorted(ids)}"
    return {record["custom_id"]: record for record in lines}


def error_codes(errors: list[dict]) -> list[str]:
    return sorted(record["error"]["code"] for record in errors if record["error"])


def client_for(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def front_metrics(url: str) -> dict[tuple, float]:
    """(sample name, *label values) -> value, from the front's GET /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, *sample.labels.values()): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def first_tokens(server) -> float:
    """Sequences the engine has started (its time-to-first-token histogram's count)."""
    return metrics(server)["llm_time_to_first_token_seconds_count"]


def assert_still_serves(client: openai.OpenAI, model: str) -> None:
    live = client.chat.completions.create(**chat_body(model, QUESTIONS[0], max_tokens=4))
    assert live.choices[0].message.content
    batch, outputs, errors = run_batch(client, jsonl([line("after", chat_body(model, QUESTIONS[0], max_tokens=4))]))
    assert (batch.status, errors) == ("completed", [])
    assert outputs[0]["response"]["body"]["choices"][0]["message"]["content"] == live.choices[0].message.content


def refusal(error: pytest.ExceptionInfo) -> str:
    return error.value.response.json()["error"]["message"]


# --- fixtures ---

@pytest.fixture(scope="module")
def front(server, model_dir, tmp_path_factory):
    """The front with its own data dir and 2 batch lines in flight at once; yields its URL."""
    folder = tmp_path_factory.mktemp("batch-front")
    with running_openai_api(f"127.0.0.1:{server.grpc}", model_dir, folder / "api.log", data_dir=folder / "data",
                            extra_args=TWO_IN_FLIGHT) as url:
        yield url
    print(f"front log: {folder / 'api.log'}")


@pytest.fixture(scope="module")
def client(front):
    return client_for(front)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


# --- upload, create, poll, download ---

def test_a_chat_batch_answers_each_line_once_as_the_same_body_answers_live(client, model):
    bodies = {f"chat-{i}": chat_body(model, question) for i, question in enumerate(QUESTIONS)}
    batch, outputs, errors = run_batch(client, jsonl([line(cid, body) for cid, body in bodies.items()]))
    assert batch.status == "completed" and batch.endpoint == CHAT and errors == []
    assert batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 4, 0)
    outputs = by_id(outputs)
    assert set(outputs) == set(bodies)
    for cid, body in bodies.items():
        response = outputs[cid]["response"]
        assert response["status_code"] == 200 and outputs[cid]["error"] is None
        assert response["body"]["object"] == "chat.completion"
        live = client.chat.completions.create(**body)
        assert response["body"]["choices"][0]["message"]["content"] == live.choices[0].message.content, cid


def test_a_completions_batch_answers_as_the_same_prompts_answer_live(client, model, tokenizer):
    """Text prompts, and token-id prompts with echo as an evaluation job sends them (a line of two prompts)."""
    bodies = {f"text-{i}": {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS}
              for i, prompt in enumerate(["The capital of France is", "One, two,", "Water boils at"])}
    bodies["ids-echo"] = {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS, "echo": True, "prompt": [
        tokenizer.encode(p, apply_chat_template=False) for p in ("Water boils at", "One, two,")]}
    bodies["ids-scored"] = {"model": model, "temperature": 0, "max_tokens": 1, "echo": True, "logprobs": 1,
                            "prompt": [tokenizer.encode(p, apply_chat_template=False)
                                       for p in ("Water boils at 100", "Water boils at 90")]}
    batch, outputs, errors = run_batch(client, jsonl([line(cid, body, COMPLETIONS) for cid, body in bodies.items()]),
                                       COMPLETIONS)
    assert (batch.status, batch.request_counts.completed, errors) == ("completed", 5, [])
    scored = [c["logprobs"] for c in by_id(outputs)["ids-scored"]["response"]["body"]["choices"]]
    live = client.completions.create(**bodies["ids-scored"]).choices
    # The same values as live, up to the fp32 export's rounding in another batch (its padded batch is not bit-exact
    # across batch compositions: 1e-6 seen).
    for batched, alone in zip(scored, live):
        assert batched["tokens"] == alone.logprobs.tokens and batched["token_logprobs"][0] is None
        assert batched["token_logprobs"][1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-5)
    assert scored[0]["token_logprobs"][0] is None
    assert len(scored[0]["tokens"]) == len(bodies["ids-scored"]["prompt"][0]) + 1
    echoed = [c["text"] for c in by_id(outputs)["ids-echo"]["response"]["body"]["choices"]]
    assert echoed == [p + client.completions.create(**{**bodies["text-0"], "prompt": p}).choices[0].text
                      for p in ("Water boils at", "One, two,")]
    outputs = by_id(outputs)
    assert set(outputs) == set(bodies)
    for cid, body in bodies.items():
        assert outputs[cid]["response"]["body"]["choices"][0]["text"] == client.completions.create(
            **body).choices[0].text, cid


def test_files_and_batches_are_retrieved_listed_and_deleted(client, model):
    content = jsonl([line("only", chat_body(model, QUESTIONS[2], max_tokens=4))])
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    assert (uploaded.filename, uploaded.bytes, uploaded.purpose) == ("in.jsonl", len(content), "batch")
    assert uploaded.id.startswith("file-")
    assert client.files.retrieve(uploaded.id).bytes == len(content)
    assert client.files.content(uploaded.id).content == content
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"job": "listing"})
    assert batch.id.startswith("batch_") and batch.input_file_id == uploaded.id
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.metadata == {"job": "listing"}
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)
    assert batch.id in [b.id for b in client.batches.list()]
    listed = {f.id: f.purpose for f in client.files.list()}
    assert listed[uploaded.id] == "batch" and listed[batch.output_file_id] == "batch_output"

    for file_id in (uploaded.id, batch.output_file_id):
        deleted = client.files.delete(file_id)
        assert (deleted.id, deleted.deleted) == (file_id, True)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
        assert file_id not in [f.id for f in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_0000")


# --- structured outputs ---

def test_structured_outputs_and_required_tool_calls_work_in_batch_lines(client, model):
    lines = [
        line("json", chat_body(model, "Which city is the capital of France?", max_tokens=48, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})),
        line("tool", chat_body(model, "What is the weather like in Paris?", max_tokens=48, tools=[WEATHER],
                               tool_choice="required")),
    ]
    batch, outputs, errors = run_batch(client, jsonl(lines))
    assert (batch.status, errors) == ("completed", [])
    outputs = by_id(outputs)
    answer = outputs["json"]["response"]["body"]["choices"][0]
    assert answer["finish_reason"] == "stop", answer
    jsonschema.validate(json.loads(answer["message"]["content"]), CITY)
    call = outputs["tool"]["response"]["body"]["choices"][0]
    assert call["finish_reason"] == "tool_calls" and call["message"]["tool_calls"], call
    for tool_call in call["message"]["tool_calls"]:
        assert tool_call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(tool_call["function"]["arguments"]), WEATHER["function"]["parameters"])


# --- malformed and hostile files ---

def test_unreadable_duplicate_and_oversized_lines_go_to_the_error_file_and_the_rest_runs(client, model):
    huge = line("huge", chat_body(model, "x" * (5 << 20)))
    lines = [line("good-1", chat_body(model, QUESTIONS[0])),
             b'{"custom_id": "broken", "method": "POST", "url": "/v1/chat/com',
             line("good-2", chat_body(model, QUESTIONS[1])),
             line("good-1", chat_body(model, QUESTIONS[2])),
             huge,
             line("good-3", chat_body(model, QUESTIONS[3]))]
    batch, outputs, errors = run_batch(client, jsonl(lines))
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 3, 3)
    assert sorted(by_id(outputs)) == ["good-1", "good-2", "good-3"]
    assert by_id(outputs)["good-1"]["response"]["body"]["choices"][0]["message"]["content"] == (
        client.chat.completions.create(**chat_body(model, QUESTIONS[0])).choices[0].message.content)
    assert error_codes(errors) == ["duplicate_custom_id", "invalid_json", "line_too_large"]
    found = {record["error"]["code"]: record for record in errors}
    assert found["invalid_json"]["error"]["message"].startswith("line 2:")
    assert (found["duplicate_custom_id"]["custom_id"], found["duplicate_custom_id"]["response"]) == ("good-1", None)
    assert found["line_too_large"]["error"]["message"].startswith("line 5:")
    assert_still_serves(client, model)


def test_a_line_the_endpoint_refuses_is_in_the_error_file_with_the_status_and_body_of_a_live_refusal(client, model):
    lines = [line("wrong-model", chat_body("no-such-model", QUESTIONS[0])),
             line("unknown-field", chat_body(model, QUESTIONS[0], temprature=0)),
             line("good", chat_body(model, QUESTIONS[1]))]
    batch, outputs, errors = run_batch(client, jsonl(lines))
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 1, 2)
    assert list(by_id(outputs)) == ["good"]
    errors = by_id(errors)
    assert set(errors) == {"wrong-model", "unknown-field"}
    for cid, status in (("wrong-model", 404), ("unknown-field", 400)):
        response = errors[cid]["response"]
        assert response["status_code"] == status and errors[cid]["error"] is None
        with pytest.raises(openai.APIStatusError) as live:
            body = lines[0 if cid == "wrong-model" else 1]["body"]
            client.chat.completions.create(model=body["model"], messages=body["messages"], extra_body={
                key: value for key, value in body.items() if key not in ("model", "messages")})
        assert live.value.status_code == status
        assert response["body"] == live.value.response.json()
    assert errors["wrong-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert "temprature" in errors["unknown-field"]["response"]["body"]["error"]["message"]
    assert_still_serves(client, model)


def test_a_line_the_front_fails_on_fails_alone_and_the_batch_completes(front, client, model):
    """A lone surrogate in a message once made the tokenizer raise (a 500 live, retried for 24 h in a batch); now it
    is an invalid request: a 400 live, and the same 400 as a final error line in a batch."""
    lines = [line("surrogate", chat_body(model, "\udc80")), line("good", chat_body(model, QUESTIONS[0]))]
    batch = create(client, jsonl(lines))
    try:
        # two short lines: 60 s is ample; a line retried as if transient would hold the batch for 24 h
        batch = wait_batch(client, batch.id, timeout_s=60)
    finally:
        if client.batches.retrieve(batch.id).status not in ENDED:
            client.batches.cancel(batch.id)  # so that its retries end with this test
    assert batch.status == "completed"
    assert list(by_id(records(client, batch.output_file_id))) == ["good"]
    failed = by_id(records(client, batch.error_file_id))["surrogate"]["response"]
    # json.dumps writes the surrogate as the escape \udc80, as a client's JSON encoder would
    live = urllib.request.Request(f"{front}/v1/chat/completions", data=json.dumps(lines[0]["body"]).encode(),
                                  headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(live, timeout=60)
    assert (failed["status_code"], refused.value.code) == (400, 400)
    assert failed["body"] == json.loads(refused.value.read())
    assert "lone surrogate" in failed["body"]["error"]["message"]
    assert_still_serves(client, model)


def good_line(model: str) -> dict:
    return line("good", chat_body(model, QUESTIONS[0]))


@pytest.mark.parametrize("content, endpoint, says", [
    (lambda model: b"", CHAT, "has no lines"),
    (lambda model: b"\n\n", CHAT, "has no lines"),
    (lambda model: b"name,question\nada,Say hello.\n", CHAT, "not JSONL"),
    (lambda model: jsonl([good_line(model), line("embed", {"model": model, "input": "hi"}, "/v1/embeddings")]), CHAT,
     "line 2: url '/v1/embeddings'"),
    (lambda model: jsonl([good_line(model)]), "/v1/embeddings", "endpoint must be one of"),
], ids=["empty", "blank-lines", "csv", "a-line-for-another-endpoint", "an-unknown-endpoint"])
def test_a_file_that_is_no_batch_file_for_the_endpoint_is_a_400_that_says_why(client, model, content, endpoint, says):
    file_id = upload(client, content(model))
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")
    assert says in refusal(refused)
    assert_still_serves(client, model)


def test_an_error_names_the_line_of_the_file_counting_blank_lines(client, model):
    content = jsonl([good_line(model)]) + b"\n" + jsonl([line("embed", {"input": "hi"}, "/v1/embeddings")])
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=upload(client, content), endpoint=CHAT, completion_window="24h")
    assert refusal(refused).startswith("line 3:")


def test_an_upload_for_another_purpose_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("in.jsonl", jsonl([good_line(model)])), purpose="fine-tune")
    assert "purpose must be 'batch'" in refusal(refused)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-0000", endpoint=CHAT, completion_window="24h")


# --- metrics ---

def test_the_metrics_count_batches_lines_and_their_output_tokens(front, client, model):
    before = front_metrics(front)
    batch, outputs, _ = run_batch(client, jsonl([line(f"m{i}", chat_body(model, q)) for i, q in enumerate(QUESTIONS)]))
    assert batch.status == "completed"
    tokens = sum(record["response"]["body"]["usage"]["completion_tokens"] for record in outputs)
    assert tokens > 0
    after = front_metrics(front)

    def grew(name: str, *labels: str) -> float:
        return after.get((name, *labels), 0) - before.get((name, *labels), 0)

    assert grew("openai_api_batch_lines_total", "completed") == len(QUESTIONS)
    assert grew("openai_api_batch_output_tokens_total") == tokens
    # the gauge follows the runner's loop, which looks again when a batch ends
    wait_for(lambda: front_metrics(front).get(("openai_api_batches", "completed"), 0) >= 1, 30,
             message="openai_api_batches{status=completed} stayed 0")


# --- cancel ---

def test_a_cancel_stops_the_batch_midway_and_keeps_the_lines_done(front, client, model):
    batch = create(client, long_batch(model))
    running = wait_batch(client, batch.id, until=ENDED + ("in_progress",))
    while running.status == "in_progress" and running.request_counts.completed < 2:
        time.sleep(0.05)
        running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress", "the batch ended before it could be cancelled midway"
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    outputs, errors = records(client, batch.output_file_id), records(client, batch.error_file_id)
    # no line starts after the cancel: besides the lines counted by then, only the two in flight and two that had
    # just ended, not yet counted, can finish
    done_by_the_cancel = cancelling.request_counts.completed
    assert 2 <= done_by_the_cancel <= len(outputs) <= done_by_the_cancel + 4 and errors == []
    assert all(record["response"]["status_code"] == 200 and ran_in_full(record) for record in by_id(outputs).values())
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (LONG_BATCH, len(outputs), 0)


# --- kill -9 and restart ---

def test_a_batch_survives_kill_9_of_the_front_and_each_line_runs_once(server, model_dir, tmp_path):
    triton, data_dir, log = f"127.0.0.1:{server.grpc}", tmp_path / "data", tmp_path / "api.log"
    process, url = start_openai_api(triton, model_dir, log, data_dir=data_dir, extra_args=TWO_IN_FLIGHT)
    try:
        client = client_for(url)
        batch = create(client, long_batch(client.models.list().data[0].id, KILLED_BATCH))
        running = wait_batch(client, batch.id, until=ENDED + ("in_progress",))
        while running.status == "in_progress" and running.request_counts.completed < KILL_AFTER:
            time.sleep(0.05)
            running = client.batches.retrieve(batch.id)
        assert running.status == "in_progress", "the batch ended before the kill"
        process.kill()
        process.wait()
    finally:
        terminate(process, 30)
    wait_idle(server)  # the lines in flight at the kill are over, one way or the other
    store = Store(data_dir)
    try:
        done_before = {record["custom_id"]: record for record in store.results(batch.id, failed=False)}
        total, completed, failed = store.counts(batch.id)
    finally:
        store.close()
    pending = total - completed - failed
    assert total == KILLED_BATCH and completed >= KILL_AFTER and pending > 0
    started = first_tokens(server)

    process, url = start_openai_api(triton, model_dir, log, data_dir=data_dir, port=int(url.rsplit(":", 1)[1]),
                                    extra_args=TWO_IN_FLIGHT)
    try:
        client = client_for(url)
        batch = wait_batch(client, batch.id)
        assert batch.status == "completed"
        outputs, errors = by_id(records(client, batch.output_file_id)), records(client, batch.error_file_id)
        assert len(outputs) + len(errors) == KILLED_BATCH and errors == []
        assert set(outputs) == {f"q{i}" for i in range(KILLED_BATCH)}
        assert all(ran_in_full(record) for record in outputs.values())
        assert {cid: outputs[cid] for cid in done_before} == done_before  # kept as recorded, not run again
        assert batch.request_counts.completed == KILLED_BATCH
        restarted = front_metrics(url)
        assert restarted.get(("openai_api_batch_lines_total", "completed"), 0) == pending
    finally:
        terminate(process, 30)
    wait_idle(server)
    # the 2 lines in flight at the kill may reach the engine only after `started` was read
    assert pending <= first_tokens(server) - started <= pending + 2, "lines done before the kill ran again"


# --- API keys ---

@pytest.fixture(scope="module")
def keyed_front(server, model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keyed-front")
    with running_openai_api(f"127.0.0.1:{server.grpc}", model_dir, folder / "api.log", data_dir=folder / "data",
                            api_keys=("key-a", "key-b"), extra_args=TWO_IN_FLIGHT) as url:
        yield url


def test_without_a_valid_key_every_v1_route_is_401_and_health_and_metrics_stay_open(keyed_front):
    wrong = client_for(keyed_front, "key-c")
    no_key = {"Authorization": openai.omit}  # per request: the client sends no Authorization header at all
    for headers in (no_key, None):
        calls = [lambda: wrong.models.list(extra_headers=headers),
                 # a body that would be a 400 with a key: the key is checked first
                 lambda: wrong.chat.completions.create(model="nope", messages=[], max_tokens=-1,
                                                       extra_headers=headers),
                 lambda: wrong.files.list(extra_headers=headers),
                 lambda: wrong.files.create(file=("in.jsonl", b"{}\n"), purpose="batch", extra_headers=headers),
                 lambda: wrong.batches.list(extra_headers=headers)]
        for call in calls:
            with pytest.raises(openai.AuthenticationError) as refused:
                call()
            assert refused.value.code == "invalid_api_key"
    for path in ("/health/live", "/health/ready", "/metrics"):
        with urllib.request.urlopen(f"{keyed_front}{path}", timeout=10) as response:
            assert response.status == 200, path


def test_one_key_never_sees_another_keys_files_and_batches(keyed_front):
    a, b = client_for(keyed_front, "key-a"), client_for(keyed_front, "key-b")
    model = a.models.list().data[0].id
    content = jsonl([line("a-1", chat_body(model, QUESTIONS[0], max_tokens=4))])
    file_id = upload(a, content)
    done = wait_batch(a, a.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id)
    assert done.status == "completed"
    running = create(a, long_batch(model))

    for call in (lambda: b.files.retrieve(file_id), lambda: b.files.content(file_id),
                 lambda: b.files.content(done.output_file_id), lambda: b.batches.retrieve(done.id),
                 lambda: b.batches.cancel(running.id), lambda: b.files.delete(file_id),
                 lambda: b.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(b.files.list()) == [] and list(b.batches.list()) == []
    assert a.batches.retrieve(running.id).status in ("validating", "in_progress")

    assert a.batches.cancel(running.id).status == "cancelling"
    assert wait_batch(a, running.id).status == "cancelled"
    assert a.files.content(file_id).content == content
    assert records(a, done.output_file_id)[0]["custom_id"] == "a-1"
    assert {file_id, done.output_file_id} <= {f.id for f in a.files.list()}
    assert {done.id, running.id} <= {batch.id for batch in a.batches.list()}
    assert a.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(file_id)
