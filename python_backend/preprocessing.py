"""The `preprocessing` model's job: validate the user-facing inputs, tokenize the prompt, and hand the LLM model
a complete, typed set of generation inputs."""

from __future__ import annotations

import numpy as np

from python_backend.errors import InvalidRequestError
from python_backend.request_inputs import TensorGetter, encode_stop_sequences, sampling_values, scalar, text_list
from python_backend.tokenization import PromptTokenizer


class Preprocessor:
    def __init__(self, tokenizer: PromptTokenizer, chat_template_by_default: bool = True):
        self.tokenizer = tokenizer
        self.chat_template_by_default = chat_template_by_default

    def prepare(self, get: TensorGetter) -> dict[str, np.ndarray]:
        """Returns the LLM model's inputs (without batch dimension) or raises InvalidRequestError."""
        text = scalar(get, "text_input")
        if text is None:
            raise InvalidRequestError("text_input is required")
        if not str(text).strip():
            raise InvalidRequestError("text_input is empty")
        values, seed = sampling_values(get)
        chat = bool(scalar(get, "apply_chat_template", self.chat_template_by_default))
        end_id = scalar(get, "end_id")
        stop_words = [w for w in text_list(get, "stop_words") if w]
        return {
            "input_ids": np.asarray(self.tokenizer.encode(text, apply_chat_template=chat), np.int32),
            "max_tokens": np.asarray([values["max_tokens"]], np.int32),
            "temperature": np.asarray([values["temperature"]], np.float32),
            "top_k": np.asarray([values["top_k"]], np.int32),
            "top_p": np.asarray([values["top_p"]], np.float32),
            "repetition_penalty": np.asarray([values["repetition_penalty"]], np.float32),
            "seed": np.asarray([np.random.randint(0, 2**63) if seed is None else seed], np.uint64),
            "end_id": np.asarray([-1 if end_id is None else int(end_id)], np.int32),
            "stop_words_ids": encode_stop_sequences([self.tokenizer.encode_plain(w) for w in stop_words]),
        }
