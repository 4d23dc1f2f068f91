"""The peers step of the benchmark (scripts/bench/peers.py) without its peers: answers cut at EOS, agreement counting,
the reference cache, the generator's padding, a stand-in llama-server's stream and lifetime, skipped peers, the
table. Nothing here builds a peer or starts a tritonserver."""

from __future__ import annotations

import http.server
import json
import os
import sys

import numpy as np
import pytest

from scripts.bench import peers
from scripts.bench.workload import workload
from scripts.launcher.processes import free_loopback_port
from tests.helpers import http_stub


def test_an_answer_ends_before_its_first_eos_and_at_its_max_tokens():
    assert peers.answer_ids([5, 6, 2, 7, 2], 10) == [5, 6]
    assert peers.answer_ids([5, 6, 7, 8], 3) == [5, 6, 7]
    assert peers.answer_ids([2, 5], 4) == []


def by_ids(*answers):
    return [peers.Answer(ids, None, len(ids), len(ids), None) for ids in answers]


def by_text(*answers):
    return [peers.Answer(None, text, 1, 1, None) for text in answers]


def test_only_answers_equal_to_their_reference_count_as_identical():
    ids, texts = [[1, 2, 3], [4, 5], [], [7]], ["a b", "c", "", "d"]
    assert peers.identical(by_ids([1, 2, 3], [4, 5, 6], [], [8]), ids, texts) == 2  # a longer answer is not identical
    assert peers.identical(by_ids([1, 2], [4, 5], [9], [7]), ids, texts) == 2  # nor a shorter one
    with pytest.raises(AssertionError):
        peers.identical(by_ids([1, 2, 3]), ids, texts)


def test_an_answer_without_ids_is_compared_by_its_text():
    ids, texts = [[1, 2, 3], [4, 5]], ["a b", "c"]
    assert peers.identical(by_text("a b", "c "), ids, texts) == 1
    assert peers.identical(by_text("a", "c"), ids, texts) == 1


def test_the_reference_key_depends_on_the_prompt_and_max_tokens():
    key = peers.reference_key("Why is the sky blue?", 64)
    assert key == peers.reference_key("Why is the sky blue?", 64)
    assert key != peers.reference_key("Why is the sky blue?", 32)
    assert key != peers.reference_key("Why is the sky blue ?", 64)


def test_the_reference_computes_only_what_its_cache_lacks(tmp_path):
    requests = workload(3)
    cache = tmp_path / "reference.json"
    calls = []

    def greedy(prompt, max_tokens):
        calls.append((prompt, max_tokens))
        return [len(prompt), max_tokens]

    prompts = [[10], [20, 21], [30, 31, 32]]
    first = peers.fp32_reference(requests[:2], prompts[:2], cache, greedy)
    assert first == [[1, 16], [2, 32]] and len(calls) == 2
    both = peers.fp32_reference(requests, prompts, cache, greedy)
    assert both == [[1, 16], [2, 32], [3, 64]]
    assert calls[2:] == [([30, 31, 32], 64)], "the cached answers were computed again"
    peers.fp32_reference(requests, prompts, cache, greedy=lambda *_: pytest.fail("all were cached"))


def test_a_generator_batch_is_padded_on_the_right_with_the_pad_id():
    batch = peers.ogen_padded([[7, 8, 9], [5], [4, 4]], pad_id=2)
    assert batch.dtype == np.int32
    assert batch.tolist() == [[7, 8, 9], [5, 2, 2], [4, 4, 2]]


class StreamingCompletion(http.server.BaseHTTPRequestHandler):
    """/completion as llama-server streams it: an event per token (none for a token that ends inside a UTF-8
    character, here the first half of an emoji), then a final event with its own count, EOS included."""

    events = [{"content": " Hi", "tokens": [11], "stop": False},
              {"content": "\U0001f600", "tokens": [13], "stop": False},
              {"content": "", "tokens": [2], "stop": False},
              {"content": "", "tokens": [], "stop": True, "tokens_predicted": 4, "stop_type": "eos"}]

    def do_POST(self):
        StreamingCompletion.body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in self.events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def completion_url():
    with http_stub(StreamingCompletion) as server:
        yield f"http://127.0.0.1:{server.server_port}"


def test_a_llama_server_stream_gives_the_text_the_peers_count_and_a_first_token_time(completion_url):
    answer = peers.llama_complete(completion_url, [1, 2, 3], max_tokens=16)
    assert answer.ids is None and answer.text == " Hi\U0001f600"
    assert (answer.output_tokens, answer.answer_tokens) == (4, 3)
    assert answer.first_token_s is not None and answer.first_token_s >= 0
    assert StreamingCompletion.body == {"prompt": [1, 2, 3], "n_predict": 16, "temperature": 0,
                                        "cache_prompt": False, "ignore_eos": False, "stream": True,
                                        "return_tokens": True}


STAND_IN = """#!{python}
import http.server, os, sys
with open({record!r}, "w") as record:
    record.write(str(os.getpid()) + "\\n" + " ".join(sys.argv[1:]))
if {exit_at_once}:
    sys.exit(3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def stand_in_server(tmp_path, monkeypatch, exit_at_once=False):
    """A llama-server stand-in that answers /health and records its pid and arguments; returns the record's path."""
    record, binary = tmp_path / "record.txt", tmp_path / "llama-server"
    binary.write_text(STAND_IN.format(python=sys.executable, record=str(record), exit_at_once=exit_at_once))
    binary.chmod(0o755)
    monkeypatch.setattr(peers, "LLAMA_SERVER", binary)
    monkeypatch.setattr(peers, "gguf_path", lambda: tmp_path / "model.gguf")
    return record


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_llama_server_is_stopped_when_the_measurement_fails(tmp_path, monkeypatch):
    record = stand_in_server(tmp_path, monkeypatch)
    with pytest.raises(RuntimeError, match="measurement failed"):
        with peers.llama_server(slots=32, log_path=tmp_path / "server.log") as url:
            pid, arguments = record.read_text().splitlines()
            assert running(int(pid))
            raise RuntimeError("measurement failed")
    assert not running(int(pid))
    port = url.rsplit(":", 1)[1]
    assert arguments == f"-m {tmp_path / 'model.gguf'} -t 2 -np 32 -c 16384 --host 127.0.0.1 --port {port}"
    assert port != "0"


def test_a_llama_server_that_exits_at_start_is_reported_with_its_log(tmp_path, monkeypatch):
    stand_in_server(tmp_path, monkeypatch, exit_at_once=True)
    with pytest.raises(RuntimeError, match="exited with 3.*server.log"):
        with peers.llama_server(slots=1, port=free_loopback_port(), log_path=tmp_path / "server.log"):
            pass


def test_peers_that_are_not_built_are_skipped_with_their_build_command(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "LLAMA_SERVER", tmp_path / "absent" / "llama-server")
    monkeypatch.setattr(peers, "OGEN_MODEL", tmp_path / "absent-model")
    monkeypatch.setattr(peers, "prompt_ids", lambda requests: pytest.fail("nothing is measured, nothing is encoded"))
    rows = peers.peer_rows(workload(4))
    assert rows == [{"peer": peers.LLAMA, "status": "skipped", "build": peers.BUILD_COMMAND},
                    {"peer": peers.OGEN, "status": "skipped", "build": peers.BUILD_COMMAND}]
    assert "python -m scripts.bench.peers --build" in peers.table(rows)


def fake_runs(prompts, max_tokens):
    """A peer that answers the ids [prompt length] (+ EOS, counted) one at a time, and all at once the text of those
    ids, off by one from the second request on; 2 s for each run."""
    alone = [peers.Answer([len(p)], None, 2, 1, 0.1 * (i + 1)) for i, p in enumerate(prompts)]
    together = [peers.Answer(None, f"<{len(p) + (i > 0)}>", 1, 1, 0.5) for i, p in enumerate(prompts)]
    return {"one_at_a_time": (alone, 2.0), "all_at_once": (together, 2.0)}


class DigitsTokenizer:
    """Encodes "3" as three tokens; decodes each id as <id>."""

    def encode(self, text, apply_chat_template):
        return [1] * int(text)

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def test_a_measured_peer_reports_its_own_token_count_ttft_and_agreement(monkeypatch):
    monkeypatch.setattr(peers, "project_tokenizer", DigitsTokenizer)
    monkeypatch.setattr(peers, "fp32_reference", lambda requests, prompts: [[1], [2], [9], [3]])
    requests = [{"text_input": str(i + 1), "max_tokens": 16} for i in range(4)]
    rows = peers.peer_rows(requests, peers={"fake": (lambda: True, fake_runs),
                                               "absent": (lambda: False, fake_runs)})
    measured = rows[0]
    assert measured["status"] == "measured" and measured["requests"] == 4
    one = measured["one_at_a_time"]
    assert (one["output_tokens"], one["answer_tokens"], one["tokens_per_s"]) == (8, 4, 4.0)
    assert one["ttft_p50"] == pytest.approx(0.25) and one["ttft_p95"] == pytest.approx(0.385)
    assert one["identical"] == 2
    assert measured["all_at_once"]["identical"] == 1
    assert rows[1]["status"] == "skipped"


def test_the_table_has_a_row_per_peer_with_its_numbers():
    summary = {"tokens_per_s": 123.45, "ttft_p50": 0.05, "ttft_p95": 0.123, "identical": 7}
    rows = [{"peer": peers.LLAMA, "status": "measured", "requests": 32, "one_at_a_time": summary,
             "all_at_once": {**summary, "tokens_per_s": 456.0, "ttft_p50": None, "ttft_p95": None, "identical": 5}},
            {"peer": peers.OGEN, "status": "skipped", "build": peers.BUILD_COMMAND}]
    lines = peers.table(rows).splitlines()
    assert "32 at once: output tok/s" in lines[0] and lines[0].count("|") == lines[1].count("|") == 7
    assert lines[2] == f"| {peers.LLAMA} | 123.5 | 0.05 / 0.12 | 456.0 | - / - | 7/32, 5/32 |"
    assert lines[3].startswith(f"| {peers.OGEN} | skipped: not built") and lines[3].count("|") == 7


def test_a_llama_server_built_with_other_options_is_built_again(tmp_path, monkeypatch):
    source = tmp_path / "llama.cpp"
    (source / "build" / "bin").mkdir(parents=True)
    for binary in ("llama-server", "llama-quantize"):
        (source / "build" / "bin" / binary).write_text("")
    monkeypatch.setattr(peers, "LLAMA_SOURCE", source)
    monkeypatch.setattr(peers, "LLAMA_SERVER", source / "build" / "bin" / "llama-server")
    monkeypatch.setattr(peers, "LLAMA_QUANTIZE", source / "build" / "bin" / "llama-quantize")
    assert not peers.llama_built(), "binaries without their mark (an interrupted or older build)"
    (source / "build" / peers.LLAMA_MARK).write_text(json.dumps({"cmake": ["-DGGML_NATIVE=ON"]}))
    assert not peers.llama_built()
    (source / "build" / peers.LLAMA_MARK).write_text(json.dumps({"cmake": peers.LLAMA_CMAKE_OPTIONS}))
    assert peers.llama_built()
    (source / "build" / "bin" / "llama-quantize").unlink()
    assert not peers.llama_built(), "a build from before llama-quantize was built beside the server"
