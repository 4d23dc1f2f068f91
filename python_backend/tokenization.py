"""Prompt encoding (with the model's own chat template) and output decoding, on the exported tokenizer files."""

from __future__ import annotations

import os

from transformers import AutoTokenizer


class PromptTokenizer:
    def __init__(self, model_dir: str | os.PathLike):
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def encode(self, text: str, apply_chat_template: bool) -> list[int]:
        if apply_chat_template and self.has_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return list(self.tokenizer.encode(text, add_special_tokens=not apply_chat_template))

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of a fragment (a stop word), with no special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
