"""Choosing the next token of every sequence in a batch, so that a choice that fails fails only its own sequence."""

from __future__ import annotations

import numpy as np

from python_backend.engine.sampling import token_logprob
from python_backend.engine.sequence import Sequence

Failures = list[tuple[Sequence, Exception]]


def choose_next(sequences: list[Sequence], logits: np.ndarray) -> tuple[np.ndarray, Failures]:
    """Picks (and appends) each sequence's next token from its row of last-position logits, with its
    log-probability when the sequence asks for them.

    A sequence whose choice fails (its own sampling settings, say) is returned with its error instead, so that
    only it fails; its row gets token 0, which nothing reads because the sequence leaves the batch."""
    tokens = np.zeros(len(sequences), np.int64)
    failed = []
    for row, seq in enumerate(sequences):
        try:
            tokens[row] = seq.chooser.choose(logits[row], seq.output_ids)
            logprob = token_logprob(logits[row], int(tokens[row]), seq.params.top_logprobs) \
                if seq.params.logprobs else None
        except Exception as error:  # noqa: BLE001 - isolated to this sequence
            failed.append((seq, error))
            continue
        seq.append(int(tokens[row]), logprob)
    return tokens, failed
