"""The llm model's own request checks (clients may call it directly with token ids)."""

import random
import re

import numpy as np
import pytest

from python_backend.engine.sampling import SamplingParams
from python_backend.engine.sequence import Sequence
from python_backend.errors import InvalidRequestError
from python_backend.serving.llm_requests import LlmLimits, sequence_from_inputs

LIMITS = LlmLimits(vocab_size=100, max_context_length=64, max_stop_sequences=2, max_stop_sequence_tokens=3)


def llm_inputs(prompt_len, max_tokens, ids=None, **extra):
    prompt = np.ones((1, prompt_len), np.int32) if ids is None else np.array([ids], np.int32)
    arrays = {"input_ids": prompt, "max_tokens": np.array([[max_tokens]], np.int32)}
    arrays.update({k: np.asarray(v if isinstance(v, list) else [[v]]) for k, v in extra.items()})
    return lambda name: arrays.get(name)


def test_llm_request_checks_the_context():
    seq = sequence_from_inputs(llm_inputs(10, 20), (2,), LIMITS)
    assert seq.params.max_tokens == 20 and seq.params.end_ids == (2,)
    assert sequence_from_inputs(llm_inputs(10, 54), (2,), LIMITS).params.max_tokens == 54
    with pytest.raises(InvalidRequestError, match="max_tokens 55 \\+ prompt 10 tokens exceeds the context length of 64"):
        sequence_from_inputs(llm_inputs(10, 55), (2,), LIMITS)
    assert len(sequence_from_inputs(llm_inputs(63, 1), (2,), LIMITS).prompt_ids) == 63
    with pytest.raises(InvalidRequestError, match="prompt is 64 tokens, longer than the context length of 64"):
        sequence_from_inputs(llm_inputs(64, 1), (2,), LIMITS)


def test_token_ids_outside_the_vocabulary_are_refused():
    assert sequence_from_inputs(llm_inputs(0, 4, ids=[0, 99]), (2,), LIMITS).prompt_ids == [0, 99]
    for bad in (100, -1, 2**31 - 1):
        with pytest.raises(InvalidRequestError, match=f"input_ids holds token id {bad}, outside the vocabulary"):
            sequence_from_inputs(llm_inputs(0, 4, ids=[5, bad]), (2,), LIMITS)


def test_end_id_replaces_eos_and_is_checked():
    assert sequence_from_inputs(llm_inputs(3, 4, end_id=9), (2,), LIMITS).params.end_ids == (9,)
    assert sequence_from_inputs(llm_inputs(3, 4, end_id=-1), (2,), LIMITS).params.end_ids == (2,)
    assert sequence_from_inputs(llm_inputs(3, 4, end_id=99), (2,), LIMITS).params.end_ids == (99,)
    for bad in (-2, 100):
        with pytest.raises(InvalidRequestError, match="end_id must be a token id in \\[0, 100\\)"):
            sequence_from_inputs(llm_inputs(3, 4, end_id=bad), (2,), LIMITS)


def test_stop_sequences_are_bounded_in_number_and_length():
    ok = sequence_from_inputs(llm_inputs(3, 4, stop_words_ids=[[5, 6, 7, -1, 8, -1]]), (2,), LIMITS)
    assert ok.params.stop_token_sequences == ((5, 6, 7), (8,))
    with pytest.raises(InvalidRequestError, match="3 stop sequences, more than the limit of 2"):
        sequence_from_inputs(llm_inputs(3, 4, stop_words_ids=[[5, -1, 6, -1, 7, -1]]), (2,), LIMITS)
    with pytest.raises(InvalidRequestError, match="is 4 tokens, more than the limit of 3"):
        sequence_from_inputs(llm_inputs(3, 4, stop_words_ids=[[5, 6, 7, 8, -1]]), (2,), LIMITS)
    with pytest.raises(InvalidRequestError, match="holds 9 values, more than the limit of 8"):
        sequence_from_inputs(llm_inputs(3, 4, stop_words_ids=[[5] * 9]), (2,), LIMITS)


def new_key() -> str:
    return Sequence(prompt_ids=[1], params=SamplingParams(max_tokens=1)).key


def test_request_keys_are_unguessable():
    """128 random bits each, from the operating system's generator: a cancel names its sequence by key."""
    keys = [new_key() for _ in range(2000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", k) for k in keys) and len(set(keys)) == len(keys)
    # Every one of the 128 bits is set in about half of the keys (a counter, a clock or a fixed field is not):
    # outside 40-60 % of 2000 is 9 standard deviations away for a fair bit.
    for bit in range(128):
        share = sum(int(k, 16) >> bit & 1 for k in keys) / len(keys)
        assert 0.4 < share < 0.6, f"bit {bit} is set in {share:.0%} of the keys"
    # Not from the `random` module, whose state anyone who sees its outputs can predict (or who seeds it).
    random.seed(0)
    first = new_key()
    random.seed(0)
    assert new_key() != first


def test_logit_bias_and_log_probability_inputs_are_checked():
    seq = sequence_from_inputs(llm_inputs(4, 4, logit_bias_ids=[[5, 7, 5]], logit_bias_values=[[1.0, -2.0, 3.0]],
                                          num_top_log_probs=2), (2,), LIMITS)
    assert seq.params.logit_bias == ((5, 3.0), (7, -2.0)) and seq.params.logprobs and seq.params.top_logprobs == 2
    for extra, named in [({"logit_bias_ids": [[5, 7]], "logit_bias_values": [[1.0]]}, "pair up"),
                         ({"logit_bias_ids": [[100]], "logit_bias_values": [[1.0]]}, "outside the vocabulary"),
                         ({"logit_bias_ids": [[5]], "logit_bias_values": [[100.5]]}, r"\[-100, 100\]"),
                         ({"num_top_log_probs": -1}, "num_top_log_probs")]:
        with pytest.raises(InvalidRequestError, match=named):
            sequence_from_inputs(llm_inputs(4, 4, **extra), (2,), LIMITS)
