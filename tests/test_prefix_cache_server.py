"""Prefix caching on the session's shared int4 server (enable_kv_cache_reuse switched off, then on, by reloads; the llm
config is put back as this file found it): a prompt sent again is answered from its cached prefix with the same text
(the hit counter says so); another cache_salt finds nothing; with the switch off nothing is looked up; 32 concurrent
requests ran together, with the same answers either way, on int4's server and on fp32's. Counters are shared with
other files: each claim is on a delta."""

from __future__ import annotations

import pytest

from scripts.clients.llm_client import GrpcStreamClient
from scripts.launcher.model_control import reload_llm
from scripts.launcher.openai_server import running_openai_api
from tests.helpers import decode_steps_above, metrics, reconfigured_llm, variant_folder, wait_idle

pytestmark = pytest.mark.server
SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the port if one "
          "is asked for, never invent tracking numbers, and say plainly when you do not know. ")


def request(question: str, salt: str | None = None) -> dict:
    body = {"text_input": SYSTEM + question, "max_tokens": 16, "apply_chat_template": True}
    return body if salt is None else {**body, "cache_salt": salt}


@pytest.fixture(scope="module")
def int4_server(variant_server):
    """The shared int4 server; the tests reload its llm, which is loaded again with the config it had once they end."""
    ports = variant_server("int4")
    with reconfigured_llm(ports):
        yield ports


def counters(server) -> tuple[float, float]:
    values = wait_idle(server)
    return values.get("llm_prefix_cache_queries_total", 0), values.get("llm_prefix_cache_hits_total", 0)


def test_reuse_off_looks_nothing_up_then_on_answers_from_the_cache_with_the_same_text(int4_server):
    client = GrpcStreamClient(f"127.0.0.1:{int4_server.grpc}")
    reload_llm(f"127.0.0.1:{int4_server.http}", enable_kv_cache_reuse="false")
    before = counters(int4_server)
    off = [client.complete(request(q)).text for q in ("Where is Rotterdam?", "Where is Rotterdam?")]
    assert counters(int4_server) == before, "with the switch off nothing is looked up"

    reload_llm(f"127.0.0.1:{int4_server.http}", enable_kv_cache_reuse="true")  # a new engine: an empty prefix cache
    queries_before, hits_before = counters(int4_server)
    first = client.complete(request("Where is Rotterdam?")).text
    queries, hits = counters(int4_server)
    assert queries > queries_before and hits == hits_before
    again = client.complete(request("Where is Rotterdam?")).text
    other_question = client.complete(request("What does TEU mean?")).text
    queries, hits = counters(int4_server)
    assert hits - hits_before >= 64, "the second request and the other question found the shared system prompt"
    assert first == again == off[0]
    assert other_question.strip()

    salted = client.complete(request("Where is Rotterdam?", salt="tenant-b")).text
    assert counters(int4_server)[1] == hits, "another salt finds nothing"
    assert salted == off[0]
    assert metrics(int4_server).get("llm_prefix_cache_bytes", 0) > 0


def test_the_openai_front_passes_cache_salt(int4_server, model_dir, tmp_path):
    from openai import OpenAI

    reload_llm(f"127.0.0.1:{int4_server.http}", enable_kv_cache_reuse="true")
    folder = variant_folder(model_dir, "int4")
    with running_openai_api(f"127.0.0.1:{int4_server.grpc}", folder, tmp_path / "api.log") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id

        def ask(salt: str) -> str:
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
                max_tokens=8, temperature=0, extra_body={"cache_salt": salt})
            return answer.choices[0].message.content

        first = ask("tenant-a")
        hits = counters(int4_server)[1]
        assert ask("tenant-b") == first and counters(int4_server)[1] == hits, "another salt finds nothing"
        assert ask("tenant-a") == first and counters(int4_server)[1] > hits, "the same salt shares"


@pytest.mark.parametrize("variant", ["int4", "fp32"])
def test_32_concurrent_requests_sharing_a_prefix_get_the_same_answers_with_reuse_on_and_off(variant, variant_server):
    """On the default and on fp32 (every variant is on the slot cache): each variant's own shared server."""
    with reconfigured_llm(ports := variant_server(variant)):
        same_answers_with_reuse_on_and_off(ports)


def same_answers_with_reuse_on_and_off(server):
    from concurrent.futures import ThreadPoolExecutor

    client = GrpcStreamClient(f"127.0.0.1:{server.grpc}")
    questions = [f"Question {i}: is port number {i} open today?" for i in range(32)]

    def answers() -> list[str]:
        """The 32 answers, sent at once; asserts that decode steps ran more than 8 of them together."""
        wait_idle(server)
        wide_before = decode_steps_above(server, "continuous", 8)
        with ThreadPoolExecutor(32) as pool:
            texts = [r.text for r in pool.map(client.complete, [request(q) for q in questions])]
        wait_idle(server)
        assert decode_steps_above(server, "continuous", 8) > wide_before, \
            "decode steps ran more than 8 of the 32 at once"
        return texts

    reload_llm(f"127.0.0.1:{server.http}", enable_kv_cache_reuse="false")
    off = answers()
    reload_llm(f"127.0.0.1:{server.http}", enable_kv_cache_reuse="true")
    client.complete(request(questions[0]))  # the shared prefix in the cache
    hits = counters(server)[1]
    assert answers() == off
    assert counters(server)[1] - hits >= 31 * 64, "every request found the shared instruction's blocks"
