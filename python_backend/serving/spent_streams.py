"""The front model's finished BLS response streams, released only once Triton 2.51's stub has let go of them.

In Triton 2.51's Python backend (release 24.10) a decoupled BLS call's response iterator has two owners: the model's
Python object and the stub's own table of streams. The stub drops its entry on a thread of its own, without the GIL,
when it serves the clean-up message that the iterator queued on receiving its last response. Whichever owner lets go
last destroys the iterator, with every response it received and the numpy arrays of their tensors. When that is the
stub's thread, Python objects are freed without the GIL while the model's other threads allocate: a corrupted heap,
which shows later as a segfault or an abort (`malloc(): unaligned fastbin chunk detected`). With four requests at a
time the front's stub died 4 times in 2,132 rounds (`python -m scripts.bench.front_stress`).
python_backend fixed it after 24.10 (its tensors take the GIL to free their arrays: commit b771f4f, 24.12).

One stub thread serves that clean-up message and every cancellation check (`is_cancelled()`) from one queue, in
order. So a finished stream is held here, and released only after a cancellation check that entered the queue after
the stream's clean-up message has been answered: by then the stub's entry is gone, and the release, on a Python
thread holding the GIL, destroys the iterator."""

from __future__ import annotations

import threading
from typing import Callable, Iterable


class SpentStreams:
    def __init__(self):
        self._held: list[object] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(self, stream: object) -> None:
        """Keeps a stream whose last response has been read (its clean-up message is queued by then)."""
        with self._lock:
            self._held.append(stream)

    def release(self, checks: Iterable[Callable[[], bool]]) -> int:
        """Releases the streams held so far once one of ``checks`` (the cancellation checks of requests in flight,
        tried lazily in turn) is known to have made a round trip through the stub's queue; returns how many.

        A check answering True proves nothing: a cancelled request's answer is cached, and a closed request asks
        nothing. One answering False either asked the stub itself or waited for a check already under way, which
        may have entered the queue before these streams' clean-up; asking it once more waits, at the latest, for a
        check that entered the queue after that answer. With no such check the streams stay held for the next
        call."""
        with self._lock:
            spent, self._held = self._held, []
        if not spent:
            return 0
        for is_cancelled in checks:
            if not is_cancelled():
                is_cancelled()
                released = len(spent)
                spent.clear()  # the last references: each iterator is destroyed here, with the GIL
                return released
        with self._lock:
            self._held[:0] = spent
        return 0

    def drop_all(self) -> int:
        """At unload, with no request left to ask: lets every held stream go while the stub still runs (Python's
        collection at exit would destroy them after the stub's shared memory is gone: a segfault on the way out).
        Their clean-up messages were queued when their requests ended, before Triton unloads the model."""
        with self._lock:
            spent, self._held = self._held, []
        return len(spent)
