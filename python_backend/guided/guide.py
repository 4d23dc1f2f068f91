"""One sequence's guide: which tokens its grammar allows next, and the tokens it takes. ``apply_masks`` computes the
masks of every guided row of a batch at once (llguidance's thread pool) and writes them into those rows only."""

from __future__ import annotations

import llguidance
import llguidance.numpy
import numpy as np

_EXECUTOR: llguidance.LLExecutor | None = None


class GuideError(RuntimeError):
    """The grammar cannot go on: the sequence fails alone, with llguidance's reason."""


class Guide:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def stopped(self) -> bool:
        """The grammar is complete and can take nothing more."""
        return self.matcher.is_stopped()

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GuideError(f"the guide refused token {token}: {self.matcher.get_error()}")


def apply_masks(logits: np.ndarray, guided: dict[int, Guide]) -> dict[int, GuideError]:
    """Sets to -inf, in each guided row of ``logits`` (row -> its guide), every token that row's grammar does not
    allow next; other rows are not touched. Returns the rows whose grammar allows nothing (they cannot go on)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    rows = list(guided)
    vocab = logits.shape[-1]
    masks = llguidance.numpy.allocate_token_bitmask(len(rows), vocab)
    llguidance.numpy.fill_next_token_bitmask_par(_EXECUTOR, [(guided[row].matcher, i) for i, row in enumerate(rows)],
                                                 masks)
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
    errors = {}
    for i, row in enumerate(rows):
        matcher = guided[row].matcher
        if matcher.is_error() or not allowed[i].any():
            errors[row] = GuideError(f"the guide allows no next token: {matcher.get_error() or 'a dead end'}")
        else:
            logits[row][~allowed[i]] = -np.inf
    return errors
