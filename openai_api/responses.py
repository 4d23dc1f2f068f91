"""OpenAI's response objects, built as plain dicts from the ensemble's Pieces: whole answers, stream chunks, usage and
logprobs, for /v1/completions ("text_completion") and /v1/chat/completions ("chat.completion[.chunk]")."""

from __future__ import annotations

import json
import secrets
import time

from openai_api.token_text import TokenTexts
from openai_api.triton_backend import Piece

DONE = b"data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token it deems impossible; JSON has no -Infinity


def sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class Usage:
    """prompt_tokens counts each prompt once (n choices of one prompt share it); completion_tokens adds up every
    response of every choice."""

    def __init__(self):
        self._prompts: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, prompt_index: int, piece: Piece) -> None:
        if piece.input_tokens is not None:
            self._prompts[prompt_index] = piece.input_tokens
        self.completion_tokens += piece.output_tokens

    def as_dict(self) -> dict:
        prompt_tokens = sum(self._prompts.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens}


class CompletionLogprobs:
    """Completions' logprobs of one choice: {tokens, token_logprobs, top_logprobs, text_offset}. top_logprobs holds, for
    each token, the N most likely tokens and the chosen one (so up to N + 1 entries, as OpenAI returns them);
    text_offset goes on from piece to piece. With echo (prompt_ids given), the prompt's tokens come first, scored by
    the first piece: the first prompt token has no log-probability (null, as OpenAI), nor top_logprobs."""

    def __init__(self, texts: TokenTexts, prompt_ids: list[int] | None = None):
        self._texts = texts
        self._offset = 0
        self._prompt_ids = prompt_ids

    def format(self, piece: Piece) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self._prompt_ids is not None:
            prompt, self._prompt_ids = self._prompt_ids, None
            scores = piece.prompt_logprobs or [0.0] * len(prompt)
            self._add(out, prompt, scores, piece.prompt_top_ids, piece.prompt_top_logprobs, first_unscored=True)
        self._add(out, piece.token_ids or [], piece.token_logprobs or [], piece.top_ids, piece.top_logprobs)
        return out

    def _add(self, out: dict, ids: list[int], logprobs: list[float], top_ids, top_logprobs,
             first_unscored: bool = False) -> None:
        text = self._texts.text
        for t, token_id in enumerate(ids):
            token = text(token_id)
            if first_unscored and t == 0:  # a prompt's first token: nothing before it to score it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                entries = {text(i): _finite(lp) for i, lp in zip(top_ids[t], top_logprobs[t])} if top_ids else {}
                entries.setdefault(token, _finite(logprobs[t]))
                out["token_logprobs"].append(_finite(logprobs[t]))
                out["top_logprobs"].append(entries)
            out["tokens"].append(token)
            out["text_offset"].append(self._offset)
            self._offset += len(token)


class ChatLogprobs:
    """Chat's logprobs of one choice: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def __init__(self, texts: TokenTexts):
        self._texts = texts

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self._texts.text(token_id), "logprob": _finite(logprob), "bytes": self._texts.bytes(token_id)}

    def format(self, piece: Piece) -> dict:
        content = []
        for t, (token_id, logprob) in enumerate(zip(piece.token_ids or [], piece.token_logprobs or [])):
            entry = self._entry(token_id, logprob)
            entry["top_logprobs"] = ([self._entry(i, lp) for i, lp in zip(piece.top_ids[t], piece.top_logprobs[t])]
                                     if piece.top_ids else [])
            content.append(entry)
        return {"content": content}


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf and NaN too


class _Format:
    """What the two endpoints share: ids, the envelope, usage."""

    id_prefix: str
    object: str
    chunk_object: str

    def __init__(self, model: str, include_usage: bool = False):
        self.id = self.id_prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def body(self, choices: list[dict], usage: Usage) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage.as_dict()}

    def chunk(self, choice: dict) -> dict:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                 "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def chunk_choices(self, index: int, piece: Piece, logprobs: dict | None, first: bool) -> list[dict]:
        return [self.chunk_choice(index, piece, logprobs, first)]

    def usage_chunk(self, usage: Usage) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage.as_dict()}


class CompletionFormat(_Format):
    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def choice(self, index: int, piece: Piece, logprobs: dict | None) -> dict:
        return {"index": index, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}

    def chunk_choice(self, index: int, piece: Piece, logprobs: dict | None, first: bool) -> dict:
        return self.choice(index, piece, logprobs)


class ChatFormat(_Format):
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, index: int, piece: Piece, logprobs: dict | None) -> dict:
        message = ({"role": "assistant", "content": None, "tool_calls": piece.tool_calls} if piece.tool_calls
                   else {"role": "assistant", "content": piece.text})
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": piece.finish_reason}

    def chunk_choice(self, index: int, piece: Piece, logprobs: dict | None, first: bool) -> dict:
        """The first chunk of each choice carries the role; the last one the finish_reason."""
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text}
        if piece.finish_reason is not None and not first and not piece.text:
            delta = {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": piece.finish_reason}

    def chunk_choices(self, index: int, piece: Piece, logprobs: dict | None, first: bool) -> list[dict]:
        """Tool calls as OpenAI streams them: per call, its id and name with empty arguments, then the arguments;
        the finish_reason in a chunk of its own."""
        if not piece.tool_calls:
            return [self.chunk_choice(index, piece, logprobs, first)]
        deltas = []
        for i, call in enumerate(piece.tool_calls):
            function = call["function"]
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": ""}}
            deltas.append({"role": "assistant", "content": None, "tool_calls": [head]} if first and i == 0
                          else {"tool_calls": [head]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": function["arguments"]}}]})
        chunks = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
        chunks[0]["logprobs"] = logprobs
        return chunks + [{"index": index, "delta": {}, "logprobs": None, "finish_reason": piece.finish_reason}]
