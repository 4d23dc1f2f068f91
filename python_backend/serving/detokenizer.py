"""Incremental detokenization for streaming.

Never decodes a token alone: each delta is decode(window) - decode(window prefix), where the window starts a few
tokens back (``prefix_offset``), so tokenizers that drop a word's leading space when it starts a decode still get it
right. Text that ends in an unfinished UTF-8 character (a CJK character or an emoji split over tokens decodes to
U+FFFD) is held back until the character completes."""

from __future__ import annotations

from typing import Callable

Decode = Callable[[list[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this are already in the emitted text

    def push(self, new_ids: list[int]) -> str:
        """Adds ids; returns the text that is now final (possibly empty)."""
        self.ids += new_ids
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        """The rest of the text, unfinished characters included; call once at the end."""
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
