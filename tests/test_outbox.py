"""The outbox runs callbacks in order on its own thread, survives a failing one, and loses none at close."""

import threading

from python_backend.engine.outbox import Outbox


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


def test_a_full_outbox_makes_the_producer_wait_instead_of_growing():
    outbox, release, done = Outbox(capacity=2), threading.Event(), []
    outbox.put(release.wait)  # the outbox thread blocks on this one

    def produce():
        for value in range(5):
            outbox.put(done.append, value)

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(timeout=1.0)
    assert producer.is_alive() and done == [], "the producer waits while 2 callbacks are queued"
    release.set()
    producer.join(timeout=30)
    outbox.close()
    assert done == list(range(5))
