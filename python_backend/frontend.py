"""What the user-facing models (`ensemble`, `ensemble_unary`) do with the llm model's token stream: incremental
detokenization, streaming or one final answer, and cancellation that reaches the llm model."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from python_backend.detokenizer import Decode, IncrementalDetokenizer

# The ensemble's inputs, passed on to preprocessing as they came.
USER_INPUTS = ("text_input", "max_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty",
               "end_id", "apply_chat_template", "stop_words")


@dataclass
class Delta:
    text: str
    token_count: int
    finished: bool


def text_deltas(
    chunks: Iterable[tuple[list[int], bool]],
    decode: Decode,
    stream: bool,
    is_cancelled: Callable[[], bool] = lambda: False,
    cancel: Callable[[], None] = lambda: None,
) -> Iterator[Delta]:
    """Turns (new token ids, finished) chunks into text.

    stream: one Delta per chunk that completes some text (and always a final one); otherwise one final Delta.
    When ``is_cancelled()`` turns true, ``cancel()`` is called once and nothing more is yielded; the remaining
    chunks are still consumed, so the llm model's stream ends cleanly."""
    detokenizer = IncrementalDetokenizer(decode)
    pieces: list[str] = []
    pending_tokens = 0
    cancelled = False
    for ids, finished in chunks:
        if not cancelled and is_cancelled():
            cancel()
            cancelled = True
        if cancelled:
            continue
        text = detokenizer.push(list(ids)) + (detokenizer.flush() if finished else "")
        pending_tokens += len(ids)
        if stream:
            if text or finished:
                yield Delta(text, pending_tokens, finished)
                pending_tokens = 0
        else:
            pieces.append(text)
            if finished:
                yield Delta("".join(pieces), pending_tokens, True)
        if finished:
            return


class CancellationWatch:
    """Tells the llm model about clients that went away while their request still waits in its queue: such a
    request gets no token, so the per-token check in ``text_deltas`` cannot see it. Once a request has started
    streaming, that per-token check takes over and the watch stops asking (each ask is a round trip to the
    server). Each key is cancelled at most once."""

    def __init__(self, send_cancel: Callable[[str], None], interval_s: float = 0.1):
        self.send_cancel, self.interval_s = send_cancel, interval_s
        self._active: set[str] = set()  # cancellable, not yet cancelled
        self._waiting: dict[str, Callable[[], bool]] = {}  # polled: no token yet
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def add(self, key: str, is_cancelled: Callable[[], bool]) -> None:
        with self._lock:
            self._active.add(key)
            self._waiting[key] = is_cancelled

    def started(self, key: str) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def remove(self, key: str) -> None:
        """Call before the request's final response: a sender must not be asked anything after it."""
        with self._lock:  # waits for a poll in progress, which may be asking this key's sender
            self._active.discard(key)
            self._waiting.pop(key, None)

    def cancel(self, key: str) -> None:
        with self._lock:
            if key not in self._active:
                return
            self._active.discard(key)
            self._waiting.pop(key, None)
        self.send_cancel(key)

    def poll(self) -> None:
        with self._lock:
            gone = [key for key, is_cancelled in self._waiting.items() if is_cancelled()]
            for key in gone:
                self._active.discard(key)
                del self._waiting[key]
        for key in gone:
            self.send_cancel(key)

    def start(self) -> None:
        def loop():
            while not self._stopped.wait(self.interval_s):
                try:
                    self.poll()
                except Exception as error:  # noqa: BLE001 - the watch must outlive one failed cancel
                    print(f"cancellation watch: {error}", flush=True)

        threading.Thread(target=loop, name="cancellation-watch", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
