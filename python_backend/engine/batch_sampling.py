"""Choosing the next token of every sequence in a batch, so that a choice that fails fails only its own sequence."""

from __future__ import annotations

import numpy as np

from python_backend.engine.sampling import token_logprob
from python_backend.engine.sequence import Sequence
from python_backend.guided.guide import apply_masks

Failures = list[tuple[Sequence, Exception]]


def choose_next(sequences: list[Sequence], logits: np.ndarray) -> tuple[np.ndarray, Failures]:
    """Picks (and appends) each sequence's next token from its row of last-position logits, with its
    log-probability when the sequence asks for them. ``logits`` is the caller's own array: a guided row is masked in
    place (its log-probabilities stay the model's own, as for penalties).

    A sequence whose choice fails (its own sampling settings or grammar, say) is returned with its error instead, so
    that only it fails; its row gets token 0, which nothing reads because the sequence leaves the batch."""
    tokens = np.zeros(len(sequences), np.int64)
    failed = []
    guided = {row: seq.guide for row, seq in enumerate(sequences) if seq.guide is not None}
    model_logits = {row: logits[row].copy() for row in guided if sequences[row].params.logprobs}
    mask_errors = apply_masks(logits, guided) if guided else {}
    for row, seq in enumerate(sequences):
        try:
            if row in mask_errors:
                raise mask_errors[row]
            tokens[row] = seq.chooser.choose(logits[row], seq.output_ids)
            logprob = token_logprob(model_logits.get(row, logits[row]), int(tokens[row]), seq.params.top_logprobs) \
                if seq.params.logprobs else None
            if seq.guide is not None and int(tokens[row]) not in seq.params.end_ids:
                seq.guide.accept(int(tokens[row]))
        except Exception as error:  # noqa: BLE001 - isolated to this sequence
            failed.append((seq, error))
            continue
        seq.append(int(tokens[row]), logprob)
        if seq.guide is not None and seq.guide.stopped and seq.finish_reason in (None, "length"):
            seq.finish_reason = "stop"  # the grammar is complete: the answer is whole, whatever max_tokens says
    return tokens, failed
