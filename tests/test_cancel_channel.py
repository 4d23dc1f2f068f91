"""The front model's cancellations to the llm model over local datagram sockets
(python_backend/serving/cancel_channel.py), with real sockets in a temporary runtime folder."""

import socket
import threading

from python_backend.serving.cancel_channel import CancelListener, CancelSender
from tests.helpers import wait_for


class Received:
    def __init__(self):
        self.keys: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, key: str) -> None:
        with self._lock:
            self.keys.append(key)


def test_every_key_sent_reaches_each_instance_of_the_model_and_no_other(tmp_path):
    first, second, other = Received(), Received(), Received()
    listeners = [CancelListener("llm_0_0", first, tmp_path), CancelListener("llm_0_1", second, tmp_path),
                 CancelListener("llm_draft_0_0", other, tmp_path)]
    for listener in listeners:
        listener.start()
    sender = CancelSender("llm", tmp_path)
    try:
        keys = [f"key-{i}" for i in range(200)]
        threads = [threading.Thread(target=lambda k=k: sender(k)) for k in keys]  # as the front's request threads
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wait_for(lambda: len(first.keys) == len(second.keys) == len(keys), timeout_s=30)
        assert sorted(first.keys) == sorted(second.keys) == sorted(keys)
        assert other.keys == [], "llm_draft is another model"
    finally:
        sender.close()
        for listener in listeners:
            listener.stop()


def test_with_no_instance_listening_a_cancel_reaches_none_and_does_not_raise(tmp_path):
    sender = CancelSender("llm", tmp_path / "absent")
    assert sender("k") == 0
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a socket left by a killed process: nobody reads it
    stale.bind(str(tmp_path / "llm_0_0.cancel"))
    stale.close()
    assert CancelSender("llm", tmp_path)("k") == 0


def test_a_reloaded_instance_keeps_its_socket_when_the_one_it_replaces_stops(tmp_path):
    """Triton starts a reloaded model's new instance before it stops the old one, under the same instance name."""
    old, new = Received(), Received()
    before = CancelListener("llm_0_0", old, tmp_path)
    before.start()
    after = CancelListener("llm_0_0", new, tmp_path)
    after.start()
    before.stop()
    sender = CancelSender("llm", tmp_path)
    try:
        assert sender("k") == 1
        wait_for(lambda: new.keys == ["k"], timeout_s=30)
        assert old.keys == []
    finally:
        after.stop()
    assert not (tmp_path / "llm_0_0.cancel").exists() and sender("k2") == 0


def test_a_cancel_that_raises_in_the_engine_does_not_stop_the_listening(tmp_path):
    received = Received()

    def on_cancel(key):
        if key == "bad":
            raise RuntimeError("no such sequence")
        received(key)

    listener = CancelListener("llm_0_0", on_cancel, tmp_path)
    listener.start()
    sender = CancelSender("llm", tmp_path)
    try:
        sender("bad")
        sender("good")
        wait_for(lambda: received.keys == ["good"], timeout_s=30)
    finally:
        listener.stop()
        sender.close()
