"""The Batch API's pieces without a server: batch input files read into lines (a whole file refused only when it is
not a batch file for the endpoint; each bad line kept with its own error), and the runner over a real SQLite store
with a stand-in for the live endpoint (the server tests, tests/test_batch_api.py, run the real one): every line once,
transient failures retried, a restart running only the lines without a result, cancel, expiry, retention, and lines
ordered so that shared prompt prefixes run together."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from openai_api.batch import runner as runner_module
from openai_api.batch.input_file import BatchFileError, read_lines
from openai_api.batch.runner import BatchRunner, RunnerConfig, prefix_key
from openai_api.batch.store import Store, batch_record

CHAT = "/v1/chat/completions"


def line(custom_id, content="hi", system="You are terse.", url=CHAT, **extra):
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def write(tmp_path, *lines: str) -> object:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def read(tmp_path, *lines, max_line_bytes=1 << 20):
    return read_lines(write(tmp_path, *lines), CHAT, max_lines=100, max_line_bytes=max_line_bytes)


# --- input files ---

@pytest.mark.parametrize("lines, message", [
    ((), "has no lines"),
    (("a,b,c", "1,2,3"), "is not JSONL"),
    ((line("a"), line("b", url="/v1/embeddings")), "line 2: url '/v1/embeddings' does not match"),
    (tuple(line(str(i)) for i in range(101)), "101 lines, more than the limit of 100"),
])
def test_a_file_that_is_not_a_batch_for_the_endpoint_is_refused_whole(tmp_path, lines, message):
    with pytest.raises(BatchFileError, match=message):
        read(tmp_path, *lines)


def test_each_bad_line_gets_its_own_error_and_the_good_ones_run(tmp_path):
    lines = read(tmp_path, line("a"), "{not json", line("a"), line("b", method="GET"), json.dumps(
        {"custom_id": "c", "method": "POST", "body": {}}), line("d", extra_field=1), line("e", "x" * 300),
        line("f"), max_line_bytes=250)
    errors = {ln.line: ln.result["error"]["code"] for ln in lines if ln.failed}
    assert errors == {2: "invalid_json", 3: "duplicate_custom_id", 4: "invalid_line", 5: "invalid_line",
                      6: "invalid_line", 7: "line_too_large"}
    assert [ln.custom_id for ln in lines if not ln.failed] == ["a", "f"]
    assert "line 3" in lines[2].result["error"]["message"]


def test_lines_sharing_a_prefix_sort_together():
    bodies = [json.loads(line(str(i), f"q{i}", system=f"S{i % 2}"))["body"] for i in range(4)]
    assert [b["messages"][0]["content"] for b in sorted(bodies, key=prefix_key)] == ["S0", "S0", "S1", "S1"]


# --- the runner ---

class Endpoint:
    """Stands in for the live endpoint: answers each body with its user text, after ``fail_first`` 503s per line;
    ``hold`` (a coroutine function, such as an asyncio.Event's wait) is awaited by every call before it answers."""

    def __init__(self, fail_first=0, hold=None):
        self.calls, self.fail_first, self.hold, self.failures = [], fail_first, hold, {}

    async def __call__(self, endpoint, body, owner):
        content = body["messages"][-1]["content"]
        self.calls.append(content)
        if self.hold is not None:
            await self.hold()
        if self.failures.get(content, 0) < self.fail_first:
            self.failures[content] = self.failures.get(content, 0) + 1
            return 503, {"error": {"message": "queue full", "type": "server_error", "param": None, "code": None}}
        return 200, {"id": f"chatcmpl-{content}", "choices": [{"message": {"content": content}}],
                     "usage": {"completion_tokens": 1}}


def new_batch(store, tmp_path, n, window_s=3600, owner="o"):
    lines = read(tmp_path, *[line(f"id{i}", f"q{i}") for i in range(n)])
    record = batch_record("file-x", CHAT, lines, None, int(time.time()), window_s)
    store.add_batch(owner, record, lines)
    return record["id"]


async def run_until(store, runner, batch_id, statuses=("completed", "cancelled", "expired", "failed"), timeout=30):
    return await until(store, batch_id, lambda record: record["status"] in statuses, timeout)


async def until(store, batch_id, condition, timeout=30) -> dict:
    """Polls the batch until `condition(record)` holds; the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not condition(record := store.get_batch(None, batch_id)):
        assert time.monotonic() < deadline, record
        await asyncio.sleep(0.01)
    return record


def output(store, record, key="output_file_id"):
    file_id = record[key]
    return [json.loads(x) for x in store.file_path(file_id).read_text().splitlines()] if file_id else []


def test_every_line_runs_once_and_transient_failures_are_retried(tmp_path):
    store = Store(tmp_path / "data")
    batch_id = new_batch(store, tmp_path, 6)
    endpoint = Endpoint(fail_first=2)

    async def main():
        runner = BatchRunner(store, endpoint, RunnerConfig(concurrency=3, retry_first_s=0.01))
        runner.start()
        record = await run_until(store, runner, batch_id)
        await runner.stop()
        return record

    record = asyncio.run(main())
    assert record["status"] == "completed" and record["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert sorted(r["custom_id"] for r in output(store, record)) == [f"id{i}" for i in range(6)]
    assert len(endpoint.calls) == 18, "each line: two 503s, then its answer"
    assert record["error_file_id"] is None and record["completed_at"] >= record["in_progress_at"]


def test_after_a_restart_only_lines_without_a_result_run(tmp_path):
    store = Store(tmp_path / "data")
    batch_id = new_batch(store, tmp_path, 5)
    for n in (1, 2):  # done before the "crash"
        store.finish_line(batch_id, n, {"custom_id": f"id{n - 1}", "response": {"status_code": 200}}, False)
    store.change_batch(batch_id, lambda r: {**r, "status": "in_progress"})
    store.close()
    store = Store(tmp_path / "data")  # the process restarted
    endpoint = Endpoint()

    async def main():
        runner = BatchRunner(store, endpoint, RunnerConfig(concurrency=2))
        runner.start()
        record = await run_until(store, runner, batch_id)
        await runner.stop()
        return record

    record = asyncio.run(main())
    assert sorted(endpoint.calls) == ["q2", "q3", "q4"]
    assert sorted(r["custom_id"] for r in output(store, record)) == [f"id{i}" for i in range(5)]
    assert not store.finish_line(batch_id, 1, {}, False), "a line's result is written once"


def test_cancel_stops_new_lines_and_keeps_finished_ones(tmp_path):
    store = Store(tmp_path / "data")
    batch_id = new_batch(store, tmp_path, 10)

    async def main():
        gate = asyncio.Event()
        endpoint = Endpoint(hold=gate.wait)
        runner = BatchRunner(store, endpoint, RunnerConfig(concurrency=2))
        runner.start()
        while len(endpoint.calls) < 2:
            await asyncio.sleep(0.01)
        store.change_batch(batch_id, lambda r: {**r, "status": "cancelling"})
        runner.wake()
        gate.set()  # the two lines in flight finish
        record = await run_until(store, runner, batch_id)
        await runner.stop()
        return record, endpoint

    record, endpoint = asyncio.run(main())
    assert record["status"] == "cancelled" and len(endpoint.calls) == 2
    assert len(output(store, record)) == 2 and record["request_counts"]["completed"] == 2


def test_a_batch_past_its_window_expires_with_an_error_line_for_each_line_left(tmp_path):
    store = Store(tmp_path / "data")
    batch_id = new_batch(store, tmp_path, 3, window_s=-1)
    endpoint = Endpoint()

    async def main():
        runner = BatchRunner(store, endpoint)
        runner.start()
        record = await run_until(store, runner, batch_id)
        await runner.stop()
        return record

    record = asyncio.run(main())
    assert record["status"] == "expired" and endpoint.calls == []
    assert [e["error"]["code"] for e in output(store, record, "error_file_id")] == ["batch_expired"] * 3


def test_retention_deletes_ended_batches_and_old_files(tmp_path):
    store = Store(tmp_path / "data")
    batch_id = new_batch(store, tmp_path, 1)
    store.change_batch(batch_id, lambda r: {**r, "status": "completed", "created_at": 0})
    upload = tmp_path / "upload"
    upload.write_text("x")
    store.add_file("o", "f.jsonl", "batch", upload, 1, expires_at=10)
    BatchRunner(store, Endpoint(), RunnerConfig(retention_s=100)).sweep(now=1000)
    assert store.get_batch(None, batch_id) is None and store.list_files("o") == []


def test_owners_see_only_their_own(tmp_path):
    store = Store(tmp_path / "data")
    batch_id = new_batch(store, tmp_path, 1, owner="a")
    assert store.get_batch("a", batch_id) and store.get_batch("b", batch_id) is None
    assert store.list_batches("b") == []


def test_a_line_still_retried_when_the_window_closes_makes_the_batch_expire_with_it_reported(tmp_path, monkeypatch):
    """The runner's clock is moved past the window once the two good lines are written, so the window closes on
    the line that is still retried whatever the machine's speed."""
    store = Store(tmp_path / "data")
    batch_id = new_batch(store, tmp_path, 3)
    endpoint = Endpoint()
    endpoint.failures, endpoint.fail_first = {"q0": -10**9}, 1  # q0 is refused with 503 for ever, the others never
    late = []
    monkeypatch.setattr(runner_module, "time", SimpleNamespace(time=lambda: time.time() + sum(late),
                                                               monotonic=time.monotonic))

    async def main():
        runner = BatchRunner(store, endpoint, RunnerConfig(concurrency=3, retry_first_s=0.05, retry_max_s=0.2))
        runner.start()
        await until(store, batch_id, lambda record: record["request_counts"]["completed"] == 2)
        assert endpoint.calls.count("q0") >= 1 and store.get_batch(None, batch_id)["status"] == "in_progress"
        late.append(2 * 3600)
        record = await run_until(store, runner, batch_id)
        await runner.stop()
        return record

    record = asyncio.run(main())
    assert record["status"] == "expired"
    assert sorted(r["custom_id"] for r in output(store, record)) == ["id1", "id2"]
    assert [(e["custom_id"], e["error"]["code"]) for e in output(store, record, "error_file_id")] == [
        ("id0", "batch_expired")]


def test_a_finished_line_adds_itself_to_the_counts_without_recounting_the_batch(tmp_path):
    """One line at a time: each call waits until the counts a client polls show every line answered before it, so
    a line that does not add itself holds the next one (until a timeout that only bounds a hang)."""
    store = Store(tmp_path / "data")
    batch_id = new_batch(store, tmp_path, 40)
    recounts = []
    recount = store.counts
    store.counts = lambda b: recounts.append(b) or recount(b)
    seen, behind = [], []  # what a client polling the batch saw as each line started; a call that gave up waiting

    def completed() -> int:
        return store.get_batch(None, batch_id)["request_counts"]["completed"]

    async def counts_caught_up():
        answered = len(endpoint.calls) - 1  # every earlier call has returned its 200 (concurrency 1)
        deadline = time.monotonic() + 10
        while not behind and completed() < answered:
            if time.monotonic() > deadline:
                behind.append(answered)  # the later lines run without waiting, so that the batch still ends
            await asyncio.sleep(0.005)
        seen.append(completed())

    endpoint = Endpoint(hold=counts_caught_up)

    async def main():
        runner = BatchRunner(store, endpoint, RunnerConfig(concurrency=1))
        runner.start()
        record = await run_until(store, runner, batch_id, timeout=60)
        await runner.stop()
        return record

    record = asyncio.run(main())
    assert record["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    assert seen == list(range(40)), f"the counts rise with each line while the batch runs: {seen}"
    assert len(recounts) <= 5, f"a recount per status change, not per line: {len(recounts)}"


def test_stop_ends_the_runner_even_when_a_wake_races_the_cancel(tmp_path):
    """Python 3.11's wait_for can swallow a cancel that arrives as the awaited event is set (a batch ending wakes
    the runner's loop just as the server stops it): stop() must end the loop anyway."""
    store = Store(tmp_path / "data")

    async def main():
        for _ in range(20):
            runner = BatchRunner(store, Endpoint(), RunnerConfig())
            runner.start()
            await asyncio.sleep(0.05)  # the loop waits on its wake event
            runner.wake()
            await asyncio.wait_for(runner.stop(), timeout=10)

    asyncio.run(main())
