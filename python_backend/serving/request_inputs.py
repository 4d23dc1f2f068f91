"""Reading one request's input tensors (already numpy) into plain Python values, with clear errors.

The Triton model passes a ``get(name) -> np.ndarray | None`` function, so this stays testable without a server."""

from __future__ import annotations

from typing import Callable

import numpy as np

from python_backend.engine.sampling import validate_sampling_values
from python_backend.errors import InvalidRequestError

TensorGetter = Callable[[str], "np.ndarray | None"]
STOP_SEPARATOR = -1  # stop word token sequences travel as one flat INT32 tensor, separated by -1


def as_text(value, name: str) -> str:
    # Over HTTP JSON a BYTES element can arrive as str; over gRPC and binary HTTP as bytes.
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequestError(f"{name} is not valid UTF-8: {error}") from None
    return str(value)


def scalar(get: TensorGetter, name: str, default=None):
    array = get(name)
    if array is None:
        return default
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one value, got {flat.size}")
    value = flat[0]
    if isinstance(value, (bytes, str, np.bytes_, np.str_)):
        return as_text(value, name)
    return value.item()


def sampling_values(get: TensorGetter) -> tuple[dict, int | None]:
    """max_tokens and the sampling inputs with their defaults, validated: (values, seed or None)."""
    max_tokens = scalar(get, "max_tokens")
    if max_tokens is None:
        raise InvalidRequestError("max_tokens is required")
    values = {
        "max_tokens": int(max_tokens),
        "temperature": float(scalar(get, "temperature", 0.0)),
        "top_k": int(scalar(get, "top_k", 0)),
        "top_p": float(scalar(get, "top_p", 1.0)),
        "repetition_penalty": float(scalar(get, "repetition_penalty", 1.0)),
        "presence_penalty": float(scalar(get, "presence_penalty", 0.0)),
        "frequency_penalty": float(scalar(get, "frequency_penalty", 0.0)),
    }
    seed = scalar(get, "seed")
    seed = None if seed is None else int(seed)
    validate_sampling_values(**values, seed=seed, prompt_logprobs=prompt_logprob_request(get))
    return values, seed


def prompt_logprob_request(get: TensorGetter) -> bool:
    """return_prompt_log_probs: score each prompt token (with num_top_log_probs' most likely tokens there)."""
    return bool(scalar(get, "return_prompt_log_probs", False))


MAX_LOGIT_BIAS = 1024  # entries; OpenAI's own limit is 300
MAX_TOP_LOGPROBS = 20


def logit_bias(get: TensorGetter, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias_ids / logit_bias_values: as many ids as values, ids in the vocabulary, values in [-100, 100]."""
    ids, values = get("logit_bias_ids"), get("logit_bias_values")
    ids = np.zeros(0, np.int64) if ids is None else np.asarray(ids).reshape(-1)
    values = np.zeros(0, np.float64) if values is None else np.asarray(values, np.float64).reshape(-1)
    if ids.size != values.size:
        raise InvalidRequestError(f"logit_bias_ids has {ids.size} values and logit_bias_values {values.size}: "
                                  "they must pair up")
    if ids.size > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias has {ids.size} entries, more than the limit of {MAX_LOGIT_BIAS}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InvalidRequestError(f"logit_bias_ids holds token id {int(bad[0])}, outside the vocabulary "
                                  f"[0, {vocab_size})")
    if not np.all(np.isfinite(values) & (np.abs(values) <= 100)):
        raise InvalidRequestError("logit_bias_values must be in [-100, 100]")
    merged = dict(zip(ids.tolist(), values.tolist()))  # a repeated id: the last value counts
    return tuple(merged.items())


def logprob_request(get: TensorGetter) -> tuple[bool, int]:
    """(return_log_probs, num_top_log_probs); asking for top log-probabilities implies the log-probabilities."""
    top = int(scalar(get, "num_top_log_probs", 0))
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"num_top_log_probs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return bool(scalar(get, "return_log_probs", False)) or top > 0, top


def text_list(get: TensorGetter, name: str) -> list[str]:
    array = get(name)
    if array is None:
        return []
    return [as_text(v, name) for v in np.asarray(array).reshape(-1)]


def encode_stop_sequences(sequences: list[list[int]]) -> np.ndarray:
    flat: list[int] = []
    for seq in sequences:
        flat += list(seq) + [STOP_SEPARATOR]
    return np.asarray(flat or [STOP_SEPARATOR], np.int32)


def decode_stop_sequences(array: np.ndarray | None) -> tuple[tuple[int, ...], ...]:
    if array is None:
        return ()
    sequences, current = [], []
    for token in np.asarray(array).reshape(-1).tolist():
        if token == STOP_SEPARATOR:
            if current:
                sequences.append(tuple(current))
            current = []
        else:
            current.append(int(token))
    if current:
        sequences.append(tuple(current))
    return tuple(sequences)
