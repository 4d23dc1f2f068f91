"""Request priority in the engine (lower runs earlier, default 0; batch jobs send a positive one): waiting
sequences are admitted by priority, first come first served within one; background sequences never take the
reserved rows nor make the queue refuse live ones."""

import pytest

from python_backend.engine.core import EngineCore, QueueFullError
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.engine.step_output import NewTokens, StepOutput


def seq(priority=0, max_tokens=32):
    return Sequence(prompt_ids=[1, 504, 3158], params=SamplingParams(max_tokens=max_tokens, end_ids=()),
                    priority=priority)


def core(decoder, **config):
    return EngineCore(decoder, SchedulerConfig(**{"max_batch_size": 4, "kv_budget_tokens": 4096, **config}))


def test_waiting_sequences_are_admitted_by_priority_then_arrival(decoder):
    engine = core(decoder, max_batch_size=1)
    first_batch, second_batch, live, urgent = seq(5), seq(5), seq(0), seq(-1)
    for s in (first_batch, second_batch, live, urgent):
        engine.add(s)
    assert list(engine.waiting) == [urgent, live, first_batch, second_batch]
    engine.step()
    assert engine.running == [urgent]


def test_background_sequences_leave_the_reserved_rows_to_live_ones(decoder):
    engine = core(decoder, priority_reserved_slots=2)
    background = [seq(1) for _ in range(4)]
    for s in background:
        engine.add(s)
    engine.step()
    assert engine.running == background[:2] and list(engine.waiting) == background[2:]
    live = [seq(0), seq(0)]
    for s in live:
        engine.add(s)
    engine.step()
    assert engine.running == background[:2] + live, "live requests take the reserved rows at the next step"


def test_background_work_never_makes_the_queue_refuse_live_work(decoder):
    engine = core(decoder, max_queue_size=2)
    engine.add(seq(1))
    engine.add(seq(1))
    with pytest.raises(QueueFullError):
        engine.add(seq(1))
    engine.add(seq(0))
    engine.add(seq(0))
    with pytest.raises(QueueFullError):
        engine.add(seq(0))
    with pytest.raises(QueueFullError):
        engine.add(seq(1))  # background counts everything as urgent as itself or more


def test_priority_reserved_slots_must_leave_a_row():
    with pytest.raises(ValueError, match="priority_reserved_slots"):
        SchedulerConfig(max_batch_size=4, priority_reserved_slots=4)


def test_a_live_request_is_prefilled_before_the_batch_lines_admitted_with_it(decoder):
    engine = core(decoder, max_batch_size=8)
    long_batch_lines = [Sequence(prompt_ids=[1] + [504] * 40, params=SamplingParams(max_tokens=4, end_ids=()),
                                 priority=1) for _ in range(3)]
    live = seq(0)
    for s in long_batch_lines + [live]:
        engine.add(s)
    first_tokens = []
    for event in engine.stream(StepOutput()):
        if isinstance(event, NewTokens):
            first_tokens.append(event.seq)
    assert first_tokens[0] is live, "the live request's first token comes before the batch lines' prefill"


def test_the_configured_reserve_is_capped_by_a_small_batch():
    params = {"batching_strategy": "continuous", "kv_cache_budget_mb": "1", "max_queue_size": "8",
              "max_prefill_tokens": "64", "static_timeout_ms": "500", "priority_reserved_slots": "2"}
    assert SchedulerConfig.from_parameters(params, 1, 1024).priority_reserved_slots == 0
    assert SchedulerConfig.from_parameters(params, 32, 1024).priority_reserved_slots == 2
