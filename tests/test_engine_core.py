"""The engine's core driven step by step, on the calling thread, with no callbacks: what each step returns."""

import time

import pytest

from python_backend.engine.core import EngineCore
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import Scheduler, SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.engine.step_output import Decoded, Failed, NewTokens, Prefilled, StepOutput
from python_backend.runtime.fault_injection import FAULT_ENV, FaultyDecoder, parse_spec
from tests.helpers import CountingDecoder, fail_choice_after, outputs_alone

PROMPTS = ["What is the capital of France?", "Hi", "用一句话介绍一下长城。", "def add(a, b):"]


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p, apply_chat_template=True) for p in PROMPTS]


def make(prompts, max_tokens, **params):
    """Sequences without any callback: what they produce is read from the steps' outputs alone."""
    return [Sequence(prompt_ids=p, params=SamplingParams(**{"max_tokens": n, "end_ids": (), **params}))
            for p, n in zip(prompts, max_tokens)]


def core(decoder, **config):
    return EngineCore(decoder, SchedulerConfig(**{"kv_budget_tokens": 100000, **config}))


def run(eng, sequences) -> list[StepOutput]:
    for seq in sequences:
        assert eng.add(seq) == []
    outputs = []
    while (out := eng.step()).progressed:
        outputs.append(out)
    assert out.events == [] and not eng.has_work
    return outputs


def tokens_of(seq, outputs) -> list[list[int]]:
    """The ids each step handed out for seq (steps that gave it nothing left out)."""
    return [e.ids for out in outputs for e in out.new_tokens if e.seq is seq]


@pytest.fixture(scope="module")
def alone(decoder, prompts):
    return outputs_alone(decoder, make(prompts, [8] * len(prompts)))


def test_a_requests_tokens_arrive_in_the_events_of_successive_steps(decoder, prompts, alone):
    [seq] = make(prompts[:1], [8])
    outputs = run(core(decoder, strategy="continuous"), [seq])
    assert tokens_of(seq, outputs) == [[token] for token in alone[0]], "the prefill's token, then one per decode"
    assert len(outputs) == 7, "the first step prefills and decodes"
    assert [e.finished for out in outputs for e in out.new_tokens] == [False] * 7 + [True]
    assert seq.finish_reason == "length"
    assert [type(e) for e in outputs[0].events] == [Prefilled, NewTokens, Decoded, NewTokens]
    assert all([type(e) for e in out.events] == [Decoded, NewTokens] for out in outputs[1:])


def test_batching_changes_no_sequences_tokens(decoder, prompts, alone):
    seqs = make(prompts, [8] * len(prompts))
    outputs = run(core(decoder, strategy="continuous"), seqs)
    assert [sum(tokens_of(seq, outputs), []) for seq in seqs] == alone


def test_a_cancelled_sequence_appears_as_finished_and_cancelled_in_the_next_step(decoder, prompts, alone):
    eng = core(decoder, strategy="continuous", max_batch_size=2)
    running, other, waiting = make(prompts[:3], [8, 8, 8])
    for seq in (running, other, waiting):
        eng.add(seq)
    eng.step()
    assert eng.running == [running, other] and list(eng.waiting) == [waiting]
    eng.cancel(running.key)
    eng.cancel(waiting.key)
    out = eng.step()
    assert out.finished == [waiting, running] and running.finish_reason == waiting.finish_reason == "cancelled"
    assert [(e.ids, e.finished) for e in out.new_tokens if e.seq is waiting] == [([], True)]
    assert eng.running == [other] and not eng.waiting and eng.cache.size == 1
    assert [e.seq for e in out.new_tokens] == [waiting, running, other], "the others step on"
    while eng.step().progressed:
        pass
    assert other.output_ids == alone[1]


def test_a_cancel_that_comes_before_its_sequence_ends_it_when_it_is_added(decoder, prompts):
    eng = core(decoder, strategy="continuous")
    [seq] = make(prompts[:1], [8])
    eng.cancel(seq.key)
    assert not eng.step().progressed
    assert eng.add(seq) == [NewTokens(seq, [], True, None)] and seq.finish_reason == "cancelled"
    assert not eng.has_work


def test_a_failed_choice_fails_only_its_own_row(decoder, prompts, alone):
    seqs = make(prompts, [8] * len(prompts))
    poisoned = seqs[2]
    fail_choice_after(poisoned, 3)
    outputs = run(core(decoder, strategy="continuous"), seqs)
    [failing_step] = [out for out in outputs if out.failed]
    assert failing_step.failed == [Failed(poisoned, failing_step.failed[0].error)]
    assert str(failing_step.failed[0].error) == "the logits are not finite" and failing_step.error is None
    assert poisoned.finish_reason == "error" and poisoned.output_ids == alone[2][:3]
    assert tokens_of(poisoned, outputs) == [[t] for t in alone[2][:3]], "no final tokens event after its error"
    neighbours = sorted(s.key for s in seqs if s is not poisoned)
    assert sorted(e.seq.key for e in failing_step.new_tokens) == neighbours, "its neighbours step on"
    assert [s.output_ids for s in seqs if s is not poisoned] == alone[:2] + alone[3:]


def test_a_failed_decode_step_is_the_steps_error_and_fails_its_whole_batch(decoder, prompts, alone):
    fed = alone[0][0]  # the first decode step feeds it back
    eng = core(FaultyDecoder(decoder, decode_token=fed), strategy="continuous")
    seqs = make(prompts[:2], [8, 8])
    for seq in seqs:
        eng.add(seq)
    out = eng.step()
    assert "injected fault: a decode step" in str(out.error) and out.progressed and out.state is None
    assert [f.seq for f in out.failed] == seqs and all(f.error is out.error for f in out.failed)
    assert eng.running == [] and eng.cache.size == 0


def test_a_step_floor_makes_every_step_last_at_least_its_time_and_changes_no_token(decoder, prompts, alone):
    """min_step_ms, which the suite's servers run with (tests/helpers.py's SUITE_MIN_STEP_MS): the tiny model's steps
    take a few milliseconds here; paced, none ends sooner than the floor, and the tokens are the same."""
    floor_s = 0.05
    eng = core(FaultyDecoder(decoder, **parse_spec("min_step_ms=50")), strategy="continuous")
    seqs = make(prompts[:2], [8, 8])
    for seq in seqs:
        eng.add(seq)
    steps = []
    while True:
        started = time.monotonic()
        if not eng.step().progressed:
            break
        steps.append(time.monotonic() - started)
    assert len(steps) >= 7 and min(steps) >= floor_s, steps  # 8 tokens: a prefill, then a decode step each
    assert [s.output_ids for s in seqs] == alone[:2]


def test_a_fault_spec_names_each_fault_and_refuses_what_it_does_not_know():
    assert parse_spec("prefill_token=7, decode_token=3681,min_step_ms=20") == {
        "prefill_token": 7, "decode_token": 3681, "min_step_s": 0.02}
    for bad in ("min_step_ms=fast", "slow_step=20", "decode_token"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            parse_spec(bad)


def test_static_waits_for_its_batch_and_keeps_finished_rows_as_padding(decoder, prompts):
    eng = core(decoder, strategy="static", static_batch_size=3, static_timeout_s=3600)
    seqs = make(prompts[:3], [6, 1, 3])
    eng.add(seqs[0])
    eng.add(seqs[1])
    idle = eng.step()
    assert not idle.progressed and idle.events == [] and (idle.state.running, idle.state.waiting) == (0, 2)
    assert eng.step().state is None, "an unchanged state is not reported again"
    eng.add(seqs[2])
    decodes, rows = [], []
    while (out := eng.step()).progressed:
        decodes += [(e.batch_size, e.dead_rows) for e in out.events if isinstance(e, Decoded)]
        rows.append(len(eng.running))
    assert decodes == [(3, 1), (3, 1), (3, 2), (3, 2), (3, 2)], "every decode computes all three rows"
    assert rows == [3, 3, 3, 3, 0] and eng.cache.size == 0


def test_dynamic_lets_finished_rows_go_at_once(decoder, prompts):
    seqs = make(prompts[:3], [6, 1, 3])
    outputs = run(core(decoder, strategy="dynamic"), seqs)
    decodes = [(e.batch_size, e.dead_rows) for out in outputs for e in out.events if isinstance(e, Decoded)]
    assert decodes == [(3, 1), (2, 0), (1, 0), (1, 0), (1, 0)]


def test_stream_yields_a_newcomers_first_token_before_the_step_decodes(decoder, prompts):
    counting = CountingDecoder(decoder)
    eng = core(counting, strategy="continuous")
    [first, second] = make(prompts[:2], [8, 8])
    eng.add(first)
    eng.step()
    assert len(counting.calls) == 2, "a prefill and a decode"
    eng.add(second)
    out = StepOutput()
    calls_when_yielded = [len(counting.calls) for event in eng.stream(out) if isinstance(event, NewTokens)]
    assert calls_when_yielded == [3, 4, 4], "the newcomer's token left after its prefill, before the decode ran"
    assert [type(e) for e in out.events] == [Prefilled, NewTokens, Decoded, NewTokens, NewTokens]
    assert [e.seq for e in out.new_tokens] == [second, first, second]


# The policy the core asks, on sequences alone (no model).

def plain(prompt_len, max_tokens=4, finish_reason=None):
    seq = Sequence(prompt_ids=[1] * prompt_len, params=SamplingParams(max_tokens=max_tokens))
    seq.finish_reason = finish_reason
    return seq


@pytest.mark.parametrize("strategy", ["continuous", "dynamic", "static"])
def test_the_scheduler_says_when_the_batch_decodes(strategy):
    scheduler = Scheduler(SchedulerConfig(strategy=strategy))
    running, admitted = [plain(5), plain(5, finish_reason="eos")], [plain(5)]
    assert scheduler.should_decode(running, admitted) == (strategy == "continuous"), "a group waits for its prefill"
    assert scheduler.should_decode(running, [])
    assert not scheduler.should_decode([plain(5, finish_reason="eos")], []), "never for finished rows alone"


@pytest.mark.parametrize("strategy", ["continuous", "dynamic", "static"])
def test_only_static_keeps_finished_rows_until_its_last_row_ends(strategy):
    scheduler = Scheduler(SchedulerConfig(strategy=strategy))
    running = [plain(5), plain(5, finish_reason="eos"), plain(5, finish_reason="cancelled"),
               plain(5, finish_reason="error"), plain(5, finish_reason="length")]
    expected = [0, 1, 4] if strategy == "static" else [0]
    assert scheduler.rows_to_keep(running) == expected, "static keeps padding rows, never a cancelled or failed one"
    ended = running[1:]
    assert scheduler.rows_to_keep(ended) == [], "the batch ends with its last row"


def test_a_steps_prefill_is_bounded_by_max_prefill_tokens_and_takes_at_least_one():
    scheduler = Scheduler(SchedulerConfig(max_prefill_tokens=50))
    big, small, medium, rest = plain(60), plain(20), plain(25), plain(10)
    admitted = [big, small, medium, rest]
    assert scheduler.prefill_chunks(admitted) == [[big]], "a prompt above the bound still goes, alone"
    assert scheduler.prefill_chunks(admitted) == [[medium, small]], "then as many as fit, longest first"
    assert scheduler.prefill_chunks(admitted) == [[rest]] and admitted == []
