"""Prompt encoding (with the model's own chat template) and output decoding, on the exported tokenizer files.

Chat prompts: the template's control tokens (``<|im_start|>``, ``<|im_end|>``, BOS, ...) are special tokens, but the
same strings inside the user's text are encoded as plain text, so a user cannot open or close a turn.
Raw prompts (no template requested, or the model has none): the text is encoded as the client wrote it, control
tokens included, and the tokenizer's own configuration decides whether BOS/EOS are added."""

from __future__ import annotations

import json
import os
from pathlib import Path

# What transformers 5 writes as tokenizer_class for a tokenizer.json tokenizer (every export here).
TOKENIZERS_BACKEND = "TokenizersBackend"


def load_tokenizer(model_dir: str | os.PathLike):
    """transformers' tokenizer of the folder, the class AutoTokenizer picks. A folder whose tokenizer_config.json names
    TokenizersBackend is loaded as that class directly: AutoTokenizer's module imports torch (about 1.3 s and 200 MB
    in every process that tokenizes: the ensembles' Python models, the OpenAI API), this one does not."""
    config = Path(model_dir) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") == TOKENIZERS_BACKEND:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class PromptTokenizer:
    def __init__(self, model_dir: str | os.PathLike):
        self.tokenizer = load_tokenizer(model_dir)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def encode(self, text: str, apply_chat_template: bool) -> list[int]:
        if apply_chat_template and self.has_chat_template:
            return self._encode_chat(text)
        return self._encode_raw(text)

    def _encode_chat(self, text: str) -> list[int]:
        return self.encode_conversation([{"role": "user", "content": text}])

    def encode_conversation(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation by the chat template, ready for the assistant's turn, message contents as plain text."""
        # sanitize_control_tokens: control tokens inside the message are encoded as text. Text without them is
        # encoded exactly as the rendered template string would be. The template writes its own BOS if it wants one,
        # so the tokenizer adds no special tokens here. Thread-safe: unlike `split_special_tokens=True`, it does not
        # switch the shared Rust tokenizer's mode, which other requests' threads use at the same time.
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False,
            sanitize_control_tokens=True,
        ))

    def _encode_raw(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of a fragment (a stop word), with no special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
