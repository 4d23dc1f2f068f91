"""Turning the LLM model's input tensors into a Sequence, checked against the model's context length."""

from __future__ import annotations

import numpy as np

from python_backend.errors import InvalidRequestError
from python_backend.request_inputs import TensorGetter, decode_stop_sequences, sampling_values, scalar
from python_backend.sampling import SamplingParams
from python_backend.sequence import Sequence


def sequence_from_inputs(get: TensorGetter, eos_token_ids: tuple[int, ...], max_context_length: int) -> Sequence:
    ids = get("input_ids")
    if ids is None or np.asarray(ids).size == 0:
        raise InvalidRequestError("input_ids is empty")
    prompt = [int(t) for t in np.asarray(ids).reshape(-1)]
    values, seed = sampling_values(get)
    if len(prompt) >= max_context_length:
        raise InvalidRequestError(
            f"prompt is {len(prompt)} tokens, longer than the context length of {max_context_length} tokens"
        )
    if len(prompt) + values["max_tokens"] > max_context_length:
        raise InvalidRequestError(
            f"max_tokens {values['max_tokens']} + prompt {len(prompt)} tokens exceeds the context length of "
            f"{max_context_length} tokens (at most {max_context_length - len(prompt)} for this prompt)"
        )
    end_id = int(scalar(get, "end_id", -1))
    params = SamplingParams(
        **values,
        seed=seed,
        stop_token_sequences=decode_stop_sequences(get("stop_words_ids")),
        end_ids=(end_id,) if end_id >= 0 else tuple(eos_token_ids),
    )
    return Sequence(prompt_ids=prompt, params=params)
