"""The slot KV cache (python_backend/engine/kv_slots.py) on the fused graph of the engine tests' tiny model
(QUANT=fast; tests/tiny_engine_model.py): rows that join, leave, are cancelled or fail never change another row's
greedy answer; freed slots go back to the system; the scheduler counts each row's own reservation."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from python_backend.engine.core import EngineCore
from python_backend.engine.kv_slots import SlotKVCache
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.engine.step_output import Decoded
from python_backend.errors import InvalidRequestError
from python_backend.model_files import ONNX_FILE
from python_backend.runtime.decoder import CacheShape, HostTensors
from python_backend.runtime.factory import cpu_decoder
from python_backend.runtime.onnx_slot_decoder import OnnxSlotDecoder
from tests.helpers import CountingDecoder, fail_choice_after, outputs_alone, variant_folder

MAX_TOKENS = (6, 14, 9, 20, 11)  # rows leave at different steps


@pytest.fixture(scope="module")
def decoder(tiny_dir):
    fused = cpu_decoder(variant_folder(tiny_dir, "fast") / ONNX_FILE)
    assert isinstance(fused, OnnxSlotDecoder)
    return fused


def sequences(prompts):
    return [Sequence(prompt_ids=p, params=SamplingParams(max_tokens=m, end_ids=()))
            for p, m in zip(prompts, MAX_TOKENS)]


@pytest.fixture(scope="module")
def alone(decoder, kv_prompts):
    return outputs_alone(decoder, sequences(kv_prompts))


def run(decoder, seqs, strategy="continuous", max_batch_size=8, budget=65536, on_step=None):
    config = SchedulerConfig(strategy=strategy, max_batch_size=max_batch_size, kv_budget_tokens=budget,
                             kv_layout="slots", max_context_length=512, static_batch_size=len(seqs))
    core = EngineCore(decoder, config)
    for seq in seqs:
        core.add(seq)
    while core.step().progressed:
        if on_step:
            on_step(core)
    return core


@pytest.mark.parametrize("strategy", ["continuous", "dynamic", "static"])
def test_a_batch_of_slots_gives_each_row_its_answer_alone(decoder, kv_prompts, alone, strategy):
    seqs = sequences(kv_prompts)
    core = run(decoder, seqs, strategy)
    assert [s.output_ids for s in seqs] == alone
    assert core.cache.size == 0 and core.cache.cache_bytes() == 0


def test_rows_join_freed_slots_and_moved_rows_keep_their_answers(decoder, kv_prompts, alone):
    seqs = sequences(kv_prompts)
    sizes = []
    run(decoder, seqs, max_batch_size=2, on_step=lambda core: sizes.append(core.cache.size))
    assert [s.output_ids for s in seqs] == alone
    assert max(sizes) == 2 and len(sizes) > max(MAX_TOKENS), "rows joined as others left"


def test_a_cancelled_row_leaves_and_the_others_are_unchanged(decoder, kv_prompts, alone):
    seqs = sequences(kv_prompts)

    def cancel_the_second(core):
        if len(seqs[1].output_ids) == 3:
            core.cancel(seqs[1].key)

    run(decoder, seqs, on_step=cancel_the_second)
    assert seqs[1].finish_reason == "cancelled" and len(seqs[1].output_ids) < MAX_TOKENS[1]
    assert [s.output_ids for i, s in enumerate(seqs) if i != 1] == [a for i, a in enumerate(alone) if i != 1]


def test_a_failing_row_leaves_and_the_others_are_unchanged(decoder, kv_prompts, alone):
    seqs = sequences(kv_prompts)
    fail_choice_after(seqs[0], 2)
    run(decoder, seqs)
    assert seqs[0].finish_reason == "error"
    assert [s.output_ids for s in seqs[1:]] == alone[1:]


def test_batch_rows_wait_while_a_live_row_runs_and_every_row_keeps_its_answer(decoder, kv_prompts, alone):
    """The last sequence is live (priority 0) and comes after the four batch rows (priority 1) have started: while it
    runs, one batch row decodes with it and the others wait (moved behind them); then all resume."""
    seqs = sequences(kv_prompts)
    background, live = seqs[:4], seqs[4]
    for seq in background:
        seq.priority = 1
    config = SchedulerConfig(max_batch_size=8, kv_budget_tokens=65536, kv_layout="slots", max_context_length=512,
                             background_rows_with_live=1, live_grace_s=0)
    core = EngineCore(decoder, config)
    for seq in background:
        core.add(seq)
    core.step()
    core.step()
    core.add(live)
    decoded_while_live = []
    while True:
        out = core.step()
        if not out.progressed:
            break
        if not live.finished or any(e.seq is live for e in out.events if hasattr(e, "seq")):
            decoded_while_live += [e.batch_size for e in out.events if isinstance(e, Decoded)]
    assert decoded_while_live and max(decoded_while_live) == 2, decoded_while_live
    assert [s.output_ids for s in seqs] == alone, "a wait, and the moves, change no row's answer"


def test_the_same_prompt_admitted_together_is_computed_once_and_every_copy_keeps_its_answer(decoder, kv_prompts, alone):
    counting = CountingDecoder(decoder)
    core = EngineCore(counting, SchedulerConfig(max_batch_size=8, kv_layout="slots", max_context_length=512))
    other = next(i for i in range(1, len(kv_prompts)) if alone[i][0] != alone[0][0])  # another first token
    order = (0, other, 0, other, 0)  # n choices of two kv_prompts, in one prefill chunk
    seqs = [Sequence(prompt_ids=list(kv_prompts[i]), params=SamplingParams(max_tokens=MAX_TOKENS[i], end_ids=()))
            for i in order]
    list(core._prefill_chunk(seqs))
    assert counting.calls == [(2, max(len(kv_prompts[0]), len(kv_prompts[other])))], "each prompt computed once"
    while core.step().progressed:
        pass
    assert [s.output_ids for s in seqs] == [alone[i] for i in order]


def test_the_cache_holds_each_rows_tokens_and_static_rows_stop_at_their_reservation(decoder, kv_prompts):
    seqs = sequences(kv_prompts)
    seen = []

    def check(core):
        cache = core.cache
        assert np.all(cache.lengths <= cache.reserved)
        assert cache.cache_bytes() == int(cache.lengths.sum()) * decoder.cache_shape.bytes_per_token()
        seen.append(cache.size)

    run(decoder, seqs, strategy="static", on_step=check)
    assert max(seen) == len(seqs)


@pytest.mark.parametrize("all_positions", [False, True])
def test_rows_after_their_own_pasts_in_one_call_are_each_the_bits_of_a_call_of_its_own(decoder, kv_prompts,
                                                                                       all_positions):
    """The prefix cache's rests: rows after cached prefixes of different lengths (one after none: a first prompt),
    with rests of different lengths right-padded in one call (query_seqlens), give each row the logits and the keys
    and values that the row gets in a call of its own, to the bit."""
    prompts = kv_prompts[:4]
    cached = [7, 0, 13, len(prompts[3]) - 2]
    source = SlotKVCache(decoder, len(prompts), 256)  # each prompt's keys and values, computed whole
    source.prefill(prompts, [256] * len(prompts))

    def fill(row: int):
        def write(target):
            for written, held in zip(target, source.row(row)):
                written[:, :, :cached[row]] = held[:, :, :cached[row]]
        return write

    together = SlotKVCache(decoder, len(prompts), 256)
    logits, computed, padding = together.prefill(prompts, [256] * len(prompts), all_positions, cached=cached,
                                                 fills=[fill(r) for r in range(len(prompts))])
    rests = [len(p) - c for p, c in zip(prompts, cached)]
    assert (computed, padding) == (len(prompts) * max(rests), len(prompts) * max(rests) - sum(rests))
    apart = SlotKVCache(decoder, len(prompts), 256)
    for r, prompt in enumerate(prompts):
        alone, _, _ = apart.prefill([prompt], [256], all_positions, cached=cached[r:r + 1], fills=[fill(r)])
        assert np.array_equal(logits[r], alone[0]), f"row {r}: {cached[r]} cached, {rests[r]} computed"
        for mine, its in zip(together.row(r), apart.row(r)):
            assert np.array_equal(mine[:, :, :len(prompt)], its[:, :, :len(prompt)])


def test_the_rest_benchmark_times_both_ways_on_the_same_bits(decoder):
    from scripts.bench.rest_prefill import compare

    apart, together, difference = compare(SlotKVCache(decoder, 3, 64), 20, 3, 9, 3, 1, np.random.default_rng(0))
    assert apart > 0 and together > 0 and difference == 0.0


def test_the_budget_counts_each_rows_reservation_and_the_context_bounds_a_row(decoder, kv_prompts):
    seqs = sequences(kv_prompts[:2])
    budget = seqs[0].reserved_tokens() + seqs[1].reserved_tokens() - 1
    config = SchedulerConfig(max_batch_size=8, kv_budget_tokens=budget, kv_layout="slots", max_context_length=512)
    core = EngineCore(decoder, config)
    for seq in seqs:
        core.add(seq)
    core.step()
    assert core.running == [seqs[0]] and list(core.waiting) == [seqs[1]], "the second waits for room"
    while core.step().progressed:
        pass
    assert all(s.finish_reason == "length" for s in seqs)
    roomy = EngineCore(decoder, replace(config, kv_budget_tokens=65536))
    with pytest.raises(InvalidRequestError, match="context length of 512"):
        roomy.add(Sequence(prompt_ids=[1] * 500, params=SamplingParams(max_tokens=13)))


class _ShapeOnly:
    kv_layout = "slots"
    tensors = HostTensors()
    cache_shape = CacheShape(num_layers=2, num_kv_heads=3, head_dim=64, dtype=np.dtype(np.float32))


def test_select_moves_the_last_rows_into_holes_and_frees_their_slots():
    cache = SlotKVCache(_ShapeOnly(), slots=6, max_len=40)
    assert cache.max_len % cache.align_tokens == 0 and cache.max_len >= 40
    cache.lengths, cache.reserved = np.array([5, 7, 9, 11, 13, 3]), np.full(6, 40)
    cache.adapters = [None] * 6
    for buffer in cache._buffers:
        for row in range(6):
            buffer[row, :, : cache.lengths[row]] = row + 1
    order = cache.select([0, 2, 4, 5])  # rows 1 and 3 leave: rows 4 and 5 fill slots 1 and 3
    assert order == [0, 4, 2, 5]
    assert cache.lengths.tolist() == [5, 13, 9, 3]
    for buffer in cache._buffers:
        for slot, row in enumerate(order):
            assert np.all(buffer[slot, :, : cache.lengths[slot]] == row + 1)
        assert not buffer[4:].any(), "freed slots went back to the system (they read as zeros)"
    cache.clear()
    assert cache.size == 0 and not any(b.any() for b in cache._buffers)


def test_a_failed_prefill_adds_no_row():
    class Failing(_ShapeOnly):
        def forward_in_place(self, *args):
            raise RuntimeError("boom")

    cache = SlotKVCache(Failing(), slots=2, max_len=32)
    with pytest.raises(RuntimeError):
        cache.prefill([[1, 2, 3]], [10])
    assert cache.size == 0


def test_a_slot_cache_needs_a_context_length():
    from python_backend.engine.core import open_kv_cache

    with pytest.raises(ValueError, match="max_context_length"):
        open_kv_cache(SimpleNamespace(kv_layout="slots"), SchedulerConfig(kv_layout="slots"))


def test_the_config_budget_counts_slots_once_and_takes_the_context_length():
    params = {"batching_strategy": "continuous", "kv_cache_budget_mb": "1", "max_queue_size": "8",
              "max_prefill_tokens": "64", "static_timeout_ms": "250"}
    slots = SchedulerConfig.from_parameters(params, 4, kv_bytes_per_token=1024, kv_layout="slots",
                                            max_context_length=512)
    padded = SchedulerConfig.from_parameters(params, 4, kv_bytes_per_token=1024)
    assert slots.kv_budget_tokens == 2**20 // 1024 == 2 * padded.kv_budget_tokens
    assert (slots.kv_layout, slots.max_context_length) == ("slots", 512)
