"""Prefix caching on a real server (QUANT=int4; enable_kv_cache_reuse switched off, then on, by reloads): a prompt
sent again is answered from its cached prefix with the same text (the hit counter says so); another cache_salt finds
nothing; with the switch off nothing is looked up."""

from __future__ import annotations

import pytest

from python_backend.model_files import MODEL_DIR_ENV
from scripts.clients.llm_client import GrpcStreamClient
from scripts.launcher.model_control import SERVED_MODELS, reload_llm
from scripts.launcher.openai_server import running_openai_api
from scripts.launcher.triton_server import running_server
from tests.helpers import metrics, variant_folder, wait_idle

pytestmark = pytest.mark.server
SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the port if one "
          "is asked for, never invent tracking numbers, and say plainly when you do not know. ")


def request(question: str, salt: str | None = None) -> dict:
    body = {"text_input": SYSTEM + question, "max_tokens": 16, "apply_chat_template": True}
    return body if salt is None else {**body, "cache_salt": salt}


@pytest.fixture(scope="module")
def int4_server(model_dir, tmp_path_factory):
    folder = variant_folder(model_dir, "int4")
    log = tmp_path_factory.mktemp("prefix") / "server.log"
    with running_server(log_path=log, explicit_models=SERVED_MODELS, env={MODEL_DIR_ENV: str(folder)}) as ports:
        yield ports


def counters(server) -> tuple[float, float]:
    values = wait_idle(server)
    return values.get("llm_prefix_cache_queries_total", 0), values.get("llm_prefix_cache_hits_total", 0)


def test_reuse_off_looks_nothing_up_then_on_answers_from_the_cache_with_the_same_text(int4_server):
    client = GrpcStreamClient(f"127.0.0.1:{int4_server.grpc}")
    reload_llm(f"127.0.0.1:{int4_server.http}", enable_kv_cache_reuse="false")
    off = [client.complete(request(q)).text for q in ("Where is Rotterdam?", "Where is Rotterdam?")]
    assert counters(int4_server) == (0, 0), "with the switch off nothing is looked up"

    reload_llm(f"127.0.0.1:{int4_server.http}", enable_kv_cache_reuse="true")
    first = client.complete(request("Where is Rotterdam?")).text
    queries, hits = counters(int4_server)
    assert queries > 0 and hits == 0
    again = client.complete(request("Where is Rotterdam?")).text
    other_question = client.complete(request("What does TEU mean?")).text
    queries, hits = counters(int4_server)
    assert hits >= 64, "the second request and the other question found the shared system prompt"
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


def test_32_concurrent_requests_sharing_a_prefix_get_the_same_answers_with_reuse_on_and_off(int4_server):
    from concurrent.futures import ThreadPoolExecutor

    client = GrpcStreamClient(f"127.0.0.1:{int4_server.grpc}")
    questions = [f"Question {i}: is port number {i} open today?" for i in range(32)]

    def answers() -> list[str]:
        with ThreadPoolExecutor(32) as pool:
            return [r.text for r in pool.map(client.complete, [request(q) for q in questions])]

    reload_llm(f"127.0.0.1:{int4_server.http}", enable_kv_cache_reuse="false")
    off = answers()
    reload_llm(f"127.0.0.1:{int4_server.http}", enable_kv_cache_reuse="true")
    client.complete(request(questions[0]))  # the shared prefix in the cache
    assert answers() == off
    assert counters(int4_server)[1] >= 31 * 64, "every request found the shared instruction's blocks"
