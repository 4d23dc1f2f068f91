"""Speculative decoding for a lone row: a small draft model proposes the next few tokens one call each, and the served
model checks them all in one call of several tokens (core.py's ``_decode_speculative``).

Why a lone row: on a CPU one row's decode step reads all the weights for one token (fp32 SmolLM2: 540 MB, ~21 ms),
and a call of 7 tokens costs about 29 ms, so each draft kept is a token almost for free. A batch's step is
compute-bound already, and the drafts would cost more than they save (docs/performance.md, the speculative probe).

The answers do not change: each position's token is chosen by the sequence's own chooser from the served model's
logits at that position (its grammar, penalties and seed included), and a draft counts only while it is that very
token, so every logits row read follows the sequence's real tokens. The draft only decides how many positions one
call computes.

The draft's KV cache is one slot of its own (the same layout as kv_slots.py), holding one sequence's tokens: those
it was fed that turned out to be the sequence's. It belongs to the lone row of the moment; another row alone later
starts it again.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from python_backend.engine.kv_slots import buffers

DEFAULT_DRAFT_TOKENS = 6  # the probe's best trade on the 2-core CPU: 6.3 tokens per fp32 call (docs/performance.md)


@dataclass
class SpeculationCounts:
    """Since the engine started: checking calls of the served model, draft tokens proposed, and of them kept."""
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0


class Drafter:
    """The draft model (a fused graph: python_backend/runtime/onnx_slot_decoder.py) and its one-slot cache."""

    def __init__(self, decoder, draft_tokens: int, max_len: int):
        if draft_tokens < 1:
            raise ValueError(f"speculative_tokens must be at least 1, not {draft_tokens}")
        if getattr(decoder, "kv_layout", "padded") != "slots":
            raise ValueError("the draft model must be a fused graph (a QUANT variant's folder) writing its cache in "
                             "place")
        self.decoder = decoder
        self.draft_tokens = draft_tokens
        self.max_len = max_len + draft_tokens + 1
        shape = decoder.cache_shape
        self._maps, self._cache = buffers(decoder.tensors, len(shape.cache_names()),
                                          (1, shape.num_kv_heads, self.max_len, shape.head_dim), shape.dtype)
        self._owner: str | None = None  # the key of the sequence whose tokens the cache holds
        self._valid = 0  # how many of its tokens, from the first
        self._fed = 0  # tokens written in the cache (the last round's drafts included)

    def propose(self, key: str, tokens: list[int], count: int) -> list[int]:
        """The draft's ``count`` greedy tokens after ``tokens`` (all of a sequence's tokens so far), fed from where its
        cache stops holding this sequence's tokens: the whole sequence for a new owner."""
        if key != self._owner or len(tokens) <= self._valid:  # (a key used again by another request: start anew)
            self._reset(key)
        if len(tokens) + count > self.max_len:
            raise ValueError(f"{len(tokens)} tokens and {count} drafts exceed the draft cache ({self.max_len})")
        proposed = [self._next(tokens[self._valid:], len(tokens))]
        self._valid = self._fed = len(tokens)
        for _ in range(1, count):
            self._fed += 1
            proposed.append(self._next([proposed[-1]], self._fed))
        return proposed

    def accept(self, kept: int) -> None:
        """After a round whose first ``kept`` drafts were the sequence's next tokens: the cache holds the sequence's
        tokens up to there (the last draft was never fed; what follows a rejected one is written over)."""
        self._valid = min(self._fed, self._valid + kept)

    def forget(self) -> None:
        """Holds nothing any more (after a failed call, its cache is not trusted)."""
        self._owner = None

    def _next(self, new: list[int], total: int) -> int:
        logits = self.decoder.forward_in_place(np.array([new], np.int64), np.ones((1, total), np.int64), self._cache)
        return int(logits[0, -1].argmax())

    def _reset(self, key: str) -> None:
        self._owner, self._valid, self._fed = key, 0, 0
        for m in self._maps:  # the previous owner's pages go back to the system
            m.madvise(mmap.MADV_DONTNEED)
