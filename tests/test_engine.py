"""The engine on the export of the engine tests' tiny model (tests/tiny_engine_model.py): the three
strategies, joining mid-flight, cancellation, bounds."""

import threading
import time

import pytest

from python_backend.engine.loop import Engine, QueueFullError, generate
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig, length_sorted_chunks
from python_backend.engine.sequence import Sequence
from python_backend.errors import InvalidRequestError
from python_backend.runtime.fault_injection import FaultyDecoder
from tests.helpers import fail_choice_after, outputs_alone

PROMPTS = ["What is the capital of France?", "Hi", "用一句话介绍一下长城。", "def add(a, b):", "Name a color."]
MAX_TOKENS = [12, 6, 10, 8, 5]


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p, apply_chat_template=True) for p in PROMPTS]


def make(prompts, max_tokens=MAX_TOKENS, **params):
    events = []
    seqs = [
        Sequence(prompt_ids=p, params=SamplingParams(**{"max_tokens": n, "end_ids": (2,), **params}),
                 emit=lambda seq, ids, done, _logprobs: events.append((seq.key, list(ids), done)))
        for p, n in zip(prompts, max_tokens)
    ]
    return seqs, events


@pytest.fixture(scope="module")
def alone(decoder, prompts):
    seqs, _ = make(prompts)
    return outputs_alone(decoder, seqs)


def assert_each_stream_adds_up_and_ends_once(seqs, events):
    """Each sequence's emitted pieces concatenate to its output, and exactly one piece, the last, is final."""
    for seq in seqs:
        pieces = [(ids, done) for key, ids, done in events if key == seq.key]
        assert [i for ids, _ in pieces for i in ids] == seq.output_ids
        assert [done for _, done in pieces] == [False] * (len(pieces) - 1) + [True]


def engine(decoder, **config):
    return Engine(decoder, SchedulerConfig(**{"kv_budget_tokens": 100000, **config}))


def test_continuous_batching_admits_at_every_step_and_changes_no_answer(decoder, prompts, alone):
    eng = engine(decoder, strategy="continuous")
    seqs, events = make(prompts)
    eng.submit(seqs[0])
    eng.step()
    eng.submit(seqs[1])
    eng.step()
    assert len(eng.core.running) == 2, "a new request joins the running batch at the next step"
    for seq in seqs[2:]:
        eng.submit(seq)
        eng.step()
    while eng.step():
        pass
    assert [s.output_ids for s in seqs] == alone
    assert_each_stream_adds_up_and_ends_once(seqs, events)


def test_finished_sequences_leave_the_batch_at_once(decoder, prompts):
    eng = engine(decoder, strategy="continuous")
    seqs, _ = make(prompts[:2], [10, 2])
    for seq in seqs:
        eng.submit(seq)
    eng.step()
    eng.step()
    assert seqs[1].finished and eng.core.running == [seqs[0]] and eng.core.cache.size == 1


@pytest.mark.parametrize("strategy", ["dynamic", "static"])
def test_group_strategies_give_the_same_answers(decoder, prompts, alone, strategy):
    seqs, _ = make(prompts)
    generate(decoder, seqs, strategy=strategy)
    assert [s.output_ids for s in seqs] == alone


def test_static_waits_for_its_batch_then_keeps_finished_rows(decoder, prompts):
    eng = engine(decoder, strategy="static", static_batch_size=3, static_timeout_s=60)
    seqs, _ = make(prompts[:3], [10, 1, 3])
    eng.submit(seqs[0])
    eng.submit(seqs[1])
    assert not eng.step() and eng.core.running == [], "static batching waits for static_batch_size requests"
    eng.submit(seqs[2])
    eng.step()
    assert seqs[1].finished and len(eng.core.running) == 3, "a finished row stays until the batch ends"
    while eng.step():
        pass
    assert eng.observer.padding_tokens > 0 and eng.core.cache.size == 0


def test_static_timeout_starts_a_partial_batch(decoder, prompts):
    eng = engine(decoder, strategy="static", static_batch_size=8, static_timeout_s=60)
    [seq], _ = make(prompts[:1], [5])
    eng.submit(seq)
    assert not eng.step(), "a partial batch waits for the timeout"
    seq.arrival -= 61  # as if it had waited past the timeout (no sleeping: the machine's speed must not matter)
    assert eng.step() and len(eng.core.running) == 1


def test_dynamic_runs_groups_and_buckets_by_length(decoder, prompts):
    eng = engine(decoder, strategy="dynamic", length_buckets=(20,))
    short = [p[:5] for p in prompts[:2]]
    seqs, _ = make([prompts[0], short[0], prompts[2], short[1]], [4, 4, 4, 4])
    for seq in seqs:
        eng.submit(seq)
    eng.step()
    assert {s.key for s in eng.core.running} == {seqs[0].key, seqs[2].key}, "one length bucket at a time"
    late, _ = make(prompts[3:4], [4])
    eng.submit(late[0])
    eng.step()
    assert late[0] not in eng.core.running, "a dynamic group runs to completion before the next starts"
    while eng.step():
        pass
    assert all(s.finished for s in seqs + late)


def test_cancel_frees_the_sequence_within_one_step(decoder, prompts):
    eng = engine(decoder, strategy="continuous")
    seqs, events = make(prompts[:2], [50, 50])
    for seq in seqs:
        eng.submit(seq)
    eng.step()
    eng.step()
    eng.cancel(seqs[0].key)
    eng.step()
    assert seqs[0].finish_reason == "cancelled" and eng.core.running == [seqs[1]] and eng.core.cache.size == 1
    assert events[-1][0] == seqs[1].key and [e for e in events if e[0] == seqs[0].key][-1][2] is True


def test_cancel_of_a_waiting_sequence_and_the_is_cancelled_poll(decoder, prompts):
    eng = engine(decoder, strategy="continuous", max_batch_size=1)
    seqs, _ = make(prompts[:2], [20, 20])
    flag = {"cancelled": False}
    seqs[0].is_cancelled = lambda: flag["cancelled"]
    for seq in seqs:
        eng.submit(seq)
    eng.step()
    assert eng.core.running == [seqs[0]] and list(eng.core.waiting) == [seqs[1]]
    eng.cancel(seqs[1].key)
    flag["cancelled"] = True
    eng.step()
    assert seqs[0].finish_reason == seqs[1].finish_reason == "cancelled" and not eng.core.waiting


def test_the_kv_budget_holds_a_request_back_until_it_fits(decoder, prompts, alone):
    seqs, _ = make(prompts[:2], MAX_TOKENS[:2])
    need_first = len(prompts[0]) + MAX_TOKENS[0]
    eng = engine(decoder, strategy="continuous", kv_budget_tokens=need_first + 1)
    for seq in seqs:
        eng.submit(seq)
    eng.step()
    assert eng.core.running == [seqs[0]] and list(eng.core.waiting) == [seqs[1]], \
        "the second does not fit beside the first"
    while not seqs[0].finished:
        assert list(eng.core.waiting) == [seqs[1]]
        eng.step()
    while eng.step():
        assert eng.core.cache.size * eng.core.cache.cache_len <= need_first + 1
    assert [s.output_ids for s in seqs] == alone[:2]


def test_a_request_larger_than_the_budget_is_refused_and_the_queue_is_bounded(decoder, prompts):
    seqs, _ = make([prompts[0]] * 3, [10, 10, 10])
    need = len(prompts[0]) + 10
    eng = engine(decoder, strategy="continuous", kv_budget_tokens=need, max_queue_size=2)
    eng.submit(seqs[0])  # exactly the budget: accepted
    eng.submit(seqs[1])
    with pytest.raises(QueueFullError, match="queue is full"):
        eng.submit(seqs[2])
    too_big, _ = make(prompts[:1], [11])
    with pytest.raises(InvalidRequestError, match=f"need {need + 1} KV-cache slots, more than the budget of {need}"):
        eng.submit(too_big[0])


def test_stop_sequence_tail_is_held_back_until_decided(decoder, prompts, alone):
    stop = tuple(alone[0][3:5])
    seqs, events = make(prompts[:1], [12], stop_token_sequences=(stop,))
    generate(decoder, seqs)
    assert seqs[0].output_ids == alone[0][:3] and seqs[0].finish_reason == "stop"
    assert sum((ids for _, ids, _ in events), []) == alone[0][:3]


def test_engine_thread_serves_submissions(decoder, prompts, alone):
    eng = engine(decoder, strategy="continuous")
    seqs, events = make(prompts)
    eng.start()
    try:
        for seq in seqs:
            eng.submit(seq)
            time.sleep(0.01)
        deadline = time.monotonic() + 60
        while not all(s.final_sent for s in seqs) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        eng.stop()
    assert [s.output_ids for s in seqs] == alone
    assert_each_stream_adds_up_and_ends_once(seqs, events)  # delivered from the outbox thread


def test_stopping_the_engine_answers_every_unfinished_request(decoder, prompts):
    # One at a time, and the first cannot finish before the stop (no EOS, 10,000 tokens): at the stop one request
    # is running and the others wait behind it, however fast the machine is.
    eng = engine(decoder, strategy="continuous", max_batch_size=1)
    seqs, events = make(prompts, [10_000] + [200] * (len(prompts) - 1), end_ids=())
    errors = []
    first_token = threading.Event()
    for seq in seqs:
        seq.on_error = lambda s, error: errors.append((s.key, str(error)))
    seqs[0].emit = lambda seq, ids, done, _logprobs: (events.append((seq.key, list(ids), done)), first_token.set())
    eng.start()
    for seq in seqs:
        eng.submit(seq)
    assert first_token.wait(timeout=120), "the first request streams a token"
    eng.stop()
    finals = [key for key, _, done in events if done] + [key for key, _ in errors]
    assert sorted(finals) == sorted(s.key for s in seqs), "every request ends with exactly one final response"
    assert [key for key, _ in errors] == [s.key for s in seqs] and all(
        message == "the model is shutting down" for _, message in errors), "the running one, then those waiting"
    assert {key for key, _, _ in events} == {seqs[0].key}, "only the running request streamed tokens"


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(decoder, prompts, alone):
    class Broken:
        cache_shape, tensors = decoder.cache_shape, decoder.tensors

        def __init__(self):
            self.calls = 0

        def empty_cache(self, n):
            return decoder.empty_cache(n)

        def forward(self, *args):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("boom")
            return decoder.forward(*args)

    eng = Engine(Broken(), SchedulerConfig(kv_budget_tokens=100000))
    errors = []
    first, _ = make(prompts[:1], [4])
    second, _ = make(prompts[:1], [MAX_TOKENS[0]])
    first[0].on_error = lambda seq, error: errors.append(str(error))
    eng.start()
    try:
        eng.submit(first[0])
        deadline = time.monotonic() + 30
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.submit(second[0])
        while not second[0].final_sent and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        eng.stop()
    assert errors == ["boom"] and first[0].finish_reason == "error"
    assert second[0].output_ids == alone[0]


def test_prefill_chunks_keep_padding_low_and_lose_no_sequence():
    seqs = [Sequence(prompt_ids=[1] * n, params=SamplingParams(max_tokens=1)) for n in (5, 60, 7, 58, 30, 6, 31)]
    chunks = length_sorted_chunks(seqs, max_padding=0.10)
    assert sorted(id(s) for c in chunks for s in c) == sorted(id(s) for s in seqs)
    assert [[len(s.prompt_ids) for s in c] for c in chunks] == [[60, 58], [31, 30], [7, 6], [5]]


def test_a_cancel_that_overtakes_its_request_still_cancels_it(decoder, prompts):
    eng = engine(decoder, strategy="continuous")
    [seq], events = make(prompts[:1], [50])
    eng.cancel(seq.key)
    eng.step()  # the unmatched cancel is kept
    eng.submit(seq)
    assert seq.finish_reason == "cancelled" and not eng.core.waiting and events == [(seq.key, [], True)]


def run_to_end(eng, seqs):
    for seq in seqs:
        eng.submit(seq)
    while eng.step():
        pass


def test_a_failing_prefill_is_retried_per_sequence_so_only_the_culprit_fails(decoder, prompts, alone):
    poison = 7
    seqs, events = make(prompts + [prompts[0][:-1] + [poison]], MAX_TOKENS + [8])
    errors = []
    for seq in seqs:
        seq.on_error = lambda s, error: errors.append((s.key, str(error)))
    faulty = FaultyDecoder(decoder, prefill_token=poison)
    run_to_end(Engine(faulty, SchedulerConfig(kv_budget_tokens=100000)), seqs)
    assert errors == [(seqs[-1].key, "injected fault: a prefill fed token 7")] and seqs[-1].finish_reason == "error"
    assert [s.output_ids for s in seqs[:-1]] == alone, "the neighbours get exactly the tokens they get alone"
    assert_each_stream_adds_up_and_ends_once(seqs[:-1], events)


def test_a_failing_choice_fails_only_its_own_sequence(decoder, prompts, alone):
    seqs, events = make(prompts + [prompts[1]], MAX_TOKENS + [10])
    poisoned = seqs[-1]
    errors = []
    poisoned.on_error = lambda s, error: errors.append(str(error))
    fail_choice_after(poisoned, 2)
    run_to_end(Engine(decoder, SchedulerConfig(kv_budget_tokens=100000)), seqs)
    assert errors == ["the logits are not finite"] and len(poisoned.output_ids) == 2
    assert [s.output_ids for s in seqs[:-1]] == alone
    assert [done for key, _, done in events if key == poisoned.key] == [False] * len(
        [1 for key, _, _ in events if key == poisoned.key]), "a failed sequence gets no final data response"


def test_a_failing_decode_step_ends_every_running_request_at_once_and_the_next_ones_run(decoder, prompts, alone):
    fed = alone[0][0]  # the first decode step feeds it back
    clean = next(i for i in range(1, len(alone)) if fed not in alone[i])  # a request the fault never touches
    eng = Engine(FaultyDecoder(decoder, decode_token=fed), SchedulerConfig(kv_budget_tokens=100000))
    seqs, _ = make(prompts[:3], MAX_TOKENS[:3])
    errors = []
    for seq in seqs:
        seq.on_error = lambda s, error: errors.append(s.key)
    for seq in seqs:
        eng.submit(seq)
    eng.step()  # prefill, then the failing decode: every running sequence gets its error now
    assert sorted(errors) == sorted(s.key for s in seqs) and all(s.final_sent for s in seqs)
    assert eng.core.running == [] and eng.core.cache.size == 0
    later, _ = make(prompts[clean:clean + 1], MAX_TOKENS[clean:clean + 1])
    run_to_end(eng, later)
    assert later[0].output_ids == alone[clean]


@pytest.mark.parametrize("strategy", ["continuous", "dynamic", "static"])
def test_max_prefill_tokens_bounds_every_strategys_prefill_step(decoder, prompts, alone, strategy):
    faulty = FaultyDecoder(decoder)
    cap = max(len(p) for p in prompts)  # the longest prompt alone fits; any two together do not
    eng = Engine(faulty, SchedulerConfig(strategy=strategy, kv_budget_tokens=100000, max_prefill_tokens=cap,
                                         static_batch_size=len(prompts)))
    seqs, _ = make(prompts)
    run_to_end(eng, seqs)
    assert [s.output_ids for s in seqs] == alone
    assert len(faulty.prefill_tokens) >= 2 and max(faulty.prefill_tokens) <= cap, faulty.prefill_tokens


def test_the_config_parameters_make_the_scheduler_config():
    from python_backend.engine.kv_batch import KV_PEAK_FACTOR

    params = {"batching_strategy": "static", "kv_cache_budget_mb": "1", "max_queue_size": "3",
              "max_prefill_tokens": "64", "static_batch_size": "", "static_timeout_ms": "250", "length_buckets": "8, 32"}
    config = SchedulerConfig.from_parameters(params, max_batch_size=4, kv_bytes_per_token=1024)
    assert config == SchedulerConfig(strategy="static", max_batch_size=4, kv_budget_tokens=2**20 // (KV_PEAK_FACTOR * 1024),
                                     max_queue_size=3, max_prefill_tokens=64, static_batch_size=4,
                                     static_timeout_s=0.25, length_buckets=(8, 32))


def test_the_tiny_model_takes_the_served_models_tokenizer_and_its_sources_config(tiny_dir, model_dir, settings):
    """The tiny model reads its tokenizer and config from the export's source, not from the export (so that `make`
    builds it beside the export): its tokenizer files are the export's byte for byte, so that the prompts these tests
    tokenize with the served model's tokenizer are its own ids, and its config is the source's but for its recipe."""
    import json
    from pathlib import Path

    from tests.tiny_engine_model import RECIPE

    folder = tiny_dir.parent / "hf"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).read_bytes() == (model_dir / name).read_bytes(), name
    config = json.loads((folder / "config.json").read_text())
    source = json.loads((Path(settings["hf_dir"]) / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in RECIPE} == {k: v for k, v in source.items() if k not in RECIPE}
