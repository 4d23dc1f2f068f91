"""Run a group of sequences to completion as one batch (static / dynamic batching)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from python_backend.kv_batch import KVBatch
from python_backend.onnx_decoder import OnnxDecoder
from python_backend.sequence import Sequence


@dataclass
class BatchStats:
    prefill_tokens: int = 0
    padding_tokens: int = 0  # pad tokens computed in prefill (left padding to the longest prompt)
    decode_steps: int = 0
    decode_tokens: int = 0


def choose_next(sequences: list[Sequence], logits: np.ndarray) -> np.ndarray:
    tokens = np.empty(len(sequences), np.int64)
    for row, seq in enumerate(sequences):
        tokens[row] = seq.chooser.choose(logits[row], seq.output_ids)
        seq.append(int(tokens[row]))
    return tokens


def run_to_completion(decoder: OnnxDecoder, sequences: list[Sequence]) -> BatchStats:
    """Prefills all sequences together, then decodes; a finished sequence leaves the batch at once."""
    stats = BatchStats()
    batch, logits, stats.padding_tokens = KVBatch.prefill(decoder, [s.prompt_ids for s in sequences])
    stats.prefill_tokens = sum(len(s.prompt_ids) for s in sequences)
    running = list(sequences)
    tokens = choose_next(running, logits)
    while True:
        keep = [row for row, seq in enumerate(running) if not seq.finished]
        if not keep:
            return stats
        if len(keep) < len(running):
            batch.select(keep)
            running = [running[row] for row in keep]
            tokens = tokens[keep]
        logits = batch.step(decoder, tokens)
        stats.decode_steps += 1
        stats.decode_tokens += len(running)
        tokens = choose_next(running, logits)
