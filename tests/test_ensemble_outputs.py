"""The ensemble driven as Triton's OpenAI frontend drives a TensorRT-LLM or vLLM model (raw text_input, TensorRT-LLM
names, gRPC streaming), against transformers on the same raw prompt: text, token counts, finish reasons and the
engine's log-probabilities."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from scripts.clients.llm_client import triton_inputs

pytestmark = pytest.mark.server

PROMPT = "The three primary colors are"
MAX_TOKENS = 12


def stream(server, request: dict, parameters: dict | None = None) -> tuple[list, str | None]:
    """Sends one request on a gRPC stream; returns (the responses' outputs as dicts, the error message or None)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("ensemble", triton_inputs(grpcclient, request), parameters=parameters,
                                  enable_empty_final_response=True)
        outputs = []
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return outputs, error.message()
            response = result.get_response()
            outputs.append({o.name: result.as_numpy(o.name) for o in response.outputs})
            if response.parameters.get("triton_final_response").bool_param:
                return outputs, None
    finally:
        client.stop_stream()
        client.close()


def text_of(outputs) -> str:
    return "".join(o["text_output"].reshape(-1)[0].decode() for o in outputs if "text_output" in o)


def reference(hf_model, settings, ids: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens (EOS excluded) and the log-softmax at each generated position."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                                max_new_tokens=max_tokens, do_sample=False, pad_token_id=settings["eos_token_ids"][0],
                                output_scores=True, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    log_probs = torch.log_softmax(torch.stack(out.logits)[:, 0].double(), dim=-1).numpy()
    if any(t in settings["eos_token_ids"] for t in new):
        end = next(i for i, t in enumerate(new) if t in settings["eos_token_ids"])
        new, log_probs = new[:end], log_probs[:end]
    return new, log_probs


def test_a_triton_openai_frontend_request_gets_the_raw_prompts_greedy_text_and_exact_counts(
        server, hf_model, tokenizer, settings):
    ids = tokenizer.encode(PROMPT, apply_chat_template=False)
    expected, _ = reference(hf_model, settings, ids, MAX_TOKENS)
    # The inputs Triton's OpenAI frontend sends (its TensorRT-LLM path) plus the usage flags it sends to vLLM.
    request = {"text_input": PROMPT, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0.0, "top_p": 1.0,
               "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": 7, "exclude_input_in_output": True,
               "return_num_input_tokens": True, "return_num_output_tokens": True}
    outputs, error = stream(server, request)
    assert error is None
    assert text_of(outputs) == tokenizer.decode(expected)
    assert {int(o["num_input_tokens"].reshape(-1)[0]) for o in outputs if "num_input_tokens" in o} == {len(ids)}
    assert sum(int(o["num_output_tokens"].reshape(-1)[0]) for o in outputs if "num_output_tokens" in o) == len(expected)
    assert all(o["num_output_tokens"].dtype == np.uint32 for o in outputs if "num_output_tokens" in o)
    reasons = [o["finish_reason"].reshape(-1)[0].decode() for o in outputs if "finish_reason" in o]
    assert reasons == ["length" if len(expected) == MAX_TOKENS else "stop"]


def test_finish_reason_says_stop_at_eos_or_a_stop_word_and_length_at_max_tokens(server):
    def reason(**extra):
        outputs, error = stream(server, {"text_input": "What is the capital of France?", "max_tokens": 32,
                                         "apply_chat_template": True, **extra})
        assert error is None
        [final] = [o for o in outputs if "finish_reason" in o]
        return text_of(outputs), final["finish_reason"].reshape(-1)[0].decode()

    assert reason() == ("The capital of France is Paris.", "stop")  # EOS
    assert reason(stop_words=["France"]) == ("The capital of ", "stop")
    assert reason(max_tokens=3) == ("The capital of", "length")
    assert reason(stream=False) == ("The capital of France is Paris.", "stop")


def test_log_probabilities_are_the_models_own_and_travel_with_their_tokens(server, hf_model, tokenizer, settings):
    ids = tokenizer.encode(PROMPT, apply_chat_template=False)
    expected, log_probs = reference(hf_model, settings, ids, MAX_TOKENS)
    # temperature and a repetition penalty change the choice's distribution, not the reported log-probabilities
    outputs, error = stream(server, {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
                                     "return_log_probs": True, "num_top_log_probs": 5})
    assert error is None
    tokens = np.concatenate([o["output_ids"].reshape(-1) for o in outputs if "output_ids" in o]).tolist()
    chosen = np.concatenate([o["output_log_probs"].reshape(-1) for o in outputs if "output_log_probs" in o])
    top = np.concatenate([o["top_log_probs"].reshape(-1, 5) for o in outputs if "top_log_probs" in o])
    top_ids = np.concatenate([o["top_log_prob_ids"].reshape(-1, 5) for o in outputs if "top_log_prob_ids" in o])
    assert tokens == expected and len(chosen) == len(top) == len(expected)
    positions = np.arange(len(expected))
    assert np.abs(chosen - log_probs[positions, expected]).max() < 1e-3
    best = np.argsort(-log_probs, axis=-1, kind="stable")[:, :5]
    assert (top_ids == best).all()  # no ties among the top 5 of these positions
    assert np.abs(top - np.take_along_axis(log_probs, best, axis=-1)).max() < 1e-3
    assert (top_ids[:, 0] == expected).all() and np.allclose(top[:, 0], chosen)  # greedy chose the top token
    assert np.all(np.diff(top, axis=-1) <= 0)
    sampled, error = stream(server, {"text_input": PROMPT, "max_tokens": 4, "temperature": 5.0, "seed": 3,
                                     "return_log_probs": True})
    assert error is None
    [final] = sampled
    picked = final["output_ids"].reshape(-1).tolist()
    with torch.no_grad():  # the log-softmax of the raw logits, not of the logits divided by the temperature
        logits = hf_model(torch.tensor([ids + picked])).logits[0, len(ids) - 1:-1].double()
    raw = torch.log_softmax(logits, -1).numpy()[np.arange(len(picked)), picked]
    assert np.abs(final["output_log_probs"].reshape(-1) - raw).max() < 1e-3


def test_prompt_log_probabilities_come_in_the_first_response_and_equal_transformers(server, hf_model, tokenizer):
    """return_prompt_log_probs: per prompt token its log-probability (0.0 for the first) and its top N, in the
    first response of a stream; with max_tokens 0 the prompt is scored and nothing generated."""
    ids = tokenizer.encode(PROMPT, apply_chat_template=False)
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    outputs, error = stream(server, {"text_input": PROMPT, "max_tokens": 3, "stream": True,
                                     "return_prompt_log_probs": True, "num_top_log_probs": 2})
    assert error is None
    first, *rest = [o for o in outputs if "text_output" in o]
    assert not any("prompt_log_probs" in o for o in rest)
    scores, top, top_ids = (first[name].reshape(len(ids), -1) for name in
                            ("prompt_log_probs", "prompt_top_log_probs", "prompt_top_log_prob_ids"))
    assert scores[0, 0] == 0.0 and (top_ids[0] == -1).all()
    positions = np.arange(len(ids) - 1)
    assert np.abs(scores[1:, 0] - expected[positions, ids[1:]]).max() < 1e-4
    assert (top_ids[1:] == np.argsort(-expected[:-1], axis=-1, kind="stable")[:, :2]).all()
    only, error = stream(server, {"text_input": PROMPT, "max_tokens": 0, "return_prompt_log_probs": True,
                                  "exclude_input_in_output": False})
    assert error is None
    [final] = [o for o in only if "text_output" in o]
    assert text_of(only) == PROMPT and final["finish_reason"].reshape(-1)[0] == b"length"
    assert np.array_equal(final["prompt_log_probs"].reshape(-1), scores[:, 0])
    assert final["num_output_tokens"].reshape(-1)[0] == 0
    _, error = stream(server, {"text_input": PROMPT, "max_tokens": 0})
    assert "max_tokens must be > 0" in error


def test_logit_bias_penalties_and_echo_reach_the_engine(server, tokenizer):
    base = {"text_input": PROMPT, "max_tokens": 6}
    plain = text_of(stream(server, base)[0])
    forced_id = tokenizer.encode_plain(" banana")[0]
    forced, error = stream(server, {**base, "logit_bias_ids": [forced_id], "logit_bias_values": [100.0],
                                    "return_num_output_tokens": True})
    assert error is None and text_of(forced) == tokenizer.decode([forced_id] * 6)
    penalised = text_of(stream(server, {**base, "max_tokens": 24, "frequency_penalty": 2.0})[0])
    repeated = text_of(stream(server, {**base, "max_tokens": 24})[0])
    assert penalised != repeated
    echoed = text_of(stream(server, {**base, "exclude_input_in_output": False})[0])
    assert echoed == PROMPT + plain


def test_errors_carry_their_code_in_the_message_when_the_client_asks_for_tags(server):
    bad = {"text_input": "Hi", "max_tokens": 4, "logit_bias_ids": [49152], "logit_bias_values": [1.0]}
    _, plain = stream(server, bad)
    _, tagged = stream(server, bad, parameters={"tag_errors": True})
    assert "outside the vocabulary" in plain and not plain.startswith("[")
    assert tagged == f"[INVALID_ARG] {plain}"
    _, tagged = stream(server, {"text_input": "Hi", "max_tokens": 4, "presence_penalty": 3.0},
                       parameters={"tag_errors": True})
    assert tagged.startswith("[INVALID_ARG] presence_penalty must be in [-2, 2]")
