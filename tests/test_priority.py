"""Request priority in the engine (lower runs earlier, default 0; batch jobs send a positive one): waiting
sequences are admitted by priority, first come first served within one; background sequences never take the
reserved rows nor make the queue refuse live ones. On the engine tests' tiny model (tests/tiny_engine_model.py)."""

import pytest

from python_backend.engine.core import EngineCore, QueueFullError
from python_backend.engine.sampling import SamplingParams
from python_backend.engine.scheduler import SchedulerConfig
from python_backend.engine.sequence import Sequence
from python_backend.engine.step_output import Decoded, NewTokens, StepOutput


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    return tiny_decoder


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


def background_rows(engine) -> int:
    return sum(s.priority > 0 for s in engine.running + engine.prefilling)


def test_while_live_work_runs_background_work_is_held_to_its_rows(decoder):
    engine = core(decoder, max_batch_size=8, priority_reserved_slots=1, background_rows_with_live=2,
                  live_grace_s=3600)
    live = seq(0, max_tokens=64)
    engine.add(live)
    for _ in range(6):
        engine.add(seq(1, max_tokens=64))
    engine.step()
    assert live in engine.running and background_rows(engine) == 2 and len(engine.waiting) == 4
    engine.step()
    assert background_rows(engine) == 2, "no more background rows while the live request runs"


def test_without_live_work_background_work_fills_the_batch(decoder):
    engine = core(decoder, max_batch_size=8, priority_reserved_slots=1, background_rows_with_live=2)
    for _ in range(8):
        engine.add(seq(1, max_tokens=64))
    engine.step()
    assert background_rows(engine) == 7, "all but the reserved row"


@pytest.mark.parametrize("grace_s, rows_after", [(0, 6), (3600, 2)], ids=["lifts-after-grace", "stays-within-grace"])
def test_the_bound_lifts_only_once_live_work_is_gone_for_the_grace_time(decoder, grace_s, rows_after):
    """A client's next live request usually comes within the grace time: the bound stays on between them."""
    engine = core(decoder, max_batch_size=8, background_rows_with_live=2, live_grace_s=grace_s)
    engine.add(seq(0, max_tokens=1))
    for _ in range(6):
        engine.add(seq(1, max_tokens=64))
    engine.step()
    assert background_rows(engine) == 2
    engine.step()  # the live request finished in the first step
    assert background_rows(engine) == rows_after


def test_while_live_work_runs_background_prefill_is_held_to_its_tokens(decoder):
    engine = core(decoder, max_batch_size=8, background_prefill_tokens_with_live=4, live_grace_s=3600)
    engine.add(seq(0, max_tokens=64))
    for _ in range(4):
        engine.add(seq(1, max_tokens=64))  # 3 prompt tokens each: one fits 4, two do not
    engine.step()
    assert background_rows(engine) == 1
    engine.step()
    assert background_rows(engine) == 2


def test_the_live_bounds_must_not_be_negative():
    with pytest.raises(ValueError, match="background_rows_with_live"):
        SchedulerConfig(background_rows_with_live=-1)


def decoded(out: StepOutput) -> bool:
    return any(isinstance(e, Decoded) for e in out.events)


def test_while_live_work_runs_background_prefill_and_the_decode_take_turns(decoder):
    engine = core(decoder, max_batch_size=8, background_rows_with_live=2, live_grace_s=3600)
    engine.add(seq(0, max_tokens=64))
    assert decoded(engine.step())
    engine.add(seq(1, max_tokens=64))
    assert not decoded(engine.step()), "the background line's prefill is a step of its own"
    engine.add(seq(1, max_tokens=64))
    assert decoded(engine.step()), "never two prefill steps in a row: the decode goes on"


def test_without_live_work_background_prefill_and_the_decode_share_a_step(decoder):
    engine = core(decoder, max_batch_size=8, background_rows_with_live=2, live_grace_s=3600)
    engine.add(seq(1, max_tokens=64))
    engine.step()
    engine.add(seq(1, max_tokens=64))
    assert decoded(engine.step())
