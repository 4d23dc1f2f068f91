"""What the user-facing models (`ensemble`, `ensemble_unary`) do with the llm model's token stream: incremental
detokenization, stop strings matched on the generated text, streaming or one final answer, and cancellation that
reaches the llm model."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from python_backend.detokenizer import Decode, IncrementalDetokenizer
from python_backend.periodic import Periodic

# The ensemble's inputs, passed on to preprocessing as they came.
USER_INPUTS = ("text_input", "max_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty",
               "end_id", "apply_chat_template", "stop_words")


@dataclass
class Delta:
    text: str
    token_count: int
    finished: bool


class StopStrings:
    """Cuts the generated text just before the first occurrence of any stop string, wherever the token boundaries
    fall. Text that could still turn out to begin a stop string (the longest suffix that is a prefix of one) is
    held back until the next text decides it, so nothing sent ever has to be taken back."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(s for s in stop if s)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Adds generated text; returns (the text now safe to send, whether a stop string was found). After a
        match the text returned ends just before the stop string, and nothing more should be pushed."""
        self.held += text
        match = self._first_match()
        if match is not None:
            ready, self.held = self.held[:match], ""
            return ready, True
        cut = len(self.held) - self._longest_partial_match()
        ready, self.held = self.held[:cut], self.held[cut:]
        return ready, False

    def flush(self) -> str:
        """The held-back text, for the end of a generation that found no stop string."""
        held, self.held = self.held, ""
        return held

    def _first_match(self) -> int | None:
        found = [at for at in (self.held.find(s) for s in self.stop) if at >= 0]
        return min(found, default=None)

    def _longest_partial_match(self) -> int:
        longest = max((len(s) for s in self.stop), default=0)
        for length in range(min(len(self.held), longest - 1), 0, -1):
            suffix = self.held[-length:]
            if any(s.startswith(suffix) for s in self.stop):
                return length
        return 0


def text_deltas(
    chunks: Iterable[tuple[list[int], bool]],
    decode: Decode,
    stream: bool,
    is_cancelled: Callable[[], bool] = lambda: False,
    cancel: Callable[[], None] = lambda: None,
    stop: Sequence[str] = (),
) -> Iterator[Delta]:
    """Turns (new token ids, finished) chunks into text, ended before the first stop string.

    stream: one Delta per chunk that completes some text (and always a final one); otherwise one final Delta.
    ``token_count`` is the number of tokens consumed since the previous Delta.
    When a stop string appears before the llm model has finished, ``cancel()`` is called once, then the final
    Delta is yielded. When ``is_cancelled()`` turns true, ``cancel()`` is called once and nothing more is yielded.
    Either way the remaining chunks are still consumed, so the llm model's stream ends cleanly."""
    detokenizer = IncrementalDetokenizer(decode)
    stops = StopStrings(stop)
    pieces: list[str] = []  # text not yet yielded
    pending_tokens = 0
    answering = True  # false once the answer is complete or its client went away: the rest is only drained
    for ids, finished in chunks:
        if answering and is_cancelled():
            cancel()
            answering = False
        if answering:
            pending_tokens += len(ids)
            text, stopped = _sendable_text(detokenizer, stops, ids, finished)
            pieces.append(text)
            if stopped and not finished:
                cancel()
            if stopped or finished:
                yield Delta("".join(pieces), pending_tokens, True)
                answering = False
            elif stream and text:
                yield Delta("".join(pieces), pending_tokens, False)
                pieces, pending_tokens = [], 0
        if finished:
            return


def _sendable_text(detokenizer: IncrementalDetokenizer, stops: StopStrings, ids: list[int], finished: bool):
    """(the chunk's text that can be sent now, whether it ended at a stop string)."""
    text, stopped = stops.push(detokenizer.push(list(ids)) + (detokenizer.flush() if finished else ""))
    if finished and not stopped:
        text += stops.flush()
    return text, stopped


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
        self._poller = Periodic("cancellation-watch", interval_s, self.poll)

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
        self._poller.start()

    def stop(self) -> None:
        self._poller.stop()
