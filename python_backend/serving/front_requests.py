"""The front model's book of the client requests it is serving.

Bounded: beyond ``limit`` requests a new one is refused at once (503 / UNAVAILABLE) instead of queueing without
bound. And ended together: when the llm model's process dies, Triton never ends the BLS streams that wait on it, so
the front's watchdog fails every request it holds with a clear error and lets the blocked threads be."""

from __future__ import annotations

import threading
from typing import Callable, Iterator

from python_backend.errors import UnavailableError
from python_backend.serving.periodic import Periodic


class Reply:
    """One request's response channel. It sends at most one final response, whichever thread (the request's own,
    or the watchdog) gets there first; nothing is sent or asked after it."""

    def __init__(self, send: Callable[[object, bool], None], is_cancelled: Callable[[], bool],
                 on_final: Callable[[], None] = lambda: None,
                 error_response: Callable[[Exception], object] = lambda error: error):
        self._send, self._is_cancelled, self._on_final = send, is_cancelled, on_final
        self._error_response = error_response  # this request's error response for an exception
        self._send_lock = threading.Lock()  # one send at a time, so the final one is last
        self._state_lock = threading.Lock()  # guards `closed`; never held while on_final runs (it takes other locks)
        self.closed = False

    def send(self, response, final: bool = False) -> bool:
        """False when the request was already answered (then nothing is sent)."""
        with self._send_lock:
            with self._state_lock:
                if self.closed:
                    return False
                self.closed = final
            if final:
                self._on_final()
            self._send(response, final)
            return True

    def fail(self, error: Exception) -> bool:
        """Ends the request with this error, if it was not answered yet."""
        return self.send(self._error_response(error), final=True)

    def is_cancelled(self) -> bool:
        """The client went away, or the request was answered already: either way, stop working on it."""
        with self._state_lock:
            return self.closed or self._is_cancelled()


class InFlight:
    def __init__(self, limit: int):
        self.limit = limit
        self._replies: dict[str, Reply] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._replies)

    def admit(self, key: str, reply: Reply) -> None:
        with self._lock:
            if len(self._replies) >= self.limit:
                raise UnavailableError(
                    f"the server is serving {self.limit} requests, its limit (max_concurrent_requests); retry later")
            self._replies[key] = reply

    def release(self, key: str) -> None:
        with self._lock:
            self._replies.pop(key, None)

    def cancellation_checks(self) -> Iterator[Callable[[], bool]]:
        """The held requests' cancellation checks, in turn (a closed one answers True without asking)."""
        with self._lock:
            replies = list(self._replies.values())
        return (reply.is_cancelled for reply in replies)

    def fail_all(self, error: Exception) -> int:
        """Ends every held request with this error; returns how many were still unanswered."""
        with self._lock:
            replies, self._replies = list(self._replies.values()), {}
        return sum(reply.fail(error) for reply in replies)


class Watchdog(Periodic):
    """Every ``interval_s`` while ``busy()`` (requests in flight): when ``problem()`` names one, ``on_problem(problem)``
    (which fails the requests in flight). An idle front asks nothing: ``problem()`` reads every llm instance's
    heartbeat file, and an idle server asking it four times a second spent half a percent to one percent of a core
    on it (``python -m scripts.bench.idle_server``). A new request is checked as it is admitted."""

    def __init__(self, problem: Callable[[], str | None], on_problem: Callable[[str], None],
                 busy: Callable[[], bool] = lambda: True, interval_s: float = 0.25):
        super().__init__("llm-watchdog", interval_s, self.check)
        self.problem, self.on_problem, self.busy = problem, on_problem, busy

    def check(self) -> None:
        if not self.busy():
            return
        problem = self.problem()
        if problem:
            self.on_problem(problem)


def llm_unavailable(problem: str) -> UnavailableError:
    return UnavailableError(f"the llm model is not running ({problem}); the request was not completed. "
                            "The server is restarting it: retry in a few seconds")
