"""The KV-cache batch on the tiny model's export (tests/tiny_engine_model.py): batching, dropping and
joining must not change a greedy answer."""

import numpy as np
import pytest

from python_backend.engine.batch_sampling import choose_next
from python_backend.engine.kv_batch import KVBatch
from python_backend.engine.loop import generate
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import length_sorted_chunks
from python_backend.engine.sequence import Sequence
from tests.helpers import outputs_alone


def sequences(prompts, max_tokens=12, eos=(2,)):
    return [Sequence(prompt_ids=p, params=SamplingParams(max_tokens=max_tokens, end_ids=eos)) for p in prompts]


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder


@pytest.fixture(scope="module")
def alone(decoder, kv_prompts):
    return outputs_alone(decoder, sequences(kv_prompts))


def test_each_prompt_generates_something(alone):
    assert all(len(ids) > 0 for ids in alone)


def test_batched_greedy_equals_alone(decoder, kv_prompts, alone):
    batch = sequences(kv_prompts)
    totals = generate(decoder, batch)
    assert [s.output_ids for s in batch] == alone
    chunks = [[len(s.prompt_ids) for s in chunk] for chunk in length_sorted_chunks(batch)]
    assert totals.padding_tokens == sum(len(c) * max(c) - sum(c) for c in chunks) > 0


def test_sequences_joining_mid_flight_get_the_same_tokens(decoder, kv_prompts, alone):
    first, later = sequences(kv_prompts[:2]), sequences(kv_prompts[2:])
    batch, logits, _ = KVBatch.prefill(decoder, [s.prompt_ids for s in first])
    tokens, _ = choose_next(first, logits)
    for _ in range(3):
        logits = batch.step(decoder, tokens)
        tokens, _ = choose_next(first, logits)
    joining, join_logits, _ = KVBatch.prefill(decoder, [s.prompt_ids for s in later])
    join_tokens, _ = choose_next(later, join_logits)
    batch.extend(joining)
    running, tokens = first + later, np.concatenate([tokens, join_tokens])
    while running:
        keep = [row for row, s in enumerate(running) if not s.finished]
        if not keep:
            break
        batch.select(keep)
        running, tokens = [running[r] for r in keep], tokens[keep]
        tokens, _ = choose_next(running, batch.step(decoder, tokens))
    assert [s.output_ids for s in first + later] == alone


def test_select_trims_columns_that_are_padding_everywhere(decoder, kv_prompts):
    short, long = min(kv_prompts, key=len), max(kv_prompts, key=len)
    batch, _, _ = KVBatch.prefill(decoder, [short, long])
    batch.select([0])
    assert batch.cache_len == len(short) and batch.real_tokens() == len(short)
    assert batch.past[0].shape[2] == len(short)
