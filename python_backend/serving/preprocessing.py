"""The front model's first job: validate the user-facing inputs, tokenize the prompt, and hand the LLM model a
complete, typed set of generation inputs. Stop strings stay text: the front matches them on the generated text
(``frontend.text_deltas``), since a stop string tokenized alone rarely has the ids the model generates for it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from python_backend.errors import InvalidRequestError
from python_backend.serving.llm_requests import cache_salt, priority
from python_backend.serving.request_inputs import (TensorGetter, encode_stop_sequences, logprob_request,
                                                  prompt_logprob_request, sampling_values, scalar, text_list)
from python_backend.serving.tokenization import PromptTokenizer

NO_END_ID = -1  # tells the llm model to stop at the model's own EOS ids
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")


@dataclass(frozen=True)
class PreparedRequest:
    llm_inputs: dict[str, np.ndarray]  # the llm model's inputs, without batch dimension
    stop: tuple[str, ...]  # stop strings, matched on the generated text
    prompt_tokens: int = 0
    echo: str = ""  # the prompt, when the client asked for it in the output (exclude_input_in_output false)
    # Optional outputs, as TensorRT-LLM names them (num_input_tokens, num_output_tokens, output_log_probs...).
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_log_probs: bool = False
    num_top_log_probs: int = 0
    return_prompt_log_probs: bool = False


class Preprocessor:
    def __init__(
        self,
        tokenizer: PromptTokenizer,
        chat_template_by_default: bool = False,
        *,
        max_prompt_bytes: int = 65536,
        max_stop_strings: int = 16,
        max_stop_string_bytes: int = 256,
    ):
        self.tokenizer = tokenizer
        self.chat_template_by_default = chat_template_by_default
        self.max_prompt_bytes = max_prompt_bytes
        self.max_stop_strings = max_stop_strings
        self.max_stop_string_bytes = max_stop_string_bytes

    def prepare(self, get: TensorGetter) -> PreparedRequest:
        """Validates everything before tokenizing anything; raises InvalidRequestError naming the input."""
        text = self._prompt(get)
        stop = self._stop_strings(get)
        values, seed = sampling_values(get)
        end_id = _end_id(get)
        chat = bool(scalar(get, "apply_chat_template", self.chat_template_by_default))
        return_log_probs, top = logprob_request(get)
        ids = self._prompt_ids(get, text, chat)
        llm_inputs = {
            "input_ids": ids,
            "max_tokens": np.asarray([values["max_tokens"]], np.int32),
            "temperature": np.asarray([values["temperature"]], np.float32),
            "top_k": np.asarray([values["top_k"]], np.int32),
            "top_p": np.asarray([values["top_p"]], np.float32),
            "repetition_penalty": np.asarray([values["repetition_penalty"]], np.float32),
            "seed": np.asarray([np.random.randint(0, 2**63) if seed is None else seed], np.uint64),
            "end_id": np.asarray([end_id], np.int32),
            "stop_words_ids": encode_stop_sequences([]),
            "presence_penalty": np.asarray([values["presence_penalty"]], np.float32),
            "frequency_penalty": np.asarray([values["frequency_penalty"]], np.float32),
            "return_log_probs": np.asarray([return_log_probs], np.bool_),
            "num_top_log_probs": np.asarray([top], np.int32),
            "return_prompt_log_probs": np.asarray([prompt_logprob_request(get)], np.bool_),
        }
        salt = cache_salt(get)  # checked here too, so that a bad one fails before tokenizing
        if salt:
            llm_inputs["cache_salt"] = np.asarray([salt.encode("utf-8")], np.object_)
        if get("priority") is not None:
            llm_inputs["priority"] = np.asarray([priority(get)], np.int32)
        lora_name = scalar(get, "lora_name")  # known to the llm model, which says so when it is not
        if lora_name:
            llm_inputs["lora_name"] = np.asarray([lora_name.encode("utf-8")], np.object_)
        for name in GUIDE_INPUTS:  # checked and compiled by the llm model, which has the grammar engine
            value = scalar(get, name)
            if value is not None:
                llm_inputs[name] = np.asarray([value.encode("utf-8")], np.object_)
        for name, dtype in (("logit_bias_ids", np.int32), ("logit_bias_values", np.float32)):
            value = get(name)  # checked against the vocabulary by the llm model
            if value is not None:
                llm_inputs[name] = np.asarray(value, dtype).reshape(-1)
        return PreparedRequest(
            llm_inputs, stop,
            prompt_tokens=int(ids.size),
            echo="" if scalar(get, "exclude_input_in_output", True) else text,
            return_num_input_tokens=bool(scalar(get, "return_num_input_tokens", False)),
            return_num_output_tokens=bool(scalar(get, "return_num_output_tokens", False)),
            return_log_probs=return_log_probs,
            num_top_log_probs=top,
            return_prompt_log_probs=prompt_logprob_request(get),
        )

    def _prompt(self, get: TensorGetter) -> str:
        text = scalar(get, "text_input")
        if text is None:
            raise InvalidRequestError("text_input is required")
        text = str(text)
        size = len(text.encode("utf-8"))
        if size > self.max_prompt_bytes:
            raise InvalidRequestError(f"text_input is {size} bytes, more than the limit of {self.max_prompt_bytes}")
        if not text.strip():
            raise InvalidRequestError("text_input is empty")
        return text

    def _prompt_ids(self, get: TensorGetter, text: str, chat: bool) -> np.ndarray:
        """text_input tokenized, or the caller's own input_ids: a prompt already templated and tokenized (the OpenAI
        API sends a conversation so, its messages' control-token strings encoded as text, which no text can say).
        The llm model checks them against the vocabulary."""
        given = get("input_ids")
        if given is None:
            return np.asarray(self.tokenizer.encode(text, apply_chat_template=chat), np.int32)
        if chat:
            raise InvalidRequestError("apply_chat_template applies to text_input; input_ids must be templated already")
        ids = np.asarray(given).reshape(-1)
        if ids.size == 0:
            raise InvalidRequestError("input_ids is empty")
        return ids.astype(np.int32)

    def _stop_strings(self, get: TensorGetter) -> tuple[str, ...]:
        """The non-empty stop strings (empty ones are ignored)."""
        stop = tuple(word for word in text_list(get, "stop_words") if word)
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError(
                f"stop_words has {len(stop)} strings, more than the limit of {self.max_stop_strings}")
        for word in stop:
            size = len(word.encode("utf-8"))
            if size > self.max_stop_string_bytes:
                raise InvalidRequestError(f"stop_words has a string of {size} bytes, more than the limit of "
                                          f"{self.max_stop_string_bytes}")
        return stop


def _end_id(get: TensorGetter) -> int:
    end_id = scalar(get, "end_id")
    if end_id is None:
        return NO_END_ID
    if int(end_id) < 0:
        raise InvalidRequestError(f"end_id must be >= 0, got {end_id}")
    return int(end_id)
