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
    assert sender.send("k") == 0
    sender.close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a socket left by a killed process: nobody reads it
    stale.bind(str(tmp_path / "llm_0_0.cancel"))
    stale.close()
    sender = CancelSender("llm", tmp_path)
    assert sender.send("k") == 0
    sender.close()


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
        assert sender.send("k") == 1
        wait_for(lambda: new.keys == ["k"], timeout_s=30)
        assert old.keys == []
    finally:
        after.stop()
    assert not (tmp_path / "llm_0_0.cancel").exists() and sender.send("k2") == 0
    sender.close()


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


def test_a_burst_beyond_the_listener_s_queue_never_blocks_the_callers_and_loses_no_key(tmp_path):
    """A listener holds only a few datagrams (net.unix.max_dgram_qlen, 10 here): the front's request threads must
    not wait on it, and every key still arrives once it reads again."""
    received, reading = Received(), threading.Event()

    def on_cancel(key):
        reading.wait()  # the llm's listener busy: its queue fills
        received(key)

    listener = CancelListener("llm_0_0", on_cancel, tmp_path)
    listener.start()
    sender = CancelSender("llm", tmp_path)
    try:
        keys = [f"key-{i}" for i in range(100)]
        threads = [threading.Thread(target=sender, args=(key,)) for key in keys]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), "a caller waited on the listener"
        assert received.keys == []
        reading.set()
        wait_for(lambda: len(received.keys) == len(keys), timeout_s=60)
        assert sorted(received.keys) == sorted(keys)
    finally:
        reading.set()
        listener.stop()
        sender.close()


def test_a_runtime_folder_too_long_for_a_socket_leaves_the_model_serving_without_cancels(tmp_path, capsys):
    folder = tmp_path / ("x" * 120)
    listener = CancelListener("llm_0_0", Received(), folder)
    listener.start()  # no exception: the model loads
    listener.stop()
    assert "too long for a socket" in capsys.readouterr().out
    sender = CancelSender("llm", folder)
    assert sender.send("k") == 0
    sender.close()
