import re

import numpy as np
import pytest

from python_backend.errors import InvalidRequestError
from python_backend.serving.preprocessing import Preprocessor
from python_backend.serving.request_inputs import STOP_SEPARATOR, decode_stop_sequences


def inputs(**values):
    arrays = {}
    for name, value in values.items():
        arrays[name] = np.array([value if isinstance(value, list) else [value]], dtype=object if isinstance(
            value, (str, list)) else None)
    return lambda name: arrays.get(name)


@pytest.fixture(scope="module")
def preprocessor(tokenizer):
    return Preprocessor(tokenizer)


def test_text_input_is_the_raw_prompt_unless_the_chat_template_is_asked_for(preprocessor, tokenizer):
    """As in TensorRT-LLM's ensemble: the raw prompt by default; the chat template is an opt-in extension."""
    def input_ids(**values):
        return preprocessor.prepare(inputs(text_input="Hello", max_tokens=4, **values)).llm_inputs["input_ids"]

    assert tokenizer.tokenizer.decode(input_ids().tolist()) == "Hello"
    assert "<|im_start|>user" in tokenizer.tokenizer.decode(input_ids(apply_chat_template=True).tolist())
    assert Preprocessor(tokenizer, chat_template_by_default=True).prepare(
        inputs(text_input="Hello", max_tokens=4)).llm_inputs["input_ids"].tolist() == input_ids(
        apply_chat_template=True).tolist()


def test_given_input_ids_are_the_prompt_and_text_input_is_only_echoed(preprocessor):
    def get(**values):
        arrays = {"text_input": np.array([["Hello"]], object), "max_tokens": np.array([[4]]), **values}
        return lambda name: arrays.get(name)

    prepared = preprocessor.prepare(get(input_ids=np.array([[1, 9690, 198, 2]], np.int32),
                                        exclude_input_in_output=np.array([[False]])))
    assert prepared.llm_inputs["input_ids"].tolist() == [1, 9690, 198, 2] and prepared.prompt_tokens == 4
    assert prepared.echo == "Hello"
    with pytest.raises(InvalidRequestError, match="input_ids is empty"):
        preprocessor.prepare(get(input_ids=np.zeros((1, 0), np.int32)))
    with pytest.raises(InvalidRequestError, match="apply_chat_template applies to text_input"):
        preprocessor.prepare(get(input_ids=np.array([[1]], np.int32), apply_chat_template=np.array([[True]])))


def test_response_options_follow_tensorrt_llm_names(preprocessor):
    plain = preprocessor.prepare(inputs(text_input="Hi", max_tokens=8))
    assert plain.prompt_tokens == 1 and plain.echo == ""
    assert not (plain.return_num_input_tokens or plain.return_num_output_tokens or plain.return_log_probs)
    asked = preprocessor.prepare(inputs(text_input="Hi", max_tokens=8, exclude_input_in_output=False,
                                        return_num_input_tokens=True, return_num_output_tokens=True,
                                        num_top_log_probs=3))
    assert asked.echo == "Hi" and asked.return_num_input_tokens and asked.return_num_output_tokens
    assert asked.return_log_probs and asked.num_top_log_probs == 3  # top log-probabilities imply log-probabilities
    assert asked.llm_inputs["num_top_log_probs"].tolist() == [3] and asked.llm_inputs["return_log_probs"].tolist() == [True]
    with pytest.raises(InvalidRequestError, match="num_top_log_probs"):
        preprocessor.prepare(inputs(text_input="Hi", max_tokens=8, num_top_log_probs=21))
    with pytest.raises(InvalidRequestError, match="presence_penalty"):
        preprocessor.prepare(inputs(text_input="Hi", max_tokens=8, presence_penalty=2.5))


def test_outputs_are_complete_and_typed(preprocessor):
    out = preprocessor.prepare(inputs(text_input="Hi", max_tokens=8)).llm_inputs
    assert out["input_ids"].dtype == np.int32 and out["max_tokens"].tolist() == [8]
    assert out["temperature"].tolist() == [0.0] and out["top_p"].tolist() == [1.0] and out["end_id"].tolist() == [-1]


def test_stop_words_stay_text_for_the_front_and_are_not_sent_to_the_llm_as_ids(preprocessor):
    prepared = preprocessor.prepare(inputs(text_input="Hi", max_tokens=8, stop_words=["\n\n", "", "END"]))
    assert prepared.stop == ("\n\n", "END")
    assert prepared.llm_inputs["stop_words_ids"].tolist() == [STOP_SEPARATOR]
    assert decode_stop_sequences(prepared.llm_inputs["stop_words_ids"]) == ()


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
        ({"text_input": "Hi", "max_tokens": 4, "end_id": -1}, "end_id must be >= 0"),
    ],
)
def test_bad_requests_name_the_input(preprocessor, values, message):
    with pytest.raises(InvalidRequestError, match=message):
        preprocessor.prepare(inputs(**values))


class CountingTokenizer:
    """Stands in for the tokenizer, to show that limits are checked before any tokenization."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def encode(self, text, apply_chat_template):
        self.calls += 1
        return self.tokenizer.encode(text, apply_chat_template)


E_ACUTE = "\u00e9"  # two UTF-8 bytes: limits count bytes, not characters


@pytest.mark.parametrize("largest_accepted, smallest_refused, message", [
    ({"text_input": E_ACUTE * 32768},
     {"text_input": E_ACUTE * 32768 + "a"},
     "text_input is 65537 bytes, more than the limit of 65536"),
    ({"stop_words": [f"w{i}" for i in range(16)] + [""]},
     {"stop_words": [f"w{i}" for i in range(17)]},
     "stop_words has 17 strings, more than the limit of 16"),
    ({"stop_words": ["x", E_ACUTE * 128]},
     {"stop_words": ["x", E_ACUTE * 128 + "a"]},
     "stop_words has a string of 257 bytes, more than the limit of 256"),
    ({"end_id": 0}, {"end_id": -1}, "end_id must be >= 0, got -1"),
], ids=["text_input bytes", "stop_words count", "stop_words bytes", "end_id"])
def test_limits_at_their_edges_are_checked_before_tokenizing(tokenizer, largest_accepted, smallest_refused, message):
    counting = CountingTokenizer(tokenizer)
    preprocessor = Preprocessor(counting)
    request = {"text_input": "Hi", "max_tokens": 4}
    preprocessor.prepare(inputs(**{**request, **largest_accepted}))
    assert counting.calls == 1
    with pytest.raises(InvalidRequestError, match=f"^{re.escape(message)}$"):
        preprocessor.prepare(inputs(**{**request, **smallest_refused}))
    assert counting.calls == 1, "refused before tokenizing"


def test_limits_are_constructor_arguments(tokenizer):
    preprocessor = Preprocessor(tokenizer, max_prompt_bytes=4, max_stop_strings=1, max_stop_string_bytes=2)
    assert preprocessor.prepare(inputs(text_input="Hiya", max_tokens=4, stop_words=["ab"])).stop == ("ab",)
    for values, message in [({"text_input": "Hiyah"}, "text_input is 5 bytes, more than the limit of 4"),
                            ({"stop_words": ["a", "b"]}, "stop_words has 2 strings, more than the limit of 1"),
                            ({"stop_words": ["abc"]}, "stop_words has a string of 3 bytes, more than the limit of 2")]:
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            preprocessor.prepare(inputs(**{"text_input": "Hi", "max_tokens": 4, **values}))

