"""One bad request among running neighbours, on the real server: it fails alone (or, validated away, runs
harmlessly), and every neighbour gets exactly the tokens it gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from scripts.clients.llm_client import GrpcStreamClient
from tests import helpers
from tests.helpers import llm_stream

pytestmark = pytest.mark.server

NEIGHBOURS = ["What is the capital of France?", "Name three primary colors.", "用一句话介绍一下长城。",
              "Write a Python function that reverses a string.", "Why do cats purr?", "Hi!", "What is 2+2?",
              "Describe the sea in one sentence."]
MAX_TOKENS = 24


def neighbour_request(prompt_ids, max_tokens=MAX_TOKENS, **sampling):
    return helpers.llm_request(prompt_ids, max_tokens, **sampling)


@pytest.fixture(scope="module")
def neighbours(tokenizer):
    return [tokenizer.encode(p, apply_chat_template=True) for p in NEIGHBOURS]


@pytest.fixture(scope="module")
def alone(server, neighbours):
    answers = []
    for ids in neighbours:
        out, error = llm_stream(server, neighbour_request(ids))
        assert error is None, error
        answers.append(out)
    return answers


POISONS = {
    # Measured before the fix: with seeds 0 and 1 this hung the poisoned request and all 8 neighbours (the penalty
    # overflowed fp32 logits to inf, then NaN probabilities). Now it samples like any other request.
    "tiny repetition_penalty, seed 0": dict(temperature=1.0, repetition_penalty=1e-38, seed=0),
    "tiny repetition_penalty, seed 1": dict(temperature=1.0, repetition_penalty=1e-38, seed=1),
    "tiny temperature": dict(temperature=1e-38, seed=0),
}


@pytest.mark.parametrize("poison", list(POISONS), ids=list(POISONS))
def test_a_poisoned_request_among_8_changes_no_neighbours_tokens(server, neighbours, alone, poison):
    poisoned = neighbour_request(neighbours[0], max_tokens=48, **POISONS[poison])
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(llm_stream, server, neighbour_request(ids)) for ids in neighbours]
        bad = pool.submit(llm_stream, server, poisoned)
        results = [f.result() for f in futures]
        bad_ids, bad_error = bad.result()
    assert [error for _, error in results] == [None] * 8
    assert [ids for ids, _ in results] == alone, "each neighbour gets exactly its tokens alone"
    assert bad_error is None and len(bad_ids) > 0, bad_error


def test_a_token_id_outside_the_vocabulary_is_refused_and_neighbours_finish(server, neighbours, alone):
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(llm_stream, server, neighbour_request(ids)) for ids in neighbours]
        bad = pool.submit(llm_stream, server, neighbour_request(neighbours[0][:-1] + [49152]))
        results = [f.result() for f in futures]
        _, bad_error = bad.result()
    assert "input_ids holds token id 49152, outside the vocabulary [0, 49152)" in bad_error
    assert [ids for ids, _ in results] == alone


def test_the_front_model_answers_a_poisoned_request_and_its_neighbours(server):
    client = GrpcStreamClient(f"127.0.0.1:{server.grpc}")
    requests = [{"apply_chat_template": True, "text_input": p, "max_tokens": MAX_TOKENS} for p in NEIGHBOURS]
    alone_texts = [client.complete(r).text for r in requests]
    poisoned = {"apply_chat_template": True, "text_input": "Write a poem.", "max_tokens": 32, "temperature": 1.0, "repetition_penalty": 1e-38,
                "seed": 0}
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(client.complete, r) for r in requests + [poisoned]]
        results = [f.result() for f in futures]
    assert [r.text for r in results[:8]] == alone_texts and results[8].output_tokens > 0


PREFILL_POISON = 49000  # a valid id that no test prompt holds


@pytest.fixture(scope="module")
def paris(tokenizer) -> int:
    [token] = tokenizer.encode_plain(" Paris")
    return token


@pytest.fixture(scope="module")
def faulty_server(model_dir, tmp_path_factory, paris):
    """The same models, with faults injected on purpose (python_backend/runtime/fault_injection.py): a prefill that holds
    token 49000 fails, and so does any decode step that feeds " Paris"."""
    from python_backend.model_files import MODEL_DIR_ENV
    from python_backend.runtime.fault_injection import FAULT_ENV
    from scripts.launcher.triton_server import running_server

    log = tmp_path_factory.mktemp("faulty") / "server.log"
    env = {MODEL_DIR_ENV: str(model_dir), FAULT_ENV: f"prefill_token={PREFILL_POISON},decode_token={paris}"}
    with running_server(log_path=log, env=env) as ports:
        yield ports


def test_a_failing_prefill_fails_only_its_request_on_the_server(faulty_server, neighbours, alone, paris):
    clean = [i for i in range(len(neighbours)) if paris not in alone[i]]  # untouched by the decode fault
    assert len(clean) >= 6
    with ThreadPoolExecutor(len(clean) + 1) as pool:
        futures = [pool.submit(llm_stream, faulty_server, neighbour_request(neighbours[i])) for i in clean]
        bad = pool.submit(llm_stream, faulty_server, neighbour_request(neighbours[1][:-1] + [PREFILL_POISON]))
        results = [f.result() for f in futures]
        _, bad_error = bad.result()
    assert "injected fault: a prefill fed token 49000" in bad_error
    assert results == [(alone[i], None) for i in clean], "the neighbours get exactly their tokens alone"


def test_a_failing_decode_step_ends_every_request_in_the_batch_with_an_error_at_once(faulty_server):
    """No hang: the step fails, every request in its batch gets the error, and the server serves the next one."""
    client = GrpcStreamClient(f"127.0.0.1:{faulty_server.grpc}", timeout_s=120)
    running = [{"apply_chat_template": True, "text_input": p, "max_tokens": 64, "end_id": helpers.NO_EOS}
               for p in NEIGHBOURS[1:]]
    trigger = {"apply_chat_template": True, "text_input": "What is the capital of France?", "max_tokens": 16}  # greedy: "... is Paris."

    def outcome(request):
        try:
            return client.complete(request).text
        except Exception as error:  # noqa: BLE001 - the error is what we look at
            return error

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(outcome, running + [trigger]))
    assert isinstance(results[-1], Exception) and "injected fault: a decode step" in str(results[-1])
    failed = [r for r in results if isinstance(r, Exception)]
    assert all("injected fault" in str(r) for r in failed), failed
    assert client.complete({"apply_chat_template": True, "text_input": "Name three primary colors.", "max_tokens": 8}).output_tokens > 0
