"""The outbox runs callbacks in order on its own thread, survives a failing one, and loses none at close."""

import threading

from python_backend.outbox import Outbox


def test_runs_callbacks_in_order_on_its_own_thread_and_survives_a_failure(capsys):
    outbox, seen, threads = Outbox("test"), [], set()

    def record(value):
        threads.add(threading.current_thread().name)
        seen.append(value)

    def fail():
        raise RuntimeError("client gone")

    for value in range(50):
        outbox.put(record, value)
        if value == 10:
            outbox.put(fail)
    outbox.close()
    assert seen == list(range(50))
    assert threads == {"test"}
    assert "client gone" in capsys.readouterr().err


def test_after_close_a_callback_runs_in_place_instead_of_being_lost():
    outbox, seen = Outbox(), []
    outbox.close()
    outbox.put(seen.append, "late")
    assert seen == ["late"]
