"""The front's finished BLS streams are let go only after a cancellation check that made a round trip through the
stub's queue after them (python_backend/serving/spent_streams.py); the crash it prevents is reproduced by
`python -m scripts.bench.front_stress` against a real server."""

import gc
import weakref

from python_backend.serving.spent_streams import SpentStreams


class Stream:
    """Stands in for a BLS response iterator: all SpentStreams does with one is hold it and let it go."""


def held_streams(spent, count):
    streams = [Stream() for _ in range(count)]
    for stream in streams:
        spent.hold(stream)
    return [weakref.ref(stream) for stream in streams]


def alive(refs):
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_streams_stay_held_without_a_check_that_asked_the_stub():
    spent = SpentStreams()
    refs = held_streams(spent, 3)
    assert spent.release([]) == 0, "no request in flight: nothing proves the stub let go"
    assert spent.release([lambda: True, lambda: True]) == 0, "cancelled or closed requests do not ask the stub"
    assert alive(refs) == 3 and len(spent) == 3


def test_a_check_answering_false_is_asked_again_then_the_streams_are_let_go():
    spent, asked = SpentStreams(), []
    refs = held_streams(spent, 3)

    def is_cancelled():
        asked.append(alive(refs))
        return False

    assert spent.release([is_cancelled]) == 3
    assert asked == [3, 3], "asked twice, the streams held throughout: the first answer may predate their clean-up"
    assert alive(refs) == 0 and len(spent) == 0


def test_the_checks_are_tried_in_turn_and_only_until_one_asked_the_stub():
    spent, asked = SpentStreams(), []
    held_streams(spent, 1)
    checks = (lambda name=name, answer=answer: asked.append(name) or answer
              for name, answer in [("cancelled", True), ("in flight", False), ("unused", False)])
    assert spent.release(checks) == 1
    assert asked == ["cancelled", "in flight", "in flight"]


def test_a_stream_held_during_a_release_waits_for_the_next_one():
    spent = SpentStreams()
    first = held_streams(spent, 2)
    late = []

    def is_cancelled():
        if not late:
            late.extend(held_streams(spent, 1))
        return False

    assert spent.release([is_cancelled]) == 2
    assert alive(first) == 0 and alive(late) == 1 and len(spent) == 1
    assert spent.release([lambda: False]) == 1 and alive(late) == 0


def test_nothing_held_asks_nothing():
    asked = []
    assert SpentStreams().release([lambda: asked.append(1) or False]) == 0
    assert asked == []


def test_at_unload_every_held_stream_is_let_go():
    spent = SpentStreams()
    refs = held_streams(spent, 2)
    assert spent.drop_all() == 2 and alive(refs) == 0 and len(spent) == 0
