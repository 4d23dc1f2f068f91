"""Token id -> the text and the raw bytes that logprobs report.

The text is ``tokenizer.decode([id])``, as OpenAI-compatible servers report it; a token that holds part of a UTF-8
character decodes to U+FFFD, which is why OpenAI's chat logprobs also carry each token's ``bytes``. SmolLM2's tokenizer
is byte-level BPE (GPT-2's scheme): each vocabulary entry is written in an alphabet of 256 printable characters, one
per byte, so mapping the entry's characters back gives the token's exact bytes. Added tokens (``<|im_end|>`` ...) are
not in that alphabet; their bytes are their text in UTF-8.

Looked up only for requests that asked for logprobs, and cached per id."""

from __future__ import annotations


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: character -> byte. Bytes that are printable (and not a space) stand for
    themselves; the others, in order, take the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    decoder = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in decoder.values())
    for offset, b in enumerate(others):
        decoder[chr(256 + offset)] = b
    return decoder


class TokenTexts:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._decoder = byte_decoder()
        self._added = {token.content for token in tokenizer.added_tokens_decoder.values()}
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self._raw(token_id))
        return raw

    def _raw(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if piece in self._added:
            return piece.encode("utf-8")
        out = bytearray()
        for char in piece:
            b = self._decoder.get(char)
            out += char.encode("utf-8") if b is None else bytes((b,))
        return bytes(out)
