"""The front model's in-flight book: bounded admission, one final response per request, failing them all."""

import threading

import pytest

from python_backend.errors import UnavailableError
from python_backend.serving.front_requests import InFlight, Reply, Watchdog


def recording_reply(log, key="k", cancelled=lambda: False, on_final=lambda: None):
    return Reply(lambda response, final: log.append((key, response, final)), cancelled, on_final)


def test_admission_is_bounded_and_a_released_slot_is_reused():
    book, log = InFlight(limit=2), []
    book.admit("a", recording_reply(log))
    book.admit("b", recording_reply(log))
    with pytest.raises(UnavailableError, match="serving 2 requests, its limit"):
        book.admit("c", recording_reply(log))
    book.release("a")
    book.admit("c", recording_reply(log))
    assert len(book) == 2


def test_a_reply_sends_one_final_response_and_nothing_after_it():
    log, finals = [], []
    reply = recording_reply(log, on_final=lambda: finals.append(len(log)))
    assert reply.send("data") and reply.send("last", final=True)
    assert not reply.send("late data") and not reply.send("late error", final=True)
    assert log == [("k", "data", False), ("k", "last", True)]
    assert finals == [1], "on_final runs once, before the final response is sent"


def test_a_closed_reply_no_longer_asks_its_sender_about_cancellation():
    asked = []
    reply = Reply(lambda *_: None, lambda: asked.append(1) or False)
    assert reply.is_cancelled() is False and asked == [1]
    reply.send(None, final=True)
    assert reply.is_cancelled() is True and asked == [1]


def test_fail_all_answers_every_unanswered_request_once():
    book, log = InFlight(limit=8), []
    replies = {key: recording_reply(log, key) for key in "abc"}
    for key, reply in replies.items():
        book.admit(key, reply)
    replies["b"].send("done", final=True)  # answered meanwhile (its release would come from on_final)
    assert book.fail_all("llm died") == 2
    assert sorted(k for k, r, final in log if r == "llm died" and final) == ["a", "c"]
    assert len(book) == 0 and book.fail_all("again") == 0


def test_on_final_may_take_a_lock_that_a_concurrent_cancellation_poll_holds():
    """The front's cancellation watch holds its lock while it asks a reply; a final send must not deadlock."""
    watch_lock = threading.Lock()
    reply = Reply(lambda *_: None, lambda: False, on_final=lambda: watch_lock.acquire() and watch_lock.release())
    polls = threading.Event()

    def poll_forever():
        for _ in range(2000):
            with watch_lock:
                reply.is_cancelled()
        polls.set()

    poller, sender = threading.Thread(target=poll_forever, daemon=True), threading.Thread(
        target=reply.send, args=("x", True), daemon=True)
    poller.start()
    sender.start()
    sender.join(timeout=60)
    assert not sender.is_alive() and polls.wait(timeout=60), "deadlock between the final send and the poll"


def test_the_watchdog_reports_a_problem_only_when_there_is_one():
    problems, seen = [None, "llm_0_0: process 7 is gone"], []
    dog = Watchdog(lambda: problems.pop(0), seen.append)
    dog.check()
    dog.check()
    assert seen == ["llm_0_0: process 7 is gone"]


def test_an_idle_watchdog_asks_nothing_and_a_busy_one_reports_the_problem():
    asked, seen, in_flight = [], [], []

    def problem():
        asked.append(1)
        return "llm_0_0: process 7 is gone"

    dog = Watchdog(problem, seen.append, busy=lambda: bool(in_flight))
    dog.check()
    assert asked == [] and seen == []
    in_flight.append("request")
    dog.check()
    assert seen == ["llm_0_0: process 7 is gone"]
