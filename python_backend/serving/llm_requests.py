"""Turning the LLM model's input tensors into a Sequence, checked against the model's vocabulary and context."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from python_backend.engine.sampling import SamplingParams
from python_backend.engine.sequence import Sequence
from python_backend.errors import InvalidRequestError
from python_backend.guided.grammars import GuideSpec, guide_spec
from python_backend.serving.request_inputs import (TensorGetter, decode_stop_sequences, logit_bias, logprob_request,
                                                  prompt_logprob_request, sampling_values, scalar)


MAX_CACHE_SALT_BYTES = 256


@dataclass(frozen=True)
class LlmLimits:
    vocab_size: int
    max_context_length: int  # prompt + max_tokens
    max_stop_sequences: int = 16
    max_stop_sequence_tokens: int = 64
    max_guide_bytes: int = 65536


def sequence_from_inputs(get: TensorGetter, eos_token_ids: tuple[int, ...], limits: LlmLimits) -> Sequence:
    ids = get("input_ids")
    if ids is None or np.asarray(ids).size == 0:
        raise InvalidRequestError("input_ids is empty")
    ids = np.asarray(ids).reshape(-1)
    if ids.size >= limits.max_context_length:  # checked before the ids become a Python list
        raise InvalidRequestError(
            f"prompt is {ids.size} tokens, longer than the context length of {limits.max_context_length} tokens"
        )
    _check_token_ids(ids, "input_ids", limits.vocab_size)
    prompt = ids.tolist()
    values, seed = sampling_values(get)
    if len(prompt) + values["max_tokens"] > limits.max_context_length:
        raise InvalidRequestError(
            f"max_tokens {values['max_tokens']} + prompt {len(prompt)} tokens exceeds the context length of "
            f"{limits.max_context_length} tokens (at most {limits.max_context_length - len(prompt)} for this prompt)"
        )
    end_id = int(scalar(get, "end_id", -1))
    if end_id < -1 or end_id >= limits.vocab_size:
        raise InvalidRequestError(f"end_id must be a token id in [0, {limits.vocab_size}) (or -1: the model's EOS), "
                                  f"got {end_id}")
    logprobs, top_logprobs = logprob_request(get)
    params = SamplingParams(
        **values,
        seed=seed,
        logit_bias=logit_bias(get, limits.vocab_size),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprob_request(get),
        stop_token_sequences=_stop_sequences(get, limits),
        end_ids=(end_id,) if end_id >= 0 else tuple(eos_token_ids),
    )
    return Sequence(prompt_ids=prompt, params=params, cache_salt=cache_salt(get), priority=priority(get))


def prompt_score_arrays(scores: list, top: int) -> dict[str, np.ndarray]:
    """The llm model's prompt_log_probs [tokens] (0.0 for the first token, which has nothing before it) and, with a
    top count, prompt_top_log_probs / prompt_top_log_prob_ids [tokens, top] (zeros and -1 for the first token)."""
    arrays = {"prompt_log_probs": np.array([0.0 if s is None else s.logprob for s in scores], np.float32)}
    if top:
        arrays["prompt_top_log_probs"] = np.array(
            [[0.0] * top if s is None else s.top_logprobs[:top] for s in scores], np.float32).reshape(-1, top)
        arrays["prompt_top_log_prob_ids"] = np.array(
            [[-1] * top if s is None else s.top_ids[:top] for s in scores], np.int32).reshape(-1, top)
    return arrays


def priority(get: TensorGetter) -> int:
    """Lower runs earlier; 0 by default (live requests); batch jobs send a positive one."""
    return int(scalar(get, "priority", 0))


def guide_from_inputs(get: TensorGetter, limits: LlmLimits) -> GuideSpec | None:
    """guided_decoding_guide_type / guided_decoding_guide, checked (the compiler checks the guide itself)."""
    return guide_spec(scalar(get, "guided_decoding_guide_type"), scalar(get, "guided_decoding_guide"),
                      limits.max_guide_bytes)


def cache_salt(get: TensorGetter) -> str:
    salt = scalar(get, "cache_salt", "")
    if len(salt.encode("utf-8")) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(f"cache_salt is more than {MAX_CACHE_SALT_BYTES} bytes")
    return salt


def _check_token_ids(ids: np.ndarray, name: str, vocab_size: int) -> None:
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InvalidRequestError(f"{name} holds token id {int(bad[0])}, outside the vocabulary [0, {vocab_size})")


def _stop_sequences(get: TensorGetter, limits: LlmLimits) -> tuple[tuple[int, ...], ...]:
    raw = get("stop_words_ids")
    if raw is not None:
        size = np.asarray(raw).size
        most = limits.max_stop_sequences * (limits.max_stop_sequence_tokens + 1)
        if size > most:
            raise InvalidRequestError(f"stop_words_ids holds {size} values, more than the limit of {most}")
    sequences = decode_stop_sequences(raw)
    if len(sequences) > limits.max_stop_sequences:
        raise InvalidRequestError(
            f"stop_words_ids holds {len(sequences)} stop sequences, more than the limit of {limits.max_stop_sequences}")
    for sequence in sequences:
        if len(sequence) > limits.max_stop_sequence_tokens:
            raise InvalidRequestError(f"a stop sequence of stop_words_ids is {len(sequence)} tokens, more than the "
                                      f"limit of {limits.max_stop_sequence_tokens}")
    return sequences
