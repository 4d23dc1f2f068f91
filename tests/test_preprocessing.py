import numpy as np
import pytest

from python_backend.errors import InvalidRequestError
from python_backend.llm_requests import sequence_from_inputs
from python_backend.preprocessing import Preprocessor
from python_backend.request_inputs import decode_stop_sequences


def inputs(**values):
    arrays = {}
    for name, value in values.items():
        arrays[name] = np.array([value if isinstance(value, list) else [value]], dtype=object if isinstance(
            value, (str, list)) else None)
    return lambda name: arrays.get(name)


@pytest.fixture(scope="module")
def preprocessor(tokenizer):
    return Preprocessor(tokenizer)


def test_chat_template_is_applied_by_default_and_can_be_turned_off(preprocessor, tokenizer):
    chat = preprocessor.prepare(inputs(text_input="Hello", max_tokens=4))["input_ids"].tolist()
    raw = preprocessor.prepare(inputs(text_input="Hello", max_tokens=4, apply_chat_template=False))["input_ids"]
    assert "<|im_start|>user" in tokenizer.tokenizer.decode(chat)
    assert tokenizer.decode(raw.tolist()) == "Hello"


def test_outputs_are_complete_and_typed(preprocessor):
    out = preprocessor.prepare(inputs(text_input="Hi", max_tokens=8, stop_words=["\n\n", "END"]))
    assert out["input_ids"].dtype == np.int32 and out["max_tokens"].tolist() == [8]
    assert out["temperature"].tolist() == [0.0] and out["top_p"].tolist() == [1.0] and out["end_id"].tolist() == [-1]
    assert len(decode_stop_sequences(out["stop_words_ids"])) == 2


@pytest.mark.parametrize(
    "values, message",
    [
        ({"text_input": "", "max_tokens": 4}, "text_input is empty"),
        ({"text_input": "   ", "max_tokens": 4}, "text_input is empty"),
        ({"max_tokens": 4}, "text_input is required"),
        ({"text_input": "Hi"}, "max_tokens is required"),
        ({"text_input": "Hi", "max_tokens": 0}, "max_tokens must be > 0"),
        ({"text_input": "Hi", "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"text_input": "Hi", "max_tokens": 4, "top_p": 0.0}, "top_p"),
    ],
)
def test_bad_requests_name_the_input(preprocessor, values, message):
    with pytest.raises(InvalidRequestError, match=message):
        preprocessor.prepare(inputs(**values))


def llm_inputs(prompt_len, max_tokens, **extra):
    arrays = {"input_ids": np.ones((1, prompt_len), np.int32), "max_tokens": np.array([[max_tokens]], np.int32)}
    arrays.update({k: np.array([[v]]) for k, v in extra.items()})
    return lambda name: arrays.get(name)


def test_llm_request_checks_the_context():
    seq = sequence_from_inputs(llm_inputs(10, 20), eos_token_ids=(2,), max_context_length=64)
    assert seq.params.max_tokens == 20 and seq.params.end_ids == (2,)
    with pytest.raises(InvalidRequestError, match="max_tokens 60 \\+ prompt 10 tokens exceeds the context length of 64"):
        sequence_from_inputs(llm_inputs(10, 60), eos_token_ids=(2,), max_context_length=64)
    with pytest.raises(InvalidRequestError, match="prompt is 64 tokens, longer than the context length of 64"):
        sequence_from_inputs(llm_inputs(64, 1), eos_token_ids=(2,), max_context_length=64)


def test_llm_request_end_id_replaces_eos():
    seq = sequence_from_inputs(llm_inputs(3, 4, end_id=9), eos_token_ids=(2,), max_context_length=64)
    assert seq.params.end_ids == (9,)
